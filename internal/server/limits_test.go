package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/server/servertest"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// serveReal runs cfg's server with Serve on a loopback listener (the http.Server's
// timeouts apply, unlike under httptest) and returns its address.
func serveReal(t *testing.T, cfg server.Config) string {
	t.Helper()
	if cfg.Generator == nil {
		cfg.Generator = &servertest.Generator{}
	}
	if cfg.Tokenizer == nil {
		cfg.Tokenizer = servertest.Tokenizer{}
	}
	s, err := server.New(cfg)
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
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return ln.Addr().String()
}

// readUntilClosed reads conn until the server closes it (or within passes) and returns
// what came and when the end came.
func readUntilClosed(t *testing.T, conn net.Conn, within time.Duration) (string, time.Duration) {
	t.Helper()
	start := time.Now()
	conn.SetReadDeadline(start.Add(within))
	b, err := io.ReadAll(conn)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("connection still open after %v (read %q)", within, b)
	}
	return string(b), time.Since(start)
}

// TestReadTimeout: a request that does not arrive whole within the read timeout is
// answered 408 (body) or dropped (headers), and its connection closed; a response that
// takes longer than the read timeout is not cut.
func TestReadTimeout(t *testing.T) {
	const rt = 300 * time.Millisecond
	hold := make(chan struct{})
	addr := serveReal(t, server.Config{ReadTimeout: rt, Generator: &servertest.Generator{Hold: hold}})

	t.Run("stalled body", func(t *testing.T) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"text\": \"")
		out, took := readUntilClosed(t, conn, 10*rt)
		if !strings.HasPrefix(out, "HTTP/1.1 408") || !strings.Contains(out, "read timeout") {
			t.Fatalf("answer %q", out)
		}
		if took < rt/2 {
			t.Fatalf("closed after %v, before the read timeout", took)
		}
	})
	t.Run("stalled headers", func(t *testing.T) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST /generate HTTP/1.1\r\nHost: x\r\n")
		if out, _ := readUntilClosed(t, conn, 10*rt); strings.HasPrefix(out, "HTTP/1.1 200") {
			t.Fatalf("answer %q", out)
		}
	})
	t.Run("long responses", func(t *testing.T) {
		// Released after several read timeouts: the answers must still come whole.
		time.AfterFunc(4*rt, func() { close(hold) })
		client := &http.Client{Timeout: 20 * rt}
		defer client.CloseIdleConnections()
		type answer struct {
			what string
			code int
			body string
			err  error
		}
		answers := make(chan answer, 3)
		for _, q := range []struct{ what, method, path, body string }{
			{"generate", "POST", "/generate", `{"text": "a", "sampling_params": {"max_new_tokens": 3}}`},
			{"stream", "POST", "/generate", `{"text": "a", "stream": true, "sampling_params": {"max_new_tokens": 3}}`},
			{"health_generate", "GET", "/health_generate", ""},
		} {
			go func() {
				req, _ := http.NewRequest(q.method, "http://"+addr+q.path, strings.NewReader(q.body))
				resp, err := client.Do(req)
				if err != nil {
					answers <- answer{q.what, 0, "", err}
					return
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				answers <- answer{q.what, resp.StatusCode, string(b), err}
			}()
		}
		for range 3 {
			a := <-answers
			if a.err != nil || a.code != 200 {
				t.Fatalf("%s: %d %q %v", a.what, a.code, a.body, a.err)
			}
			if a.what == "stream" && !strings.HasSuffix(a.body, "data: [DONE]\n\n") {
				t.Fatalf("stream cut: %q", a.body)
			}
		}
		// The connections are reused: the next request on one gets a fresh deadline.
		if resp, err := client.Post("http://"+addr+"/generate", "application/json", strings.NewReader(`{"text": "b"}`)); err != nil || resp.StatusCode != 200 {
			t.Fatalf("after: %v %v", resp, err)
		} else {
			resp.Body.Close()
		}
	})
}

