package cpu

import "github.com/mooncake-go/mooncake-go/internal/model"

// matJob multiplies activation batches by weight matrices: each entry is
// x [n][in] times w [rows][in] into out [n][rows]. Entries added after one
// set share its x (q, k and v; gate and up); a MoE layer adds one entry per
// expert with that expert's tokens. Threads take ranges of 4-row blocks
// balanced by work; every (row, token) dot product is computed with the same
// reduction order whoever computes it and whatever the tile, so results do
// not depend on the batch, the routing of other tokens or the thread count.
type matJob struct {
	mats  []mat
	x     []float32 // the current set
	n     int
	work  int // multiply-adds
	parts int
	_     [64]byte // threads' jobs sit side by side: keep them off each other's cache lines
}

type mat struct {
	w    *wmat
	x    []float32
	n    int
	out  []float32
	bias []float32
	work int // multiply-adds of one 4-row block
}

// set starts a group of entries over x [n][in] (dropping earlier entries
// when reset).
func (j *matJob) set(x []float32, n int) { j.x, j.n = x, n }

// reset empties the job.
func (j *matJob) reset() { j.mats, j.work = j.mats[:0], 0 }

// add multiplies the current x by w into out (plus bias when not nil).
func (j *matJob) add(w *wmat, out, bias []float32) {
	if j.n == 0 {
		return
	}
	m := mat{w: w, x: j.x, n: j.n, out: out, bias: bias, work: 4 * w.in * j.n}
	j.mats = append(j.mats, m)
	j.work += (w.rows + 3) / 4 * m.work
}

// plan sets the number of parts for tm.
func (j *matJob) plan(tm *team) int {
	j.parts = tm.parts(j.work)
	return j.parts
}

// run computes part k's blocks: those whose first multiply-add falls in
// its share of the work. Per block of rows (kept in L1), all tokens, through
// the microkernels in tiles of up to 4 or 8 rows by 3 tokens.
func (j *matJob) run(k int) {
	lo, hi := 0, j.work
	if j.parts > 1 {
		lo, hi = j.work*k/j.parts, j.work*(k+1)/j.parts
	}
	base := 0
	for mi := range j.mats {
		m := &j.mats[mi]
		nb := (m.rows() + 3) / 4
		// Blocks b with lo <= base + b*work < hi.
		a, z := 0, nb
		if j.parts > 1 {
			a = max(0, ceilDiv(lo-base, m.work))
			z = min(nb, ceilDiv(hi-base, m.work))
		}
		rows := m.rows()
		for blk := a; blk < z; {
			r0, nr := blk*4, 4
			switch {
			case blk+1 < z && r0+8 <= rows:
				nr = 8
				blk += 2
			case r0+4 <= rows:
				blk++
			default:
				nr = rows - r0
				blk++
			}
			if m.w.dt == model.F32 && hasAVX2 {
				matRows32(m.w.f32, m.w.in, m.w.ld, m.x, m.n, m.out, rows, r0, nr)
			} else {
				matRows(m.w, m.x, m.n, m.out, r0, nr)
			}
		}
		if m.bias != nil {
			// The bias goes on after the dot products of the part's rows.
			r0, r1 := min(a*4, m.rows()), min(z*4, m.rows())
			for t := 0; t < m.n; t++ {
				addTo(m.out[t*m.rows()+r0:t*m.rows()+r1], m.bias[r0:r1])
			}
		}
		base += nb * m.work
	}
}

func (m *mat) rows() int { return m.w.rows }

func ceilDiv(a, b int) int {
	if a <= 0 {
		return 0
	}
	return (a + b - 1) / b
}

// matRows computes rows r0..r0+nr-1 (nr = 8, 4 or fewer) of w times x
// [n][in] into out [n][rows].
func matRows(w *wmat, x []float32, n int, out []float32, r0, nr int) {
	in, ld, rows := w.in, w.ld, w.rows
	_ = x[n*in-1]
	_ = out[(n-1)*rows+r0+nr-1]
	if !hasAVX2 {
		for r := r0; r < r0+nr; r++ {
			for t := 0; t < n; t++ {
				out[t*rows+r] = dotRowGo(w, r, x[t*in:(t+1)*in])
			}
		}
		return
	}
	switch w.dt {
	case model.BF16:
		matRows16(w.u16, in, ld, x, n, out, rows, r0, nr, gemmBF)
	case model.F16:
		matRows16(w.u16, in, ld, x, n, out, rows, r0, nr, gemmHF)
	default:
		matRows32(w.f32, in, ld, x, n, out, rows, r0, nr)
	}
}

