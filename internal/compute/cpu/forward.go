package cpu

import (
	"context"
	"fmt"
	"math"

	"github.com/mooncake-go/mooncake-go/internal/compute"
)

// scratch holds the activations of one forward pass, grown on demand and
// reused, so steady-state decoding does not allocate.
type scratch struct {
	tokens int         // capacity in tokens
	x      []float32   // residual stream [tokens][Dim]
	xb     []float32   // normed input [tokens][Dim]
	xb2    []float32   // projection output [tokens][Dim]
	q      []float32   // [tokens][Heads*HeadDim]
	k, v   []float32   // [tokens][KVHeads*HeadDim]
	att    []float32   // attention output [tokens][Heads*HeadDim]
	hb     []float32   // gate [tokens][HiddenDim]
	hb2    []float32   // up [tokens][HiddenDim]
	pos    []int       // position of each token
	seq    []int       // sequence of each token
	slot   []int       // element offset of each token's KV entry inside a layer's K (or V) buffer
	scores [][]float32 // per thread [positions]
	lx     []float32   // normed last tokens [m][Dim]
	logits []float32   // [m][Vocab]

	seqs  []compute.Seq
	out   [][]float32
	split []int // sequence-parallel pass: thread k's first sequence,
	tok0  []int // token
	row0  []int // and logits row
	mm    matJob
	at    attnJob
	mmFn  func(int)
	atFn  func(int)
	seqFn func(int)
}

func (s *scratch) init(b *Backend) {
	s.scores = make([][]float32, b.team.n)
	s.mmFn = s.mm.run
	s.atFn = func(k int) { b.attentionPart(k) }
	s.seqFn = func(k int) { b.seqPart(k) }
}

func grow(buf []float32, n int) []float32 {
	if cap(buf) < n {
		return make([]float32, n)
	}
	return buf[:n]
}

func (b *Backend) growScratch(n, maxPos, m int) {
	c := &b.cfg
	s := &b.s
	if n > s.tokens {
		t := max(n, 2*s.tokens)
		s.tokens = t
		s.x = make([]float32, t*c.Dim)
		s.xb = make([]float32, t*c.Dim)
		s.xb2 = make([]float32, t*c.Dim)
		s.q = make([]float32, t*c.Heads*c.HeadDim)
		s.att = make([]float32, t*c.Heads*c.HeadDim)
		s.k = make([]float32, t*c.KVHeads*c.HeadDim)
		s.v = make([]float32, t*c.KVHeads*c.HeadDim)
		s.hb = make([]float32, t*c.HiddenDim)
		s.hb2 = make([]float32, t*c.HiddenDim)
		s.pos = make([]int, t)
		s.seq = make([]int, t)
		s.slot = make([]int, t)
	}
	for k := range s.scores {
		if len(s.scores[k]) < maxPos+8 {
			s.scores[k] = make([]float32, max(maxPos, 2*len(s.scores[k]))+8)
		}
	}
	s.lx = grow(s.lx, m*c.Dim)
	s.logits = grow(s.logits, m*c.Vocab)
}

