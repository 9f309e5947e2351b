package cpu

import (
	"context"
	"math"
)

// block is one step of a layer over tokens [t0, t1) of the pass on rank r:
// split across tm, or all on thread k when tm is nil. Every block reads the
// residual stream s.x and adds its output to it; with tp > 1 the output is
// the rank's partial sum, all-reduced before the add.
type block interface {
	run(ctx context.Context, r *rank, li, t0, t1, k int, tm *team) error
}

// normRows writes rmsnorm(x[t]) * w into o[t] for n rows of len(w).
func normRows(o, x, w []float32, n int, eps float32) {
	d := len(w)
	for t := 0; t < n; t++ {
		rmsnorm(o[t*d:(t+1)*d], x[t*d:(t+1)*d], w, eps)
	}
}

// rmsnorm writes o = w * (x / rms(x)); o may be x.
func rmsnorm(o, x, w []float32, eps float32) {
	ss := dot(x, x)/float32(len(x)) + eps
	sc := float32(1 / math.Sqrt(float64(ss)))
	o = o[:len(x)]
	w = w[:len(x)]
	for i, v := range x {
		o[i] = w[i] * (sc * v)
	}
}

func addTo(dst, src []float32) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] += src[i]
	}
}

// attnBlock is the attention block: RMSNorm, q/k/v projections (with
// biases), per-head q/k RMSNorm, RoPE, the KV write, grouped-query attention
// over the paged cache (within the window), the output projection and the
// residual add.
type attnBlock struct {
	norm         []float32
	q, k, v, o   wmat
	bq, bk, bv   []float32
	qNorm, kNorm []float32
	window       int
}

func (a *attnBlock) run(ctx context.Context, r *rank, li, t0, t1, k int, tm *team) error {
	c := &r.cfg
	l := &r.pool.Layout
	s := &r.s
	n := t1 - t0
	dim, qd, kvd, hd := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HeadDim
	x := s.x[t0*dim : t1*dim]
	xb := s.xb[t0*dim : t1*dim]
	xb2 := s.xb2[t0*dim : t1*dim]
	mm := s.job(k)
	normRows(xb, x, a.norm, n, c.NormEps)
	mm.reset()
	mm.set(xb, n)
	mm.add(&a.q, s.q[t0*qd:t1*qd], a.bq)
	mm.add(&a.k, s.k[t0*kvd:t1*kvd], a.bk)
	mm.add(&a.v, s.v[t0*kvd:t1*kvd], a.bv)
	r.matmul(mm, tm)
	// Head-major pages: a layer's page holds, head by head, the head's K
	// then its V, PageSize slots of HeadDim each.
	pageElems := 2 * l.PageSize * kvd
	base := li * l.Pages * pageElems
	blk := l.PageSize * hd // one head's K (or V) in a page
	for t := t0; t < t1; t++ {
		qt := s.q[t*qd : (t+1)*qd]
		kt := s.k[t*kvd : (t+1)*kvd]
		if a.qNorm != nil {
			for h := 0; h < c.Heads; h++ {
				rmsnorm(qt[h*hd:(h+1)*hd], qt[h*hd:(h+1)*hd], a.qNorm, c.NormEps)
			}
			for h := 0; h < c.KVHeads; h++ {
				rmsnorm(kt[h*hd:(h+1)*hd], kt[h*hd:(h+1)*hd], a.kNorm, c.NormEps)
			}
		}
		r.rope.apply(qt, c.Heads, s.pos[t])
		r.rope.apply(kt, c.KVHeads, s.pos[t])
		vt := s.v[t*kvd : (t+1)*kvd]
		for h := 0; h < c.KVHeads; h++ {
			off := base + s.slot[t] + 2*h*blk
			copy(r.kv[off:off+hd], kt[h*hd:(h+1)*hd])
			copy(r.kv[off+blk:off+blk+hd], vt[h*hd:(h+1)*hd])
		}
	}
	at := attnJob{t0: t0, n: n, base: base, pageElems: pageElems, blk: blk, window: a.window, parts: 1}
	if tm != nil {
		work := 0
		for t := t0; t < t1; t++ {
			work += (at.first(s.pos[t]) + 1) * 2 * qd
		}
		at.parts = tm.parts(work)
		s.at = at
		tm.run(s.at.parts, s.atFn)
	} else {
		r.attend(&at, k, 0, n*c.KVHeads)
	}
	mm.reset()
	mm.set(s.att[t0*qd:t1*qd], n)
	mm.add(&a.o, xb2, nil)
	r.matmul(mm, tm)
	if err := r.allReduce(ctx, xb2); err != nil {
		return err
	}
	addTo(x, xb2)
	return nil
}

// attnJob is one layer's attention over tokens [t0, t0+n) of a pass.
type attnJob struct {
	t0, n     int
	base      int // the layer's first element
	pageElems int // a layer's page
	blk       int // one head's K (or V) in a page
	window    int
	parts     int
}

// first is the number of positions a token at pos attends to, less one.
func (a *attnJob) first(pos int) int {
	if a.window > 0 {
		return min(pos, a.window-1)
	}
	return pos
}

