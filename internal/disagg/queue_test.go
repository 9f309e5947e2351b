package disagg

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
)

// TestDecodeQueuesForPages: with the decode pool full, a room waits for
// pages in arrival order and then succeeds, although the wait is longer
// than the bootstrap and KV bound: that bound starts once the pages are
// reserved. Past QueueWait the room fails as pool_full (503).
func TestDecodeQueuesForPages(t *testing.T) {
	const bound = time.Second
	x := newPD(t, pdOpts{decodeTimeout: bound, prefillTimeout: bound, queueWait: 5 * time.Second})
	hold, err := x.dec.pages.Take(testLayout.Pages)
	if err != nil {
		t.Fatal(err)
	}
	dreq := &engine.Request{InputIDs: make([]int, 9)}
	ch := x.prepareDecode(context.Background(), dreq, x.p.Port(), 31)
	preq := &engine.Request{InputIDs: make([]int, 9)}
	if err := x.p.Prepare(context.Background(), preq, 31); err != nil {
		t.Fatal(err)
	}
	select {
	case <-preq.Prefill.(engine.PrefillGate).Ready():
		t.Fatal("the prefill's gate opened before decode registered")
	case <-time.After(2 * bound): // longer than either side's bound alone
	}
	hold.Release()
	select {
	case <-preq.Prefill.(engine.PrefillGate).Ready():
	case <-time.After(2 * time.Second):
		t.Fatal("the prefill's gate did not open after decode registered")
	}
	f := x.pre.startPrefill(t, preq.Prefill, 9)
	f.chunk(preq.Prefill, 0, 9)
	f.done(preq.Prefill, 5, 0, nil)
	if res := wait(t, ch, 2*time.Second); res.err != nil {
		t.Fatalf("queued room: %v", res.err)
	}
	dreq.Preloaded.Table.Release()
	f.waitReleased(t, time.Second)

	// Past the queue bound: pool_full, 503, nothing held.
	y := newPD(t, pdOpts{decodeTimeout: bound, queueWait: 100 * time.Millisecond})
	hold, _ = y.dec.pages.Take(testLayout.Pages)
	defer hold.Release()
	res := wait(t, y.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, y.p.Port(), 32), 2*time.Second)
	var re *RoomError
	if !errors.As(res.err, &re) || re.Reason != ReasonPoolFull || re.HTTPStatus() != http.StatusServiceUnavailable || !errors.Is(res.err, ErrPoolFull) {
		t.Fatalf("error %v, want a pool_full RoomError (503)", res.err)
	}
	if y.dec.pages.Waiting() != 0 || y.p.Rooms() != 0 {
		t.Fatalf("after the queue bound: %d waiting, %d prefill rooms", y.dec.pages.Waiting(), y.p.Rooms())
	}
}

// TestDecodeWaitsWhilePrefillQueued: the decode's KV bound restarts while
// the prefill reports the room still queued for its own pages.
func TestDecodeWaitsWhilePrefillQueued(t *testing.T) {
	const bound = 600 * time.Millisecond
	x := newPD(t, pdOpts{decodeTimeout: bound, heartbeat: 50 * time.Millisecond})
	dreq := &engine.Request{InputIDs: make([]int, 9)}
	ch := x.prepareDecode(context.Background(), dreq, x.p.Port(), 41)
	preq := &engine.Request{InputIDs: make([]int, 9)}
	if err := x.p.Prepare(context.Background(), preq, 41); err != nil {
		t.Fatal(err)
	}
	// The engine has not admitted the request (no Pages call) for 3 bounds.
	select {
	case res := <-ch:
		t.Fatalf("decode gave up while the prefill was queued: %v", res.err)
	case <-time.After(3 * bound):
	}
	f := x.pre.startPrefill(t, preq.Prefill, 9)
	f.chunk(preq.Prefill, 0, 9)
	f.done(preq.Prefill, 5, 0, nil)
	if res := wait(t, ch, 2*time.Second); res.err != nil {
		t.Fatalf("room: %v", res.err)
	}
	dreq.Preloaded.Table.Release()

	// Once admitted (running), the bound holds again.
	dreq2 := &engine.Request{InputIDs: make([]int, 9)}
	ch2 := x.prepareDecode(context.Background(), dreq2, x.p.Port(), 42)
	preq2 := &engine.Request{InputIDs: make([]int, 9)}
	x.p.Prepare(context.Background(), preq2, 42)
	x.pre.startPrefill(t, preq2.Prefill, 9) // admitted, never finishes
	res := wait(t, ch2, 3*bound+2*time.Second)
	var re *RoomError
	if !errors.As(res.err, &re) || re.Reason != ReasonKVTimeout || re.HTTPStatus() != http.StatusGatewayTimeout {
		t.Fatalf("error %v, want a kv_timeout RoomError", res.err)
	}
}

