package cpu

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

func randVec(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64())
	}
	return v
}

func dot64(a, b []float32) float64 {
	s := 0.0
	for i := range a {
		s += float64(a[i]) * float64(b[i])
	}
	return s
}

func TestDotKernels(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for n := 1; n < 300; n += 1 + n/16 {
		stride := n + r.IntN(5)
		w := randVec(r, 3*stride+n)
		x := randVec(r, n)
		var got [4]float32
		dotRows4(w, stride, x, n, got[:])
		for row := 0; row < 4; row++ {
			wr := w[row*stride : row*stride+n]
			one := dot(wr, x)
			if math.Float32bits(one) != math.Float32bits(got[row]) {
				t.Fatalf("n=%d row %d: dotRows4 %v != dot %v", n, row, got[row], one)
			}
			want := dot64(wr, x)
			tol := 1e-5 * math.Sqrt(float64(n)) * 4
			if math.Abs(float64(one)-want) > tol {
				t.Fatalf("n=%d: dot %v, want %v", n, one, want)
			}
			if g := dotGo(wr, x); math.Abs(float64(g)-want) > tol {
				t.Fatalf("n=%d: dotGo %v, want %v", n, g, want)
			}
		}
	}
}

func TestAttnKernels(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, hd := range []int{8, 12, 16, 64, 128} {
		for _, n := range []int{1, 3, 17} {
			stride := hd*2 + 8
			q := randVec(r, hd)
			k := randVec(r, (n-1)*stride+hd)
			sc := make([]float32, n)
			attnScores(q, k, stride, n, hd, sc)
			for j := range sc {
				want := dot64(q, k[j*stride:j*stride+hd])
				if math.Abs(float64(sc[j])-want) > 1e-4 {
					t.Fatalf("hd=%d n=%d: score %d = %v, want %v", hd, n, j, sc[j], want)
				}
			}
			out := randVec(r, hd)
			want := make([]float64, hd)
			for i := range want {
				want[i] = float64(out[i])
				for j := 0; j < n; j++ {
					want[i] += float64(sc[j]) * float64(k[j*stride+i])
				}
			}
			attnAccum(sc, k, stride, n, hd, out)
			for i := range out {
				if math.Abs(float64(out[i])-want[i]) > 1e-3 {
					t.Fatalf("hd=%d n=%d: accum[%d] = %v, want %v", hd, n, i, out[i], want[i])
				}
			}
		}
	}
}

func TestExpf(t *testing.T) {
	for x := -87.0; x < 88; x += 0.01 {
		got := float64(expf(float32(x)))
		want := math.Exp(float64(float32(x)))
		if math.Abs(got-want) > 3e-7*want {
			t.Fatalf("expf(%v) = %v, want %v", x, got, want)
		}
	}
	if expf(-100) != 0 || !math.IsInf(float64(expf(100)), 1) {
		t.Fatal("expf out of range")
	}
}

func TestSoftmaxSilu(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	for _, n := range []int{1, 5, 8, 9, 33, 200} {
		x := randVec(r, n+8)
		for i := range x {
			x[i] *= 10
		}
		want := make([]float64, n)
		mx := math.Inf(-1)
		for i := 0; i < n; i++ {
			mx = math.Max(mx, float64(x[i])/3)
		}
		sum := 0.0
		for i := range want {
			want[i] = math.Exp(float64(x[i])/3 - mx)
			sum += want[i]
		}
		softmax(x, n, 3)
		for i := range want {
			if d := math.Abs(float64(x[i]) - want[i]/sum); d > 1e-6 {
				t.Fatalf("n=%d: softmax[%d] = %v, want %v", n, i, x[i], want[i]/sum)
			}
		}
		g := randVec(r, n)
		u := randVec(r, n)
		g[0] = -100
		if n > 1 {
			g[1] = 100
		}
		w := make([]float64, n)
		for i := range w {
			w[i] = float64(g[i]) / (1 + math.Exp(-float64(g[i]))) * float64(u[i])
		}
		siluMul(g, u)
		for i := range w {
			if d := math.Abs(float64(g[i]) - w[i]); d > 1e-5*math.Max(1, math.Abs(w[i])) {
				t.Fatalf("n=%d: silu[%d] = %v, want %v", n, i, g[i], w[i])
			}
		}
	}
}