// TestPromptTooLong: a prompt that cannot fit the context by its length is refused
// before tokenization, on every endpoint, naming the field; one that passes the length
// check is refused once the tokenizer passes the context.
func TestPromptTooLong(t *testing.T) {
	ts, _ := newServer(t, server.Config{Tokenizer: tokenizer.NewByteLevel(), ContextLen: 4096})
	big := strings.Repeat("x", 8<<20-200)
	for _, c := range []struct{ path, body, param string }{
		{"/generate", `{"text": "` + big + `"}`, "text"},
		{"/v1/completions", `{"prompt": "` + big + `"}`, "prompt"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "` + big + `"}]}`, "messages"},
	} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		start := time.Now()
		status, body := post(t, ts.URL+c.path, c.body)
		took := time.Since(start)
		runtime.ReadMemStats(&after)
		checkError(t, status, body, 400, "is longer than the model's context length (4096 tokens)")
		if p := errParam(t, body); p != c.param || !strings.Contains(string(body), "bytes: at least") {
			t.Fatalf("%s: param %q: %s", c.path, p, body)
		}
		alloc := after.TotalAlloc - before.TotalAlloc
		t.Logf("%s: %v, %d MiB allocated (both sides)", c.path, took, alloc>>20)
		if alloc > 128<<20 || took > 5*time.Second {
			t.Fatalf("%s: %v, %d MiB allocated", c.path, took, alloc>>20)
		}
	}
	// Under the length bound, but past the context once tokenized.
	ts2, _ := newServer(t, server.Config{Tokenizer: wordTokenizer{}, ContextLen: 8})
	status, body := post(t, ts2.URL+"/generate", `{"text": "a b c d e f g h i j"}`)
	checkError(t, status, body, 400, "the prompt (at least 8 tokens) is longer than the model's context length (8 tokens)")
	// A word the tokenizer does not merge.
	status, body = post(t, ts2.URL+"/v1/completions", `{"prompt": "a `+strings.Repeat("z", 100)+`"}`)
	checkError(t, status, body, 400, "a word of 100 bytes")
	if p := errParam(t, body); p != "prompt" {
		t.Fatalf("param %q", p)
	}
}

// wordTokenizer is one id per space-separated word, with no length bound.
type wordTokenizer struct{ servertest.Tokenizer }

func (w wordTokenizer) EncodeLimit(text string, addBOS bool, limit int) ([]int, error) {
	var ids []int
	for _, f := range strings.Fields(text) {
		if len(f) > 64 {
			return nil, &tokenizer.WordTooLongError{Bytes: len(f), Limit: 64}
		}
		ids = append(ids, 'w')
		if limit >= 0 && len(ids) > limit {
			return nil, &tokenizer.TooLongError{Limit: limit, Tokens: len(ids), Bytes: len(text)}
		}
	}
	return ids, nil
}

func errParam(t *testing.T, body []byte) string {
	t.Helper()
	var e struct {
		Error struct {
			Param *string `json:"param"`
		} `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	if e.Error.Param == nil {
		return ""
	}
	return *e.Error.Param
}