// TestFailureReasons: a room's reason reaches the decode and the metric as
// the prefill named it.
func TestFailureReasons(t *testing.T) {
	x := newPD(t, pdOpts{failTransfers: true})
	dreq := &engine.Request{InputIDs: make([]int, 9)}
	ch := x.prepareDecode(context.Background(), dreq, x.p.Port(), 51)
	preq := &engine.Request{InputIDs: make([]int, 9)}
	x.p.Prepare(context.Background(), preq, 51)
	f := x.pre.startPrefill(t, preq.Prefill, 9)
	f.chunk(preq.Prefill, 0, 9)
	f.done(preq.Prefill, 5, 0, nil)
	res := wait(t, ch, 3*time.Second)
	var re *RoomError
	if !errors.As(res.err, &re) || re.Reason != ReasonBounds || re.Room != 51 {
		t.Fatalf("error %v, want room 51's bounds failure", res.err)
	}
	f.waitReleased(t, time.Second)
	for _, tc := range []struct {
		r    Reason
		code int
	}{{ReasonKVTimeout, 504}, {ReasonPoolFull, 503}, {ReasonOverloaded, 503}, {ReasonInvalid, 400}, {ReasonAuth, 502}, {ReasonCanceled, 499}} {
		if got := (&RoomError{Reason: tc.r}).HTTPStatus(); got != tc.code {
			t.Errorf("%s: status %d, want %d", tc.r, got, tc.code)
		}
	}
	if knownReason("from-a-newer-peer") != ReasonTransfer {
		t.Error("an unknown reason from the wire was kept")
	}
}

// TestPrefillRestartedSamePort: decode remembers a prefill's info; when a
// new prefill process answers on the same port, the first registration is
// refused as meant for the old one and the room goes through with the new
// one's info.
func TestPrefillRestartedSamePort(t *testing.T) {
	x := newPD(t, pdOpts{})
	run := func(p *Prefill, room uint64) {
		t.Helper()
		dreq := &engine.Request{InputIDs: make([]int, 9)}
		ch := x.prepareDecode(context.Background(), dreq, p.Port(), room)
		preq := &engine.Request{InputIDs: make([]int, 9)}
		if err := p.Prepare(context.Background(), preq, room); err != nil {
			t.Fatal(err)
		}
		f := x.pre.startPrefill(t, preq.Prefill, 9)
		f.chunk(preq.Prefill, 0, 9)
		f.done(preq.Prefill, 5, 0, nil)
		if res := wait(t, ch, 3*time.Second); res.err != nil {
			t.Fatalf("room %d: %v", room, res.err)
		}
		dreq.Preloaded.Table.Release()
		f.waitReleased(t, time.Second)
	}
	run(x.p, 61)
	port := x.p.Port()
	x.p.Close()
	info := x.pre.info
	info.Incarnation = "restarted"
	p2, err := NewPrefill(context.Background(), PrefillConfig{Transfer: x.pre.te, Info: info,
		Listen: fmt.Sprintf("127.0.0.1:%d", port), AuxSlots: 8, Secret: testSecret})
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	run(p2, 62)
}

// TestDecodeHoldsPrefix: the decode's prefix cache holds the prompt's first
// pages; the room shares them, tells the prefill, and the prefill sends
// only the rest: the held pages are not written and fewer bytes move.
func TestDecodeHoldsPrefix(t *testing.T) {
	x := newPD(t, pdOpts{})
	ps := testLayout.PageSize
	cache := kvcache.NewRadix(x.dec.pages, ps)
	x.d.cfg.Cache = cache
	const prompt = 21 // 6 pages; all but the last token: 5 whole pages
	ids := make([]int, prompt)
	toks := make([]int32, prompt)
	for i := range ids {
		ids[i], toks[i] = i+1, int32(i+1)
	}
	// An earlier request left the first 3 pages in the decode's cache.
	prev, _ := x.dec.pages.Take(3)
	for i, pg := range prev.IDs() {
		x.dec.fill(100+i, pg) // a marker the prefill must not overwrite
	}
	cache.Insert(toks[:3*ps], prev.IDs())
	held := append([]int32(nil), prev.IDs()...)
	prev.Release()

	dreq := &engine.Request{InputIDs: ids}
	ch := x.prepareDecode(context.Background(), dreq, x.p.Port(), 71)
	preq := &engine.Request{InputIDs: ids}
	x.p.Prepare(context.Background(), preq, 71)
	f := x.pre.startPrefill(t, preq.Prefill, prompt)
	f.chunk(preq.Prefill, 0, prompt)
	f.done(preq.Prefill, 5, 0, nil)
	if res := wait(t, ch, 3*time.Second); res.err != nil {
		t.Fatal(res.err)
	}
	pl := dreq.Preloaded
	got := pl.Table.IDs()
	if !slices.Equal(got[:3], held) {
		t.Fatalf("decode pages %v do not start with the cached %v", got, held)
	}
	for i := range 6 {
		for l := 0; l < testLayout.Layers; l++ {
			for k := kvcache.K; k <= kvcache.V; k++ {
				want := pageOf(x.pre.pool, l, k, int(f.pages[i]))
				if i < 3 { // held: the earlier request's bytes stay
					probe := newSidePage(x.dec, 100+i)
					want = probe(l, k)
				}
				if !bytes.Equal(pageOf(x.dec.pool, l, k, int(got[i])), want) {
					t.Fatalf("page %d layer %d kind %d: wrong bytes (held pages must be left alone, the rest pushed)", i, l, k)
				}
			}
		}
	}
	pl.Table.Release()
	f.waitReleased(t, time.Second)
}

// newSidePage returns the bytes fill(i, ...) writes for a layer and kind.
func newSidePage(s *side, i int) func(l int, k kvcache.Kind) []byte {
	return func(l int, k kvcache.Kind) []byte {
		b := make([]byte, s.pool.Layout.PageBytes())
		for j := range b {
			b[j] = byte(i*131 + l*17 + int(k)*7 + j)
		}
		return b
	}
}
