package cpu

import (
	"context"
	"fmt"

	"github.com/mooncake-go/mooncake-go/internal/compute"
)

// scratch holds the activations of one forward pass, grown on demand and
// reused, so steady-state decoding does not allocate. Buffers are indexed by
// the token's place in the pass (MoE buffers by token x rank), so the
// threads of a sequence-parallel pass write disjoint parts.
type scratch struct {
	tokens int         // capacity in tokens
	x      []float32   // residual stream [tokens][Dim]
	xb     []float32   // normed input [tokens][Dim]
	xb2    []float32   // block output [tokens][Dim]
	q      []float32   // [tokens][Heads*HeadDim]
	k, v   []float32   // [tokens][KVHeads*HeadDim]
	att    []float32   // attention output [tokens][Heads*HeadDim]
	hb     []float32   // gate [tokens][max(HiddenDim, SharedExpertDim)]
	hb2    []float32   // up, the same
	pos    []int       // position of each token
	seq    []int       // sequence of each token
	slot   []int       // element offset of each token's KV entry inside a layer's K (or V) buffer
	scores [][]float32 // per thread [positions]
	lx     []float32   // normed last tokens [m][Dim]
	logits []float32   // [m][Vocab]

	// Mixture of experts.
	router []float32    // router logits [tokens][Experts]
	topID  []int32      // chosen experts [tokens][TopK]
	topW   []float32    // their weights
	rowOf  []int        // gathered row of each (token, rank)
	xe     []float32    // gathered inputs [tokens*TopK][Dim], by expert
	he, hu []float32    // [tokens*TopK][ExpertDim]
	ye     []float32    // expert outputs [tokens*TopK][Dim]
	sh     []float32    // shared expert output [tokens][Dim]
	sgate  []float32    // shared expert gate logit [tokens]
	moe    []moeScratch // per thread

	seqs  []compute.Seq
	out   [][]float32
	split []int    // sequence-parallel pass: thread k's first sequence,
	tok0  []int    // token
	row0  []int    // and logits row
	jobs  []matJob // per thread; row-split passes use jobs[0]
	at    attnJob
	mmFn  func(int)
	atFn  func(int)
	seqFn func(int)
}

// moeScratch is one thread's expert bookkeeping.
type moeScratch struct {
	count, start, next []int // per expert
}

func (s *scratch) init(b *Backend) {
	n := b.team.n
	s.scores = make([][]float32, n)
	s.jobs = make([]matJob, n)
	s.moe = make([]moeScratch, n)
	for k := range s.moe {
		e := b.cfg.Experts
		s.moe[k] = moeScratch{count: make([]int, e), start: make([]int, e), next: make([]int, e)}
	}
	s.mmFn = func(k int) { s.jobs[0].run(k) }
	s.atFn = func(k int) { b.attentionPart(k) }
	s.seqFn = func(k int) { b.seqPart(k) }
}

// job is thread k's matmul job.
func (s *scratch) job(k int) *matJob { return &s.jobs[k] }

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
		hid := max(c.HiddenDim, c.SharedExpertDim)
		s.x = make([]float32, t*c.Dim)
		s.xb = make([]float32, t*c.Dim)
		s.xb2 = make([]float32, t*c.Dim)
		s.q = make([]float32, t*c.Heads*c.HeadDim)
		s.att = make([]float32, t*c.Heads*c.HeadDim)
		s.k = make([]float32, t*c.KVHeads*c.HeadDim)
		s.v = make([]float32, t*c.KVHeads*c.HeadDim)
		s.hb = make([]float32, t*hid)
		s.hb2 = make([]float32, t*hid)
		s.pos = make([]int, t)
		s.seq = make([]int, t)
		s.slot = make([]int, t)
		if c.Experts > 0 {
			tk := t * c.TopK
			s.router = make([]float32, t*c.Experts)
			s.topID = make([]int32, tk)
			s.topW = make([]float32, tk)
			s.rowOf = make([]int, tk)
			s.xe = make([]float32, tk*c.Dim)
			s.he = make([]float32, tk*c.ExpertDim)
			s.hu = make([]float32, tk*c.ExpertDim)
			s.ye = make([]float32, tk*c.Dim)
			if c.SharedExpertDim > 0 {
				s.sh = make([]float32, t*c.Dim)
				s.sgate = make([]float32, t)
			}
		}
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
			b.embed.row(int(tok), s.x[t*dim:(t+1)*dim])
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
	for li := range b.layers {
		if err := ctx.Err(); err != nil {
			return err
		}
		b.layer(li, 0, n, 0, b.team)
		layerDone(seqs, li)
	}
	b.logits(0, len(seqs), 0, 0, 0, b.team)
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
	for li := range b.layers {
		b.layer(li, t0, t1, k, nil)
		layerDone(s.seqs[s.split[k]:s.split[k+1]], li)
	}
	b.logits(s.split[k], s.split[k+1], t0, s.row0[k], k, nil)
}

// layer runs layer li's blocks for tokens [t0, t1): split across tm, or
// all on thread k when tm is nil.
func (b *Backend) layer(li, t0, t1, k int, tm *team) {
	for _, blk := range b.layers[li] {
		blk.run(b, li, t0, t1, k, tm)
	}
}

// matmul runs mm across tm, or whole on the calling thread when tm is nil.
func (b *Backend) matmul(mm *matJob, tm *team) {
	if len(mm.mats) == 0 {
		return
	}
	if tm == nil {
		mm.parts = 1
		mm.run(0)
		return
	}
	tm.run(mm.plan(tm), b.s.mmFn)
}

// logits computes the logits of sequences [i0, i1), whose tokens start at
// t0, into logits rows from r0 on, and copies them out.
func (b *Backend) logits(i0, i1, t0, r0, k int, tm *team) {
	c := &b.cfg
	s := &b.s
	dim := c.Dim
	t, r := t0, r0
	for _, sq := range s.seqs[i0:i1] {
		t += len(sq.Tokens)
		if sq.Logits {
			rmsnorm(s.lx[r*dim:(r+1)*dim], s.x[(t-1)*dim:t*dim], b.norm, c.NormEps)
			r++
		}
	}
	if r == r0 {
		return
	}
	mm := s.job(k)
	mm.reset()
	mm.set(s.lx[r0*dim:r*dim], r-r0)
	mm.add(&b.lmHead, s.logits[r0*c.Vocab:r*c.Vocab], nil)
	b.matmul(mm, tm)
	r = r0
	for i := i0; i < i1; i++ {
		if s.seqs[i].Logits {
			copy(s.out[i][:c.Vocab], s.logits[r*c.Vocab:(r+1)*c.Vocab])
			r++
		}
	}
}
