package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// recHook records a prefill-only request's hook calls.
type recHook struct {
	mu      sync.Mutex
	calls   []string
	pages   []int32
	chunks  []int
	first   int
	top     []sampling.TopLogprob
	logprob float32
	err     error
	release func()
	done    chan struct{}
}

func newRecHook() *recHook { return &recHook{done: make(chan struct{})} }

func (h *recHook) Pages(p []int32) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, "pages")
	h.pages = p
}

func (h *recHook) Chunk(n int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, fmt.Sprint("chunk ", n))
	h.chunks = append(h.chunks, n)
}

func (h *recHook) Done(first int, lp float32, top []sampling.TopLogprob, err error, release func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, "done")
	h.first, h.logprob, h.top, h.err, h.release = first, lp, top, err, release
	close(h.done)
}

func (h *recHook) wait(t *testing.T) {
	t.Helper()
	select {
	case <-h.done:
	case <-time.After(10 * time.Second):
		t.Fatal("Done not called")
	}
}

func (h *recHook) called() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.calls)
}

func TestPrefillHook(t *testing.T) {
	te := startEngine(t, 64, 4, func(c *Config) { c.ChunkedPrefillSize = 5 })
	prompt := ids("hello world!") // 13 tokens: chunks of 5, 5, 3; 4 pages
	h := newRecHook()
	r := te.generate(t, &Request{InputIDs: prompt, Params: SamplingParams{MaxNewTokens: 20}, Logprobs: true, Prefill: h})
	h.wait(t)

	want := []string{"pages", "chunk 5", "chunk 10", "chunk 13", "done"}
	if got := h.called(); !slices.Equal(got, want) {
		t.Fatalf("hook calls %v, want %v", got, want)
	}
	first := expectGreedy(i32(prompt), nil, 1, false)[0]
	l := make([]float32, fakeVocab)
	fakeLogits(i32(prompt), nil, l)
	if h.first != first || h.err != nil || h.logprob != sampling.Logprob(l, first) {
		t.Fatalf("Done(%d, %v, %v), want (%d, %v, nil)", h.first, h.logprob, h.err, first, sampling.Logprob(l, first))
	}
	if len(h.pages) != 4 {
		t.Fatalf("Pages got %d pages, want 4", len(h.pages))
	}
	if !slices.Equal(r.tokens, []int{first}) || r.finish.Type != "stop" || r.finish.Matched != nil || r.finish.OutputTokens != 1 {
		t.Fatalf("events: tokens %v finish %+v", r.tokens, r.finish)
	}
	// The pages stay allocated until release, which is idempotent.
	time.Sleep(10 * time.Millisecond) // give a wrong implementation the chance to free them
	if got := te.pages.Free(); got != 60 {
		t.Fatalf("free pages %d before release, want 60", got)
	}
	h.release()
	h.release()
	if got := te.pages.Free(); got != 64 {
		t.Fatalf("free pages %d after release, want 64", got)
	}
	if got := counter(t, te.reg, "mooncake_engine_prefill_tokens_total", ""); got != 13 {
		t.Fatalf("prefill tokens %v", got)
	}
	if got := counter(t, te.reg, "mooncake_engine_decode_tokens_total", ""); got != 0 {
		t.Fatalf("decode tokens %v", got)
	}
}

func TestPrefillHookAbort(t *testing.T) {
	t.Run("running", func(t *testing.T) {
		te := startEngine(t, 64, 4, func(c *Config) { c.ChunkedPrefillSize = 2 })
		gate := make(chan struct{})
		te.fake.gate = gate
		h := newRecHook()
		ctx, cancel := context.WithCancel(context.Background())
		prompt := make([]int, 200) // 100 chunks of 2, 50 pages
		ch, err := te.Submit(ctx, &Request{InputIDs: prompt, Params: SamplingParams{MaxNewTokens: 1}, Prefill: h})
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, "Pages", func() bool { return len(h.called()) > 0 })
		cancel()
		stop := feed(gate)
		h.wait(t)
		close(stop)
		if !errors.Is(h.err, context.Canceled) || h.first != -1 {
			t.Fatalf("Done(%d, err %v)", h.first, h.err)
		}
		for range ch {
		}
		if got := te.pages.Free(); got != 14 {
			t.Fatalf("free pages %d before release, want 14", got)
		}
		h.release()
		if got := te.pages.Free(); got != 64 {
			t.Fatalf("free pages %d after release", got)
		}
	})
	t.Run("queued", func(t *testing.T) {
		te := newTestEngine(t, 64, 4, nil) // not running
		h := newRecHook()
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := te.Submit(ctx, &Request{InputIDs: ids("x"), Prefill: h})
		if err != nil {
			t.Fatal(err)
		}
		cancel()
		h.wait(t)
		if got := h.called(); !slices.Equal(got, []string{"done"}) || !errors.Is(h.err, context.Canceled) {
			t.Fatalf("calls %v err %v", got, h.err)
		}
		h.release()
		r := collect(t, ch)
		if r.finish.Type != "abort" || te.pages.Free() != 64 {
			t.Fatalf("finish %+v, free %d", r.finish, te.pages.Free())
		}
	})
}

