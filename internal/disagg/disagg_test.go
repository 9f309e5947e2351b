package disagg

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
	"go.uber.org/zap"
)

// testLayout is a small KV pool: 2 layers, 4 tokens a page, 32 pages.
var testLayout = kvcache.Layout{Layers: 2, PageSize: 4, KVHeads: 2, HeadDim: 8, ElemBytes: 4, Pages: 32}

// side is one process's half in-process: a transfer engine (tcp, p2p), a
// registered KV pool and its page allocator.
type side struct {
	te    *transfer.Engine
	mem   *transfer.HostMemory
	pool  *kvcache.Pool
	pages *kvcache.Allocator
	info  Info
}

// xferTimeout is the transfer engine's bound in these tests.
const xferTimeout = 500 * time.Millisecond

func newSide(t *testing.T, model string, lay kvcache.Layout, onNotify func(transfer.Notification)) *side {
	t.Helper()
	ctx := context.Background()
	te, err := transfer.New(ctx, transfer.Config{Listen: "127.0.0.1:0", Transports: []transfer.Transport{tcp.New(tcp.Config{})},
		Timeout: xferTimeout, OnNotify: onNotify})
	if err != nil {
		t.Fatal(err)
	}
	mem, err := te.AllocHost(ctx, lay.TotalBytes(), 0, transfer.AccessReadWrite)
	if err != nil {
		te.Close()
		t.Fatal(err)
	}
	pool, err := kvcache.NewPool(lay, mem.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	s := &side{te: te, mem: mem, pool: pool, pages: kvcache.NewAllocator(lay.Pages),
		info: Info{Model: model, Fingerprint: "test dim=32", DType: "float32", Layout: lay, Segment: te.Name(),
			Ranks: []Rank{{Segment: te.Name(), PoolAddr: mem.Addr(), Shard: kvcache.Shard{Layout: lay}}}, Incarnation: te.Incarnation(), AuxBytes: AuxSize}}
	t.Cleanup(func() {
		te.FreeHost(context.Background(), mem)
		te.Close()
	})
	return s
}

// pd is a prefill and a decode, wired as serve wires them.
type pd struct {
	pre, dec *side
	p        *Prefill
	d        *Decode
}

type pdOpts struct {
	prefillTimeout, decodeTimeout, heartbeat time.Duration
	decodeModel                              string
	decodeLayout                             *kvcache.Layout
	failTransfers                            bool
	pushByLayer                              bool
	queueWait                                time.Duration
}

// testSecret is the cluster secret of the bootstrap calls in these tests.
var testSecret = func() auth.Secret {
	s, err := auth.New("disagg-test-secret-0123", "test")
	if err != nil {
		panic(err)
	}
	return s
}()

func newPD(t *testing.T, o pdOpts) *pd {
	t.Helper()
	var dec atomic.Pointer[Decode]
	x := &pd{}
	x.pre = newSide(t, "m", testLayout, nil)
	model, lay := "m", testLayout
	if o.decodeModel != "" {
		model = o.decodeModel
	}
	if o.decodeLayout != nil {
		lay = *o.decodeLayout
	}
	x.dec = newSide(t, model, lay, func(n transfer.Notification) {
		if d := dec.Load(); d != nil {
			d.OnNotify(n)
		}
	})
	var err error
	var xfer Transfer = x.pre.te
	if o.failTransfers {
		xfer = outOfBounds{x.pre.te}
	}
	x.p, err = NewPrefill(context.Background(), PrefillConfig{Transfer: xfer, Info: x.pre.info, Listen: "127.0.0.1:0",
		Timeout: o.prefillTimeout, QueueWait: o.queueWait, AuxSlots: 8, PushByLayer: o.pushByLayer,
		Secret: testSecret})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.p.Close() })
	x.d, err = NewDecode(context.Background(), DecodeConfig{Transfer: x.dec.te, Info: x.dec.info, Pages: x.dec.pages,
		Timeout: o.decodeTimeout, QueueWait: o.queueWait, Heartbeat: o.heartbeat, AuxSlots: 8, Secret: testSecret})
	if err != nil {
		t.Fatal(err)
	}
	dec.Store(x.d)
	t.Cleanup(func() { x.d.Close() })
	return x
}

// outOfBounds is a transfer engine whose KV writes all aim far outside the
// decode's registered regions: the real engine refuses them.
type outOfBounds struct{ *transfer.Engine }

func (t outOfBounds) Transfer(ctx context.Context, reqs []transfer.Request) error {
	bad := slices.Clone(reqs)
	for i := range bad {
		bad[i].Remote = 1 << 62
	}
	return t.Engine.Transfer(ctx, bad)
}

// fill writes a pattern that names (page index in the prompt, layer, kind,
// byte) into page of s's pool.
func (s *side) fill(i int, page int32) {
	for l := 0; l < s.pool.Layout.Layers; l++ {
		for k := kvcache.K; k <= kvcache.V; k++ {
			b := pageOf(s.pool, l, k, int(page))
			for j := range b {
				b[j] = byte(i*131 + l*17 + int(k)*7 + j)
			}
		}
	}
}

// fakeEngine plays the model engine for a prefill-only request: it takes
// pages, fills them chunk by chunk and drives the hook.
type fakeEngine struct {
	s        *side
	pages    []int32
	released chan struct{}
	ended    atomic.Bool           // done was called
	top      []sampling.TopLogprob // the first token's top logprobs
}

