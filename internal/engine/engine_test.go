package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

func TestConfigValidate(t *testing.T) {
	f := newFake(16, 4)
	good := Config{Model: f, Pages: kvcache.NewAllocator(16), Tokenizer: tokenizer.NewByteLevel()}
	for _, tc := range []struct {
		name string
		mut  func(*Config)
		want string // substring of the error; "" = valid
	}{
		{"good", func(*Config) {}, ""},
		{"no model", func(c *Config) { c.Model = nil }, "Model is required"},
		{"no pages", func(c *Config) { c.Pages = nil }, "Pages is required"},
		{"no tokenizer", func(c *Config) { c.Tokenizer = nil }, "Tokenizer is required"},
		{"negative running", func(c *Config) { c.MaxRunningRequests = -1 }, "MaxRunningRequests -1"},
		{"chunk -2", func(c *Config) { c.ChunkedPrefillSize = -2 }, "ChunkedPrefillSize -2"},
		{"chunk -1 is no limit", func(c *Config) { c.ChunkedPrefillSize = -1 }, ""},
		{"negative queue", func(c *Config) { c.MaxQueue = -1 }, "MaxQueue -1"},
		{"seq len beyond model", func(c *Config) { c.MaxSeqLen = 5000 }, "MaxSeqLen 5000 beyond the model's context length 4096"},
		{"pool mismatch", func(c *Config) { c.Pages = kvcache.NewAllocator(8) }, "the model's pool has 16 pages, the allocator 8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := good
			tc.mut(&c)
			err := c.Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestSubmitValidation(t *testing.T) {
	te := newTestEngine(t, 16, 4, func(c *Config) { c.MaxSeqLen = 100 }) // 64 tokens of pool
	long := make([]int, 100)
	for _, tc := range []struct {
		name     string
		req      Request
		prePages int // a preloaded request gets a table of this many pages
		is       error
		wants    []string
	}{
		{"empty prompt", Request{}, 0, ErrBadRequest, []string{"empty prompt"}},
		{"negative max_new_tokens", Request{InputIDs: ids("a"), Params: SamplingParams{MaxNewTokens: -1}}, 0, ErrBadRequest, []string{"-1"}},
		{"token outside vocabulary", Request{InputIDs: []int{1, 320}}, 0, ErrBadRequest, []string{"320", "position 1", "320)"}},
		{"negative token", Request{InputIDs: []int{-1}}, 0, ErrBadRequest, []string{"-1"}},
		{"bad temperature", Request{InputIDs: ids("a"), Params: SamplingParams{Temperature: -1}}, 0, ErrBadRequest, []string{"temperature"}},
		{"bad top_p", Request{InputIDs: ids("a"), Params: SamplingParams{TopP: 2}}, 0, ErrBadRequest, []string{"top_p"}},
		{"prompt at context length", Request{InputIDs: long}, 0, ErrPromptTooLong, []string{"100 tokens", "context length is 100"}},
		{"prompt + max_new beyond context", Request{InputIDs: long[:50], Params: SamplingParams{MaxNewTokens: 60}}, 0, ErrPromptTooLong, []string{"50", "60", "110", "100"}},
		{"beyond the pool", Request{InputIDs: long[:50], Params: SamplingParams{MaxNewTokens: 40}}, 0, ErrPromptTooLong, []string{"23 KV pages", "pool has 16"}},
		{"both hooks", Request{InputIDs: ids("a"), Prefill: newRecHook(), Preloaded: &Preloaded{}}, 1, ErrBadRequest, []string{"both"}},
		{"preloaded pages short", Request{InputIDs: long[:9], Params: SamplingParams{MaxNewTokens: 2}, Preloaded: &Preloaded{}}, 2, ErrBadRequest, []string{"2 pages", "9 tokens", "needs 3"}},
		{"preloaded first token", Request{InputIDs: ids("a"), Params: SamplingParams{MaxNewTokens: 2}, Preloaded: &Preloaded{FirstToken: 999}}, 1, ErrBadRequest, []string{"999"}},
		{"preloaded too long", Request{InputIDs: long, Preloaded: &Preloaded{}}, 3, ErrPromptTooLong, []string{"context length"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.req
			r.ID = "r1"
			if r.Preloaded != nil {
				pl := *r.Preloaded
				tb, err := te.pages.Take(tc.prePages)
				if err != nil {
					t.Fatal(err)
				}
				pl.Table, r.Preloaded = tb, &pl
			}
			_, err := te.Submit(context.Background(), &r)
			if !errors.Is(err, tc.is) {
				t.Fatalf("error %v, want %v", err, tc.is)
			}
			for _, w := range tc.wants {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not name %q", err, w)
				}
			}
		})
	}
	// Refused preloaded requests' tables were released by Submit.
	if s := te.Stats(); s.Queued != 0 || s.FreePages != 16 {
		t.Fatalf("rejected requests changed the state: %+v", s)
	}
}

func TestDefaultMaxNewTokensClamped(t *testing.T) {
	te := startEngine(t, 64, 4, func(c *Config) { c.MaxSeqLen = 40 })
	r := te.generate(t, &Request{InputIDs: ids("0123456789012345678901234567890")}) // 32 tokens
	if r.finish.Type != "length" || len(r.tokens) != 8 {
		t.Fatalf("want 8 tokens (context 40 - prompt 32) and length, got %d %+v", len(r.tokens), r.finish)
	}
}

func TestGreedyMatchesModel(t *testing.T) {
	for _, tc := range []struct {
		name     string
		pageSize int
		chunk    int
		prompt   string
		maxNew   int
	}{
		{"short", 4, 0, "Hi", 10},
		{"chunked", 4, 3, "Once upon a time", 20},
		{"page size 1", 1, 5, "abcdefghijklmnop", 7},
		{"one token", 16, 0, "x", 1},
		{"unlimited chunk", 8, -1, strings.Repeat("long prompt ", 20), 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			te := startEngine(t, 512, tc.pageSize, func(c *Config) { c.ChunkedPrefillSize = tc.chunk })
			prompt := ids(tc.prompt)
			r := te.generate(t, &Request{InputIDs: prompt, Params: SamplingParams{MaxNewTokens: tc.maxNew}, Logprobs: true})
			want := expectGreedy(i32(prompt), nil, tc.maxNew, false)
			if !eqInts(r.tokens, want) {
				t.Fatalf("tokens %v, want %v", r.tokens, want)
			}
			if r.finish.Type != "length" || r.finish.PromptTokens != len(prompt) || r.finish.OutputTokens != tc.maxNew {
				t.Fatalf("finish %+v", r.finish)
			}
			if got := tokenizer.NewByteLevel().Decode(r.tokens); r.text != got {
				t.Fatalf("text %q, want %q", r.text, got)
			}
			// logprob: log-softmax of the raw logits
			hist := i32(prompt)
			l := make([]float32, fakeVocab)
			for i, tok := range r.tokens {
				fakeLogits(hist, nil, l)
				if lp := sampling.Logprob(l, tok); r.logprobs[i] != lp {
					t.Fatalf("logprob %d = %v, want %v", i, r.logprobs[i], lp)
				}
				hist = append(hist, int32(tok))
			}
			waitFor(t, "pages to return", func() bool { return te.pages.Free() == 512 })
		})
	}
}

// TestBatchingInvariance: 16 different prompts, each alone and all at once,
// give the same greedy tokens, whatever the chunking, page size and limits.
func TestBatchingInvariance(t *testing.T) {
	prompts := make([][]int, 16)
	for i := range prompts {
		prompts[i] = ids(fmt.Sprintf("prompt %d: %s", i, strings.Repeat("xyz", i)))
	}
	for _, tc := range []struct {
		name                     string
		pages, pageSize, chunk   int
		maxRunning, maxNewTokens int
	}{
		{"roomy", 1024, 4, 512, 64, 24},
		{"small chunks", 1024, 4, 7, 64, 24},
		{"few running", 1024, 8, 16, 3, 24},
		{"tight pool", 40, 4, 32, 64, 24}, // requests wait for pages
	} {
		t.Run(tc.name, func(t *testing.T) {
			te := startEngine(t, tc.pages, tc.pageSize, func(c *Config) {
				c.ChunkedPrefillSize, c.MaxRunningRequests = tc.chunk, tc.maxRunning
			})
			p := SamplingParams{MaxNewTokens: tc.maxNewTokens}
			alone := make([][]int, len(prompts))
			for i, pr := range prompts {
				alone[i] = te.generate(t, &Request{InputIDs: pr, Params: p}).tokens
				if want := expectGreedy(i32(pr), nil, tc.maxNewTokens, false); !eqInts(alone[i], want) {
					t.Fatalf("prompt %d alone: %v, want %v", i, alone[i], want)
				}
			}
			gate := make(chan struct{}) // hold the first step until all are queued
			te.fake.gate = gate
			chans := make([]<-chan Event, len(prompts))
			for i, pr := range prompts {
				ch, err := te.Submit(context.Background(), &Request{InputIDs: pr, Params: p})
				if err != nil {
					t.Fatal(err)
				}
				chans[i] = ch
			}
			stop := feed(gate)
			defer close(stop)
			for i, ch := range chans {
				if got := collect(t, ch).tokens; !eqInts(got, alone[i]) {
					t.Fatalf("prompt %d in a batch: %v, alone %v", i, got, alone[i])
				}
			}
			_, _, maxSeqs := te.fake.stats()
			if tc.name == "roomy" && maxSeqs < 8 {
				t.Errorf("largest batch had %d sequences: no batching happened", maxSeqs)
			}
			if maxSeqs > tc.maxRunning {
				t.Errorf("batch of %d sequences beyond MaxRunningRequests %d", maxSeqs, tc.maxRunning)
			}
			waitFor(t, "pages to return", func() bool { return te.pages.Free() == tc.pages })
		})
	}
}

func TestStops(t *testing.T) {
	const prompt = "Q:"
	n := len(ids(prompt))
	for _, tc := range []struct {
		name      string
		say       string // what the model writes, byte by byte, then EOS
		params    SamplingParams
		text      string
		finish    string
		matched   any
		numTokens int
	}{
		{"eos", "hello", SamplingParams{MaxNewTokens: 50}, "hello", "stop", fakeEOS, 6},
		{"max_new_tokens", "hello", SamplingParams{MaxNewTokens: 3}, "hel", "length", nil, 3},
		{"ignore_eos", "hi", SamplingParams{MaxNewTokens: 5, IgnoreEOS: true}, "hi", "length", nil, 5},
		{"stop token id", "hello", SamplingParams{MaxNewTokens: 50, StopTokenIDs: []int{'l'}}, "he", "stop", int('l'), 3},
		{"stop string", "Hello, world! STOP here", SamplingParams{MaxNewTokens: 50, Stop: []string{"STOP"}}, "Hello, world! ", "stop", "STOP", 18},
		{"earliest of several", "abcXYZdef", SamplingParams{MaxNewTokens: 50, Stop: []string{"def", "Z", "cX"}}, "ab", "stop", "cX", 4},
		{"false start released", "aab", SamplingParams{MaxNewTokens: 50, Stop: []string{"ab!"}}, "aab", "stop", fakeEOS, 4},
		{"stop string at the length limit", "12345", SamplingParams{MaxNewTokens: 3, Stop: []string{"23"}}, "1", "stop", "23", 3},
		{"held text flushed at length", "abc", SamplingParams{MaxNewTokens: 3, Stop: []string{"cd"}}, "abc", "length", nil, 3},
		{"multibyte stop string", "dinner: 🍕 tonight", SamplingParams{MaxNewTokens: 50, Stop: []string{"🍕"}}, "dinner: ", "stop", "🍕", 12},
	} {
		t.Run(tc.name, func(t *testing.T) {
			te := startEngine(t, 64, 4, nil)
			te.fake.next = script(n, tc.say)
			r := te.generate(t, &Request{InputIDs: ids(prompt), Params: tc.params})
			if r.text != tc.text || r.finish.Type != tc.finish || r.finish.Matched != tc.matched || len(r.tokens) != tc.numTokens {
				t.Fatalf("got text %q finish %s matched %v (%d tokens); want %q %s %v (%d)",
					r.text, r.finish.Type, r.finish.Matched, len(r.tokens), tc.text, tc.finish, tc.matched, tc.numTokens)
			}
			for i, s := range r.texts {
				if !utf8.ValidString(s) {
					t.Fatalf("event %d text %q is not valid UTF-8", i, s)
				}
			}
			waitFor(t, "pages to return", func() bool { return te.pages.Free() == 64 })
		})
	}
}

func TestStreamingUTF8(t *testing.T) {
	const say = "héllo 世界 🙂 ok"
	te := startEngine(t, 64, 4, nil)
	te.fake.next = script(1, say)
	r := te.generate(t, &Request{InputIDs: []int{fakeBOS}, Params: SamplingParams{MaxNewTokens: 100}})
	if r.text != say {
		t.Fatalf("text %q, want %q", r.text, say)
	}
	held := 0
	for i, s := range r.texts {
		if !utf8.ValidString(s) {
			t.Fatalf("event %d carries broken UTF-8 %q", i, s)
		}
		if s == "" {
			held++
		}
	}
	if held < 6 { // the continuation bytes of é, 世, 界, 🙂 plus EOS
		t.Fatalf("only %d events held text back", held)
	}
}

func TestSeededSampling(t *testing.T) {
	te := startEngine(t, 256, 4, func(c *Config) { c.DefaultSeed = 7 })
	seed := func(v int64) *int64 { return &v }
	run := func(p SamplingParams) []int {
		p.MaxNewTokens = 20
		return te.generate(t, &Request{InputIDs: ids("seed test"), Params: p}).tokens
	}
	hot := SamplingParams{Temperature: 1.5, Seed: seed(42)}
	a, b := run(hot), run(hot)
	if !eqInts(a, b) {
		t.Fatalf("same seed, different tokens:\n%v\n%v", a, b)
	}
	hot.Seed = seed(43)
	if c := run(hot); eqInts(a, c) {
		t.Fatalf("seeds 42 and 43 gave the same tokens %v", a)
	}
	// top_k = 1 is greedy whatever the temperature and seed
	greedy := run(SamplingParams{})
	if k1 := run(SamplingParams{Temperature: 2, TopK: 1, Seed: seed(1)}); !eqInts(k1, greedy) {
		t.Fatalf("top_k=1 %v != greedy %v", k1, greedy)
	}
	// unseeded requests draw different streams
	if x, y := run(SamplingParams{Temperature: 1.5}), run(SamplingParams{Temperature: 1.5}); eqInts(x, y) {
		t.Fatalf("two unseeded requests gave the same tokens")
	}
}

func TestPenaltiesInEngine(t *testing.T) {
	te := startEngine(t, 64, 4, nil)
	te.fake.next = func([]int32) int { return 'a' } // the model always wants 'a'
	plain := te.generate(t, &Request{InputIDs: ids("x"), Params: SamplingParams{MaxNewTokens: 10}})
	if plain.text != "aaaaaaaaaa" {
		t.Fatalf("without penalties: %q", plain.text)
	}
	pen := te.generate(t, &Request{InputIDs: ids("x"), Params: SamplingParams{MaxNewTokens: 10, FrequencyPenalty: 2}})
	if strings.Count(pen.text, "a") > 4 {
		t.Fatalf("frequency penalty 2 still gives %q", pen.text)
	}
}

func TestAbort(t *testing.T) {
	t.Run("running", func(t *testing.T) {
		te := startEngine(t, 64, 4, nil)
		gate := make(chan struct{})
		te.fake.gate = gate
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := te.Submit(ctx, &Request{InputIDs: ids("abort me"), Params: SamplingParams{MaxNewTokens: 100, IgnoreEOS: true}})
		if err != nil {
			t.Fatal(err)
		}
		gate <- struct{}{} // prefill
		gate <- struct{}{} // one decode step
		<-ch
		<-ch
		cancel()
		stop := feed(gate)
		r := collect(t, ch)
		close(stop)
		if r.finish.Type != "abort" || !errors.Is(r.finish.Err, context.Canceled) || len(r.tokens) >= 98 {
			t.Fatalf("after cancel: %d more tokens, finish %+v", len(r.tokens), r.finish)
		}
		waitFor(t, "pages to return", func() bool { return te.pages.Free() == 64 })
		waitFor(t, "running to drop", func() bool { return te.Stats().Running == 0 })
		if got := counter(t, te.reg, "mooncake_engine_requests_total", "abort"); got != 1 {
			t.Fatalf("requests_total{finish=abort} = %v", got)
		}
	})
	t.Run("queued", func(t *testing.T) {
		te := startEngine(t, 64, 4, func(c *Config) { c.MaxRunningRequests = 1 })
		gate := make(chan struct{})
		te.fake.gate = gate
		first, err := te.Submit(context.Background(), &Request{InputIDs: ids("a"), Params: SamplingParams{MaxNewTokens: 3}})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		second, err := te.Submit(ctx, &Request{InputIDs: ids("b"), Params: SamplingParams{MaxNewTokens: 3}})
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, "first to run", func() bool { s := te.Stats(); return s.Running == 1 && s.Queued == 1 })
		cancel()
		r := collect(t, second)
		if r.finish.Type != "abort" || len(r.tokens) != 0 || !errors.Is(r.finish.Err, context.Canceled) {
			t.Fatalf("queued abort: %+v", r.finish)
		}
		close(gate)
		if r := collect(t, first); r.finish.Type != "length" {
			t.Fatalf("first: %+v", r.finish)
		}
		waitFor(t, "pages to return", func() bool { return te.pages.Free() == 64 })
	})
	t.Run("cancelled before submit", func(t *testing.T) {
		te := startEngine(t, 64, 4, nil)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := te.Submit(ctx, &Request{InputIDs: ids("a")}); !errors.Is(err, context.Canceled) {
			t.Fatalf("Submit with a done context: %v", err)
		}
	})
}

