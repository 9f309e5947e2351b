package lb

import (
	"context"
	"encoding/json"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeServer is a prefill or decode server that records request bodies.
type fakeServer struct {
	*httptest.Server
	mode    string
	modeNow atomic.Pointer[string] // setMode's, if set
	down    atomic.Bool
	stall   atomic.Int64 // /health answers after this many nanoseconds
	fail    atomic.Bool  // answer /generate with 400
	mu      sync.Mutex
	bodies  []map[string]any
	headers []http.Header
	release chan struct{} // decode waits for it before answering, if set
	// gen, if set, answers /generate after the body was recorded; answer,
	// if set, too, with the body (both under mu: setGen, setAnswer).
	gen    func(w http.ResponseWriter, r *http.Request)
	answer func(w http.ResponseWriter, r *http.Request, body map[string]any)
	// healthGen, if set, is the status of /health_generate.
	healthGen atomic.Int32
	load      atomic.Pointer[map[string]any] // added to /get_server_info
	// flushes counts POST /flush_cache; flushStatus, if set, is its answer.
	flushes, flushStatus atomic.Int32
}

// setAnswer and setGen set answer and gen (under mu: a handler of an
// earlier request may still be running).
func (f *fakeServer) setAnswer(fn func(w http.ResponseWriter, r *http.Request, body map[string]any)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.answer = fn
}

func (f *fakeServer) setGen(fn func(w http.ResponseWriter, r *http.Request)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gen = fn
}

func newFake(t *testing.T, mode string) *fakeServer {
	f := &fakeServer{mode: mode}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if f.down.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		switch r.URL.Path {
		case "/health":
			if d := time.Duration(f.stall.Load()); d > 0 {
				select {
				case <-time.After(d):
				case <-r.Context().Done():
				}
			}
		case "/health_generate":
			if c := f.healthGen.Load(); c != 0 {
				w.WriteHeader(int(c))
				w.Write([]byte(`{"error":{"message":"health check generation failed: engine stopped","code":503}}`))
			}
		case "/get_server_info":
			mode := f.mode
			if m := f.modeNow.Load(); m != nil {
				mode = *m
			}
			info := map[string]any{"disaggregation_mode": mode, "bootstrap_port": 9123}
			if l := f.load.Load(); l != nil {
				maps.Copy(info, *l)
			}
			json.NewEncoder(w).Encode(info)
		case "/flush_cache":
			f.flushes.Add(1)
			if c := f.flushStatus.Load(); c != 0 {
				w.WriteHeader(int(c))
				w.Write([]byte(`{"error":{"message":"this server has no prefix cache","code":400}}`))
				return
			}
			w.Write([]byte(`{"message":"Cache flushed."}`))
		case "/generate", "/v1/completions":
			var m map[string]any
			json.NewDecoder(r.Body).Decode(&m)
			f.mu.Lock()
			f.bodies = append(f.bodies, m)
			f.headers = append(f.headers, r.Header.Clone())
			answer, gen := f.answer, f.gen
			f.mu.Unlock()
			if answer != nil {
				answer(w, r, m)
				return
			}
			if gen != nil {
				gen(w, r)
				return
			}
			if f.fail.Load() {
				w.WriteHeader(http.StatusBadRequest)
				w.Write([]byte(`{"error":{"message":"prompt is empty","type":"invalid_request_error","code":400}}`))
				return
			}
			if f.release != nil {
				select {
				case <-f.release:
				case <-r.Context().Done():
					return
				}
			}
			w.Header().Set("Content-Type", "text/event-stream")
			w.Write([]byte("data: {\"text\":\"a\"}\n\n"))
			w.(http.Flusher).Flush()
			w.Write([]byte("data: [DONE]\n\n"))
		}
	}))
	t.Cleanup(f.Close)
	return f
}

// setMode changes the mode /get_server_info reports.
func (f *fakeServer) setMode(m string) { f.modeNow.Store(&m) }

func (f *fakeServer) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.bodies)
}

func (f *fakeServer) last() map[string]any {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.bodies) == 0 {
		return nil
	}
	return f.bodies[len(f.bodies)-1]
}

func startLB(t *testing.T, cfg Config) (*LB, *httptest.Server, *prometheus.Registry) {
	return startLBWith(t, cfg, nil)
}

// startLBWith is startLB that waits for the servers in usable only (nil:
// all).
func startLBWith(t *testing.T, cfg Config, usable []*fakeServer) (*LB, *httptest.Server, *prometheus.Registry) {
	reg := prometheus.NewRegistry()
	cfg.Registerer, cfg.Gatherer = reg, reg
	if cfg.HealthInterval == 0 {
		cfg.HealthInterval = 100 * time.Millisecond
	}
	l, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Run(ctx); close(done) }()
	<-l.Ready()
	// A check may time out on a loaded machine (-race): wait for them all.
	waitFor(t, 5*time.Second, func() bool {
		for _, b := range append(append([]*backend{}, l.prefill...), l.decode...) {
			want := usable == nil
			for _, f := range usable {
				want = want || f.URL == b.String()
			}
			if want && !b.usable() {
				return false
			}
		}
		return true
	})
	srv := httptest.NewServer(l.Handler())
	t.Cleanup(func() { srv.Close(); cancel(); <-done })
	return l, srv, reg
}

