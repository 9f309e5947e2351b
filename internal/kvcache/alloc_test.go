package kvcache

import (
	"errors"
	"testing"
)

func TestAllocator(t *testing.T) {
	a := NewAllocator(8)
	p, err := a.Alloc(3)
	if err != nil || len(p) != 3 || a.Free() != 5 {
		t.Fatalf("alloc 3: %v %v free=%d", p, err, a.Free())
	}
	if p[0] != 0 || p[1] != 1 || p[2] != 2 {
		t.Fatalf("fresh pool should hand out pages in order, got %v", p)
	}
	if _, err := a.Alloc(6); !errors.Is(err, ErrOutOfPages) {
		t.Fatalf("alloc beyond free: %v", err)
	}
	if a.Free() != 5 {
		t.Fatalf("failed alloc changed free count: %d", a.Free())
	}
	if err := a.Retain(p[:1]); err != nil {
		t.Fatal(err)
	}
	if err := a.Release(p); err != nil {
		t.Fatal(err)
	}
	if a.Free() != 7 {
		t.Fatalf("page with two refs was freed: free=%d", a.Free())
	}
	if err := a.Release(p[1:2]); err == nil {
		t.Fatal("double release accepted")
	}
	if err := a.Release([]int32{p[0], 99}); err == nil || a.Free() != 7 {
		t.Fatalf("bad release changed state: %v free=%d", err, a.Free())
	}
	if err := a.Release(p[:1]); err != nil || a.Free() != 8 {
		t.Fatalf("final release: %v free=%d", err, a.Free())
	}
}

func TestPairsMergeRuns(t *testing.T) {
	l := Layout{Layers: 2, PageSize: 4, KVHeads: 2, HeadDim: 8, ElemBytes: 4, Pages: 16}
	d := l
	d.Pages = 32
	var pairs []Pair
	for layer := range l.Layers {
		p, err := l.LayerPairs(layer, []int32{1, 2, 3, 7}, d, []int32{10, 11, 20, 21})
		if err != nil {
			t.Fatal(err)
		}
		pairs = append(pairs, p...)
	}
	// per layer and kind: [1,2]->[10,11], [3]->[20], [7]->[21]
	if len(pairs) != 2*2*3 {
		t.Fatalf("got %d pairs: %+v", len(pairs), pairs)
	}
	pb := int64(l.PageBytes())
	if pairs[0] != (Pair{Src: l.Offset(0, K, 1), Dst: d.Offset(0, K, 10), Len: 2 * pb}) {
		t.Fatalf("first pair %+v", pairs[0])
	}
	var total int64
	for _, p := range pairs {
		total += p.Len
	}
	if total != 2*2*4*pb {
		t.Fatalf("moved %d bytes, want %d", total, 2*2*4*pb)
	}
	bad := d
	bad.HeadDim = 16
	if _, err := l.LayerPairs(0, []int32{1}, bad, []int32{1}); err == nil {
		t.Fatal("mismatched layouts accepted")
	}
	if _, err := l.LayerPairs(2, []int32{1}, d, []int32{1}); err == nil {
		t.Fatal("layer 2 of 2 accepted")
	}
}