func (s *side) startPrefill(t *testing.T, hook engine.PrefillHook, prompt int) *fakeEngine {
	t.Helper()
	n := (prompt + s.pool.Layout.PageSize - 1) / s.pool.Layout.PageSize
	pages, err := s.pages.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	hook.Pages(pages)
	f := &fakeEngine{s: s, pages: pages, released: make(chan struct{})}
	// A test that fails before the engine's Done would leave the room's
	// worker waiting for it, and the prefill's Close with it: end it.
	t.Cleanup(func() {
		if !f.ended.Load() {
			f.done(hook, -1, 0, errors.New("test ended before the engine was done"))
		}
	})
	return f
}

// chunk computes the prompt's tokens up to done.
func (f *fakeEngine) chunk(hook engine.PrefillHook, from, done int) {
	ps := f.s.pool.Layout.PageSize
	for i := from / ps; i < (done+ps-1)/ps; i++ {
		f.s.fill(i, f.pages[i])
	}
	hook.Chunk(done)
}

func (f *fakeEngine) done(hook engine.PrefillHook, first int, lp float32, err error) {
	f.ended.Store(true)
	var once sync.Once
	hook.Done(first, lp, f.top, err, func() {
		once.Do(func() {
			if rerr := f.s.pages.Release(f.pages); rerr != nil {
				panic(rerr)
			}
			close(f.released)
		})
	})
}

func (f *fakeEngine) waitReleased(t *testing.T, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	select {
	case <-f.released:
		return time.Since(start)
	case <-time.After(within):
		t.Fatalf("prefill did not release its pages within %v", within)
		return 0
	}
}

type prepResult struct {
	err  error
	took time.Duration
}

// prepareDecode runs Decode.Prepare in the background.
func (x *pd) prepareDecode(ctx context.Context, req *engine.Request, port int, room uint64) chan prepResult {
	ch := make(chan prepResult, 1)
	go func() {
		start := time.Now()
		err := x.d.Prepare(ctx, req, "127.0.0.1", port, room)
		ch <- prepResult{err, time.Since(start)}
	}()
	return ch
}

func wait(t *testing.T, ch chan prepResult, within time.Duration) prepResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(within):
		t.Fatalf("decode Prepare did not return within %v", within)
		return prepResult{}
	}
}

func waitFor(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func mustContain(t *testing.T, err error, subs ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want one containing %q", subs)
	}
	for _, s := range subs {
		if !strings.Contains(err.Error(), s) {
			t.Fatalf("error %q does not contain %q", err, s)
		}
	}
}

func TestRoomSuccess(t *testing.T) {
	for _, tc := range []struct {
		name         string
		prompt       int
		chunks       []int
		decodeFirst  bool
		registerLate bool // decode registers after the engine finished
		settle       bool // every page is pushed before Done (the first token still must arrive)
		fragment     bool // decode's free pages are every other page: single pages go as a page list
	}{
		{name: "page-aligned prompt pushed before Done", prompt: 16, chunks: []int{8, 16}, decodeFirst: true, settle: true},
		{name: "one chunk", prompt: 3, chunks: []int{3}, decodeFirst: true},
		{name: "chunks, decode first", prompt: 37, chunks: []int{8, 16, 30, 37}, decodeFirst: true},
		{name: "chunks, prefill first", prompt: 37, chunks: []int{10, 37}},
		{name: "engine done before registration", prompt: 21, chunks: []int{12, 21}, registerLate: true},
		{name: "fragmented decode pool", prompt: 37, chunks: []int{10, 37}, decodeFirst: true, fragment: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := newPD(t, pdOpts{})
			var held []int32 // decode pages taken to fragment its pool
			if tc.fragment {
				all, err := x.dec.pages.Alloc(testLayout.Pages)
				if err != nil {
					t.Fatal(err)
				}
				var even []int32
				for _, p := range all {
					if p%2 == 0 {
						even = append(even, p)
					} else {
						held = append(held, p)
					}
				}
				if err := x.dec.pages.Release(even); err != nil {
					t.Fatal(err)
				}
			}
			room := uint64(0x5eed0000 + tc.prompt)
			dreq := &engine.Request{ID: "d", InputIDs: make([]int, tc.prompt)}
			var dch chan prepResult
			if tc.decodeFirst {
				dch = x.prepareDecode(context.Background(), dreq, x.p.Port(), room)
			}
			preq := &engine.Request{ID: "p", InputIDs: make([]int, tc.prompt)}
			if err := x.p.Prepare(context.Background(), preq, room); err != nil {
				t.Fatal(err)
			}
			if preq.Prefill == nil || preq.Room != room {
				t.Fatalf("Prepare did not make a prefill-only request of room %d: %+v", room, preq)
			}
			if !tc.decodeFirst && !tc.registerLate {
				dch = x.prepareDecode(context.Background(), dreq, x.p.Port(), room)
			}
			f := x.pre.startPrefill(t, preq.Prefill, tc.prompt)
			f.top = []sampling.TopLogprob{{Token: 77, Logprob: -0.25}, {Token: 9, Logprob: -1.5}}
			from := 0
			for _, c := range tc.chunks {
				f.chunk(preq.Prefill, from, c)
				from = c
			}
			if tc.settle {
				x.waitRegistered(t, room)
				waitFor(t, "all pages pushed", 2*time.Second, func() bool {
					x.p.mu.Lock()
					r := x.p.rooms[room]
					x.p.mu.Unlock()
					r.mu.Lock()
					defer r.mu.Unlock()
					return r.sentPages() == len(f.pages)
				})
			}
			f.done(preq.Prefill, 77, -0.25, nil)
			if tc.registerLate {
				dch = x.prepareDecode(context.Background(), dreq, x.p.Port(), room)
			}
			res := wait(t, dch, 5*time.Second)
			if res.err != nil {
				t.Fatalf("decode: %v", res.err)
			}
			pl := dreq.Preloaded
			if pl == nil || pl.FirstToken != 77 || pl.FirstLogprob != -0.25 || !slices.Equal(pl.FirstTop, f.top) {
				t.Fatalf("Preloaded = %+v, want first token 77, logprob -0.25, top %v", pl, f.top)
			}
			if len(pl.Table.IDs()) != len(f.pages) {
				t.Fatalf("decode has %d pages, prefill %d", len(pl.Table.IDs()), len(f.pages))
			}
			for i := 1; tc.fragment && i < len(pl.Table.IDs()); i++ {
				if pl.Table.IDs()[i] == pl.Table.IDs()[i-1]+1 {
					t.Fatalf("decode pages %v are not fragmented", pl.Table.IDs())
				}
			}
			// The pages between them were not written.
			for _, p := range held {
				for l := 0; l < testLayout.Layers; l++ {
					for k := kvcache.K; k <= kvcache.V; k++ {
						if b := pageOf(x.dec.pool, l, k, int(p)); !bytes.Equal(b, make([]byte, len(b))) {
							t.Fatalf("decode page %d (not the room's) layer %d kind %d was written", p, l, k)
						}
					}
				}
			}
			for i := range f.pages {
				for l := 0; l < testLayout.Layers; l++ {
					for k := kvcache.K; k <= kvcache.V; k++ {
						want := pageOf(x.pre.pool, l, k, int(f.pages[i]))
						got := pageOf(x.dec.pool, l, k, int(pl.Table.IDs()[i]))
						if !bytes.Equal(want, got) {
							t.Fatalf("prompt page %d (decode page %d) layer %d kind %d differs from the prefill's", i, pl.Table.IDs()[i], l, k)
						}
					}
				}
			}
			f.waitReleased(t, 2*time.Second)
			waitFor(t, "prefill rooms gone", 2*time.Second, func() bool { return x.p.Rooms() == 0 })
			// The pages belong to the decode engine now; it frees them.
			if got, want := x.dec.pages.Free(), testLayout.Pages-len(pl.Table.IDs())-len(held); got != want {
				t.Fatalf("decode free pages %d, want %d", got, want)
			}
			if err := pl.Table.Release(); err != nil {
				t.Fatal(err)
			}
			if err := x.dec.pages.Release(held); err != nil {
				t.Fatal(err)
			}
			if x.d.aux.inUse() != 0 || x.p.aux.inUse() != 0 {
				t.Fatalf("aux slots in use: decode %d, prefill %d", x.d.aux.inUse(), x.p.aux.inUse())
			}
		})
	}
}