func TestBackPressureAndClose(t *testing.T) {
	te := newTestEngine(t, 64, 4, func(c *Config) { c.MaxQueue = 2 }) // not running: requests stay queued
	var chans []<-chan Event
	for i := range 2 {
		ch, err := te.Submit(context.Background(), &Request{InputIDs: ids(fmt.Sprint(i))})
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, ch)
	}
	_, err := te.Submit(context.Background(), &Request{InputIDs: ids("2")})
	if !errors.Is(err, ErrOverloaded) || !strings.Contains(err.Error(), "2 requests queued") {
		t.Fatalf("third Submit: %v", err)
	}
	if s := te.Stats(); s.Queued != 2 || s.Running != 0 {
		t.Fatalf("stats %+v", s)
	}
	if got := gauge(t, te.reg, "mooncake_engine_queue_length"); got != 2 {
		t.Fatalf("queue length gauge %v", got)
	}
	te.Close()
	for _, ch := range chans {
		r := collect(t, ch)
		if r.finish.Type != "abort" || !errors.Is(r.finish.Err, ErrClosed) {
			t.Fatalf("after Close: %+v", r.finish)
		}
	}
	if _, err := te.Submit(context.Background(), &Request{InputIDs: ids("late")}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Submit after Close: %v", err)
	}
	if err := te.Run(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Run after Close: %v", err)
	}
}

