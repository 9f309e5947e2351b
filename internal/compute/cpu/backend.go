// Package cpu is the CPU backend of compute.Model: a batched float32 forward
// pass over a paged KV pool in host memory, with AVX2/FMA kernels and a fixed
// reduction order, so a sequence's result does not depend on the batch it
// runs in, on how its prompt is chunked, or on the thread count. Each layer
// is composed from the model Spec's blocks (blocks.go); weights are read in
// their stored dtype (float32, or bfloat16 / half widened in the kernels).
//
// With tensor parallelism (NewTP) the model runs on tp ranks of one
// process, as SGLang shards it (model/shard.go): each rank its goroutine,
// its share of the threads, its block of every weight (views of the
// model's tensors) and its own KV pool of the heads it holds; the ranks sum
// and gather through a collective.Comm.
package cpu

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

var _ compute.Model = (*Backend)(nil)

// LayoutFor is the KV pool layout the CPU backend needs for cfg at tp 1:
// float32 elements, head-major pages of pageSize tokens, pages pages.
func LayoutFor(cfg model.Config, pageSize, pages int) kvcache.Layout {
	l := cfg.KVLayout(pageSize, pages, 4)
	l.Order = kvcache.HeadMajor
	return l
}

// ShardsFor are the KV pools of tp ranks of cfg: each rank's layout and
// the model's index of its first KV head.
func ShardsFor(cfg model.Config, tp, pageSize, pages int) []kvcache.Shard {
	return cfg.KVShards(tp, pageSize, pages, 4, kvcache.HeadMajor)
}

// Options configure a tensor-parallel backend. Zero values mean the
// defaults noted.
type Options struct {
	// Threads is the forward pass's threads in all, shared evenly by the
	// ranks (at least one each). 0: GOMAXPROCS.
	Threads int
	// Comms makes a communicator of tp ranks, again after a pass that
	// failed. nil: collective.NewLocal.
	Comms func(tp int) []collective.Comm
	// Logger gets each rank's start and failures (field tp_rank). nil: none.
	Logger *zap.Logger
	// Registerer gets the per-rank metrics (label tp_rank). nil: none.
	Registerer prometheus.Registerer
}

// Backend runs a model on the CPU, on one rank or tp. Forward calls are
// serialised.
type Backend struct {
	cfg    model.Config
	layout kvcache.Layout // the ranks' pools as one of every KV head
	opts   Options
	ranks  []*rank
	comms  []collective.Comm
	lg     *zap.Logger
	m      *compute.TPMetrics
	mu     sync.Mutex
	closed bool
}

// New makes a backend for m whose KV cache lives in pool (LayoutFor's
// layout). threads <= 0 means GOMAXPROCS. The backend reads m's tensors in
// place: m must stay open while it runs.
func New(m *model.Model, pool *kvcache.Pool, threads int) (*Backend, error) {
	return NewTP(m, []*kvcache.Pool{pool}, Options{Threads: threads})
}

