package lb

import (
	"bufio"
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

	"github.com/mooncake-go/mooncake-go/internal/lb/voucher"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

func testSecret(t *testing.T) auth.Secret {
	s, err := auth.New("lb-test-cluster-secret", "test")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// metricValue is the value of the series name{labels...} (pairs), 0 if absent.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue next
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// TestVoucher: both servers get the same voucher, which a Checker with the
// cluster secret accepts for the fields the LB set, and a client's own
// bootstrap fields, however spelt, never reach them.
func TestVoucher(t *testing.T) {
	s := testSecret(t)
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	_, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, Secret: s})
	body := `{"text":"hi","BOOTSTRAP_HOST":"evil","Bootstrap_Port":1,"bootſtrap_room":7,"bootstrap\u005fhost":"x","stream":true}`
	if code, out := post(t, srv.URL+"/generate", body); code != 200 {
		t.Fatalf("got %d %s", code, out)
	}
	waitFor(t, 5*time.Second, func() bool { return p.count() == 1 && d.count() == 1 })
	for _, f := range []*fakeServer{p, d} {
		f.mu.Lock()
		m, h := f.bodies[0], f.headers[0]
		f.mu.Unlock()
		if m["bootstrap_host"] != "127.0.0.1" || m["bootstrap_port"] != float64(9123) {
			t.Fatalf("%s got %v", f.mode, m)
		}
		for k := range m {
			if strings.EqualFold(k, "bootstrap_host") && k != "bootstrap_host" || strings.EqualFold(k, "bootstrap_port") && k != "bootstrap_port" ||
				strings.EqualFold(k, "bootstrap_room") && k != "bootstrap_room" {
				t.Fatalf("%s got the client's %q", f.mode, k)
			}
		}
		if h.Get(voucher.Header) == "" {
			t.Fatalf("%s got no voucher", f.mode)
		}
	}
	p.mu.Lock()
	ph := p.headers[0].Get(voucher.Header)
	p.mu.Unlock()
	d.mu.Lock()
	dh := d.headers[0].Get(voucher.Header)
	d.mu.Unlock()
	if ph != dh {
		t.Fatalf("prefill and decode got different vouchers: %q, %q", ph, dh)
	}
}

// TestVoucherChecks: servers that check vouchers as internal/server does
// accept the LB's; an LB with another secret gets a 502 naming the cause.
func TestVoucherChecks(t *testing.T) {
	s := testSecret(t)
	var checked atomic.Int32
	// A server that checks the voucher exactly as internal/server does.
	mk := func(mode string) *httptest.Server {
		c := voucher.NewChecker(s, 0)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/get_server_info":
				json.NewEncoder(w).Encode(map[string]any{"disaggregation_mode": mode, "bootstrap_port": 9123})
			case "/generate":
				var f struct {
					Host string `json:"bootstrap_host"`
					Port int    `json:"bootstrap_port"`
					Room uint64 `json:"bootstrap_room"`
				}
				if err := json.NewDecoder(r.Body).Decode(&f); err != nil {
					http.Error(w, err.Error(), 400)
					return
				}
				if err := c.Check(r.Header.Get(voucher.Header), voucher.Fields{Host: f.Host, Port: f.Port, Room: f.Room}); err != nil {
					w.WriteHeader(400)
					fmt.Fprintf(w, `{"error":{"message":%q,"param":"bootstrap_room","code":400}}`, err.Error())
					return
				}
				checked.Add(1)
				w.Header().Set("Content-Type", "text/event-stream")
				w.Write([]byte("data: {}\n\ndata: [DONE]\n\n"))
			}
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	p, d := mk("prefill"), mk("decode")
	_, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, Secret: s})
	if code, out := post(t, srv.URL+"/generate", `{"text":"a","BOOTSTRAP_ROOM":1,"bootstrap_port":2}`); code != 200 {
		t.Fatalf("got %d %s", code, out)
	}
	waitFor(t, 5*time.Second, func() bool { return checked.Load() == 2 })

	// An LB with another secret: the servers refuse its fields; the client
	// gets a 502 that blames the LB's configuration, not a 400.
	other, _ := auth.New("another-cluster-secret", "test")
	_, srv2, reg := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, Secret: other})
	code, out := post(t, srv2.URL+"/generate", `{"text":"a"}`)
	if code != http.StatusBadGateway || !strings.Contains(out, "cluster secret") || !strings.Contains(out, "does not match") {
		t.Fatalf("mismatched secrets: %d %s", code, out)
	}
	// One pair only: no other pair to retry on.
	if n := metricValue(t, reg, "mooncake_lb_retries_total"); n != 0 {
		t.Fatalf("retries %v with one pair", n)
	}
}

