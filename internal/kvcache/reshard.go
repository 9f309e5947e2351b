package kvcache

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// Shard is one tensor-parallel rank's part of a model's KV cache: its
// pool's layout (KVHeads: how many of the model's KV heads it holds) and the
// model's index of the first of them.
type Shard struct {
	Layout    Layout `json:"layout"`
	FirstHead int    `json:"first_head"`
}

func (s Shard) holds(h int) bool { return h >= s.FirstHead && h < s.FirstHead+s.Layout.KVHeads }

// Plan is how the KV of one set of shards (a prefill's ranks) reaches
// another (a decode's): every destination gets every head it holds from
// exactly one source that holds it. A head replicated on several sources
// is sent by one of them to each destination, the replicas taking turns
// over the destinations. A plan depends on the shards' layouts but not on
// their pool sizes or page indices: make it once per pair of rank lists.
type Plan struct {
	Moves []Move
	// Ideal is the bytes every destination needs per page and layer, by
	// destination: each of its heads' K and V once.
	Ideal []int64
}

// Move is what source shard Src sends destination shard Dst: the model's
// KV heads [Head, Head+Heads), as Segs within one page of one layer.
type Move struct {
	Src, Dst    int
	Head, Heads int
	Segs        []Seg
	whole       bool // every Seg is a whole block on both sides: runs of pages merge
}

// Seg is a contiguous piece of a layer's page: Len bytes at SrcOff in the
// source's block of SrcKind (TokenMajor: K or V; HeadMajor: always K, the
// layer page) to DstOff in the destination's block of DstKind.
type Seg struct {
	SrcKind, DstKind Kind
	SrcOff, DstOff   int64
	Len              int64
}

// Bytes is what the move carries per page and layer.
func (m *Move) Bytes() int64 {
	var n int64
	for _, s := range m.Segs {
		n += s.Len
	}
	return n
}

// NewPlan plans the reshard of src's KV onto dst's. The shards of both
// sides must agree on layers, page size, head dim and element size; the
// sources must hold every head from 0 to their highest, and the
// destinations only heads among them.
func NewPlan(src, dst []Shard) (*Plan, error) {
	if len(src) == 0 || len(dst) == 0 {
		return nil, fmt.Errorf("kvcache: reshard of %d source shards onto %d", len(src), len(dst))
	}
	ref := src[0].Layout
	heads := 0
	for i, s := range slices.Concat(src, dst) {
		side, idx := "source", i
		if i >= len(src) {
			side, idx = "destination", i-len(src)
		}
		l := s.Layout
		if err := l.Validate(); err != nil {
			return nil, fmt.Errorf("kvcache: %s shard %d: %w", side, idx, err)
		}
		if l.Layers != ref.Layers || l.PageSize != ref.PageSize || l.HeadDim != ref.HeadDim || l.ElemBytes != ref.ElemBytes {
			return nil, fmt.Errorf("kvcache: %s shard %d: %d layers, page size %d, head dim %d, %d-byte elements; source shard 0 has %d, %d, %d, %d",
				side, idx, l.Layers, l.PageSize, l.HeadDim, l.ElemBytes, ref.Layers, ref.PageSize, ref.HeadDim, ref.ElemBytes)
		}
		if s.FirstHead < 0 {
			return nil, fmt.Errorf("kvcache: %s shard %d: first head %d", side, idx, s.FirstHead)
		}
		if i < len(src) {
			heads = max(heads, s.FirstHead+l.KVHeads)
		}
	}
	holders := make([][]int, heads)
	for i, s := range src {
		for h := s.FirstHead; h < s.FirstHead+s.Layout.KVHeads; h++ {
			holders[h] = append(holders[h], i)
		}
	}
	for h, hs := range holders {
		if len(hs) == 0 {
			return nil, fmt.Errorf("kvcache: no source shard holds KV head %d of %d", h, heads)
		}
	}
	p := &Plan{Ideal: make([]int64, len(dst))}
	for d, ds := range dst {
		if ds.FirstHead+ds.Layout.KVHeads > heads {
			return nil, fmt.Errorf("kvcache: destination shard %d holds KV heads %d..%d, the sources %d", d,
				ds.FirstHead, ds.FirstHead+ds.Layout.KVHeads-1, heads)
		}
		p.Ideal[d] = int64(ds.Layout.KVHeads) * 2 * int64(ds.Layout.PageSize) * int64(ds.Layout.HeadBytes())
		var m *Move
		for h := ds.FirstHead; h < ds.FirstHead+ds.Layout.KVHeads; h++ {
			s := holders[h][d%len(holders[h])]
			if m == nil || m.Src != s {
				p.Moves = append(p.Moves, Move{Src: s, Dst: d, Head: h})
				m = &p.Moves[len(p.Moves)-1]
			}
			m.Heads++
		}
	}
	for i := range p.Moves {
		m := &p.Moves[i]
		m.Segs = segments(src[m.Src], dst[m.Dst], m.Head, m.Heads)
		sl, dl := src[m.Src].Layout, dst[m.Dst].Layout
		m.whole = true
		for _, g := range m.Segs {
			m.whole = m.whole && g.SrcOff == 0 && g.DstOff == 0 && g.Len == sl.blockBytes() && g.Len == dl.blockBytes()
		}
	}
	return p, nil
}

