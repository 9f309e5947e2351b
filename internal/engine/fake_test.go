package engine

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	fakeVocab = tokenizer.ByteLevelVocabSize
	fakeEOS   = tokenizer.ByteLevelEOS
	fakeBOS   = tokenizer.ByteLevelBOS
)

// fakeModel is a compute.Model whose logits are a deterministic function of
// the whole token history. It keeps its own "KV cache" (page, slot) -> token
// and reads the history back through each sequence's page table, so wrong
// page tables, positions or reused pages change its output, as they would a
// real model's. It never touches pool memory.
type fakeModel struct {
	compute.Model
	layout kvcache.Layout
	// next, when set, picks the favoured token from the history (it gets a
	// logit of 10, the EOS 0 unless favoured, the rest hash noise in [0, 4)).
	next func(hist []int32) int

	mu      sync.Mutex
	kv      map[int]int32
	fed     int // tokens processed
	calls   int
	maxSeqs int
	err     error         // returned by the next Forward
	gate    chan struct{} // when set, each Forward first receives from it
}

func newFake(pages, pageSize int) *fakeModel {
	return &fakeModel{
		layout: kvcache.Layout{Layers: 1, PageSize: pageSize, KVHeads: 1, HeadDim: 1, ElemBytes: 4, Pages: pages},
		kv:     map[int]int32{},
	}
}

func (f *fakeModel) Config() model.Config {
	return model.Config{Vocab: fakeVocab, MaxSeqLen: 4096, BOS: fakeBOS, EOS: []int{fakeEOS}}
}
func (f *fakeModel) Layout() kvcache.Layout { return f.layout }
func (f *fakeModel) Close() error           { return nil }

func (f *fakeModel) Forward(ctx context.Context, seqs []compute.Seq, out [][]float32) error {
	if f.gate != nil {
		select {
		case <-f.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	f.maxSeqs = max(f.maxSeqs, len(seqs))
	if err := f.err; err != nil {
		f.err = nil
		return err
	}
	ps := f.layout.PageSize
	for i, s := range seqs {
		end := s.Pos + len(s.Tokens)
		if len(s.Pages)*ps < end {
			return errors.New("fake: page table too short")
		}
		for j, tok := range s.Tokens {
			p := s.Pos + j
			f.kv[int(s.Pages[p/ps])*ps+p%ps] = tok
		}
		f.fed += len(s.Tokens)
		if !s.Logits {
			continue
		}
		if len(out[i]) != fakeVocab {
			return errors.New("fake: logits row has the wrong length")
		}
		hist := make([]int32, end)
		for p := range hist {
			tok, ok := f.kv[int(s.Pages[p/ps])*ps+p%ps]
			if !ok {
				return errors.New("fake: reading a position never written")
			}
			hist[p] = tok
		}
		fakeLogits(hist, f.next, out[i])
	}
	return nil
}

// preload writes tokens into pages as a KV transfer would.
func (f *fakeModel) preload(pages []int32, tokens []int32) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ps := f.layout.PageSize
	for p, tok := range tokens {
		f.kv[int(pages[p/ps])*ps+p%ps] = tok
	}
}

func (f *fakeModel) stats() (fed, calls, maxSeqs int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fed, f.calls, f.maxSeqs
}

func fakeLogits(hist []int32, next func([]int32) int, out []float32) {
	h := uint64(1469598103934665603)
	for _, t := range hist {
		h = (h ^ uint64(t)) * 1099511628211
	}
	for v := range out {
		out[v] = float32(splitmix64(h+uint64(v))>>40) / float32(1<<24) * 4
	}
	out[fakeEOS] = 0
	if next != nil {
		out[next(hist)] = 10
	}
}

// expectGreedy is what greedy decoding of prompt through fakeLogits gives.
func expectGreedy(prompt []int32, next func([]int32) int, n int, ignoreEOS bool) []int {
	hist := append([]int32(nil), prompt...)
	logits := make([]float32, fakeVocab)
	var out []int
	for range n {
		fakeLogits(hist, next, logits)
		best := 0
		for v, x := range logits {
			if x > logits[best] {
				best = v
			}
		}
		out = append(out, best)
		if best == fakeEOS && !ignoreEOS {
			break
		}
		hist = append(hist, int32(best))
	}
	return out
}

// script makes the model write text, one byte per token, then EOS.
func script(promptLen int, text string) func([]int32) int {
	return func(hist []int32) int {
		i := len(hist) - promptLen
		if i < len(text) {
			return int(text[i])
		}
		return fakeEOS
	}
}

type testEngine struct {
	*Engine
	fake  *fakeModel
	pages *kvcache.Allocator
	reg   *prometheus.Registry
}

// startEngine runs an engine over a fake model with pages pages of
// pageSize tokens; mut adjusts the config. The engine is closed at cleanup.
func startEngine(t *testing.T, pages, pageSize int, mut func(*Config)) *testEngine {
	t.Helper()
	te := newTestEngine(t, pages, pageSize, mut)
	te.run(t)
	return te
}

func newTestEngine(t *testing.T, pages, pageSize int, mut func(*Config)) *testEngine {
	t.Helper()
	f := newFake(pages, pageSize)
	a := kvcache.NewAllocator(pages)
	reg := prometheus.NewRegistry()
	cfg := Config{Model: f, Pages: a, Tokenizer: tokenizer.NewByteLevel(), Registerer: reg}
	if mut != nil {
		mut(&cfg)
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return &testEngine{Engine: e, fake: f, pages: a, reg: reg}
}

func (te *testEngine) run(t testing.TB) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- te.Run(ctx) }()
	t.Cleanup(func() {
		te.Close()
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, ErrClosed) {
			t.Errorf("Run: %v", err)
		}
	})
}

type result struct {
	tokens   []int
	logprobs []float32
	tops     [][]sampling.TopLogprob
	texts    []string
	text     string
	finish   *Finish
}

// collect reads ch until it is closed (failing after 20 s).
func collect(t testing.TB, ch <-chan Event) result {
	t.Helper()
	var r result
	timeout := time.After(20 * time.Second)
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				if r.finish == nil {
					t.Fatalf("channel closed without a Finish event")
				}
				return r
			}
			if r.finish != nil {
				t.Fatalf("event after Finish: %+v", ev)
			}
			if ev.Token >= 0 {
				r.tokens = append(r.tokens, ev.Token)
				r.logprobs = append(r.logprobs, ev.Logprob)
				r.tops = append(r.tops, ev.Top)
			}
			r.texts = append(r.texts, ev.Text)
			r.text += ev.Text
			r.finish = ev.Finish
		case <-timeout:
			t.Fatalf("no Finish after 20 s; so far %+v", r)
		}
	}
}

func (te *testEngine) generate(t *testing.T, req *Request) result {
	t.Helper()
	ch, err := te.Submit(context.Background(), req)
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	return collect(t, ch)
}

func ids(s string) []int {
	out := []int{fakeBOS}
	for _, b := range []byte(s) {
		out = append(out, int(b))
	}
	return out
}

func i32(x []int) []int32 {
	out := make([]int32, len(x))
	for i, v := range x {
		out[i] = int32(v)
	}
	return out
}

func eqInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// waitFor polls cond (state changed by other goroutines) for up to 10 s.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}
