// Package staging holds what the transports that stage device memory
// through host buffers (tcp, rdma) share: a byte ring that hands out spans
// of a staging area in order, and a budget bounding the staging of many
// users together.
package staging

import (
	"sync"
	"sync/atomic"
)

// Ring allocates spans of an area of size bytes at its head; released spans
// retire from the tail in allocation order (one released early waits for
// those before it). It deals in offsets, so it serves local buffers (Of)
// and a peer's area alike. Safe for concurrent use.
type Ring struct {
	mu         sync.Mutex
	size       uint64
	head, tail uint64
	live       []*Span       // allocated, oldest first
	freed      chan struct{} // a span was released (capacity 1)
}

// Span is one allocation: N bytes at offset Off of the area.
type Span struct {
	Off        uint64
	N          int
	start, end uint64 // ring positions, the padding skipped before Off included
	free       bool
}

// Of is the span's bytes of buf (the area).
func (s *Span) Of(buf []byte) []byte { return buf[s.Off : s.Off+uint64(s.N) : s.Off+uint64(s.N)] }

// NewRing returns a ring over an area of size bytes.
func NewRing(size uint64) *Ring { return &Ring{size: size, freed: make(chan struct{}, 1)} }

// Size is the area's size.
func (r *Ring) Size() uint64 { return r.size }

// TryAlloc takes n contiguous bytes (never split at the area's end: a span
// that does not fit there skips to the start), if free now.
func (r *Ring) TryAlloc(n int) (*Span, bool) {
	if n <= 0 || uint64(n) > r.size {
		return nil, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.live) == 0 {
		r.head, r.tail = 0, 0 // empty: start over, no wrap needed
	}
	pos := r.head % r.size
	pad := uint64(0)
	if pos+uint64(n) > r.size {
		pad = r.size - pos // wrap: the tail end is skipped
	}
	if r.head+pad+uint64(n)-r.tail > r.size {
		return nil, false
	}
	s := &Span{Off: (pos + pad) % r.size, N: n, start: r.head, end: r.head + pad + uint64(n)}
	r.head = s.end
	r.live = append(r.live, s)
	return s, true
}

// Release gives s back and signals Freed.
func (r *Ring) Release(s *Span) {
	r.mu.Lock()
	s.free = true
	k := 0
	for k < len(r.live) && r.live[k].free {
		r.tail = r.live[k].end
		k++
	}
	if k > 0 {
		n := copy(r.live, r.live[k:])
		clear(r.live[n:])
		r.live = r.live[:n]
	}
	r.mu.Unlock()
	select {
	case r.freed <- struct{}{}:
	default:
	}
}

// Freed receives after a release (one signal may stand for several).
func (r *Ring) Freed() <-chan struct{} { return r.freed }

// Live is the number of spans not yet retired.
func (r *Ring) Live() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.live)
}

// Budget bounds bytes taken by many users together. A nil *Budget is no
// bound.
type Budget struct {
	Max  int64
	used atomic.Int64
}

// Take takes n bytes, or reports false (taking nothing) if that would
// exceed Max.
func (b *Budget) Take(n int64) bool {
	if b == nil {
		return true
	}
	if b.used.Add(n) > b.Max {
		b.used.Add(-n)
		return false
	}
	return true
}

// Give returns n bytes taken.
func (b *Budget) Give(n int64) {
	if b != nil {
		b.used.Add(-n)
	}
}

// Used is the bytes taken now.
func (b *Budget) Used() int64 {
	if b == nil {
		return 0
	}
	return b.used.Load()
}
