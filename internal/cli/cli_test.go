package cli

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	g := &globals{out: &out, errw: &out}
	root := newRoot(g)
	root.SetArgs(normalizeArgs(args))
	err := root.ExecuteContext(context.Background())
	return out.String(), err
}

// Bad flags fail at start with an error naming the flag.
func TestServeFlagErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		flag string
	}{
		{[]string{"--tp-size", "0"}, "--tp-size 0"},
		{[]string{"--tp-size", "3"}, "--tp-size 3"},
		{[]string{"--disaggregation-mode", "both"}, "--disaggregation-mode"},
		{[]string{"--disaggregation-transfer-backend", "rdma"}, "--disaggregation-transfer-backend rdma"},
		{[]string{"--disaggregation-transfer-backend", "carrier-pigeon"}, "--disaggregation-transfer-backend"},
		{[]string{"--device", "tpu"}, "--device"},
		{[]string{"--dtype", "int4"}, "--dtype"},
		{[]string{"--mem-fraction-static", "1.5"}, "--mem-fraction-static"},
		{[]string{"--model-path", "/nonexistent/model"}, "--model-path"},
		{[]string{"--port", "70000"}, "--port"},
		{[]string{"--cuda-graph-max-bs", "0"}, "--cuda-graph-max-bs 0"},
		{[]string{"--max-queued-requests", "0"}, "--max-queued-requests"},
		{[]string{"--http-read-timeout", "0s"}, "--http-read-timeout"},
	} {
		_, err := run(t, append([]string{"serve", "--log-level", "error"}, c.args...)...)
		if err == nil || !strings.Contains(err.Error(), c.flag) {
			t.Errorf("serve %v: error %v does not name %s", c.args, err, c.flag)
		}
	}
}

// serve --help lists SGLang's CUDA graph flags; the largest captured batch
// is --cuda-graph-max-bs capped by the running batch.
func TestServeGraphFlags(t *testing.T) {
	out, err := run(t, "serve", "--help")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"--disable-cuda-graph", "--cuda-graph-max-bs int", "(default 256)", "--disable-overlap-schedule"} {
		if !strings.Contains(out, want) {
			t.Errorf("serve --help lacks %q", want)
		}
	}
	core, logs := observer.New(zap.InfoLevel)
	(&serveFlags{}).noteGPUFlags(zap.New(core))
	(&serveFlags{gpuFlagsSet: []string{"--disable-cuda-graph", "--base-gpu-id"}}).noteGPUFlags(zap.New(core))
	if l := logs.FilterMessageSnippet("no effect on the cpu backend"); l.Len() != 1 || !strings.Contains(l.All()[0].Message, "--disable-cuda-graph, --base-gpu-id") {
		t.Errorf("%d notes that the cpu backend ignores the GPU flags, want 1 naming them (only when given)", l.Len())
	}
	for _, c := range []struct{ maxBS, running, want int }{{256, 0, 64}, {16, 0, 16}, {256, 300, 256}, {100, 80, 80}} {
		f := &serveFlags{cudaGraphMaxBS: c.maxBS, maxRunning: c.running}
		if got := f.graphMaxBS(); got != c.want {
			t.Errorf("--cuda-graph-max-bs %d --max-running-requests %d: %d, want %d", c.maxBS, c.running, got, c.want)
		}
	}
}

// --device cuda without a GPU fails at start, naming what is missing.
func TestServeCUDAWithoutGPU(t *testing.T) {
	if ok, _ := gpuPresent(); ok {
		t.Skip("a GPU is present")
	}
	_, err := run(t, "serve", "--device", "cuda", "--port", "0", "--log-level", "error")
	if err == nil || !strings.Contains(err.Error(), "--device cuda") || !strings.Contains(err.Error(), "CUDA driver not found") {
		t.Fatalf("error %v", err)
	}
}

// topo with no GPU prints "no NVIDIA GPU" and the reason, then the host
// transports, and succeeds.
func TestTopoWithoutGPU(t *testing.T) {
	if ok, _ := gpuPresent(); ok {
		t.Skip("a GPU is present")
	}
	out, err := run(t, "topo")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out, "no NVIDIA GPU") || !strings.Contains(out, "same machine  cpu:0   -> cpu:0   shm") ||
		!strings.Contains(out, "other machine cpu:0   -> cpu:0   tcp") {
		t.Fatalf("topo printed:\n%s", out)
	}
}

func TestLBFlagErrors(t *testing.T) {
	_, err := run(t, "lb", "--decode", "http://127.0.0.1:1")
	if err == nil || !strings.Contains(err.Error(), "--prefill") {
		t.Fatalf("lb without --prefill: %v", err)
	}
	_, err = run(t, "lb", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--insecure-no-cluster-token",
		"--upstream-idle-timeout", "1s", "--health-check-interval", "2s")
	if err == nil || !strings.Contains(err.Error(), "--health-check-interval") || !strings.Contains(err.Error(), "--upstream-idle-timeout") {
		t.Fatalf("lb with an idle timeout shorter than the health checks: %v", err)
	}
	for _, c := range [][]string{{"--policy", "fastest"}, {"--policy", "cache_aware", "--cache-threshold", "2"},
		{"--balance-rel-threshold", "0.5"}, {"--max-tree-size", "-1"}} {
		_, err = run(t, append([]string{"lb", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--insecure-no-cluster-token"}, c...)...)
		if flag := c[len(c)-2]; err == nil || !strings.Contains(err.Error(), flag) {
			t.Fatalf("lb %v: %v, want an error naming %s", c, err, flag)
		}
	}
}