// segments lists the contiguous pieces of heads [h0, h0+n) of one layer's
// page from s to d: every head's K and V at every slot, merged wherever
// both sides are contiguous.
func segments(s, d Shard, h0, n int) []Seg {
	sl, dl := s.Layout, d.Layout
	hb := int64(sl.HeadBytes())
	var segs []Seg
	for kind := K; kind <= V; kind++ {
		for h := h0; h < h0+n; h++ {
			for slot := 0; slot < sl.PageSize; slot++ {
				segs = append(segs, Seg{SrcKind: sl.blockKind(kind), DstKind: dl.blockKind(kind),
					SrcOff: sl.inBlock(kind, slot, h-s.FirstHead), DstOff: dl.inBlock(kind, slot, h-d.FirstHead), Len: hb})
			}
		}
	}
	slices.SortFunc(segs, func(a, b Seg) int { return cmp.Or(cmp.Compare(a.SrcKind, b.SrcKind), cmp.Compare(a.SrcOff, b.SrcOff)) })
	out := segs[:1]
	for _, g := range segs[1:] {
		last := &out[len(out)-1]
		if g.SrcKind == last.SrcKind && g.DstKind == last.DstKind && g.SrcOff == last.SrcOff+last.Len && g.DstOff == last.DstOff+last.Len {
			last.Len += g.Len
			continue
		}
		out = append(out, g)
	}
	return slices.Clip(out)
}

// Pairs appends to out the copies that carry m's heads of the pages
// srcPages[i] -> dstPages[i] in layer, between pools of layouts src and dst
// (the plan's shards' layouts, of any pool size). A whole-page move merges
// runs of pages consecutive on both sides into one copy.
func (m *Move) Pairs(out []Pair, layer int, src Layout, srcPages []int32, dst Layout, dstPages []int32) []Pair {
	n := min(len(srcPages), len(dstPages))
	for _, g := range m.Segs {
		for i := 0; i < n; {
			j := i + 1
			if m.whole {
				for j < n && srcPages[j] == srcPages[j-1]+1 && dstPages[j] == dstPages[j-1]+1 {
					j++
				}
			}
			out = append(out, Pair{
				Src: src.block(layer, g.SrcKind, int(srcPages[i])) + g.SrcOff,
				Dst: dst.block(layer, g.DstKind, int(dstPages[i])) + g.DstOff,
				Len: int64(j-i) * g.Len,
			})
			i = j
		}
	}
	return out
}

// PlanKey is a key of the plan of src onto dst that ignores pool sizes: equal
// keys, equal plans.
func PlanKey(src, dst []Shard) string {
	var b strings.Builder
	for i, side := range [][]Shard{src, dst} {
		if i > 0 {
			b.WriteByte('>')
		}
		for _, s := range side {
			l := s.Layout
			fmt.Fprintf(&b, "%d:%d:%d:%d:%d:%d+%d;", l.Layers, l.PageSize, l.KVHeads, l.HeadDim, l.ElemBytes, l.Order, s.FirstHead)
		}
	}
	return b.String()
}
