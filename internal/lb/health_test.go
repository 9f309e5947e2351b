package lb

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// logged is the entries with message msg whose url field is url.
func logged(logs *observer.ObservedLogs, msg, url string) []observer.LoggedEntry {
	var out []observer.LoggedEntry
	for _, e := range logs.FilterMessage(msg).All() {
		if e.ContextMap()["url"] == url {
			out = append(out, e)
		}
	}
	return out
}

func getJSON(t *testing.T, url string) (int, map[string]any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		t.Fatalf("GET %s: %d, not JSON: %v", url, resp.StatusCode, err)
	}
	return resp.StatusCode, m
}

// TestRoleCheck: a server whose /get_server_info says another mode than its
// flag (a prefill given as --decode, a colocated server as --prefill) is
// refused, with the reason logged once and on /get_server_info; requests go
// to the others.
func TestRoleCheck(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	p, colocated := newFake(t, "prefill"), newFake(t, "null")
	d, wrong := newFake(t, "decode"), newFake(t, "prefill")
	l, srv, _ := startLBWith(t, Config{Prefill: []string{p.URL, colocated.URL}, Decode: []string{wrong.URL, d.URL}, Policy: "round_robin",
		Logger: zap.New(core)}, []*fakeServer{p, d})
	time.Sleep(5 * l.cfg.HealthInterval) // several checks
	for _, c := range []struct {
		f    *fakeServer
		want string
	}{
		{wrong, `its /get_server_info says disaggregation_mode "prefill" (a prefill server), but it was given as --decode`},
		{colocated, `its /get_server_info says disaggregation_mode "null" (a colocated server), but it was given as --prefill`},
	} {
		es := logged(logs, "server refused: not routing to it", c.f.URL)
		if len(es) != 1 || es[0].Level != zapcore.ErrorLevel || es[0].ContextMap()["reason"] != c.want {
			t.Fatalf("%s: logged %v, want one error with reason %q", c.f.URL, es, c.want)
		}
	}
	for range 4 {
		if code, out := post(t, srv.URL+"/generate", `{"text":"x"}`); code != 200 {
			t.Fatalf("%d %s", code, out)
		}
	}
	// The answer comes from the decode; the prefill's copy may still be on its way.
	waitFor(t, 5*time.Second, func() bool { return p.count() == 4 })
	if wrong.count() != 0 || colocated.count() != 0 || p.count() != 4 || d.count() != 4 {
		t.Fatalf("requests: refused %d and %d, the others %d and %d", wrong.count(), colocated.count(), p.count(), d.count())
	}
	_, info := getJSON(t, srv.URL+"/get_server_info")
	dec := info["decode"].([]any)[0].(map[string]any)
	if dec["healthy"] != false || dec["index"] != float64(0) || dec["url"] != wrong.URL || !strings.Contains(dec["reason"].(string), "given as --decode") {
		t.Fatalf("/get_server_info decode[0]: %v", dec)
	}
	// A server fixed (restarted with the right mode) is used again.
	wrong.setMode("decode")
	waitFor(t, 5*time.Second, func() bool { return l.decode[0].usable() })
	if es := logged(logs, "server healthy again: routing to it", wrong.URL); len(es) != 1 {
		t.Fatalf("recovery logged %d times", len(es))
	}
}

// TestStateChangesLogged: one line per change of a server's state, with the
// reason: healthy, unhealthy (why), unhealthy for another reason, healthy
// again; none while it stays the same.
func TestStateChangesLogged(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	l, _, _ := startLBWith(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, Logger: zap.New(core)}, nil)
	iv := l.cfg.HealthInterval
	if es := logged(logs, "server healthy: routing to it", p.URL); len(es) != 1 || es[0].ContextMap()["bootstrap_port"] != int64(9123) {
		t.Fatalf("first verdict: %v", es)
	}
	d.down.Store(true)
	waitFor(t, 5*time.Second, func() bool { return !l.decode[0].healthy.Load() })
	time.Sleep(4 * iv)
	es := logged(logs, "server became unhealthy: not routing to it", d.URL)
	if len(es) != 1 || es[0].ContextMap()["reason"] != "/health answered 503" || es[0].ContextMap()["role"] != "decode" || es[0].ContextMap()["index"] != int64(0) {
		t.Fatalf("healthy -> unhealthy: %v", es)
	}
	d.setMode("null")
	d.down.Store(false)
	waitFor(t, 5*time.Second, func() bool { return len(logged(logs, "server refused: not routing to it", d.URL)) == 1 })
	d.setMode("decode")
	waitFor(t, 5*time.Second, func() bool { return l.decode[0].healthy.Load() })
	time.Sleep(4 * iv)
	if n := len(logged(logs, "server healthy again: routing to it", d.URL)); n != 1 {
		t.Fatalf("healthy again logged %d times", n)
	}
	if n := len(logs.FilterField(zap.String("url", d.URL)).All()); n != 4 {
		t.Fatalf("%d lines about the decode, want 4: %v", n, logs.FilterField(zap.String("url", d.URL)).All())
	}
}

