package cpu

import (
	"context"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/compute/computetest"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
)

func stories260K(tb testing.TB) string {
	m, _ := sharedtest.Stories260K(tb)
	return m
}

func refCases(tb testing.TB) []sharedtest.Case { return sharedtest.Reference(tb) }

// newBackend makes a backend with a pool of pages pages of pageSize tokens
// on plain Go memory.
func newBackend(tb testing.TB, m *model.Model, pageSize, pages, threads int) *Backend {
	l := LayoutFor(m.Config, pageSize, pages)
	pool, err := kvcache.NewPool(l, make([]byte, l.TotalBytes()))
	if err != nil {
		tb.Fatal(err)
	}
	b, err := New(m, pool, threads)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { b.Close() })
	return b
}

func pagesFor(i, per int) []int32 { return computetest.PagesFor(i, per) }

func argmax(x []float32) int32 { return computetest.Argmax(x) }

// greedy runs prompt (in chunks of chunk tokens; 0 = whole) then steps
// greedy decode steps for sequence i alone, and returns the logits after the
// prompt and after every step.
func greedy(tb testing.TB, b *Backend, prompt []int32, pages []int32, chunk, steps int) [][]float32 {
	ctx := context.Background()
	V := b.Config().Vocab
	var all [][]float32
	if chunk <= 0 {
		chunk = len(prompt)
	}
	pos := 0
	for pos < len(prompt) {
		end := min(pos+chunk, len(prompt))
		out := [][]float32{make([]float32, V)}
		seq := compute.Seq{Tokens: prompt[pos:end], Pos: pos, Pages: pages, Logits: end == len(prompt)}
		if err := b.Forward(ctx, []compute.Seq{seq}, out); err != nil {
			tb.Fatal(err)
		}
		if seq.Logits {
			all = append(all, out[0])
		}
		pos = end
	}
	for s := 0; s < steps; s++ {
		next := argmax(all[len(all)-1])
		out := [][]float32{make([]float32, V)}
		if err := b.Forward(ctx, []compute.Seq{{Tokens: []int32{next}, Pos: pos, Pages: pages, Logits: true}}, out); err != nil {
			tb.Fatal(err)
		}
		all = append(all, out[0])
		pos++
	}
	return all
}

// newTPBackend makes tp ranks sharing threads, with pools of pages pages of
// pageSize tokens on plain Go memory; o.Threads is set from threads.
func newTPBackend(tb testing.TB, m *model.Model, pageSize, pages, tp, threads int, o Options) *Backend {
	pools := make([]*kvcache.Pool, tp)
	var alloc *kvcache.Allocator
	for r, s := range ShardsFor(m.Config, tp, pageSize, pages) {
		p, err := kvcache.NewPoolShared(s.Layout, make([]byte, s.Layout.TotalBytes()), alloc)
		if err != nil {
			tb.Fatal(err)
		}
		pools[r], alloc = p, p.Alloc
	}
	o.Threads = threads
	b, err := NewTP(m, pools, o)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { b.Close() })
	return b
}