// TestPrefersRoom: a server whose queue is not empty, or whose KV pool is
// full, gets requests only when no other has room.
func TestPrefersRoom(t *testing.T) {
	p := newFake(t, "prefill")
	d1, d2 := newFake(t, "decode"), newFake(t, "decode")
	d1.load.Store(&map[string]any{"queued": 3, "running": 64, "kv_pages_free": 10, "kv_pages_total": 100})
	d2.load.Store(&map[string]any{"queued": 0, "running": 2, "kv_pages_free": 50, "kv_pages_total": 100})
	l, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d1.URL, d2.URL}, Policy: "round_robin"})
	waitFor(t, 2*time.Second, func() bool { return l.decode[0].load.Load().full() && !l.decode[1].load.Load().full() })
	for i := range 4 {
		if code, _ := post(t, srv.URL+"/generate", `{"text":"x"}`); code != 200 {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	if n1, n2 := d1.count(), d2.count(); n1 != 0 || n2 != 4 {
		t.Fatalf("full decode got %d requests, the one with room %d", n1, n2)
	}
	// d2's pool fills: both are full, so both are used again.
	d2.load.Store(&map[string]any{"queued": 0, "running": 2, "kv_pages_free": 0, "kv_pages_total": 100})
	waitFor(t, 2*time.Second, func() bool { return l.decode[1].load.Load().full() })
	for i := range 4 {
		if code, _ := post(t, srv.URL+"/generate", `{"text":"x"}`); code != 200 {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	// round_robin takes d1 first; a server counts as having room again
	// once a request on it ended after its check, so the split may vary.
	if n1, n2 := d1.count(), d2.count(); n1 == 0 || n2 < 4 || n1+n2 != 8 {
		t.Fatalf("all full: decodes got %d and %d requests, want both used", n1, n2)
	}
}

// TestRoomBackWhenARequestEnds: a server full at its check has room again
// once one of the LB's requests on it ends, before the next check.
func TestRoomBackWhenARequestEnds(t *testing.T) {
	b, err := newBackend("decode", 0, "http://127.0.0.1:1", 0)
	if err != nil {
		t.Fatal(err)
	}
	if b.full() {
		t.Fatal("full before any check")
	}
	b.inflight.Store(2)
	b.load.Store(&load{Queued: 1, PagesTotal: 10, PagesFree: 5, inflight: 2})
	if !b.full() {
		t.Fatal("not full with a queue at its check")
	}
	b.inflight.Add(1) // another request sent (all servers full)
	if !b.full() {
		t.Fatal("not full after a request was added")
	}
	b.inflight.Add(-2)
	if b.full() {
		t.Fatal("still full after a request ended")
	}
	// Cached pages are room; pages held by requests are not.
	b.load.Store(&load{PagesTotal: 10, PagesFree: 0, PagesCached: 3, inflight: 1})
	if b.full() {
		t.Fatal("full with only cached pages")
	}
	b.load.Store(&load{PagesTotal: 10, PagesFree: 0, PagesCached: 0, inflight: 1})
	if !b.full() {
		t.Fatal("not full with no page free or cached")
	}
}

// TestRetryOnPrefillFailure: a prefill that fails before any token (503,
// 500, refused connection) is replaced once; the decode request of the
// failed attempt is canceled.
func TestRetryOnPrefillFailure(t *testing.T) {
	for _, c := range []struct {
		name, cause string
		fail        func(w http.ResponseWriter, r *http.Request)
	}{
		{"overloaded", "overloaded", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(503)
			w.Write([]byte(`{"error":{"message":"engine: overloaded","code":503}}`))
		}},
		{"error", "error", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(500) }},
		{"unreachable", "unreachable", func(w http.ResponseWriter, r *http.Request) {
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			bad, good := newFake(t, "prefill"), newFake(t, "prefill")
			d := newFake(t, "decode")
			bad.setGen(func(w http.ResponseWriter, r *http.Request) {
				// Fail once the decode holds the room, as a real prefill would.
				for end := time.Now().Add(5 * time.Second); d.count() == 0 && time.Now().Before(end); {
					time.Sleep(time.Millisecond)
				}
				c.fail(w, r)
			})
			// The decode answers only once its room's prefill answered, as a
			// real one does: the failed attempt's request must be canceled.
			var canceled atomic.Int32
			goodRooms := make(chan any, 4)
			d.setGen(func(w http.ResponseWriter, r *http.Request) {
				d.mu.Lock()
				room := d.bodies[len(d.bodies)-1]["bootstrap_room"]
				d.mu.Unlock()
				deadline := time.After(5 * time.Second)
				for {
					good.mu.Lock()
					served := false
					for _, b := range good.bodies {
						served = served || b["bootstrap_room"] == room
					}
					good.mu.Unlock()
					if served {
						goodRooms <- room
						w.Header().Set("Content-Type", "text/event-stream")
						w.Write([]byte("data: {\"text\":\"a\"}\n\ndata: [DONE]\n\n"))
						return
					}
					select {
					case <-r.Context().Done():
						canceled.Add(1)
						return
					case <-deadline:
						w.WriteHeader(504)
						return
					case <-time.After(5 * time.Millisecond):
					}
				}
			})
			_, srv, reg := startLB(t, Config{Prefill: []string{bad.URL, good.URL}, Decode: []string{d.URL}, Policy: "round_robin"})
			// Round robin: the first request goes to the bad prefill first.
			if code, out := post(t, srv.URL+"/generate", `{"text":"x","stream":true}`); code != 200 || !strings.Contains(out, "[DONE]") {
				t.Fatalf("got %d %s", code, out)
			}
			if n := metricValue(t, reg, "mooncake_lb_retries_total", "role", "prefill", "cause", c.cause); n != 1 {
				t.Fatalf("retries{prefill,%s} = %v, want 1", c.cause, n)
			}
			waitFor(t, 5*time.Second, func() bool { return canceled.Load() == 1 })
			if bad.count() != 1 || good.count() != 1 || d.count() != 2 {
				t.Fatalf("bad prefill %d, good prefill %d, decode %d requests", bad.count(), good.count(), d.count())
			}
		})
	}
}

// TestRetryOnce: when the second pair fails too, the request fails with
// both causes; a 4xx (the client's error) is not retried.
func TestRetryOnce(t *testing.T) {
	p1, p2 := newFake(t, "prefill"), newFake(t, "prefill")
	for _, p := range []*fakeServer{p1, p2} {
		p.setGen(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(503)
			w.Write([]byte(`{"error":{"message":"engine: overloaded: 64 requests queued","code":503}}`))
		})
	}
	d := newFake(t, "decode")
	d.release = make(chan struct{})
	_, srv, reg := startLB(t, Config{Prefill: []string{p1.URL, p2.URL}, Decode: []string{d.URL}})
	code, out := post(t, srv.URL+"/generate", `{"text":"x"}`)
	if code != 503 || strings.Count(out, "overloaded") != 2 || !strings.Contains(out, p1.URL) || !strings.Contains(out, p2.URL) {
		t.Fatalf("two overloaded prefills: %d %s", code, out)
	}
	if n := metricValue(t, reg, "mooncake_lb_retries_total"); n != 1 {
		t.Fatalf("retries %v, want 1", n)
	}
	p1.setGen(nil)
	p2.setGen(nil)
	p1.fail.Store(true)
	p2.fail.Store(true)
	code, out = post(t, srv.URL+"/generate", `{"text":""}`)
	if code != 400 || !strings.Contains(out, "prompt is empty") || p1.count()+p2.count() != 3 {
		t.Fatalf("client error: %d %s after %d prefill requests", code, out, p1.count()+p2.count())
	}
}

