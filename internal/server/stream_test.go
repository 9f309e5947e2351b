package server_test

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/server/servertest"
)

// sseEvents reads an SSE body: the data of each event, in order.
func sseEvents(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	blank := true
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			blank = true
			continue
		}
		if !blank {
			t.Fatalf("event without a blank line before it: %q", line)
		}
		blank = false
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("line without data: %q", line)
		}
		out = append(out, data)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func postStream(t *testing.T, url, body string) []string {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d, Content-Type %q: %s", resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
	return sseEvents(t, resp.Body)
}

func TestGenerateStream(t *testing.T) {
	ts, _ := newServer(t, server.Config{})
	events := postStream(t, ts.URL+"/generate", `{"text": "Hi", "stream": true, "return_logprob": true, "sampling_params": {"max_new_tokens": 4}}`)
	if len(events) != 5 || events[4] != "[DONE]" {
		t.Fatalf("events %q", events)
	}
	for i, ev := range events[:4] {
		var g generateJSON
		if err := json.Unmarshal([]byte(ev), &g); err != nil {
			t.Fatal(err)
		}
		if want := "Hello"[:i+1]; g.Text != want || len(g.OutputIDs) != i+1 || len(g.MetaInfo.OutputTokenLogprobs) != i+1 {
			t.Fatalf("event %d: text %q ids %v, want cumulative %q", i, g.Text, g.OutputIDs, want)
		}
		last := i == 3
		if (string(g.MetaInfo.FinishReason) == "null") == last {
			t.Fatalf("event %d: finish_reason %s", i, g.MetaInfo.FinishReason)
		}
		if g.MetaInfo.PromptTokens != 3 || g.MetaInfo.ID == "" {
			t.Fatalf("event %d: meta_info %+v", i, g.MetaInfo)
		}
	}
}

// failing aborts with an error after two tokens.
func failing(r *engine.Request) []engine.Event {
	return []engine.Event{
		{Token: 'a', Text: "a"},
		{Token: 'b', Text: "b"},
		{Token: -1, Finish: &engine.Finish{Type: "abort", Err: errors.New("device lost")}},
	}
}

func TestStreamErrorAfterStart(t *testing.T) {
	ts, _ := newServer(t, server.Config{Generator: &servertest.Generator{Script: failing}})
	for _, p := range []struct{ path, body string }{
		{"/generate", `{"text": "Hi", "stream": true}`},
		{"/v1/completions", `{"prompt": "Hi", "stream": true}`},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "Hi"}], "stream": true}`},
	} {
		t.Run(p.path, func(t *testing.T) {
			events := postStream(t, ts.URL+p.path, p.body)
			if len(events) < 2 {
				t.Fatalf("events %q", events)
			}
			last := events[len(events)-1]
			var e errorJSON
			if err := json.Unmarshal([]byte(last), &e); err != nil || !strings.Contains(e.Error.Message, "device lost") || e.Error.Code != 500 {
				t.Fatalf("last event %q, want an error", last)
			}
			for _, ev := range events {
				if ev == "[DONE]" {
					t.Fatalf("[DONE] after an error: %q", events)
				}
			}
		})
	}
}

func TestErrorBeforeFirstToken(t *testing.T) {
	script := func(r *engine.Request) []engine.Event {
		return []engine.Event{{Token: -1, Finish: &engine.Finish{Type: "abort", Err: fmt.Errorf("%w: out of pages", engine.ErrOverloaded)}}}
	}
	ts, _ := newServer(t, server.Config{Generator: &servertest.Generator{Script: script}})
	for _, body := range []string{`{"text": "Hi", "stream": true}`, `{"text": "Hi"}`} {
		status, b := post(t, ts.URL+"/generate", body)
		checkError(t, status, b, 503, "out of pages")
	}
}

func TestCompletionsStream(t *testing.T) {
	ts, _ := newServer(t, server.Config{})
	events := postStream(t, ts.URL+"/v1/completions", `{"prompt": "Hi", "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}`)
	if events[len(events)-1] != "[DONE]" {
		t.Fatalf("events %q", events)
	}
	var text strings.Builder
	finishes, usages := 0, 0
	for _, ev := range events[:len(events)-1] {
		var c completionJSON
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatal(err)
		}
		if c.Object != "text_completion" {
			t.Fatalf("object %q", c.Object)
		}
		if c.Usage != nil {
			usages++
			if len(c.Choices) != 0 || c.Usage.CompletionTokens != 5 || c.Usage.PromptTokens != 3 {
				t.Fatalf("usage chunk %s", ev)
			}
			continue
		}
		if finishes > 0 {
			t.Fatalf("chunk after the finish: %s", ev)
		}
		text.WriteString(c.Choices[0].Text)
		if c.Choices[0].FinishReason != nil {
			finishes++
			if *c.Choices[0].FinishReason != "length" {
				t.Fatalf("finish %s", ev)
			}
		}
	}
	if text.String() != "Hello" || finishes != 1 || usages != 1 {
		t.Fatalf("text %q, finishes %d, usages %d", text.String(), finishes, usages)
	}
	// No usage chunk unless asked.
	events = postStream(t, ts.URL+"/v1/completions", `{"prompt": "Hi", "max_tokens": 2, "stream": true}`)
	for _, ev := range events {
		if strings.Contains(ev, `"usage"`) {
			t.Fatalf("usage without include_usage: %s", ev)
		}
	}
}

func TestChatStream(t *testing.T) {
	ts, _ := newServer(t, server.Config{})
	events := postStream(t, ts.URL+"/v1/chat/completions", `{"messages": [{"role": "user", "content": "Hi"}], "stream": true,
		"stream_options": {"include_usage": true}}`)
	if events[len(events)-1] != "[DONE]" {
		t.Fatalf("events %q", events)
	}
	var text strings.Builder
	var finish string
	for i, ev := range events[:len(events)-1] {
		var c completionJSON
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatal(err)
		}
		if c.Object != "chat.completion.chunk" {
			t.Fatalf("object %q", c.Object)
		}
		if c.Usage != nil {
			if i != len(events)-2 || c.Usage.CompletionTokens != 14 {
				t.Fatalf("usage chunk %d: %s", i, ev)
			}
			continue
		}
		d := c.Choices[0].Delta
		if d == nil {
			t.Fatalf("chunk without delta: %s", ev)
		}
		if i == 0 && (d.Role != "assistant" || d.Content == nil || *d.Content != "") {
			t.Fatalf("first chunk %s", ev)
		}
		if d.Content != nil {
			text.WriteString(*d.Content)
		}
		if c.Choices[0].FinishReason != nil {
			finish = *c.Choices[0].FinishReason
		}
	}
	if text.String() != servertest.DefaultReply || finish != "stop" {
		t.Fatalf("text %q finish %q", text.String(), finish)
	}
}