// TestBootstrapPortFlag: a bootstrap port given on the command line is the
// one the LB sends; one that differs from the server's is logged once.
func TestBootstrapPortFlag(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	p1, p2, d := newFake(t, "prefill"), newFake(t, "prefill"), newFake(t, "decode")
	p2.load.Store(&map[string]any{"bootstrap_port": nil}) // reports none
	l, srv, _ := startLBWith(t, Config{Prefill: []string{p1.URL, p2.URL}, PrefillBootstrapPorts: []int{7777, 8888}, Decode: []string{d.URL},
		Policy: "round_robin", Logger: zap.New(core)}, nil)
	time.Sleep(4 * l.cfg.HealthInterval)
	for range 2 {
		if code, out := post(t, srv.URL+"/generate", `{"text":"x"}`); code != 200 {
			t.Fatalf("%d %s", code, out)
		}
	}
	waitFor(t, 5*time.Second, func() bool { return p1.count() == 1 && p2.count() == 1 }) // the prefills' copies may end after the answers
	if b1, b2 := p1.last(), p2.last(); b1["bootstrap_port"] != float64(7777) || b2["bootstrap_port"] != float64(8888) {
		t.Fatalf("bootstrap ports sent: %v and %v", b1["bootstrap_port"], b2["bootstrap_port"])
	}
	es := logged(logs, "the bootstrap port given on the command line is not the one the prefill reports: using the command line's", p1.URL)
	if len(es) != 1 || es[0].ContextMap()["flag"] != int64(7777) || es[0].ContextMap()["reported"] != int64(9123) {
		t.Fatalf("mismatch logged: %v", es)
	}
	if es := logged(logs, "the bootstrap port given on the command line is not the one the prefill reports: using the command line's", p2.URL); len(es) != 0 {
		t.Fatalf("a prefill that reports no port: %v", es)
	}
	if _, err := New(Config{Prefill: []string{p1.URL}, PrefillBootstrapPorts: []int{1, 2}, Decode: []string{d.URL}}); err == nil ||
		!strings.Contains(err.Error(), "--prefill-bootstrap-ports") {
		t.Fatalf("two ports for one prefill: %v", err)
	}
}

// TestJSONErrors: unknown paths and methods get the {"error": ...} every
// other error has.
func TestJSONErrors(t *testing.T) {
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	_, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}})
	for _, c := range []struct {
		method, path string
		code         int
		msg          string
	}{
		{"GET", "/nope", 404, "no such endpoint: GET /nope"},
		{"POST", "/v1/embeddings", 404, "no such endpoint: POST /v1/embeddings"},
		{"GET", "/generate", 405, "method GET not allowed on /generate (use POST)"},
		{"POST", "/health", 405, "method POST not allowed on /health (use GET)"},
	} {
		req, _ := http.NewRequest(c.method, srv.URL+c.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body struct {
			Error struct {
				Message string  `json:"message"`
				Type    string  `json:"type"`
				Param   *string `json:"param"`
				Code    int     `json:"code"`
			} `json:"error"`
		}
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != c.code || body.Error.Code != c.code || body.Error.Message != c.msg || body.Error.Type == "" ||
			resp.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("%s %s: %d %+v %v", c.method, c.path, resp.StatusCode, body, err)
		}
	}
}

