package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
)

// asyncFake is devFake with queued passes (compute.AsyncSampler), as late
// as a device can be: StartSample copies a pass's inputs and returns; the
// pass runs only when it is waited for (after every pass started before
// it), with the tokens its from rows name taken from the pass before. When
// it runs, every page it touches must still be allocated and every state it
// samples still open (devFake checks those), so a request released while a
// pass still reads it fails the test.
type asyncFake struct {
	*devFake
	pages *kvcache.Allocator

	qmu     sync.Mutex
	last    *fakePending
	unread  []*fakePending
	started int // StartSample calls
	chained int // passes started with tokens from the pass before
}

type fakePending struct {
	a      *asyncFake
	ctx    context.Context
	seqs   []compute.Seq
	samp   []compute.Sample
	from   []int
	prev   *fakePending
	res    []compute.Sampled
	ran    bool
	err    error
	waited bool
}

func (a *asyncFake) StartSample(ctx context.Context, seqs []compute.Seq, samp []compute.Sample, from []int) (compute.Pending, error) {
	a.qmu.Lock()
	defer a.qmu.Unlock()
	if len(a.unread) >= 2 {
		return nil, errors.New("fake: two passes pending")
	}
	p := &fakePending{a: a, ctx: ctx, seqs: slices.Clone(seqs), samp: slices.Clone(samp[:len(seqs)]), prev: a.last}
	for i := range p.seqs {
		p.seqs[i].Tokens = slices.Clone(p.seqs[i].Tokens)
		p.seqs[i].Pages = slices.Clone(p.seqs[i].Pages)
		p.samp[i].Accept = slices.Clone(p.samp[i].Accept)
	}
	for i, f := range from {
		if f < 0 {
			continue
		}
		if p.prev == nil || f >= len(p.prev.seqs) || !p.prev.seqs[f].Logits || len(p.seqs[i].Tokens) != 1 {
			return nil, fmt.Errorf("fake: seq %d takes its token from row %d of no pass", i, f)
		}
		if p.from == nil {
			p.from = slices.Repeat([]int{-1}, len(seqs))
		}
		p.from[i] = f
	}
	if p.from != nil {
		a.chained++
	}
	a.started++
	a.last = p
	a.unread = append(a.unread, p)
	return p, nil
}

// run runs p (the passes before it ran).
func (p *fakePending) run() {
	p.ran = true
	if p.from != nil && p.prev.err != nil {
		p.err = p.prev.err
		return
	}
	for i, f := range p.from {
		if f >= 0 {
			p.seqs[i].Tokens[0] = int32(p.prev.res[f].Token)
		}
	}
	for i, s := range p.seqs {
		if err := p.a.pages.Retain(s.Pages); err != nil {
			p.err = fmt.Errorf("fake: seq %d: a page of a queued pass was released: %w", i, err)
			return
		}
		p.a.pages.Release(s.Pages)
	}
	p.res = make([]compute.Sampled, len(p.seqs))
	p.err = p.a.devFake.ForwardSample(p.ctx, p.seqs, p.samp, p.res)
}

func (p *fakePending) Wait(res []compute.Sampled) error {
	a := p.a
	a.qmu.Lock()
	defer a.qmu.Unlock()
	if p.waited || len(a.unread) == 0 || a.unread[0] != p {
		return errors.New("fake: pass waited for twice or out of order")
	}
	p.waited = true
	a.unread = a.unread[1:]
	if !p.ran {
		p.run()
	}
	if p.err != nil {
		return p.err
	}
	copy(res, p.res)
	return nil
}

func (a *asyncFake) counts() (started, chained int) {
	a.qmu.Lock()
	defer a.qmu.Unlock()
	return a.started, a.chained
}

// withAsync makes the engine's model an asyncFake (returned through *dst).
func withAsync(dst **asyncFake, mut func(*Config)) func(*Config) {
	return func(c *Config) {
		a := &asyncFake{devFake: &devFake{fakeModel: c.Model.(*fakeModel)}, pages: c.Pages}
		c.Model = a
		*dst = a
		if mut != nil {
			mut(c)
		}
	}
}

