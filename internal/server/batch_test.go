package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/server/servertest"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// seedEcho is a scripted generator whose reply is the prompt's last byte and the
// request's seed ("a:10"), one byte per token, then EOS.
func seedEcho(r *engine.Request) []engine.Event {
	seed := int64(-1)
	if r.Params.Seed != nil {
		seed = *r.Params.Seed
	}
	reply := fmt.Sprintf("%c:%d", r.InputIDs[len(r.InputIDs)-1], seed)
	var evs []engine.Event
	for i := 0; i < len(reply); i++ {
		evs = append(evs, engine.Event{Token: int(reply[i]), Logprob: -0.5, Text: reply[i : i+1]})
	}
	evs = append(evs, engine.Event{Token: servertest.EOS, Logprob: -0.5,
		Finish: &engine.Finish{Type: "stop", Matched: servertest.EOS, PromptTokens: len(r.InputIDs), OutputTokens: len(reply) + 1}})
	return evs
}

type genJSON struct {
	Text      string `json:"text"`
	OutputIDs []int  `json:"output_ids"`
	Index     *int   `json:"index"`
	MetaInfo  struct {
		ID                 string          `json:"id"`
		FinishReason       json.RawMessage `json:"finish_reason"`
		PromptTokens       int             `json:"prompt_tokens"`
		InputTokenLogprobs [][3]any        `json:"input_token_logprobs"`
		InputTopLogprobs   []any           `json:"input_top_logprobs"`
	} `json:"meta_info"`
}

// TestGenerateBatch: text lists, input_ids lists and n > 1 are answered with a list in
// SGLang's order (prompt i's sample j at i*n+j); each element is its own engine
// request; rids get _k; seeds step by one per sample.
func TestGenerateBatch(t *testing.T) {
	gen := &servertest.Generator{Script: seedEcho}
	ts, _ := newServer(t, server.Config{Generator: gen})
	for _, c := range []struct {
		body  string
		texts []string
		rids  []string
	}{
		{`{"text": ["xa", "yb"], "sampling_params": {"seed": 10}}`, []string{"a:10", "b:10"}, nil},
		{`{"input_ids": [[97], [98, 99]], "sampling_params": {"seed": 3}}`, []string{"a:3", "c:3"}, nil},
		{`{"text": "a", "rid": "r", "sampling_params": {"n": 3, "seed": 7}}`, []string{"a:7", "a:8", "a:9"}, []string{"r_0", "r_1", "r_2"}},
		{`{"text": ["a", "b"], "rid": "q", "sampling_params": {"n": 2, "sampling_seed": 10}}`, []string{"a:10", "a:11", "b:10", "b:11"}, []string{"q_0", "q_1", "q_2", "q_3"}},
		{`{"text": ["a", "b"], "rid": ["A", "B"], "sampling_params": {"n": 2, "seed": 1}}`, []string{"a:1", "a:2", "b:1", "b:2"}, []string{"A_0", "A_1", "B_0", "B_1"}},
		{`{"text": ["a", "b"], "rid": ["A", "B"], "sampling_params": [{"seed": 5}, {"seed": 6}]}`, []string{"a:5", "b:6"}, []string{"A", "B"}},
		{`{"text": ["a"]}`, []string{"a:-1"}, nil},
	} {
		before := len(gen.Requests())
		status, body := post(t, ts.URL+"/generate", c.body)
		var got []genJSON
		if err := json.Unmarshal(body, &got); status != 200 || err != nil {
			t.Fatalf("%s: %d %v %s", c.body, status, err, body)
		}
		if len(got) != len(c.texts) || len(gen.Requests())-before != len(c.texts) {
			t.Fatalf("%s: %d answers, %d engine requests, want %d", c.body, len(got), len(gen.Requests())-before, len(c.texts))
		}
		for k, g := range got {
			if g.Text != c.texts[k] || g.Index != nil || string(g.MetaInfo.FinishReason) != `{"matched":257,"type":"stop"}` {
				t.Errorf("%s [%d]: %+v, want text %q", c.body, k, g, c.texts[k])
			}
			if c.rids != nil && g.MetaInfo.ID != c.rids[k] {
				t.Errorf("%s [%d]: id %q, want %q", c.body, k, g.MetaInfo.ID, c.rids[k])
			}
		}
	}
	// Per-prompt sampling params apply to their prompt.
	status, body := post(t, ts.URL+"/generate", `{"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}`)
	var got []genJSON
	if err := json.Unmarshal(body, &got); status != 200 || err != nil || len(got) != 2 {
		t.Fatalf("%d %v %s", status, err, body)
	}
	if r := gen.Requests(); r[len(r)-2].Params.MaxNewTokens != 1 || r[len(r)-1].Params.MaxNewTokens != 2 {
		t.Fatalf("max_new_tokens %d %d", r[len(r)-2].Params.MaxNewTokens, r[len(r)-1].Params.MaxNewTokens)
	}
	// One prompt, n=1: an object.
	status, body = post(t, ts.URL+"/generate", `{"text": "a"}`)
	if status != 200 || body[0] != '{' {
		t.Fatalf("single: %d %s", status, body)
	}
}

