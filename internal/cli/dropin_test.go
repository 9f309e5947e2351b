package cli

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// runLogged runs the command line with an observed logger and the environment env
// (KEY=VALUE), and returns its output, error and logs.
func runLogged(t *testing.T, env []string, args ...string) (string, error, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zap.InfoLevel)
	var out bytes.Buffer
	g := &globals{out: &out, errw: &out, lg: zap.New(core), environ: func() []string { return env }, env: envOf(env)}
	root := newRoot(g)
	root.SetArgs(normalizeArgs(args))
	err := root.ExecuteContext(context.Background())
	return out.String(), err, logs
}

func envOf(env []string) func(string) string {
	return func(k string) string {
		for _, kv := range env {
			if name, v, ok := strings.Cut(kv, "="); ok && name == k {
				return v
			}
		}
		return ""
	}
}

// sglangLaunchFlags are the flags of SGLang's launch_server commands in its PD
// disaggregation guide, its multi-node and Kubernetes deployment examples, its
// server-arguments page's common commands and its metrics guide, with the values
// those use. serve must take every one (a name missing fails); noop flags get one
// warning naming them.
var sglangLaunchFlags = []struct {
	args []string
	noop bool
}{
	// PD disaggregation guide (Mooncake, Llama single node and DeepSeek multi-node).
	{[]string{"--model-path", "/nonexistent/for-the-test"}, false},
	{[]string{"--disaggregation-mode", "prefill"}, false},
	{[]string{"--disaggregation-ib-device", "mlx5_roce0"}, false}, // used by rdma; a missing device is warned after --port is checked
	{[]string{"--base-gpu-id", "1"}, false},
	{[]string{"--host", "127.0.0.1"}, false},
	{[]string{"--trust-remote-code"}, true},
	{[]string{"--dist-init-addr", "10.0.0.1:5000"}, true},
	{[]string{"--nnodes", "1"}, false},
	{[]string{"--node-rank", "1"}, true},
	{[]string{"--tp-size", "1"}, false},
	{[]string{"--dp-size", "1"}, false},
	{[]string{"--enable-dp-attention"}, true},
	{[]string{"--moe-a2a-backend", "deepep"}, true},
	{[]string{"--mem-fraction-static", "0.8"}, false},
	{[]string{"--max-running-requests", "128"}, false},
	{[]string{"--disaggregation-transfer-backend", "mooncake"}, false},
	// Kubernetes LeaderWorkerSet examples (lws-examples/p.yaml, d.yaml).
	{[]string{"--chunked-prefill-size", "524288"}, false},
	{[]string{"--max-prefill-tokens", "32768"}, true},
	{[]string{"--page-size", "64"}, false},
	{[]string{"--ep-dispatch-algorithm", "dynamic"}, true},
	{[]string{"--eplb-algorithm", "deepseek"}, true},
	{[]string{"--enable-dp-lm-head"}, true},
	{[]string{"--disable-radix-cache"}, false},
	{[]string{"--context-length", "32768"}, false},
	{[]string{"--tp", "1"}, false},
	{[]string{"--ep-num-redundant-experts", "32"}, true},
	{[]string{"--moe-dense-tp-size", "1"}, true},
	{[]string{"--deepep-config", "/home/aiges/tuned/tuned_8sms.json"}, true},
	{[]string{"--cuda-graph-bs", "1", "2", "4", "8"}, true},
	// Server arguments: common launch commands.
	{[]string{"--enable-p2p-check"}, true},
	{[]string{"--dp", "1"}, false},
	{[]string{"--quantization", "fp8"}, true},
	{[]string{"--kv-cache-dtype", "fp8_e4m3"}, true},
	{[]string{"--enable-deterministic-inference"}, true},
	{[]string{"--hf-chat-template-name", "tool_use"}, true},
	{[]string{"--enable-torch-compile"}, true},
	{[]string{"--disable-cuda-graph"}, false},
	{[]string{"--cuda-graph-max-bs", "32"}, false},
	{[]string{"--tensor-parallel-size", "1"}, false},
	{[]string{"--log-requests"}, true},
	// Metrics guide and the drop-in issue's launch script.
	{[]string{"--enable-metrics"}, false},
	{[]string{"--watchdog-timeout", "600"}, true},
	{[]string{"--decode-log-interval", "40"}, true},
	{[]string{"--served-model-name", "llama"}, false},
	{[]string{"--random-seed", "42"}, false},
	{[]string{"--dtype", "bfloat16"}, false},
	{[]string{"--max-total-tokens", "4096"}, false},
	{[]string{"--max-queued-requests", "64"}, false},
	{[]string{"--stream-interval", "8"}, true},
	{[]string{"--schedule-policy", "lpm"}, true},
	{[]string{"--attention-backend", "flashinfer"}, true},
	{[]string{"--model", "/nonexistent/for-the-test"}, false},
	{[]string{"--api-key", "sk-test"}, false},
	{[]string{"--log-level", "warning"}, false},
}