func TestCloseAbortsRunning(t *testing.T) {
	te := newTestEngine(t, 1024, 4, nil)
	gate := make(chan struct{})
	te.fake.gate = gate
	var chans []<-chan Event
	for i := range 4 {
		ch, err := te.Submit(context.Background(), &Request{InputIDs: ids(fmt.Sprint("r", i)), Params: SamplingParams{MaxNewTokens: 500}})
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, ch)
	}
	te.run(t)
	gate <- struct{}{} // one step: all four prefill and sample a token
	for _, ch := range chans {
		<-ch
	}
	// The loop now waits in a forward pass; Close cancels it.
	if err := te.Close(); err != nil {
		t.Fatal(err)
	}
	for _, ch := range chans {
		if r := collect(t, ch); r.finish.Type != "abort" || !errors.Is(r.finish.Err, ErrClosed) || r.finish.OutputTokens != 1 {
			t.Fatalf("finish %+v", r.finish)
		}
	}
	if te.pages.Free() != 1024 {
		t.Fatalf("free pages %d after Close, want 1024", te.pages.Free())
	}
}

func TestForwardError(t *testing.T) {
	te := newTestEngine(t, 64, 4, nil) // started once all three are queued: one batch
	boom := errors.New("device fell off the bus")
	te.fake.err = boom
	var chans []<-chan Event
	for i := range 3 {
		ch, err := te.Submit(context.Background(), &Request{InputIDs: ids(fmt.Sprint(i)), Params: SamplingParams{MaxNewTokens: 4}})
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, ch)
	}
	te.run(t)
	for _, ch := range chans {
		r := collect(t, ch)
		if r.finish.Type != "abort" || !errors.Is(r.finish.Err, boom) || !strings.Contains(r.finish.Err.Error(), "forward") {
			t.Fatalf("finish %+v", r.finish)
		}
	}
	waitFor(t, "pages to return", func() bool { return te.pages.Free() == 64 })
	if r := te.generate(t, &Request{InputIDs: ids("after"), Params: SamplingParams{MaxNewTokens: 2}}); r.finish.Type != "length" {
		t.Fatalf("engine did not recover: %+v", r.finish)
	}
}

