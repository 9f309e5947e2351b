package tcp

import "testing"

// TestRing: spans pack, wrap without splitting, retire in order even when
// released out of order, and an empty ring always fits a whole ring.
func TestRing(t *testing.T) {
	r := ring{buf: make([]byte, 100), freed: make(chan struct{}, 1)}
	a, ok1 := r.tryAlloc(40)
	b, ok2 := r.tryAlloc(40)
	if !ok1 || !ok2 || &a.b[0] != &r.buf[0] || &b.b[0] != &r.buf[40] {
		t.Fatal("spans do not pack from the start")
	}
	if _, ok := r.tryAlloc(30); ok {
		t.Fatal("30 bytes fit in 20")
	}
	r.release(b) // out of order: a still holds the tail
	if _, ok := r.tryAlloc(30); ok {
		t.Fatal("a span released before an older one freed space")
	}
	r.release(a)
	if len(r.live) != 0 {
		t.Fatalf("%d spans live", len(r.live))
	}
	c, _ := r.tryAlloc(70)
	d, ok := r.tryAlloc(30)
	if !ok || &d.b[0] != &r.buf[70] || len(d.b) != 30 {
		t.Fatal("the ring's end is not used")
	}
	r.release(c)
	e, ok := r.tryAlloc(50) // wraps to the start: [0, 50)
	if !ok || &e.b[0] != &r.buf[0] {
		t.Fatal("no wrap to the start")
	}
	r.release(d)
	r.release(e)
	if f, ok := r.tryAlloc(100); !ok || len(f.b) != 100 {
		t.Fatal("an empty ring does not fit its whole size")
	}
	select {
	case <-r.freed:
	default:
		t.Fatal("releases not signaled")
	}
}
