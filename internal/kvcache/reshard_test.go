package kvcache

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestEntryAddressing(t *testing.T) {
	for _, o := range []Order{TokenMajor, HeadMajor} {
		l := Layout{Layers: 3, PageSize: 4, KVHeads: 3, HeadDim: 2, ElemBytes: 4, Pages: 5, Order: o}
		// Every (layer, kind, page, slot, head) entry is its own HeadBytes
		// of the pool, and together they tile it.
		seen := make([]int, l.TotalBytes())
		for layer := range l.Layers {
			for kind := K; kind <= V; kind++ {
				for p := range l.Pages {
					for slot := range l.PageSize {
						for h := range l.KVHeads {
							off := l.Entry(layer, kind, p, slot, h)
							for b := range int64(l.HeadBytes()) {
								seen[off+b]++
							}
							if slot > 0 && off-l.Entry(layer, kind, p, slot-1, h) != l.SlotStride() {
								t.Fatalf("%v: slot stride %d, entries %d apart", o, l.SlotStride(), off-l.Entry(layer, kind, p, slot-1, h))
							}
							in := false
							for _, s := range l.LayerPage(layer, p) {
								in = in || (off >= s.Off && off+int64(l.HeadBytes()) <= s.Off+s.Len)
							}
							if !in {
								t.Fatalf("%v: entry %d of layer %d page %d outside its LayerPage %v", o, off, layer, p, l.LayerPage(layer, p))
							}
						}
					}
				}
			}
		}
		for i, n := range seen {
			if n != 1 {
				t.Fatalf("%v: byte %d covered %d times", o, i, n)
			}
		}
		var span int64
		for _, s := range l.LayerPage(1, 2) {
			span += s.Len
		}
		if span != 2*int64(l.PageBytes()) {
			t.Fatalf("%v: a layer's page is %d bytes, want %d", o, span, 2*l.PageBytes())
		}
	}
	// HeadMajor: a run of heads of a page is one slice.
	l := Layout{Layers: 2, PageSize: 4, KVHeads: 4, HeadDim: 8, ElemBytes: 2, Pages: 3, Order: HeadMajor}
	if got, want := l.Entry(1, K, 2, 0, 2)-l.Entry(1, K, 2, 0, 1), int64(2*l.PageSize*l.HeadBytes()); got != want {
		t.Fatalf("head-major: heads %d bytes apart, want %d", got, want)
	}
}

// TestPlanSameLayout: between equal shards a plan copies whole pages, one
// copy per run of pages consecutive on both sides.
func TestPlanSameLayout(t *testing.T) {
	for _, o := range []Order{TokenMajor, HeadMajor} {
		l := Layout{Layers: 2, PageSize: 4, KVHeads: 2, HeadDim: 8, ElemBytes: 4, Pages: 16, Order: o}
		d := l
		d.Pages = 32
		p, err := NewPlan([]Shard{{Layout: l}}, []Shard{{Layout: d}})
		if err != nil {
			t.Fatal(err)
		}
		if len(p.Moves) != 1 {
			t.Fatalf("%v: %d moves", o, len(p.Moves))
		}
		var pairs []Pair
		for layer := range l.Layers {
			pairs = p.Moves[0].Pairs(pairs, layer, l, []int32{1, 2, 3, 7}, d, []int32{10, 11, 20, 21})
		}
		// per layer and block: [1,2]->[10,11], [3]->[20], [7]->[21]
		blocks := map[Order]int{TokenMajor: 2, HeadMajor: 1}[o]
		if len(pairs) != 2*blocks*3 {
			t.Fatalf("%v: got %d pairs: %+v", o, len(pairs), pairs)
		}
		if want := (Pair{Src: l.Entry(0, K, 1, 0, 0), Dst: d.Entry(0, K, 10, 0, 0), Len: 2 * int64(2*l.PageBytes()/blocks)}); pairs[0] != want {
			t.Fatalf("%v: first pair %+v, want %+v", o, pairs[0], want)
		}
		var total int64
		for _, pr := range pairs {
			total += pr.Len
		}
		if want := int64(2 * 2 * 4 * l.PageBytes()); total != want {
			t.Fatalf("%v: moved %d bytes, want %d", o, total, want)
		}
	}
	bad := Layout{Layers: 2, PageSize: 4, KVHeads: 2, HeadDim: 16, ElemBytes: 4, Pages: 16}
	good := bad
	good.HeadDim = 8
	if _, err := NewPlan([]Shard{{Layout: good}}, []Shard{{Layout: bad}}); err == nil {
		t.Fatal("mismatched head dims accepted")
	}
	if _, err := NewPlan([]Shard{{Layout: good}}, []Shard{{Layout: good, FirstHead: 1}}); err == nil {
		t.Fatal("a destination head no source holds accepted")
	}
	if _, err := NewPlan([]Shard{{Layout: good, FirstHead: 1}}, []Shard{{Layout: good}}); err == nil {
		t.Fatal("sources missing head 0 accepted")
	}
}

