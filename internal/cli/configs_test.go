package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/zap"
	"go.yaml.in/yaml/v3"
)

const configsDir = "../../configs"

// commandLines collects every mooncake-go command line in a decoded YAML tree:
// a container's command [mooncake-go ...] and its args.
func commandLines(v any, out *[][]string) {
	switch x := v.(type) {
	case map[string]any:
		if cmd, ok := x["command"].([]any); ok && len(cmd) > 0 && cmd[0] == "mooncake-go" {
			var line []string
			for _, a := range append(cmd[1:], anySlice(x["args"])...) {
				line = append(line, strings.TrimSpace(strings.Split(asString(a), " #")[0]))
			}
			*out = append(*out, line)
		}
		for _, c := range x {
			commandLines(c, out)
		}
	case []any:
		for _, c := range x {
			commandLines(c, out)
		}
	}
}

func anySlice(v any) []any {
	s, _ := v.([]any)
	return s
}

func asString(v any) string {
	s, _ := v.(string)
	return s
}

// execStart is a systemd unit's ExecStart command line (continuation lines joined).
func execStart(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	joined := strings.ReplaceAll(string(b), "\\\n", " ")
	for _, line := range strings.Split(joined, "\n") {
		if rest, ok := strings.CutPrefix(line, "ExecStart="); ok {
			f := strings.Fields(rest)
			if len(f) == 0 || filepath.Base(f[0]) != "mooncake-go" {
				t.Fatalf("%s: ExecStart does not run mooncake-go: %q", path, rest)
			}
			return f[1:]
		}
	}
	t.Fatalf("%s: no ExecStart", path)
	return nil
}

// checkFlags parses a command line against the cobra commands: the subcommand must
// exist and every flag must be one of its flags (values are parsed too).
func checkFlags(t *testing.T, where string, line []string) {
	t.Helper()
	args := normalizeArgs(line)
	root := newRoot(&globals{out: io.Discard, errw: io.Discard, lg: zap.NewNop()})
	cmd, rest, err := root.Find(args)
	if err != nil || cmd == root {
		t.Errorf("%s: no such command: %v (%v)", where, line, err)
		return
	}
	if err := cmd.ParseFlags(rest); err != nil {
		t.Errorf("%s: %v: %v", where, line, err)
	}
	if n := len(cmd.Flags().Args()); n > 0 {
		t.Errorf("%s: %v: stray arguments %v", where, line, cmd.Flags().Args())
	}
}

// TestConfigs: every manifest and unit parses, and every flag it passes to
// mooncake-go exists; the dashboard's metrics are checked by TestDashboardMetrics.
func TestConfigs(t *testing.T) {
	lines := 0
	err := filepath.WalkDir(configsDir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		switch filepath.Ext(p) {
		case ".yaml", ".yml":
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			dec := yaml.NewDecoder(bytes.NewReader(b))
			docs := 0
			for {
				var doc map[string]any
				if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
					break
				} else if err != nil {
					t.Errorf("%s: %v", p, err)
					return nil
				}
				docs++
				if strings.Contains(p, "/k8s/") && (doc["apiVersion"] == nil || doc["kind"] == nil) {
					t.Errorf("%s: document %d has no apiVersion or kind", p, docs)
				}
				var cls [][]string
				commandLines(doc, &cls)
				for _, l := range cls {
					checkFlags(t, p, l)
					lines++
				}
			}
			if docs == 0 {
				t.Errorf("%s: no YAML document", p)
			}
		case ".service":
			checkFlags(t, p, execStart(t, p))
			lines++
		case ".json":
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			var v any
			if err := json.Unmarshal(b, &v); err != nil {
				t.Errorf("%s: %v", p, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// 1p1d: 3; xpyd: 5; lws: 3; systemd: 3.
	if lines < 14 {
		t.Fatalf("only %d mooncake-go command lines found", lines)
	}
	// The check is not vacuous: a flag that does not exist fails it.
	root := newRoot(&globals{out: io.Discard, errw: io.Discard, lg: zap.NewNop()})
	cmd, rest, _ := root.Find([]string{"serve", "--no-such-flag=1"})
	if err := cmd.ParseFlags(rest); err == nil {
		t.Fatal("an unknown flag parses")
	}
}

// dashboardMetrics are the metric names the Grafana dashboard's queries use.
func dashboardMetrics(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(configsDir, "grafana", "mooncake-go.json"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	re := regexp.MustCompile(`(sglang:[a-z0-9_]+|mooncake_[a-z0-9_]+)`)
	for _, m := range regexp.MustCompile(`"expr": "((?:[^"\\]|\\.)*)"`).FindAllStringSubmatch(string(b), -1) {
		for _, n := range re.FindAllString(m[1], -1) {
			if !slices.Contains(names, n) {
				names = append(names, n)
			}
		}
	}
	if len(names) < 15 {
		t.Fatalf("only %d metrics in the dashboard: %v", len(names), names)
	}
	return names
}

// startServe runs serve in this process until the test ends; it returns its URL.
func startServe(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var out syncBuffer
	g := &globals{out: &out, errw: &out, lg: zap.NewNop(), environ: func() []string { return nil }}
	root := newRoot(g)
	root.SetArgs(append([]string{"serve", "--port", "0", "--max-total-tokens", "2048", "--threads", "1",
		"--cluster-token", "configs-test-token-0123456789", "--disaggregation-transfer-backend", "tcp"}, args...))
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve %v: %v", args, err)
		}
	})
	re := regexp.MustCompile(`listening on (\S+)`)
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if m := re.FindStringSubmatch(out.String()); m != nil {
			return "http://" + m[1]
		}
		select {
		case err := <-done:
			t.Fatalf("serve %v ended: %v\n%s", args, err, out.String())
		default:
		}
	}
	t.Fatalf("serve %v did not listen:\n%s", args, out.String())
	return ""
}

func families(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(bufio.NewReader(resp.Body))
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}

// TestDashboardMetrics starts a prefill and a decode server and checks that every
// metric the dashboard queries is exported by one of them.
func TestDashboardMetrics(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two servers")
	}
	urls := []string{
		startServe(t, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"),
		startServe(t, "--disaggregation-mode", "decode"),
	}
	have := map[string]dto.MetricType{}
	for _, u := range urls {
		resp, err := http.Post(u+"/generate", "application/json", strings.NewReader(`{"text": "a"}`)) // a direct request: 400, counted
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		for name, mf := range families(t, u) {
			have[name] = mf.GetType()
		}
	}
	for _, n := range dashboardMetrics(t) {
		if _, ok := have[n]; ok {
			continue
		}
		base := n
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			base = strings.TrimSuffix(base, suf)
		}
		if typ, ok := have[base]; !ok || typ != dto.MetricType_HISTOGRAM {
			t.Errorf("the dashboard queries %s, which no server exports", n)
		}
	}
}
