package server_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/internal/compute/cpu"
	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// newEngine runs the real engine on the built-in random-weight model and the
// CPU backend, with a small KV pool; it stops when the test ends.
func newEngine(t *testing.T, maxSeqLen int) *engine.Engine {
	t.Helper()
	return newEngineFor(t, model.Builtin(), tokenizer.NewByteLevel(), maxSeqLen)
}

func newEngineFor(t *testing.T, m *model.Model, tok tokenizer.Tokenizer, maxSeqLen int) *engine.Engine {
	t.Helper()
	return newEngineWith(t, m, tok, maxSeqLen, false, nil)
}

// newEngineWith is newEngineFor with a prefix cache (cached) and the engine's metrics
// on reg (nil: none).
func newEngineWith(t *testing.T, m *model.Model, tok tokenizer.Tokenizer, maxSeqLen int, cached bool, reg prometheus.Registerer) *engine.Engine {
	t.Helper()
	l := cpu.LayoutFor(m.Config, 16, 64)
	pool, err := kvcache.NewPool(l, make([]byte, l.TotalBytes()))
	if err != nil {
		t.Fatal(err)
	}
	b, err := cpu.New(m, pool, 1)
	if err != nil {
		t.Fatal(err)
	}
	var cache *kvcache.Radix
	if cached {
		cache = kvcache.NewRadix(pool.Alloc, l.PageSize)
	}
	e, err := engine.New(engine.Config{Model: b, Pages: pool.Alloc, Cache: cache, Tokenizer: tok, MaxSeqLen: maxSeqLen, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := e.Run(ctx); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, engine.ErrClosed) {
			t.Errorf("engine Run: %v", err)
		}
	}()
	t.Cleanup(func() {
		cancel()
		_ = e.Close()
		wg.Wait()
		b.Close()
	})
	return e
}

func TestRealEngine(t *testing.T) {
	e := newEngine(t, 256)
	ts, _ := newServer(t, server.Config{Generator: e, Tokenizer: e.Tokenizer(), RandomWeights: true, ContextLen: 256})

	// Greedy: the whole answer, the stream and the OpenAI answer agree.
	body := `{"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}}`
	status, b := post(t, ts.URL+"/generate", body)
	if status != 200 {
		t.Fatalf("status %d: %s", status, b)
	}
	var whole generateJSON
	_ = json.Unmarshal(b, &whole)
	if len(whole.OutputIDs) != 12 || whole.MetaInfo.CompletionTokens != 12 || whole.MetaInfo.PromptTokens != 17 {
		t.Fatalf("got %s", b)
	}
	events := postStream(t, ts.URL+"/generate", strings.Replace(body, `"text"`, `"stream": true, "text"`, 1))
	var last generateJSON
	if err := json.Unmarshal([]byte(events[len(events)-2]), &last); err != nil || events[len(events)-1] != "[DONE]" {
		t.Fatalf("events %q", events)
	}
	if last.Text != whole.Text || len(last.OutputIDs) != 12 {
		t.Fatalf("stream %q %v, whole %q %v", last.Text, last.OutputIDs, whole.Text, whole.OutputIDs)
	}
	status, b = post(t, ts.URL+"/v1/completions", `{"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": true}`)
	var c completionJSON
	_ = json.Unmarshal(b, &c)
	if status != 200 || c.Choices[0].Text != whole.Text {
		t.Fatalf("completion %d %s, want text %q", status, b, whole.Text)
	}

	// Chat through the tokenizer's template.
	status, b = post(t, ts.URL+"/v1/chat/completions", `{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}`)
	if status != 200 || !strings.Contains(string(b), `"role":"assistant"`) {
		t.Fatalf("chat %d %s", status, b)
	}

	// Bad input, prompts past the context, health, and the server keeps serving.
	status, b = post(t, ts.URL+"/generate", `{"text": "`+strings.Repeat("x", 300)+`"}`)
	checkError(t, status, b, 400, "context length")
	status, b = post(t, ts.URL+"/generate", `{"input_ids": [99999]}`)
	checkError(t, status, b, 400, "vocabulary")
	if status, b := get(t, ts.URL+"/health_generate"); status != 200 {
		t.Fatalf("health_generate %d %s", status, b)
	}
	if status, b := post(t, ts.URL+"/generate", `{"text": "x", "sampling_params": {"max_new_tokens": 1}}`); status != 200 {
		t.Fatalf("status %d: %s", status, b)
	}
}

func TestRealEngineClosed(t *testing.T) {
	e := newEngine(t, 0)
	ts, _ := newServer(t, server.Config{Generator: e, Tokenizer: e.Tokenizer()})
	_ = e.Close()
	status, b := post(t, ts.URL+"/generate", `{"text": "x"}`)
	checkError(t, status, b, http.StatusServiceUnavailable, "closed")
	if status, _ := get(t, ts.URL+"/health_generate"); status != http.StatusServiceUnavailable {
		t.Fatalf("health_generate on a closed engine: %d", status)
	}
}

// TestStories260KGreedyHTTP checks llama2.c's greedy outputs through /generate,
// all cases at once (so batched).
func TestStories260KGreedyHTTP(t *testing.T) {
	bin, tokPath := sharedtest.Stories260K(t)
	cases := sharedtest.Reference(t)
	m, err := model.Load(bin)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(bin, tokPath)
	if err != nil {
		t.Fatal(err)
	}
	e := newEngineFor(t, m, tok, 0)
	ts, _ := newServer(t, server.Config{Generator: e, Tokenizer: e.Tokenizer(), ContextLen: m.Config.MaxSeqLen})
	var wg sync.WaitGroup
	for _, c := range cases {
		wg.Go(func() {
			body, _ := json.Marshal(map[string]any{"text": c.Prompt,
				"sampling_params": map[string]any{"max_new_tokens": len(c.GreedyNextIDs), "temperature": 0}})
			status, b := post(t, ts.URL+"/generate", string(body))
			var g generateJSON
			if err := json.Unmarshal(b, &g); err != nil || status != 200 {
				t.Errorf("%q: status %d: %s", c.Prompt, status, b)
				return
			}
			if fmt.Sprint(g.OutputIDs) != fmt.Sprint(c.GreedyNextIDs) {
				t.Errorf("%q: output_ids\n got %v\nwant %v", c.Prompt, g.OutputIDs, c.GreedyNextIDs)
			}
			if g.MetaInfo.PromptTokens != len(c.PromptIDs) {
				t.Errorf("%q: prompt_tokens %d, want %d", c.Prompt, g.MetaInfo.PromptTokens, len(c.PromptIDs))
			}
			if want := strings.TrimPrefix(c.Text, c.Prompt); g.Text != want {
				t.Errorf("%q: text\n got %q\nwant %q", c.Prompt, g.Text, want)
			}
		})
	}
	wg.Wait()
}
