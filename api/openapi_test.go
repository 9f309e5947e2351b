// Package api_test checks api/openapi.yaml against a running server: every
// request it sends and every response the server gives (stream events included)
// must match the document, and every path of the document must be exercised.
package api_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/legacy"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/internal/lb"
	"github.com/mooncake-go/mooncake-go/internal/lb/lbtest"
)

func loadDoc(t *testing.T) *openapi3.T {
	t.Helper()
	doc, err := openapi3.NewLoader().LoadFromFile("openapi.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := doc.Validate(context.Background()); err != nil {
		t.Fatalf("openapi.yaml is not a valid OpenAPI 3 document: %v", err)
	}
	return doc
}

// realServer is a server over the real engine (the built-in random-weight model on
// the CPU backend, with a prefix cache).
func realServer(t *testing.T) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(lbtest.Server(t, map[string]any{"tp_size": 1}))
	t.Cleanup(ts.Close)
	return ts
}

// check sends one request and validates it and its response (each event of a
// stream against the operation's x-event-schema).
func check(t *testing.T, doc *openapi3.T, router routers.Router, base, method, path, body string, wantStatus int) {
	t.Helper()
	req, _ := http.NewRequest(method, base+path, strings.NewReader(body))
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	route, params, err := router.FindRoute(req)
	if err != nil {
		t.Fatalf("%s %s: not in openapi.yaml: %v", method, path, err)
	}
	in := &openapi3filter.RequestValidationInput{Request: req, PathParams: params, Route: route,
		Options: &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc}}
	if err := openapi3filter.ValidateRequest(context.Background(), in); err != nil {
		t.Fatalf("%s %s %s: the request does not match openapi.yaml: %v", method, path, body, err)
	}
	// ValidateRequest read the body: send a fresh one.
	sent, _ := http.NewRequest(method, base+path, strings.NewReader(body))
	sent.Header = req.Header
	resp, err := http.DefaultClient.Do(sent)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != wantStatus {
		t.Fatalf("%s %s %s: status %d, want %d: %s", method, path, body, resp.StatusCode, wantStatus, raw)
	}
	out := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: resp.StatusCode, Header: resp.Header,
		Body: io.NopCloser(bytes.NewReader(raw)), Options: &openapi3filter.Options{IncludeResponseStatus: true}}
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		t.Fatalf("%s %s %s: the response does not match openapi.yaml: %v\n%s", method, path, body, err, raw)
	}
	if ct := resp.Header.Get("Content-Type"); strings.HasPrefix(ct, "text/event-stream") {
		name, _ := route.Operation.Responses.Status(200).Value.Content.Get("text/event-stream").Extensions["x-event-schema"].(string)
		schema := doc.Components.Schemas[name]
		if schema == nil {
			t.Fatalf("%s: no x-event-schema for its stream", path)
		}
		events := 0
		sc := bufio.NewScanner(bytes.NewReader(raw))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok || data == "[DONE]" {
				continue
			}
			var v any
			if err := json.Unmarshal([]byte(data), &v); err != nil {
				t.Fatal(err)
			}
			if err := schema.Value.VisitJSON(v); err != nil {
				t.Fatalf("%s %s: a stream event does not match %s: %v\n%s", path, body, name, err, data)
			}
			events++
		}
		if events == 0 || !strings.HasSuffix(strings.TrimSpace(string(raw)), "data: [DONE]") {
			t.Fatalf("%s: stream of %d events: %s", path, events, raw)
		}
	}
}

// apiCall is one request and the status it must get.
type apiCall struct {
	method, path, body string
	status             int
}

// exercise makes each call against url, validating request and answer
// against openapi.yaml, and returns the document and the paths exercised.
func exercise(t *testing.T, url string, calls []apiCall) (*openapi3.T, map[string]bool) {
	t.Helper()
	openapi3filter.RegisterBodyDecoder("text/event-stream", func(r io.Reader, _ http.Header, _ *openapi3.SchemaRef, _ openapi3filter.EncodingFn) (any, error) {
		b, err := io.ReadAll(r)
		return string(b), err
	})
	defer openapi3filter.UnregisterBodyDecoder("text/event-stream")
	doc := loadDoc(t)
	router, err := legacy.NewRouter(doc)
	if err != nil {
		t.Fatal(err)
	}
	covered := map[string]bool{}
	for _, c := range calls {
		check(t, doc, router, url, c.method, c.path, c.body, c.status)
		route, _, _ := router.FindRoute(httptest.NewRequest(c.method, c.path, nil))
		covered[route.Path] = true
	}
	return doc, covered
}

