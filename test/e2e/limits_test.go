package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// What a serve accepts over HTTP is bounded: a request must arrive within
// --http-read-timeout, a prompt that cannot fit the context is refused before
// it costs memory, the admission queue holds --max-queued-requests, and what
// the server does not implement is refused by name.

// procKiB reads a /proc/PID/status field in KiB (VmRSS, VmHWM).
func procKiB(t *testing.T, pid int, field string) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			if err != nil {
				t.Fatalf("%s: %q", field, line)
			}
			return n
		}
	}
	t.Fatalf("/proc/%d/status has no %s", pid, field)
	return 0
}

// openFDs counts the process's open file descriptors.
func openFDs(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// errorParam is the param of a JSON error body ("" if none).
func errorParam(body string) string {
	var e struct {
		Error struct {
			Param *string `json:"param"`
		} `json:"error"`
	}
	if json.Unmarshal([]byte(body), &e) != nil || e.Error.Param == nil {
		return ""
	}
	return *e.Error.Param
}

// TestLimitsStalledBody: connections whose body never comes (Content-Length 1000, 10
// bytes sent) are answered 408 and closed within --http-read-timeout; none is kept.
func TestLimitsStalledBody(t *testing.T) {
	const rt = 2 * time.Second
	s := serve(t, serveOpts{name: "serve", args: []string{"--http-read-timeout", rt.String()}})
	addr := strings.TrimPrefix(s.url, "http://")
	pid := s.cmd.Process.Pid
	base := openFDs(t, pid)

	const n = 200
	conns := make([]net.Conn, n)
	for i := range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"text\": \"")
		conns[i] = c
	}
	sent := time.Now()
	held := openFDs(t, pid)
	var wg sync.WaitGroup
	errs := make(chan string, n)
	closedAt := make([]time.Duration, n)
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.SetReadDeadline(sent.Add(rt + 5*time.Second))
			out, err := io.ReadAll(c)
			closedAt[i] = time.Since(sent)
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				errs <- fmt.Sprintf("conn %d still open after %v", i, closedAt[i])
				return
			}
			if !bytes.HasPrefix(out, []byte("HTTP/1.1 408")) {
				errs <- fmt.Sprintf("conn %d: %q", i, out)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	slowest := time.Duration(0)
	for _, d := range closedAt {
		slowest = max(slowest, d)
	}
	if slowest > rt+2*time.Second {
		t.Fatalf("the last stalled connection closed %v after its headers (read timeout %v)", slowest, rt)
	}
	// The server's descriptors go back to what it had.
	deadline := time.Now().Add(5 * time.Second)
	for openFDs(t, pid) > base+5 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	after := openFDs(t, pid)
	if after > base+5 {
		t.Fatalf("server fds: %d before, %d with %d stalled connections, %d after", base, held, n, after)
	}
	t.Logf("%d stalled connections: server fds %d -> %d -> %d; all closed within %v", n, base, held, after, slowest)
	r, err := postGenerate(t, s.url, `{"text": "hi", "sampling_params": {"max_new_tokens": 2}}`)
	mustOK(t, "after", r, err)
}

// postGenerate posts a /generate body given as JSON text.
func postGenerate(t *testing.T, url, body string) (*result, error) {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatal(err)
	}
	return generate(t.Context(), url, m)
}

// postTimed posts body and returns the status, the body and how long it took.
func postTimed(t *testing.T, url, body string) (int, string, http.Header, time.Duration) {
	t.Helper()
	start := time.Now()
	resp, err := client.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header, time.Since(start)
}

