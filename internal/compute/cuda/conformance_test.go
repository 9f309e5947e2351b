package cuda

import (
	"math"
	"runtime"
	"slices"
	"testing"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/compute/computetest"
	"github.com/mooncake-go/mooncake-go/internal/compute/cpu"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// gpuOrSkip skips a test on a machine without a CUDA driver or GPU.
func gpuOrSkip(t *testing.T) {
	t.Helper()
	if err := cu.Init(); err != nil {
		t.Skipf("no usable GPU: %v", err)
	}
	if n, err := cu.DeviceCount(); err != nil || n == 0 {
		t.Skipf("no usable GPU: %d devices, %v", n, err)
	}
}

// unsupported is the conformance suite's skip: the architectures (shapes)
// Supports refuses.
func unsupported(c model.Config) string {
	if err := Supports(c); err != nil {
		return err.Error()
	}
	return ""
}

// TestConformance runs the conformance suite over the CUDA backend for
// every registered architecture it supports, against the CPU backend on
// the float32 widening of the same weights. Both runs use the
// batch-invariant GEMMs and the split-K attention for prefill too, so a
// sequence's logits are bit for bit the same alone, batched, chunked and
// token by token (the suite asks for that); eager passes.
//   - float32: every stored dtype (exact in f32), relative logits error
//     1e-4 (TestVsCPU's float32 bound: only the sums' order differs).
//   - bfloat16: bf16 weights, relative error 3e-2 (TestVsCPU's bf16 bound:
//     activations rounded to bf16 at every GEMM input and in the KV cache,
//     about 2^-9 relative each, through 2-3 layers).
func TestConformance(t *testing.T) {
	gpuOrSkip(t)
	skip := computetest.WithSkip(unsupported)
	ref := computetest.WithReference(newCPURef)
	t.Run("float32", func(t *testing.T) {
		computetest.Run(t, newCUDA(Options{DType: "float32", BatchInvariant: true, NoFlashPrefill: true, DisableCUDAGraph: true}),
			ref, skip, computetest.WithTolerance(model.F32, 1e-4), computetest.WithTolerance(model.BF16, 1e-4),
			computetest.WithTolerance(model.F16, 1e-4))
	})
	t.Run("bfloat16", func(t *testing.T) {
		computetest.Run(t, newCUDA(Options{DType: "bfloat16", BatchInvariant: true, NoFlashPrefill: true, DisableCUDAGraph: true}),
			ref, skip, computetest.WithDTypes(model.BF16), computetest.WithTolerance(model.BF16, 3e-2))
	})
}

// newCUDA makes conformance backends with options o.
func newCUDA(o Options) computetest.NewFunc {
	return func(tb testing.TB, m *model.Model, pageSize, pages int) computetest.Backend {
		o := o
		o.PageSize, o.Pages = pageSize, pages
		b := newOrSkip(tb, m, o)
		return computetest.Backend{Model: b, KV: func(l int, kind kvcache.Kind, p int) []float32 {
			kv, err := b.pageKV(l, kind, p)
			if err != nil {
				tb.Fatal(err)
			}
			return kv
		}}
	}
}

// newCPURef is the reference: the CPU backend, two threads.
func newCPURef(tb testing.TB, m *model.Model, pageSize, pages int) computetest.Backend {
	l := cpu.LayoutFor(m.Config, pageSize, pages)
	pool, err := kvcache.NewPool(l, make([]byte, l.TotalBytes()))
	if err != nil {
		tb.Fatal(err)
	}
	b, err := cpu.New(m, pool, 2)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { b.Close() })
	return computetest.Backend{Model: b, KV: func(layer int, kind kvcache.Kind, p int) []float32 {
		return computetest.PageKV(l, pool.Mem, layer, kind, p)
	}}
}