// sseStub is a decode server whose /generate is gen.
func sseStub(t *testing.T, health func(w http.ResponseWriter, r *http.Request), gen func(w http.ResponseWriter, r *http.Request)) *httptest.Server {
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			if health != nil {
				health(w, r)
			}
		case "/get_server_info":
			w.Write([]byte(`{"disaggregation_mode":"decode"}`))
		case "/generate":
			io.Copy(io.Discard, r.Body)
			gen(w, r)
		}
	}))
	t.Cleanup(s.Close)
	return s
}

// TestUpstreamIdle: a decode that stalls mid-stream is ended with an error
// event after the idle timeout; one that stalls before answering gets the
// client a 504; an answer sent whole is bound by its server's health.
func TestUpstreamIdle(t *testing.T) {
	const idle = 500 * time.Millisecond
	const gap = idle / 4 // between a live stream's events
	stalled := make(chan struct{})
	t.Cleanup(func() { close(stalled) })
	stall := func(r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-stalled:
		}
	}
	p := newFake(t, "prefill")

	t.Run("mid-stream", func(t *testing.T) {
		d := sseStub(t, nil, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			for i := range 5 { // alive for longer than idle, then stalls
				fmt.Fprintf(w, "data: {\"text\":\"%d\"}\n\n", i)
				w.(http.Flusher).Flush()
				time.Sleep(gap)
			}
			stall(r)
		})
		_, srv, reg := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, UpstreamIdleTimeout: idle})
		start := time.Now()
		lastByte := 4 * gap
		code, out := post(t, srv.URL+"/generate", `{"text":"x","stream":true}`)
		el := time.Since(start)
		if code != 200 || !strings.Contains(out, `data: {"text":"4"}`) || !strings.Contains(out, `data: {"error"`) || !strings.Contains(out, "no bytes for 500ms") ||
			strings.Contains(out, "[DONE]") {
			t.Fatalf("stalled stream: %d %q", code, out)
		}
		if el < lastByte+idle || el > 5*time.Second {
			t.Fatalf("stalled stream ended after %v, want about %v", el, lastByte+idle)
		}
		if n := metricValue(t, reg, "mooncake_lb_upstream_idle_timeouts_total", "stage", "mid_response"); n != 1 {
			t.Fatalf("idle timeouts mid_response = %v", n)
		}
		if n := counterValue(t, reg, "504"); n != 1 {
			t.Fatalf("requests{504} = %v", n)
		}
	})

	t.Run("before response", func(t *testing.T) {
		d := sseStub(t, nil, func(w http.ResponseWriter, r *http.Request) { stall(r) })
		_, srv, reg := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, UpstreamIdleTimeout: idle})
		code, out := post(t, srv.URL+"/generate", `{"text":"x","stream":true}`)
		if code != 504 || !strings.Contains(out, "answered nothing") {
			t.Fatalf("silent decode: %d %s", code, out)
		}
		if n := metricValue(t, reg, "mooncake_lb_upstream_idle_timeouts_total", "stage", "before_response"); n != 1 {
			t.Fatalf("idle timeouts before_response = %v", n)
		}
	})

	t.Run("whole answer, server alive", func(t *testing.T) {
		const idle = 1500 * time.Millisecond // many health checks in it, even on a loaded machine
		d := sseStub(t, nil, func(w http.ResponseWriter, r *http.Request) {
			time.Sleep(2 * idle) // a long generation, sent whole
			w.Write([]byte(`{"text":"done"}`))
		})
		_, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, UpstreamIdleTimeout: idle, HealthInterval: idle / 10})
		if code, out := post(t, srv.URL+"/generate", `{"text":"x"}`); code != 200 || out != `{"text":"done"}` {
			t.Fatalf("slow whole answer of a healthy server: %d %s", code, out)
		}
	})

	t.Run("whole answer, server stopped", func(t *testing.T) {
		var stopped atomic.Bool
		d := sseStub(t, func(w http.ResponseWriter, r *http.Request) {
			if stopped.Load() {
				stall(r)
			}
		}, func(w http.ResponseWriter, r *http.Request) {
			stopped.Store(true) // as a SIGSTOPped process: no answers at all
			stall(r)
		})
		_, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, UpstreamIdleTimeout: idle, HealthInterval: idle / 5})
		start := time.Now()
		code, out := post(t, srv.URL+"/generate", `{"text":"x"}`)
		if code != 504 || !strings.Contains(out, "no passed health check") || time.Since(start) > 5*time.Second {
			t.Fatalf("stopped server: %d %s after %v", code, out, time.Since(start))
		}
	})
}