// TestOpenAPI validates real responses of a server over the real engine.
func TestOpenAPI(t *testing.T) {
	ts := realServer(t)
	doc, covered := exercise(t, ts.URL, []apiCall{
		{"POST", "/generate", `{"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}`, 200},
		{"POST", "/generate", `{"text": ["a", "b"], "return_logprob": true, "top_logprobs_num": 2, "return_text_in_logprobs": true, "sampling_params": {"max_new_tokens": 3}}`, 200},
		{"POST", "/generate", `{"input_ids": [[1, 2, 3], [4, 5]], "rid": ["x", "y"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "n": 1}]}`, 200},
		{"POST", "/generate", `{"text": "hello", "sampling_params": {"n": 3, "max_new_tokens": 2, "seed": 5}}`, 200},
		{"POST", "/generate", `{"text": "hello", "stream": true, "sampling_params": {"max_new_tokens": 3}}`, 200},
		{"POST", "/generate", `{"text": ["a", "b"], "stream": true, "return_logprob": true, "sampling_params": {"max_new_tokens": 3, "n": 2}}`, 200},
		{"POST", "/generate", `{"text": "a", "return_logprob": true, "logprob_start_len": 0}`, 400},
		{"POST", "/v1/completions", `{"prompt": "Once", "max_tokens": 3, "logprobs": 2}`, 200},
		{"POST", "/v1/completions", `{"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 2}`, 200},
		{"POST", "/v1/completions", `{"prompt": ["a", "b"], "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}`, 200},
		{"POST", "/v1/completions", `{"prompt": "a", "model": "gpt-4"}`, 404},
		{"POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": true, "top_logprobs": 2}`, 200},
		{"POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}`, 200},
		{"POST", "/v1/chat/completions", `{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3, "stream": true, "n": 2, "stream_options": {"include_usage": true}}`, 200},
		{"GET", "/v1/models", "", 200},
		{"GET", "/v1/models/builtin", "", 200},
		{"GET", "/v1/models/nope", "", 404},
		{"GET", "/health", "", 200},
		{"GET", "/health_generate", "", 200},
		{"GET", "/get_model_info", "", 200},
		{"GET", "/get_server_info", "", 200},
		{"GET", "/server_info", "", 200},
		{"GET", "/get_server_args", "", 200},
		{"POST", "/tokenize", `{"prompt": "hello"}`, 200},
		{"POST", "/v1/tokenize", `{"prompt": ["hello", "there"], "add_special_tokens": false}`, 200},
		{"POST", "/detokenize", `{"tokens": [104, 105]}`, 200},
		{"POST", "/v1/detokenize", `{"tokens": [[104], [105]]}`, 200},
		{"POST", "/abort_request", `{"rid": "not-running"}`, 200},
		{"POST", "/flush_cache", "", 200},
		{"GET", "/metrics", "", 200},
	})
	for _, p := range doc.Paths.InMatchingOrder() {
		if !covered[p] {
			t.Errorf("openapi.yaml's %s is never exercised", p)
		}
	}
}

// realLB is a load balancer over a real prefill and decode (lbtest).
func realLB(t *testing.T) *httptest.Server {
	t.Helper()
	srv := lbtest.Start(t)
	reg := prometheus.NewRegistry()
	l, err := lb.New(lb.Config{Prefill: []string{srv.Prefill}, Decode: []string{srv.Decode}, HealthInterval: 50 * time.Millisecond,
		MaxBatch: 16, Registerer: reg, Gatherer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Run(ctx); close(done) }()
	ts := httptest.NewServer(l.Handler())
	t.Cleanup(func() { ts.Close(); cancel(); <-done })
	for deadline := time.Now().Add(10 * time.Second); ; {
		resp, err := http.Get(ts.URL + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return ts
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the LB has no healthy pair")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestOpenAPILB validates the load balancer's answers, over a real prefill and
// decode, against the operations marked x-lb: every one is exercised.
func TestOpenAPILB(t *testing.T) {
	ts := realLB(t)
	doc, covered := exercise(t, ts.URL, []apiCall{
		{"POST", "/generate", `{"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}`, 200},
		{"POST", "/generate", `{"text": ["a", "b"], "return_logprob": true, "top_logprobs_num": 2, "return_text_in_logprobs": true, "sampling_params": {"max_new_tokens": 3}}`, 200},
		{"POST", "/generate", `{"input_ids": [[1, 2, 3], [4, 5]], "rid": ["x", "y"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "n": 1}]}`, 200},
		{"POST", "/generate", `{"text": "hello", "sampling_params": {"n": 3, "max_new_tokens": 2, "seed": 5}}`, 200},
		{"POST", "/generate", `{"text": ["a", "b"], "stream": true, "return_logprob": true, "sampling_params": {"max_new_tokens": 3, "n": 2}}`, 200},
		{"POST", "/generate", `{"text": ["a", "b"], "sampling_params": {"n": 9}}`, 400},
		{"POST", "/v1/completions", `{"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 2}`, 200},
		{"POST", "/v1/completions", `{"prompt": ["a", "b"], "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}`, 200},
		{"POST", "/v1/completions", `{"prompt": ["a", "b"], "model": "gpt-4"}`, 404},
		{"POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}`, 200},
		{"POST", "/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true, "n": 2, "stream_options": {"include_usage": true}}`, 200},
		{"GET", "/v1/models", "", 200},
		{"GET", "/v1/models/builtin", "", 200},
		{"GET", "/health", "", 200},
		{"GET", "/health_generate", "", 200},
		{"GET", "/get_model_info", "", 200},
		{"GET", "/get_server_info", "", 200},
		{"GET", "/server_info", "", 200},
		{"POST", "/flush_cache", "", 200},
		{"GET", "/metrics", "", 200},
	})
	for p, item := range doc.Paths.Map() {
		for _, op := range item.Operations() {
			if lbOp, _ := op.Extensions["x-lb"].(bool); lbOp != covered[p] {
				t.Errorf("openapi.yaml's %s: x-lb %v, exercised through the LB %v", p, lbOp, covered[p])
			}
		}
	}
}

// TestOpenAPIRefusesDrift: the document is strict enough to catch a response field
// it does not describe.
func TestOpenAPIRefusesDrift(t *testing.T) {
	doc := loadDoc(t)
	err := doc.Components.Schemas["GenerateResponse"].Value.VisitJSON(map[string]any{"text": "", "output_ids": []any{},
		"meta_info": map[string]any{"id": "x", "finish_reason": nil, "prompt_tokens": 1.0, "completion_tokens": 0.0, "cached_tokens": 0.0, "e2e_latency": 0.0},
		"surprise":  true})
	var se *openapi3.SchemaError
	if !errors.As(err, &se) {
		t.Fatalf("an undocumented field passes: %v", err)
	}
}
