package server_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/server/servertest"
)

// fuzzMaxInput caps fuzz inputs: larger bodies only exercise the 413 path.
const fuzzMaxInput = 16 << 10

// fuzzEndpoint runs the whole request path (body limit, decoder, checks,
// tokenization, a fake generation, the response writer) on arbitrary bodies.
// Every answer must be a 200 or a well-formed 4xx error; nothing may panic.
// Seeds are in testdata/fuzz/<name>/ and below.
func fuzzEndpoint(f *testing.F, path string, seeds []string) {
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	s, err := server.New(server.Config{
		Generator:    &servertest.Generator{},
		Tokenizer:    servertest.Tokenizer{},
		ModelName:    testModel,
		ContextLen:   64, // also bounds the fake's output
		MaxBodyBytes: 8 << 10,
	})
	if err != nil {
		f.Fatal(err)
	}
	h := s.Handler()
	f.Fuzz(func(t *testing.T, body []byte) {
		if len(body) > fuzzMaxInput {
			t.Skip()
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body)))
		out := rec.Body.Bytes()
		switch rec.Code {
		case http.StatusOK:
			if strings.HasPrefix(rec.Header().Get("Content-Type"), "text/event-stream") {
				if !bytes.HasSuffix(out, []byte("data: [DONE]\n\n")) {
					t.Fatalf("stream without [DONE]: %q", out)
				}
				for _, ev := range bytes.Split(bytes.TrimSuffix(out, []byte("\n\n")), []byte("\n\n")) {
					data, ok := bytes.CutPrefix(ev, []byte("data: "))
					if !ok || (!json.Valid(data) && string(data) != "[DONE]") {
						t.Fatalf("bad event %q", ev)
					}
				}
				return
			}
			if !json.Valid(out) {
				t.Fatalf("200 with a body that is not JSON: %q", out)
			}
		case http.StatusBadRequest, http.StatusNotFound, http.StatusRequestEntityTooLarge:
			var e errorJSON
			if err := json.Unmarshal(out, &e); err != nil || e.Error.Message == "" || e.Error.Code != rec.Code {
				t.Fatalf("status %d with a bad error body %q (%v)", rec.Code, out, err)
			}
		default:
			t.Fatalf("status %d for body %q: %s", rec.Code, body, out)
		}
	})
}

func FuzzGenerate(f *testing.F) {
	fuzzEndpoint(f, "/generate", []string{
		`{"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "stop": ["x"]}}`,
		`{"input_ids": [1, 2, 3], "stream": true, "return_logprob": true}`,
		`{"text": ["a"], "rid": "r", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 3}`,
		`{"text": "a", "sampling_params": {"top_p": 0.5, "top_k": 3, "min_p": 0.1, "stop_token_ids": [2], "ignore_eos": true}}`,
	})
}

func FuzzCompletion(f *testing.F) {
	fuzzEndpoint(f, "/v1/completions", []string{
		`{"model": "test-model", "prompt": "Hello", "max_tokens": 4, "logprobs": 1}`,
		`{"prompt": [1, 2], "stream": true, "stream_options": {"include_usage": true}, "stop": "x"}`,
		`{"prompt": [[5, 6]], "n": 1, "seed": 3, "temperature": 0}`,
	})
}

func FuzzChat(f *testing.F) {
	fuzzEndpoint(f, "/v1/chat/completions", []string{
		`{"model": "test-model", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}], "max_tokens": 3}`,
		`{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "stream": true, "logprobs": true, "top_logprobs": 1}`,
		`{"messages": [{"role": "assistant", "content": null}], "max_completion_tokens": 2, "response_format": {"type": "text"}}`,
	})
}
