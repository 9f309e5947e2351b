package lb

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/lb/lbtest"
)

// answer is a response read for comparison: its status, and the body
// (a stream: its events, in order, and whether it ended with [DONE]).
type answer struct {
	status int
	body   any
	events []any
	done   bool
	raw    string
}

func postAnswer(t *testing.T, url, body string) answer {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	a := answer{status: resp.StatusCode}
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		raw, _ := io.ReadAll(resp.Body)
		a.raw = string(raw)
		if err := json.Unmarshal(raw, &a.body); err != nil {
			t.Fatalf("POST %s %s: %d %q: %v", url, body, resp.StatusCode, raw, err)
		}
		return a
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var sb strings.Builder
	for sc.Scan() {
		sb.WriteString(sc.Text() + "\n")
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			a.done = true
			continue
		}
		var v any
		if err := json.Unmarshal([]byte(data), &v); err != nil {
			t.Fatalf("event %q: %v", data, err)
		}
		a.events = append(a.events, v)
	}
	a.raw = sb.String()
	return a
}

// normalize drops what differs between two runs of the same generations:
// latencies, creation times, prefix-cache hits and, unless keepIDs, ids.
func normalize(v any, keepIDs bool) any {
	switch x := v.(type) {
	case map[string]any:
		out := map[string]any{}
		for k, e := range x {
			switch k {
			case "e2e_latency", "created", "cached_tokens":
				continue
			case "id":
				if !keepIDs {
					continue
				}
			}
			out[k] = normalize(e, keepIDs)
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = normalize(e, keepIDs)
		}
		return out
	}
	return v
}

// byIndex groups a stream's events by generation: /generate's index, or
// the index of an OpenAI chunk's choice (-1: a chunk without choices).
func byIndex(events []any, keepIDs bool) map[int][]any {
	out := map[int][]any{}
	for _, ev := range events {
		m, _ := ev.(map[string]any)
		k := -1
		if i, ok := m["index"].(float64); ok {
			k = int(i)
		} else if cs, _ := m["choices"].([]any); len(cs) > 0 {
			k = int(cs[0].(map[string]any)["index"].(float64))
		}
		out[k] = append(out[k], normalize(ev, keepIDs))
	}
	return out
}