// TestPlanHeadMajorDescriptors: with head-major pages on both sides every
// move is one slice per page and layer, whatever the TP sizes.
func TestPlanHeadMajorDescriptors(t *testing.T) {
	const heads = 8
	for _, ps := range []int{1, 2, 4, 8, 16} {
		for _, pd := range []int{1, 2, 4, 8, 16} {
			src, dst := sglangShards(heads, ps, 1, 2, 16, 4, HeadMajor), sglangShards(heads, pd, 1, 2, 16, 4, HeadMajor)
			p, err := NewPlan(src, dst)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range p.Moves {
				if len(m.Segs) != 1 {
					t.Fatalf("tp %d -> %d: move %+v has %d segments", ps, pd, m, len(m.Segs))
				}
			}
		}
	}
}

// sglangShards are the shards of tp ranks holding heads as SGLang assigns
// them (model.Config.KVHeadsOf's rule).
func sglangShards(heads, tp, layers, pageSize, headDim, elem int, o Order) []Shard {
	out := make([]Shard, tp)
	for r := range out {
		lo, n := 0, 0
		if tp <= heads {
			n = heads / tp
			lo = r * n
		} else {
			lo, n = r/(tp/heads), 1
		}
		out[r] = Shard{Layout: Layout{Layers: layers, PageSize: pageSize, KVHeads: n, HeadDim: headDim, ElemBytes: elem,
			Pages: 1, Order: o}, FirstHead: lo}
	}
	return out
}

// randomShards are shards holding random runs of heads that together hold
// every one of heads at least once.
func randomShards(r *rand.Rand, heads int, base Layout) []Shard {
	var out []Shard
	covered := make([]bool, heads)
	for len(out) == 0 || slices.Contains(covered, false) {
		lo := r.IntN(heads)
		n := 1 + r.IntN(heads-lo)
		if len(out) > 6 { // finish: the first uncovered run
			lo = slices.Index(covered, false)
			n = 1
		}
		l := base
		l.KVHeads = n
		l.Order = Order(r.IntN(2))
		l.Pages = 1 + r.IntN(12)
		out = append(out, Shard{Layout: l, FirstHead: lo})
		for h := lo; h < lo+n; h++ {
			covered[h] = true
		}
	}
	r.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// TestPlanProperties runs random plans over random layouts (heads, head
// dim, page size, element size, page orders, both sides' TP sizes or
// arbitrary shards, page tables with and without runs) and checks that
// every destination byte is written exactly once, with the bytes of its
// (layer, kind, head, position) from a source that holds the head, that
// nothing else is written, and that the bytes moved are the plan's ideal.
func TestPlanProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	tps := func(heads int) []int { // SGLang's valid TP sizes for heads
		var out []int
		for tp := 1; tp <= 4*heads && tp <= 16; tp++ {
			if heads%tp == 0 || tp%heads == 0 {
				out = append(out, tp)
			}
		}
		return out
	}
	for it := range 400 {
		heads := 1 + r.IntN(8)
		base := Layout{Layers: 1 + r.IntN(3), PageSize: 1 + r.IntN(6), HeadDim: 1 + r.IntN(5), ElemBytes: []int{2, 4}[r.IntN(2)]}
		var src, dst []Shard
		if it%2 == 0 {
			ts := tps(heads)
			so, do := Order(r.IntN(2)), Order(r.IntN(2))
			src = sglangShards(heads, ts[r.IntN(len(ts))], base.Layers, base.PageSize, base.HeadDim, base.ElemBytes, so)
			dst = sglangShards(heads, ts[r.IntN(len(ts))], base.Layers, base.PageSize, base.HeadDim, base.ElemBytes, do)
			for i := range src {
				src[i].Layout.Pages = 4 + r.IntN(8)
			}
			for i := range dst {
				dst[i].Layout.Pages = 4 + r.IntN(8)
			}
		} else {
			src, dst = randomShards(r, heads, base), randomShards(r, heads, base)
		}
		name := fmt.Sprintf("it %d: %d heads, %+v: %d sources -> %d destinations", it, heads, base, len(src), len(dst))
		checkPlan(t, r, name, src, dst)
	}
}

