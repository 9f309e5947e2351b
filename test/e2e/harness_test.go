// Package e2e runs mooncake-go as real processes: colocated, 1P1D and 2P2D
// behind the load balancer, over shm and tcp, across two network
// namespaces, and under faults (kill -9, failed transfers, clients that
// leave). TestMain builds the binary once; every process runs in its own
// process group and is killed when its test ends.
//
// Tests that need ../shared (stories260K and its reference outputs) skip
// with a message when it is missing; MOONCAKE_SHARED overrides the path.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
)

// bin is the mooncake-go binary TestMain built.
var bin string

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		fmt.Println("e2e: skipped in -short mode")
		os.Exit(0)
	}
	dir, err := os.MkdirTemp("", "mooncake-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "mooncake-go")
	build := exec.Command("go", "build", "-o", bin, "github.com/mooncake-go/mooncake-go/cmd/mooncake-go")
	build.Stdout, build.Stderr = os.Stdout, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e: building mooncake-go:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// sharedDir is ../shared (MOONCAKE_SHARED), or skips.
func sharedDir(t *testing.T) string {
	sharedtest.Stories260K(t)
	return sharedtest.Dir(t)
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// proc is a process started by a test.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	mu   sync.Mutex
	dead bool
}

// start runs argv (bin is the default program) in its own process group,
// its output in a log file; the test's cleanup kills it.
func start(t *testing.T, name string, env []string, argv ...string) *proc {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	f.Close()
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("--- %s log (last lines) ---\n%s", name, p.tail(40))
		}
	})
	return p
}