// TestSGLangFlagTable: every flag of SGLang's launch commands is taken by serve (the
// command fails only at --port, checked after them), and each without effect gets
// exactly one warning naming it.
func TestSGLangFlagTable(t *testing.T) {
	for _, c := range sglangLaunchFlags {
		name := c.args[0]
		args := append([]string{"serve"}, c.args...)
		_, err, logs := runLogged(t, nil, append(args, "--port", "70000")...)
		if err == nil || !strings.Contains(err.Error(), "--port 70000") {
			t.Errorf("serve %v: %v (want it taken, and --port's error)", c.args, err)
			continue
		}
		warned := logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet(name + " ").Len()
		if c.noop && warned != 1 || !c.noop && warned != 0 {
			t.Errorf("serve %v: %d warnings naming %s, want %d", c.args, warned, name, map[bool]int{true: 1}[c.noop])
		}
	}
	// Values that need no warning: what serve does anyway.
	_, _, logs := runLogged(t, nil, "serve", "--schedule-policy", "fcfs", "--trust-remote-code=false", "--stream-interval", "1", "--port", "70000")
	if n := logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 0 {
		t.Errorf("%d warnings for default values: %v", n, logs.All())
	}
}

// TestSGLangFlagsRefused: what serve cannot do is refused at start, naming the flag.
func TestSGLangFlagsRefused(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--tp", "3"}, "--tp-size 3: model: 8 attention heads do not split over 3 ranks"},
		{[]string{"--tensor-parallel-size", "16"}, "--tp-size 16"},
		{[]string{"--tp-size", "100"}, "--tp-size 100: want 1 to 64 ranks"},
		{[]string{"--dp-size", "8", "--disaggregation-mode", "prefill"}, "--dp-size 8 with --disaggregation-mode prefill: data-parallel replicas run colocated only"},
		{[]string{"--dp", "2", "--disaggregation-mode", "decode"}, "--dp-size 2 with --disaggregation-mode decode"},
		{[]string{"--dp", "0"}, "--dp-size 0: want 1 to 64"},
		{[]string{"--nnodes", "2"}, "--nnodes 2"},
		{[]string{"--context-length", "-1"}, "--context-length"},
		{[]string{"--context-length", "999999"}, "--context-length 999999 is beyond the model's context length"},
		{[]string{"--dtype", "half"}, "--dtype half: float16 is not supported"},
		{[]string{"--device", "npu"}, "--device npu"},
		{[]string{"--disaggregation-transfer-backend", "nixl"}, "--disaggregation-transfer-backend nixl"},
		{[]string{"--config", "/nonexistent.yaml"}, "--config"},
	} {
		args := append([]string{"serve", "--port", "0", "--insecure-no-cluster-token"}, c.args...)
		if _, err, _ := runLogged(t, nil, args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("serve %v: %v, want %q", c.args, err, c.want)
		}
	}
}

