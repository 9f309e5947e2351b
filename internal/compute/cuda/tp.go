package cuda

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	"github.com/mooncake-go/mooncake-go/internal/collective/nccl"
	"github.com/mooncake-go/mooncake-go/internal/compute"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

var (
	_ compute.Model         = (*TP)(nil)
	_ compute.DeviceSampler = (*TP)(nil)
	_ compute.AsyncSampler  = (*TP)(nil)
)

// CommsFunc makes the communicators of ranks on GPUs devs, rank r
// enqueuing on streams[r].
type CommsFunc func(devs []int, streams []*cu.Stream) ([]collective.Comm, error)

// NCCLComms is the default CommsFunc: NCCL, all ranks made together.
func NCCLComms(devs []int, streams []*cu.Stream) ([]collective.Comm, error) {
	cs, err := nccl.NewComms(devs, streams)
	if err != nil {
		return nil, err
	}
	out := make([]collective.Comm, len(cs))
	for i, c := range cs {
		out[i] = c
	}
	return out, nil
}

// TPOptions configure NewTP.
type TPOptions struct {
	Size int // ranks
	// Devices are the ranks' GPUs; nil: Options.Device + r for rank r.
	Devices []int
	// Comms makes the communicators; nil: NCCLComms. One whose
	// communicators cannot be captured (no Capturable method returning
	// true) turns the CUDA graphs off.
	Comms      CommsFunc
	Registerer prometheus.Registerer // the per-rank metrics (tp_rank); nil: unregistered
}

// TP is a model split over tensor-parallel ranks, one Backend each
// (shard.go): a pass runs on every rank at once, each from its own
// goroutine and stream, and rank 0 returns the logits (or samples).
type TP struct {
	cfg    model.Config
	ranks  []*Backend
	devs   []int
	comms  []collective.Comm
	mk     CommsFunc
	met    *compute.TPMetrics // tp > 1
	lg     *zap.Logger
	mu     sync.Mutex
	closed bool
	lastMu sync.Mutex
	last   []compute.Sampled // tp > 1: the last StartSample pass's results (nil: failed, or none); lastMu
}

// NewTP loads m over o.Size ranks. opts apply to every rank (Device: the
// first rank's GPU, unless o.Devices says otherwise). With opts.Pages 0,
// rank 0 sizes its pool from MemFraction and the others take as many
// pages (a page index names the same positions on every rank).
func NewTP(m *model.Model, opts Options, o TPOptions) (_ *TP, err error) {
	if m == nil {
		return nil, errors.New("cuda backend: no model")
	}
	tp := o.Size
	if err := m.Config.CheckTP(tp); err != nil {
		return nil, fmt.Errorf("cuda backend: --tp-size %d: %w", tp, err)
	}
	devs := o.Devices
	if devs == nil {
		for r := range tp {
			devs = append(devs, opts.Device+r)
		}
	}
	if len(devs) != tp {
		return nil, fmt.Errorf("cuda backend: %d GPUs for %d tensor-parallel ranks", len(devs), tp)
	}
	t := &TP{cfg: m.Config, devs: devs, mk: o.Comms, lg: opts.Logger}
	if t.mk == nil {
		t.mk = NCCLComms
	}
	if t.lg == nil {
		t.lg = zap.NewNop()
	}
	defer func() {
		if err != nil {
			t.release()
		}
	}()
	for r := range tp {
		ro := opts
		ro.Device = devs[r]
		if r > 0 {
			ro.Pages = t.ranks[0].layout.Pages
		}
		if ro.Logger != nil {
			ro.Logger = ro.Logger.With(zap.Int("tp_rank", r))
		}
		b, err := newRank(m, ro, tp, r)
		if err != nil {
			return nil, fmt.Errorf("cuda backend: tp rank %d (GPU %d): %w", r, devs[r], err)
		}
		t.ranks = append(t.ranks, b)
	}
	if err := t.connect(); err != nil {
		return nil, err
	}
	if tp > 1 {
		t.met = compute.NewTPMetrics(o.Registerer, tp)
	}
	if tp > 1 && !t.ranks[0].sh.capturable() {
		t.lg.Info("CUDA graphs off: the tensor-parallel communicator cannot be captured")
		for _, b := range t.ranks {
			b.gmode = graphsOff
		}
	}
	for r, b := range t.ranks {
		t.lg.Info("tp rank ready", zap.Int("tp_rank", r), zap.Int("tp_size", tp), zap.Int("gpu", devs[r]),
			zap.Ints("q_heads", []int{b.sh.qlo, b.sh.qlo + b.cfg.Heads}), zap.Int("first_kv_head", b.sh.klo),
			zap.Int("kv_heads", b.cfg.KVHeads), zap.Ints("vocab_rows", []int{b.sh.vlo, b.sh.vlo + b.sh.vrows}),
			zap.Int64("weight_bytes", b.w.bytes), zap.Uint64("kv_pool_bytes", b.kvSize))
	}
	return t, nil
}