// TestHTTPServerReadTimeout: the LB's server bounds a slow request body
// but not a stream that lasts longer than the bound.
func TestHTTPServerReadTimeout(t *testing.T) {
	const read = 400 * time.Millisecond
	p := newFake(t, "prefill")
	d := sseStub(t, nil, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 5 {
			fmt.Fprintf(w, "data: {\"text\":\"%d\"}\n\n", i)
			w.(http.Flusher).Flush()
			time.Sleep(read / 2)
		}
		w.Write([]byte("data: [DONE]\n\n"))
	})
	l, _, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, HTTPReadTimeout: read})
	hs := l.HTTPServer()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go hs.Serve(ln)
	t.Cleanup(func() { hs.Close() })
	url := "http://" + ln.Addr().String()

	if code, out := post(t, url+"/generate", `{"text":"x","stream":true}`); code != 200 || !strings.Contains(out, "data: [DONE]") {
		t.Fatalf("stream of %v through a server with a %v read timeout: %d %q", 5*read/2, read, code, out)
	}
	// A body that trickles in slower than the bound.
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"text\":")
	start := time.Now()
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !strings.Contains(string(b), "reading request body") {
			t.Fatalf("slow body: %d %s", resp.StatusCode, b)
		}
	} else if ne := (net.Error)(nil); errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("slow body: no answer within 5s")
	}
	if el := time.Since(start); el > read+2*time.Second {
		t.Fatalf("slow body cut after %v, want about %v", el, read)
	}
}