// pageKV reads the K or V of page p of layer l from the GPU pool, token by
// token (PageSize tokens of KVHeads x HeadDim), widened to float32.
func (b *Backend) pageKV(l int, kind kvcache.Kind, p int) ([]float32, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.cx.SetCurrent(); err != nil {
		return nil, err
	}
	if err := b.stream.Synchronize(); err != nil {
		return nil, err
	}
	lay := b.layout
	hd, eb := lay.HeadDim, lay.ElemBytes
	out := make([]float32, 0, lay.PageSize*lay.KVHeads*hd)
	raw := make([]byte, hd*eb)
	for slot := range lay.PageSize {
		for h := range lay.KVHeads {
			off := lay.Entry(l, kind, p, slot, h)
			if err := b.cx.MemcpyDtoH(raw, b.kvBase+cu.DevicePtr(off)); err != nil {
				return nil, err
			}
			for i := range hd {
				if eb == 2 {
					out = append(out, model.BF16ToF32(*(*uint16)(unsafe.Pointer(&raw[2*i]))))
				} else {
					out = append(out, math.Float32frombits(*(*uint32)(unsafe.Pointer(&raw[4*i]))))
				}
			}
		}
	}
	return out, nil
}

// TestGolden checks every tiny architecture the backend supports, written
// as convert --random writes it (seed 0) and loaded from disk, against
// transformers' runs of the same directory (internal/model/testdata/golden),
// on the serving path (cuBLAS, flash prefill, fused decode kernels and CUDA
// graphs where the architecture has them):
//   - float32: the last-position logits of the top ids within
//     max(5e-4, 2e-5 x the largest) of transformers' float32 (the CPU
//     backend is held to 1e-4; the GPU sums in other orders) and the greedy
//     continuation token for token.
//   - bfloat16: the top logits within max(3x transformers' own bf16 error
//     against its float32 on that prompt, 1% of the largest logit): a
//     bf16 pipeline rounds different intermediates than transformers' does,
//     so its error is of the same size, not the same values. The first
//     greedy token is transformers' float32 one or its bf16 one (they
//     differ where the top two are closer than bf16's error).
func TestGolden(t *testing.T) {
	gpuOrSkip(t)
	for _, name := range computetest.GoldenShapes() {
		t.Run(name, func(t *testing.T) {
			f, m := computetest.LoadGolden(t, name)
			if why := unsupported(m.Config); why != "" {
				t.Skip(why)
			}
			const per = 8 // pages of 16: 128 positions
			for _, dt := range []string{"float32", "bfloat16"} {
				t.Run(dt, func(t *testing.T) {
					be := newOrSkip(t, m, Options{DType: dt, PageSize: 16, Pages: per * 2})
					worst := 0.0
					for i, p := range f.Prompts {
						want := p.Float32
						logits := runBatch(t, be, [][]int32{p.IDs}, []int{0}, len(want.Greedy)-1, per)[0]
						last := logits[0]
						tfErr, scale := 0.0, 0.0
						bf := map[int]float64{}
						for _, top := range p.BFloat16.Top {
							bf[int(top[0])] = top[1]
						}
						for _, top := range want.Top {
							if v, ok := bf[int(top[0])]; ok {
								tfErr = max(tfErr, math.Abs(v-top[1]))
							}
							scale = max(scale, math.Abs(top[1]))
						}
						tol := max(5e-4, 2e-5*scale)
						if dt == "bfloat16" {
							tol = max(3*tfErr, 0.01*scale)
						}
						for _, top := range want.Top {
							d := math.Abs(float64(last[int(top[0])]) - top[1])
							worst = max(worst, d/tol)
							if d > tol {
								t.Errorf("prompt %d (%d tokens): logit of %d is %v, transformers float32 %v (tolerance %.3g)",
									i, len(p.IDs), int(top[0]), last[int(top[0])], top[1], tol)
							}
						}
						got := make([]int32, len(logits))
						for s := range got {
							got[s] = argmax(logits[s])
						}
						if dt == "float32" {
							if !slices.Equal(got, want.Greedy) {
								t.Errorf("prompt %d: greedy %v, transformers float32 %v", i, got, want.Greedy)
							}
						} else if got[0] != want.Greedy[0] && got[0] != p.BFloat16.Greedy[0] {
							t.Errorf("prompt %d: first greedy token %d, transformers %d (float32) %d (bfloat16)", i, got[0],
								want.Greedy[0], p.BFloat16.Greedy[0])
						}
					}
					t.Logf("%s %s: worst top-logit error %.2f of its tolerance", name, dt, worst)
				})
			}
		})
	}
}