// attentionPart computes thread k's share of (token, kv head) pairs.
func (r *rank) attentionPart(k int) {
	a := &r.s.at
	lo, hi := span(k, a.parts, a.n*r.cfg.KVHeads)
	r.attend(a, k, lo, hi)
}

// attend computes tasks [lo, hi) of a on thread k: for each query head of
// the group, scores over the token's positions in order (the last Window
// ones with a sliding window), a softmax, and the weighted sum of values in
// position order.
func (r *rank) attend(a *attnJob, k, lo, hi int) {
	c := &r.cfg
	s := &r.s
	hd, qd := c.HeadDim, c.Heads*c.HeadDim
	ps := r.pool.PageSize
	group := c.Heads / c.KVHeads
	scale := float32(math.Sqrt(float64(hd)))
	sc := s.scores[k]
	for task := lo; task < hi; task++ {
		t, g := a.t0+task/c.KVHeads, task%c.KVHeads
		end := s.pos[t] + 1
		start := end - 1 - a.first(s.pos[t])
		// The positions start in page pi0 at slot in0; each later page
		// from its slot 0.
		pi0 := start / ps
		in0 := start - pi0*ps
		pages := s.seqs[s.seq[t]].Pages
		sc := sc[:cap(sc)]
		for h := g * group; h < (g+1)*group; h++ {
			q := s.q[t*qd+h*hd : t*qd+(h+1)*hd]
			for p, pi, in := start, pi0, in0; p < end; pi, in = pi+1, 0 {
				cnt := min(ps-in, end-p)
				off := a.base + int(pages[pi])*a.pageElems + 2*g*a.blk + in*hd
				attnScores(q, r.kv[off:], hd, cnt, hd, sc[p-start:])
				p += cnt
			}
			softmax(sc, end-start, scale)
			o := s.att[t*qd+h*hd : t*qd+(h+1)*hd]
			clear(o)
			for p, pi, in := start, pi0, in0; p < end; pi, in = pi+1, 0 {
				cnt := min(ps-in, end-p)
				off := a.base + int(pages[pi])*a.pageElems + (2*g+1)*a.blk + in*hd
				attnAccum(sc[p-start:], r.kv[off:], hd, cnt, hd, o)
				p += cnt
			}
		}
	}
}

// siluRows applies siluMul to each of n rows of g and u: per row, so that
// a row's tail elements take the same (scalar) path whatever follows it.
func siluRows(g, u []float32, n int) {
	d := len(g) / max(n, 1)
	for t := 0; t < n; t++ {
		siluMul(g[t*d:(t+1)*d], u[t*d:(t+1)*d])
	}
}

// swiglu is a SwiGLU MLP: down(silu(gate x) * up x).
type swiglu struct {
	gate, up, down wmat
}

// denseBlock is the dense MLP block: RMSNorm, SwiGLU, residual add.
type denseBlock struct {
	norm []float32
	ffn  swiglu
}

func (d *denseBlock) run(ctx context.Context, r *rank, li, t0, t1, k int, tm *team) error {
	c := &r.cfg
	s := &r.s
	n := t1 - t0
	dim, hd := c.Dim, d.ffn.gate.rows
	x := s.x[t0*dim : t1*dim]
	xb := s.xb[t0*dim : t1*dim]
	xb2 := s.xb2[t0*dim : t1*dim]
	normRows(xb, x, d.norm, n, c.NormEps)
	hb := s.hb[t0*hd : t1*hd]
	hb2 := s.hb2[t0*hd : t1*hd]
	mm := s.job(k)
	mm.reset()
	mm.set(xb, n)
	mm.add(&d.ffn.gate, hb, nil)
	mm.add(&d.ffn.up, hb2, nil)
	r.matmul(mm, tm)
	siluRows(hb, hb2, n)
	mm.reset()
	mm.set(hb, n)
	mm.add(&d.ffn.down, xb2, nil)
	r.matmul(mm, tm)
	if err := r.allReduce(ctx, xb2); err != nil {
		return err
	}
	addTo(x, xb2)
	return nil
}

// moeBlock is the mixture-of-experts block: RMSNorm, the router (softmax
// over experts, the top k, renormalised or not), each chosen expert's
// SwiGLU on its tokens, their weighted sum in rank order (plus the gated
// shared expert), residual add. A token's result depends only on the token:
// its experts' rows go through the same kernels whichever tokens share them.
type moeBlock struct {
	norm       []float32
	router     wmat
	experts    []swiglu
	shared     *swiglu
	sharedGate wmat
}