// TestLimitsHugePrompt: an 8 MB prompt for a 4096-token context is refused with 400 in
// under a second, costing the server under 100 MiB, on every endpoint.
func TestLimitsHugePrompt(t *testing.T) {
	s := serve(t, serveOpts{name: "serve"})
	pid := s.cmd.Process.Pid
	big := strings.Repeat("abcdefgh ", (8<<20-200)/9)
	for _, c := range []struct{ path, body, param string }{
		{"/generate", `{"text": "` + big + `"}`, "text"},
		{"/v1/completions", `{"prompt": "` + big + `"}`, "prompt"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "` + big + `"}]}`, "messages"},
	} {
		rss, hwm := procKiB(t, pid, "VmRSS"), procKiB(t, pid, "VmHWM")
		status, body, _, took := postTimed(t, s.url+c.path, c.body)
		rss2, hwm2 := procKiB(t, pid, "VmRSS"), procKiB(t, pid, "VmHWM")
		if status != 400 || errorParam(body) != c.param || !strings.Contains(body, "context length (4096 tokens)") {
			t.Fatalf("%s: %d %.300s", c.path, status, body)
		}
		t.Logf("%s (%d bytes): 400 in %v; RSS %+d KiB, peak %+d KiB", c.path, len(c.body), took, rss2-rss, hwm2-hwm)
		if took > time.Second {
			t.Errorf("%s: refused after %v", c.path, took)
		}
		if rss2-rss > 100<<10 || hwm2-hwm > 100<<10 {
			t.Errorf("%s: RSS grew %d KiB (peak %d KiB)", c.path, rss2-rss, hwm2-hwm)
		}
	}
	// Eight at once.
	rss := procKiB(t, pid, "VmRSS")
	var wg sync.WaitGroup
	statuses := make([]int, 8)
	start := time.Now()
	for i := range statuses {
		wg.Add(1)
		go func() {
			defer wg.Done()
			statuses[i], _, _, _ = postTimed(t, s.url+"/generate", `{"text": "`+big+`"}`)
		}()
	}
	wg.Wait()
	took, grew := time.Since(start), procKiB(t, pid, "VmRSS")-rss
	t.Logf("8 at once: %v, statuses %v, RSS %+d KiB", took, statuses, grew)
	for _, st := range statuses {
		if st != 400 {
			t.Fatalf("statuses %v", statuses)
		}
	}
	if grew > 512<<10 {
		t.Fatalf("8 huge prompts at once grew the RSS by %d MiB", grew>>10)
	}
	r, err := postGenerate(t, s.url, `{"text": "hi", "sampling_params": {"max_new_tokens": 2}}`)
	mustOK(t, "after", r, err)
}

// TestLimitsQueue: with one running request and a full queue, the next request gets
// 503 with Retry-After and a JSON error; the queued one still runs.
func TestLimitsQueue(t *testing.T) {
	s := serve(t, serveOpts{name: "serve", args: []string{"--max-running-requests", "1", "--max-queued-requests", "1"}})
	long := map[string]any{"text": longPrompt, "sampling_params": map[string]any{"max_new_tokens": 16, "ignore_eos": true}}
	running := send(t, s.url, long)
	waitInfo(t, s, "running", 1)
	queued := send(t, s.url, map[string]any{"text": "hi", "sampling_params": map[string]any{"max_new_tokens": 2}})
	waitInfo(t, s, "queued", 1)
	for _, p := range []struct{ path, body string }{
		{"/generate", `{"text": "a"}`},
		{"/v1/completions", `{"prompt": "a", "stream": true}`},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}]}`},
	} {
		status, body, h, _ := postTimed(t, s.url+p.path, p.body)
		if status != 503 || h.Get("Retry-After") == "" || !strings.Contains(body, "queued (max 1)") || h.Get("Content-Type") != "application/json" {
			t.Fatalf("%s past the queue: %d, Retry-After %q: %s", p.path, status, h.Get("Retry-After"), body)
		}
		t.Logf("%s: 503, Retry-After %s: %s", p.path, h.Get("Retry-After"), strings.TrimSpace(body))
	}
	r := running.wait(t, 60*time.Second)
	mustOK(t, "running", r, nil)
	mustOK(t, "queued", queued.wait(t, 60*time.Second), nil)
}

// waitInfo waits until /get_server_info's key is want.
func waitInfo(t *testing.T, s *server, key string, want float64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		v, _ := s.info(t)[key].(float64)
		if v == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s = %v, want %v", s.name, key, v, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestLimitsFields: a real server refuses unknown and unsupported fields and
// wrong-typed token ids, naming them by their API path.
func TestLimitsFields(t *testing.T) {
	s := serve(t, serveOpts{name: "serve"})
	for _, c := range []struct{ path, body, param string }{
		{"/generate", `{"text": "a", "sampling_params": {"json_schema": "{}"}}`, "sampling_params.json_schema"},
		{"/generate", `{"text": "a", "sampling_params": {"temperature": "hot"}}`, "sampling_params.temperature"},
		{"/generate", `{"text": "a", "sampling_params": {"temprature": 0.5}}`, "sampling_params.temprature"},
		{"/generate", `{"input_ids": ["a"]}`, "input_ids"},
		{"/generate", `{"input_ids": [[1, 2.5]]}`, "input_ids"},
		{"/v1/completions", `{"prompt": "a", "max_tokens": "8"}`, "max_tokens"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 7}]}`, "messages[1].content"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}}`, "response_format"},
	} {
		status, body, _, _ := postTimed(t, s.url+c.path, c.body)
		if status != 400 || errorParam(body) != c.param {
			t.Errorf("%s %s: %d %s", c.path, c.body, status, body)
		}
	}
}
