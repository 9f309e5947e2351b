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

// run computes part k's blocks.
func (j *matJob) run(k int) {
	lo, hi := span(k, j.parts, j.blocks())
	base := 0
	in := j.in
	for mi := range j.mats[:j.nm] {
		m := &j.mats[mi]
		nb := (m.rows + 3) / 4
		a, z := max(lo-base, 0), min(hi-base, nb)
		for blk := a; blk < z; blk++ {
			r0 := blk * 4
			if r0+4 <= m.rows {
				w := m.w[r0*in:]
				for t := 0; t < j.n; t++ {
					dotRows4(w, in, j.x[t*in:], in, m.out[t*m.rows+r0:])
				}
				continue
			}
			for r := r0; r < m.rows; r++ {
				w := m.w[r*in : (r+1)*in]
				for t := 0; t < j.n; t++ {
					m.out[t*m.rows+r] = dot(w, j.x[t*in:(t+1)*in])
				}
			}
		}
		base += nb
	}
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