// TestOverlapMatchesHost: with queued passes, every sampling mode (with
// logprobs and top logprobs, mixed batches, chunked prompts, requests
// ending by EOS and by length) gives the host path's tokens, text,
// logprobs and finish; decode passes were started before the pass before
// them was read (the counter moved); every state was closed and every page
// came back.
func TestOverlapMatchesHost(t *testing.T) {
	modes := samplingModes()
	for _, tc := range []struct {
		name string
		lp   bool
		top  int
	}{{"plain", false, 0}, {"logprobs", true, 3}} {
		t.Run(tc.name, func(t *testing.T) {
			small := func(c *Config) { c.ChunkedPrefillSize = 7; c.DefaultSeed = 99 }
			host := startEngine(t, 512, 4, func(c *Config) { small(c); c.HostSampling = true })
			var a *asyncFake
			dev := startEngine(t, 512, 4, withAsync(&a, small))
			want := runModes(t, host, modes, tc.lp, tc.top)
			got := runModes(t, dev, modes, tc.lp, tc.top)
			sameResults(t, "queued passes", got, want)
			started, chained := a.counts()
			if q := counter(t, dev.reg, "mooncake_engine_queued_passes_total", ""); chained == 0 || q != float64(chained) {
				t.Fatalf("%d passes started, %d with tokens from the pass before; the counter says %v", started, chained, q)
			}
			waitFor(t, "pages and states back", func() bool {
				open, _, _, _, _ := a.devFake.counts()
				return dev.pages.Free() == 512 && open == 0
			})
			if _, _, _, hostPasses, _ := a.devFake.counts(); hostPasses != 0 {
				t.Fatalf("%d passes sampled on the host", hostPasses)
			}
		})
	}
}

// TestOverlapStops: requests that end on EOS, a stop token or a stop
// string while the next decode pass is already queued end exactly as
// without queued passes (the same text and finish), and their pages and
// states wait for that pass before they are released.
func TestOverlapStops(t *testing.T) {
	const prompt = "Q:"
	n := len(ids(prompt))
	for _, tc := range []struct {
		name   string
		say    string
		params SamplingParams
	}{
		{"eos", "hello there", SamplingParams{MaxNewTokens: 50}},
		{"stop token id", "hello", SamplingParams{MaxNewTokens: 50, StopTokenIDs: []int{'l'}}},
		{"stop string", "Hello, world! STOP here", SamplingParams{MaxNewTokens: 50, Stop: []string{"STOP"}}},
		{"length", "abcdefgh", SamplingParams{MaxNewTokens: 5, IgnoreEOS: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plain := startEngine(t, 64, 4, withAsync(new(*asyncFake), func(c *Config) { c.DisableOverlap = true }))
			plain.fake.next = script(n, tc.say)
			var a *asyncFake
			te := startEngine(t, 64, 4, withAsync(&a, nil))
			te.fake.next = script(n, tc.say)
			// Several at once, each its text from a different place (longer
			// prompts start further in), so the batch keeps decoding after
			// one ends.
			var want, got []result
			for _, e := range []*testEngine{plain, te} {
				var chs []<-chan Event
				for i := range 3 {
					p := tc.params
					p.MaxNewTokens += i
					ch, err := e.Submit(context.Background(), &Request{InputIDs: ids(prompt + strings.Repeat(":", i)), Params: p})
					if err != nil {
						t.Fatal(err)
					}
					chs = append(chs, ch)
				}
				var rs []result
				for _, ch := range chs {
					rs = append(rs, collect(t, ch))
				}
				if e == plain {
					want = rs
				} else {
					got = rs
				}
			}
			for i := range want {
				if !slices.Equal(got[i].tokens, want[i].tokens) || got[i].text != want[i].text || *got[i].finish != *want[i].finish {
					t.Fatalf("request %d: %v %q %+v; without queued passes %v %q %+v", i, got[i].tokens, got[i].text,
						got[i].finish, want[i].tokens, want[i].text, want[i].finish)
				}
			}
			if _, chained := a.counts(); chained == 0 {
				t.Fatal("no pass was queued behind another")
			}
			waitFor(t, "pages and states back", func() bool {
				open, _, _, _, _ := a.devFake.counts()
				return te.pages.Free() == 64 && open == 0
			})
		})
	}
}