// TestSplitEqualsColocated: batches and n > 1 through the LB over a
// prefill and a decode that take one generation per request are answered
// exactly as the colocated server answers them, greedy and seeded, whole
// and streamed, on the three endpoints.
func TestSplitEqualsColocated(t *testing.T) {
	srv := lbtest.Start(t)
	_, lb, _ := startLB(t, Config{Prefill: []string{srv.Prefill}, Decode: []string{srv.Decode}, Policy: "round_robin", BatchConcurrency: 3})
	// The servers take one generation per room.
	if a := postAnswer(t, srv.Decode+"/generate", `{"text": ["a", "b"], "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 2}`); a.status != 400 ||
		!strings.Contains(a.raw, "not supported on disaggregated requests") {
		t.Fatalf("a batch sent whole: %d %s", a.status, a.raw)
	}
	const greedy, seeded = `"temperature": 0`, `"temperature": 0.9, "top_p": 0.95, "seed": 7`
	cases := []struct {
		path, body string
		keepIDs    bool
	}{
		{"/generate", `{"text": ["Once upon", "a time", "there"], "sampling_params": {"max_new_tokens": 5, ` + greedy + `}}`, false},
		{"/generate", `{"text": ["Once upon", "a time"], "sampling_params": {"max_new_tokens": 5, ` + seeded + `}}`, false},
		{"/generate", `{"input_ids": [[1, 2, 3], [4, 5]], "rid": ["x", "y"], "return_logprob": true, "top_logprobs_num": 2,
			"sampling_params": [{"max_new_tokens": 3, ` + greedy + `}, {"max_new_tokens": 4, ` + seeded + `}]}`, true},
		{"/generate", `{"text": "hello", "rid": "r", "sampling_params": {"n": 3, "max_new_tokens": 4, ` + seeded + `}}`, true},
		{"/generate", `{"text": "hello", "sampling_params": {"n": 2, "max_new_tokens": 4, "temperature": 0.9, "sampling_seed": 3}}`, false},
		{"/generate", `{"text": ["a", "b"], "stream": true, "sampling_params": {"n": 2, "max_new_tokens": 3, ` + seeded + `}}`, false},
		{"/generate", `{"text": ["a", "bc"], "stream": true, "return_logprob": true, "sampling_params": {"max_new_tokens": 4, ` + greedy + `}}`, false},
		{"/v1/completions", `{"prompt": ["Once", "upon a"], "max_tokens": 4, ` + greedy + `}`, false},
		{"/v1/completions", `{"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 3, "logprobs": 2, ` + seeded + `}`, false},
		{"/v1/completions", `{"prompt": "Once", "n": 3, "rid": "c", "max_tokens": 3, ` + seeded + `}`, true},
		{"/v1/completions", `{"prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}, ` + seeded + `}`, false},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3, ` + seeded + `}`, false},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 3, "stream": true,
			"stream_options": {"include_usage": true}, "logprobs": true, ` + seeded + `}`, false},
	}
	for _, c := range cases {
		want := postAnswer(t, srv.Colocated+c.path, c.body)
		got := postAnswer(t, lb.URL+c.path, c.body)
		if want.status != 200 || got.status != 200 {
			t.Fatalf("%s %s: colocated %d, LB %d: %s", c.path, c.body, want.status, got.status, got.raw)
		}
		if want.events == nil {
			if w, g := normalize(want.body, c.keepIDs), normalize(got.body, c.keepIDs); !reflect.DeepEqual(w, g) {
				t.Fatalf("%s %s:\nLB         %s\ncolocated  %s", c.path, c.body, got.raw, want.raw)
			}
			continue
		}
		if !got.done || len(got.events) != len(want.events) {
			t.Fatalf("%s %s: LB stream of %d events (done %v), colocated %d:\n%s", c.path, c.body, len(got.events), got.done, len(want.events), got.raw)
		}
		w, g := byIndex(want.events, c.keepIDs), byIndex(got.events, c.keepIDs)
		if !reflect.DeepEqual(w, g) {
			t.Fatalf("%s %s: the generations' events differ:\nLB         %s\ncolocated  %s", c.path, c.body, got.raw, want.raw)
		}
		// OpenAI's stream: one id and one created for every chunk.
		if c.path != "/generate" {
			ids, created := map[any]bool{}, map[any]bool{}
			for _, ev := range got.events {
				ids[ev.(map[string]any)["id"]], created[ev.(map[string]any)["created"]] = true, true
			}
			if len(ids) != 1 || len(created) != 1 {
				t.Fatalf("%s: LB stream with ids %v, created %v", c.path, ids, created)
			}
		}
	}
	// The ids of a split OpenAI answer are the colocated server's.
	a := postAnswer(t, lb.URL+"/v1/completions", `{"prompt": "Once", "n": 2, "rid": "abc", "max_tokens": 1, "stream": true}`)
	if len(a.events) == 0 || a.events[0].(map[string]any)["id"] != "cmpl-abc_0" {
		t.Fatalf("stream id: %s", a.raw)
	}
}

// echoServer is a fake prefill or decode that answers each generation with
// its body, and counts the requests in flight on every echoServer of a
// load.
type echoServer struct {
	*fakeServer
}

type load0 struct{ inflight, peak atomic.Int32 }

func newEchoServer(t *testing.T, mode string, hold time.Duration, l *load0) *echoServer {
	rec := &echoServer{fakeServer: newFake(t, mode)}
	rec.setAnswer(func(w http.ResponseWriter, r *http.Request, b map[string]any) {
		n := l.inflight.Add(1)
		defer l.inflight.Add(-1)
		for p := l.peak.Load(); n > p && !l.peak.CompareAndSwap(p, n); p = l.peak.Load() {
		}
		time.Sleep(hold)
		echo, _ := json.Marshal(b)
		fmt.Fprintf(w, `{"text": %q, "output_ids": [], "meta_info": {}}`, echo)
	})
	return rec
}

