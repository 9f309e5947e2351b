package cpu

// matJob multiplies one activation batch x [n][in] by up to four weight
// matrices ([rows][in] each) sharing it. Threads take fixed ranges of 4-row
// blocks over all matrices; every (row, token) dot product is computed by
// the same kernel with the same reduction order whoever computes it, so
// results do not depend on the batch or the thread count.
type matJob struct {
	x     []float32
	n, in int
	mats  [4]mat
	nm    int
	parts int
}

type mat struct {
	w    []float32
	rows int
	out  []float32 // [n][rows]
	bias []float32
}

func (j *matJob) set(x []float32, n, in int) { j.x, j.n, j.in, j.nm = x, n, in, 0 }

func (j *matJob) add(w []float32, rows int, out, bias []float32) {
	j.mats[j.nm] = mat{w: w, rows: rows, out: out, bias: bias}
	j.nm++
}

// blocks is the number of 4-row blocks over all matrices.
func (j *matJob) blocks() int {
	b := 0
	for _, m := range j.mats[:j.nm] {
		b += (m.rows + 3) / 4
	}
	return b
}

// plan sets the number of parts for tm.
func (j *matJob) plan(tm *team) int {
	j.parts = tm.parts(j.blocks() * 4 * j.in * j.n)
	return j.parts
}

// run computes part k's blocks: per block of rows (kept in L1), all
// tokens, through the microkernels in tiles of up to 4 or 8 rows by 3 tokens.
func (j *matJob) run(k int) {
	lo, hi := span(k, j.parts, j.blocks())
	base := 0
	for mi := range j.mats[:j.nm] {
		m := &j.mats[mi]
		nb := (m.rows + 3) / 4
		a, z := max(lo-base, 0), min(hi-base, nb)
		for blk := a; blk < z; {
			r0 := blk * 4
			switch {
			case blk+1 < z && r0+8 <= m.rows:
				matRows(m.w, j.in, j.x, j.n, m.out, m.rows, r0, 8)
				blk += 2
			case r0+4 <= m.rows:
				matRows(m.w, j.in, j.x, j.n, m.out, m.rows, r0, 4)
				blk++
			default:
				matRows(m.w, j.in, j.x, j.n, m.out, m.rows, r0, m.rows-r0)
				blk++
			}
		}
		base += nb
	}
}

// matRows computes rows r0..r0+nr-1 (nr = 8, 4 or fewer) of w [rows][in]
// times x [n][in] into out [n][rows].
func matRows(w []float32, in int, x []float32, n int, out []float32, rows, r0, nr int) {
	_ = w[(r0+nr)*in-1]
	_ = x[n*in-1]
	_ = out[(n-1)*rows+r0+nr-1]
	if !hasAVX2 {
		for r := r0; r < r0+nr; r++ {
			for t := 0; t < n; t++ {
				out[t*rows+r] = dotLanes(w[r*in:(r+1)*in], x[t*in:(t+1)*in])
			}
		}
		return
	}
	if nr < 4 {
		for r := r0; r < r0+nr; r++ {
			for t := 0; t < n; t++ {
				gemm1x1(&w[r*in], in, &x[t*in], in, in, &out[t*rows+r], rows)
			}
		}
		return
	}
	for g := 0; g < nr; g += 4 {
		r := r0 + g
		t := 0
		for ; t+3 <= n; t += 3 {
			gemm4x3(&w[r*in], in, &x[t*in], in, in, &out[t*rows+r], rows)
		}
		if n-t == 2 {
			gemm4x2(&w[r*in], in, &x[t*in], in, in, &out[t*rows+r], rows)
		}
	}
	if n%3 == 1 {
		t := n - 1
		if nr == 8 {
			gemm8x1(&w[r0*in], in, &x[t*in], in, in, &out[t*rows+r0], rows)
		} else {
			gemm4x1(&w[r0*in], in, &x[t*in], in, in, &out[t*rows+r0], rows)
		}
	}
}

// dotLanes is the microkernels' reduction order in plain Go (without fused
// multiply-adds, so deterministic but not bit-equal to the assembly).
func dotLanes(a, b []float32) float32 {
	n := len(a)
	b = b[:n]
	var acc [8]float32
	for i := 0; i < n; i++ {
		acc[i%8] += a[i] * b[i]
	}
	return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

// bias adds each matrix's bias to its outputs.
func (j *matJob) bias() {
	for _, m := range j.mats[:j.nm] {
		if m.bias == nil {
			continue
		}
		for t := 0; t < j.n; t++ {
			addTo(m.out[t*m.rows:(t+1)*m.rows], m.bias)
		}
	}
}