func post(t *testing.T, url, body string) (int, string) {
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestInjectsBootstrapAndStreamsDecode(t *testing.T) {
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	_, srv, reg := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}})
	code, body := post(t, srv.URL+"/generate", `{"text":"hi","stream":true}`)
	if code != 200 || !strings.Contains(body, "[DONE]") {
		t.Fatalf("got %d %q", code, body)
	}
	waitFor(t, 5*time.Second, func() bool { return p.count() == 1 && d.count() == 1 })
	pb, db := p.last(), d.last()
	if pb["bootstrap_room"] != db["bootstrap_room"] || pb["bootstrap_port"] != float64(9123) || pb["bootstrap_host"] != "127.0.0.1" {
		t.Fatalf("bootstrap fields: prefill %v decode %v", pb, db)
	}
	if pb["text"] != "hi" {
		t.Fatalf("body not passed through: %v", pb)
	}
	if n := counterValue(t, reg, "200"); n != 1 {
		t.Fatalf("mooncake_lb_requests_total{code=200} = %v", n)
	}
}

func counterValue(t *testing.T, reg *prometheus.Registry, code string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "mooncake_lb_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == code {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func TestPrefillErrorCancelsDecode(t *testing.T) {
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	d.release = make(chan struct{}) // decode would wait forever
	p.fail.Store(true)
	_, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}})
	start := time.Now()
	code, body := post(t, srv.URL+"/generate", `{"text":""}`)
	if code != http.StatusBadRequest || !strings.Contains(body, "prompt is empty") {
		t.Fatalf("got %d %q", code, body)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatal("prefill failure was not reported promptly")
	}
}

func TestUnhealthyServerSkippedThenRecovers(t *testing.T) {
	p := newFake(t, "prefill")
	d1, d2 := newFake(t, "decode"), newFake(t, "decode")
	interval := 100 * time.Millisecond
	l, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d1.URL, d2.URL}, Policy: "round_robin", HealthInterval: interval})
	d1.down.Store(true)
	waitFor(t, 2*interval+time.Second, func() bool { return !l.decode[0].healthy.Load() })
	for i := 0; i < 4; i++ {
		if code, _ := post(t, srv.URL+"/generate", `{"text":"x"}`); code != 200 {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	if n1, n2 := d1.count(), d2.count(); n1 != 0 || n2 != 4 {
		t.Fatalf("unhealthy server got %d requests, healthy %d", n1, n2)
	}
	d1.down.Store(false)
	recovered := time.Now()
	waitFor(t, 2*interval+time.Second, func() bool { return l.decode[0].healthy.Load() })
	if el := time.Since(recovered); el > 2*interval+200*time.Millisecond {
		t.Fatalf("recovery took %v, more than two intervals", el)
	}
}

func waitFor(t *testing.T, d time.Duration, f func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for !f() {
		if time.Now().After(end) {
			t.Fatal("condition not met in time")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestBadInput(t *testing.T) {
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	_, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, MaxBodyBytes: 64})
	if code, body := post(t, srv.URL+"/generate", `not json`); code != 400 || !strings.Contains(body, `"error"`) {
		t.Fatalf("malformed: %d %s", code, body)
	}
	if code, _ := post(t, srv.URL+"/generate", `{"text":"`+strings.Repeat("x", 100)+`"}`); code != 413 {
		t.Fatalf("oversize: %d", code)
	}
	for _, c := range []Config{{Decode: []string{"http://x"}}, {Prefill: []string{"http://x"}}, {Prefill: []string{"ftp://x"}, Decode: []string{"http://y"}},
		{Prefill: []string{"http://x"}, Decode: []string{"http://y"}, Policy: "fastest"},
		{Prefill: []string{"http://h%C3%A9/"}, Decode: []string{"http://y"}}} {
		if _, err := New(c); err == nil || !strings.Contains(err.Error(), "--") {
			t.Fatalf("config %+v: error %v does not name the flag", c, err)
		}
	}
}

func TestRoundRobinPerRole(t *testing.T) {
	p1, p2 := newFake(t, "prefill"), newFake(t, "prefill")
	d1, d2 := newFake(t, "decode"), newFake(t, "decode")
	_, srv, _ := startLB(t, Config{Prefill: []string{p1.URL, p2.URL}, Decode: []string{d1.URL, d2.URL}, Policy: "round_robin"})
	for i := 0; i < 4; i++ {
		if code, _ := post(t, srv.URL+"/generate", `{"text":"x"}`); code != 200 {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	waitFor(t, 5*time.Second, func() bool { return p1.count()+p2.count() == 4 })
	for _, f := range []*fakeServer{p1, p2, d1, d2} {
		if f.count() != 2 {
			t.Fatalf("%s %s got %d of 4 requests, want 2", f.mode, f.URL, f.count())
		}
	}
}

func TestDecodeDiesMidStream(t *testing.T) {
	p := newFake(t, "prefill")
	d := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			return
		case "/get_server_info":
			w.Write([]byte(`{"disaggregation_mode":"decode"}`))
		case "/generate":
			w.Header().Set("Content-Type", "text/event-stream")
			w.Write([]byte("data: {\"text\":\"a\"}\n\n"))
			w.(http.Flusher).Flush()
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close() // dies mid-stream
		}
	}))
	defer d.Close()
	_, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}})
	_, body := post(t, srv.URL+"/generate", `{"text":"x","stream":true}`)
	if !strings.Contains(body, `data: {"error"`) || strings.Contains(body, "[DONE]") {
		t.Fatalf("stream after decode death: %q", body)
	}
}