// gate is a fence that opens when closed.
type gate chan struct{}

func (g gate) Wait() error { <-g; return nil }

// layerWritten reports whether any page of layer l in s's pool is non-zero.
func (s *side) layerWritten(l int) bool {
	for p := 0; p < s.pool.Layout.Pages; p++ {
		for k := kvcache.K; k <= kvcache.V; k++ {
			if b := pageOf(s.pool, l, k, p); !bytes.Equal(b, make([]byte, len(b))) {
				return true
			}
		}
	}
	return false
}

// TestPushByLayer: with PushByLayer a layer's pages go to decode once the
// engine reports the layer (and its fence opens), before the pass ends.
func TestPushByLayer(t *testing.T) {
	x := newPD(t, pdOpts{pushByLayer: true})
	const room, prompt = 0x1a7e, 14 // 4 pages, the last one partial
	dreq := &engine.Request{ID: "d", InputIDs: make([]int, prompt)}
	dch := x.prepareDecode(context.Background(), dreq, x.p.Port(), room)
	preq := &engine.Request{ID: "p", InputIDs: make([]int, prompt)}
	if err := x.p.Prepare(context.Background(), preq, room); err != nil {
		t.Fatal(err)
	}
	lh, ok := preq.Prefill.(engine.PrefillLayerHook)
	if !ok {
		t.Fatalf("prefill hook %T takes no layer calls", preq.Prefill)
	}
	x.waitRegistered(t, room)
	f := x.pre.startPrefill(t, preq.Prefill, prompt)
	for i, p := range f.pages {
		x.pre.fill(i, p)
	}
	g := make(gate)
	gateOpen := false
	t.Cleanup(func() { // a failed test must not leave the room's worker waiting
		if !gateOpen {
			close(g)
		}
	})
	lh.Layer(0, prompt, g)
	time.Sleep(50 * time.Millisecond)
	if x.dec.layerWritten(0) {
		t.Fatal("layer 0 pushed before its fence opened")
	}
	close(g)
	gateOpen = true
	waitFor(t, "layer 0 pushed", 2*time.Second, func() bool { return x.dec.layerWritten(0) })
	if x.dec.layerWritten(1) {
		t.Fatal("layer 1 pushed before it was reported")
	}
	lh.Layer(1, prompt, nil)
	waitFor(t, "layer 1 pushed", 2*time.Second, func() bool { return x.dec.layerWritten(1) })
	hook := preq.Prefill
	hook.Chunk(prompt)
	f.done(hook, 5, -1, nil)
	res := wait(t, dch, 5*time.Second)
	if res.err != nil {
		t.Fatalf("decode: %v", res.err)
	}
	pl := dreq.Preloaded
	for i := range f.pages {
		for l := 0; l < testLayout.Layers; l++ {
			for k := kvcache.K; k <= kvcache.V; k++ {
				if !bytes.Equal(pageOf(x.pre.pool, l, k, int(f.pages[i])), pageOf(x.dec.pool, l, k, int(pl.Table.IDs()[i]))) {
					t.Fatalf("prompt page %d layer %d kind %d differs", i, l, k)
				}
			}
		}
	}
	f.waitReleased(t, 2*time.Second)
	if err := pl.Table.Release(); err != nil {
		t.Fatal(err)
	}
}