// check validates seqs against the model and pool and returns the token
// count, the largest end position and the number of logits rows.
func (b *Backend) check(seqs []compute.Seq, out [][]float32) (n, maxEnd, m int, err error) {
	c := &b.cfg
	l := &b.pool.Layout
	for i, s := range seqs {
		if s.Logits && len(s.Tokens) == 0 {
			return 0, 0, 0, fmt.Errorf("cpu: seq %d asks for logits but has no tokens", i)
		}
		if s.Pos < 0 {
			return 0, 0, 0, fmt.Errorf("cpu: seq %d: negative position %d", i, s.Pos)
		}
		end := s.Pos + len(s.Tokens)
		if end > c.MaxSeqLen {
			return 0, 0, 0, fmt.Errorf("cpu: seq %d: position %d beyond the context length %d", i, end-1, c.MaxSeqLen)
		}
		if need := (end + l.PageSize - 1) / l.PageSize; len(s.Pages) < need {
			return 0, 0, 0, fmt.Errorf("cpu: seq %d: %d pages for %d positions (page size %d)", i, len(s.Pages), end, l.PageSize)
		}
		for _, p := range s.Pages[:(end+l.PageSize-1)/l.PageSize] {
			if p < 0 || int(p) >= l.Pages {
				return 0, 0, 0, fmt.Errorf("cpu: seq %d: page %d outside the pool of %d", i, p, l.Pages)
			}
		}
		for _, t := range s.Tokens {
			if t < 0 || int(t) >= c.Vocab {
				return 0, 0, 0, fmt.Errorf("cpu: seq %d: token %d outside the vocabulary of %d", i, t, c.Vocab)
			}
		}
		if s.Logits {
			if i >= len(out) || len(out[i]) < c.Vocab {
				return 0, 0, 0, fmt.Errorf("cpu: seq %d: no room for %d logits", i, c.Vocab)
			}
			m++
		}
		n += len(s.Tokens)
		maxEnd = max(maxEnd, end)
	}
	return n, maxEnd, m, nil
}

func (b *Backend) forward(ctx context.Context, seqs []compute.Seq, out [][]float32) error {
	n, maxEnd, m, err := b.check(seqs, out)
	if err != nil || n == 0 {
		return err
	}
	c := &b.cfg
	l := &b.pool.Layout
	s := &b.s
	b.growScratch(n, maxEnd, m)
	b.rope.ensure(maxEnd)
	s.seqs = seqs
	s.out = out
	dim, kvd := c.Dim, c.KVHeads*c.HeadDim
	pageElems := l.PageSize * kvd
	t := 0
	for i, sq := range seqs {
		for j, tok := range sq.Tokens {
			p := sq.Pos + j
			s.pos[t], s.seq[t] = p, i
			s.slot[t] = int(sq.Pages[p/l.PageSize])*pageElems + (p%l.PageSize)*kvd
			copy(s.x[t*dim:(t+1)*dim], b.m.W.Embed[int(tok)*dim:(int(tok)+1)*dim])
			t++
		}
	}
	// Many sequences, none too long: each thread runs whole sequences
	// through all layers (one hand-off per pass instead of several per
	// layer). Otherwise every step is split across the threads by rows.
	// Either way each value is computed by the same kernels in the same
	// order.
	if parts := b.seqSplit(seqs, n); parts > 1 {
		b.team.run(parts, s.seqFn)
		return ctx.Err()
	}
	for li := range b.m.W.Layers {
		if err := ctx.Err(); err != nil {
			return err
		}
		b.layer(li, 0, n, 0, b.team)
		layerDone(seqs, li)
	}
	b.logits(0, len(seqs), 0, 0, b.team)
	return nil
}

// layerDone tells the seqs that asked that layer li's KV is written.
func layerDone(seqs []compute.Seq, li int) {
	for i := range seqs {
		if f := seqs[i].Layer; f != nil {
			f(li, nil)
		}
	}
}

// seqSplit plans a sequence-parallel pass: s.split[k] is thread k's first
// sequence. It returns the number of parts (1: split by rows instead).
func (b *Backend) seqSplit(seqs []compute.Seq, n int) int {
	s := &b.s
	parts := min(b.team.n, len(seqs))
	if parts <= 1 || n < 6*parts {
		return 1
	}
	longest := 0
	for _, sq := range seqs {
		longest = max(longest, len(sq.Tokens))
	}
	if longest*parts*2 > n {
		return 1
	}
	s.split = s.split[:0]
	s.tok0 = s.tok0[:0]
	s.row0 = s.row0[:0]
	t, r, k := 0, 0, 0
	for i, sq := range seqs {
		if t >= n*k/parts && len(s.split) == k {
			s.split = append(s.split, i)
			s.tok0 = append(s.tok0, t)
			s.row0 = append(s.row0, r)
			k++
		}
		t += len(sq.Tokens)
		if sq.Logits {
			r++
		}
	}
	for len(s.split) < parts+1 {
		s.split = append(s.split, len(seqs))
		s.tok0 = append(s.tok0, t)
		s.row0 = append(s.row0, r)
	}
	return parts
}