// TestGenerateBatchStream: a streamed batch sends each element's events with its
// index (text cumulative per element), then one [DONE].
func TestGenerateBatchStream(t *testing.T) {
	ts, _ := newServer(t, server.Config{Generator: &servertest.Generator{Script: seedEcho}})
	evs := postStream(t, ts.URL+"/generate", `{"text": ["a", "b"], "stream": true, "sampling_params": {"n": 2, "seed": 1}}`)
	if evs[len(evs)-1] != "[DONE]" || slices.Index(evs, "[DONE]") != len(evs)-1 {
		t.Fatalf("events %v", evs)
	}
	last := map[int]genJSON{}
	for _, e := range evs[:len(evs)-1] {
		var g genJSON
		if err := json.Unmarshal([]byte(e), &g); err != nil || g.Index == nil {
			t.Fatalf("event %s: %v", e, err)
		}
		if prev, ok := last[*g.Index]; ok && !strings.HasPrefix(g.Text, prev.Text) {
			t.Fatalf("index %d: text %q after %q is not cumulative", *g.Index, g.Text, prev.Text)
		}
		last[*g.Index] = g
	}
	want := []string{"a:1", "a:2", "b:1", "b:2"}
	for k, w := range want {
		if g := last[k]; g.Text != w || string(g.MetaInfo.FinishReason) != `{"matched":257,"type":"stop"}` {
			t.Errorf("index %d ends with %+v, want %q", k, g, w)
		}
	}
}

// TestBatchFailure: one failing element fails the whole request: an HTTP error
// without a stream, an error event and no [DONE] in one; the others are aborted.
func TestBatchFailure(t *testing.T) {
	gen := &servertest.Generator{Script: func(r *engine.Request) []engine.Event {
		if r.InputIDs[len(r.InputIDs)-1] == 'b' {
			return failing(r)
		}
		return seedEcho(r)
	}}
	ts, _ := newServer(t, server.Config{Generator: gen})
	status, body := post(t, ts.URL+"/generate", `{"text": ["a", "b"]}`)
	checkError(t, status, body, 500, "device lost")
	evs := postStream(t, ts.URL+"/generate", `{"text": ["a", "b", "a"], "stream": true}`)
	if !strings.Contains(evs[len(evs)-1], `"error"`) || slices.Contains(evs, "[DONE]") {
		t.Fatalf("events %v", evs)
	}
}