// TestOverlapAbortAndClose: a request cancelled while passes are queued,
// and every request at Close, end as "abort" with their states closed and
// pages back; the engine keeps serving after the cancel.
func TestOverlapAbortAndClose(t *testing.T) {
	var a *asyncFake
	te := newTestEngine(t, 128, 4, withAsync(&a, nil))
	gate := make(chan struct{}) // passes run only while fed: the long request cannot end first
	te.fake.gate = gate
	te.run(t)
	ctx, cancel := context.WithCancel(context.Background())
	long, err := te.Submit(ctx, &Request{InputIDs: ids("cancel me"), Params: SamplingParams{MaxNewTokens: 400, IgnoreEOS: true}})
	if err != nil {
		t.Fatal(err)
	}
	// Both queued before any pass runs, and at most 100 passes fed: the long
	// request cannot reach its 400 tokens however the goroutines are scheduled.
	shortCh, err := te.Submit(context.Background(), &Request{InputIDs: ids("beside it"), Params: SamplingParams{MaxNewTokens: 20, IgnoreEOS: true}})
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	go func() {
		for range 100 {
			select {
			case gate <- struct{}{}:
			case <-stop:
				return
			}
		}
	}()
	short := collect(t, shortCh)
	close(stop)
	if short.finish.Type != "length" || len(short.tokens) != 20 {
		t.Fatalf("short request: %d tokens, finish %+v", len(short.tokens), short.finish)
	}
	cancel()
	defer close(feedEvery(gate, time.Millisecond)) // free feeding let the request reach its length first under load
	if r := collect(t, long); r.finish.Type != "abort" || r.finish.OutputTokens == 0 {
		t.Fatalf("cancelled request: finish %+v", r.finish)
	}
	if r := te.generate(t, &Request{InputIDs: ids("after"), Params: SamplingParams{MaxNewTokens: 6}}); r.finish == nil || r.finish.Type == "abort" {
		t.Fatalf("after the cancel: %+v", r.finish)
	}
	open, _, _, _, _ := a.devFake.counts()
	if free := te.pages.Free(); free != 128 || open != 0 {
		t.Fatalf("after the cancel: %d of 128 pages free, %d states open", free, open)
	}

	// Close while passes are queued (the loop held in one by the gate).
	var a2 *asyncFake
	te2 := newTestEngine(t, 128, 4, withAsync(&a2, nil))
	gate2 := make(chan struct{})
	te2.fake.gate = gate2
	te2.run(t)
	var chs []<-chan Event
	for i := range 4 {
		ch, err := te2.Submit(context.Background(), &Request{InputIDs: ids(fmt.Sprint("closing ", i)),
			Params: SamplingParams{MaxNewTokens: 100, IgnoreEOS: true}})
		if err != nil {
			t.Fatal(err)
		}
		chs = append(chs, ch)
	}
	for range 30 {
		gate2 <- struct{}{}
	}
	te2.Close()
	for i, ch := range chs {
		if r := collect(t, ch); r.finish.Type != "abort" || len(r.tokens) == 0 {
			t.Fatalf("request %d at Close: %d tokens, %+v", i, len(r.tokens), r.finish)
		}
	}
	if _, c := a2.counts(); c == 0 {
		t.Fatal("no pass was queued behind another before Close")
	}
	open, made, _, _, _ := a2.devFake.counts()
	if free := te2.pages.Free(); free != 128 || open != 0 || made != 4 {
		t.Fatalf("after Close: %d of 128 pages free, %d of %d states open", free, open, made)
	}
}

// TestOverlapForwardError: a queued pass that fails ends its requests (and
// those of the pass queued behind it, whose tokens it was to give) with the
// error; the engine serves the next request.
func TestOverlapForwardError(t *testing.T) {
	var a *asyncFake
	te := newTestEngine(t, 64, 4, withAsync(&a, nil))
	gate := make(chan struct{})
	te.fake.gate = gate
	te.run(t)
	boom := errors.New("device fell off the bus")
	ch, err := te.Submit(context.Background(), &Request{InputIDs: ids("fail later"), Params: SamplingParams{MaxNewTokens: 200, IgnoreEOS: true}})
	if err != nil {
		t.Fatal(err)
	}
	for range 10 {
		gate <- struct{}{}
	}
	te.fake.mu.Lock()
	te.fake.err = boom
	te.fake.mu.Unlock()
	defer close(feed(gate))
	r := collect(t, ch)
	if r.finish.Type != "abort" || !errors.Is(r.finish.Err, boom) || !strings.Contains(r.finish.Err.Error(), "forward") {
		t.Fatalf("finish %+v", r.finish)
	}
	if _, c := a.counts(); c < 5 {
		t.Fatalf("%d passes queued behind another before the error", c)
	}
	waitFor(t, "pages and states back", func() bool {
		open, _, _, _, _ := a.devFake.counts()
		return te.pages.Free() == 64 && open == 0
	})
	if r := te.generate(t, &Request{InputIDs: ids("after"), Params: SamplingParams{MaxNewTokens: 3, IgnoreEOS: true}}); r.finish.Type != "length" {
		t.Fatalf("engine did not recover: %+v", r.finish)
	}
}
