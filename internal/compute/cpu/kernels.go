package cpu

import "math"

// Kernels: dot products with a fixed reduction order (see kernels_amd64.s),
// in assembly where the CPU has AVX2 and FMA and in Go otherwise. The Go
// versions follow the same blocking but round each multiply and add
// separately, so they are deterministic but not bit-equal to the assembly.

// dot returns the dot product of a[:n] and b[:n], n = len(a).
func dot(a, b []float32) float32 {
	n := len(a)
	if n == 0 {
		return 0
	}
	_ = b[n-1]
	if hasAVX2 {
		return dot1AVX2(&a[0], &b[0], n)
	}
	return dotGo(a, b[:n])
}

// dotRows4 writes out[r] = dot(w[r*stride:r*stride+n], x[:n]) for r < 4.
func dotRows4(w []float32, stride int, x []float32, n int, out []float32) {
	_ = w[3*stride+n-1]
	_ = x[n-1]
	_ = out[3]
	if hasAVX2 {
		dotRows4AVX2(&w[0], stride, &x[0], n, &out[0])
		return
	}
	for r := 0; r < 4; r++ {
		out[r] = dotGo(w[r*stride:r*stride+n], x[:n])
	}
}

// attnScores writes out[j] = dot(q[:hd], k[j*stride:j*stride+hd]) for j < n.
func attnScores(q, k []float32, stride, n, hd int, out []float32) {
	if n == 0 {
		return
	}
	_ = k[(n-1)*stride+hd-1]
	_ = q[hd-1]
	_ = out[n-1]
	if hasAVX2 && hd%8 == 0 {
		attnScoresAVX2(&q[0], &k[0], stride, n, hd, &out[0])
		return
	}
	q = q[:hd]
	for j := 0; j < n; j++ {
		kj := k[j*stride : j*stride+hd]
		var s float32
		for i, v := range q {
			s += v * kj[i]
		}
		out[j] = s
	}
}

// attnAccum adds the sum of p[j] * v[j*stride:j*stride+hd] over j < n to
// out[:hd], in an order fixed by n.
func attnAccum(p, v []float32, stride, n, hd int, out []float32) {
	if n == 0 {
		return
	}
	_ = v[(n-1)*stride+hd-1]
	_ = p[n-1]
	_ = out[hd-1]
	if hasAVX2 && hd%8 == 0 {
		attnAccumAVX2(&p[0], &v[0], stride, n, hd, &out[0])
		return
	}
	out = out[:hd]
	for j := 0; j < n; j++ {
		pj := p[j]
		vj := v[j*stride : j*stride+hd]
		for i := range out {
			out[i] += pj * vj[i]
		}
	}
}

// dotGo is dot with the assembly's blocking, in plain Go.
func dotGo(a, b []float32) float32 {
	n := len(a)
	b = b[:n]
	var acc0, acc1 [8]float32
	i := 0
	for ; i+16 <= n; i += 16 {
		for l := 0; l < 8; l++ {
			acc0[l] += a[i+l] * b[i+l]
			acc1[l] += a[i+8+l] * b[i+8+l]
		}
	}
	if i+8 <= n {
		for l := 0; l < 8; l++ {
			acc0[l] += a[i+l] * b[i+l]
		}
		i += 8
	}
	for l := 0; l < 8; l++ {
		acc0[l] += acc1[l]
	}
	var h [4]float32
	for l := 0; l < 4; l++ {
		h[l] = acc0[l] + acc0[l+4]
	}
	s := (h[0] + h[2]) + (h[1] + h[3])
	for ; i < n; i++ {
		s += a[i] * b[i]
	}
	return s
}

// softmax replaces x[:n] by softmax(x[:n] / div). x must have room for n
// rounded up to 8 (the padding is overwritten).
func softmax(x []float32, n int, div float32) {
	if hasAVX2 {
		n8 := (n + 7) &^ 7
		pad := x[n:n8]
		for i := range pad {
			pad[i] = float32(math.Inf(-1))
		}
		softmaxAVX2(&x[0], n8, div)
		return
	}
	x = x[:n]
	mx := float32(math.Inf(-1))
	for j := range x {
		x[j] /= div
		mx = max(mx, x[j])
	}
	var sum float32
	for j, v := range x {
		e := expf(v - mx)
		x[j] = e
		sum += e
	}
	for j := range x {
		x[j] /= sum
	}
}

// siluMul sets g[i] = silu(g[i]) * u[i].
func siluMul(g, u []float32) {
	u = u[:len(g)]
	i := 0
	if hasAVX2 && len(g) >= 8 {
		i = len(g) &^ 7
		siluMulAVX2(&g[0], &u[0], i)
	}
	for ; i < len(g); i++ {
		g[i] = silu(g[i]) * u[i]
	}
}
