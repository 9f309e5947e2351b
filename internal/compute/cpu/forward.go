package cpu

import (
	"context"

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
	slot   []int       // element offset of each token's slot in a layer's buffer (its page's block + slot*HeadDim)
	scores [][]float32 // per thread [positions]
	lx     []float32   // normed last tokens [m][Dim]
	logits []float32   // [m][the rank's vocabulary rows]
	lsend  []float32   // tp > 1: logits padded to the shard [m][vshard]
	lrecv  []float32   // and every rank's [tp][m][vshard]

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

func (s *scratch) init(r *rank) {
	n := r.team.n
	s.scores = make([][]float32, n)
	s.jobs = make([]matJob, n)
	s.moe = make([]moeScratch, n)
	for k := range s.moe {
		e := r.cfg.Experts
		s.moe[k] = moeScratch{count: make([]int, e), start: make([]int, e), next: make([]int, e)}
	}
	s.mmFn = func(k int) { s.jobs[0].run(k) }
	s.atFn = func(k int) { r.attentionPart(k) }
	s.seqFn = func(k int) { r.seqPart(k) }
}

// job is thread k's matmul job.
func (s *scratch) job(k int) *matJob { return &s.jobs[k] }

func grow(buf []float32, n int) []float32 {
	if cap(buf) < n {
		return make([]float32, n)
	}
	return buf[:n]
}

func (r *rank) growScratch(n, maxPos, m int) {
	c := &r.cfg
	s := &r.s
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
	s.logits = grow(s.logits, m*r.lmHead.rows)
	if r.tp > 1 {
		s.lsend = grow(s.lsend, m*r.vshard)
		s.lrecv = grow(s.lrecv, r.tp*m*r.vshard)
	}
}

// forward runs the pass of seqs (n tokens, positions below maxEnd, m
// logits rows) on this rank; rank 0 writes the logits into out.
func (r *rank) forward(ctx context.Context, seqs []compute.Seq, out [][]float32, n, maxEnd, m int) error {
	c := &r.cfg
	l := &r.pool.Layout
	s := &r.s
	r.growScratch(n, maxEnd, m)
	r.rope.ensure(maxEnd)
	s.seqs = seqs
	s.out = out
	dim := c.Dim
	pageElems := 2 * l.PageSize * l.KVHeads * l.HeadDim // a layer's page, K and V
	t := 0
	for i, sq := range seqs {
		for j, tok := range sq.Tokens {
			p := sq.Pos + j
			s.pos[t], s.seq[t] = p, i
			s.slot[t] = int(sq.Pages[p/l.PageSize])*pageElems + (p%l.PageSize)*l.HeadDim
			x := s.x[t*dim : (t+1)*dim]
			// The embedding by vocabulary rows: a rank's own, zeros for
			// the others' (summed below).
			if v := int(tok) - r.vlo; v >= 0 && v < r.embed.rows {
				r.embed.row(v, x)
			} else {
				clear(x)
			}
			t++
		}
	}
	if err := r.allReduce(ctx, s.x[:n*dim]); err != nil {
		return err
	}
	// Many sequences, none too long, one rank: each thread runs whole
	// sequences through all layers (one hand-off per pass instead of
	// several per layer). Otherwise every step is split across the
	// threads by rows. Either way each value is computed by the same
	// kernels in the same order.
	if r.tp == 1 {
		if parts := r.seqSplit(seqs, n); parts > 1 {
			r.team.run(parts, s.seqFn)
			return ctx.Err()
		}
	}
	for li := range r.layers {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := r.layer(ctx, li, 0, n, 0, r.team); err != nil {
			return err
		}
		if r.id == 0 {
			// Every rank wrote layer li's KV before the layer's sums.
			layerDone(seqs, li)
		}
	}
	if r.tp == 1 {
		r.logits(0, len(seqs), 0, 0, 0, r.team)
		return nil
	}
	return r.logitsTP(ctx, m)
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
func (r *rank) seqSplit(seqs []compute.Seq, n int) int {
	s := &r.s
	parts := min(r.team.n, len(seqs))
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
	t, row, k := 0, 0, 0
	for i, sq := range seqs {
		if t >= n*k/parts && len(s.split) == k {
			s.split = append(s.split, i)
			s.tok0 = append(s.tok0, t)
			s.row0 = append(s.row0, row)
			k++
		}
		t += len(sq.Tokens)
		if sq.Logits {
			row++
		}
	}
	for len(s.split) < parts+1 {
		s.split = append(s.split, len(seqs))
		s.tok0 = append(s.tok0, t)
		s.row0 = append(s.row0, row)
	}
	return parts
}

// seqPart is thread k's share of a sequence-parallel pass.
func (r *rank) seqPart(k int) {
	s := &r.s
	t0, t1 := s.tok0[k], s.tok0[k+1]
	if t0 == t1 {
		return
	}
	for li := range r.layers {
		_ = r.layer(context.Background(), li, t0, t1, k, nil) // tp 1: no collectives, nothing fails
		layerDone(s.seqs[s.split[k]:s.split[k+1]], li)
	}
	r.logits(s.split[k], s.split[k+1], t0, s.row0[k], k, nil)
}

// layer runs layer li's blocks for tokens [t0, t1): split across tm, or
// all on thread k when tm is nil.
func (r *rank) layer(ctx context.Context, li, t0, t1, k int, tm *team) error {
	for _, blk := range r.layers[li] {
		if err := blk.run(ctx, r, li, t0, t1, k, tm); err != nil {
			return err
		}
	}
	return nil
}

// matmul runs mm across tm, or whole on the calling thread when tm is nil.
func (r *rank) matmul(mm *matJob, tm *team) {
	if len(mm.mats) == 0 {
		return
	}
	if tm == nil {
		mm.parts = 1
		mm.run(0)
		return
	}
	tm.run(mm.plan(tm), r.s.mmFn)
}

// normLast writes the final-normed last token of every seq of [i0, i1)
// that asks for logits, whose tokens start at t0, into s.lx rows from r0
// on, and returns the row after the last.
func (r *rank) normLast(i0, i1, t0, r0 int) int {
	c := &r.cfg
	s := &r.s
	dim := c.Dim
	t, row := t0, r0
	for _, sq := range s.seqs[i0:i1] {
		t += len(sq.Tokens)
		if sq.Logits {
			rmsnorm(s.lx[row*dim:(row+1)*dim], s.x[(t-1)*dim:t*dim], r.norm, c.NormEps)
			row++
		}
	}
	return row
}

// logits computes the logits of sequences [i0, i1), whose tokens start at
// t0, into logits rows from r0 on, and copies them out (tp 1).
func (r *rank) logits(i0, i1, t0, r0, k int, tm *team) {
	c := &r.cfg
	s := &r.s
	dim := c.Dim
	row := r.normLast(i0, i1, t0, r0)
	if row == r0 {
		return
	}
	mm := s.job(k)
	mm.reset()
	mm.set(s.lx[r0*dim:row*dim], row-r0)
	mm.add(&r.lmHead, s.logits[r0*c.Vocab:row*c.Vocab], nil)
	r.matmul(mm, tm)
	row = r0
	for i := i0; i < i1; i++ {
		if s.seqs[i].Logits {
			copy(s.out[i][:c.Vocab], s.logits[row*c.Vocab:(row+1)*c.Vocab])
			row++
		}
	}
}

// logitsTP computes the rank's vocabulary rows of the m logits rows and
// gathers every rank's; rank 0 copies them out.
func (r *rank) logitsTP(ctx context.Context, m int) error {
	c := &r.cfg
	s := &r.s
	dim, vs, rows := c.Dim, r.vshard, r.lmHead.rows
	if m == 0 {
		return nil
	}
	r.normLast(0, len(s.seqs), 0, 0)
	mm := s.job(0)
	mm.reset()
	mm.set(s.lx[:m*dim], m)
	mm.add(&r.lmHead, s.logits[:m*rows], nil)
	r.matmul(mm, r.team)
	send := s.lsend[:m*vs]
	for i := range m {
		copy(send[i*vs:i*vs+rows], s.logits[i*rows:(i+1)*rows])
		clear(send[i*vs+rows : (i+1)*vs])
	}
	recv := s.lrecv[:r.tp*m*vs]
	if err := r.allGather(ctx, send, recv); err != nil {
		return err
	}
	if s.out == nil {
		return nil
	}
	row := 0
	for i, sq := range s.seqs {
		if !sq.Logits {
			continue
		}
		for q := range r.tp {
			lo, hi := c.VocabRows(r.tp, q)
			copy(s.out[i][lo:hi], recv[(q*m+row)*vs:][:hi-lo])
		}
		row++
	}
	return nil
}