// NewTP makes a backend for m on len(pools) tensor-parallel ranks, rank r
// keeping its KV cache in pools[r] (ShardsFor's layouts, one allocator for
// all: a page index names the same positions on every rank).
func NewTP(m *model.Model, pools []*kvcache.Pool, o Options) (*Backend, error) {
	if m == nil || !m.HasWeights() {
		return nil, fmt.Errorf("cpu: no model weights")
	}
	c := m.Config
	if c.Spec == nil {
		return nil, fmt.Errorf("cpu: model has no architecture")
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	tp := len(pools)
	if tp == 0 || pools[0] == nil {
		return nil, fmt.Errorf("cpu: no KV pool")
	}
	if err := c.CheckTP(tp); err != nil {
		return nil, fmt.Errorf("cpu: --tp-size %d: %w", tp, err)
	}
	l0 := pools[0].Layout
	want := ShardsFor(c, tp, l0.PageSize, l0.Pages)
	for r, p := range pools {
		if p == nil {
			return nil, fmt.Errorf("cpu: no KV pool for tp rank %d", r)
		}
		if err := p.Layout.Validate(); err != nil {
			return nil, err
		}
		if p.Layout != want[r].Layout {
			return nil, fmt.Errorf("cpu: tp rank %d: pool layout %+v does not fit the model (want %+v)", r, p.Layout, want[r].Layout)
		}
		if p.Alloc != pools[0].Alloc {
			return nil, fmt.Errorf("cpu: tp rank %d: the ranks' pools must share one page allocator", r)
		}
	}
	if o.Threads <= 0 {
		o.Threads = runtime.GOMAXPROCS(0)
	}
	if o.Comms == nil {
		o.Comms = collective.NewLocal
	}
	lg := o.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	b := &Backend{cfg: c, layout: LayoutFor(c, l0.PageSize, l0.Pages), opts: o, lg: lg.Named("cpu")}
	if tp > 1 {
		b.m = compute.NewTPMetrics(o.Registerer, tp, "all_reduce", "all_gather")
		b.comms = o.Comms(tp)
		if len(b.comms) != tp {
			return nil, fmt.Errorf("cpu: %d communicator ends for %d ranks", len(b.comms), tp)
		}
	}
	for r, p := range pools {
		lo, hi := span(r, tp, o.Threads)
		rk, err := newRank(m, r, tp, p, max(1, hi-lo))
		if err != nil {
			b.closeRanks()
			return nil, err
		}
		if tp > 1 {
			rk.comm = b.comms[r]
			rk.arSecs = b.m.Collective.WithLabelValues(rk.label, "all_reduce")
			rk.agSecs = b.m.Collective.WithLabelValues(rk.label, "all_gather")
		}
		b.ranks = append(b.ranks, rk)
		if tp > 1 {
			b.lg.Info("tp rank ready", zap.Int("tp_rank", r), zap.Int("tp_size", tp), zap.Ints("q_heads", []int{rk.qlo, rk.qhi}),
				zap.Int("first_kv_head", want[r].FirstHead), zap.Int("kv_heads", p.Layout.KVHeads), zap.Int("threads", rk.team.n),
				zap.Int64("kv_pool_bytes", p.Layout.TotalBytes()))
		}
	}
	return b, nil
}

// Config is the model's configuration.
func (b *Backend) Config() model.Config { return b.cfg }

// Layout is the KV pool's layout: with tp > 1 the ranks' pools seen as one
// of every KV head (each rank's is Shards' layout).
func (b *Backend) Layout() kvcache.Layout { return b.layout }

// TP is the number of tensor-parallel ranks.
func (b *Backend) TP() int { return len(b.ranks) }

// Close stops the worker threads.
func (b *Backend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.closed {
		b.closed = true
		b.closeRanks()
	}
	return nil
}

func (b *Backend) closeRanks() {
	for _, r := range b.ranks {
		r.team.close()
	}
	for _, c := range b.comms {
		c.Close()
	}
}

// Forward implements compute.Model.
func (b *Backend) Forward(ctx context.Context, seqs []compute.Seq, out [][]float32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("cpu: backend closed")
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	n, maxEnd, m, err := b.check(seqs, out)
	if err != nil || n == 0 {
		return err
	}
	if len(b.ranks) == 1 {
		return b.ranks[0].forward(ctx, seqs, out, n, maxEnd, m)
	}
	return b.forwardTP(ctx, seqs, out, n, maxEnd, m)
}

// forwardTP runs the pass on every rank at once (rank 0 on this goroutine,
// writing out). A rank that fails closes its end of the communicator, so
// the others stop waiting for it; the pass fails with the first rank's own
// error, and the next pass gets a fresh communicator.
func (b *Backend) forwardTP(ctx context.Context, seqs []compute.Seq, out [][]float32, n, maxEnd, m int) error {
	errs := make([]error, len(b.ranks))
	run := func(r *rank, out [][]float32) {
		start := time.Now()
		defer func() {
			if p := recover(); p != nil {
				errs[r.id] = fmt.Errorf("panic: %v", p)
				b.lg.Error("tp rank panicked", zap.Int("tp_rank", r.id), zap.Any("panic", p), zap.Stack("stack"))
			}
			if errs[r.id] != nil {
				r.comm.Close() // the others' waits for this rank end
			}
			b.m.Forward.WithLabelValues(r.label).Add(time.Since(start).Seconds())
		}()
		errs[r.id] = r.forward(ctx, seqs, out, n, maxEnd, m)
	}
	var wg sync.WaitGroup
	for _, r := range b.ranks[1:] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			run(r, nil)
		}()
	}
	run(b.ranks[0], out)
	wg.Wait()
	first := compute.FirstRankError(errs)
	if first == nil {
		return nil
	}
	b.m.Failures.WithLabelValues(b.ranks[first.Rank].label).Inc()
	b.lg.Warn("tp pass failed", zap.Int("tp_rank", first.Rank), zap.Error(first.Err))
	for _, c := range b.comms {
		c.Close()
	}
	b.comms = b.opts.Comms(len(b.ranks))
	for i, r := range b.ranks {
		r.comm = b.comms[i]
	}
	return first
}

// check validates seqs against the model and pool and returns the token
// count, the largest end position and the number of logits rows.
func (b *Backend) check(seqs []compute.Seq, out [][]float32) (n, maxEnd, m int, err error) {
	c := &b.cfg
	l := &b.layout
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

// team runs one function on n threads: the caller is thread 0.
type team struct {
	n  int
	ch []chan func(int)
	wg sync.WaitGroup
}

func newTeam(n int) *team {
	t := &team{n: n, ch: make([]chan func(int), n)}
	for k := 1; k < n; k++ {
		t.ch[k] = make(chan func(int))
		go func(k int, ch chan func(int)) {
			for f := range ch {
				f(k)
				t.wg.Done()
			}
		}(k, t.ch[k])
	}
	return t
}

// minWorkPerPart is the smallest job (in multiply-adds) worth a thread.
const minWorkPerPart = 1 << 16

// parts is how many threads a job of work multiply-adds uses.
func (t *team) parts(work int) int { return max(1, min(t.n, work/minWorkPerPart)) }

// run calls f(k) for k = 0..parts-1 concurrently and waits.
func (t *team) run(parts int, f func(int)) {
	if parts <= 1 {
		f(0)
		return
	}
	t.wg.Add(parts - 1)
	for k := 1; k < parts; k++ {
		t.ch[k] <- f
	}
	f(0)
	t.wg.Wait()
}

func (t *team) close() {
	for k := 1; k < t.n; k++ {
		close(t.ch[k])
	}
}

// span is part k's share [lo, hi) of n items split evenly into parts.
func span(k, parts, n int) (int, int) {
	return n * k / parts, n * (k + 1) / parts
}
