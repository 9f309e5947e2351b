package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// dialTrap is a TCP listener that counts the connections it gets: a
// bootstrap address a client chose, which no server may dial.
type dialTrap struct {
	ln    net.Listener
	conns atomic.Int32
}

func newDialTrap(t *testing.T) *dialTrap {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d := &dialTrap{ln: ln}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			d.conns.Add(1)
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return d
}

func (d *dialTrap) port() int { return d.ln.Addr().(*net.TCPAddr).Port }

// postRaw posts body as it is (duplicate keys, escapes) and reads the answer.
func postRaw(t *testing.T, url, body string, h http.Header) *result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range h {
		req.Header[k] = v
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	r := &result{Status: resp.StatusCode}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		if err := readSSE(resp.Body, r); err != nil {
			t.Fatalf("POST %s: %v", url, err)
		}
		return r
	}
	raw, _ := io.ReadAll(resp.Body)
	r.Raw = string(raw)
	if err := json.Unmarshal(raw, r); err != nil {
		t.Fatalf("POST %s: status %d, body %q: %v", url, resp.StatusCode, raw, err)
	}
	r.Status = resp.StatusCode
	return r
}

// smuggled are the bootstrap fields a client may try to set, in every
// spelling encoding/json matches, pointing at host:port; each is a list of
// members to put in a /generate body.
func smuggled(port int) map[string]string {
	h, p := `"127.0.0.1"`, strconv.Itoa(port)
	return map[string]string{
		"exact":      `"bootstrap_host":` + h + `,"bootstrap_port":` + p + `,"bootstrap_room":12345`,
		"upper":      `"BOOTSTRAP_HOST":` + h + `,"BOOTSTRAP_PORT":` + p + `,"BOOTSTRAP_ROOM":12345`,
		"mixed":      `"Bootstrap_Host":` + h + `,"bootstrap_PORT":` + p + `,"BootStrap_Room":12346`,
		"escapes":    `"bootstrap\u005fhost":` + h + `,"\u0062ootstrap_port":` + p + `,"bootstrap_r\u006Fom":12347`,
		"long s":     `"bootſtrap_host":` + h + `,"BOOTſTRAP_PORT":` + p + `,"boot\u017ftrap_room":12348`,
		"duplicates": `"bootstrap_host":"10.9.9.9","bootstrap_host":` + h + `,"bootstrap_port":1,"Bootstrap_Port":` + p,
		"nested":     `"sampling_params":{"max_new_tokens":4,"ignore_eos":true,"bootstrap_host":` + h + `,"bootstrap_port":` + p + `},"bootstrap_host.x":` + h + `,"sampling_params.bootstrap_port":` + p,
	}
}

// TestLBBootstrapFields: bootstrap fields a client smuggles in, however
// spelt, never make a server dial out through the LB: the request is served
// by the LB's own pair. Sent directly to a decode server they get a 400
// naming the LB, again with no dial; a prefill server asked directly does
// too, unless it runs with --allow-direct-requests.
func TestLBBootstrapFields(t *testing.T) {
	base := []string{"--page-size", "16", "--max-total-tokens", "8192"}
	p := serve(t, serveOpts{name: "prefill", mode: "prefill", args: base})
	d := serve(t, serveOpts{name: "decode", mode: "decode", args: base})
	l := lb(t, "lb", []*server{p}, []*server{d})
	trap := newDialTrap(t)
	pFree, dFree := p.freePages(t), d.freePages(t)

	n := 0
	for name, members := range smuggled(trap.port()) {
		for _, stream := range []bool{false, true} {
			body := `{"text":"Once upon a time",` + members + `,"stream":` + strconv.FormatBool(stream) + `,"sampling_params":{"max_new_tokens":4,"ignore_eos":true}}`
			if name == "nested" {
				body = `{"text":"Once upon a time",` + members + `,"stream":` + strconv.FormatBool(stream) + `}`
			}
			r := postRaw(t, l.url+"/generate", body, nil)
			if name == "nested" {
				// Not bootstrap fields at all: names the API does not know,
				// which the servers refuse (the client's 400, passed on).
				if r.Status != 400 || r.Error == nil || !strings.Contains(r.Error.Message, "unknown field") {
					t.Fatalf("nested (stream %v) through the LB: status %d %s, want the servers' 400 for unknown fields", stream, r.Status, r.Raw)
				}
				continue
			}
			if r.Status != 200 || r.Error != nil || r.StreamErr != "" || len(r.IDs) == 0 || stream != r.Done {
				t.Fatalf("%s (stream %v) through the LB: status %d %s %q, %d tokens", name, stream, r.Status, r.Raw, r.StreamErr, len(r.IDs))
			}
			n++
		}
	}
	if c := trap.conns.Load(); c != 0 {
		t.Fatalf("servers dialled the client's bootstrap address %d times", c)
	}
	// All of them went through the LB's pair: the decode got its KV from
	// the prefill for each.
	if v := d.metric(t, `mooncake_disagg_requests_total{mode="decode",result="success"}`); int(v) != n {
		t.Fatalf("decode served %v disaggregated requests, want %d", v, n)
	}

	// Directly to the decode server: 400 naming the LB, no dial, no page.
	for name, members := range smuggled(trap.port()) {
		for _, h := range []http.Header{nil, {"X-Mooncake-Bootstrap-Voucher": {"v1.1." + strings.Repeat("0", 64)}}} {
			r := postRaw(t, d.url+"/generate", `{"text":"Once upon a time",`+members+`}`, h)
			if name == "nested" { // no top-level bootstrap field: unknown names
				if r.Status != 400 || r.Error == nil || !strings.Contains(r.Error.Message, "unknown field") {
					t.Fatalf("nested fields directly to decode: %d %s", r.Status, r.Raw)
				}
				continue
			}
			// Exact names without a voucher: refused naming the LB; other
			// spellings are no fields of the API: refused as unknown.
			if r.Status != 400 || r.Error == nil || !(strings.Contains(r.Error.Message, "bootstrap fields are set only by mooncake-go lb") ||
				name != "exact" && strings.Contains(r.Error.Message, "unknown field")) {
				t.Fatalf("%s directly to decode (voucher %v): %d %s", name, h != nil, r.Status, r.Raw)
			}
		}
	}
	if c := trap.conns.Load(); c != 0 {
		t.Fatalf("decode dialled the client's bootstrap address %d times", c)
	}
	d.waitFreePages(t, dFree, 5*time.Second)

	// A plain /generate straight to the prefill server.
	r := postRaw(t, p.url+"/generate", `{"text":"Once upon a time","sampling_params":{"max_new_tokens":4}}`, nil)
	if r.Status != 400 || r.Error == nil || !strings.Contains(r.Error.Message, "this is a prefill server: send requests to mooncake-go lb") {
		t.Fatalf("direct /generate to prefill: %d %s", r.Status, r.Raw)
	}
	if v := p.metric(t, "mooncake_engine_prefill_tokens_total"); v == 0 {
		t.Fatalf("the prefill computed nothing for the LB's requests")
	}
	before := p.metric(t, "mooncake_engine_prefill_tokens_total")
	r = postRaw(t, p.url+"/v1/completions", `{"prompt":"Once upon a time","max_tokens":4}`, nil)
	if r.Status != 400 || r.Error == nil || !strings.Contains(r.Error.Message, "mooncake-go lb") {
		t.Fatalf("direct /v1/completions to prefill: %d %s", r.Status, r.Raw)
	}
	if v := p.metric(t, "mooncake_engine_prefill_tokens_total"); v != before {
		t.Fatalf("the prefill computed %v tokens of refused requests", v-before)
	}
	p.waitFreePages(t, pFree, 5*time.Second)

	// With --allow-direct-requests the prefill server serves it itself.
	pd := serve(t, serveOpts{name: "prefill-direct", mode: "prefill", args: append(append([]string{}, base...), "--allow-direct-requests")})
	r = postRaw(t, pd.url+"/generate", `{"text":"Once upon a time","sampling_params":{"max_new_tokens":4,"ignore_eos":true}}`, nil)
	if r.Status != 200 || len(r.IDs) != 4 {
		t.Fatalf("direct /generate to a prefill with --allow-direct-requests: %d %s", r.Status, r.Raw)
	}
	if !strings.Contains(pd.logText(), "allow-direct-requests") {
		t.Errorf("the prefill with --allow-direct-requests did not warn about it at start")
	}
}

