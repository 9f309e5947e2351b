package cpu_test

import (
	"testing"
	"unsafe"

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
		page := pool.Page(layer, kind, p)
		return append([]float32(nil), unsafe.Slice((*float32)(unsafe.Pointer(&page[0])), len(page)/4)...)
	}}
}