// TestSplitRequests: each generation is a request of its own with the
// fields the colocated server would give it; a prompt's samples share a
// pair; the fan-out is bounded.
func TestSplitRequests(t *testing.T) {
	var pl, dl load0
	p := newEchoServer(t, "prefill", 0, &pl)
	d1, d2 := newEchoServer(t, "decode", 20*time.Millisecond, &dl), newEchoServer(t, "decode", 20*time.Millisecond, &dl)
	_, lb, reg := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d1.URL, d2.URL}, Policy: "round_robin", BatchConcurrency: 2})
	a := postAnswer(t, lb.URL+"/generate", `{"text": ["p0", "p1"], "rid": "r", "bootstrap_room": 5,
		"sampling_params": {"n": 3, "seed": 10, "max_new_tokens": 2}}`)
	list, _ := a.body.([]any)
	if a.status != 200 || len(list) != 6 {
		t.Fatalf("%d %s", a.status, a.raw)
	}
	decodeOf := map[string]string{}
	for _, rec := range []*echoServer{d1, d2} {
		rec.mu.Lock()
		for _, b := range rec.bodies {
			decodeOf[b["rid"].(string)] = rec.URL
		}
		rec.mu.Unlock()
	}
	for k, v := range list {
		var sub map[string]any
		if err := json.Unmarshal([]byte(v.(map[string]any)["text"].(string)), &sub); err != nil {
			t.Fatal(err)
		}
		i, j := k/3, k%3
		sp := sub["sampling_params"].(map[string]any)
		if sub["text"] != fmt.Sprintf("p%d", i) || sub["rid"] != fmt.Sprintf("r_%d", k) || sp["seed"] != float64(10+j) || sp["n"] != nil ||
			sp["max_new_tokens"] != float64(2) || sub["bootstrap_room"] == float64(5) {
			t.Fatalf("generation %d got %v", k, sub)
		}
		if decodeOf[sub["rid"].(string)] != decodeOf[fmt.Sprintf("r_%d", i*3)] {
			t.Fatalf("prompt %d's samples went to different decodes: %v", i, decodeOf)
		}
	}
	if decodeOf["r_0"] == decodeOf["r_3"] {
		t.Fatalf("round_robin sent both prompts to %s", decodeOf["r_0"])
	}
	if pk := dl.peak.Load(); pk != 2 {
		t.Fatalf("%d generations at once on the decodes, with --batch-concurrency 2", pk)
	}
	if n := metricValue(t, reg, "mooncake_lb_split_generations_total"); n != 6 {
		t.Fatalf("split generations %v, want 6", n)
	}
	if n := counterValue(t, reg, "200"); n != 1 {
		t.Fatalf("requests{200} = %v, want 1 (the client's)", n)
	}

	// A rid per prompt and a sampling_params list; OpenAI's n and seed.
	a = postAnswer(t, lb.URL+"/generate", `{"input_ids": [[1], [2, 3]], "rid": ["a", "b"], "sampling_params": [{"n": 2, "sampling_seed": 4}, {"n": 2}]}`)
	list, _ = a.body.([]any)
	want := []string{`"input_ids":[1],"rid":"a_0","sampling_params":{"sampling_seed":4}`, `"input_ids":[1],"rid":"a_1","sampling_params":{"sampling_seed":5}`,
		`"input_ids":[2,3],"rid":"b_0","sampling_params":{}`, `"input_ids":[2,3],"rid":"b_1","sampling_params":{}`}
	if len(list) != 4 {
		t.Fatalf("%d %s", a.status, a.raw)
	}
	for k, v := range list {
		var m map[string]any
		json.Unmarshal([]byte(v.(map[string]any)["text"].(string)), &m)
		delete(m, "bootstrap_host")
		delete(m, "bootstrap_port")
		delete(m, "bootstrap_room")
		b, _ := json.Marshal(m)
		if got := string(b[1 : len(b)-1]); got != want[k] {
			t.Fatalf("generation %d: %s, want %s", k, got, want[k])
		}
	}
}