// TestDecodeClose: closing the decode side ends the rooms waiting for KV
// (their pages come back, the prefill drops the room) and refuses new ones;
// the aux buffer goes only after.
func TestDecodeClose(t *testing.T) {
	x := newPD(t, pdOpts{})
	const room = 0xc105e
	dreq := &engine.Request{ID: "d", InputIDs: make([]int, 9)}
	dch := x.prepareDecode(context.Background(), dreq, x.p.Port(), room)
	x.waitRegistered(t, room)
	start := time.Now()
	if err := x.d.Close(); err != nil {
		t.Fatal(err)
	}
	res := wait(t, dch, time.Second)
	if !errors.Is(res.err, ErrDecodeClosing) {
		t.Fatalf("waiting room ended with %v, want ErrDecodeClosing", res.err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("Close took %v", el)
	}
	if got := x.dec.pages.Free(); got != testLayout.Pages {
		t.Fatalf("decode free pages %d, want all %d", got, testLayout.Pages)
	}
	waitFor(t, "prefill dropped the room", 2*time.Second, func() bool { return x.p.Rooms() == 0 })
	err := x.d.Prepare(context.Background(), &engine.Request{ID: "late", InputIDs: make([]int, 3)}, "127.0.0.1", x.p.Port(), room+1)
	if !errors.Is(err, ErrDecodeClosing) {
		t.Fatalf("Prepare after Close: %v", err)
	}
}

// TestManyRooms runs rooms concurrently and checks every page arrives where
// its room said.
func TestManyRooms(t *testing.T) {
	x := newPD(t, pdOpts{})
	const n = 6
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			room := uint64(1000 + i)
			prompt := 5 + 3*i
			dreq := &engine.Request{InputIDs: make([]int, prompt)}
			dch := x.prepareDecode(context.Background(), dreq, x.p.Port(), room)
			preq := &engine.Request{InputIDs: make([]int, prompt)}
			if err := x.p.Prepare(context.Background(), preq, room); err != nil {
				errs <- err
				return
			}
			f := x.pre.startPrefill(t, preq.Prefill, prompt)
			f.chunk(preq.Prefill, 0, prompt)
			f.done(preq.Prefill, i, 0, nil)
			select {
			case r := <-dch:
				if r.err != nil {
					errs <- r.err
					return
				}
			case <-time.After(5 * time.Second):
				errs <- fmt.Errorf("room %d: decode did not finish", room)
				return
			}
			if dreq.Preloaded.FirstToken != i {
				errs <- fmt.Errorf("room %d: first token %d, want %d", room, dreq.Preloaded.FirstToken, i)
			}
			for j := range f.pages {
				if !bytes.Equal(pageOf(x.pre.pool, 1, kvcache.V, int(f.pages[j])), pageOf(x.dec.pool, 1, kvcache.V, int(dreq.Preloaded.Table.IDs()[j]))) {
					errs <- fmt.Errorf("room %d: page %d differs", room, j)
				}
			}
			<-f.released
			dreq.Preloaded.Table.Release()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if x.dec.pages.Free() != testLayout.Pages || x.pre.pages.Free() != testLayout.Pages {
		t.Fatalf("free pages: decode %d, prefill %d, want %d", x.dec.pages.Free(), x.pre.pages.Free(), testLayout.Pages)
	}
}

// TestFirstTokenAlwaysArrives: a prompt that ends on a page boundary has all
// its pages out after its last chunk; the room must still wait for Done and
// carry the first token (Done racing the last push lost it once).
func TestFirstTokenAlwaysArrives(t *testing.T) {
	x := newPD(t, pdOpts{})
	for i := range 100 {
		room := uint64(5000 + i)
		dreq := &engine.Request{InputIDs: make([]int, 8)}
		dch := x.prepareDecode(context.Background(), dreq, x.p.Port(), room)
		preq := &engine.Request{InputIDs: make([]int, 8)}
		if err := x.p.Prepare(context.Background(), preq, room); err != nil {
			t.Fatal(err)
		}
		x.waitRegistered(t, room)
		f := x.pre.startPrefill(t, preq.Prefill, 8)
		f.chunk(preq.Prefill, 0, 8)
		time.Sleep(time.Duration(i%20) * 10 * time.Microsecond) // let Done land anywhere in the last push
		f.done(preq.Prefill, 3, 0, nil)
		res := wait(t, dch, 5*time.Second)
		if res.err != nil {
			t.Fatalf("room %d: %v", i, res.err)
		}
		if dreq.Preloaded.FirstToken != 3 {
			t.Fatalf("room %d: first token %d, want 3", i, dreq.Preloaded.FirstToken)
		}
		f.waitReleased(t, 2*time.Second)
		dreq.Preloaded.Table.Release()
	}
}

// TestDecodeNeverRegisters: the prefill fails the room within its bound and
// releases its pages.
func TestDecodeNeverRegisters(t *testing.T) {
	const bound = 300 * time.Millisecond
	// The prefill waits QueueWait more: the decode may be queueing for pages.
	x := newPD(t, pdOpts{prefillTimeout: bound - 100*time.Millisecond, queueWait: 100 * time.Millisecond})
	preq := &engine.Request{InputIDs: make([]int, 9)}
	start := time.Now()
	if err := x.p.Prepare(context.Background(), preq, 7); err != nil {
		t.Fatal(err)
	}
	f := x.pre.startPrefill(t, preq.Prefill, 9)
	f.chunk(preq.Prefill, 0, 9)
	f.done(preq.Prefill, 1, 0, nil)
	f.waitReleased(t, bound+2*time.Second)
	if el := time.Since(start); el < bound {
		t.Fatalf("released after %v, before the bound %v: decode had no chance", el, bound)
	}
	waitFor(t, "room gone", time.Second, func() bool { return x.p.Rooms() == 0 })
	if x.pre.pages.Free() != testLayout.Pages {
		t.Fatalf("prefill free pages %d, want %d", x.pre.pages.Free(), testLayout.Pages)
	}
}

// TestPrefillNeverGetsRequest: decode registered, the prefill's copy of the
// request never came; decode learns why within the prefill's bound.
func TestPrefillNeverGetsRequest(t *testing.T) {
	const bound = 300 * time.Millisecond
	x := newPD(t, pdOpts{prefillTimeout: bound, decodeTimeout: 5 * time.Second})
	dreq := &engine.Request{InputIDs: make([]int, 9)}
	res := wait(t, x.prepareDecode(context.Background(), dreq, x.p.Port(), 8), bound+2*time.Second)
	mustContain(t, res.err, "did not receive the request")
	if x.dec.pages.Free() != testLayout.Pages {
		t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), testLayout.Pages)
	}
}

