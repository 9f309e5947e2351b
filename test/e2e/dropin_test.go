package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// reference is ../shared's greedy reference for stories260K.
func reference(t *testing.T, shared string) (prompt string, next []int) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(shared, "reference", "stories260K-greedy.json"))
	if err != nil {
		t.Fatal(err)
	}
	var ref struct {
		Cases []struct {
			Prompt string `json:"prompt"`
			Next   []int  `json:"greedy_next_ids"`
		} `json:"cases"`
	}
	if err := json.Unmarshal(b, &ref); err != nil || len(ref.Cases) == 0 {
		t.Fatalf("reference: %v", err)
	}
	return ref.Cases[0].Prompt, ref.Cases[0].Next
}

// TestSGLangPDGuide runs the commands of SGLang's PD disaggregation guide (Mooncake,
// Llama single node) with mooncake-go's name, on stories260K, with free ports in
// place of 30000, 30001 and 8998; then curl, the openai npm client and the metrics
// SGLang's dashboards read, through the LB.
func TestSGLangPDGuide(t *testing.T) {
	shared := sharedDir(t)
	modelPath := filepath.Join(shared, "models", "stories260K", "stories260K.bin") // tok512.bin is found beside it
	pp, dp := freePort(t), freePort(t)
	prefill := &server{url: "http://127.0.0.1:" + strconv.Itoa(pp), proc: start(t, "prefill", nil, bin, "serve",
		"--model-path", modelPath, "--disaggregation-mode", "prefill", "--port", strconv.Itoa(pp), "--disaggregation-ib-device", "mlx5_roce0",
		"--disaggregation-bootstrap-port", "0", "--threads", "1")}
	decode := &server{url: "http://127.0.0.1:" + strconv.Itoa(dp), proc: start(t, "decode", nil, bin, "serve",
		"--model-path", modelPath, "--disaggregation-mode", "decode", "--port", strconv.Itoa(dp), "--base-gpu-id", "1",
		"--disaggregation-ib-device", "mlx5_roce0", "--threads", "1")}
	prefill.waitHealthy(t, 30*time.Second)
	decode.waitHealthy(t, 30*time.Second)
	l := lb(t, "lb", []*server{prefill}, []*server{decode})

	// A named RDMA device that is not there (no HCA on this machine) is
	// warned once under the auto backend, and KV moves by another transport.
	for _, s := range []*server{prefill, decode} {
		if n := strings.Count(s.logText(), "--disaggregation-ib-device names a device that is not usable"); n != 1 {
			t.Errorf("%s: %d warnings about --disaggregation-ib-device, want 1", s.name, n)
		}
	}
	if out, _ := exec.Command(bin, "topo").Output(); strings.HasPrefix(string(out), "no NVIDIA GPU") &&
		!strings.Contains(decode.logText(), "--base-gpu-id have no effect on the cpu backend") {
		t.Errorf("decode: no warning that --base-gpu-id has no effect on the cpu backend")
	}

	// The guide's request, with SGLang's /generate: the reference's greedy tokens.
	prompt, want := reference(t, shared)
	maxNew := 24
	r, err := generate(context.Background(), l.url, map[string]any{"text": prompt,
		"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": maxNew}})
	mustOK(t, "generate through the LB", r, err)
	if n := min(len(want), maxNew); !slices.Equal(r.IDs[:min(len(r.IDs), n)], want[:n]) {
		t.Fatalf("output_ids %v, reference %v", r.IDs, want[:n])
	}

	// curl, as the guide's users send it.
	if _, err := exec.LookPath("curl"); err == nil {
		body := fmt.Sprintf(`{"text": %q, "sampling_params": {"temperature": 0, "max_new_tokens": %d}}`, prompt, maxNew)
		out, err := exec.Command("curl", "-s", "--max-time", "60", l.url+"/generate", "-H", "Content-Type: application/json", "-d", body).Output()
		var c result
		if err != nil || json.Unmarshal(out, &c) != nil || c.Text != r.Text {
			t.Errorf("curl: %v %s, want text %q", err, out, r.Text)
		}
	} else {
		t.Log("no curl: the curl part is skipped")
	}

	// The openai npm client through the LB (n > 1 waits for the LB to send it whole).
	if node, npm := openaiClient(t); node != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, node, "client.mjs")
		cmd.Dir = filepath.Join("..", "openai")
		cmd.Env = append(os.Environ(), "OPENAI_NPM_DIR="+npm, "BASE_URL="+l.url+"/v1", "MODEL="+modelPath, "NO_N=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("openai client through the LB: %v\n%s", err, out)
		}
	}

	// SGLang's metrics: the decode counts every output token of its requests, the first
	// (sampled by the prefill) included, and the KV bytes it received; the prefill
	// counts the prompts; health checks are not requests.
	reqs := decode.metric(t, `sglang:num_requests_total{model_name="`+modelPath+`"}`)
	for _, s := range []*server{prefill, decode} {
		if st, body := getStatus(t, s.url+"/health_generate"); st != 200 {
			t.Fatalf("%s /health_generate: %d %s", s.name, st, body)
		}
	}
	dm, pm := decode.metrics(t), prefill.metrics(t)
	label := `{model_name="` + modelPath + `"}`
	if got := dm["sglang:num_requests_total"+label]; got != reqs || got < 2 {
		t.Errorf("decode: %v requests after health checks (%v before), want them unchanged and at least 2", got, reqs)
	}
	// r, curl's and the client's requests: at least r's tokens, and whole requests.
	if g := dm["sglang:generation_tokens_total"+label]; g < float64(len(r.IDs)) || dm["sglang:prompt_tokens_total"+label] != 0 {
		t.Errorf("decode: generation tokens %v (want at least %d), prompt tokens %v (want 0)", g, len(r.IDs), dm["sglang:prompt_tokens_total"+label])
	}
	if pm["sglang:generation_tokens_total"+label] != 0 || pm["sglang:prompt_tokens_total"+label] < float64(r.MetaInfo.PromptTokens) {
		t.Errorf("prefill: generation %v (want 0), prompt %v (want at least %d)", pm["sglang:generation_tokens_total"+label],
			pm["sglang:prompt_tokens_total"+label], r.MetaInfo.PromptTokens)
	}
	if b := dm[`mooncake_disagg_transfer_bytes_total{mode="decode"}`]; b <= 0 {
		t.Errorf("decode: %v KV bytes received", b)
	}
	if dm["sglang:time_to_first_token_seconds_count"+label] < 1 || dm["sglang:token_usage"+label] < 0 {
		t.Errorf("decode: TTFT count %v", dm["sglang:time_to_first_token_seconds_count"+label])
	}
}