func (e *moeBlock) run(ctx context.Context, r *rank, li, t0, t1, k int, tm *team) error {
	c := &r.cfg
	s := &r.s
	n := t1 - t0
	dim, E, K, I := c.Dim, c.Experts, c.TopK, c.ExpertDim
	x := s.x[t0*dim : t1*dim]
	xb := s.xb[t0*dim : t1*dim]
	out := s.xb2[t0*dim : t1*dim]
	normRows(xb, x, e.norm, n, c.NormEps)
	mm := s.job(k)
	logits := s.router[t0*E : t1*E]
	mm.reset()
	mm.set(xb, n)
	mm.add(&e.router, logits, nil)
	var sh *swiglu
	if e.shared != nil {
		sh = e.shared
		sd := sh.gate.rows
		mm.add(&sh.gate, s.hb[t0*sd:t1*sd], nil)
		mm.add(&sh.up, s.hb2[t0*sd:t1*sd], nil)
		mm.add(&e.sharedGate, s.sgate[t0:t1], nil)
	}
	r.matmul(mm, tm)

	// Route, then sort the (token, rank) pairs by expert, in token order
	// within an expert: pair (t, j) goes to row rowOf[t*K+j] of the
	// gathered buffers, which start at row t0*K.
	ids := s.topID[t0*K : t1*K]
	wts := s.topW[t0*K : t1*K]
	for t := 0; t < n; t++ {
		route(logits[t*E:(t+1)*E], K, c.NormTopKProb, ids[t*K:(t+1)*K], wts[t*K:(t+1)*K])
	}
	ms := &s.moe[k]
	clear(ms.count)
	for _, id := range ids {
		ms.count[id]++
	}
	off := 0
	for j := range ms.count {
		ms.start[j] = off
		off += ms.count[j]
	}
	rowOf := s.rowOf[t0*K : t1*K]
	next := ms.next
	copy(next, ms.start)
	base := t0 * K
	xe := s.xe[base*dim : (base+n*K)*dim]
	for p, id := range ids {
		r := next[id]
		next[id]++
		rowOf[p] = r
		t := p / K
		copy(xe[r*dim:(r+1)*dim], xb[t*dim:(t+1)*dim])
	}
	he := s.he[base*I : (base+n*K)*I]
	hu := s.hu[base*I : (base+n*K)*I]
	ye := s.ye[base*dim : (base+n*K)*dim]
	mm.reset()
	for j := range e.experts {
		if cnt := ms.count[j]; cnt > 0 {
			r := ms.start[j]
			mm.set(xe[r*dim:(r+cnt)*dim], cnt)
			mm.add(&e.experts[j].gate, he[r*I:(r+cnt)*I], nil)
			mm.add(&e.experts[j].up, hu[r*I:(r+cnt)*I], nil)
		}
	}
	r.matmul(mm, tm)
	siluRows(he, hu, n*K)
	mm.reset()
	for j := range e.experts {
		if cnt := ms.count[j]; cnt > 0 {
			r := ms.start[j]
			mm.set(he[r*I:(r+cnt)*I], cnt)
			mm.add(&e.experts[j].down, ye[r*dim:(r+cnt)*dim], nil)
		}
	}
	if sh != nil {
		sd := sh.gate.rows
		siluRows(s.hb[t0*sd:t1*sd], s.hb2[t0*sd:t1*sd], n)
		mm.set(s.hb[t0*sd:t1*sd], n)
		mm.add(&sh.down, s.sh[t0*dim:t1*dim], nil)
	}
	r.matmul(mm, tm)

	for t := 0; t < n; t++ {
		o := out[t*dim : (t+1)*dim]
		clear(o)
		for j := 0; j < K; j++ {
			r := rowOf[t*K+j]
			axpy(o, wts[t*K+j], ye[r*dim:(r+1)*dim])
		}
		if sh != nil {
			g := sigmoid(s.sgate[t0+t])
			axpy(o, g, s.sh[(t0+t)*dim:(t0+t+1)*dim])
		}
	}
	// Every expert's down projection is split by columns: out is this
	// rank's part of the weighted sum.
	if err := r.allReduce(ctx, out); err != nil {
		return err
	}
	addTo(x, out)
	return nil
}

// route picks the top k of softmax(logits) (the lowest expert id on ties)
// into ids and their probabilities into w, renormalised to sum to 1 when
// norm is set.
func route(logits []float32, k int, norm bool, ids []int32, w []float32) {
	mx := logits[0]
	for _, v := range logits {
		mx = max(mx, v)
	}
	var sum float64
	for _, v := range logits {
		sum += math.Exp(float64(v - mx))
	}
	for j := 0; j < k; j++ {
		best := -1
		for i, v := range logits {
			if (best < 0 || v > logits[best]) && !taken(ids[:j], int32(i)) {
				best = i
			}
		}
		ids[j] = int32(best)
		w[j] = float32(math.Exp(float64(logits[best]-mx)) / sum)
	}
	if norm {
		var s float32
		for _, v := range w[:k] {
			s += v
		}
		for j := range w[:k] {
			w[j] /= s
		}
	}
}

func taken(ids []int32, i int32) bool {
	for _, id := range ids {
		if id == i {
			return true
		}
	}
	return false
}

// axpy adds a*x to y.
func axpy(y []float32, a float32, x []float32) {
	x = x[:len(y)]
	for i := range y {
		y[i] += a * x[i]
	}
}

func sigmoid(x float32) float32 { return 1 / (1 + expf(-x)) }