// TestFieldInventory: every known field we do not implement is refused naming it,
// unless it holds its default; informational fields are accepted.
func TestFieldInventory(t *testing.T) {
	ts, _ := newServer(t, server.Config{})
	gen := func(extra string) string { return `{"text": "a", ` + extra + `}` }
	samp := func(extra string) string { return `{"text": "a", "sampling_params": {` + extra + `}}` }
	cmpl := func(extra string) string { return `{"prompt": "a", ` + extra + `}` }
	chat := func(extra string) string { return `{"messages": [{"role": "user", "content": "a"}], ` + extra + `}` }
	msg := func(extra string) string { return `{"messages": [{"role": "user", "content": "a", ` + extra + `}]}` }
	refused := []struct{ path, body, param string }{
		{"/generate", samp(`"json_schema": "{}"`), "sampling_params.json_schema"},
		{"/generate", samp(`"regex": "a+"`), "sampling_params.regex"},
		{"/generate", samp(`"ebnf": "root ::= \"a\""`), "sampling_params.ebnf"},
		{"/generate", samp(`"structural_tag": "{}"`), "sampling_params.structural_tag"},
		{"/generate", samp(`"stop_regex": "x"`), "sampling_params.stop_regex"},
		{"/generate", samp(`"min_new_tokens": 3`), "sampling_params.min_new_tokens"},
		{"/generate", samp(`"skip_special_tokens": false`), "sampling_params.skip_special_tokens"},
		{"/generate", samp(`"no_stop_trim": true`), "sampling_params.no_stop_trim"},
		{"/generate", samp(`"custom_params": {"a": 1}`), "sampling_params.custom_params"},
		{"/generate", gen(`"lora_path": "x"`), "lora_path"},
		{"/generate", gen(`"image_data": "x.png"`), "image_data"},
		{"/generate", gen(`"audio_data": "x.wav"`), "audio_data"},
		{"/generate", gen(`"return_hidden_states": true`), "return_hidden_states"},
		{"/generate", gen(`"custom_logit_processor": "x"`), "custom_logit_processor"},
		{"/generate", gen(`"input_embeds": [[0.5]]`), "input_embeds"},
		{"/generate", gen(`"return_logprob": true, "logprob_start_len": 0`), "logprob_start_len"},
		{"/generate", gen(`"session_params": {"id": "s"}`), "session_params"},
		{"/v1/completions", cmpl(`"best_of": 2`), "best_of"},
		{"/v1/completions", cmpl(`"echo": true`), "echo"},
		{"/v1/completions", cmpl(`"suffix": "z"`), "suffix"},
		{"/v1/completions", cmpl(`"regex": "a"`), "regex"},
		{"/v1/completions", cmpl(`"stream_options": {"continuous_usage_stats": true}`), "stream_options.continuous_usage_stats"},
		{"/v1/chat/completions", chat(`"response_format": {"type": "json_object"}`), "response_format"},
		{"/v1/chat/completions", chat(`"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}`), "response_format"},
		{"/v1/chat/completions", chat(`"tools": [{"type": "function", "function": {"name": "f"}}]`), "tools"},
		{"/v1/chat/completions", chat(`"tool_choice": "required"`), "tool_choice"},
		{"/v1/chat/completions", chat(`"functions": [{"name": "f"}]`), "functions"},
		{"/v1/chat/completions", chat(`"audio": {"voice": "x"}`), "audio"},
		{"/v1/chat/completions", chat(`"json_schema": "{}"`), "json_schema"},
		{"/v1/chat/completions", chat(`"lora_path": "x"`), "lora_path"},
		{"/v1/chat/completions", msg(`"tool_calls": [{"id": "c"}]`), "messages[0].tool_calls"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}`, "messages[0].content[0].image_url"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]}`, "messages[0].content[0].type"},
	}
	for _, c := range refused {
		status, body := post(t, ts.URL+c.path, c.body)
		checkError(t, status, body, 400, c.param)
		if p := errParam(t, body); p != c.param || !strings.Contains(string(body), "not supported") {
			t.Errorf("%s %s: param %q: %s", c.path, c.body, p, body)
		}
	}
	// chat_template_kwargs is honoured (TestChatTemplateKwargs), but must be an
	// object and may not redefine the server's own template variables.
	for _, c := range []struct{ body, param string }{
		{chat(`"chat_template_kwargs": {"enable_thinking": false, "messages": []}`), "chat_template_kwargs.messages"},
		{chat(`"chat_template_kwargs": {"add_generation_prompt": false}`), "chat_template_kwargs.add_generation_prompt"},
		{chat(`"chat_template_kwargs": [true]`), "chat_template_kwargs"},
	} {
		status, body := post(t, ts.URL+"/v1/chat/completions", c.body)
		checkError(t, status, body, 400, c.param)
	}
	accepted := []struct{ path, body string }{
		{"/v1/chat/completions", chat(`"chat_template_kwargs": {"enable_thinking": false}`)},
		{"/v1/chat/completions", chat(`"chat_template_kwargs": null`)},
		{"/generate", samp(`"skip_special_tokens": true, "spaces_between_special_tokens": false, "min_new_tokens": 0, "no_stop_trim": false, "stream_interval": 4, "json_schema": null`)},
		{"/generate", gen(`"return_hidden_states": false, "logprob_start_len": -1, "session_id": "s", "log_metrics": true, "lora_path": null`)},
		{"/v1/completions", cmpl(`"best_of": 1, "echo": false, "suffix": "", "user": "u", "stream_options": {"include_usage": false, "include_obfuscation": true}`)},
		{"/v1/chat/completions", chat(`"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "parallel_tool_calls": false, "user": "u", "metadata": {"k": "v"}, "store": false, "service_tier": "auto"`)},
		{"/v1/chat/completions", msg(`"name": "bob", "tool_calls": [], "refusal": null`)},
	}
	for _, c := range accepted {
		if status, body := post(t, ts.URL+c.path, c.body); status != 200 {
			t.Errorf("%s %s: %d %s", c.path, c.body, status, body)
		}
	}
}

