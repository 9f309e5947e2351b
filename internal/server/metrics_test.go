package server

import (
	"testing"
	"time"
)

// TestTokenRate: gen_throughput is the mean over the window's complete seconds.
func TestTokenRate(t *testing.T) {
	now := time.Unix(1000, 0)
	r := newTokenRate(10)
	r.now = func() time.Time { return now }
	for s := range 9 {
		now = time.Unix(int64(1000+s), 0)
		r.add(18)
	}
	now = time.Unix(1009, 0) // seconds 1000..1008 complete: 9 x 18 tokens
	r.add(1000)              // the current second does not count yet
	if got := r.perSecond(); got != 18 {
		t.Fatalf("rate %v, want 18", got)
	}
	now = time.Unix(1020, 0) // everything is older than the window
	if got := r.perSecond(); got != 0 {
		t.Fatalf("rate %v after the window, want 0", got)
	}
}