// fakeBootstrap is a prefill bootstrap server that accepts rooms and never
// transfers anything.
type fakeBootstrap struct {
	srv        *httptest.Server
	info       Info
	registered chan RoomRequest
	canceled   chan string
	heartbeats chan struct{}
	mu         sync.Mutex
	inc        string
}

func newFakeBootstrap(t *testing.T, info Info) *fakeBootstrap {
	fb := &fakeBootstrap{info: info, registered: make(chan RoomRequest, 16), canceled: make(chan string, 16),
		heartbeats: make(chan struct{}, 1), inc: info.Incarnation}
	mux := http.NewServeMux()
	// answer signs as the real bootstrap server does.
	answer := func(w http.ResponseWriter, r *http.Request, v any) []byte {
		body, _ := io.ReadAll(r.Body)
		mac, err := checkRequest(testSecret, r, body, time.Now())
		if err != nil {
			t.Errorf("fake bootstrap: %v", err)
		}
		writeJSON(w, testSecret, mac, 200, v)
		return body
	}
	mux.HandleFunc("GET /bootstrap/info", func(w http.ResponseWriter, r *http.Request) { answer(w, r, fb.info) })
	mux.HandleFunc("GET /bootstrap/health", func(w http.ResponseWriter, r *http.Request) {
		fb.mu.Lock()
		inc := fb.inc
		fb.mu.Unlock()
		answer(w, r, map[string]string{"incarnation": inc})
		select {
		case fb.heartbeats <- struct{}{}:
		default:
		}
	})
	mux.HandleFunc("POST /bootstrap/rooms", func(w http.ResponseWriter, r *http.Request) {
		var rr RoomRequest
		json.Unmarshal(answer(w, r, map[string]string{"status": "ok"}), &rr)
		fb.registered <- rr
	})
	mux.HandleFunc("POST /bootstrap/cancel", func(w http.ResponseWriter, r *http.Request) {
		answer(w, r, map[string]string{"status": "ok"})
		fb.canceled <- r.URL.Query().Get("room")
	})
	fb.srv = httptest.NewServer(mux)
	t.Cleanup(fb.srv.Close)
	return fb
}

func (fb *fakeBootstrap) port() int { return fb.srv.Listener.Addr().(*net.TCPAddr).Port }

