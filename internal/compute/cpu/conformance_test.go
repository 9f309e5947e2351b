package cpu_test

import (
	"fmt"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute/computetest"
	"github.com/mooncake-go/mooncake-go/internal/compute/cpu"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestConformance runs the conformance suite over the CPU backend (two
// threads, so both the row-split and the sequence-split passes run): every
// architecture, every weight dtype bit for bit against its float32
// widening.
func TestConformance(t *testing.T) {
	computetest.Run(t, newCPU)
}

// TestConformanceTP runs the suite over 2 and 4 tensor-parallel ranks (the
// tiny shapes' 4 heads and 1 or 2 KV heads: at tp 4 every KV head is
// replicated) against the one-rank backend on the float32 weights: logits
// within float32 rounding of the sums' new order, greedy tokens equal,
// batch and chunk invariance bit for bit, every KV head in place on every
// rank that holds it.
func TestConformanceTP(t *testing.T) {
	for _, tp := range []int{2, 4} {
		t.Run(fmt.Sprintf("tp=%d", tp), func(t *testing.T) {
			computetest.Run(t, newCPUTP(tp), computetest.WithReference(newCPU),
				computetest.WithTolerance(model.F32, 2e-6), computetest.WithTolerance(model.BF16, 2e-6),
				computetest.WithTolerance(model.F16, 2e-6))
		})
	}
}

func newCPU(tb testing.TB, m *model.Model, pageSize, pages int) computetest.Backend {
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

// newCPUTP makes tp ranks of two threads in all.
func newCPUTP(tp int) computetest.NewFunc {
	return func(tb testing.TB, m *model.Model, pageSize, pages int) computetest.Backend {
		shards := cpu.ShardsFor(m.Config, tp, pageSize, pages)
		pools := make([]*kvcache.Pool, tp)
		mems := make([][]byte, tp)
		var alloc *kvcache.Allocator
		for r, s := range shards {
			mems[r] = make([]byte, s.Layout.TotalBytes())
			p, err := kvcache.NewPoolShared(s.Layout, mems[r], alloc)
			if err != nil {
				tb.Fatal(err)
			}
			pools[r], alloc = p, p.Alloc
		}
		b, err := cpu.NewTP(m, pools, cpu.Options{Threads: 2})
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { b.Close() })
		return computetest.Backend{Model: b, KV: func(layer int, kind kvcache.Kind, p int) []float32 {
			kv, err := computetest.ShardKV(shards, mems, m.Config.KVHeads, layer, kind, p)
			if err != nil {
				tb.Fatal(err)
			}
			return kv
		}}
	}
}