// connect makes the ranks' communicators (none at tp 1).
func (t *TP) connect() error {
	if len(t.ranks) == 1 {
		return nil
	}
	streams := make([]*cu.Stream, len(t.ranks))
	for i, b := range t.ranks {
		streams[i] = b.stream
	}
	cs, err := t.mk(t.devs, streams)
	if err != nil {
		return fmt.Errorf("cuda backend: communicators of %d ranks: %w", len(t.ranks), err)
	}
	if len(cs) != len(t.ranks) {
		for _, c := range cs {
			c.Close()
		}
		return fmt.Errorf("cuda backend: %d communicator ends for %d ranks", len(cs), len(t.ranks))
	}
	t.comms = cs
	for i, b := range t.ranks {
		b.sh.comm = cs[i]
	}
	return nil
}

// abort ends every rank's communicator at once (NCCL: ncclCommAbort), so
// the ranks still waiting for failed rank first stop; first's end goes
// first, so the others' errors name it.
func (t *TP) abort(first int) {
	for i := range t.comms {
		c := t.comms[(first+i)%len(t.comms)]
		if a, ok := c.(interface{ Abort() }); ok {
			a.Abort()
		} else {
			c.Close()
		}
	}
}

// Config is the whole model's configuration.
func (t *TP) Config() model.Config { return t.cfg }

// Layout is the ranks' KV pools seen as one pool of every KV head (each
// rank's is Shards' layout).
func (t *TP) Layout() kvcache.Layout {
	l := t.ranks[0].layout
	return LayoutFor(t.cfg, t.ranks[0].opts.DType, l.PageSize, l.Pages)
}

// Shards are the ranks' KV pools: each one's layout and first KV head.
func (t *TP) Shards() []kvcache.Shard {
	out := make([]kvcache.Shard, len(t.ranks))
	for i, b := range t.ranks {
		out[i] = kvcache.Shard{Layout: b.layout, FirstHead: b.sh.klo}
	}
	return out
}

// Ranks are the ranks' backends (their KV pools, for registration with
// the transfer engine). Passes go through t only.
func (t *TP) Ranks() []*Backend { return t.ranks }

// Devices are the ranks' GPUs.
func (t *TP) Devices() []int { return t.devs }

// DType is "bfloat16" or "float32".
func (t *TP) DType() string { return t.ranks[0].opts.DType }

// Forward implements compute.Model.
func (t *TP) Forward(ctx context.Context, seqs []compute.Seq, out [][]float32) error {
	return t.pass(ctx, seqs, out, func(b *Backend) error { return b.forwardOpt(ctx, seqs, out, true) })
}

// NewSamplerState implements compute.DeviceSampler (rank 0 samples).
func (t *TP) NewSamplerState(p sampling.Params, seed uint64, prompt []int32) (compute.SamplerState, error) {
	return t.ranks[0].NewSamplerState(p, seed, prompt)
}

// ForwardSample implements compute.DeviceSampler: rank 0 samples.
func (t *TP) ForwardSample(ctx context.Context, seqs []compute.Seq, samp []compute.Sample, res []compute.Sampled) error {
	return t.pass(ctx, seqs, nil, func(b *Backend) error { return b.ForwardSample(ctx, seqs, samp, res) })
}