// TestDisaggregatedMatchesColocated runs requests through a prefill engine
// and a decode engine (each with its own model and pool, the KV "transfer"
// done by copying the fake's cache), and checks that the output equals the
// colocated output, token for token, greedy and seeded, with and without a
// logit bias, and that the decode side never computes the prompt.
func TestDisaggregatedMatchesColocated(t *testing.T) {
	seed := int64(1234)
	prompt := ids("disaggregate me")
	// Ban the unbiased greedy answer's tokens and favour one token: prefill
	// and decode must both apply the bias for PD to equal colocated.
	bias := map[int]float64{'e': 3.5}
	for _, tok := range expectGreedy(i32(prompt), nil, 12, false) {
		bias[tok] = -100
	}
	for _, tc := range []struct {
		name   string
		params SamplingParams
	}{
		{"greedy", SamplingParams{MaxNewTokens: 12}},
		{"seeded", SamplingParams{MaxNewTokens: 12, Temperature: 1.3, TopP: 0.95, FrequencyPenalty: 0.5, Seed: &seed}},
		{"one token", SamplingParams{MaxNewTokens: 1}},
		{"logit_bias greedy", SamplingParams{MaxNewTokens: 12, LogitBias: bias}},
		{"logit_bias seeded", SamplingParams{MaxNewTokens: 12, Temperature: 0.9, TopK: 40, MinP: 0.02,
			RepetitionPenalty: 1.2, Seed: &seed, LogitBias: bias}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			colo := startEngine(t, 64, 4, func(c *Config) { c.ChunkedPrefillSize = 4 })
			pre := startEngine(t, 64, 4, func(c *Config) { c.ChunkedPrefillSize = 4 })
			dec := startEngine(t, 32, 4, nil)

			want := colo.generate(t, &Request{InputIDs: prompt, Params: tc.params, Logprobs: true, TopLogprobs: 3})
			if tc.params.LogitBias != nil {
				unbiased := tc.params
				unbiased.LogitBias = nil
				u := colo.generate(t, &Request{InputIDs: prompt, Params: unbiased})
				if slices.Equal(u.tokens, want.tokens) || slices.ContainsFunc(want.tokens, func(tok int) bool { return bias[tok] < 0 }) {
					t.Fatalf("the bias did not act: biased %v, unbiased %v", want.tokens, u.tokens)
				}
			}

			h := newRecHook()
			pr := pre.generate(t, &Request{InputIDs: prompt, Params: tc.params, Logprobs: true, TopLogprobs: 3, Prefill: h, Room: 77})
			h.wait(t)
			if h.err != nil || pr.tokens[0] != want.tokens[0] {
				t.Fatalf("prefill: first %d err %v, colocated first %d", h.first, h.err, want.tokens[0])
			}
			// "Transfer": decode reserves pages for the prompt, the KV moves, the
			// prefill side releases its pages.
			dreq := &Request{InputIDs: prompt, Params: tc.params, Logprobs: true, TopLogprobs: 3, Room: 77}
			need, err := dec.KVPages(dreq)
			if err != nil {
				t.Fatal(err)
			}
			dtable, err := dec.pages.Take(need) // every page it needs, as disagg reserves
			if err != nil {
				t.Fatal(err)
			}
			dec.fake.preload(dtable.IDs(), i32(prompt))
			h.release()

			dreq.Preloaded = &Preloaded{Table: dtable, FirstToken: h.first, FirstLogprob: h.logprob, FirstTop: h.top}
			got := dec.generate(t, dreq)
			if !slices.Equal(got.tokens, want.tokens) || got.text != want.text || !slices.Equal(got.logprobs, want.logprobs) {
				t.Fatalf("disaggregated %v %q %v\ncolocated %v %q %v", got.tokens, got.text, got.logprobs, want.tokens, want.text, want.logprobs)
			}
			for i := range want.tops {
				if !slices.Equal(got.tops[i], want.tops[i]) || len(want.tops[i]) != 3 {
					t.Fatalf("token %d: top logprobs %v, colocated %v", i, got.tops[i], want.tops[i])
				}
			}
			if *got.finish != *want.finish {
				t.Fatalf("finish %+v, colocated %+v", got.finish, want.finish)
			}
			fed, _, _ := dec.fake.stats()
			if fed != len(want.tokens)-1 {
				t.Fatalf("decode side fed %d tokens, want %d (no prompt)", fed, len(want.tokens)-1)
			}
			if v := counter(t, dec.reg, "mooncake_engine_prefill_tokens_total", ""); v != 0 {
				t.Fatalf("decode side prefill_tokens_total = %v", v)
			}
			waitFor(t, "pages to return", func() bool {
				return dec.pages.Free() == 32 && pre.pages.Free() == 64 && colo.pages.Free() == 64
			})
		})
	}
}