// TestDecode502BlamesPrefill: a decode's 502 says its own upstream, the
// prefill, failed it: the retry goes to another prefill.
func TestDecode502BlamesPrefill(t *testing.T) {
	p1, p2 := newFake(t, "prefill"), newFake(t, "prefill")
	p1.load.Store(&map[string]any{"bootstrap_port": 1111})
	p2.load.Store(&map[string]any{"bootstrap_port": 2222})
	d := newFake(t, "decode")
	d.setGen(func(w http.ResponseWriter, r *http.Request) {
		d.mu.Lock()
		port := d.bodies[len(d.bodies)-1]["bootstrap_port"]
		d.mu.Unlock()
		if port == float64(1111) {
			w.WriteHeader(502)
			w.Write([]byte(`{"error":{"message":"disagg: prefill server unreachable","code":502}}`))
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.Write([]byte("data: {\"text\":\"a\"}\n\ndata: [DONE]\n\n"))
	})
	l, srv, reg := startLB(t, Config{Prefill: []string{p1.URL, p2.URL}, Decode: []string{d.URL}, Policy: "round_robin"})
	waitFor(t, 2*time.Second, func() bool {
		return l.prefill[0].bootstrapPort.Load() == 1111 && l.prefill[1].bootstrapPort.Load() == 2222
	})
	if code, out := post(t, srv.URL+"/generate", `{"text":"x","stream":true}`); code != 200 {
		t.Fatalf("got %d %s", code, out)
	}
	if n := metricValue(t, reg, "mooncake_lb_retries_total", "role", "prefill", "cause", "unreachable"); n != 1 {
		t.Fatalf("retries{prefill,unreachable} = %v, want 1", n)
	}
}
