package server_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/server/servertest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testModel = "test-model"

// newServer starts an httptest server over a Server built from cfg, with the
// fakes where cfg leaves Generator or Tokenizer nil.
func newServer(t testing.TB, cfg server.Config) (*httptest.Server, *server.Server) {
	t.Helper()
	if cfg.Generator == nil {
		cfg.Generator = &servertest.Generator{}
	}
	if cfg.Tokenizer == nil {
		cfg.Tokenizer = servertest.Tokenizer{}
	}
	if cfg.ModelName == "" {
		cfg.ModelName = testModel
	}
	if cfg.ModelPath == "" {
		cfg.ModelPath = "/models/test"
	}
	s, err := server.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(ts.Close)
	return ts, s
}

func post(t testing.TB, url, body string) (int, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

func get(t testing.TB, url string) (int, []byte) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

type errorJSON struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}

// checkError checks the status and the error body's shape.
func checkError(t *testing.T, status int, body []byte, wantStatus int, wantMsg string) {
	t.Helper()
	if status != wantStatus {
		t.Fatalf("status %d, want %d; body %s", status, wantStatus, body)
	}
	var e errorJSON
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("error body is not JSON: %v: %s", err, body)
	}
	if e.Error.Message == "" || e.Error.Type == "" || e.Error.Code != wantStatus {
		t.Fatalf("error body lacks message, type or code: %s", body)
	}
	if !strings.Contains(e.Error.Message, wantMsg) {
		t.Fatalf("message %q does not contain %q", e.Error.Message, wantMsg)
	}
}