// TestLBUpstreamIdle: a decode server stopped mid-stream (SIGSTOP) ends
// the client's stream through the LB with an error event within
// --upstream-idle-timeout; once it runs again, the LB routes to it.
func TestLBUpstreamIdle(t *testing.T) {
	const idle = 2 * time.Second
	base := []string{"--page-size", "16", "--max-total-tokens", "8192"}
	p := serve(t, serveOpts{name: "prefill", mode: "prefill", args: base})
	d := serve(t, serveOpts{name: "decode", mode: "decode", args: base})
	l := lb(t, "lb", []*server{p}, []*server{d}, "--upstream-idle-timeout", idle.String())
	dFree := d.freePages(t)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	body := `{"text":"Once upon a time","stream":true,"sampling_params":{"max_new_tokens":3000,"ignore_eos":true}}`
	hreq, _ := http.NewRequestWithContext(ctx, http.MethodPost, l.url+"/generate", strings.NewReader(body))
	resp, err := client.Do(hreq)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	buf := make([]byte, 4096)
	for got := 0; got < 3; {
		n, err := resp.Body.Read(buf)
		got += bytes.Count(buf[:n], []byte("data:"))
		if err != nil {
			t.Fatalf("stream ended after %d events: %v", got, err)
		}
	}
	pid := d.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGCONT) })
	r := &result{}
	done := make(chan error, 1)
	go func() { done <- readSSE(resp.Body, r) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("reading the stream: %v", err)
		}
	case <-time.After(idle + slack):
		t.Fatalf("the stream of a stopped decode did not end within %v", idle+slack)
	}
	el := time.Since(stopped)
	if r.Done || !strings.Contains(r.StreamErr, "stalled") || !strings.Contains(r.StreamErr, "upstream-idle-timeout") {
		t.Fatalf("stream of a stopped decode: [DONE] %v, error event %q", r.Done, r.StreamErr)
	}
	t.Logf("stream ended %v after SIGSTOP: %s", el, r.StreamErr)
	if v := l.metric(t, `mooncake_lb_upstream_idle_timeouts_total{stage="mid_response"}`); v != 1 {
		t.Fatalf("mooncake_lb_upstream_idle_timeouts_total{stage=mid_response} = %v, want 1", v)
	}

	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	l.waitHealthy(t, 10*time.Second)
	res, err := generate(context.Background(), l.url, map[string]any{"text": "Once upon a time", "stream": true,
		"sampling_params": map[string]any{"max_new_tokens": 8, "ignore_eos": true}})
	mustOK(t, "a request after the decode resumed", res, err)
	if !res.Done || len(res.IDs) != 8 {
		t.Fatalf("after resume: [DONE] %v, %d tokens", res.Done, len(res.IDs))
	}
	// The ended request was aborted on decode when it resumed: its pages
	// come back.
	d.waitFreePages(t, dFree, 10*time.Second)
	if v := l.metric(t, `mooncake_lb_requests_total{code="504"}`); v != 1 {
		t.Errorf("LB counted %v requests with code 504, want 1", v)
	}
}