// getStatus is a GET's status and body.
func getStatus(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := client.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b := make([]byte, 4096)
	n, _ := resp.Body.Read(b)
	return resp.StatusCode, string(b[:n])
}

// openaiClient is node and the openai npm package (scripts/npm-openai.sh), or "".
func openaiClient(t *testing.T) (node, npm string) {
	node, err := exec.LookPath("node")
	if err != nil {
		t.Log("node not found: the openai client part is skipped")
		return "", ""
	}
	npm = os.Getenv("MOONCAKE_NPM_OPENAI_DIR")
	if npm == "" {
		npm, _ = filepath.Abs(filepath.Join("..", "..", ".cache", "npm-openai"))
	}
	if _, err := os.Stat(filepath.Join(npm, "node_modules", "openai", "package.json")); err != nil {
		t.Logf("the openai npm package is not in %s (scripts/npm-openai.sh): the openai client part is skipped", npm)
		return "", ""
	}
	return node, npm
}

// TestSGLangFlagsProcess: a launch script with SGLang's flags starts mooncake-go
// serve (the no-ops warned once each), and serve refuses what it cannot do in words.
func TestSGLangFlagsProcess(t *testing.T) {
	port := freePort(t)
	s := &server{url: "http://127.0.0.1:" + strconv.Itoa(port), proc: start(t, "serve", nil, bin, "serve", "--port", strconv.Itoa(port),
		"--trust-remote-code", "--context-length", "256", "--watchdog-timeout", "600", "--decode-log-interval", "40",
		"--enable-metrics", "--dp-size", "1", "--tp", "1", "--disable-radix-cache", "--mem-fraction-static", "0.8",
		"--cuda-graph-bs", "1", "2", "4", "--threads", "1", "--served-model-name", "llama")}
	s.waitHealthy(t, 30*time.Second)
	var args map[string]any
	st, body := getStatus(t, s.url+"/get_server_args")
	if err := json.Unmarshal([]byte(body), &args); st != 200 || err != nil {
		t.Fatalf("get_server_args: %d %v %s", st, err, body)
	}
	if args["context_length"] != float64(256) || args["tp_size"] != float64(1) || args["disable_radix_cache"] != true ||
		args["chunked_prefill_size"] != float64(512) || args["disable_overlap_schedule"] != false {
		t.Errorf("get_server_args: %s", body)
	}
	for _, f := range []string{"--trust-remote-code", "--watchdog-timeout", "--decode-log-interval", "--cuda-graph-bs"} {
		if n := strings.Count(s.logText(), f+" has no effect here"); n != 1 {
			t.Errorf("%d warnings naming %s, want 1:\n%s", n, f, s.tail(30))
		}
	}
	// --context-length caps the context: a 300-token prompt is refused.
	r, err := generate(context.Background(), s.url, map[string]any{"input_ids": slices.Repeat([]int{5}, 300)})
	if err != nil || r.Status != 400 || !strings.Contains(r.Raw, "context length (256 tokens)") {
		t.Errorf("a prompt beyond --context-length: %v %d %s", err, r.Status, r.Raw)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--tp", "3"}, "8 attention heads do not split over 3 ranks"},
		{[]string{"--tp", "2", "--device", "cuda", "--base-gpu-id", "1000"}, "GPUs 1000..1001"},
		{[]string{"--dp-size", "2", "--disaggregation-mode", "prefill"}, "run 2 prefill servers"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // a serve that starts instead runs until killed
		out, err := exec.CommandContext(ctx, bin, append([]string{"serve", "--port", "0"}, c.args...)...).CombinedOutput()
		cancel()
		if err == nil || !strings.Contains(string(out), c.want) || strings.Contains(string(out), "unknown flag") {
			t.Errorf("serve %v: %v\n%s", c.args, err, out)
		}
	}
}

// TestDataParallel: --dp-size 2 runs two engine replicas behind one server:
// concurrent requests reach both (each its dp_rank series), every answer is
// the reference's greedy tokens, /get_server_info counts both pools, and
// /flush_cache flushes both.
func TestDataParallel(t *testing.T) {
	shared := sharedDir(t)
	modelPath := filepath.Join(shared, "models", "stories260K", "stories260K.bin")
	port := freePort(t)
	s := &server{url: "http://127.0.0.1:" + strconv.Itoa(port), proc: start(t, "serve", nil, bin, "serve", "--port", strconv.Itoa(port),
		"--model-path", modelPath, "--dp-size", "2", "--threads", "2", "--max-total-tokens", "4096")}
	s.waitHealthy(t, 30*time.Second)
	prompt, want := reference(t, shared)
	const maxNew = 16
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := generate(context.Background(), s.url, map[string]any{"text": prompt,
				"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": maxNew}})
			if err != nil || r.Status != 200 {
				t.Errorf("generate: %v %d %s", err, r.Status, r.Raw)
				return
			}
			if n := min(len(want), maxNew); !slices.Equal(r.IDs[:min(len(r.IDs), n)], want[:n]) {
				t.Errorf("output_ids %v, reference %v", r.IDs, want[:n])
			}
		}()
	}
	wg.Wait()
	var r0, r1 float64
	for series, v := range s.metrics(t) {
		switch {
		case strings.HasPrefix(series, `mooncake_engine_requests_total{dp_rank="0"`):
			r0 += v
		case strings.HasPrefix(series, `mooncake_engine_requests_total{dp_rank="1"`):
			r1 += v
		}
	}
	t.Logf("replicas served %v and %v requests", r0, r1)
	if r0 == 0 || r1 == 0 || r0+r1 != 8 {
		t.Errorf("replicas served %v and %v of 8 requests, want both some", r0, r1)
	}
	info := s.info(t)
	if info["dp_size"] != float64(2) || info["kv_pages_total"] != float64(2*4096/64) {
		t.Errorf("get_server_info: dp_size %v, kv_pages_total %v (want 2 and %d)", info["dp_size"], info["kv_pages_total"], 2*4096/64)
	}
	st, body := postJSON(t, s.url+"/flush_cache", "")
	if st != 200 || !strings.Contains(body, "freed_pages") {
		t.Errorf("flush_cache: %d %s", st, body)
	}
}