func TestBadInput(t *testing.T) {
	ts, _ := newServer(t, server.Config{ContextLen: 64, MaxBodyBytes: 4096})
	long := strings.Repeat("x", 100)
	huge := `{"text": "` + strings.Repeat("y", 5000) + `"}`
	cases := []struct {
		name, method, path, body string
		status                   int
		msg                      string
	}{
		// malformed JSON and wrong shapes
		{"generate/malformed", "POST", "/generate", `{"text": "a"`, 400, "malformed JSON"},
		{"generate/garbage", "POST", "/generate", `not json`, 400, "JSON object"},
		{"generate/not-object", "POST", "/generate", `[1, 2]`, 400, "JSON object"},
		{"generate/empty-body", "POST", "/generate", ``, 400, "empty request body"},
		{"generate/trailing", "POST", "/generate", `{"text": "a"} {}`, 400, "malformed JSON"},
		{"completions/malformed", "POST", "/v1/completions", `{"prompt": }`, 400, "malformed JSON"},
		{"chat/malformed", "POST", "/v1/chat/completions", `{"messages": [`, 400, "malformed JSON"},
		// wrong types
		{"generate/text-number", "POST", "/generate", `{"text": 5}`, 400, "text"},
		{"generate/text-object", "POST", "/generate", `{"text": {"a": 1}}`, 400, "text"},
		{"generate/ids-string", "POST", "/generate", `{"input_ids": "1 2"}`, 400, "input_ids"},
		{"generate/ids-float", "POST", "/generate", `{"input_ids": [1.5]}`, 400, "input_ids"},
		{"generate/temperature-string", "POST", "/generate", `{"text": "a", "sampling_params": {"temperature": "hot"}}`, 400, "temperature"},
		{"generate/max-float", "POST", "/generate", `{"text": "a", "sampling_params": {"max_new_tokens": 1.5}}`, 400, "max_new_tokens"},
		{"generate/stream-string", "POST", "/generate", `{"text": "a", "stream": "yes"}`, 400, "stream"},
		{"generate/stop-number", "POST", "/generate", `{"text": "a", "sampling_params": {"stop": 5}}`, 400, "stop"},
		{"generate/sampling-list", "POST", "/generate", `{"text": "a", "sampling_params": [1]}`, 400, "sampling_params"},
		{"completions/max-string", "POST", "/v1/completions", `{"prompt": "a", "max_tokens": "10"}`, 400, "max_tokens"},
		{"completions/prompt-bool", "POST", "/v1/completions", `{"prompt": true}`, 400, "prompt"},
		{"completions/prompt-mixed", "POST", "/v1/completions", `{"prompt": [1, "a"]}`, 400, "prompt"},
		{"chat/messages-string", "POST", "/v1/chat/completions", `{"messages": "hi"}`, 400, "messages"},
		{"chat/content-number", "POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": 5}]}`, 400, "content"},
		{"chat/content-image", "POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}`, 400, "text content"},
		{"chat/bad-role", "POST", "/v1/chat/completions", `{"messages": [{"role": "wizard", "content": "hi"}]}`, 400, "role"},
		// empty prompts
		{"generate/empty-text", "POST", "/generate", `{"text": ""}`, 400, "empty"},
		{"generate/empty-ids", "POST", "/generate", `{"input_ids": []}`, 400, "empty"},
		{"generate/no-prompt", "POST", "/generate", `{"sampling_params": {}}`, 400, "required"},
		{"generate/null-text", "POST", "/generate", `{"text": null}`, 400, "required"},
		{"generate/both", "POST", "/generate", `{"text": "a", "input_ids": [1]}`, 400, "not both"},
		{"completions/empty-prompt", "POST", "/v1/completions", `{"prompt": ""}`, 400, "empty"},
		{"completions/no-prompt", "POST", "/v1/completions", `{"model": "test-model"}`, 400, "required"},
		{"completions/empty-ids", "POST", "/v1/completions", `{"prompt": []}`, 400, "empty"},
		{"chat/no-messages", "POST", "/v1/chat/completions", `{"messages": []}`, 400, "empty"},
		// batches and n
		{"generate/batch-mixed", "POST", "/generate", `{"text": ["a", 5]}`, 400, "text[1]"},
		{"generate/batch-empty-element", "POST", "/generate", `{"text": ["a", ""]}`, 400, "empty"},
		{"generate/batch-ids-mixed", "POST", "/generate", `{"input_ids": [[1], [2, "x"]]}`, 400, "input_ids[1][1]"},
		{"generate/batch-sampling-count", "POST", "/generate", `{"text": ["a", "b"], "sampling_params": [{}]}`, 400, "one per prompt"},
		{"generate/batch-sampling-single", "POST", "/generate", `{"text": "a", "sampling_params": [{}]}`, 400, "sampling_params"},
		{"generate/batch-n-differs", "POST", "/generate", `{"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}`, 400, "sampling_params[1].n"},
		{"generate/batch-rid-count", "POST", "/generate", `{"text": ["a", "b"], "rid": ["x"]}`, 400, "rid"},
		{"generate/rid-list-single", "POST", "/generate", `{"text": "a", "rid": ["x"]}`, 400, "rid"},
		{"generate/batch-too-big", "POST", "/generate", `{"text": ["a", "b", "c"], "sampling_params": {"n": 100}}`, 400, "more than this server takes"},
		{"completions/batch-mixed", "POST", "/v1/completions", `{"prompt": ["a", [1]]}`, 400, "prompt[1]"},
		{"completions/n-zero", "POST", "/v1/completions", `{"prompt": "a", "n": 0}`, 400, "n must be in [1, 128]"},
		{"chat/n-big", "POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}], "n": 129}`, 400, "n must be in [1, 128]"},
		{"generate/n-negative", "POST", "/generate", `{"text": "a", "sampling_params": {"n": -1}}`, 400, "sampling_params.n"},
		{"generate/logprob-start-negative", "POST", "/generate", `{"text": "a", "return_logprob": true, "logprob_start_len": -2}`, 400, "logprob_start_len"},
		{"generate/logprob-start-prompt", "POST", "/generate", `{"text": "abc", "return_logprob": true, "logprob_start_len": 1}`, 400, "last position only"},
		{"generate/logprob-start-beyond", "POST", "/generate", `{"text": "abc", "return_logprob": true, "logprob_start_len": 4}`, 400, "not below the prompt"},
		// prompt beyond the context length, tokens outside the vocabulary
		{"generate/too-long", "POST", "/generate", `{"text": "` + long + `"}`, 400, "context length"},
		{"generate/too-long-ids", "POST", "/generate", `{"input_ids": [` + strings.Repeat("1,", 63) + `1]}`, 400, "context length"},
		{"completions/too-long", "POST", "/v1/completions", `{"prompt": "` + long + `"}`, 400, "context length"},
		{"chat/too-long", "POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": "` + long + `"}]}`, 400, "context length"},
		{"generate/id-negative", "POST", "/generate", `{"input_ids": [1, -1]}`, 400, "vocabulary"},
		{"generate/id-too-big", "POST", "/generate", `{"input_ids": [99999]}`, 400, "vocabulary"},
		{"generate/stop-id-too-big", "POST", "/generate", `{"text": "a", "sampling_params": {"stop_token_ids": [99999]}}`, 400, "vocabulary"},
		// sampling ranges
		{"generate/max-negative", "POST", "/generate", `{"text": "a", "sampling_params": {"max_new_tokens": -1}}`, 400, "max_new_tokens"},
		{"completions/max-negative", "POST", "/v1/completions", `{"prompt": "a", "max_tokens": -5}`, 400, "max_tokens"},
		{"chat/max-negative", "POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}`, 400, "max_tokens"},
		{"generate/temperature-negative", "POST", "/generate", `{"text": "a", "sampling_params": {"temperature": -0.1}}`, 400, "temperature"},
		{"completions/temperature-negative", "POST", "/v1/completions", `{"prompt": "a", "temperature": -1}`, 400, "temperature"},
		{"generate/top-p-zero", "POST", "/generate", `{"text": "a", "sampling_params": {"top_p": 0}}`, 400, "top_p"},
		{"generate/top-p-big", "POST", "/generate", `{"text": "a", "sampling_params": {"top_p": 1.5}}`, 400, "top_p"},
		{"chat/top-p-negative", "POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}], "top_p": -0.5}`, 400, "top_p"},
		{"generate/top-k", "POST", "/generate", `{"text": "a", "sampling_params": {"top_k": -2}}`, 400, "top_k"},
		{"generate/min-p", "POST", "/generate", `{"text": "a", "sampling_params": {"min_p": 2}}`, 400, "min_p"},
		{"generate/penalty", "POST", "/generate", `{"text": "a", "sampling_params": {"frequency_penalty": 3}}`, 400, "frequency_penalty"},
		{"generate/repetition-zero", "POST", "/generate", `{"text": "a", "sampling_params": {"repetition_penalty": 0}}`, 400, "repetition_penalty"},
		{"generate/repetition-big", "POST", "/generate", `{"text": "a", "sampling_params": {"repetition_penalty": 2.5}}`, 400, "repetition_penalty"},
		{"completions/repetition", "POST", "/v1/completions", `{"prompt": "a", "repetition_penalty": -1}`, 400, "repetition_penalty"},
		{"completions/best-of", "POST", "/v1/completions", `{"prompt": "a", "best_of": 2}`, 400, "best_of"},
		{"completions/echo", "POST", "/v1/completions", `{"prompt": "a", "echo": true}`, 400, "echo"},
		{"chat/tools", "POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}`, 400, "tools"},
		{"generate/bootstrap-port", "POST", "/generate", `{"text": "a", "bootstrap_port": 70000}`, 400, "bootstrap_port"},
		// unknown model
		{"completions/model", "POST", "/v1/completions", `{"model": "gpt-4", "prompt": "a"}`, 404, "gpt-4"},
		{"chat/model", "POST", "/v1/chat/completions", `{"model": "gpt-4", "messages": [{"role": "user", "content": "a"}]}`, 404, "gpt-4"},
		{"models/unknown", "GET", "/v1/models/gpt-4", ``, 404, "gpt-4"},
		{"models/none", "GET", "/v1/models/", ``, 404, "no model named"},
		{"tokenize/model", "POST", "/tokenize", `{"model": "gpt-4", "prompt": "a"}`, 404, "this server serves"},
		// oversize body
		{"generate/oversize", "POST", "/generate", huge, 413, "larger than 4096"},
		{"completions/oversize", "POST", "/v1/completions", huge, 413, "larger than 4096"},
		{"chat/oversize", "POST", "/v1/chat/completions", huge, 413, "larger than 4096"},
		// routing
		{"generate/get", "GET", "/generate", ``, 405, "not allowed"},
		{"unknown-path", "GET", "/nope", ``, 404, "no such endpoint"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, err := http.NewRequest(c.method, ts.URL+c.path, strings.NewReader(c.body))
			if err != nil {
				t.Fatal(err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			checkError(t, resp.StatusCode, body, c.status, c.msg)
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q", ct)
			}
		})
	}
	// The server keeps serving.
	status, body := post(t, ts.URL+"/generate", `{"text": "ok", "sampling_params": {"max_new_tokens": 2}}`)
	if status != 200 {
		t.Fatalf("after the bad inputs: status %d: %s", status, body)
	}
}