// TestOpenAIBatchAndN: /v1/completions takes prompt lists and n (choices indexed
// prompt-major, usage counting each prompt once); chat takes n.
func TestOpenAIBatchAndN(t *testing.T) {
	ts, _ := newServer(t, server.Config{Generator: &servertest.Generator{Script: seedEcho}})
	status, body := post(t, ts.URL+"/v1/completions", `{"prompt": [[120, 97], [98]], "n": 2, "seed": 4}`)
	var c struct {
		Choices []struct {
			Index        int    `json:"index"`
			Text         string `json:"text"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
			TotalTokens      int `json:"total_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(body, &c); status != 200 || err != nil {
		t.Fatalf("%d %v %s", status, err, body)
	}
	want := []string{"a:4", "a:5", "b:4", "b:5"}
	if len(c.Choices) != 4 {
		t.Fatalf("choices %s", body)
	}
	for k, ch := range c.Choices {
		if ch.Index != k || ch.Text != want[k] || ch.FinishReason != "stop" {
			t.Errorf("choice %d: %+v, want %q", k, ch, want[k])
		}
	}
	// Prompts of 2 and 1 tokens; completions of 4 each (3 bytes + EOS).
	if c.Usage.PromptTokens != 3 || c.Usage.CompletionTokens != 16 || c.Usage.TotalTokens != 19 {
		t.Fatalf("usage %+v", c.Usage)
	}
	// Streaming: every choice's chunks carry its index; each ends with a finish reason.
	evs := postStream(t, ts.URL+"/v1/completions", `{"prompt": ["a", "b"], "stream": true, "seed": 1, "stream_options": {"include_usage": true}}`)
	texts, finished := map[int]string{}, map[int]bool{}
	for _, e := range evs[:len(evs)-1] {
		var ch struct {
			Choices []struct {
				Index        int     `json:"index"`
				Text         string  `json:"text"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens int `json:"prompt_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(e), &ch); err != nil {
			t.Fatal(err)
		}
		for _, x := range ch.Choices {
			texts[x.Index] += x.Text
			if x.FinishReason != nil {
				finished[x.Index] = true
			}
		}
		if ch.Usage != nil && ch.Usage.PromptTokens != 4 {
			t.Fatalf("stream usage %s", e)
		}
	}
	if texts[0] != "a:1" || texts[1] != "b:1" || !finished[0] || !finished[1] {
		t.Fatalf("stream texts %v finished %v", texts, finished)
	}
	// Chat n=2: two choices, two message texts; streamed, a role chunk per choice.
	status, body = post(t, ts.URL+"/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 8}`)
	if status != 200 || !strings.Contains(string(body), `"index":1,"message":{"role":"assistant","content":"::9"}`) {
		t.Fatalf("chat n=2: %d %s", status, body)
	}
	evs = postStream(t, ts.URL+"/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": true}`)
	roles := 0
	for _, e := range evs {
		if strings.Contains(e, `"role":"assistant"`) {
			roles++
		}
	}
	if roles != 2 {
		t.Fatalf("%d role chunks in %v", roles, evs)
	}
}

// TestInputLogprobs: with return_logprob, input_token_logprobs starts at the prompt's
// last position ([null, id, text]); other starts are refused naming logprob_start_len.
func TestInputLogprobs(t *testing.T) {
	ts, _ := newServer(t, server.Config{})
	for _, body := range []string{
		`{"text": "Hi", "return_logprob": true, "sampling_params": {"max_new_tokens": 1}}`,
		`{"text": "Hi", "return_logprob": true, "logprob_start_len": 2, "top_logprobs_num": 1, "return_text_in_logprobs": true, "sampling_params": {"max_new_tokens": 1}}`,
	} {
		status, b := post(t, ts.URL+"/generate", body)
		var g genJSON
		if err := json.Unmarshal(b, &g); status != 200 || err != nil {
			t.Fatalf("%d %v %s", status, err, b)
		}
		il := g.MetaInfo.InputTokenLogprobs
		if len(il) != 1 || il[0][0] != nil || il[0][1] != float64('i') {
			t.Fatalf("%s: input_token_logprobs %v", body, il)
		}
		if strings.Contains(body, "return_text_in_logprobs") && (il[0][2] != "i" || len(g.MetaInfo.InputTopLogprobs) != 1) {
			t.Fatalf("%s: %s", body, b)
		}
	}
	status, b := post(t, ts.URL+"/generate", `{"text": "Hi", "sampling_params": {"max_new_tokens": 1}}`)
	if status != 200 || strings.Contains(string(b), "input_token_logprobs") {
		t.Fatalf("without return_logprob: %s", b)
	}
	status, b = post(t, ts.URL+"/generate", `{"text": "Hi", "return_logprob": true, "logprob_start_len": 0}`)
	checkError(t, status, b, 400, "last position only")
	if errParam(t, b) != "logprob_start_len" {
		t.Fatalf("param: %s", b)
	}
}

// TestAbortRequest: /abort_request ends a running request by rid (or all): it is
// answered with what it generated and finish_reason abort.
func TestAbortRequest(t *testing.T) {
	hold := make(chan struct{})
	defer close(hold)
	gen := &servertest.Generator{Hold: hold}
	ts, _ := newServer(t, server.Config{Generator: gen})
	type result struct {
		status int
		body   []byte
	}
	res := make(chan result, 3)
	var wg sync.WaitGroup
	for _, body := range []string{`{"text": "a", "rid": "slow"}`, `{"prompt": "a", "rid": "other"}`, `{"prompt": "a", "rid": "other2"}`} {
		path := "/generate"
		if strings.Contains(body, "prompt") {
			path = "/v1/completions"
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, b := post(t, ts.URL+path, body)
			res <- result{s, b}
		}()
	}
	waitFor(t, func() bool { return len(gen.Requests()) == 3 })
	status, body := post(t, ts.URL+"/abort_request", `{"rid": "slow"}`)
	if status != 200 || string(body) != "{\"aborted\":1}\n" {
		t.Fatalf("abort: %d %s", status, body)
	}
	r := <-res
	if r.status != 200 || !strings.Contains(string(r.body), `"type":"abort"`) || !strings.Contains(string(r.body), `"id":"slow"`) {
		t.Fatalf("aborted request: %d %s", r.status, r.body)
	}
	if status, body = post(t, ts.URL+"/abort_request", `{"abort_all": true}`); status != 200 || string(body) != "{\"aborted\":2}\n" {
		t.Fatalf("abort_all: %d %s", status, body)
	}
	for range 2 {
		if r := <-res; r.status != 200 || !strings.Contains(string(r.body), `"finish_reason":"abort"`) {
			t.Fatalf("aborted completion: %d %s", r.status, r.body)
		}
	}
	wg.Wait()
	status, body = post(t, ts.URL+"/abort_request", `{}`)
	checkError(t, status, body, 400, "rid")
}

// TestTokenize: /tokenize and /detokenize, one prompt or a list, as SGLang answers.
func TestTokenize(t *testing.T) {
	ts, _ := newServer(t, server.Config{ContextLen: 64})
	for _, c := range []struct{ path, body, want string }{
		{"/tokenize", `{"prompt": "Hi"}`, `{"count":3,"max_model_len":64,"tokens":[256,72,105]}`},
		{"/v1/tokenize", `{"prompt": ["Hi", "a"], "add_special_tokens": false, "model": "test-model"}`, `{"count":[2,1],"max_model_len":64,"tokens":[[72,105],[97]]}`},
		{"/detokenize", `{"tokens": [256, 72, 105]}`, `{"text":"Hi"}`},
		{"/v1/detokenize", `{"tokens": [[72], [105, 257]]}`, `{"text":["H","i"]}`},
		{"/detokenize", `{"tokens": []}`, `{"text":""}`},
	} {
		status, body := post(t, ts.URL+c.path, c.body)
		if status != 200 || strings.TrimSpace(string(body)) != c.want {
			t.Errorf("%s %s: %d %s, want %s", c.path, c.body, status, body, c.want)
		}
	}
	for _, c := range []struct{ path, body, param string }{
		{"/tokenize", `{"prompt": 5}`, "prompt"},
		{"/tokenize", `{"prompt": "a", "nope": 1}`, "nope"},
		{"/detokenize", `{"tokens": [99999]}`, "tokens"},
		{"/detokenize", `{"tokens": "a"}`, "tokens"},
		{"/detokenize", `{"tokens": [1], "skip_special_tokens": false}`, "skip_special_tokens"},
	} {
		status, body := post(t, ts.URL+c.path, c.body)
		if status != 400 || errParam(t, body) != c.param {
			t.Errorf("%s %s: %d %s, want 400 naming %s", c.path, c.body, status, body, c.param)
		}
	}
	status, body := post(t, ts.URL+"/tokenize", `{"prompt": "a", "model": "gpt-4"}`)
	checkError(t, status, body, 404, "gpt-4")
}

// TestSGLangInfo: /server_info, /get_server_args and /get_model_info have SGLang's
// fields.
func TestSGLangInfo(t *testing.T) {
	ts, _ := newServer(t, server.Config{ModelName: "m", ModelPath: "/models/m", TokenizerPath: "/models/m", ContextLen: 128,
		PageSize: 16, PrefixCache: true, Version: "v1.2.3", ServerArgs: map[string]any{"tp_size": 1, "port": 30000}})
	var args map[string]any
	status, body := get(t, ts.URL+"/get_server_args")
	if err := json.Unmarshal(body, &args); status != 200 || err != nil {
		t.Fatalf("%d %s", status, body)
	}
	for k, v := range map[string]any{"model_path": "/models/m", "tp_size": 1.0, "port": 30000.0, "context_length": 128.0,
		"disaggregation_mode": "null", "served_model_name": "m", "disable_radix_cache": false, "page_size": 16.0} {
		if args[k] != v {
			t.Errorf("get_server_args %s = %v, want %v", k, args[k], v)
		}
	}
	for _, path := range []string{"/server_info", "/get_server_info"} {
		var info map[string]any
		status, body = get(t, ts.URL+path)
		if err := json.Unmarshal(body, &info); status != 200 || err != nil {
			t.Fatalf("%d %s", status, body)
		}
		st, _ := info["internal_states"].([]any)
		if info["version"] != "v1.2.3" || info["tp_size"] != 1.0 || len(st) != 1 || info["ready"] != true {
			t.Errorf("%s: %s", path, body)
		}
	}
	var mi map[string]any
	status, body = get(t, ts.URL+"/get_model_info")
	if err := json.Unmarshal(body, &mi); status != 200 || err != nil {
		t.Fatalf("%d %s", status, body)
	}
	for _, k := range []string{"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version",
		"has_image_understanding", "has_audio_understanding"} {
		if _, ok := mi[k]; !ok {
			t.Errorf("get_model_info lacks %s: %s", k, body)
		}
	}
}

// TestBatchOnDisaggregated: a prefill or decode server takes one generation per
// room: batches and n > 1 with bootstrap fields are refused.
func TestBatchOnDisaggregated(t *testing.T) {
	ts, _ := newServer(t, server.Config{Mode: server.ModeDecode, Vouchers: server.VoucherPolicy{AllowUnsigned: true},
		PrepareDisagg: func(ctx context.Context, req *engine.Request, b server.Bootstrap) error { return nil }})
	boot := `"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7`
	for _, c := range []struct{ body, param string }{
		{`{"text": ["a", "b"], ` + boot + `}`, "text"},
		{`{"text": "a", "sampling_params": {"n": 2}, ` + boot + `}`, "sampling_params.n"},
	} {
		status, body := post(t, ts.URL+"/generate", c.body)
		checkError(t, status, body, 400, "disaggregated")
		if errParam(t, body) != c.param {
			t.Errorf("%s: %s", c.body, body)
		}
	}
}

// TestNSharesPrompt: with a prefix cache, n > 1 computes the prompt once: the real
// engine then takes the samples' prompt pages from its cache, and greedy samples
// equal the n=1 answer.
func TestNSharesPrompt(t *testing.T) {
	e, reg := newCachedEngine(t)
	ts, _ := newServer(t, server.Config{Generator: e, Tokenizer: e.Tokenizer(), PrefixCache: true, Gatherer: reg})
	prompt := strings.Repeat("once upon a time ", 4) // 68 tokens: four 16-token pages
	status, body := post(t, ts.URL+"/generate", `{"text": "`+prompt+`", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}`)
	var one genJSON
	if err := json.Unmarshal(body, &one); status != 200 || err != nil {
		t.Fatalf("%d %s", status, body)
	}
	if _, err := e.FlushCache(); err != nil {
		t.Fatal(err)
	}
	hit0 := metricValue(t, reg, "mooncake_radix_cache_hit_tokens_total")
	status, body = post(t, ts.URL+"/generate", `{"text": "`+prompt+`", "sampling_params": {"n": 3, "max_new_tokens": 4, "temperature": 0}}`)
	var many []genJSON
	if err := json.Unmarshal(body, &many); status != 200 || err != nil || len(many) != 3 {
		t.Fatalf("%d %s", status, body)
	}
	for _, g := range many {
		if g.Text != one.Text || !slices.Equal(g.OutputIDs, one.OutputIDs) {
			t.Fatalf("greedy sample %q, n=1 gave %q", g.Text, one.Text)
		}
	}
	if hit := metricValue(t, reg, "mooncake_radix_cache_hit_tokens_total") - hit0; hit < 3*64 {
		t.Fatalf("%v prompt tokens from the cache for 3 samples, want at least %d", hit, 3*64)
	}
}

// newCachedEngine is newEngine with a prefix cache and the engine's metrics on a
// registry.
func newCachedEngine(t *testing.T) (*engine.Engine, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	return newEngineWith(t, model.Builtin(), tokenizer.NewByteLevel(), 0, true, reg), reg
}

// metricValue is the sum of a metric family's counters and gauges in g.
func metricValue(t *testing.T, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	v := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return v
}

// TestAPIKey: with an API key every endpoint but health and metrics needs it.
func TestAPIKey(t *testing.T) {
	ts, _ := newServer(t, server.Config{APIKey: "sk-secret"})
	for _, path := range []string{"/health", "/health_generate", "/metrics"} {
		if status, body := get(t, ts.URL+path); status != 200 {
			t.Errorf("%s without the key: %d %s", path, status, body)
		}
	}
	status, body := post(t, ts.URL+"/generate", `{"text": "a"}`)
	checkError(t, status, body, 401, "API key")
	if status, body := get(t, ts.URL+"/get_server_args"); status != 401 || strings.Contains(string(body), "sk-secret") {
		t.Errorf("get_server_args without the key: %d %s", status, body)
	}
	for key, want := range map[string]int{"Bearer sk-secret": 200, "Bearer sk-secreT": 401, "sk-secret": 401} {
		req, _ := http.NewRequest("POST", ts.URL+"/generate", strings.NewReader(`{"text": "a", "sampling_params": {"max_new_tokens": 1}}`))
		req.Header.Set("Authorization", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("Authorization %q: %d, want %d", key, resp.StatusCode, want)
		}
	}
}
