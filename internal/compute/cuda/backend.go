// Package cuda is the CUDA backend of compute.Model: the forward pass of the
// registered architectures' blocks (blocks.go; not sliding-window attention)
// on one NVIDIA GPU, with weights in bf16 (or f32 for exactness checks), the
// KV cache in a paged pool in GPU memory (one VMM allocation that can be
// exported to another process), GEMMs through cuBLAS and the other kernels
// (csrc/llama/*.cu) compiled at start by NVRTC for the device found.
//
// All GPU work of a backend runs on one stream of its own (non-blocking, so
// it neither waits for nor blocks the legacy default stream, and can be
// captured); cuBLAS runs on it with a fixed workspace. Forward calls are
// serialised and lock their goroutine to an OS thread (cuBLAS uses the
// thread's current context; a capture must end on the thread that began
// it). A pass is planned first (plan.go: a pure function of the batch),
// then enqueued; pure-decode passes replay CUDA graphs (graphs.go).
package cuda

import (
	"cmp"
	"errors"
	"fmt"
	"runtime"
	"sync"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/cublas"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

var _ compute.Model = (*Backend)(nil)

// Options configure a Backend. Zero values: GPU 0, bfloat16, 64-token pages,
// pages sized from MemFraction (0.85 of the GPU's memory for weights and KV),
// cuBLAS GEMMs, weights from the model.
type Options struct {
	Device   int
	DType    string // "bfloat16" (default) or "float32" (no TF32 anywhere)
	PageSize int    // tokens per KV page
	Pages    int    // KV pool pages; 0: sized from MemFraction
	// MemFraction is SGLang's mem-fraction-static: the share of the GPU's
	// total memory for weights + KV pool, used when Pages is 0.
	MemFraction float64
	// BatchInvariant runs the GEMMs with this package's own kernels (fixed
	// k order per output element, whatever the batch) instead of cuBLAS,
	// whose kernel choice depends on the token count. Slower.
	BatchInvariant bool
	// RandomWeights makes seeded random weights on the GPU (uniform, std
	// 0.02; norms 1) instead of uploading m's tensors, which it may lack: for
	// benchmarks of large shapes.
	RandomWeights bool
	Seed          int64
	// NoFlashPrefill sends prefill chunks through the split-K kernel instead
	// of the tensor-core flash-attention kernel (for tests).
	NoFlashPrefill bool
	// DisableCUDAGraph runs every pass eagerly (SGLang's
	// --disable-cuda-graph); else pure-decode passes of at most
	// CUDAGraphMaxBS seqs replay CUDA graphs.
	DisableCUDAGraph bool
	// CUDAGraphMaxBS is the largest batch bucket captured (SGLang's
	// --cuda-graph-max-bs); 0: 256. The graph buffers are sized for it.
	CUDAGraphMaxBS int
	// TimeSteps records events around every pass for StepTimes (GPU time
	// per pass and the idle gap between passes).
	TimeSteps   bool
	KernelCache cu.KernelsConfig
	Logger      *zap.Logger // nil: no logs

	tune tuning
}

// Validate reports options that cannot work.
func (o *Options) Validate() error {
	switch o.DType {
	case "", "auto", "bfloat16", "float32":
	default:
		return fmt.Errorf("cuda backend: dtype %q not supported (bfloat16 or float32)", o.DType)
	}
	if o.PageSize < 0 || o.Pages < 0 || o.Device < 0 {
		return fmt.Errorf("cuda backend: negative device, page size or pages")
	}
	if o.CUDAGraphMaxBS < 0 {
		return fmt.Errorf("cuda backend: CUDA graph max batch size %d < 0", o.CUDAGraphMaxBS)
	}
	if o.MemFraction < 0 || o.MemFraction > 1 {
		return fmt.Errorf("cuda backend: mem fraction %g outside [0, 1]", o.MemFraction)
	}
	return nil
}

// LayoutFor is the KV pool layout the CUDA backend uses for cfg.
func LayoutFor(cfg model.Config, dtype string, pageSize, pages int) kvcache.Layout {
	eb := 2
	if dtype == "float32" {
		eb = 4
	}
	return kvcache.Layout{Layers: cfg.Layers, PageSize: pageSize, KVHeads: cfg.KVHeads,
		HeadDim: cfg.HeadDim, ElemBytes: eb, Pages: pages}
}

// Backend runs a model on one GPU: all of it, or one tensor-parallel
// rank's share (shard.go; NewTP).
type Backend struct {
	cfg    model.Config // the rank's shape (the model's at tp 1)
	sh     rankShard
	opts   Options
	bf16   bool
	eb     int // bytes per element of T
	lg     *zap.Logger
	dev    cu.Device
	cx     *cu.Context
	stream *cu.Stream // every kernel, copy and GEMM of the backend
	blas   *cublas.Handle
	mod    *cu.Module
	fn     kernels
	bk     blockKernels // the blocks beyond Llama's (nil functions when the Spec has none)
	moe    moeBufs
	w      devWeights
	layout kvcache.Layout
	kvPool *cu.Pool     // VMM pool (nil when the fallback allocation is used)
	kvBase cu.DevicePtr // KV pool base address
	kvSize uint64
	kvOwn  bool         // kvBase from MemAlloc
	flash  bool         // tensor-core prefill attention available
	rope   cu.DevicePtr // RoPE inverse frequencies, f64 [HeadDim/2]
	allocs []cu.DevicePtr
	s      scratch
	mu     sync.Mutex
	closed bool

	// ropeTab is the f32 (cos, sin) table [ropeN positions][HeadDim/2] that
	// rope_kv reads (made by rope_table at load time).
	ropeTab cu.DevicePtr
	ropeN   int

	// layerEv[l] is recorded after layer l's KV writes when a seq asked
	// for layer calls (compute.Seq.Layer); re-recorded by later passes.
	layerEv []*cu.Event

	pc     planConfig
	graphs *graphSet  // nil: CUDA graphs off
	gmode  int        // graphsOn, or a test's graphsOff / graphsPadded
	tm     *stepTimer // nil unless Options.TimeSteps
	smp    sampler    // sampling on the GPU (sample.go)
	q      queue      // sampling passes in flight (async.go)
}

// New loads m onto GPU opts.Device. Errors from a missing driver wrap
// cuda.ErrNoDriver (or cuda.ErrNoDevice); a missing cuBLAS wraps
// cublas.ErrNoLibrary; a missing NVRTC wraps cuda.ErrNoNVRTC.
func New(m *model.Model, opts Options) (*Backend, error) {
	if m == nil {
		return nil, errors.New("cuda backend: no model")
	}
	return newRank(m, opts, 1, 0)
}

// newRank loads rank r of tp's share of m onto GPU opts.Device; its
// communicator is set before its first pass.
func newRank(m *model.Model, opts Options, tp, r int) (_ *Backend, err error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	c := m.Config
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if err := Supports(c); err != nil {
		return nil, err
	}
	if c.HeadDim%8 != 0 {
		return nil, fmt.Errorf("cuda backend: head dim %d is not a multiple of 8", c.HeadDim)
	}
	if !opts.RandomWeights && !m.HasWeights() {
		return nil, errors.New("cuda backend: model has no weights (and RandomWeights is off)")
	}
	if opts.DType == "" || opts.DType == "auto" {
		opts.DType = "bfloat16"
	}
	if opts.PageSize == 0 {
		opts.PageSize = 64
	}
	if opts.MemFraction == 0 {
		opts.MemFraction = 0.85
	}
	sh, rc := shardOf(c, tp, r)
	b := &Backend{cfg: rc, sh: sh, opts: opts, bf16: opts.DType == "bfloat16", lg: opts.Logger}
	if b.lg == nil {
		b.lg = zap.NewNop()
	}
	b.eb = 4
	if b.bf16 {
		b.eb = 2
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if b.dev, err = cu.GetDevice(opts.Device); err != nil {
		return nil, fmt.Errorf("cuda backend: GPU %d: %w", opts.Device, err)
	}
	if b.cx, err = b.dev.Retain(); err != nil {
		return nil, fmt.Errorf("cuda backend: GPU %d: %w", opts.Device, err)
	}
	defer func() {
		if err != nil {
			b.release()
		}
	}()
	if err = b.cx.SetCurrent(); err != nil {
		return nil, err
	}
	if b.stream, err = b.cx.NewStream(cu.StreamNonBlocking); err != nil {
		return nil, fmt.Errorf("cuda backend: stream: %w", err)
	}
	if b.blas, err = cublas.Create(); err != nil {
		return nil, fmt.Errorf("cuda backend: %w", err)
	}
	// SetStream resets the workspace to cuBLAS's own pool: set ours after.
	if err = b.blas.SetStream(b.stream.Handle()); err != nil {
		return nil, err
	}
	ws, err := b.alloc(cublasWorkspace)
	if err != nil {
		return nil, fmt.Errorf("cuda backend: cuBLAS workspace: %w", err)
	}
	if werr := b.blas.SetWorkspace(uint64(ws), cublasWorkspace); werr != nil {
		b.lg.Warn("cuBLAS workspace not set: captured GEMMs may allocate their own", zap.Error(werr))
	}
	if !b.bf16 {
		// Pedantic math: no TF32, no reduced-precision reductions.
		if err = b.blas.SetMathMode(cublas.PedanticMath); err != nil {
			return nil, err
		}
	}
	if err = b.loadKernels(); err != nil {
		return nil, err
	}
	if err = b.loadGrouped(); err != nil {
		return nil, err
	}
	b.loadSampler()
	if err = b.uploadWeights(m); err != nil {
		return nil, err
	}
	b.pc = planConfig{pageSize: opts.PageSize, split: b.fn.split, heads: rc.Heads, kvHeads: rc.KVHeads, headDim: c.HeadDim,
		dim: c.Dim, hidden: rc.HiddenDim, vocab: c.Vocab, lmExtra: sh.lmExtra(), eb: b.eb, flash: b.flash && !opts.NoFlashPrefill,
		maxSeqLen: c.MaxSeqLen, partBudget: partBudget}
	if c.Spec.MLP.MoE && !b.moeCapturable() && !opts.DisableCUDAGraph {
		// Without the grouped expert GEMMs each MoE block waits for the host.
		b.lg.Info("CUDA graphs off: this build's MoE blocks run one GEMM per expert, after a host step",
			zap.String("architecture", c.ArchName()), zap.Bool("bf16", b.bf16))
	} else if !opts.DisableCUDAGraph {
		if b.graphs, err = b.newGraphs(cmp.Or(opts.CUDAGraphMaxBS, defaultGraphMaxBS)); err != nil {
			return nil, err
		}
		b.lg.Info("CUDA graphs for decode", zap.Ints("batch_buckets", b.graphs.buckets),
			zap.Int("split_buckets", len(splitBuckets(b.graphs.maxSplits))), zap.Int("keys_per_split", b.fn.split),
			zap.Int("graphs_per_bucket", graphsPerBucket),
			zap.Uint64("buffer_bytes", b.graphs.sizes.total()), zap.Uint64("logits_bytes", b.graphs.sizes.logits),
			zap.Uint64("partials_bytes", b.graphs.sizes.part), zap.Uint64("cublas_workspace_bytes", cublasWorkspace))
	} else {
		b.lg.Info("CUDA graphs off: every pass runs eagerly")
	}
	if opts.TimeSteps {
		if b.tm, err = newStepTimer(b.cx); err != nil {
			return nil, err
		}
	}
	if err = b.allocKV(); err != nil {
		return nil, err
	}
	if err = b.stream.Synchronize(); err != nil {
		return nil, fmt.Errorf("cuda backend: after loading: %w", err)
	}
	if err = b.cx.Synchronize(); err != nil {
		return nil, fmt.Errorf("cuda backend: after loading: %w", err)
	}
	return b, nil
}

// allocKV sizes and allocates the KV pool: a shareable VMM pool from
// internal/cuda, or plain cuMemAlloc memory when VMM fails.
func (b *Backend) allocKV() error {
	c := &b.cfg
	pages := b.opts.Pages
	l := LayoutFor(*c, b.opts.DType, b.opts.PageSize, 1)
	perPage := uint64(l.TotalBytes())
	if pages == 0 {
		_, total, err := b.cx.MemGetInfo()
		if err != nil {
			return err
		}
		free, _, err := b.cx.MemGetInfo()
		if err != nil {
			return err
		}
		// The graph buffers and the cuBLAS workspace are allocated already
		// (in free, not yet in the share of total).
		fixed := int64(cublasWorkspace)
		if b.graphs != nil {
			fixed += int64(b.graphs.sizes.total()) + int64(b.graphs.moe.bytes())
		}
		budget := int64(float64(total)*b.opts.MemFraction) - b.w.bytes - fixed - scratchReserve(c, b.eb)
		budget = min(budget, int64(free)-scratchReserve(c, b.eb))
		if budget < int64(perPage) {
			return fmt.Errorf("cuda backend: no room for a KV pool: %.2f GiB total, fraction %g, weights %.2f GiB",
				float64(total)/(1<<30), b.opts.MemFraction, float64(b.w.bytes)/(1<<30))
		}
		pages = int(uint64(budget) / perPage)
	}
	b.layout = LayoutFor(*c, b.opts.DType, b.opts.PageSize, pages)
	if err := b.layout.Validate(); err != nil {
		return err
	}
	size := uint64(b.layout.TotalBytes())
	pool, err := b.cx.NewPool(cu.PoolConfig{Size: size, Logger: b.lg})
	if err == nil {
		b.kvPool, b.kvBase, b.kvSize = pool, pool.Ptr(), pool.Size()
		b.lg.Info("KV pool", zap.Int("pages", pages), zap.Uint64("bytes", b.kvSize), zap.Stringer("handles", pool.HandleType()))
		return nil
	}
	if errors.Is(err, cu.ErrOutOfMemory) {
		return fmt.Errorf("cuda backend: KV pool of %d pages: %w", pages, err)
	}
	b.lg.Warn("VMM KV pool failed, using cuMemAlloc (not shareable through VMM handles)", zap.Error(err))
	p, aerr := b.cx.MemAlloc(size)
	if aerr != nil {
		return fmt.Errorf("cuda backend: KV pool of %d pages: %w", pages, errors.Join(err, aerr))
	}
	b.kvBase, b.kvSize, b.kvOwn = p, size, true
	return nil
}

// scratchReserve is what the activations of a large prefill chunk need
// (with experts: their routed rows, moeBufs).
func scratchReserve(c *model.Config, eb int) int64 {
	r := 1<<30 + int64(8192)*int64(2*c.HiddenDim+c.Heads*c.HeadDim*3)*int64(eb+4)
	if c.Spec != nil && c.Spec.MLP.MoE {
		r += int64(8192) * int64(c.TopK) * (int64(c.Dim)*int64(eb+4) + int64(3*c.ExpertDim*eb) + 12)
		r += int64(8192) * (int64(c.Experts+1)*4 + int64(3*c.SharedExpertDim*eb) + int64(c.Dim)*4)
	}
	return r
}

// Config is the model's configuration.
func (b *Backend) Config() model.Config { return b.cfg }

// Layout is the KV pool's layout.
func (b *Backend) Layout() kvcache.Layout { return b.layout }

// DType is "bfloat16" or "float32".
func (b *Backend) DType() string { return b.opts.DType }

// Context is the GPU context the backend runs in.
func (b *Backend) Context() *cu.Context { return b.cx }

// KVBase is the device address of the KV pool (offsets of Layout apply).
func (b *Backend) KVBase() cu.DevicePtr { return b.kvBase }

// KVSize is the KV pool's size in bytes (at least Layout().TotalBytes()).
func (b *Backend) KVSize() uint64 { return b.kvSize }

// KVPool is the VMM pool holding the KV cache, for export to the transfer
// engine; nil when the pool fell back to cuMemAlloc (then use
// Context().ExportIPC(KVBase())).
func (b *Backend) KVPool() *cu.Pool { return b.kvPool }

// WeightBytes is the size of the weights on the GPU.
func (b *Backend) WeightBytes() int64 { return b.w.bytes }

// Close frees the GPU memory and releases the context.
func (b *Backend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return b.release()
}

func (b *Backend) release() error {
	if b.cx == nil {
		return nil
	}
	var errs []error
	b.cx.SetCurrent()
	errs = append(errs, b.cx.Synchronize())
	if b.graphs != nil {
		errs = append(errs, b.graphs.destroy())
		b.graphs.moe.free(b)
		b.graphs = nil
	}
	errs = append(errs, b.tm.destroy(), b.q.destroy())
	b.tm = nil
	for _, ev := range b.layerEv {
		errs = append(errs, ev.Destroy())
	}
	b.layerEv = nil
	errs = append(errs, b.smp.release(b)...)
	b.s.free(b)
	for _, p := range b.allocs {
		errs = append(errs, b.cx.MemFree(p))
	}
	b.allocs = nil
	if b.kvPool != nil {
		errs = append(errs, b.kvPool.Close())
	} else if b.kvOwn {
		errs = append(errs, b.cx.MemFree(b.kvBase))
	}
	if b.mod != nil {
		errs = append(errs, b.mod.Unload())
	}
	for _, m := range []*cu.Module{b.bk.mod, b.fn.tcMod} {
		if m != nil {
			errs = append(errs, m.Unload())
		}
	}
	if b.blas != nil {
		errs = append(errs, b.blas.Destroy())
	}
	errs = append(errs, b.stream.Destroy())
	b.stream = nil
	errs = append(errs, b.cx.Release())
	b.cx = nil
	return errors.Join(errs...)
}

// alloc allocates device memory owned until Close.
func (b *Backend) alloc(n uint64) (cu.DevicePtr, error) {
	p, err := b.cx.MemAlloc(max(n, 256))
	if err != nil {
		return 0, err
	}
	b.allocs = append(b.allocs, p)
	return p, nil
}
