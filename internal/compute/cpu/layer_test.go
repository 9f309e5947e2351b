package cpu

import (
	"bytes"
	"context"
	"fmt"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestLayerCalls: a seq that asks is told of every layer, in order, and its
// KV of that layer is in the pool when it is told (row-split and
// sequence-split passes).
func TestLayerCalls(t *testing.T) {
	m, err := model.NewRandom("tiny", 7)
	if err != nil {
		t.Fatal(err)
	}
	const pageSize = 4
	for _, c := range []struct {
		name string
		lens []int // tokens per seq; every other seq asks for layer calls
	}{
		{"row split", []int{40, 1, 3}},
		{"sequence split", []int{3, 2, 4, 3, 2, 3, 4, 2, 3, 3, 2, 4}},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := newBackend(t, m, pageSize, 64, 2)
			layers := b.Layout().Layers
			seqs := make([]compute.Seq, len(c.lens))
			out := make([][]float32, len(c.lens))
			calls := make([][]int, len(c.lens))
			snaps := make([][][]byte, len(c.lens)) // [seq][layer] K and V of the seq's pages
			snap := func(i, l int) []byte {
				var buf []byte
				for _, p := range seqs[i].Pages {
					for _, blk := range b.ranks[0].pool.LayerPage(l, int(p)) {
						buf = append(buf, blk...)
					}
				}
				return buf
			}
			next := int32(0)
			for i, n := range c.lens {
				toks := make([]int32, n)
				for j := range toks {
					toks[j] = int32(1 + (i*7+j*3)%200)
				}
				np := (n + pageSize - 1) / pageSize
				pages := make([]int32, np)
				for j := range pages {
					pages[j] = next
					next++
				}
				seqs[i] = compute.Seq{Tokens: toks, Pages: pages, Logits: true}
				out[i] = make([]float32, m.Config.Vocab)
				if i%2 == 0 {
					snaps[i] = make([][]byte, layers)
					seqs[i].Layer = func(l int, ready compute.Fence) {
						if ready != nil {
							t.Errorf("seq %d layer %d: a CPU fence", i, l)
						}
						calls[i] = append(calls[i], l)
						snaps[i][l] = snap(i, l)
					}
				}
			}
			if err := b.Forward(context.Background(), seqs, out); err != nil {
				t.Fatal(err)
			}
			for i := range seqs {
				if seqs[i].Layer == nil {
					continue
				}
				if want := fmt.Sprint(seqRange(layers)); fmt.Sprint(calls[i]) != want {
					t.Fatalf("seq %d: layer calls %v, want %v", i, calls[i], want)
				}
				for l := 0; l < layers; l++ {
					if !bytes.Equal(snaps[i][l], snap(i, l)) {
						t.Fatalf("seq %d: layer %d's KV was not all written when the layer was reported", i, l)
					}
				}
			}
		})
	}
}

func seqRange(n int) []int {
	r := make([]int, n)
	for i := range r {
		r[i] = i
	}
	return r
}