// TestGemmKernels checks that every microkernel gives each (row, token)
// the same bits as the 1x1 kernel, values close to float64, and that the
// bfloat16 and half kernels give the float32 kernels' bits on the widened
// weights.
func TestGemmKernels(t *testing.T) {
	if !hasAVX2 {
		t.Skip("no AVX2")
	}
	r := rand.New(rand.NewPCG(9, 10))
	for _, in := range []int{1, 7, 8, 9, 16, 64, 100, 172} {
		for _, n := range []int{1, 2, 3, 4, 5, 7} {
			for _, rows := range []int{1, 3, 4, 5, 8, 12, 13} {
				w := randVec(r, rows*in)
				x := randVec(r, n*in)
				f32 := wmat{dt: model.F32, f32: w, rows: rows, in: in, ld: in}
				got := mulAll(&f32, x, n)
				for row := 0; row < rows; row++ {
					for tk := 0; tk < n; tk++ {
						var one float32
						gemm1x1(&w[row*in], in, &x[tk*in], in, in, &one, 1)
						g := got[tk*rows+row]
						if math.Float32bits(one) != math.Float32bits(g) {
							t.Fatalf("in=%d n=%d rows=%d: (%d,%d) %v != 1x1 %v", in, n, rows, row, tk, g, one)
						}
						want := dot64(w[row*in:(row+1)*in], x[tk*in:(tk+1)*in])
						if math.Abs(float64(g)-want) > 1e-5*math.Sqrt(float64(in))*4 {
							t.Fatalf("in=%d: %v, want %v", in, g, want)
						}
						if d := dotRowGo(&f32, row, x[tk*in:(tk+1)*in]); math.Abs(float64(d)-want) > 1e-5*math.Sqrt(float64(in))*4 {
							t.Fatalf("in=%d: dotRowGo %v, want %v", in, d, want)
						}
					}
				}
				if in%8 != 0 {
					continue
				}
				for _, dt := range []model.DType{model.BF16, model.F16} {
					if dt == model.F16 && !hasF16C {
						continue
					}
					u := make([]uint16, len(w))
					wide := make([]float32, len(w))
					for i, v := range w {
						u[i], wide[i] = to16(dt, v)
					}
					h := wmat{dt: dt, u16: u, rows: rows, in: in, ld: in}
					g16 := mulAll(&h, x, n)
					g32 := mulAll(&wmat{dt: model.F32, f32: wide, rows: rows, in: in, ld: in}, x, n)
					if !sameBits(g16, g32) {
						t.Fatalf("%v in=%d n=%d rows=%d: 16-bit kernels differ from float32 on the widened weights", dt, in, n, rows)
					}
					for row := 0; row < rows; row++ {
						want := dot64(wide[row*in:(row+1)*in], x[:in])
						if d := dotRowGo(&h, row, x[:in]); math.Abs(float64(d)-want) > 1e-5*math.Sqrt(float64(in))*4 {
							t.Fatalf("%v in=%d: dotRowGo %v, want %v", dt, in, d, want)
						}
					}
				}
			}
		}
	}
}

// mulAll multiplies x [n][in] by w through matRows in 8-, 4- and smaller
// row groups, as a matJob would.
func mulAll(w *wmat, x []float32, n int) []float32 {
	out := make([]float32, n*w.rows)
	for r0 := 0; r0 < w.rows; {
		nr := w.rows - r0
		if nr >= 8 {
			nr = 8
		} else if nr >= 4 {
			nr = 4
		}
		matRows(w, x, n, out, r0, nr)
		r0 += nr
	}
	return out
}

// to16 rounds v to dt and returns its bits and its exact widening.
func to16(dt model.DType, v float32) (uint16, float32) {
	if dt == model.BF16 {
		h := model.F32ToBF16(v)
		return h, model.BF16ToF32(h)
	}
	h := model.F32ToF16(v)
	return h, model.F16ToF32(h)
}