// TestSplitAnswers: what the LB itself answers for a split request: the
// bound on generations, rid lists that do not fit, a generation's
// failure naming its prompt, requests it sends whole.
func TestSplitAnswers(t *testing.T) {
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	var failOn atomic.Value // a prompt the decode refuses
	failOn.Store("")
	d.setAnswer(func(w http.ResponseWriter, r *http.Request, b map[string]any) {
		if _, ok := b["bootstrap_room"]; !ok {
			w.WriteHeader(400)
			w.Write([]byte(`{"error":{"message":"no room","type":"invalid_request_error","param":null,"code":400}}`))
			return
		}
		if b["text"] == failOn.Load() {
			w.WriteHeader(400)
			w.Write([]byte(`{"error":{"message":"sampling_params.temperature must be non-negative","type":"invalid_request_error","param":"sampling_params.temperature","code":400}}`))
			return
		}
		text, _ := json.Marshal(b["text"])
		if b["stream"] == true {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprintf(w, "data: {\"text\":%s,\"output_ids\":[1],\"meta_info\":{}}\n\ndata: [DONE]\n\n", text)
			return
		}
		fmt.Fprintf(w, `{"text":%s,"output_ids":[1],"meta_info":{}}`, text)
	})
	_, lb, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, MaxBatch: 8})
	for _, c := range []struct {
		body  string
		code  int
		param string
		msg   string
	}{
		{`{"text": ["a","b","c"], "sampling_params": {"n": 3}}`, 400, "text", "9 generations, more than the load balancer takes in one request (8)"},
		{`{"text": "a", "sampling_params": {"n": 9}}`, 400, "sampling_params.n", "more than the load balancer takes"},
		{`{"text": "a", "rid": ["x"], "sampling_params": {"n": 2}}`, 400, "rid", "rid is a list but the prompt is not"},
		{`{"text": ["a", "b"], "rid": ["x"]}`, 400, "rid", "rid has 1 ids for 2 prompts"},
	} {
		a := postAnswer(t, lb.URL+"/generate", c.body)
		e, _ := a.body.(map[string]any)["error"].(map[string]any)
		if a.status != c.code || e == nil || e["param"] != c.param || !strings.Contains(e["message"].(string), c.msg) || e["code"] != float64(c.code) {
			t.Fatalf("%s: %d %s", c.body, a.status, a.raw)
		}
	}
	n := d.count()
	// What the servers must refuse themselves goes whole (the decode's own
	// error answers: here "no room" is not it, the body reached it whole).
	// (The last body the decode got is the request's: these are sent one
	// at a time.)
	for _, body := range []string{`{"text": ["a", 1]}`, `{"text": "a", "sampling_params": {"n": 0}}`, `{"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}`,
		`{"text": ["a", "b"], "sampling_params": [{}]}`, `{"text": "a", "input_ids": [[1], [2]]}`} {
		if a := postAnswer(t, lb.URL+"/generate", body); a.status != 200 {
			t.Fatalf("%s: %d %s", body, a.status, a.raw)
		}
		d.mu.Lock()
		last := d.bodies[len(d.bodies)-1]
		d.mu.Unlock()
		var whole map[string]any
		json.Unmarshal([]byte(body), &whole)
		for k, v := range whole {
			if !reflect.DeepEqual(last[k], v) {
				t.Fatalf("%s: the decode got %s = %v, want it whole", body, k, last[k])
			}
		}
		n++
	}
	if d.count() != n {
		t.Fatalf("%d requests for %d sent whole", d.count(), n)
	}
	// A generation's error names its prompt (and the sampling_params element).
	failOn.Store("b")
	for _, stream := range []string{"false", "true"} {
		a := postAnswer(t, lb.URL+"/generate", `{"text": ["a", "b"], "stream": `+stream+`, "sampling_params": [{}, {"temperature": -1}]}`)
		m, _ := a.body.(map[string]any)
		e, _ := m["error"].(map[string]any)
		if a.status != 400 || e == nil || e["message"] != "text[1]: sampling_params.temperature must be non-negative" || e["param"] != "sampling_params[1].temperature" {
			t.Fatalf("stream %s: %d %s", stream, a.status, a.raw)
		}
	}
	// An OpenAI list's choices and usage.
	d.setAnswer(func(w http.ResponseWriter, r *http.Request, b map[string]any) {
		fmt.Fprintf(w, `{"id":"cmpl-%v","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":%q,"logprobs":null,"finish_reason":"length"}],`+
			`"usage":{"prompt_tokens":%d,"completion_tokens":2,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":1}}}`,
			b["rid"], b["prompt"], len(b["prompt"].(string)), len(b["prompt"].(string))+2)
	})
	a := postAnswer(t, lb.URL+"/v1/completions", `{"prompt": ["ab", "cde"], "n": 2, "rid": "q"}`)
	want := `{"id":"cmpl-q_0","object":"text_completion","created":1,"model":"m","choices":[` +
		`{"index":0,"text":"ab","logprobs":null,"finish_reason":"length"},{"index":1,"text":"ab","logprobs":null,"finish_reason":"length"},` +
		`{"index":2,"text":"cde","logprobs":null,"finish_reason":"length"},{"index":3,"text":"cde","logprobs":null,"finish_reason":"length"}],` +
		`"usage":{"prompt_tokens":5,"completion_tokens":8,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":2}}}` + "\n"
	if a.raw != want {
		t.Fatalf("completions list:\n got %s\nwant %s", a.raw, want)
	}
}

