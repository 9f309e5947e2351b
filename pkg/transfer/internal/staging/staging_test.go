package staging

import "testing"

// TestRing: spans pack, wrap without splitting, retire in order even when
// released out of order, and an empty ring always fits a whole ring.
func TestRing(t *testing.T) {
	r := NewRing(100)
	a, ok1 := r.TryAlloc(40)
	b, ok2 := r.TryAlloc(40)
	if !ok1 || !ok2 || a.Off != 0 || b.Off != 40 {
		t.Fatal("spans do not pack from the start")
	}
	if _, ok := r.TryAlloc(30); ok {
		t.Fatal("30 bytes fit in 20")
	}
	r.Release(b) // out of order: a still holds the tail
	if _, ok := r.TryAlloc(30); ok {
		t.Fatal("a span released before an older one freed space")
	}
	r.Release(a)
	if r.Live() != 0 {
		t.Fatalf("%d spans live", r.Live())
	}
	c, _ := r.TryAlloc(70)
	d, ok := r.TryAlloc(30)
	if !ok || d.Off != 70 || d.N != 30 {
		t.Fatal("the ring's end is not used")
	}
	r.Release(c)
	e, ok := r.TryAlloc(50) // wraps to the start: [0, 50)
	if !ok || e.Off != 0 {
		t.Fatal("no wrap to the start")
	}
	r.Release(d)
	r.Release(e)
	if f, ok := r.TryAlloc(100); !ok || f.N != 100 {
		t.Fatal("an empty ring does not fit its whole size")
	}
	if _, ok := r.TryAlloc(0); ok {
		t.Fatal("an empty span")
	}
	if _, ok := NewRing(10).TryAlloc(11); ok {
		t.Fatal("a span larger than the ring")
	}
	select {
	case <-r.Freed():
	default:
		t.Fatal("releases not signaled")
	}
	buf := make([]byte, 100)
	if g := (&Span{Off: 10, N: 5}).Of(buf); len(g) != 5 || cap(g) != 5 || &g[0] != &buf[10] {
		t.Fatal("Of is not the span's bytes")
	}
}

func TestBudget(t *testing.T) {
	b := &Budget{Max: 10}
	if !b.Take(6) || b.Take(5) || !b.Take(4) || b.Used() != 10 {
		t.Fatalf("budget of 10: used %d", b.Used())
	}
	b.Give(6)
	if b.Used() != 4 {
		t.Fatalf("used %d after giving 6 back", b.Used())
	}
	var nb *Budget
	if !nb.Take(1 << 40) {
		t.Fatal("a nil budget bounds")
	}
}
