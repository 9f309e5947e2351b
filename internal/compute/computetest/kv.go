package computetest

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
)

// PageKV reads the K or V of page p of layer l of a float32 pool (mem, of
// layout lay) token by token: PageSize tokens of lay.KVHeads x HeadDim.
func PageKV(lay kvcache.Layout, mem []byte, l int, kind kvcache.Kind, p int) []float32 {
	f := unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(mem))), len(mem)/4)
	hd := lay.HeadDim
	out := make([]float32, 0, lay.PageSize*lay.KVHeads*hd)
	for slot := range lay.PageSize {
		for h := range lay.KVHeads {
			off := lay.Entry(l, kind, p, slot, h) / 4
			out = append(out, f[off:off+int64(hd)]...)
		}
	}
	return out
}

// ShardKV reads the K or V of page p of layer l of every KV head from the
// float32 pools of tensor-parallel ranks (shards[r], mems[r]), each head
// from the first rank that holds it. A replica that differs from it is an
// error.
func ShardKV(shards []kvcache.Shard, mems [][]byte, heads int, l int, kind kvcache.Kind, p int) ([]float32, error) {
	pages := make([][]float32, len(shards))
	for r, s := range shards {
		pages[r] = PageKV(s.Layout, mems[r], l, kind, p)
	}
	return MergeKV(shards, pages, heads, l, p)
}

// MergeKV merges the ranks' pages of layer l, page p (pages[r]: rank r's
// PageSize tokens of its KV heads) into one page of every KV head, each
// head from the first rank that holds it. A replica that differs from it
// is an error.
func MergeKV(shards []kvcache.Shard, pages [][]float32, heads int, l int, p int) ([]float32, error) {
	hd := shards[0].Layout.HeadDim
	ps := shards[0].Layout.PageSize
	out := make([]float32, ps*heads*hd)
	have := make([]bool, heads)
	for r, s := range shards {
		page := pages[r]
		n := s.Layout.KVHeads
		for slot := range ps {
			for h := range n {
				g := s.FirstHead + h
				src := page[(slot*n+h)*hd:][:hd]
				dst := out[(slot*heads+g)*hd:][:hd]
				if !have[g] {
					copy(dst, src)
					continue
				}
				for i := range dst {
					if math.Float32bits(dst[i]) != math.Float32bits(src[i]) {
						return nil, fmt.Errorf("layer %d page %d slot %d: KV head %d on tp rank %d differs from its replica", l, p, slot, g, r)
					}
				}
			}
		}
		for h := range n {
			have[s.FirstHead+h] = true
		}
	}
	for h, ok := range have {
		if !ok {
			return nil, fmt.Errorf("no tp rank holds KV head %d", h)
		}
	}
	return out, nil
}