func TestPreloadedPagesReleased(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(te *testEngine, cancel context.CancelFunc)
		want string
	}{
		{"close while queued", func(te *testEngine, _ context.CancelFunc) { te.Close() }, "abort"},
		{"cancel while queued", func(_ *testEngine, cancel context.CancelFunc) { cancel() }, "abort"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			te := newTestEngine(t, 16, 4, nil) // not running
			p, err := te.pages.Take(3)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ch, err := te.Submit(ctx, &Request{InputIDs: ids("preloaded"), Params: SamplingParams{MaxNewTokens: 4},
				Preloaded: &Preloaded{Table: p, FirstToken: 'a'}})
			if err != nil {
				t.Fatal(err)
			}
			tc.end(te, cancel)
			if r := collect(t, ch); r.finish.Type != tc.want {
				t.Fatalf("finish %+v", r.finish)
			}
			if got := te.pages.Free(); got != 16 {
				t.Fatalf("free pages %d, want 16", got)
			}
		})
	}
	t.Run("first token ends it", func(t *testing.T) {
		te := startEngine(t, 16, 4, nil)
		p, _ := te.pages.Take(3)
		te.fake.preload(p.IDs(), i32(ids("preloaded")))
		r := te.generate(t, &Request{InputIDs: ids("preloaded"), Params: SamplingParams{MaxNewTokens: 4},
			Preloaded: &Preloaded{Table: p, FirstToken: fakeEOS}})
		if r.finish.Type != "stop" || r.finish.Matched != fakeEOS || !slices.Equal(r.tokens, []int{fakeEOS}) {
			t.Fatalf("tokens %v finish %+v", r.tokens, r.finish)
		}
		waitFor(t, "pages to return", func() bool { return te.pages.Free() == 16 })
		if fed, _, _ := te.fake.stats(); fed != 0 {
			t.Fatalf("model fed %d tokens", fed)
		}
	})
}

// abortingHook fails its room after the first chunk, as the disaggregation
// layer does when the decode side is gone.
type abortingHook struct {
	*recHook
}

func (h abortingHook) Aborted() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.chunks) > 0 {
		return errors.New("decode side gone")
	}
	return nil
}

// TestPrefillAborter: a hook that reports its room failed stops the prompt's
// compute at the next step; Done carries the reason and release frees the
// pages.
func TestPrefillAborter(t *testing.T) {
	te := startEngine(t, 64, 4, func(c *Config) { c.ChunkedPrefillSize = 2 })
	h := abortingHook{newRecHook()}
	prompt := make([]int, 40) // 20 chunks of 2
	r := te.generate(t, &Request{InputIDs: prompt, Params: SamplingParams{MaxNewTokens: 4}, Prefill: h})
	h.wait(t)
	if h.err == nil || h.first != -1 || r.finish.Type != "abort" {
		t.Fatalf("Done(%d, %v), finish %+v", h.first, h.err, r.finish)
	}
	if n := len(h.chunks); n > 2 {
		t.Fatalf("%d chunks ran after the room failed", n-1)
	}
	h.release()
	if got := te.pages.Free(); got != 64 {
		t.Fatalf("free pages %d after release, want 64", got)
	}
}