// TestSGLangConfig: --config takes SGLang's YAML (dashes or underscores); the command
// line wins.
func TestSGLangConfig(t *testing.T) {
	p := filepath.Join(t.TempDir(), "config.yaml")
	yaml := "model-path: /nonexistent/model\nport: 70001\ntensor_parallel_size: 1\nenable-metrics: true\nlog-requests: true\ncuda-graph-bs: [1, 2]\n"
	if err := os.WriteFile(p, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err, logs := runLogged(t, nil, "serve", "--config", p)
	if err == nil || !strings.Contains(err.Error(), "--port 70001") {
		t.Fatalf("config's port: %v", err)
	}
	if logs.FilterMessageSnippet("--log-requests ").Len() != 1 || logs.FilterMessageSnippet("--cuda-graph-bs ").Len() != 1 {
		t.Fatalf("config's no-op flags not warned: %v", logs.All())
	}
	if _, err, _ := runLogged(t, nil, "serve", "--config", p, "--port", "70002"); err == nil || !strings.Contains(err.Error(), "--port 70002") {
		t.Fatalf("command line over config: %v", err)
	}
	if err := os.WriteFile(p, []byte("no-such-flag: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err, _ := runLogged(t, nil, "serve", "--config", p); err == nil || !strings.Contains(err.Error(), `unknown flag "no-such-flag"`) {
		t.Fatalf("unknown config key: %v", err)
	}
}

// TestNormalizeArgs: SGLang's list flags, lb's server lists and gflags' single dash.
func TestNormalizeArgs(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"serve --cuda-graph-bs 1 2 4 --port 1", "serve --cuda-graph-bs=1,2,4 --port 1"},
		{"serve --lora-paths a=b --tp 1", "serve --lora-paths=a=b --tp 1"},
		{"bench transfer -mode=target -metadata_server=P2PHANDSHAKE --duration 3", "bench transfer --mode=target --metadata_server=P2PHANDSHAKE --duration 3"},
		{"lb --prefill a b --decode=c 8998 --port 1", "lb --prefill=a,b --decode=c,8998 --port 1"}, // lb's server lists (lb_test.go)
	} {
		if got := strings.Join(normalizeArgs(strings.Fields(c.in)), " "); got != c.want {
			t.Errorf("%q: %q, want %q", c.in, got, c.want)
		}
	}
}