// TestPrefillDies: decode fails its waiting room within the bound and
// releases its pages, whatever way the prefill went away.
func TestPrefillDies(t *testing.T) {
	const hb = 100 * time.Millisecond
	t.Run("bootstrap unreachable", func(t *testing.T) {
		x := newPD(t, pdOpts{heartbeat: hb})
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		res := wait(t, x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, port, 1), 3*time.Second)
		mustContain(t, res.err, "unreachable")
		if x.dec.pages.Free() != testLayout.Pages || x.d.aux.inUse() != 0 {
			t.Fatalf("decode free pages %d (want %d), aux in use %d", x.dec.pages.Free(), testLayout.Pages, x.d.aux.inUse())
		}
	})
	t.Run("dies while decode waits", func(t *testing.T) {
		x := newPD(t, pdOpts{heartbeat: hb, decodeTimeout: 10 * time.Second})
		fb := newFakeBootstrap(t, x.pre.info)
		ch := x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, fb.port(), 2)
		select {
		case <-fb.registered:
		case <-time.After(3 * time.Second):
			t.Fatal("decode did not register the room")
		}
		<-fb.heartbeats // decode is waiting (heartbeats start after registration)
		if x.dec.pages.Free() == testLayout.Pages {
			t.Fatal("decode reserved no pages")
		}
		fb.srv.CloseClientConnections()
		fb.srv.Close()
		res := wait(t, ch, 10*hb+time.Second) // two missed heartbeats, with slack
		mustContain(t, res.err, "unreachable")
		if x.dec.pages.Free() != testLayout.Pages || x.d.aux.inUse() != 0 {
			t.Fatalf("decode free pages %d (want %d), aux in use %d", x.dec.pages.Free(), testLayout.Pages, x.d.aux.inUse())
		}
	})
	t.Run("restarts while decode waits", func(t *testing.T) {
		x := newPD(t, pdOpts{heartbeat: hb, decodeTimeout: 10 * time.Second})
		fb := newFakeBootstrap(t, x.pre.info)
		ch := x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, fb.port(), 3)
		select {
		case <-fb.registered:
		case <-time.After(3 * time.Second):
			t.Fatal("decode did not register the room")
		}
		fb.mu.Lock()
		fb.inc = "new-incarnation"
		fb.mu.Unlock()
		res := wait(t, ch, 5*hb+time.Second)
		mustContain(t, res.err, "restarted", "new-incarnation")
		if x.dec.pages.Free() != testLayout.Pages {
			t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), testLayout.Pages)
		}
	})
	t.Run("alive but silent", func(t *testing.T) {
		const bound = 400 * time.Millisecond
		x := newPD(t, pdOpts{heartbeat: hb, decodeTimeout: bound})
		fb := newFakeBootstrap(t, x.pre.info)
		res := wait(t, x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, fb.port(), 4), bound+2*time.Second)
		mustContain(t, res.err, "did not arrive within")
		if res.took < bound {
			t.Fatalf("failed after %v, before the bound %v", res.took, bound)
		}
		select {
		case r := <-fb.canceled:
			if r != "4" {
				t.Fatalf("canceled room %s, want 4", r)
			}
		default:
			t.Fatal("decode did not cancel the room at the prefill")
		}
		if x.dec.pages.Free() != testLayout.Pages {
			t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), testLayout.Pages)
		}
	})
}

// TestMismatchRefused: model, page size and layout mismatches are refused at
// bootstrap with both values named, on both sides.
func TestMismatchRefused(t *testing.T) {
	ps8 := testLayout
	ps8.PageSize = 8
	heads := testLayout
	heads.KVHeads = 4
	for _, tc := range []struct {
		name  string
		o     pdOpts
		wants []string
	}{
		{"page size", pdOpts{decodeLayout: &ps8}, []string{"page size mismatch", "8 here", "4 on the peer"}},
		{"model", pdOpts{decodeModel: "other"}, []string{"model mismatch", `"other" here`, `"m" on the peer`}},
		{"kv heads", pdOpts{decodeLayout: &heads}, []string{"kv heads", "4", "2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := newPD(t, tc.o)
			res := wait(t, x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, x.p.Port(), 5), 3*time.Second)
			mustContain(t, res.err, tc.wants...)
			if x.dec.pages.Free() != x.dec.pages.Total() {
				t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), x.dec.pages.Total())
			}
			// The prefill refuses such a registration too.
			rr := RoomRequest{Room: 6, Decode: x.dec.info, Pages: []int32{0, 1, 2}, Tokens: 9}
			b, _ := json.Marshal(rr)
			post := func(s auth.Secret) *http.Response {
				req, _ := http.NewRequest(http.MethodPost, fmt.Sprintf("http://127.0.0.1:%d/bootstrap/rooms", x.p.Port()), bytes.NewReader(b))
				if !s.IsZero() {
					signRequest(s, req, b, time.Now())
				}
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				return resp
			}
			// Without the secret, or with another, nothing is looked at.
			other, _ := auth.New("another-secret-altogether", "test")
			for _, s := range []auth.Secret{{}, other} {
				resp := post(s)
				resp.Body.Close()
				if resp.StatusCode != http.StatusUnauthorized {
					t.Fatalf("unauthenticated registration answered %d, want 401", resp.StatusCode)
				}
			}
			resp := post(testSecret)
			defer resp.Body.Close()
			t.Cleanup(http.DefaultClient.CloseIdleConnections)
			var e struct {
				Error struct{ Message string } `json:"error"`
			}
			json.NewDecoder(resp.Body).Decode(&e)
			if resp.StatusCode != 400 {
				t.Fatalf("prefill answered %d to a mismatched room, want 400", resp.StatusCode)
			}
			// The prefill names its own value first.
			msg := e.Error.Message
			if !strings.Contains(msg, "mismatch") && !strings.Contains(msg, "kv heads") {
				t.Fatalf("prefill refusal %q does not say what differs", msg)
			}
			if x.p.Rooms() != 0 {
				t.Fatalf("prefill kept %d rooms after refusing", x.p.Rooms())
			}
		})
	}
}

// TestPromptLengthMismatch: tokenizers that disagree fail the room on both
// sides.
func TestPromptLengthMismatch(t *testing.T) {
	x := newPD(t, pdOpts{})
	ch := x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, x.p.Port(), 9)
	preq := &engine.Request{InputIDs: make([]int, 10)}
	if err := x.p.Prepare(context.Background(), preq, 9); err != nil {
		t.Fatal(err)
	}
	f := x.pre.startPrefill(t, preq.Prefill, 10)
	f.chunk(preq.Prefill, 0, 10)
	f.done(preq.Prefill, 1, 0, nil)
	res := wait(t, ch, 3*time.Second)
	mustContain(t, res.err, "10 tokens here, 9 on decode")
	f.waitReleased(t, 2*time.Second)
	if x.dec.pages.Free() != testLayout.Pages {
		t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), testLayout.Pages)
	}
}