// kill sends SIGKILL to the process group and waits for the process.
func (p *proc) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dead {
		return
	}
	p.dead = true
	syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
	}
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) tail(n int) string {
	b, _ := os.ReadFile(p.log)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (p *proc) logText() string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// server is a running serve or lb.
type server struct {
	*proc
	url string
}

// serveOpts says how to start one serve.
type serveOpts struct {
	name    string
	mode    string // null, prefill, decode
	model   string // "" = built-in
	host    string // default 127.0.0.1
	netns   string // run inside this network namespace
	env     []string
	args    []string // extra flags
	timeout time.Duration
}

// modelArgs are the flags for stories260K from the shared folder.
func storiesArgs(shared string) []string {
	return []string{"--model-path", filepath.Join(shared, "models", "stories260K", "stories260K.bin"),
		"--tokenizer-path", filepath.Join(shared, "models", "stories260K", "tok512.bin")}
}

func serve(t *testing.T, o serveOpts) *server {
	t.Helper()
	host := o.host
	if host == "" {
		host = "127.0.0.1"
	}
	mode := o.mode
	if mode == "" {
		mode = "null"
	}
	port := freePort(t)
	args := []string{bin, "serve", "--host", host, "--port", strconv.Itoa(port), "--threads", "1",
		"--disaggregation-mode", mode, "--disaggregation-bootstrap-port", "0", "--log-level", "info"}
	if o.model != "" {
		args = append(args, "--model-path", o.model)
	}
	args = append(args, o.args...)
	if o.netns != "" {
		args = append([]string{"ip", "netns", "exec", o.netns}, args...)
	}
	s := &server{proc: start(t, o.name, o.env, args...), url: "http://" + net.JoinHostPort(host, strconv.Itoa(port))}
	s.waitHealthy(t, 30*time.Second)
	return s
}

// lb starts a load balancer over the servers.
func lb(t *testing.T, name string, prefill, decode []*server, args ...string) *server {
	t.Helper()
	port := freePort(t)
	argv := []string{bin, "lb", "--port", strconv.Itoa(port), "--health-check-interval", "200ms"}
	for _, p := range prefill {
		argv = append(argv, "--prefill", p.url)
	}
	for _, d := range decode {
		argv = append(argv, "--decode", d.url)
	}
	argv = append(argv, args...)
	s := &server{proc: start(t, name, nil, argv...), url: "http://127.0.0.1:" + strconv.Itoa(port)}
	s.waitHealthy(t, 30*time.Second)
	return s
}

var client = &http.Client{Timeout: 60 * time.Second}

func (s *server) waitHealthy(t *testing.T, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		resp, err := client.Get(s.url + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		if s.exited() {
			t.Fatalf("%s exited before it was healthy:\n%s", s.name, s.tail(30))
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not healthy within %v (last: %v):\n%s", s.name, within, err, s.tail(30))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// info is /get_server_info.
func (s *server) info(t *testing.T) map[string]any {
	t.Helper()
	resp, err := client.Get(s.url + "/get_server_info")
	if err != nil {
		t.Fatalf("%s /get_server_info: %v", s.name, err)
	}
	defer resp.Body.Close()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		t.Fatalf("%s /get_server_info: %v", s.name, err)
	}
	return m
}

// freePages is the server's free KV pages plus those only its prefix
// cache holds (evictable: not leaked).
func (s *server) freePages(t *testing.T) int {
	t.Helper()
	info := s.info(t)
	v, ok := info["kv_pages_free"].(float64)
	if !ok {
		t.Fatalf("%s: /get_server_info has no kv_pages_free", s.name)
	}
	if c, ok := info["kv_pages_cached"].(float64); ok {
		v += c
	}
	return int(v)
}

// waitFreePages waits until the server's free (or only cached) page count
// is want.
func (s *server) waitFreePages(t *testing.T, want int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		got := s.freePages(t)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d free KV pages %v after the test, want %d (pages leaked)", s.name, got, within, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// metrics scrapes /metrics into "name{labels}" -> value (labels as
// Prometheus prints them, sorted).
func (s *server) metrics(t *testing.T) map[string]float64 {
	t.Helper()
	resp, err := client.Get(s.url + "/metrics")
	if err != nil {
		t.Fatalf("%s /metrics: %v", s.name, err)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		out[line[:i]] = v
	}
	return out
}

// metric is one series' value (0 when absent).
func (s *server) metric(t *testing.T, series string) float64 {
	t.Helper()
	return s.metrics(t)[series]
}

// waitMetric waits until cond holds for the series' value.
func (s *server) waitMetric(t *testing.T, series string, within time.Duration, cond func(float64) bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		v := s.metric(t, series)
		if cond(v) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s = %v, condition not met within %v", s.name, series, v, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// result is a /generate answer (or its error).
type result struct {
	Status   int
	Text     string `json:"text"`
	IDs      []int  `json:"output_ids"`
	MetaInfo struct {
		FinishReason        map[string]any `json:"finish_reason"`
		PromptTokens        int            `json:"prompt_tokens"`
		CachedTokens        int            `json:"cached_tokens"`
		OutputTokenLogprobs [][3]any       `json:"output_token_logprobs"`
		OutputTopLogprobs   [][][3]any     `json:"output_top_logprobs"`
	} `json:"meta_info"`
	Error *struct {
		Message string `json:"message"`
		Code    int    `json:"code"`
	} `json:"error"`
	// Streaming only.
	Events    int
	Done      bool   // saw [DONE]
	StreamErr string // the message of an error event
	Took      time.Duration
	Raw       string
}

// generate posts a /generate body and reads the answer, streamed or not.
func generate(ctx context.Context, url string, body map[string]any) (*result, error) {
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/generate", bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	r := &result{Status: resp.StatusCode}
	stream, _ := body["stream"].(bool)
	if !stream || resp.StatusCode != 200 {
		raw, err := io.ReadAll(resp.Body)
		r.Took, r.Raw = time.Since(start), string(raw)
		if err != nil {
			return r, err
		}
		if err := json.Unmarshal(raw, r); err != nil {
			return r, fmt.Errorf("status %d, body %q: %w", resp.StatusCode, raw, err)
		}
		r.Status = resp.StatusCode
		return r, nil
	}
	err = readSSE(resp.Body, r)
	r.Took = time.Since(start)
	return r, err
}

// readSSE reads events into r: the last data object, [DONE], errors.
func readSSE(body io.Reader, r *result) error {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data:") {
			continue
		}
		data := strings.TrimSpace(strings.TrimPrefix(line, "data:"))
		if data == "[DONE]" {
			r.Done = true
			continue
		}
		r.Events++
		var ev result
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return fmt.Errorf("bad event %q: %w", data, err)
		}
		if ev.Error != nil {
			r.StreamErr = ev.Error.Message
			continue
		}
		r.Text, r.IDs, r.MetaInfo = ev.Text, ev.IDs, ev.MetaInfo
	}
	return sc.Err()
}

// mustOK fails unless r is a 200 with no error.
func mustOK(t *testing.T, what string, r *result, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if r.Status != 200 || r.Error != nil || r.StreamErr != "" {
		t.Fatalf("%s: status %d, body %s, stream error %q", what, r.Status, r.Raw, r.StreamErr)
	}
}