// TestMooncakeEnv: MC_* variables with their Mooncake meaning, the others warned.
func TestMooncakeEnv(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	lg := zap.New(core)
	for _, v := range []string{"1", "true", "TRUE", "yes", "on"} {
		m, err := readMC([]string{"MC_FORCE_TCP=" + v}, lg)
		if err != nil || !m.forceTCP {
			t.Errorf("MC_FORCE_TCP=%s: %+v %v", v, m, err)
		}
	}
	for _, v := range []string{"0", "false", "no", ""} {
		if m, _ := readMC([]string{"MC_FORCE_TCP=" + v}, lg); m.forceTCP {
			t.Errorf("MC_FORCE_TCP=%s taken as set", v)
		}
	}
	m, err := readMC([]string{"MC_NUM_CQ_PER_CTX=3", "MC_GID_INDEX=3", "MC_SLICE_SIZE=65536", "MC_NOT_A_THING=1", "MC_INTRA_NVLINK=1", "MC_TE_METRIC=true",
		"MC_TE_METRIC_INTERVAL_SECONDS=2", "PATH=/bin"}, lg)
	if err != nil || !m.intraNVLink || m.intraName != "MC_INTRA_NVLINK" || !m.teMetric || m.teMetricEvery != 2*time.Second {
		t.Fatalf("%+v %v", m, err)
	}
	for _, want := range []string{"MC_NUM_CQ_PER_CTX has no effect here: the rdma transport sizes", "MC_SLICE_SIZE has no effect here",
		"MC_NOT_A_THING is not a Mooncake variable"} {
		if logs.FilterMessageSnippet(want).Len() != 1 {
			t.Errorf("no warning %q: %v", want, logs.All())
		}
	}
	if _, err := readMC([]string{"MC_FORCE_MNNVL=1", "MC_INTRANODE_NVLINK=1"}, lg); err == nil || !strings.Contains(err.Error(), "exclude each other") {
		t.Errorf("MNNVL and intra-node NVLink: %v", err)
	}
	if _, err := readMC([]string{"MC_TE_METRIC_INTERVAL_SECONDS=soon"}, lg); err == nil {
		t.Error("a bad interval is taken")
	}
	// The transports follow them.
	tf := &transferFlags{backend: "shm", mc: mcEnv{forceTCP: true}}
	if ts, err := tf.transports("--x", nil, nil); err != nil || len(ts) != 1 || ts[0].Name() != "tcp" {
		t.Errorf("MC_FORCE_TCP: %v %v", ts, err)
	}
	tf = &transferFlags{mc: mcEnv{forceHCA: true}}
	if _, err := tf.transports("--x", nil, nil); err == nil || !strings.Contains(err.Error(), "MC_FORCE_HCA") {
		t.Errorf("MC_FORCE_HCA: %v", err)
	}
	if ok, _ := gpuPresent(); !ok {
		tf = &transferFlags{mc: mcEnv{intraNVLink: true, intraName: "MC_INTRANODE_NVLINK"}}
		if _, err := tf.transports("--x", nil, nil); err == nil || !strings.Contains(err.Error(), "MC_INTRANODE_NVLINK") {
			t.Errorf("MC_INTRANODE_NVLINK without a GPU: %v", err)
		}
		tf = &transferFlags{mc: mcEnv{forceMNNVL: true}}
		if _, err := tf.transports("--x", nil, nil); err == nil || !strings.Contains(err.Error(), "MC_FORCE_MNNVL") {
			t.Errorf("MC_FORCE_MNNVL without a GPU: %v", err)
		}
	}
	for _, b := range []string{"mooncake", "auto"} {
		if ts, err := (&transferFlags{backend: b}).transports("--x", nil, nil); err != nil || len(ts) < 2 {
			t.Errorf("backend %s: %v %v", b, ts, err)
		}
	}
}

// TestMCLogLevel: MC_LOG_LEVEL sets the level (Mooncake's names) unless --log-level
// is given; SGLang's "warning" is warn.
func TestMCLogLevel(t *testing.T) {
	for _, c := range []struct {
		flag, env string
		set       bool
		want      zapcore.Level
	}{
		{"info", "WARNING", false, zapcore.WarnLevel},
		{"info", "TRACE", false, zapcore.DebugLevel},
		{"info", "ERROR", false, zapcore.ErrorLevel},
		{"error", "TRACE", true, zapcore.ErrorLevel},
		{"warning", "", true, zapcore.WarnLevel},
	} {
		g := &globals{logLevel: c.flag, logLevelSet: func() bool { return c.set }, env: envOf([]string{"MC_LOG_LEVEL=" + c.env})}
		if lvl, err := g.level(); err != nil || lvl != c.want {
			t.Errorf("%+v: %v %v", c, lvl, err)
		}
	}
	g := &globals{logLevel: "info", logLevelSet: func() bool { return false }, env: envOf([]string{"MC_LOG_LEVEL=LOUD"})}
	if _, err := g.level(); err == nil || !strings.Contains(err.Error(), "MC_LOG_LEVEL") {
		t.Errorf("bad MC_LOG_LEVEL: %v", err)
	}
}

// TestMetadataSpec: Mooncake's bare host:port metadata server is etcd.
func TestMetadataSpec(t *testing.T) {
	for in, want := range map[string]string{"10.0.0.1:2379": "etcd://10.0.0.1:2379", "a:1,b:2": "etcd://a:1,b:2",
		"P2PHANDSHAKE": "P2PHANDSHAKE", "p2p": "p2p", "etcd://h:1": "etcd://h:1", "http://h:8080/metadata": "http://h:8080/metadata"} {
		if got := metadataSpec(in); got != want {
			t.Errorf("%s: %s, want %s", in, got, want)
		}
	}
}