// seqPart is thread k's share of a sequence-parallel pass.
func (b *Backend) seqPart(k int) {
	s := &b.s
	t0, t1 := s.tok0[k], s.tok0[k+1]
	if t0 == t1 {
		return
	}
	for li := range b.m.W.Layers {
		b.layer(li, t0, t1, k, nil)
		layerDone(s.seqs[s.split[k]:s.split[k+1]], li)
	}
	b.logits(s.split[k], s.split[k+1], t0, s.row0[k], nil)
}

// layer runs layer li for tokens [t0, t1): split across tm, or all on
// thread k when tm is nil.
func (b *Backend) layer(li, t0, t1, k int, tm *team) {
	c := &b.cfg
	l := &b.pool.Layout
	s := &b.s
	w := &b.m.W.Layers[li]
	n := t1 - t0
	dim, qd, kvd, hd := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HiddenDim
	x := s.x[t0*dim : t1*dim]
	xb := s.xb[t0*dim : t1*dim]
	xb2 := s.xb2[t0*dim : t1*dim]
	q := s.q[t0*qd : t1*qd]
	kk := s.k[t0*kvd : t1*kvd]
	v := s.v[t0*kvd : t1*kvd]
	att := s.att[t0*qd : t1*qd]
	hb := s.hb[t0*hd : t1*hd]
	hb2 := s.hb2[t0*hd : t1*hd]
	var local matJob
	mm := &local
	if tm != nil {
		mm = &s.mm
	}
	for t := 0; t < n; t++ {
		rmsnorm(xb[t*dim:(t+1)*dim], x[t*dim:(t+1)*dim], w.AttnNorm, c.NormEps)
	}
	mm.set(xb, n, dim)
	mm.add(w.WQ, qd, q, w.BQ)
	mm.add(w.WK, kvd, kk, w.BK)
	mm.add(w.WV, kvd, v, w.BV)
	b.matmul(mm, tm)
	mm.bias()
	pageElems := l.PageSize * kvd
	layerElems := l.Pages * pageElems
	kBase := (2 * li) * layerElems
	vBase := kBase + layerElems
	for t := t0; t < t1; t++ {
		qt := s.q[t*qd : (t+1)*qd]
		kt := s.k[t*kvd : (t+1)*kvd]
		b.rope.apply(qt, c.Heads, s.pos[t])
		b.rope.apply(kt, c.KVHeads, s.pos[t])
		copy(b.kv[kBase+s.slot[t]:kBase+s.slot[t]+kvd], kt)
		copy(b.kv[vBase+s.slot[t]:vBase+s.slot[t]+kvd], s.v[t*kvd:(t+1)*kvd])
	}
	if tm != nil {
		work := 0
		for t := t0; t < t1; t++ {
			work += (s.pos[t] + 1) * 2 * qd
		}
		s.at = attnJob{t0: t0, n: n, kBase: kBase, vBase: vBase, pageElems: pageElems, parts: tm.parts(work)}
		tm.run(s.at.parts, s.atFn)
	} else {
		a := attnJob{t0: t0, n: n, kBase: kBase, vBase: vBase, pageElems: pageElems, parts: 1}
		b.attend(&a, k, 0, n*c.KVHeads)
	}
	mm.set(att, n, qd)
	mm.add(w.WO, dim, xb2, nil)
	b.matmul(mm, tm)
	addTo(x, xb2)

	for t := 0; t < n; t++ {
		rmsnorm(xb[t*dim:(t+1)*dim], x[t*dim:(t+1)*dim], w.FFNNorm, c.NormEps)
	}
	mm.set(xb, n, dim)
	mm.add(w.W1, hd, hb, nil)
	mm.add(w.W3, hd, hb2, nil)
	b.matmul(mm, tm)
	for t := 0; t < n; t++ {
		siluMul(hb[t*hd:(t+1)*hd], hb2[t*hd:(t+1)*hd])
	}
	mm.set(hb, n, hd)
	mm.add(w.W2, dim, xb2, nil)
	b.matmul(mm, tm)
	addTo(x, xb2)
}

