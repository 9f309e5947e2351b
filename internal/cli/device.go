package cli

import (
	"cmp"
	"context"
	"fmt"
	"runtime"

	"github.com/prometheus/client_golang/prometheus"
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

// cudaRuns says whether the CUDA backend runs c's architecture (every
// registered block but sliding-window attention: cudabe.Supports).
func cudaRuns(c model.Config) bool { return cudabe.Supports(c) == nil }

// backend is the model backend serve runs on, with its KV pools
// registered with the transfer engine: one per tensor-parallel rank.
type backend struct {
	model  compute.Model
	pages  *kvcache.Allocator // every rank's: a page index names the same positions on each
	layout kvcache.Layout     // the ranks' pools seen as one of every KV head
	shards []kvcache.Shard    // each rank's pool: its layout and first KV head
	addrs  []uint64           // each rank's pool address
	tp     int
	dtype  string
	device string
	close  []func() error
}

// newBackend builds the cpu or cuda backend the flags ask for and registers
// its KV pools with te.
func newBackend(ctx context.Context, f *serveFlags, m *model.Model, te *transfer.Engine, lg *zap.Logger, reg prometheus.Registerer) (*backend, error) {
	dev := f.device
	if dev == "auto" {
		if ok, _ := gpuPresent(); ok && cudaRuns(m.Config) {
			dev = "cuda"
		} else {
			dev = "cpu"
		}
	}
	tp := f.tpSize
	if err := m.Config.CheckTP(tp); err != nil {
		return nil, fmt.Errorf("--tp-size %d: %w", tp, err)
	}
	if dev == "cuda" {
		return newCUDABackend(ctx, f, m, te, lg, reg)
	}
	if f.dtype == "bfloat16" {
		return nil, fmt.Errorf("--dtype bfloat16: the cpu backend computes in float32")
	}
	f.noteGPUFlags(lg)
	ps := f.pageSize
	if ps == 0 {
		ps = 64
	}
	var tokenBytes int64 // K and V of one token, every layer, every rank
	for _, s := range cpu.ShardsFor(m.Config, tp, ps, 1) {
		tokenBytes += int64(s.Layout.TokenBytes()) * 2 * int64(s.Layout.Layers)
	}
	tokens := poolTokens(f.maxTotalTokens, tokenBytes)
	pages := (tokens + ps - 1) / ps
	b := &backend{layout: cpu.LayoutFor(m.Config, ps, pages), shards: cpu.ShardsFor(m.Config, tp, ps, pages), tp: tp,
		dtype: "float32", device: "cpu", pages: kvcache.NewAllocator(pages)}
	pools := make([]*kvcache.Pool, tp)
	for r, s := range b.shards {
		mem, err := te.AllocHost(ctx, s.Layout.TotalBytes(), 0, transfer.AccessReadWrite)
		if err != nil {
			b.shutdown(lg)
			return nil, fmt.Errorf("KV pool of tp rank %d, %d bytes: %w", r, s.Layout.TotalBytes(), err)
		}
		b.close = append(b.close, func() error { return te.FreeHost(context.Background(), mem) })
		b.addrs = append(b.addrs, mem.Addr())
		if pools[r], err = kvcache.NewPoolShared(s.Layout, mem.Bytes(), b.pages); err != nil {
			b.shutdown(lg)
			return nil, err
		}
	}
	threads := f.threads
	if threads == 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	if threads < tp {
		lg.Warn("fewer threads than tensor-parallel ranks: each rank gets one", zap.Int("threads", threads), zap.Int("tp_size", tp))
	}
	be, err := cpu.NewTP(m, pools, cpu.Options{Threads: threads, Logger: lg, Registerer: reg})
	if err != nil {
		b.shutdown(lg)
		return nil, err
	}
	b.close = append(b.close, be.Close)
	b.model = be
	return b, nil
}

func newCUDABackend(ctx context.Context, f *serveFlags, m *model.Model, te *transfer.Engine, lg *zap.Logger, reg prometheus.Registerer) (*backend, error) {
	tp := f.tpSize
	gpus := fmt.Sprintf("GPU %d", f.baseGPU)
	if tp > 1 {
		gpus = fmt.Sprintf("GPUs %d..%d", f.baseGPU, f.baseGPU+tp-1)
	}
	if ok, why := gpuPresent(); !ok {
		return nil, fmt.Errorf("--device cuda (%s): no usable GPU: %s", gpus, why)
	}
	if err := cudabe.Supports(m.Config); err != nil {
		return nil, fmt.Errorf("--device cuda: %w; use --device cpu", err)
	}
	if n, err := cu.DeviceCount(); err == nil && f.baseGPU+tp > n {
		return nil, fmt.Errorf("--device cuda --tp-size %d --base-gpu-id %d needs %s; this machine has %d", tp, f.baseGPU, gpus, n)
	}
	be, err := cudabe.NewTP(m, cudabe.Options{Device: f.baseGPU, DType: f.dtype, PageSize: f.pageSize,
		Pages: pagesFromTokens(f.maxTotalTokens, f.pageSize), MemFraction: f.memFraction, Logger: lg,
		RandomWeights: !m.HasWeights(), Seed: f.seed, DisableCUDAGraph: f.disableCUDAGraph, CUDAGraphMaxBS: f.graphMaxBS()},
		cudabe.TPOptions{Size: tp, Registerer: reg})
	if err != nil {
		return nil, fmt.Errorf("--device cuda (%s): %w", gpus, err)
	}
	b := &backend{model: be, layout: be.Layout(), shards: be.Shards(), tp: tp, dtype: be.DType(),
		device: fmt.Sprintf("cuda:%d", f.baseGPU)}
	b.close = append(b.close, be.Close)
	b.pages = kvcache.NewAllocator(b.layout.Pages)
	for r, rk := range be.Ranks() {
		gpu := be.Devices()[r]
		loc := transfer.Location{Kind: transfer.CUDA, Index: gpu}
		// A VMM pool is shared by nvlink and staged by tcp for peers on any
		// machine; memory from cuMemAlloc (no pool) only nvlink reaches,
		// over legacy IPC, so same-machine peers only.
		opts := []transfer.RegisterOption{transfer.WithScope(transfer.ScopeSameMachine)}
		if p := rk.KVPool(); p != nil {
			opts = []transfer.RegisterOption{transfer.WithMemory(p)}
		}
		base := rk.KVBase()
		if err := te.RegisterMemory(ctx, uintptr(base), rk.KVSize(), loc, transfer.AccessReadWrite, opts...); err != nil {
			b.shutdown(lg)
			return nil, fmt.Errorf("register the KV pool of tp rank %d (GPU %d): %w", r, gpu, err)
		}
		b.addrs = append(b.addrs, uint64(base))
		b.close = append(b.close, func() error { return te.UnregisterMemory(context.Background(), uintptr(base)) })
	}
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