// TestTransferFails: a transfer the engine refuses fails the room on both
// sides with the transfer error, and both release.
func TestTransferFails(t *testing.T) {
	x := newPD(t, pdOpts{failTransfers: true})
	ch := x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 13)}, x.p.Port(), 10)
	preq := &engine.Request{InputIDs: make([]int, 13)}
	if err := x.p.Prepare(context.Background(), preq, 10); err != nil {
		t.Fatal(err)
	}
	f := x.pre.startPrefill(t, preq.Prefill, 13)
	f.chunk(preq.Prefill, 0, 8) // the first push already fails
	f.chunk(preq.Prefill, 8, 13)
	f.done(preq.Prefill, 1, 0, nil)
	res := wait(t, ch, 3*time.Second)
	mustContain(t, res.err, "KV transfer to "+x.dec.info.Segment)
	if !strings.Contains(res.err.Error(), "bounds") && !strings.Contains(res.err.Error(), "not inside") &&
		!strings.Contains(res.err.Error(), "region") {
		t.Logf("transfer error (check it names the bounds): %v", res.err)
	}
	f.waitReleased(t, 2*time.Second)
	if x.dec.pages.Free() != testLayout.Pages {
		t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), testLayout.Pages)
	}
}

// TestUnreachableDecodeSegment: the prefill cannot open the decode's
// segment (so it can neither push nor notify); decode learns why through
// the bootstrap server's health check, not by waiting for its timeout.
func TestUnreachableDecodeSegment(t *testing.T) {
	x := newPD(t, pdOpts{decodeTimeout: 10 * time.Second, heartbeat: 50 * time.Millisecond})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone := ln.Addr().String()
	ln.Close()
	x.d.cfg.Info.Segment = gone // what decode registers the room with
	x.d.cfg.Info.Ranks[0].Segment = gone
	ch := x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 13)}, x.p.Port(), 12)
	preq := &engine.Request{InputIDs: make([]int, 13)}
	if err := x.p.Prepare(context.Background(), preq, 12); err != nil {
		t.Fatal(err)
	}
	f := x.pre.startPrefill(t, preq.Prefill, 13)
	f.chunk(preq.Prefill, 0, 13)
	f.done(preq.Prefill, 1, 0, nil)
	res := wait(t, ch, 3*time.Second)
	mustContain(t, res.err, "failed the room", "open decode segment "+gone)
	f.waitReleased(t, 2*time.Second)
	if x.dec.pages.Free() != testLayout.Pages {
		t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), testLayout.Pages)
	}
}

// TestPrefillAborted: the engine aborts the prefill request (client gone);
// decode learns it at once.
func TestPrefillAborted(t *testing.T) {
	x := newPD(t, pdOpts{})
	ch := x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, x.p.Port(), 11)
	preq := &engine.Request{InputIDs: make([]int, 9)}
	if err := x.p.Prepare(context.Background(), preq, 11); err != nil {
		t.Fatal(err)
	}
	f := x.pre.startPrefill(t, preq.Prefill, 9)
	f.chunk(preq.Prefill, 0, 4)
	x.waitRegistered(t, 11)
	f.done(preq.Prefill, -1, 0, context.Canceled)
	res := wait(t, ch, 3*time.Second)
	mustContain(t, res.err, "prefill failed")
	f.waitReleased(t, 2*time.Second)
	if x.dec.pages.Free() != testLayout.Pages {
		t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), testLayout.Pages)
	}
}

// TestAbortedBeforeRegistration: the prefill request failed before decode
// registered; decode's registration is refused at once with the reason.
func TestAbortedBeforeRegistration(t *testing.T) {
	x := newPD(t, pdOpts{})
	preq := &engine.Request{InputIDs: make([]int, 9)}
	if err := x.p.Prepare(context.Background(), preq, 14); err != nil {
		t.Fatal(err)
	}
	f := x.pre.startPrefill(t, preq.Prefill, 9)
	f.done(preq.Prefill, -1, 0, context.Canceled)
	f.waitReleased(t, 2*time.Second)
	waitFor(t, "room gone", time.Second, func() bool { return x.p.Rooms() == 0 })
	res := wait(t, x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, x.p.Port(), 14), time.Second)
	mustContain(t, res.err, "already failed", "canceled")
	if x.dec.pages.Free() != testLayout.Pages || x.p.Rooms() != 0 {
		t.Fatalf("decode free pages %d (want %d), prefill rooms %d", x.dec.pages.Free(), testLayout.Pages, x.p.Rooms())
	}
}

