package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute/cpu"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// cpuEngine runs an engine on the real CPU backend.
func cpuEngine(t testing.TB, m *model.Model, tok tokenizer.Tokenizer, pages, pageSize, chunk, threads int, mut ...func(*Config)) (*Engine, *kvcache.Pool) {
	t.Helper()
	l := cpu.LayoutFor(m.Config, pageSize, pages)
	pool, err := kvcache.NewPool(l, make([]byte, l.TotalBytes()))
	if err != nil {
		t.Fatal(err)
	}
	be, err := cpu.New(m, pool, threads)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	cfg := Config{Model: be, Pages: pool.Alloc, Tokenizer: tok, ChunkedPrefillSize: chunk}
	for _, f := range mut {
		f(&cfg)
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	te := &testEngine{Engine: e, pages: pool.Alloc}
	t.Cleanup(func() { e.Close() })
	te.run(t)
	return e, pool
}

// TestBatchingInvarianceCPU: with the real CPU backend and the built-in
// model, 16 different prompts decoded greedily alone and as 16 concurrent
// requests give identical tokens.
func TestBatchingInvarianceCPU(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	tok := tokenizer.NewByteLevel()
	e, pool := cpuEngine(t, model.Builtin(), tok, 256, 16, 24, 2)
	const maxNew = 24
	prompts := make([][]int, 16)
	for i := range prompts {
		p, err := tok.Encode(fmt.Sprintf("Story %d: %s", i, strings.Repeat("once upon a time ", i%5)), true)
		if err != nil {
			t.Fatal(err)
		}
		prompts[i] = p
	}
	p := SamplingParams{MaxNewTokens: maxNew, IgnoreEOS: true}
	alone := make([][]int, len(prompts))
	for i, pr := range prompts {
		ch, err := e.Submit(context.Background(), &Request{InputIDs: pr, Params: p})
		if err != nil {
			t.Fatal(err)
		}
		alone[i] = collect(t, ch).tokens
	}
	distinct := map[int]bool{}
	for _, a := range alone {
		for _, x := range a {
			distinct[x] = true
		}
	}
	if len(distinct) < 4 {
		t.Fatalf("the model produced only %d distinct tokens: the test would prove little", len(distinct))
	}
	chans := make([]<-chan Event, len(prompts))
	for i, pr := range prompts {
		ch, err := e.Submit(context.Background(), &Request{InputIDs: pr, Params: p})
		if err != nil {
			t.Fatal(err)
		}
		chans[i] = ch
	}
	for i, ch := range chans {
		if got := collect(t, ch).tokens; !slices.Equal(got, alone[i]) {
			t.Fatalf("prompt %d: batched %v, alone %v", i, got, alone[i])
		}
	}
	waitFor(t, "pages to return", func() bool { return pool.Alloc.Free() == 256 })
}

func loadStories(tb testing.TB) (*model.Model, tokenizer.Tokenizer, string) {
	tb.Helper()
	bin, tokPath := sharedtest.Stories260K(tb)
	shared := sharedtest.Dir(tb)
	m, err := model.LoadLlama2C(bin)
	if err != nil {
		tb.Fatal(err)
	}
	tok, err := tokenizer.LoadLlama2C(tokPath, m.Config.Vocab)
	if err != nil {
		tb.Fatal(err)
	}
	return m, tok, shared
}

// TestStories260KReference: the engine on the CPU backend reproduces
// llama2.c's greedy tokens and text for stories260K.
func TestStories260KReference(t *testing.T) {
	m, tok, shared := loadStories(t)
	refPath := filepath.Join(shared, "reference", "stories260K-greedy.json")
	b, err := os.ReadFile(refPath)
	if err != nil {
		t.Fatal(err)
	}
	var ref struct {
		Cases []struct {
			Prompt    string `json:"prompt"`
			PromptIDs []int  `json:"prompt_ids"`
			Next      []int  `json:"greedy_next_ids"`
			Text      string `json:"text"`
		} `json:"cases"`
	}
	if err := json.Unmarshal(b, &ref); err != nil {
		t.Fatal(err)
	}
	e, pool := cpuEngine(t, m, tok, 512, 16, 7, 2)
	chans := make([]<-chan Event, len(ref.Cases))
	for i, c := range ref.Cases { // all at once: batched, chunked
		ch, err := e.Submit(context.Background(), &Request{InputIDs: c.PromptIDs, Params: SamplingParams{MaxNewTokens: len(c.Next)}})
		if err != nil {
			t.Fatal(err)
		}
		chans[i] = ch
	}
	for i, ch := range chans {
		c := ref.Cases[i]
		r := collect(t, ch)
		if !slices.Equal(r.tokens, c.Next) {
			t.Errorf("case %d (%q): tokens\n%v\nwant\n%v", i, c.Prompt, r.tokens, c.Next)
			continue
		}
		if c.Prompt+r.text != c.Text {
			t.Errorf("case %d: text %q, want %q", i, c.Prompt+r.text, c.Text)
		}
	}
	waitFor(t, "pages to return", func() bool { return pool.Alloc.Free() == 512 })
}

// BenchmarkEngine measures generated tokens per second through the engine
// (Submit to the last event) on stories260K with one backend thread.
func BenchmarkEngine(b *testing.B) {
	m, tok, _ := loadStories(b)
	for _, streams := range []int{1, 32} {
		b.Run(fmt.Sprintf("model=stories260K/streams=%d", streams), func(b *testing.B) {
			e, _ := cpuEngine(b, m, tok, 1024, 16, 512, 1)
			prompt, _ := tok.Encode("Once upon a time", true)
			const maxNew = 200
			tokens := 0
			b.ReportAllocs()
			for b.Loop() {
				chans := submitN(b, e, streams, prompt, maxNew)
				for _, ch := range chans {
					tokens += len(collect(b, ch).tokens)
				}
			}
			b.ReportMetric(float64(tokens)/b.Elapsed().Seconds(), "tok/s")
		})
	}
}