// TestHealthGenerate: /health_generate asks every server; 200 when a
// prefill and a decode of their roles generated.
func TestHealthGenerate(t *testing.T) {
	p, d1, d2 := newFake(t, "prefill"), newFake(t, "decode"), newFake(t, "decode")
	l, srv, _ := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d1.URL, d2.URL}})
	status := func() int {
		resp, err := http.Get(srv.URL + "/health_generate")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := status(); code != 200 {
		t.Fatalf("every server can generate: %d", code)
	}
	d1.healthGen.Store(503)
	if code := status(); code != 200 {
		t.Fatalf("one decode can generate: %d", code)
	}
	d2.healthGen.Store(503)
	code, m := getJSON(t, srv.URL+"/health_generate")
	if s, _ := m["servers"].([]any); len(s) != 3 {
		t.Fatalf("outcomes of %d servers: %v", len(s), m)
	}
	e, _ := m["error"].(map[string]any)
	if code != 503 || e == nil || !strings.Contains(e["message"].(string), "no prefill/decode pair can generate") ||
		!strings.Contains(e["message"].(string), "decode server "+d2.URL+": health check generation failed: engine stopped") {
		t.Fatalf("no decode can generate: %d %v", code, m)
	}
	for _, s := range m["servers"].([]any) {
		o := s.(map[string]any)
		if o["role"] == "decode" && o["status"] != float64(503) {
			t.Fatalf("outcome %v", o)
		}
	}
	// A decode of the wrong role does not count, whatever it answers.
	d1.healthGen.Store(0)
	d1.setMode("prefill")
	waitFor(t, 5*time.Second, func() bool { return !l.decode[0].healthy.Load() })
	if code, m := getJSON(t, srv.URL+"/health_generate"); code != 503 || !strings.Contains(m["error"].(map[string]any)["message"].(string), "refused") {
		t.Fatalf("a refused decode: %d %v", code, m)
	}
}

// TestMetricLabelsBounded: no URL is a label value; per-server series are
// by role and index.
func TestMetricLabelsBounded(t *testing.T) {
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	_, srv, reg := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, Policy: "cache_aware"})
	post(t, srv.URL+"/generate", `{"text":"x"}`)
	post(t, srv.URL+"/generate", `{"text":["x","y"]}`)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := 0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
				if strings.Contains(lp.GetValue(), "://") || strings.Contains(lp.GetValue(), "127.0.0.1") {
					t.Fatalf("%s{%s=%q}: a URL as a label value", mf.GetName(), lp.GetName(), lp.GetValue())
				}
			}
			if mf.GetName() == "mooncake_lb_backend_healthy" {
				seen++
				if len(labels) != 2 || labels["index"] != "0" || (labels["role"] != "prefill" && labels["role"] != "decode") {
					t.Fatalf("mooncake_lb_backend_healthy labels %v", labels)
				}
			}
		}
	}
	if seen != 2 {
		t.Fatalf("%d mooncake_lb_backend_healthy series, want 2", seen)
	}
}

// TestSlowChecks: a healthy server that misses a check's bound keeps its
// requests until slowChecks checks in a row timed out; a wrong answer
// takes it out at once.
func TestSlowChecks(t *testing.T) {
	p, d := newFake(t, "prefill"), newFake(t, "decode")
	reg := prometheus.NewRegistry()
	l, err := New(Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, HealthInterval: 50 * time.Millisecond, Registerer: reg, Gatherer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, b := context.Background(), l.decode[0]
	l.checkOne(ctx, b)
	if !b.healthy.Load() {
		t.Fatalf("decode unhealthy: %v", b.why.Load())
	}
	d.stall.Store(int64(time.Second))
	for i := 1; i < slowChecks; i++ {
		if l.checkOne(ctx, b); !b.healthy.Load() {
			t.Fatalf("taken out after %d timed-out checks", i)
		}
	}
	if l.checkOne(ctx, b); b.healthy.Load() || !strings.Contains(b.why.Load().Msg, "deadline") {
		t.Fatalf("still healthy after %d timed-out checks (why %v)", slowChecks, b.why.Load())
	}
	d.stall.Store(0)
	if l.checkOne(ctx, b); !b.healthy.Load() {
		t.Fatalf("answers again but unhealthy: %v", b.why.Load())
	}
	d.stall.Store(int64(time.Second))
	l.checkOne(ctx, b) // one timeout: still in
	d.stall.Store(0)
	d.down.Store(true)
	if l.checkOne(ctx, b); b.healthy.Load() {
		t.Fatal("a server answering 503 kept its requests")
	}
}