// syncBuffer is a bytes.Buffer safe for a writer and a reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestBenchTransferMooncakeSpellings runs a target and an initiator with
// transfer_engine_bench's flags (gflags' single dash, underscores, --duration in
// seconds) and checks its result line, and the initiator's --cpu-profile.
func TestBenchTransferMooncakeSpellings(t *testing.T) {
	token := "--cluster_token=bench-test-token-0123456789"
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var tout syncBuffer
	tg := &globals{out: &tout, errw: &tout, lg: zap.NewNop(), environ: func() []string { return nil }}
	target := newRoot(tg)
	target.SetArgs(normalizeArgs([]string{"bench", "transfer", "-mode=target", "--local_server_name=127.0.0.1:0", "--metadata_server=P2PHANDSHAKE",
		"--protocol=tcp", "--buffer_size=4194304", token}))
	done := make(chan error, 1)
	go func() { done <- target.ExecuteContext(ctx) }()
	var seg string
	for deadline := time.Now().Add(10 * time.Second); seg == ""; {
		if m := regexp.MustCompile(`listening on (\S+)`).FindStringSubmatch(tout.String()); m != nil {
			seg = m[1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no target: %s", tout.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	prof := filepath.Join(t.TempDir(), "cpu.pprof")
	out, err, _ := runLogged(t, nil, "bench", "transfer", "-mode=initiator", "--segment_id="+seg, "--metadata_server", "P2PHANDSHAKE",
		"--protocol", "tcp", "--block_size=65536", "--batch_size=8", "--threads=1", "--buffer_size=4194304", "--duration", "1",
		"--format=mooncake", "--report_unit=MiB", "--report_precision=3", token, "--cpu-profile", prof)
	if err != nil {
		t.Fatalf("initiator: %v\n%s", err, out)
	}
	if b, err := os.ReadFile(prof); err != nil || len(b) < 64 || b[0] != 0x1f || b[1] != 0x8b {
		t.Errorf("--cpu-profile wrote %d bytes (%v), want a gzipped profile", len(b), err)
	}
	if !regexp.MustCompile(`^Test completed: duration 1\.\d\d, batch count [1-9]\d*, throughput \d+\.\d{3} MiB/s\n$`).MatchString(out) {
		t.Fatalf("result line %q", out)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("target: %v", err)
	}
}

// TestVersion: the version names the build: -ldflags' Version, the module's, or
// dev-<revision>; `version` prints the revision and its time when known.
func TestVersion(t *testing.T) {
	for _, c := range []struct {
		b    build
		want string
	}{
		{build{module: "v1.2.3", revision: "0123456789abcdef0123"}, "v1.2.3"},
		{build{revision: "0123456789abcdef0123"}, "dev-0123456789ab"},
		{build{revision: "0123456789abcdef0123", modified: true}, "dev-0123456789ab-modified"},
		{build{}, "dev"},
	} {
		if got := c.b.version(); got != c.want {
			t.Errorf("%+v: %q, want %q", c.b, got, c.want)
		}
	}
	revision, revisionTime = "fedcba9876543210fedcba9876543210fedcba98", "2026-12-01T00:00:00Z"
	defer func() { revision, revisionTime = "", "" }()
	out, err := run(t, "version")
	if err != nil || !strings.Contains(out, "revision  fedcba9876543210fedcba9876543210fedcba98") || !strings.Contains(out, "time      2026-12-01T00:00:00Z") ||
		!strings.Contains(out, "go        go1.") {
		t.Fatalf("version: %v\n%s", err, out)
	}
}

// TestDropInDoc: docs/DROPIN.md lists every SGLang flag taken without effect and every
// MC_* variable read.
func TestDropInDoc(t *testing.T) {
	b, err := os.ReadFile("../../docs/DROPIN.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	for _, c := range compatFlags {
		if !strings.Contains(doc, "`--"+c.name) {
			t.Errorf("docs/DROPIN.md does not list --%s", c.name)
		}
	}
	for _, v := range mcHonoured {
		if !strings.Contains(doc, "`"+v+"`") {
			t.Errorf("docs/DROPIN.md does not list %s", v)
		}
	}
}