// TestVersionAndBuild: version names the build's revision and time; make build
// prints no compiler warnings (go-nvml's deprecated NVML calls).
func TestVersionAndBuild(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("no make")
	}
	built := filepath.Join(t.TempDir(), "mooncake-go")
	mk := exec.Command("make", "-s", "--no-print-directory", "build", "BIN="+built)
	mk.Dir = filepath.Join("..", "..")
	if b, err := mk.CombinedOutput(); err != nil {
		t.Fatalf("make build: %v\n%.3000s", err, b)
	}
	out, err := exec.Command(built, "version").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, re := range []string{`(?m)^mooncake-go \S+$`, `(?m)^revision +[0-9a-f]{40}`, `(?m)^time +\d{4}-\d\d-\d\dT`, `(?m)^go +go1\.`} {
		if !regexp.MustCompile(re).Match(out) {
			t.Errorf("version lacks %s:\n%s", re, out)
		}
	}
	// The Makefile's CGO_CFLAGS build go-nvml (forced: -a) without warnings; Go's
	// defaults print its deprecations.
	eval := exec.Command("make", "-s", "--no-print-directory", "--eval", "print-cgo-cflags: ; @echo $(CGO_CFLAGS)", "print-cgo-cflags")
	eval.Dir = filepath.Join("..", "..")
	eval.Env = append(os.Environ(), "CGO_CFLAGS=")
	flags, err := eval.Output()
	if err != nil || !strings.Contains(string(flags), "-Wno-deprecated-declarations") {
		t.Fatalf("the Makefile's CGO_CFLAGS: %v %q", err, flags)
	}
	for _, c := range []struct {
		cflags string
		warns  bool
	}{{strings.TrimSpace(string(flags)), false}, {"-O2 -g", true}} {
		ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
		cmd := exec.CommandContext(ctx, "go", "build", "-a", "-o", os.DevNull, "github.com/NVIDIA/go-nvml/pkg/nvml")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1", "CGO_CFLAGS="+c.cflags)
		b, err := cmd.CombinedOutput()
		cancel()
		if err != nil {
			t.Fatalf("go build go-nvml with %q: %v\n%.2000s", c.cflags, err, b)
		}
		if got := strings.Contains(string(b), "warning:"); got != c.warns {
			t.Errorf("go build go-nvml with CGO_CFLAGS=%q: warnings %v, want %v:\n%.2000s", c.cflags, got, c.warns, b)
		}
	}
}