func TestWaitForPages(t *testing.T) {
	// 8 pages of 4 tokens; each request needs 5 pages (prompt 10 + 9 positions).
	te := startEngine(t, 8, 4, nil)
	p := SamplingParams{MaxNewTokens: 10}
	a, err := te.Submit(context.Background(), &Request{InputIDs: ids("012345678"), Params: p})
	if err != nil {
		t.Fatal(err)
	}
	b, err := te.Submit(context.Background(), &Request{InputIDs: ids("876543210"), Params: p})
	if err != nil {
		t.Fatal(err)
	}
	ra, rb := collect(t, a), collect(t, b)
	if ra.finish.Type != "length" || rb.finish.Type != "length" {
		t.Fatalf("finishes %+v %+v", ra.finish, rb.finish)
	}
	if _, _, maxSeqs := te.fake.stats(); maxSeqs != 1 {
		t.Fatalf("both requests ran together (%d) in a pool that holds one", maxSeqs)
	}
	waitFor(t, "pages to return", func() bool { return te.pages.Free() == 8 })
}

func TestFIFOAdmissionAndLogs(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	te := newTestEngine(t, 256, 4, func(c *Config) { c.MaxRunningRequests = 2; c.Logger = zap.New(core) })
	var chans []<-chan Event
	for i := range 6 {
		ch, err := te.Submit(context.Background(), &Request{ID: fmt.Sprint("r", i), Room: uint64(100 + i),
			InputIDs: ids(fmt.Sprint(i)), Params: SamplingParams{MaxNewTokens: 2 + i%3}})
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, ch)
	}
	te.run(t)
	for _, ch := range chans {
		collect(t, ch)
	}
	var admitted []string
	for _, e := range logs.FilterMessage("request admitted").All() {
		admitted = append(admitted, e.ContextMap()["rid"].(string))
	}
	if want := []string{"r0", "r1", "r2", "r3", "r4", "r5"}; !slices.Equal(admitted, want) {
		t.Fatalf("admission order %v, want %v", admitted, want)
	}
	fin := logs.FilterMessage("request finished").FilterField(zap.String("rid", "r4")).All()
	if len(fin) != 1 {
		t.Fatalf("%d finish lines for r4", len(fin))
	}
	if m := fin[0].ContextMap(); m["room"] != uint64(104) || m["finish"] != "length" {
		t.Fatalf("finish line fields %v", m)
	}
}

