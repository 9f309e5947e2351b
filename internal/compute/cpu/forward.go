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
	want   []int       // seq index of each logits row

	seqs []compute.Seq
	mm   matJob
	at   attnJob
	mmFn func(int)
	atFn func(int)
}

func (s *scratch) init(b *Backend) {
	s.scores = make([][]float32, b.team.n)
	s.mmFn = s.mm.run
	s.atFn = func(k int) { b.attentionPart(k) }
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
	dim, qd, kvd := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
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
	layerElems := l.Pages * pageElems
	for li := range b.m.W.Layers {
		if err := ctx.Err(); err != nil {
			return err
		}
		w := &b.m.W.Layers[li]
		for t := 0; t < n; t++ {
			rmsnorm(s.xb[t*dim:(t+1)*dim], s.x[t*dim:(t+1)*dim], w.AttnNorm, c.NormEps)
		}
		s.mm.set(s.xb, n, dim)
		s.mm.add(w.WQ, qd, s.q, w.BQ)
		s.mm.add(w.WK, kvd, s.k, w.BK)
		s.mm.add(w.WV, kvd, s.v, w.BV)
		b.team.run(s.mm.plan(b.team), s.mmFn)
		s.mm.bias()
		kBase := (2 * li) * layerElems
		vBase := kBase + layerElems
		for t := 0; t < n; t++ {
			q := s.q[t*qd : (t+1)*qd]
			k := s.k[t*kvd : (t+1)*kvd]
			b.rope.apply(q, c.Heads, s.pos[t])
			b.rope.apply(k, c.KVHeads, s.pos[t])
			copy(b.kv[kBase+s.slot[t]:kBase+s.slot[t]+kvd], k)
			copy(b.kv[vBase+s.slot[t]:vBase+s.slot[t]+kvd], s.v[t*kvd:(t+1)*kvd])
		}
		work := 0
		for t := 0; t < n; t++ {
			work += (s.pos[t] + 1) * 2 * qd
		}
		s.at = attnJob{n: n, kBase: kBase, vBase: vBase, pageElems: pageElems, parts: b.team.parts(work)}
		b.team.run(s.at.parts, s.atFn)
		s.mm.set(s.att, n, qd)
		s.mm.add(w.WO, dim, s.xb2, nil)
		b.team.run(s.mm.plan(b.team), s.mmFn)
		addTo(s.x[:n*dim], s.xb2[:n*dim])

		for t := 0; t < n; t++ {
			rmsnorm(s.xb[t*dim:(t+1)*dim], s.x[t*dim:(t+1)*dim], w.FFNNorm, c.NormEps)
		}
		s.mm.set(s.xb, n, dim)
		s.mm.add(w.W1, c.HiddenDim, s.hb, nil)
		s.mm.add(w.W3, c.HiddenDim, s.hb2, nil)
		b.team.run(s.mm.plan(b.team), s.mmFn)
		for t := 0; t < n; t++ {
			siluMul(s.hb[t*c.HiddenDim:(t+1)*c.HiddenDim], s.hb2[t*c.HiddenDim:(t+1)*c.HiddenDim])
		}
		s.mm.set(s.hb, n, c.HiddenDim)
		s.mm.add(w.W2, dim, s.xb2, nil)
		b.team.run(s.mm.plan(b.team), s.mmFn)
		addTo(s.x[:n*dim], s.xb2[:n*dim])
	}
	if m == 0 {
		return nil
	}
	s.want = s.want[:0]
	t = 0
	for i, sq := range seqs {
		t += len(sq.Tokens)
		if sq.Logits {
			r := len(s.want)
			rmsnorm(s.lx[r*dim:(r+1)*dim], s.x[(t-1)*dim:t*dim], b.m.W.Norm, c.NormEps)
			s.want = append(s.want, i)
		}
	}
	s.mm.set(s.lx, m, dim)
	s.mm.add(b.m.W.LMHead, c.Vocab, s.logits, nil)
	b.team.run(s.mm.plan(b.team), s.mmFn)
	for r, i := range s.want {
		copy(out[i][:c.Vocab], s.logits[r*c.Vocab:(r+1)*c.Vocab])
	}
	return nil
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
	n            int
	kBase, vBase int
	pageElems    int
	parts        int
}

// attentionPart computes thread k's share of (token, kv head) pairs: for
// each query head of the group, scores over positions 0..pos in order, a
// softmax, and the weighted sum of values in position order.
func (b *Backend) attentionPart(k int) {
	c := &b.cfg
	s := &b.s
	a := &s.at
	hd, kvd, qd := c.HeadDim, c.KVHeads*c.HeadDim, c.Heads*c.HeadDim
	ps := b.pool.PageSize
	group := c.Heads / c.KVHeads
	scale := float32(math.Sqrt(float64(hd)))
	lo, hi := span(k, a.parts, a.n*c.KVHeads)
	sc := s.scores[k]
	for task := lo; task < hi; task++ {
		t, g := task/c.KVHeads, task%c.KVHeads
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