func checkPlan(t *testing.T, r *rand.Rand, name string, src, dst []Shard) {
	t.Helper()
	p, err := NewPlan(src, dst)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	ps := src[0].Layout.PageSize
	// Page tables: one per side (a page index names the same positions in
	// every rank of a side), as long as the smallest pool allows.
	minPages := func(ss []Shard) int {
		n := ss[0].Layout.Pages
		for _, s := range ss {
			n = min(n, s.Layout.Pages)
		}
		return n
	}
	ns, nd := minPages(src), minPages(dst)
	n := 1 + r.IntN(min(ns, nd))
	table := func(total int) []int32 {
		if r.IntN(2) == 0 { // a run
			start := r.IntN(total - n + 1)
			out := make([]int32, n)
			for i := range out {
				out[i] = int32(start + i)
			}
			return out
		}
		perm := r.Perm(total)[:n]
		out := make([]int32, n)
		for i, v := range perm {
			out[i] = int32(v)
		}
		return out
	}
	srcPages, dstPages := table(ns), table(nd)
	// want is the byte of (layer, kind, head, position, byte) anywhere.
	want := func(layer int, kind Kind, head, pos, b int) byte {
		return byte(layer*131 + int(kind)*71 + head*37 + pos*13 + b*7 + 1)
	}
	srcMem := make([][]byte, len(src))
	for i, s := range src {
		l := s.Layout
		srcMem[i] = make([]byte, l.TotalBytes())
		for j := range srcMem[i] {
			srcMem[i][j] = byte(r.Uint32()) // garbage outside the prompt's pages
		}
		for pi, pg := range srcPages {
			forEntries(l, func(layer int, kind Kind, slot, h int) {
				off := l.Entry(layer, kind, int(pg), slot, h)
				for b := range l.HeadBytes() {
					srcMem[i][off+int64(b)] = want(layer, kind, s.FirstHead+h, pi*ps+slot, b)
				}
			})
		}
	}
	dstMem := make([][]byte, len(dst))
	writes := make([][]uint8, len(dst))
	writer := make([][]int16, len(dst))
	for i, d := range dst {
		dstMem[i] = make([]byte, d.Layout.TotalBytes())
		writes[i] = make([]uint8, d.Layout.TotalBytes())
		writer[i] = make([]int16, d.Layout.TotalBytes())
	}
	moved := make([]int64, len(dst))
	for _, m := range p.Moves {
		sl, dl := src[m.Src].Layout, dst[m.Dst].Layout
		for layer := range sl.Layers {
			pairs := m.Pairs(nil, layer, sl, srcPages, dl, dstPages)
			if sl.Order == HeadMajor && dl.Order == HeadMajor && len(pairs) > n {
				t.Fatalf("%s: head-major move %+v: %d copies for %d pages", name, m, len(pairs), n)
			}
			for _, pr := range pairs {
				if pr.Len <= 0 || pr.Src < 0 || pr.Src+pr.Len > sl.TotalBytes() || pr.Dst < 0 || pr.Dst+pr.Len > dl.TotalBytes() {
					t.Fatalf("%s: copy %+v outside the pools (%d, %d bytes)", name, pr, sl.TotalBytes(), dl.TotalBytes())
				}
				copy(dstMem[m.Dst][pr.Dst:pr.Dst+pr.Len], srcMem[m.Src][pr.Src:pr.Src+pr.Len])
				for b := pr.Dst; b < pr.Dst+pr.Len; b++ {
					writes[m.Dst][b]++
					writer[m.Dst][b] = int16(m.Src)
				}
				moved[m.Dst] += pr.Len
			}
		}
	}
	for i, d := range dst {
		l := d.Layout
		expect := int64(0)
		for pi, pg := range dstPages {
			forEntries(l, func(layer int, kind Kind, slot, h int) {
				off := l.Entry(layer, kind, int(pg), slot, h)
				head := d.FirstHead + h
				for b := range l.HeadBytes() {
					o := off + int64(b)
					expect++
					if writes[i][o] != 1 {
						t.Fatalf("%s: destination %d layer %d %v head %d position %d: byte written %d times", name, i, layer, kind, head, pi*ps+slot, writes[i][o])
					}
					if got, w := dstMem[i][o], want(layer, kind, head, pi*ps+slot, b); got != w {
						t.Fatalf("%s: destination %d layer %d %v head %d position %d byte %d: %d, want %d", name, i, layer, kind, head, pi*ps+slot, b, got, w)
					}
					if s := src[writer[i][o]]; !s.holds(head) {
						t.Fatalf("%s: destination %d head %d written by source %d, which holds %d..%d", name, i, head, writer[i][o], s.FirstHead, s.FirstHead+s.Layout.KVHeads-1)
					}
				}
			})
		}
		var total int64
		for _, w := range writes[i] {
			total += int64(w)
		}
		if total != expect || moved[i] != expect {
			t.Fatalf("%s: destination %d: %d bytes written (%d moved), want exactly its %d", name, i, total, moved[i], expect)
		}
		if ideal := p.Ideal[i] * int64(l.Layers) * int64(len(dstPages)); ideal != expect {
			t.Fatalf("%s: destination %d: plan's ideal %d bytes, want %d", name, i, ideal, expect)
		}
	}
}

func forEntries(l Layout, f func(layer int, kind Kind, slot, head int)) {
	for layer := range l.Layers {
		for kind := K; kind <= V; kind++ {
			for slot := range l.PageSize {
				for h := range l.KVHeads {
					f(layer, kind, slot, h)
				}
			}
		}
	}
}