// TestSplitStreamFailure: a generation that fails mid-stream ends the
// answer with its error event and no [DONE]; the others are canceled. (One
// that fails before every generation started is answered as an HTTP
// error: TestSplitAnswers.)
func TestSplitStreamFailure(t *testing.T) {
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	var canceled atomic.Int32
	d.setAnswer(func(w http.ResponseWriter, r *http.Request, b map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "data: {\"text\":%q}\n\n", b["text"])
		w.(http.Flusher).Flush()
		if b["text"] == "bad" {
			time.Sleep(200 * time.Millisecond) // after every generation started
			w.Write([]byte(`data: {"error":{"message":"device lost","type":"internal_server_error","param":null,"code":500}}` + "\n\n"))
			return
		}
		<-r.Context().Done() // the others run until canceled
		canceled.Add(1)
	})
	_, lb, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}})
	a := postAnswer(t, lb.URL+"/generate", `{"text": ["a", "bad", "c"], "stream": true}`)
	if a.status != 200 || a.done || !strings.Contains(a.raw, `data: {"error":{"message":"device lost"`) {
		t.Fatalf("%d %s", a.status, a.raw)
	}
	waitFor(t, 5*time.Second, func() bool { return canceled.Load() == 2 })
	var idx []int
	for _, ev := range a.events {
		if i, ok := ev.(map[string]any)["index"].(float64); ok {
			idx = append(idx, int(i))
		}
	}
	slices.Sort(idx)
	if len(idx) == 0 || slices.Contains(idx, -1) {
		t.Fatalf("events without index: %s", a.raw)
	}
}

// TestSplitLeaksNothing: a client that leaves a split stream cancels every
// generation.
func TestSplitClientLeaves(t *testing.T) {
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	var started, ended sync.WaitGroup
	started.Add(3)
	ended.Add(3)
	d.setGen(func(w http.ResponseWriter, r *http.Request) {
		defer ended.Done()
		w.Header().Set("Content-Type", "text/event-stream")
		w.Write([]byte("data: {\"text\":\"x\"}\n\n"))
		w.(http.Flusher).Flush()
		started.Done()
		<-r.Context().Done()
	})
	l, lb, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}})
	resp, err := http.Post(lb.URL+"/generate", "application/json", strings.NewReader(`{"text": ["a", "b", "c"], "stream": true}`))
	if err != nil {
		t.Fatal(err)
	}
	started.Wait()
	resp.Body.Close()
	done := make(chan struct{})
	go func() { ended.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("generations still running after the client left")
	}
	waitFor(t, 5*time.Second, func() bool { return l.decode[0].inflight.Load() == 0 && l.prefill[0].inflight.Load() == 0 })
}