// matmul runs mm across tm, or whole on the calling thread when tm is nil.
func (b *Backend) matmul(mm *matJob, tm *team) {
	if tm == nil {
		mm.parts = 1
		mm.run(0)
		return
	}
	tm.run(mm.plan(tm), b.s.mmFn)
}

// logits computes the logits of sequences [i0, i1), whose tokens start at
// t0, into logits rows from r0 on, and copies them out.
func (b *Backend) logits(i0, i1, t0, r0 int, tm *team) {
	c := &b.cfg
	s := &b.s
	dim := c.Dim
	t, r := t0, r0
	for _, sq := range s.seqs[i0:i1] {
		t += len(sq.Tokens)
		if sq.Logits {
			rmsnorm(s.lx[r*dim:(r+1)*dim], s.x[(t-1)*dim:t*dim], b.m.W.Norm, c.NormEps)
			r++
		}
	}
	if r == r0 {
		return
	}
	var local matJob
	mm := &local
	if tm != nil {
		mm = &s.mm
	}
	mm.set(s.lx[r0*dim:r*dim], r-r0, dim)
	mm.add(b.m.W.LMHead, c.Vocab, s.logits[r0*c.Vocab:r*c.Vocab], nil)
	b.matmul(mm, tm)
	r = r0
	for i := i0; i < i1; i++ {
		if s.seqs[i].Logits {
			copy(s.out[i][:c.Vocab], s.logits[r*c.Vocab:(r+1)*c.Vocab])
			r++
		}
	}
}

// rmsnorm writes o = w * (x / rms(x)).
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

// attnJob is one layer's attention over all tokens of a forward pass.
type attnJob struct {
	t0, n        int
	kBase, vBase int
	pageElems    int
	parts        int
}

// attentionPart computes thread k's share of (token, kv head) pairs: for
// each query head of the group, scores over positions 0..pos in order, a
// softmax, and the weighted sum of values in position order.
func (b *Backend) attentionPart(k int) {
	a := &b.s.at
	lo, hi := span(k, a.parts, a.n*b.cfg.KVHeads)
	b.attend(a, k, lo, hi)
}

// attend computes tasks [lo, hi) of a on thread k.
func (b *Backend) attend(a *attnJob, k, lo, hi int) {
	c := &b.cfg
	s := &b.s
	hd, kvd, qd := c.HeadDim, c.KVHeads*c.HeadDim, c.Heads*c.HeadDim
	ps := b.pool.PageSize
	group := c.Heads / c.KVHeads
	scale := float32(math.Sqrt(float64(hd)))
	sc := s.scores[k]
	for task := lo; task < hi; task++ {
		t, g := a.t0+task/c.KVHeads, task%c.KVHeads
		npos := s.pos[t] + 1
		pages := s.seqs[s.seq[t]].Pages
		sc := sc[:cap(sc)]
		for h := g * group; h < (g+1)*group; h++ {
			q := s.q[t*qd+h*hd : t*qd+(h+1)*hd]
			for pi := 0; pi*ps < npos; pi++ {
				cnt := min(ps, npos-pi*ps)
				off := a.kBase + int(pages[pi])*a.pageElems + g*hd
				attnScores(q, b.kv[off:], kvd, cnt, hd, sc[pi*ps:])
			}
			softmax(sc, npos, scale)
			o := s.att[t*qd+h*hd : t*qd+(h+1)*hd]
			clear(o)
			for pi := 0; pi*ps < npos; pi++ {
				cnt := min(ps, npos-pi*ps)
				off := a.vBase + int(pages[pi])*a.pageElems + g*hd
				attnAccum(sc[pi*ps:], b.kv[off:], kvd, cnt, hd, o)
			}
		}
	}
}
