package dp

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/engine"
)

type fake struct {
	st      engine.Stats
	got     int
	flushed int
	err     error
}

func (f *fake) Submit(ctx context.Context, r *engine.Request) (<-chan engine.Event, error) {
	f.got++
	f.st.Queued++
	ch := make(chan engine.Event)
	close(ch)
	return ch, f.err
}
func (f *fake) Stats() engine.Stats      { return f.st }
func (f *fake) FlushCache() (int, error) { return f.flushed, f.err }

func TestPick(t *testing.T) {
	if _, err := New(); err == nil {
		t.Fatal("an empty set was made")
	}
	a, b, c := &fake{}, &fake{}, &fake{}
	s, err := New(a, b, c)
	if err != nil {
		t.Fatal(err)
	}
	// Equal loads take turns: each Submit queues one, so 9 requests spread 3/3/3.
	for range 9 {
		if _, err := s.Submit(context.Background(), &engine.Request{}); err != nil {
			t.Fatal(err)
		}
	}
	if a.got != 3 || b.got != 3 || c.got != 3 {
		t.Fatalf("equal replicas got %d/%d/%d of 9", a.got, b.got, c.got)
	}
	// The least loaded wins whatever the turn.
	a.st.Running, c.st.Running = 10, 10
	for range 4 {
		s.Submit(context.Background(), &engine.Request{})
	}
	if b.got != 7 {
		t.Fatalf("the idle replica got %d of 4, want all", b.got-3)
	}
	// A replica's refusal is the caller's.
	b.err = errors.New("overloaded")
	b.st.Queued = -100
	if _, err := s.Submit(context.Background(), &engine.Request{}); err == nil || err.Error() != "overloaded" {
		t.Fatalf("refusal: %v", err)
	}
}

func TestSums(t *testing.T) {
	a := &fake{st: engine.Stats{Queued: 1, Running: 2, FreePages: 3, TotalPages: 10, CachedPages: 1}, flushed: 4}
	b := &fake{st: engine.Stats{Queued: 5, Running: 6, FreePages: 7, TotalPages: 10, CachedPages: 2}, flushed: 5}
	s, _ := New(a, b)
	if got := s.Stats(); got != (engine.Stats{Queued: 6, Running: 8, FreePages: 10, TotalPages: 20, CachedPages: 3}) {
		t.Fatalf("stats %+v", got)
	}
	if n, err := s.FlushCache(); n != 9 || err != nil {
		t.Fatalf("flush: %d %v", n, err)
	}
	b.err = errors.New("no prefix cache")
	if n, err := s.FlushCache(); n != 9 || err == nil || !strings.Contains(err.Error(), "dp replica 1: no prefix cache") {
		t.Fatalf("flush with a failing replica: %d %v", n, err)
	}
}