func (x *pd) waitRegistered(t *testing.T, room uint64) {
	t.Helper()
	waitFor(t, "room registered", 2*time.Second, func() bool {
		x.p.mu.Lock()
		defer x.p.mu.Unlock()
		r := x.p.rooms[room]
		if r == nil {
			return false
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.dst != nil
	})
}

// TestDecodeCanceled: the decode request is canceled while waiting; decode
// releases at once, the prefill fails the room and releases when its engine
// is done.
func TestDecodeCanceled(t *testing.T) {
	x := newPD(t, pdOpts{})
	ctx, cancel := context.WithCancel(context.Background())
	ch := x.prepareDecode(ctx, &engine.Request{InputIDs: make([]int, 30)}, x.p.Port(), 12)
	preq := &engine.Request{InputIDs: make([]int, 30)}
	if err := x.p.Prepare(context.Background(), preq, 12); err != nil {
		t.Fatal(err)
	}
	f := x.pre.startPrefill(t, preq.Prefill, 30)
	f.chunk(preq.Prefill, 0, 8)
	waitFor(t, "first chunk pushed", 2*time.Second, func() bool {
		x.p.mu.Lock()
		r := x.p.rooms[12]
		x.p.mu.Unlock()
		if r == nil {
			return false
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.sentPages() == 2
	})
	cancel()
	res := wait(t, ch, 2*time.Second)
	if !errors.Is(res.err, context.Canceled) {
		t.Fatalf("decode error %v, want context.Canceled", res.err)
	}
	if x.dec.pages.Free() != testLayout.Pages {
		t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), testLayout.Pages)
	}
	// The room is failed: later chunks push nothing into the freed pages.
	before := pageOf(x.dec.pool, 0, kvcache.K, 3)
	snap := append([]byte(nil), before...)
	f.chunk(preq.Prefill, 8, 30)
	f.done(preq.Prefill, 1, 0, nil)
	f.waitReleased(t, 2*time.Second)
	if !bytes.Equal(snap, pageOf(x.dec.pool, 0, kvcache.K, 3)) {
		t.Fatal("the prefill wrote into decode's pages after the room was canceled")
	}
	waitFor(t, "room gone", time.Second, func() bool { return x.p.Rooms() == 0 })
}

// TestPrefillClose fails the rooms in progress and releases their pages.
func TestPrefillClose(t *testing.T) {
	x := newPD(t, pdOpts{})
	ch := x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, x.p.Port(), 13)
	preq := &engine.Request{InputIDs: make([]int, 9)}
	if err := x.p.Prepare(context.Background(), preq, 13); err != nil {
		t.Fatal(err)
	}
	f := x.pre.startPrefill(t, preq.Prefill, 9)
	x.waitRegistered(t, 13)
	closed := make(chan error, 1)
	go func() { closed <- x.p.Close() }()
	time.Sleep(20 * time.Millisecond)
	f.done(preq.Prefill, -1, 0, engine.ErrClosed) // the engine closes too
	res := wait(t, ch, 3*time.Second)
	if res.err == nil {
		t.Fatal("decode succeeded although the prefill closed")
	}
	f.waitReleased(t, 2*time.Second)
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Prefill.Close did not return")
	}
	if x.dec.pages.Free() != testLayout.Pages {
		t.Fatalf("decode free pages %d, want %d", x.dec.pages.Free(), testLayout.Pages)
	}
}

// TestAuxSlot: the first token, its logprob and up to MaxTopLogprobs top
// logprobs fit one aux slot and come back as written; a peer with another
// slot layout is refused at bootstrap.
func TestAuxSlot(t *testing.T) {
	b := make([]byte, AuxSize)
	var top []sampling.TopLogprob
	for i := range sampling.MaxTopLogprobs + 3 {
		top = append(top, sampling.TopLogprob{Token: 1000 + i, Logprob: -float32(i) / 3})
	}
	for _, n := range []int{0, 1, sampling.MaxTopLogprobs, sampling.MaxTopLogprobs + 3} {
		clear(b)
		encodeAux(b, 1<<60+uint64(n), 42+n, -0.75, top[:n])
		room, tok, lp, got := decodeAux(b)
		want := top[:min(n, sampling.MaxTopLogprobs)]
		if room != 1<<60+uint64(n) || tok != 42+n || lp != -0.75 || len(got) != len(want) || (len(want) > 0 && !slices.Equal(got, want)) {
			t.Fatalf("%d tops: got room %d token %d logprob %v top %v", n, room, tok, lp, got)
		}
	}
	a := Info{Model: "m", AuxBytes: AuxSize}
	old := a
	old.AuxBytes = 16
	mustContain(t, a.Check(old), "aux slot layout mismatch", fmt.Sprint(AuxSize), "16")
}

// TestCancelBeforeRegistration: a cancel that overtakes its room's
// registration (the decode gave up while the registration was in flight)
// leaves a tomb, so the prefill refuses the room when it comes instead of
// keeping it until its own timeout.
func TestCancelBeforeRegistration(t *testing.T) {
	x := newPD(t, pdOpts{})
	const room = 0xca9ce1
	boot := "http://127.0.0.1:" + strconv.Itoa(x.p.Port())
	x.d.cancelRemote(boot, room, zap.NewNop())
	if x.p.Rooms() != 0 {
		t.Fatalf("cancel of an unknown room opened %d rooms", x.p.Rooms())
	}
	res := wait(t, x.prepareDecode(context.Background(), &engine.Request{InputIDs: make([]int, 9)}, x.p.Port(), room), 2*time.Second)
	mustContain(t, res.err, "already failed", "canceled")
	preq := &engine.Request{InputIDs: make([]int, 9)}
	if err := x.p.Prepare(context.Background(), preq, room); err == nil {
		t.Fatal("prefill accepted a canceled room")
	}
	if x.dec.pages.Free() != testLayout.Pages || x.p.Rooms() != 0 {
		t.Fatalf("decode free pages %d (want %d), prefill rooms %d", x.dec.pages.Free(), testLayout.Pages, x.p.Rooms())
	}
}

// pageOf is the K or V block of page pg of layer l of a token-major pool.
func pageOf(p *kvcache.Pool, l int, k kvcache.Kind, pg int) []byte { return p.LayerPage(l, pg)[k] }
