package engine

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"
)

// gatedHook is a prefill hook whose request may be admitted only once open
// is closed, and that can fail its room meanwhile.
type gatedHook struct {
	*recHook
	open   chan struct{}
	failed error
}

func (h *gatedHook) Ready() <-chan struct{} { return h.open }

func (h *gatedHook) Aborted() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.failed
}

// TestPrefillGate: a gated prefill request reserves nothing and does not
// hold up the queue while the pool is short; it is admitted early once the
// pool has room to spare, or when its gate opens; a room that fails while
// gated ends the request with the room's error.
func TestPrefillGate(t *testing.T) {
	te := startEngine(t, 16, 4, nil)
	hold, _ := te.pages.Take(10) // 6 free: 3 for the gated one would leave less than a quarter
	h := &gatedHook{recHook: newRecHook(), open: make(chan struct{})}
	ch, err := te.Submit(context.Background(), &Request{InputIDs: ids("gated prompt"), Prefill: h}) // 3 pages
	if err != nil {
		t.Fatal(err)
	}
	// A later colocated request goes past it.
	r := te.generate(t, &Request{InputIDs: ids("ab"), Params: SamplingParams{MaxNewTokens: 5, IgnoreEOS: true}})
	if r.finish.Type != "length" {
		t.Fatalf("request behind a gated one: %+v", r.finish)
	}
	if c := h.called(); len(c) != 0 {
		t.Fatalf("gated hook was called while the pool was short and the gate shut: %v", c)
	}
	if s := te.Stats(); s.Queued != 1 || s.FreePages != 6 {
		t.Fatalf("gated request: %+v, want it queued holding no page", s)
	}
	hold.Release() // room to spare: admitted before its gate opens
	waitFor(t, "early admission", func() bool { return len(h.called()) > 0 })
	close(h.open)
	h.wait(t)
	if pr := collect(t, ch); pr.finish.Type != "stop" || h.err != nil || h.called()[0] != "pages" {
		t.Fatalf("gated request: finish %+v, hook %v err %v", pr.finish, h.called(), h.err)
	}
	h.release()

	// Short pool, gate opens: admitted then.
	hold, _ = te.pages.Take(10)
	h1 := &gatedHook{recHook: newRecHook(), open: make(chan struct{})}
	ch1, _ := te.Submit(context.Background(), &Request{InputIDs: ids("gated prompt"), Prefill: h1})
	time.Sleep(20 * time.Millisecond)
	if c := h1.called(); len(c) != 0 {
		t.Fatalf("admitted with a short pool and a shut gate: %v", c)
	}
	close(h1.open)
	h1.wait(t)
	if pr := collect(t, ch1); pr.finish.Type != "stop" || h1.err != nil {
		t.Fatalf("after the gate opened: finish %+v, err %v", pr.finish, h1.err)
	}
	h1.release()

	// Failing while gated (the pool still short): the room's error ends
	// it, no page was taken.
	h2 := &gatedHook{recHook: newRecHook(), open: make(chan struct{})}
	ch2, err := te.Submit(context.Background(), &Request{InputIDs: ids("gated prompt"), Prefill: h2})
	if err != nil {
		t.Fatal(err)
	}
	boom := errors.New("decode never came")
	h2.mu.Lock()
	h2.failed = boom
	h2.mu.Unlock()
	close(h2.open) // the room opens its gate when it fails
	h2.wait(t)
	if r := collect(t, ch2); r.finish.Type != "abort" || !errors.Is(h2.err, boom) || slices.Contains(h2.called(), "pages") {
		t.Fatalf("failed while gated: finish %+v, hook err %v, calls %v", r.finish, h2.err, h2.called())
	}
	hold.Release()
	waitFor(t, "pages to return", func() bool { return te.pages.Free() == 16 })
}

// TestQueueWait: a request that cannot get its pages ends with
// ErrQueueTimeout after MaxQueueWait, while one that gets them in time
// runs; the bound is measured from submission.
func TestQueueWait(t *testing.T) {
	const bound = 150 * time.Millisecond
	te := startEngine(t, 8, 4, func(c *Config) { c.MaxQueueWait = bound })
	hold, err := te.pages.Take(7)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	ch, err := te.Submit(context.Background(), &Request{InputIDs: ids("0123456789"), Params: SamplingParams{MaxNewTokens: 2}}) // 3 pages
	if err != nil {
		t.Fatal(err)
	}
	r := collect(t, ch)
	el := time.Since(start)
	if r.finish.Type != "abort" || !errors.Is(r.finish.Err, ErrQueueTimeout) {
		t.Fatalf("finish %+v, want abort with ErrQueueTimeout", r.finish)
	}
	if el < bound || el > bound+2*time.Second {
		t.Fatalf("ended after %v, want about %v", el, bound)
	}
	// Pages freed outside the engine before the bound: admitted at once.
	ch, err = te.Submit(context.Background(), &Request{InputIDs: ids("0123456789"), Params: SamplingParams{MaxNewTokens: 2}})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(bound / 3)
	hold.Release()
	if r := collect(t, ch); r.finish.Type != "length" {
		t.Fatalf("after pages were freed: %+v", r.finish)
	}
	waitFor(t, "pages to return", func() bool { return te.pages.Free() == 8 })
}

// TestSubmitFailureTellsHook: a prefill request Submit refuses still gets
// Done with the error, so its room is not left waiting for the engine.
func TestSubmitFailureTellsHook(t *testing.T) {
	te := startEngine(t, 8, 4, nil)
	h := newRecHook()
	_, err := te.Submit(context.Background(), &Request{InputIDs: make([]int, 100), Prefill: h}) // beyond the pool
	if !errors.Is(err, ErrPromptTooLong) {
		t.Fatalf("Submit: %v", err)
	}
	h.wait(t)
	if !errors.Is(h.err, ErrPromptTooLong) || h.first != -1 {
		t.Fatalf("hook Done(%d, %v), want -1 and the Submit error", h.first, h.err)
	}
	h.release() // a no-op release must be callable
}