func TestMetrics(t *testing.T) {
	te := startEngine(t, 64, 4, nil)
	prompt := ids("metrics")
	te.generate(t, &Request{InputIDs: prompt, Params: SamplingParams{MaxNewTokens: 5}})
	waitFor(t, "pages to return", func() bool { return te.pages.Free() == 64 })
	mfs, err := te.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, mf := range mfs {
		got[mf.GetName()] = true
	}
	for _, name := range []string{
		"mooncake_engine_prefill_tokens_total", "mooncake_engine_decode_tokens_total",
		"mooncake_request_ttft_seconds", "mooncake_request_itl_seconds",
		"mooncake_kvcache_pages_total", "mooncake_kvcache_pages_free",
		"mooncake_engine_queue_length", "mooncake_engine_running_requests",
		"mooncake_engine_queue_seconds", "mooncake_engine_requests_total",
	} {
		if !got[name] {
			t.Errorf("metric %s not exported", name)
		}
	}
	for _, c := range []struct {
		name string
		got  float64
		want float64
	}{
		{"prefill tokens", counter(t, te.reg, "mooncake_engine_prefill_tokens_total", ""), float64(len(prompt))},
		{"decode tokens", counter(t, te.reg, "mooncake_engine_decode_tokens_total", ""), 4},
		{"length finishes", counter(t, te.reg, "mooncake_engine_requests_total", "length"), 1},
		{"ttft count", float64(histCount(t, te.reg, "mooncake_request_ttft_seconds")), 1},
		{"itl count", float64(histCount(t, te.reg, "mooncake_request_itl_seconds")), 4},
		{"pages total", gauge(t, te.reg, "mooncake_kvcache_pages_total"), 64},
		{"pages free", gauge(t, te.reg, "mooncake_kvcache_pages_free"), 64},
	} {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
	// A second engine on the same registry is refused.
	_, err = New(Config{Model: te.fake, Pages: te.pages, Tokenizer: tokenizer.NewByteLevel(), Registerer: te.reg})
	if err == nil || !strings.Contains(err.Error(), "already registered") {
		t.Fatalf("second engine on one registry: %v", err)
	}
}

func histCount(t *testing.T, reg *prometheus.Registry, name string) uint64 {
	t.Helper()
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// counter is the value of a counter, of its series whose one label has the
// value label ("" for an unlabelled counter).
func counter(t *testing.T, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if lp := m.GetLabel(); (label == "" && len(lp) == 0) || (len(lp) == 1 && lp[0].GetValue() == label) {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no metric %s{%s}", name, label)
	return 0
}

// feed lets gated forward passes run until stop is closed.
func feed(gate chan struct{}) (stop chan struct{}) {
	stop = make(chan struct{})
	go func() {
		for {
			select {
			case gate <- struct{}{}:
			case <-stop:
				return
			}
		}
	}()
	return stop
}

// feedEvery is feed with a pause after each pass: after a cancel, the
// context.AfterFunc goroutine that aborts the request gets every chance to
// run before a fast fake could finish the request by length.
func feedEvery(gate chan struct{}, d time.Duration) (stop chan struct{}) {
	stop = make(chan struct{})
	go func() {
		for {
			select {
			case gate <- struct{}{}:
				time.Sleep(d)
			case <-stop:
				return
			}
		}
	}()
	return stop
}

func TestRunContextCancel(t *testing.T) {
	te := newTestEngine(t, 64, 4, nil)
	gate := make(chan struct{})
	te.fake.gate = gate
	ch, err := te.Submit(context.Background(), &Request{InputIDs: ids("x"), Params: SamplingParams{MaxNewTokens: 50}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- te.Run(ctx) }()
	gate <- struct{}{}
	<-ch
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v", err)
	}
	r := collect(t, ch)
	if r.finish.Type != "abort" || !errors.Is(r.finish.Err, ErrClosed) || !errors.Is(r.finish.Err, context.Canceled) {
		t.Fatalf("finish %+v", r.finish)
	}
	if te.pages.Free() != 64 {
		t.Fatalf("free pages %d", te.pages.Free())
	}
	if _, err := te.Submit(context.Background(), &Request{InputIDs: ids("y")}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Submit after Run returned: %v", err)
	}
}

func TestForwardPanic(t *testing.T) {
	te := startEngine(t, 64, 4, nil)
	te.fake.next = func([]int32) int { panic("kaboom") }
	r := te.generate(t, &Request{InputIDs: ids("x"), Params: SamplingParams{MaxNewTokens: 3}})
	if r.finish.Type != "abort" || r.finish.Err == nil || !strings.Contains(r.finish.Err.Error(), "kaboom") {
		t.Fatalf("finish %+v", r.finish)
	}
	te.fake.next = nil
	if r := te.generate(t, &Request{InputIDs: ids("x"), Params: SamplingParams{MaxNewTokens: 3}}); r.finish.Type != "length" {
		t.Fatalf("after a panic: %+v", r.finish)
	}
	waitFor(t, "pages to return", func() bool { return te.pages.Free() == 64 })
}

// TestRepetitionPenaltyCoversPrompt: the repetition penalty reaches the
// prompt's tokens from the first sampled token on (the engine hands the
// prompt to the sampler), so a prompt token that would win greedily loses.
func TestRepetitionPenaltyCoversPrompt(t *testing.T) {
	// A prompt whose own next-token argmax is one of its tokens.
	var prompt []int32
	logits := make([]float32, fakeVocab)
search:
	for a := 0; a < 256; a++ {
		for b := 0; b < 256; b++ {
			p := []int32{fakeBOS, int32(a), int32(b)}
			fakeLogits(p, nil, logits)
			if top := sampling.Argmax(logits); top == a || top == b {
				prompt = p
				break search
			}
		}
	}
	if prompt == nil {
		t.Fatal("no prompt whose argmax is one of its tokens")
	}
	fakeLogits(prompt, nil, logits)
	plain := sampling.Argmax(logits)
	ref := sampling.New(sampling.Params{RepetitionPenalty: 2}, 0)
	ref.SetPrompt(prompt)
	want := ref.Sample(0, logits)
	if want == plain {
		t.Fatalf("the reference sampler did not move off the prompt token %d", plain)
	}
	te := startEngine(t, 64, 4, nil)
	in := make([]int, len(prompt))
	for i, v := range prompt {
		in[i] = int(v)
	}
	for _, c := range []struct {
		penalty float64
		want    int
	}{{0, plain}, {2, want}} {
		r := te.generate(t, &Request{InputIDs: in, Params: SamplingParams{MaxNewTokens: 1, IgnoreEOS: true, RepetitionPenalty: c.penalty}})
		if len(r.tokens) != 1 || r.tokens[0] != c.want {
			t.Fatalf("repetition_penalty %v: first token %v, want %d", c.penalty, r.tokens, c.want)
		}
	}
}

// TestTopLogprobs: with TopLogprobs each output token carries the most
// likely tokens of its position (greedy: the chosen one first, with the
// same logprob), for computed and for preloaded first tokens; out-of-range
// counts are refused.
func TestTopLogprobs(t *testing.T) {
	te := startEngine(t, 64, 4, nil)
	prompt := ids("top logprobs")
	r := te.generate(t, &Request{InputIDs: prompt, Logprobs: true, TopLogprobs: 5,
		Params: SamplingParams{MaxNewTokens: 6, IgnoreEOS: true}})
	hist := i32(prompt)
	logits := make([]float32, fakeVocab)
	for i, tok := range r.tokens {
		fakeLogits(hist, nil, logits)
		want := sampling.TopLogprobs(logits, 5)
		if !slices.Equal(r.tops[i], want) {
			t.Fatalf("token %d: top %v, want %v", i, r.tops[i], want)
		}
		if r.tops[i][0].Token != tok || r.tops[i][0].Logprob != r.logprobs[i] {
			t.Fatalf("token %d (%d, logprob %v): greedy choice is not the top entry %+v", i, tok, r.logprobs[i], r.tops[i][0])
		}
		hist = append(hist, int32(tok))
	}
	// Not asked: no list.
	r = te.generate(t, &Request{InputIDs: prompt, Params: SamplingParams{MaxNewTokens: 2}})
	if r.tops[0] != nil {
		t.Fatalf("top logprobs not asked for: %v", r.tops[0])
	}
	// A preloaded first token keeps the prefill's list.
	tb, err := te.pages.Take(te.pagesFor(len(prompt)))
	if err != nil {
		t.Fatal(err)
	}
	te.fake.preload(tb.IDs(), i32(prompt))
	first := []sampling.TopLogprob{{Token: 'x', Logprob: -0.1}, {Token: 'y', Logprob: -2.5}}
	r = te.generate(t, &Request{InputIDs: prompt, TopLogprobs: 2, Params: SamplingParams{MaxNewTokens: 2, IgnoreEOS: true},
		Preloaded: &Preloaded{Table: tb, FirstToken: 'x', FirstTop: first}})
	if !slices.Equal(r.tops[0], first) || len(r.tops[1]) != 2 {
		t.Fatalf("preloaded tops %v", r.tops)
	}
	for _, n := range []int{-1, sampling.MaxTopLogprobs + 1} {
		if _, err := te.Submit(context.Background(), &Request{InputIDs: prompt, TopLogprobs: n}); !errors.Is(err, ErrBadRequest) {
			t.Fatalf("TopLogprobs %d: %v", n, err)
		}
	}
}
