// Package kvcache holds the paged KV-cache pool: its memory layout, a
// reference-counted page allocator, the prefix cache, and the reshard
// planner that maps one set of tensor-parallel ranks' pools onto another's.
//
// A pool is one block of memory allocated once and registered once with the
// transfer engine. Two page orders exist (docs/format/kvcache.md):
//
//	TokenMajor: per layer a K and a V buffer; one page of one is
//	            [PageSize][KVHeads][HeadDim]
//	            block(layer, kind, page) = ((layer*2 + kind)*Pages + page) * PageBytes
//	HeadMajor:  per layer one buffer; one page of it is
//	            [KVHeads][K, V][PageSize][HeadDim]
//	            block(layer, page) = (layer*Pages + page) * 2*PageBytes
//
// In both, one page of one layer is contiguous (two blocks, or one), so a
// page list maps to a short list of (offset, length) pairs; in HeadMajor
// the K and V of any run of heads of a page are one slice too, so a
// tensor-parallel reshard moves one slice per page and layer.
package kvcache

import "fmt"

// Kind selects the K or V half of a layer.
type Kind int

const (
	K Kind = 0
	V Kind = 1
)

// Order is how one page of one layer holds its heads.
type Order uint8

const (
	// TokenMajor: per layer a K and a V buffer, a page of each token by
	// token (the CUDA backend's).
	TokenMajor Order = iota
	// HeadMajor: per layer one buffer, a page of it head by head, each
	// head's K then V (the CPU backend's).
	HeadMajor
)

func (o Order) String() string {
	switch o {
	case TokenMajor:
		return "token-major"
	case HeadMajor:
		return "head-major"
	}
	return fmt.Sprintf("Order(%d)", uint8(o))
}

// Layout describes the shape of a KV pool. A tensor-parallel rank's pool
// holds its KVHeads of the model's.
type Layout struct {
	Layers    int   // transformer layers
	PageSize  int   // tokens per page
	KVHeads   int   // key/value heads in this pool
	HeadDim   int   // elements per head
	ElemBytes int   // 4 for float32, 2 for bfloat16
	Pages     int   // pages in the pool
	Order     Order // how a page holds its heads
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
	case l.Order > HeadMajor:
		return fmt.Errorf("kvcache: unknown page order %d", l.Order)
	}
	return nil
}

// HeadBytes is the size of one token's K (or V) of one head.
func (l Layout) HeadBytes() int { return l.HeadDim * l.ElemBytes }

// TokenBytes is the size of one token's K (or V) entry in one layer.
func (l Layout) TokenBytes() int { return l.KVHeads * l.HeadBytes() }

// PageBytes is the size of one page's K (or V) in one layer: a layer's
// page holds twice this.
func (l Layout) PageBytes() int { return l.PageSize * l.TokenBytes() }

// TotalBytes is the size of the whole pool.
func (l Layout) TotalBytes() int64 {
	return int64(l.Layers) * 2 * int64(l.Pages) * int64(l.PageBytes())
}

// block is the offset of the block holding kind's half of page in layer:
// TokenMajor has a block per kind, HeadMajor one for both.
func (l Layout) block(layer int, kind Kind, page int) int64 {
	pb := int64(l.PageBytes())
	if l.Order == HeadMajor {
		return (int64(layer)*int64(l.Pages) + int64(page)) * 2 * pb
	}
	return (int64(layer*2+int(kind))*int64(l.Pages) + int64(page)) * pb
}

// blockKind is the kind whose block holds kind's data (HeadMajor: K's, the
// layer page).
func (l Layout) blockKind(kind Kind) Kind {
	if l.Order == HeadMajor {
		return K
	}
	return kind
}

// blockBytes is the size of one block.
func (l Layout) blockBytes() int64 {
	if l.Order == HeadMajor {
		return 2 * int64(l.PageBytes())
	}
	return int64(l.PageBytes())
}

// inBlock is where, inside its block, the K (or V) of head of slot is.
func (l Layout) inBlock(kind Kind, slot, head int) int64 {
	hb := int64(l.HeadBytes())
	if l.Order == HeadMajor {
		return (int64(head*2+int(kind))*int64(l.PageSize) + int64(slot)) * hb
	}
	return (int64(slot)*int64(l.KVHeads) + int64(head)) * hb
}

// Entry is the byte offset of the K (or V) of head (of this pool) at slot
// of page in layer: HeadBytes contiguous bytes.
func (l Layout) Entry(layer int, kind Kind, page, slot, head int) int64 {
	return l.block(layer, kind, page) + l.inBlock(kind, slot, head)
}

// SlotStride is the distance in bytes between one head's entries at
// consecutive slots of a page.
func (l Layout) SlotStride() int64 {
	if l.Order == HeadMajor {
		return int64(l.HeadBytes())
	}
	return int64(l.TokenBytes())
}

// Span is a contiguous byte range of the pool.
type Span struct {
	Off int64
	Len int64
}

// LayerPage lists the byte ranges of one page of one layer, K and V of
// every head: the K block and the V block (TokenMajor), or one block
// (HeadMajor).
func (l Layout) LayerPage(layer, page int) []Span {
	if l.Order == HeadMajor {
		return []Span{{l.block(layer, K, page), l.blockBytes()}}
	}
	return []Span{{l.block(layer, K, page), l.blockBytes()}, {l.block(layer, V, page), l.blockBytes()}}
}

// Pair is one contiguous copy from a source pool offset to a destination pool
// offset.
type Pair struct {
	Src, Dst int64
	Len      int64
}

// Compatible reports whether pools of layouts l and o hold the same model's
// KV in pages of the same size (the page order may differ), naming the
// first field that differs.
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