// TestInputIDsTypes: input_ids must be integers (or a batch: a list of lists of them);
// anything else is refused naming input_ids.
func TestInputIDsTypes(t *testing.T) {
	gen := &servertest.Generator{}
	ts, _ := newServer(t, server.Config{Generator: gen})
	for _, ids := range []string{`["a"]`, `[1.5]`, `[1, "2"]`, `[[1, "a"]]`, `[["a"]]`, `[true]`, `[null]`, `[{"a": 1}]`, `"1 2"`, `{"0": 1}`, `[[[1]]]`, `[[1], ["a"]]`, `[[1], 2]`, `[1e40]`} {
		status, body := post(t, ts.URL+"/generate", `{"input_ids": `+ids+`}`)
		if status != 400 || errParam(t, body) != "input_ids" {
			t.Errorf("input_ids %s: %d %s", ids, status, body)
		}
	}
	for _, ids := range []string{`[72, 105]`, `[[72, 105]]`} {
		if status, body := post(t, ts.URL+"/generate", `{"input_ids": `+ids+`, "sampling_params": {"max_new_tokens": 1}}`); status != 200 {
			t.Errorf("input_ids %s: %d %s", ids, status, body)
		}
		if r := gen.Requests(); fmt.Sprint(r[len(r)-1].InputIDs) != "[72 105]" {
			t.Errorf("input_ids %s: engine got %v", ids, r[len(r)-1].InputIDs)
		}
	}
	// text takes no ids, prompt takes both.
	if status, body := post(t, ts.URL+"/generate", `{"text": [1, 2]}`); status != 400 || errParam(t, body) != "text" {
		t.Errorf("text ids: %d %s", status, body)
	}
	if status, body := post(t, ts.URL+"/v1/completions", `{"prompt": [["a"]]}`); status != 400 || errParam(t, body) != "prompt" {
		t.Errorf("prompt [[\"a\"]]: %d %s", status, body)
	}
}

// TestRetryAfter: every 503 (overloaded, closing, not ready) tells when to retry.
func TestRetryAfter(t *testing.T) {
	for _, err := range []error{fmt.Errorf("%w: 1024 requests queued (max 1024)", engine.ErrOverloaded), engine.ErrClosed} {
		ts, _ := newServer(t, server.Config{Generator: &servertest.Generator{Err: err}})
		for _, p := range []struct{ path, body string }{
			{"/generate", `{"text": "a"}`},
			{"/generate", `{"text": "a", "stream": true}`},
			{"/v1/completions", `{"prompt": "a"}`},
			{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}]}`},
		} {
			resp, e := http.Post(ts.URL+p.path, "application/json", strings.NewReader(p.body))
			if e != nil {
				t.Fatal(e)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			checkError(t, resp.StatusCode, b, 503, err.Error())
			if resp.Header.Get("Retry-After") == "" {
				t.Errorf("%s: 503 without Retry-After", p.path)
			}
		}
	}
	var ready atomic.Bool
	ts, _ := newServer(t, server.Config{Ready: ready.Load})
	for _, req := range []struct{ method, path string }{{"GET", "/health"}, {"GET", "/health_generate"}, {"POST", "/generate"}, {"POST", "/v1/completions"}} {
		r, _ := http.NewRequest(req.method, ts.URL+req.path, strings.NewReader(`{"text": "a"}`))
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
			t.Errorf("%s not ready: %d, Retry-After %q", req.path, resp.StatusCode, resp.Header.Get("Retry-After"))
		}
	}
}

// TestTextInLogprobs: return_text_in_logprobs fills the third element of each triple.
func TestTextInLogprobs(t *testing.T) {
	ts, _ := newServer(t, server.Config{})
	status, body := post(t, ts.URL+"/generate", `{"text": "Hi", "return_logprob": true, "return_text_in_logprobs": true,
		"top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2}}`)
	var g struct {
		MetaInfo struct {
			Tokens [][3]any   `json:"output_token_logprobs"`
			Top    [][][3]any `json:"output_top_logprobs"`
		} `json:"meta_info"`
	}
	if err := json.Unmarshal(body, &g); status != 200 || err != nil {
		t.Fatalf("%d %v %s", status, err, body)
	}
	if fmt.Sprint(g.MetaInfo.Tokens) != "[[-0.5 72 H] [-0.5 101 e]]" || fmt.Sprint(g.MetaInfo.Top[1]) != "[[-0.5 101 e] [-1 102 f]]" {
		t.Fatalf("logprobs %v %v", g.MetaInfo.Tokens, g.MetaInfo.Top)
	}
}
