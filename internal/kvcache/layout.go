// Package kvcache holds the paged KV-cache pool: its memory layout and a
// reference-counted page allocator.
//
// The pool is one block of memory allocated once and registered once with the
// transfer engine. For every layer there is a K buffer and a V buffer; one page
// of one layer is one contiguous block of PageSize x KVHeads x HeadDim elements,
// so a list of pages maps to a short list of (offset, length) pairs.
//
//	offset(layer, kind, page) = ((layer*2 + kind)*Pages + page) * PageBytes
package kvcache

import "fmt"

// Kind selects the K or V buffer of a layer.
type Kind int

const (
	K Kind = 0
	V Kind = 1
)

// Layout describes the shape of a KV pool. Two servers can exchange pages only
// when their layouts agree in everything but Pages.
type Layout struct {
	Layers    int // transformer layers
	PageSize  int // tokens per page
	KVHeads   int // key/value heads
	HeadDim   int // elements per head
	ElemBytes int // 4 for float32, 2 for bfloat16
	Pages     int // pages in the pool
}

// Validate reports a layout that cannot be used.
func (l Layout) Validate() error {
	switch {
	case l.Layers <= 0, l.PageSize <= 0, l.KVHeads <= 0, l.HeadDim <= 0:
		return fmt.Errorf("kvcache: bad layout %+v", l)
	case l.ElemBytes != 2 && l.ElemBytes != 4:
		return fmt.Errorf("kvcache: element size %d bytes not supported", l.ElemBytes)
	case l.Pages <= 0:
		return fmt.Errorf("kvcache: pool has %d pages", l.Pages)
	}
	return nil
}

// TokenBytes is the size of one token's K (or V) entry in one layer.
func (l Layout) TokenBytes() int { return l.KVHeads * l.HeadDim * l.ElemBytes }

// PageBytes is the size of one page of one layer's K (or V) buffer.
func (l Layout) PageBytes() int { return l.PageSize * l.TokenBytes() }

// TotalBytes is the size of the whole pool.
func (l Layout) TotalBytes() int64 {
	return int64(l.Layers) * 2 * int64(l.Pages) * int64(l.PageBytes())
}

// Offset is the byte offset of one page of one layer's K or V buffer.
func (l Layout) Offset(layer int, kind Kind, page int) int64 {
	return (int64(layer*2+int(kind))*int64(l.Pages) + int64(page)) * int64(l.PageBytes())
}

// Pair is one contiguous copy from a source pool offset to a destination pool
// offset.
type Pair struct {
	Src, Dst int64
	Len      int64
}

// LayerPairs maps src pages (in this layout) onto dst pages (in dstLayout,
// which must match l except for Pages), page i to page i, for one layer, K
// and V. Runs that are consecutive on both sides are merged into one copy.
func (l Layout) LayerPairs(layer int, src []int32, dstLayout Layout, dst []int32) ([]Pair, error) {
	if err := l.Compatible(dstLayout); err != nil {
		return nil, err
	}
	if len(src) != len(dst) {
		return nil, fmt.Errorf("kvcache: %d source pages for %d destination pages", len(src), len(dst))
	}
	if layer < 0 || layer >= l.Layers {
		return nil, fmt.Errorf("kvcache: layer %d of %d", layer, l.Layers)
	}
	var out []Pair
	pb := int64(l.PageBytes())
	for kind := K; kind <= V; kind++ {
		for i := 0; i < len(src); {
			j := i + 1
			for j < len(src) && src[j] == src[j-1]+1 && dst[j] == dst[j-1]+1 {
				j++
			}
			out = append(out, Pair{
				Src: l.Offset(layer, kind, int(src[i])),
				Dst: dstLayout.Offset(layer, kind, int(dst[i])),
				Len: int64(j-i) * pb,
			})
			i = j
		}
	}
	return out, nil
}

// Compatible reports whether pages can be copied between pools of layouts l
// and o, naming the first field that differs.
func (l Layout) Compatible(o Layout) error {
	type f struct {
		name string
		a, b int
	}
	for _, x := range []f{
		{"layers", l.Layers, o.Layers},
		{"page size", l.PageSize, o.PageSize},
		{"kv heads", l.KVHeads, o.KVHeads},
		{"head dim", l.HeadDim, o.HeadDim},
		{"element bytes", l.ElemBytes, o.ElemBytes},
	} {
		if x.a != x.b {
			return fmt.Errorf("kvcache: layout mismatch: %s %d here, %d on the peer", x.name, x.a, x.b)
		}
	}
	return nil
}
