package cpu

import (
	"context"
	"fmt"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// rank is one tensor-parallel rank (tp 1: the whole model): its block of
// every weight, its KV pool, its threads and activations. cfg is its shape:
// the model's, with its query and KV heads and its share of every
// intermediate dimension.
type rank struct {
	id, tp   int
	label    string // tp_rank
	cfg      model.Config
	pool     *kvcache.Pool
	kv       []float32 // the pool's memory as float32
	rope     *rope
	team     *team
	comm     collective.Comm    // nil at tp 1
	arSecs   prometheus.Counter // time in all-reduces and all-gathers (tp > 1)
	agSecs   prometheus.Counter
	qlo, qhi int // query heads
	vlo      int // first vocabulary row of embed and lmHead
	vshard   int // vocabulary rows per rank (the gathered logits' stride)
	embed    wmat
	norm     []float32
	lmHead   wmat
	layers   [][]block // per layer, the Spec's blocks in order
	s        scratch
}

func newRank(m *model.Model, id, tp int, pool *kvcache.Pool, threads int) (*rank, error) {
	c := m.Config
	l := pool.Layout
	if int64(len(pool.Mem)) != l.TotalBytes() || uintptr(unsafe.Pointer(unsafe.SliceData(pool.Mem)))%4 != 0 {
		return nil, fmt.Errorf("cpu: tp rank %d: pool memory is %d bytes or misaligned, layout needs %d", id, len(pool.Mem), l.TotalBytes())
	}
	r := &rank{id: id, tp: tp, label: fmt.Sprint(id), pool: pool,
		kv:   unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(pool.Mem))), len(pool.Mem)/4),
		rope: newRope(&c)}
	r.qlo, r.qhi = c.QHeads(tp, id)
	r.cfg = c
	r.cfg.Heads, r.cfg.KVHeads = r.qhi-r.qlo, l.KVHeads
	r.cfg.HiddenDim = splitLen(c.HiddenDim, tp, id)
	r.cfg.ExpertDim = splitLen(c.ExpertDim, tp, id)
	r.cfg.SharedExpertDim = splitLen(c.SharedExpertDim, tp, id)
	if err := r.build(m); err != nil {
		return nil, err
	}
	r.team = newTeam(threads)
	r.s.init(r)
	return r, nil
}

func splitLen(n, tp, r int) int {
	lo, hi := model.Split(n, tp, r)
	return hi - lo
}

// build composes every layer from the Spec's blocks and binds the rank's
// blocks of the weights: q/k/v by their heads' rows and o by its columns,
// gate and up by rows and down by columns (every expert's, the shared
// expert's), the embedding and the classifier by vocabulary rows.
func (r *rank) build(m *model.Model) error {
	c := &m.Config
	tp, id := r.tp, r.id
	hd := c.HeadDim
	var err error
	mat := func(t *model.Tensor) wmat {
		if err != nil {
			return wmat{}
		}
		var w wmat
		w, err = newWmat(t)
		return w
	}
	sub := func(v []float32, lo, hi int) []float32 {
		if v == nil {
			return nil
		}
		return v[lo:hi]
	}
	for _, d := range []struct {
		name string
		n    int
	}{{"intermediate_size", c.HiddenDim}, {"moe_intermediate_size", c.ExpertDim}, {"shared_expert_intermediate_size", c.SharedExpertDim}} {
		if d.n > 0 && d.n < tp {
			return fmt.Errorf("cpu: %s %d does not split over %d ranks", d.name, d.n, tp)
		}
	}
	if c.Vocab < tp {
		return fmt.Errorf("cpu: vocabulary of %d does not split over %d ranks", c.Vocab, tp)
	}
	r.vshard = c.VocabShard(tp)
	vlo, vhi := c.VocabRows(tp, id)
	r.vlo = vlo
	embed := mat(m.Embed)
	r.embed = embed.rowsOf(vlo, vhi)
	if m.LMHead == m.Embed {
		r.lmHead = r.embed
	} else {
		lm := mat(m.LMHead)
		r.lmHead = lm.rowsOf(vlo, vhi)
	}
	r.norm = vec(m.Norm)
	q0, q1 := r.qlo*hd, r.qhi*hd
	klo, _ := c.KVHeadsOf(tp, id)
	k0, k1 := klo*hd, (klo+r.cfg.KVHeads)*hd
	spec := c.Spec
	r.layers = make([][]block, c.Layers)
	for i := range m.Layers {
		l := &m.Layers[i]
		q, k, v, o := mat(l.Q), mat(l.K), mat(l.V), mat(l.O)
		a := &attnBlock{norm: vec(l.AttnNorm), q: q.rowsOf(q0, q1), k: k.rowsOf(k0, k1), v: v.rowsOf(k0, k1), o: o.colsOf(q0, q1),
			window: c.Window(i)}
		if spec.Attention.QKVBias {
			a.bq, a.bk, a.bv = sub(vec(l.QBias), q0, q1), sub(vec(l.KBias), k0, k1), sub(vec(l.VBias), k0, k1)
		}
		if spec.Attention.QKNorm {
			a.qNorm, a.kNorm = vec(l.QNorm), vec(l.KNorm)
		}
		ffn := func(e model.Expert, n int) swiglu {
			lo, hi := model.Split(n, tp, id)
			g, u, d := mat(e.Gate), mat(e.Up), mat(e.Down)
			return swiglu{gate: g.rowsOf(lo, hi), up: u.rowsOf(lo, hi), down: d.colsOf(lo, hi)}
		}
		var mlp block
		if c.MoELayer(i) {
			e := &moeBlock{norm: vec(l.MLPNorm), router: mat(l.Router), experts: make([]swiglu, len(l.Experts))}
			for j, x := range l.Experts {
				e.experts[j] = ffn(x, c.ExpertDim)
			}
			if spec.MLP.SharedExpert {
				sh := ffn(l.Shared, c.SharedExpertDim)
				e.shared = &sh
				e.sharedGate = mat(l.SharedGate)
			}
			mlp = e
		} else {
			mlp = &denseBlock{norm: vec(l.MLPNorm), ffn: ffn(model.Expert{Gate: l.Gate, Up: l.Up, Down: l.Down}, c.HiddenDim)}
		}
		r.layers[i] = []block{a, mlp}
	}
	if err != nil {
		return err
	}
	if embed.rows != c.Vocab || embed.in != c.Dim || r.lmHead.rows != vhi-vlo {
		return fmt.Errorf("cpu: embedding %dx%d, classifier %d rows for vocab %d dim %d", embed.rows, embed.in,
			r.lmHead.rows, c.Vocab, c.Dim)
	}
	return nil
}

// allReduce sums v over the ranks (nothing at tp 1).
func (r *rank) allReduce(ctx context.Context, v []float32) error {
	if r.comm == nil {
		return nil
	}
	start := time.Now()
	err := r.comm.AllReduce(ctx, collective.Host(v))
	r.arSecs.Add(time.Since(start).Seconds())
	return err
}

// allGather gathers every rank's send into recv.
func (r *rank) allGather(ctx context.Context, send, recv []float32) error {
	start := time.Now()
	err := r.comm.AllGather(ctx, collective.Host(send), collective.Host(recv))
	r.agSecs.Add(time.Since(start).Seconds())
	return err
}
