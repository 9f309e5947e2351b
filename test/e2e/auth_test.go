package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
)

// proofDeadline is the most an engine waits for a peer's proof (the brief
// allows 5 s; the engine uses 3 s).
const proofDeadline = 5 * time.Second

// transferSegment is a serve's transfer segment (host:port).
func (s *server) transferSegment(t *testing.T) string {
	t.Helper()
	seg, _ := s.info(t)["transfer_segment"].(string)
	if seg == "" {
		t.Fatalf("%s: /get_server_info has no transfer_segment", s.name)
	}
	return seg
}

// incarnation is the engine incarnation a serve logged at start.
func (s *server) incarnation(t *testing.T) string {
	t.Helper()
	m := regexp.MustCompile(`engine started.*"incarnation": "([0-9a-f]+)"`).FindStringSubmatch(s.logText())
	if m == nil {
		t.Fatalf("%s: no incarnation in the log", s.name)
	}
	return m[1]
}

// vmRSS is a process's resident set in bytes (/proc/PID/status).
func vmRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^VmRSS:\s+(\d+) kB`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("no VmRSS in /proc/%d/status", pid)
	}
	kb, _ := strconv.ParseInt(string(m[1]), 10, 64)
	return kb << 10
}

// nobodyBinary copies the binary where uid 65534 can run it.
func nobodyBinary(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mooncake-e2e-nobody-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "mooncake-go")
	if err := os.WriteFile(p, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestAuthOtherUID: a process of another user (uid 65534) runs the
// transfer bench against a colocated serve, over shm and tcp, reading and
// writing. The serve's engine accepts none of its connections (so no lane,
// no fd, no byte), the bench learns nothing of the serve's descriptor, and
// both sides say "authentication failed".
func TestAuthOtherUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skipf("running a process as uid 65534 needs root (euid %d)", os.Geteuid())
	}
	s := serve(t, serveOpts{name: "serve"})
	seg, inc := s.transferSegment(t), s.incarnation(t)
	nb := nobodyBinary(t)
	secretDir := "/tmp/mooncake-go-65534"
	if _, err := os.Stat(secretDir); os.IsNotExist(err) {
		t.Cleanup(func() { os.RemoveAll(secretDir) })
	}
	for _, proto := range []string{"shm", "tcp"} {
		for _, op := range []string{"read", "write"} {
			t.Run(proto+"/"+op, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				cmd := exec.CommandContext(ctx, nb, "bench", "transfer", "--mode", "initiator", "--segment-id", seg,
					"--protocol", proto, "--operation", op, "--buffer-size", "1048576", "--block-size", "4096",
					"--batch-size", "4", "--threads", "1", "--duration", "1s")
				cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=/nonexistent"}
				cmd.Dir = "/"
				cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
				out, err := cmd.CombinedOutput()
				t.Logf("uid 65534 bench: %v\n%s", err, out)
				if err == nil {
					t.Fatal("the bench of another user succeeded")
				}
				if !strings.Contains(string(out), "authentication failed") || !strings.Contains(string(out), "--cluster-token") {
					t.Fatal("the bench does not say authentication failed and what to do")
				}
				for _, secret := range []string{inc, "@mooncake-shm-", `"regions"`, "boot_id"} {
					if strings.Contains(string(out), secret) {
						t.Fatalf("the bench learnt %q of the serve's descriptor", secret)
					}
				}
			})
		}
	}
	if v := s.metric(t, `mooncake_transfer_handshakes_total{result="accepted"}`); v != 0 {
		t.Fatalf("the serve accepted %v connections", v)
	}
	s.waitMetric(t, `mooncake_transfer_handshakes_total{result="auth_failed"}`, 5*time.Second, func(v float64) bool { return v >= 4 })
	if !strings.Contains(s.logText(), "authentication failed") || !strings.Contains(s.logText(), "does not hold this cluster secret") {
		t.Fatal("the serve's log does not say authentication failed")
	}
}

// TestAuthHalfOpenFlood: 1000 connections that start a handshake and never
// prove anything (half send part of a hello, half declare a 16 MiB hello and
// send 256 KiB of it) raise a serve's RSS by less than 64 MiB, are all
// closed within the proof deadline, and an authenticated peer gets in
// afterwards.
func TestAuthHalfOpenFlood(t *testing.T) {
	const n = 1000
	s := serve(t, serveOpts{name: "serve"})
	seg := s.transferSegment(t)
	pid := s.cmd.Process.Pid
	before := vmRSS(t, pid)
	// magic, a hello frame declaring 200 bytes, 20 of them.
	half := append([]byte("MCG2"), binary.BigEndian.AppendUint32(nil, 200)...)
	half = append(half, []byte(`{"kind":"ctl","name":`)...)
	// magic, a hello frame declaring 16 MiB, 256 KiB of them.
	big := append([]byte("MCG2"), binary.BigEndian.AppendUint32(nil, 16<<20)...)
	big = append(big, make([]byte, 256<<10)...)
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		longest time.Duration
		late    atomic.Int32
		peak    atomic.Int64
	)
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() { // the serve's RSS, every 20 ms, while the flood lasts
		defer close(sampled)
		for {
			if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
				if m := regexp.MustCompile(`(?m)^VmRSS:\s+(\d+) kB`).FindSubmatch(b); m != nil {
					kb, _ := strconv.ParseInt(string(m[1]), 10, 64)
					if kb<<10 > peak.Load() {
						peak.Store(kb << 10)
					}
				}
			}
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range n {
		c, err := net.DialTimeout("tcp", seg, 5*time.Second)
		if err != nil {
			t.Fatalf("dial %d: %v", len(conns), err)
		}
		conns = append(conns, c)
		opened := time.Now()
		c.SetDeadline(opened.Add(3 * proofDeadline))
		wg.Go(func() {
			if i%2 == 0 {
				c.Write(half)
			} else {
				c.Write(big) // fails once the serve hangs up
			}
			io.Copy(io.Discard, c)
			el := time.Since(opened)
			mu.Lock()
			longest = max(longest, el)
			mu.Unlock()
			if el > proofDeadline {
				late.Add(1)
			}
		})
	}
	wg.Wait()
	close(stop)
	<-sampled
	t.Logf("RSS %d MiB before, at most %d MiB during %d half-open handshakes; the last closed %v after it opened",
		before>>20, peak.Load()>>20, n, longest.Round(time.Millisecond))
	if grew := peak.Load() - before; grew >= 64<<20 {
		t.Errorf("RSS grew by %d MiB", grew>>20)
	}
	if late.Load() > 0 {
		t.Errorf("%d connections were open longer than %v", late.Load(), proofDeadline)
	}
	m := s.metrics(t)
	busy, failed := m[`mooncake_transfer_handshakes_total{result="busy"}`], m[`mooncake_transfer_handshakes_total{result="error"}`]
	t.Logf("refused at accept (busy): %v, failed handshakes: %v", busy, failed)
	if busy+failed != n || m[`mooncake_transfer_handshakes_total{result="accepted"}`] != 0 {
		t.Errorf("handshakes: busy %v + error %v, want %d; accepted %v", busy, failed, n, m[`mooncake_transfer_handshakes_total{result="accepted"}`])
	}
	// A peer with the secret (this user's) gets in.
	e, err := transfer.New(context.Background(), transfer.Config{Transports: []transfer.Transport{tcp.New(tcp.Config{})}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, err := e.OpenSegment(context.Background(), seg); err != nil {
		t.Fatalf("an authenticated peer after the flood: %v", err)
	}
	s.waitMetric(t, `mooncake_transfer_handshakes_total{result="accepted"}`, 5*time.Second, func(v float64) bool { return v == 1 })
}

// registryProc is a running `mooncake-go registry`.
type registryProc struct {
	*proc
	url string // http://127.0.0.1:port/metadata
}

func startRegistry(t *testing.T, name string, args ...string) *registryProc {
	t.Helper()
	port := freePort(t)
	argv := append([]string{bin, "registry", "--port", strconv.Itoa(port)}, args...)
	r := &registryProc{proc: start(t, name, nil, argv...), url: "http://127.0.0.1:" + strconv.Itoa(port) + "/metadata"}
	(&server{proc: r.proc, url: "http://127.0.0.1:" + strconv.Itoa(port)}).waitHealthy(t, 10*time.Second)
	return r
}

// raw sends an unsigned request for key and returns the status and body.
func (r *registryProc) raw(t *testing.T, method, key string, body []byte) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, r.url+"?key="+url.QueryEscape(key), bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// forger listens where a forged descriptor points, counting what reaches it.
type forger struct {
	ln    net.Listener
	conns atomic.Int32
	bytes atomic.Int64
}

func newForger(t *testing.T) *forger {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &forger{ln: ln}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			f.conns.Add(1)
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(10 * time.Second))
				n, _ := io.Copy(io.Discard, c)
				f.bytes.Add(n)
			}()
		}
	}()
	return f
}

// pdThrough starts a prefill, a decode and an LB with --metadata-server
// meta.
func pdThrough(t *testing.T, meta string) (p, d, l *server) {
	t.Helper()
	args := []string{"--page-size", "16", "--max-total-tokens", "8192", "--metadata-server", meta}
	p = serve(t, serveOpts{name: "prefill", mode: "prefill", args: args})
	d = serve(t, serveOpts{name: "decode", mode: "decode", args: args})
	l = lb(t, "lb", []*server{p}, []*server{d})
	return p, d, l
}

func shortRequest(t *testing.T, l *server) *result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), requestBound+slack)
	defer cancel()
	r, err := generate(ctx, l.url, map[string]any{"text": "Once upon a time", "sampling_params": map[string]any{"max_new_tokens": 4}})
	if err != nil && r == nil {
		t.Fatalf("request: %v", err)
	}
	return r
}

// TestAuthRegistry: a `mooncake-go registry` refuses unsigned reads and
// writes, while PD through it works; behind a registry run with
// --insecure-no-cluster-token (which anyone can write), a forged descriptor
// of the decode (pointing at a fake engine) and a garbage one make the
// prefill's push fail with the named error as the request's cause, no byte
// reaches the forger, and the next request after the real descriptor is
// back succeeds.
func TestAuthRegistry(t *testing.T) {
	t.Run("signed", func(t *testing.T) {
		reg := startRegistry(t, "registry")
		_, d, l := pdThrough(t, reg.url)
		key := "mooncake/ram/" + d.transferSegment(t)
		for _, method := range []string{"GET", "PUT", "DELETE"} {
			code, body := reg.raw(t, method, key, []byte(`{"name":"x","incarnation":"y"}`))
			var e struct {
				Error struct{ Message string } `json:"error"`
			}
			if code != http.StatusUnauthorized || json.Unmarshal(body, &e) != nil || !strings.Contains(e.Error.Message, "signed") {
				t.Fatalf("unsigned %s: %d %s, want 401 with a JSON error", method, code, body)
			}
		}
		r := shortRequest(t, l)
		mustOK(t, "PD through the signed registry", r, nil)
	})
	t.Run("insecure", func(t *testing.T) {
		reg := startRegistry(t, "registry", "--insecure-no-cluster-token")
		_, d, l := pdThrough(t, reg.url)
		seg := d.transferSegment(t)
		key := "mooncake/ram/" + seg
		code, orig := reg.raw(t, "GET", key, nil)
		if code != 200 {
			t.Fatalf("get %s: %d %s", key, code, orig)
		}
		f := newForger(t)
		var desc map[string]any
		if err := json.Unmarshal(orig, &desc); err != nil {
			t.Fatal(err)
		}
		desc["addr"] = f.ln.Addr().String()
		forged, _ := json.Marshal(desc)
		for _, tc := range []struct {
			what  string
			value []byte
			says  string
		}{
			{"forged", forged, "does not match"},
			{"garbage", []byte(`{"name": "truncated`), "not a descriptor"},
		} {
			if code, body := reg.raw(t, "PUT", key, tc.value); code != 200 {
				t.Fatalf("insecure put: %d %s", code, body)
			}
			r := shortRequest(t, l)
			mustFail(t, r, "bad descriptor", key, tc.says)
		}
		if f.conns.Load() != 0 || f.bytes.Load() != 0 {
			t.Fatalf("the forger got %d connections, %d bytes", f.conns.Load(), f.bytes.Load())
		}
		if code, body := reg.raw(t, "PUT", key, orig); code != 200 {
			t.Fatalf("restore: %d %s", code, body)
		}
		r := shortRequest(t, l)
		mustOK(t, "PD after the real descriptor is back", r, nil)
	})
}
