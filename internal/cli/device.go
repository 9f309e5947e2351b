package cli

import (
	"cmp"
	"context"
	"fmt"
	"runtime"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/compute/cpu"
	cudabe "github.com/mooncake-go/mooncake-go/internal/compute/cuda"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// gpuPresent says whether a CUDA GPU can be used, and if not, why.
func gpuPresent() (bool, string) {
	if err := cu.Init(); err != nil {
		return false, err.Error()
	}
	n, err := cu.DeviceCount()
	if err != nil {
		return false, err.Error()
	}
	if n == 0 {
		return false, "the CUDA driver sees no GPU"
	}
	return true, ""
}

// cudaRuns says whether the CUDA backend runs c's architecture: the Llama
// blocks only (q/k/v biases included) until it composes its layers from the
// Spec; anything else it would run as a different model.
func cudaRuns(c model.Config) bool {
	return c.Spec != nil && !c.Spec.Attention.QKNorm && !c.Spec.MLP.MoE && c.SlidingWindow == 0
}

// backend is the model backend serve runs on, with its KV pool registered
// with the transfer engine.
type backend struct {
	model    compute.Model
	pages    *kvcache.Allocator
	layout   kvcache.Layout
	poolAddr uint64
	dtype    string
	device   string
	close    []func() error
}

// newBackend builds the cpu or cuda backend the flags ask for and registers
// its KV pool with te.
func newBackend(ctx context.Context, f *serveFlags, m *model.Model, te *transfer.Engine, lg *zap.Logger) (*backend, error) {
	dev := f.device
	if dev == "auto" {
		if ok, _ := gpuPresent(); ok && cudaRuns(m.Config) {
			dev = "cuda"
		} else {
			dev = "cpu"
		}
	}
	if dev == "cuda" {
		return newCUDABackend(ctx, f, m, te, lg)
	}
	if f.dtype == "bfloat16" {
		return nil, fmt.Errorf("--dtype bfloat16: the cpu backend computes in float32")
	}
	f.noteGPUFlags(lg)
	ps := f.pageSize
	if ps == 0 {
		ps = 64
	}
	probe := cpu.LayoutFor(m.Config, ps, 1)
	tokens := poolTokens(f.maxTotalTokens, int64(probe.TokenBytes())*2*int64(probe.Layers))
	layout := cpu.LayoutFor(m.Config, ps, (tokens+ps-1)/ps)
	mem, err := te.AllocHost(ctx, layout.TotalBytes(), 0, transfer.AccessReadWrite)
	if err != nil {
		return nil, fmt.Errorf("KV pool of %d bytes: %w", layout.TotalBytes(), err)
	}
	b := &backend{layout: layout, poolAddr: mem.Addr(), dtype: "float32", device: "cpu"}
	b.close = append(b.close, func() error { return te.FreeHost(context.Background(), mem) })
	pool, err := kvcache.NewPool(layout, mem.Bytes())
	if err != nil {
		b.shutdown(lg)
		return nil, err
	}
	threads := f.threads
	if threads == 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	be, err := cpu.New(m, pool, threads)
	if err != nil {
		b.shutdown(lg)
		return nil, err
	}
	b.close = append(b.close, be.Close)
	b.model, b.pages = be, pool.Alloc
	return b, nil
}

func newCUDABackend(ctx context.Context, f *serveFlags, m *model.Model, te *transfer.Engine, lg *zap.Logger) (*backend, error) {
	if ok, why := gpuPresent(); !ok {
		return nil, fmt.Errorf("--device cuda: no usable GPU: %s", why)
	}
	if !cudaRuns(m.Config) {
		return nil, fmt.Errorf("--device cuda: %s (q/k norms, experts or a sliding window) is not implemented by the CUDA backend yet; use --device cpu",
			m.Config.ArchName())
	}
	be, err := cudabe.New(m, cudabe.Options{Device: f.baseGPU, DType: f.dtype, PageSize: f.pageSize,
		Pages: pagesFromTokens(f.maxTotalTokens, f.pageSize), MemFraction: f.memFraction, Logger: lg,
		RandomWeights: !m.HasWeights(), Seed: f.seed, DisableCUDAGraph: f.disableCUDAGraph, CUDAGraphMaxBS: f.graphMaxBS()})
	if err != nil {
		return nil, fmt.Errorf("--device cuda (GPU %d): %w", f.baseGPU, err)
	}
	b := &backend{model: be, layout: be.Layout(), poolAddr: uint64(be.KVBase()), dtype: be.DType(),
		device: fmt.Sprintf("cuda:%d", f.baseGPU)}
	b.close = append(b.close, be.Close)
	b.pages = kvcache.NewAllocator(b.layout.Pages)
	loc := transfer.Location{Kind: transfer.CUDA, Index: f.baseGPU}
	// A VMM pool is shared by nvlink and staged by tcp for peers on any
	// machine; memory from cuMemAlloc (no pool) only nvlink reaches, over
	// legacy IPC, so same-machine peers only.
	opts := []transfer.RegisterOption{transfer.WithScope(transfer.ScopeSameMachine)}
	if p := be.KVPool(); p != nil {
		opts = []transfer.RegisterOption{transfer.WithMemory(p)}
	}
	if err := te.RegisterMemory(ctx, uintptr(be.KVBase()), be.KVSize(), loc, transfer.AccessReadWrite, opts...); err != nil {
		b.shutdown(lg)
		return nil, fmt.Errorf("register the GPU KV pool: %w", err)
	}
	b.close = append(b.close, func() error { return te.UnregisterMemory(context.Background(), uintptr(be.KVBase())) })
	return b, nil
}

// graphMaxBS is the largest decode batch to capture: --cuda-graph-max-bs,
// but no more than the running batch can hold (the graph buffers are sized
// for it).
func (f *serveFlags) graphMaxBS() int {
	return min(f.cudaGraphMaxBS, cmp.Or(f.maxRunning, engine.DefaultMaxRunningRequests))
}

func pagesFromTokens(tokens, pageSize int) int {
	if tokens <= 0 {
		return 0
	}
	if pageSize <= 0 {
		pageSize = 64
	}
	return (tokens + pageSize - 1) / pageSize
}

func (b *backend) shutdown(lg *zap.Logger) {
	for i := len(b.close) - 1; i >= 0; i-- {
		if err := b.close[i](); err != nil {
			lg.Warn("backend shutdown", zap.Error(err))
		}
	}
}