func matRows32(w []float32, in, ld int, x []float32, n int, out []float32, rows, r0, nr int) {
	_ = w[(r0+nr-1)*ld+in-1]
	if nr < 4 {
		for r := r0; r < r0+nr; r++ {
			for t := 0; t < n; t++ {
				gemm1x1(&w[r*ld], ld, &x[t*in], in, in, &out[t*rows+r], rows)
			}
		}
		return
	}
	for g := 0; g < nr; g += 4 {
		r := r0 + g
		t := 0
		for ; t+3 <= n; t += 3 {
			gemm4x3(&w[r*ld], ld, &x[t*in], in, in, &out[t*rows+r], rows)
		}
		if n-t == 2 {
			gemm4x2(&w[r*ld], ld, &x[t*in], in, in, &out[t*rows+r], rows)
		}
	}
	if n%3 == 1 {
		t := n - 1
		if nr == 8 {
			gemm8x1(&w[r0*ld], ld, &x[t*in], in, in, &out[t*rows+r0], rows)
		} else {
			gemm4x1(&w[r0*ld], ld, &x[t*in], in, in, &out[t*rows+r0], rows)
		}
	}
}

// gemm16 is the set of 16-bit weight kernels of one dtype.
type gemm16 struct {
	k4x3, k4x2, k4x1, k8x1, k1x1 func(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int)
}

var (
	gemmBF = &gemm16{gemm4x3bf, gemm4x2bf, gemm4x1bf, gemm8x1bf, gemm1x1bf}
	gemmHF = &gemm16{gemm4x3hf, gemm4x2hf, gemm4x1hf, gemm8x1hf, gemm1x1hf}
)

// matRows16 is matRows32 for 16-bit weights (in a multiple of 8).
func matRows16(w []uint16, in, ld int, x []float32, n int, out []float32, rows, r0, nr int, k *gemm16) {
	_ = w[(r0+nr-1)*ld+in-1]
	if nr < 4 {
		for r := r0; r < r0+nr; r++ {
			for t := 0; t < n; t++ {
				k.k1x1(&w[r*ld], ld, &x[t*in], in, in, &out[t*rows+r], rows)
			}
		}
		return
	}
	for g := 0; g < nr; g += 4 {
		r := r0 + g
		t := 0
		for ; t+3 <= n; t += 3 {
			k.k4x3(&w[r*ld], ld, &x[t*in], in, in, &out[t*rows+r], rows)
		}
		if n-t == 2 {
			k.k4x2(&w[r*ld], ld, &x[t*in], in, in, &out[t*rows+r], rows)
		}
	}
	if n%3 == 1 {
		t := n - 1
		if nr == 8 {
			k.k8x1(&w[r0*ld], ld, &x[t*in], in, in, &out[t*rows+r0], rows)
		} else {
			k.k4x1(&w[r0*ld], ld, &x[t*in], in, in, &out[t*rows+r0], rows)
		}
	}
}

// dotRowGo is the microkernels' reduction order in plain Go (without fused
// multiply-adds, so deterministic but not bit-equal to the assembly).
func dotRowGo(w *wmat, r int, x []float32) float32 {
	n := w.in
	x = x[:n]
	var acc [8]float32
	switch w.dt {
	case model.F32:
		row := w.f32[r*w.ld : r*w.ld+n]
		for i := 0; i < n; i++ {
			acc[i%8] += row[i] * x[i]
		}
	case model.BF16:
		row := w.u16[r*w.ld : r*w.ld+n]
		for i := 0; i < n; i++ {
			acc[i%8] += model.BF16ToF32(row[i]) * x[i]
		}
	default:
		row := w.u16[r*w.ld : r*w.ld+n]
		for i := 0; i < n; i++ {
			acc[i%8] += model.F16ToF32(row[i]) * x[i]
		}
	}
	return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}