func TestEngineErrors(t *testing.T) {
	for _, c := range []struct {
		err    error
		status int
	}{
		{fmt.Errorf("queue full: %w", engine.ErrOverloaded), 503},
		{engine.ErrClosed, 503},
		{fmt.Errorf("%w: 9000 tokens", engine.ErrPromptTooLong), 400},
		{fmt.Errorf("%w: bad seed", engine.ErrBadRequest), 400},
		{errors.New("kernel exploded"), 500},
	} {
		t.Run(c.err.Error(), func(t *testing.T) {
			ts, _ := newServer(t, server.Config{Generator: &servertest.Generator{Err: c.err}})
			for _, p := range []struct{ path, body string }{
				{"/generate", `{"text": "a"}`},
				{"/generate", `{"text": "a", "stream": true}`},
				{"/v1/completions", `{"prompt": "a"}`},
				{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}], "stream": true}`},
			} {
				status, body := post(t, ts.URL+p.path, p.body)
				checkError(t, status, body, c.status, c.err.Error())
			}
		})
	}
}

func TestNotReady(t *testing.T) {
	var ready atomic.Bool
	ts, _ := newServer(t, server.Config{Ready: ready.Load})
	for _, p := range []string{"/generate", "/v1/completions", "/v1/chat/completions"} {
		status, body := post(t, ts.URL+p, `{}`)
		checkError(t, status, body, 503, "not ready")
	}
	status, body := get(t, ts.URL+"/health")
	checkError(t, status, body, 503, "not ready")
	ready.Store(true)
	if status, body := get(t, ts.URL+"/health"); status != 200 {
		t.Fatalf("/health when ready: %d %s", status, body)
	}
}

type generateJSON struct {
	Text      string `json:"text"`
	OutputIDs []int  `json:"output_ids"`
	MetaInfo  struct {
		ID                  string          `json:"id"`
		FinishReason        json.RawMessage `json:"finish_reason"`
		PromptTokens        int             `json:"prompt_tokens"`
		CompletionTokens    int             `json:"completion_tokens"`
		E2ELatency          float64         `json:"e2e_latency"`
		OutputTokenLogprobs [][3]any        `json:"output_token_logprobs"`
	} `json:"meta_info"`
}

func TestGenerate(t *testing.T) {
	gen := &servertest.Generator{}
	ts, _ := newServer(t, server.Config{Generator: gen})
	status, body := post(t, ts.URL+"/generate", `{"text": "Hi", "rid": "r1", "return_logprob": true,
		"sampling_params": {"max_new_tokens": 5, "temperature": 0, "top_p": 0.9, "top_k": 4, "min_p": 0.1, "stop": "x",
		"stop_token_ids": [7], "ignore_eos": true, "seed": 42, "frequency_penalty": 0.5, "presence_penalty": -0.5,
		"repetition_penalty": 1.3}}`)
	if status != 200 {
		t.Fatalf("status %d: %s", status, body)
	}
	var g generateJSON
	if err := json.Unmarshal(body, &g); err != nil {
		t.Fatal(err)
	}
	if g.Text != "Hello" || len(g.OutputIDs) != 5 || g.OutputIDs[0] != 'H' {
		t.Fatalf("output %q %v", g.Text, g.OutputIDs)
	}
	if g.MetaInfo.ID != "r1" || g.MetaInfo.PromptTokens != 3 || g.MetaInfo.CompletionTokens != 5 || g.MetaInfo.E2ELatency <= 0 {
		t.Fatalf("meta_info %+v", g.MetaInfo)
	}
	if string(g.MetaInfo.FinishReason) != `{"length":5,"type":"length"}` {
		t.Fatalf("finish_reason %s", g.MetaInfo.FinishReason)
	}
	if len(g.MetaInfo.OutputTokenLogprobs) != 5 || g.MetaInfo.OutputTokenLogprobs[0][0] != -0.5 ||
		g.MetaInfo.OutputTokenLogprobs[0][1] != float64('H') || g.MetaInfo.OutputTokenLogprobs[0][2] != nil {
		t.Fatalf("output_token_logprobs %v", g.MetaInfo.OutputTokenLogprobs)
	}
	req := gen.Requests()[0]
	seed := int64(42)
	want := engine.SamplingParams{MaxNewTokens: 5, TopP: 0.9, TopK: 4, MinP: 0.1, Seed: &seed, FrequencyPenalty: 0.5,
		PresencePenalty: -0.5, RepetitionPenalty: 1.3, Stop: []string{"x"}, StopTokenIDs: []int{7}, IgnoreEOS: true}
	if got := req.Params; fmt.Sprint(got.MaxNewTokens, got.TopP, got.TopK, got.MinP, *got.Seed, got.FrequencyPenalty,
		got.PresencePenalty, got.RepetitionPenalty, got.Stop, got.StopTokenIDs, got.IgnoreEOS) != fmt.Sprint(want.MaxNewTokens, want.TopP, want.TopK,
		want.MinP, *want.Seed, want.FrequencyPenalty, want.PresencePenalty, want.RepetitionPenalty, want.Stop, want.StopTokenIDs, want.IgnoreEOS) {
		t.Fatalf("params %+v", got)
	}
	if fmt.Sprint(req.InputIDs) != fmt.Sprint([]int{servertest.BOS, 'H', 'i'}) || req.ID != "r1" || !req.Logprobs {
		t.Fatalf("request %+v", req)
	}

	// input_ids go through as given; EOS ends with stop, matched.
	status, body = post(t, ts.URL+"/generate", `{"input_ids": [72, 105]}`)
	if status != 200 {
		t.Fatalf("status %d: %s", status, body)
	}
	g = generateJSON{}
	_ = json.Unmarshal(body, &g)
	if g.Text != servertest.DefaultReply || string(g.MetaInfo.FinishReason) != `{"matched":257,"type":"stop"}` || g.MetaInfo.ID == "" {
		t.Fatalf("got %s", body)
	}
	if g.MetaInfo.OutputTokenLogprobs != nil {
		t.Fatalf("logprobs not asked for: %s", body)
	}
	// A one-element batch is a batch: answered with a list, as SGLang does.
	if status, body := post(t, ts.URL+"/generate", `{"text": ["Hi"], "sampling_params": {"max_new_tokens": 1}}`); status != 200 || body[0] != '[' {
		t.Fatalf("status %d: %s", status, body)
	}
	// max_new_tokens 0 answers without the engine.
	n := len(gen.Requests())
	status, body = post(t, ts.URL+"/generate", `{"text": "Hi", "sampling_params": {"max_new_tokens": 0}}`)
	g = generateJSON{}
	_ = json.Unmarshal(body, &g)
	if status != 200 || g.Text != "" || len(g.OutputIDs) != 0 || g.MetaInfo.PromptTokens != 3 || len(gen.Requests()) != n {
		t.Fatalf("max_new_tokens 0: %d %s", status, body)
	}
}

func TestContextClamp(t *testing.T) {
	gen := &servertest.Generator{}
	ts, _ := newServer(t, server.Config{Generator: gen, ContextLen: 10})
	if status, body := post(t, ts.URL+"/generate", `{"text": "abc", "sampling_params": {"max_new_tokens": 100, "ignore_eos": true}}`); status != 200 {
		t.Fatalf("status %d: %s", status, body)
	}
	if got := gen.Requests()[0].Params.MaxNewTokens; got != 6 {
		t.Fatalf("max_new_tokens %d, want 6 (context 10 - prompt 4)", got)
	}
}

type completionJSON struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Index        int     `json:"index"`
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
		Logprobs     *struct {
			Tokens        []string  `json:"tokens"`
			TokenLogprobs []float64 `json:"token_logprobs"`
		} `json:"logprobs"`
		Message *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta *struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
}

func TestCompletions(t *testing.T) {
	gen := &servertest.Generator{}
	ts, _ := newServer(t, server.Config{Generator: gen})
	for _, model := range []string{"", testModel, "/models/test"} {
		status, body := post(t, ts.URL+"/v1/completions", `{"model": "`+model+`", "prompt": "Hi", "logprobs": 1, "seed": 3, "stop": ["x", "y"]}`)
		if status != 200 {
			t.Fatalf("model %q: status %d: %s", model, status, body)
		}
		var c completionJSON
		_ = json.Unmarshal(body, &c)
		// max_tokens defaults to 16; the fake stops after its reply.
		if c.Object != "text_completion" || !strings.HasPrefix(c.ID, "cmpl-") || len(c.Choices) != 1 ||
			c.Choices[0].Text != servertest.DefaultReply || *c.Choices[0].FinishReason != "stop" {
			t.Fatalf("got %s", body)
		}
		if c.Usage == nil || c.Usage.PromptTokens != 3 || c.Usage.CompletionTokens != 14 || c.Usage.TotalTokens != 17 {
			t.Fatalf("usage %s", body)
		}
		if lp := c.Choices[0].Logprobs; lp == nil || len(lp.Tokens) != 14 || lp.Tokens[0] != "H" || lp.TokenLogprobs[0] != -0.5 {
			t.Fatalf("logprobs %s", body)
		}
	}
	if p := gen.Requests()[0].Params; p.MaxNewTokens != 16 || *p.Seed != 3 || len(p.Stop) != 2 {
		t.Fatalf("params %+v", p)
	}
	// Token prompts, and a length finish.
	status, body := post(t, ts.URL+"/v1/completions", `{"prompt": [72, 105], "max_tokens": 3}`)
	var c completionJSON
	_ = json.Unmarshal(body, &c)
	if status != 200 || c.Choices[0].Text != "Hel" || *c.Choices[0].FinishReason != "length" || c.Choices[0].Logprobs != nil {
		t.Fatalf("status %d: %s", status, body)
	}
	if got := gen.Requests()[len(gen.Requests())-1].InputIDs; fmt.Sprint(got) != "[72 105]" {
		t.Fatalf("input ids %v", got)
	}
}

// TestChatTemplateKwargs: chat_template_kwargs reach the template as its
// variables, as SGLang and vLLM pass them (Qwen3's enable_thinking).
func TestChatTemplateKwargs(t *testing.T) {
	gen := &servertest.Generator{}
	var got map[string]any
	tmpl := func(msgs []server.ChatMessage, kwargs map[string]any) (string, error) {
		got = kwargs
		return "chat:" + msgs[0].Content, nil
	}
	ts, _ := newServer(t, server.Config{Generator: gen, ChatTemplate: tmpl})
	status, body := post(t, ts.URL+"/v1/chat/completions", `{"messages": [{"role": "user", "content": "Hi"}],
		"max_tokens": 2, "chat_template_kwargs": {"enable_thinking": false, "n": 2}}`)
	if status != 200 {
		t.Fatalf("status %d: %s", status, body)
	}
	if v, ok := got["enable_thinking"].(bool); !ok || v || got["n"] != 2.0 || len(got) != 2 {
		t.Fatalf("template kwargs %#v", got)
	}
}

func TestChat(t *testing.T) {
	gen := &servertest.Generator{}
	var rendered []server.ChatMessage
	tmpl := func(msgs []server.ChatMessage, kwargs map[string]any) (string, error) {
		rendered = msgs
		if kwargs != nil {
			return "", fmt.Errorf("kwargs %v without chat_template_kwargs", kwargs)
		}
		return "<s>chat:" + msgs[len(msgs)-1].Content, nil
	}
	ts, _ := newServer(t, server.Config{Generator: gen, ChatTemplate: tmpl})
	status, body := post(t, ts.URL+"/v1/chat/completions", `{"model": "test-model", "messages": [
		{"role": "developer", "content": "be brief"},
		{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
		"max_completion_tokens": 4, "logprobs": true, "top_logprobs": 1}`)
	if status != 200 {
		t.Fatalf("status %d: %s", status, body)
	}
	var c completionJSON
	_ = json.Unmarshal(body, &c)
	if c.Object != "chat.completion" || !strings.HasPrefix(c.ID, "chatcmpl-") || c.Choices[0].Message == nil ||
		c.Choices[0].Message.Role != "assistant" || c.Choices[0].Message.Content != "Hell" || *c.Choices[0].FinishReason != "length" {
		t.Fatalf("got %s", body)
	}
	if c.Usage == nil || c.Usage.CompletionTokens != 4 {
		t.Fatalf("usage: %s", body)
	}
	if fmt.Sprint(rendered) != "[{system be brief} {user Hi\nthere}]" {
		t.Fatalf("messages %v", rendered)
	}
	// The template text starts with the BOS text: no second BOS.
	ids := gen.Requests()[0].InputIDs
	if ids[0] != '<' {
		t.Fatalf("prompt ids %v", ids)
	}
	if !strings.Contains(string(body), `"top_logprobs":[{"token":"H"`) {
		t.Fatalf("logprobs %s", body)
	}

	// The plain template by default, with a BOS.
	ts2, _ := newServer(t, server.Config{Generator: gen})
	if status, body := post(t, ts2.URL+"/v1/chat/completions", `{"messages": [{"role": "user", "content": "Hi"}]}`); status != 200 {
		t.Fatalf("status %d: %s", status, body)
	}
	reqs := gen.Requests()
	ids = reqs[len(reqs)-1].InputIDs
	if ids[0] != servertest.BOS || (servertest.Tokenizer{}).Decode(ids) != "user: Hi\nassistant:" {
		t.Fatalf("plain template prompt %q", servertest.Tokenizer{}.Decode(ids))
	}
}

func TestClientDisconnectAborts(t *testing.T) {
	hold := make(chan struct{})
	defer close(hold)
	gen := &servertest.Generator{Hold: hold}
	ts, _ := newServer(t, server.Config{Generator: gen})
	for _, body := range []string{`{"text": "Hi"}`, `{"text": "Hi", "stream": true}`} {
		ctx, cancel := context.WithCancel(context.Background())
		submitted := len(gen.Requests())
		req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL+"/generate", strings.NewReader(body))
		done := make(chan error, 1)
		go func() {
			resp, err := http.DefaultClient.Do(req)
			if err == nil {
				resp.Body.Close()
			}
			done <- err
		}()
		before := gen.Aborted()
		waitFor(t, func() bool { return len(gen.Requests()) == submitted+1 })
		cancel()
		<-done
		waitFor(t, func() bool { return gen.Aborted() == before+1 })
	}
}

// waitFor polls cond for up to 5 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 5s")
		}
		time.Sleep(time.Millisecond)
	}
}

func TestPrepareDisagg(t *testing.T) {
	gen := &servertest.Generator{}
	var got []server.Bootstrap
	prep := func(ctx context.Context, req *engine.Request, b server.Bootstrap) error {
		got = append(got, b)
		if b.Host == "fail" {
			return &server.Error{Status: http.StatusBadGateway, Message: "bootstrap server unreachable"}
		}
		if req.Room != b.Room {
			return errors.New("room not set")
		}
		return nil
	}
	// Fields by hand, and a direct request: as behind another router.
	ts, _ := newServer(t, server.Config{Generator: gen, Mode: server.ModeDecode, PrepareDisagg: prep,
		Vouchers: server.VoucherPolicy{AllowUnsigned: true, AllowDirect: true}})
	body := `{"text": "Hi", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 9223372036854775807}`
	if status, b := post(t, ts.URL+"/generate", body); status != 200 {
		t.Fatalf("status %d: %s", status, b)
	}
	if status, b := post(t, ts.URL+"/v1/completions", `{"prompt": "Hi", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}`); status != 200 {
		t.Fatalf("status %d: %s", status, b)
	}
	if status, b := post(t, ts.URL+"/generate", `{"text": "Hi"}`); status != 200 {
		t.Fatalf("status %d: %s", status, b)
	}
	status, b := post(t, ts.URL+"/generate", `{"text": "Hi", "bootstrap_host": "fail", "bootstrap_room": 1}`)
	checkError(t, status, b, 502, "unreachable")
	want := []server.Bootstrap{{"10.0.0.1", 8998, 9223372036854775807}, {"h", 1, 5}, {"fail", 0, 1}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("bootstraps %v, want %v", got, want)
	}
	if r := gen.Requests()[0]; r.Room != 9223372036854775807 {
		t.Fatalf("room %d", r.Room)
	}
}

func TestInfoEndpoints(t *testing.T) {
	reg := prometheus.NewRegistry()
	core, logs := observer.New(zap.InfoLevel)
	ts, _ := newServer(t, server.Config{
		ModelName: "served", ModelPath: "/m/stories", RandomWeights: true, ContextLen: 512, Mode: server.ModePrefill,
		Vouchers: server.VoucherPolicy{AllowUnsigned: true, AllowDirect: true}, // direct /generate below
		Info:     func() map[string]any { return map[string]any{"bootstrap_port": 8998} },
		Gatherer: reg, Registerer: reg, Logger: zap.New(core),
	})
	status, body := get(t, ts.URL+"/get_model_info")
	var mi map[string]any
	_ = json.Unmarshal(body, &mi)
	if status != 200 || mi["model_path"] != "/m/stories" || mi["random_weights"] != true || mi["is_generation"] != true {
		t.Fatalf("model info %d %s", status, body)
	}
	status, body = get(t, ts.URL+"/get_server_info")
	var si map[string]any
	_ = json.Unmarshal(body, &si)
	if status != 200 || si["disaggregation_mode"] != "prefill" || si["bootstrap_port"] != float64(8998) {
		t.Fatalf("server info %d %s", status, body)
	}
	status, body = get(t, ts.URL+"/v1/models")
	if status != 200 || !strings.Contains(string(body), `"id":"served"`) || !strings.Contains(string(body), `"object":"list"`) {
		t.Fatalf("models %d %s", status, body)
	}
	if status, body = get(t, ts.URL+"/v1/models/served"); status != 200 {
		t.Fatalf("model %d %s", status, body)
	}
	if status, body = get(t, ts.URL+"/health_generate"); status != 200 {
		t.Fatalf("health_generate %d %s", status, body)
	}
	if status, body = get(t, ts.URL+"/health"); status != 200 {
		t.Fatalf("health %d %s", status, body)
	}
	if status, body := post(t, ts.URL+"/generate", `{"text": "Hi", "rid": "log-me", "sampling_params": {"max_new_tokens": 3}}`); status != 200 {
		t.Fatalf("generate %d %s", status, body)
	}
	_, _ = post(t, ts.URL+"/generate", `{"text": ""}`)
	status, body = get(t, ts.URL+"/metrics")
	for _, want := range []string{"mooncake_server_ttft_seconds_count 1", "mooncake_server_e2e_seconds_count 1",
		`mooncake_server_requests_total{code="200",endpoint="generate"} 1`, `mooncake_server_requests_total{code="400",endpoint="generate"} 1`} {
		if !strings.Contains(string(body), want) {
			t.Fatalf("/metrics lacks %q:\n%s", want, body)
		}
	}
	// One log line per request, with rid, room, status, tokens and latency.
	entries := logs.FilterMessage("request").All()
	if len(entries) != 2 {
		t.Fatalf("%d request log lines, want 2", len(entries))
	}
	f := entries[0].ContextMap()
	if f["rid"] != "log-me" || f["status"] != int64(200) || f["completion_tokens"] != int64(3) || f["room"] != uint64(0) || f["latency"] == nil {
		t.Fatalf("log fields %v", f)
	}
	if f := entries[1].ContextMap(); f["status"] != int64(400) {
		t.Fatalf("log fields %v", f)
	}
}

func TestConfigValidate(t *testing.T) {
	cfgs := []server.Config{
		{Tokenizer: servertest.Tokenizer{}},
		{Generator: &servertest.Generator{}},
		{Generator: &servertest.Generator{}, Tokenizer: servertest.Tokenizer{}, Mode: "both"},
		{Generator: &servertest.Generator{}, Tokenizer: servertest.Tokenizer{}, ContextLen: -1},
	}
	for _, cfg := range cfgs {
		if _, err := server.New(cfg); err == nil {
			t.Errorf("New(%+v) succeeded", cfg)
		}
	}
}

func TestServeShutdown(t *testing.T) {
	s, err := server.New(server.Config{Generator: &servertest.Generator{}, Tokenizer: servertest.Tokenizer{}})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	url := "http://" + ln.Addr().String()
	if status, body := post(t, url+"/generate", `{"text": "Hi"}`); status != 200 {
		t.Fatalf("status %d: %s", status, body)
	}
	http.DefaultClient.CloseIdleConnections()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := http.Get(url + "/health"); err == nil {
		t.Fatal("still serving after shutdown")
	}
}

// TestTopLogprobs: every API returns the asked number of most likely tokens
// per output token, in the engine's order, with the engine's values.
func TestTopLogprobs(t *testing.T) {
	gen := &servertest.Generator{}
	ts, _ := newServer(t, server.Config{Generator: gen})
	// /generate: meta_info.output_top_logprobs, [logprob, id, null] each.
	status, body := post(t, ts.URL+"/generate", `{"text": "Hi", "return_logprob": true, "top_logprobs_num": 3,
		"sampling_params": {"max_new_tokens": 2}}`)
	var g struct {
		MetaInfo struct {
			OutputTopLogprobs [][][3]any `json:"output_top_logprobs"`
		} `json:"meta_info"`
	}
	if err := json.Unmarshal(body, &g); status != 200 || err != nil {
		t.Fatalf("status %d %v: %s", status, err, body)
	}
	if tl := g.MetaInfo.OutputTopLogprobs; len(tl) != 2 || len(tl[0]) != 3 ||
		fmt.Sprint(tl[0]) != fmt.Sprint([][3]any{{-0.5, float64('H'), nil}, {-1.0, float64('H' + 1), nil}, {-2.0, float64('H' + 2), nil}}) {
		t.Fatalf("output_top_logprobs %v", g.MetaInfo.OutputTopLogprobs)
	}
	if r := gen.Requests(); r[len(r)-1].TopLogprobs != 3 {
		t.Fatalf("engine request TopLogprobs %d", r[len(r)-1].TopLogprobs)
	}
	// Without return_logprob there is no list, and the engine is not asked.
	post(t, ts.URL+"/generate", `{"text": "Hi", "top_logprobs_num": 3, "sampling_params": {"max_new_tokens": 1}}`)
	if r := gen.Requests(); r[len(r)-1].TopLogprobs != 0 {
		t.Fatalf("top logprobs asked for without return_logprob")
	}
	// Completions: logprobs N, a map of N token texts.
	status, body = post(t, ts.URL+"/v1/completions", `{"prompt": "Hi", "max_tokens": 2, "logprobs": 3}`)
	var c struct {
		Choices []struct {
			Logprobs struct {
				TopLogprobs []map[string]float64 `json:"top_logprobs"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &c); status != 200 || err != nil {
		t.Fatalf("status %d %v: %s", status, err, body)
	}
	if tl := c.Choices[0].Logprobs.TopLogprobs; len(tl) != 2 || len(tl[0]) != 3 || tl[0]["H"] != -0.5 || tl[0]["I"] != -1 || tl[0]["J"] != -2 {
		t.Fatalf("completion top_logprobs %v", c.Choices[0].Logprobs.TopLogprobs)
	}
	// Chat: top_logprobs N entries of {token, logprob, bytes}.
	status, body = post(t, ts.URL+"/v1/chat/completions", `{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
		"logprobs": true, "top_logprobs": 4}`)
	if status != 200 || !strings.Contains(string(body), `"top_logprobs":[{"token":"H","logprob":-0.5,"bytes":[72]},{"token":"I","logprob":-1,"bytes":[73]},{"token":"J","logprob":-2,"bytes":[74]},{"token":"K","logprob":-3,"bytes":[75]}]`) {
		t.Fatalf("chat top_logprobs: %d %s", status, body)
	}
	// Out of range.
	if status, body := post(t, ts.URL+"/generate", `{"text": "Hi", "return_logprob": true, "top_logprobs_num": 21}`); status != 400 ||
		!strings.Contains(string(body), "top_logprobs_num") {
		t.Fatalf("top_logprobs_num 21: %d %s", status, body)
	}
}