// StartSample implements compute.AsyncSampler: one rank queues its passes
// (Backend.StartSample); several run each pass to its end here, the tokens
// taken from the pass before read from its results.
func (t *TP) StartSample(ctx context.Context, seqs []compute.Seq, samp []compute.Sample, from []int) (compute.Pending, error) {
	if len(t.ranks) == 1 {
		return t.ranks[0].StartSample(ctx, seqs, samp, from)
	}
	if len(from) != 0 && len(from) != len(seqs) {
		return nil, fmt.Errorf("cuda backend: %d token sources for %d seqs", len(from), len(seqs))
	}
	t.lastMu.Lock()
	defer t.lastMu.Unlock()
	last := t.last
	t.last = nil
	in := seqs
	for i, f := range from {
		if f < 0 {
			continue
		}
		if f >= len(last) || last[f].Token < 0 || len(seqs[i].Tokens) != 1 {
			return nil, fmt.Errorf("cuda backend: seq %d takes its token from seq %d of the last pass, which sampled none", i, f)
		}
		if &in[0] == &seqs[0] {
			in = slices.Clone(seqs)
		}
		in[i].Tokens = []int32{int32(last[f].Token)}
	}
	res := make([]compute.Sampled, len(seqs))
	for i := range res {
		res[i].Token = -1
	}
	if err := t.ForwardSample(ctx, in, samp, res); err != nil {
		return nil, err
	}
	t.last = res
	return donePass(res), nil
}

// donePass is a pass that ran to its end in StartSample.
type donePass []compute.Sampled

func (d donePass) Wait(res []compute.Sampled) error {
	for i, r := range d {
		if r.Token >= 0 {
			res[i] = r
		}
	}
	return nil
}

// pass runs one pass: lead on rank 0 (this goroutine), the same pass with
// no logits copy and no layer calls on the others. The first rank that
// fails aborts the communicators, so the others stop; the pass then fails
// with that rank's error and the next pass gets new communicators.
func (t *TP) pass(ctx context.Context, seqs []compute.Seq, out [][]float32, lead func(*Backend) error) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return errors.New("cuda backend: closed")
	}
	if len(t.ranks) == 1 {
		return lead(t.ranks[0])
	}
	if t.comms == nil {
		if err := t.connect(); err != nil {
			return err
		}
	}
	// Bad input fails here, before any rank enqueues a collective.
	if _, _, err := t.ranks[0].check(seqs, out, out != nil); err != nil {
		return err
	}
	bare := seqs
	for i := range seqs {
		if seqs[i].Layer != nil {
			bare = make([]compute.Seq, len(seqs))
			copy(bare, seqs)
			for j := range bare {
				bare[j].Layer = nil
			}
			break
		}
	}
	errs := make([]error, len(t.ranks))
	var once sync.Once
	run := func(r int, f func() error) {
		start := time.Now()
		defer func() {
			if p := recover(); p != nil {
				errs[r] = fmt.Errorf("panic: %v", p)
				t.lg.Error("tp rank panicked", zap.Int("tp_rank", r), zap.Any("panic", p), zap.Stack("stack"))
			}
			if errs[r] != nil {
				once.Do(func() { t.abort(r) })
			}
			t.met.Forward.WithLabelValues(fmt.Sprint(r)).Add(time.Since(start).Seconds())
		}()
		errs[r] = f()
	}
	var wg sync.WaitGroup
	for r, b := range t.ranks[1:] {
		wg.Go(func() { run(r+1, func() error { return b.forwardOpt(ctx, bare, nil, false) }) })
	}
	run(0, func() error { return lead(t.ranks[0]) })
	wg.Wait()
	first := compute.FirstRankError(errs)
	if first == nil {
		return nil
	}
	t.met.Failures.WithLabelValues(fmt.Sprint(first.Rank)).Inc()
	t.lg.Warn("tp pass failed", zap.Int("tp_rank", first.Rank), zap.Error(first.Err))
	for _, c := range t.comms {
		c.Close()
	}
	t.comms = nil
	for _, b := range t.ranks {
		b.sh.comm = nil
	}
	if err := t.connect(); err != nil {
		t.lg.Warn("tp communicators not remade (the next pass tries again)", zap.Error(err))
	}
	return first
}

// Close frees every rank.
func (t *TP) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	return t.release()
}

func (t *TP) release() error {
	var errs []error
	for _, c := range t.comms {
		errs = append(errs, c.Close())
	}
	t.comms = nil
	for _, b := range t.ranks {
		errs = append(errs, b.Close())
	}
	return errors.Join(errs...)
}
