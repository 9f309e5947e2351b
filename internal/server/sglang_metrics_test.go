package server_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/server/servertest"
)

// sglangNames are SGLang's metric names a server exports (its exporter and its
// Grafana dashboard's queries). A name missing from /metrics fails the test.
var sglangNames = []string{
	"sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cached_tokens_total",
	"sglang:num_requests_total", "sglang:num_aborted_requests_total",
	"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens", "sglang:max_total_num_tokens",
	"sglang:token_usage", "sglang:cache_hit_rate", "sglang:gen_throughput",
	"sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
	"sglang:time_per_output_token_seconds", "sglang:e2e_request_latency_seconds",
}

// scrapeFamilies reads url's /metrics.
func scrapeFamilies(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}

// value is the one series of name with model_name: its counter or gauge value, or
// a histogram's count.
func value(t *testing.T, mfs map[string]*dto.MetricFamily, name, modelName string) float64 {
	t.Helper()
	mf := mfs[name]
	if mf == nil || len(mf.GetMetric()) != 1 {
		t.Fatalf("%s: not exported (or not one series)", name)
	}
	m := mf.GetMetric()[0]
	labeled := false
	for _, l := range m.GetLabel() {
		labeled = labeled || l.GetName() == "model_name" && l.GetValue() == modelName
	}
	if !labeled {
		t.Fatalf("%s has no model_name=%q: %v", name, modelName, m.GetLabel())
	}
	switch {
	case m.Histogram != nil:
		return float64(m.GetHistogram().GetSampleCount())
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	default:
		return m.GetGauge().GetValue()
	}
}

// loadGen is the fake generator with the engine's load.
type loadGen struct {
	servertest.Generator
	st engine.Stats
}

func (g *loadGen) Stats() engine.Stats { return g.st }

// TestSGLangMetrics: every SGLang name is exported with model_name; the counts are a
// request's tokens and latencies; health checks are not requests; the gauges read
// the engine's load and prefix-cache counters.
func TestSGLangMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	query := prometheus.NewCounter(prometheus.CounterOpts{Name: "mooncake_radix_cache_query_tokens_total"})
	hit := prometheus.NewCounter(prometheus.CounterOpts{Name: "mooncake_radix_cache_hit_tokens_total"})
	reg.MustRegister(query, hit)
	query.Add(200)
	hit.Add(50)
	gen := &loadGen{st: engine.Stats{Queued: 2, Running: 3, FreePages: 40, TotalPages: 100, CachedPages: 10}}
	ts, _ := newServer(t, server.Config{Generator: gen, ModelName: "llama", PageSize: 16, Registerer: reg, Gatherer: reg})
	if status, body := post(t, ts.URL+"/generate", `{"text": "Hi"}`); status != 200 {
		t.Fatalf("%d %s", status, body)
	}
	for range 2 {
		if status, body := get(t, ts.URL+"/health_generate"); status != 200 {
			t.Fatalf("health_generate %d %s", status, body)
		}
	}
	mfs := scrapeFamilies(t, ts.URL)
	for _, name := range sglangNames {
		value(t, mfs, name, "llama")
	}
	reply := float64(len(servertest.DefaultReply) + 1) // its bytes, then EOS
	for name, want := range map[string]float64{
		"sglang:prompt_tokens_total":           3, // BOS H i
		"sglang:generation_tokens_total":       reply,
		"sglang:num_requests_total":            1,
		"sglang:time_to_first_token_seconds":   1,
		"sglang:inter_token_latency_seconds":   reply - 1,
		"sglang:e2e_request_latency_seconds":   1,
		"sglang:time_per_output_token_seconds": 1,
		"sglang:num_running_reqs":              3,
		"sglang:num_queue_reqs":                2,
		"sglang:num_used_tokens":               (100 - 40 - 10) * 16,
		"sglang:max_total_num_tokens":          100 * 16,
		"sglang:token_usage":                   0.5,
		"sglang:cache_hit_rate":                0.25,
	} {
		if got := value(t, mfs, name, "llama"); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	// The engine's own names are served beside them.
	if mfs["mooncake_radix_cache_hit_tokens_total"] == nil || mfs["mooncake_server_requests_total"] == nil {
		t.Fatal("/metrics lacks the registry's own families")
	}
}

// TestSGLangMetricsPD: a decode server counts every output token of its requests,
// the first (sampled by the prefill) included, and no prompt tokens; a prefill
// server counts the prompt and no output.
func TestSGLangMetricsPD(t *testing.T) {
	boot := `"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 9`
	for _, c := range []struct {
		mode         string
		prompt, gens float64
	}{
		{server.ModeDecode, 0, 4},
		{server.ModePrefill, 3, 0},
	} {
		gen := &servertest.Generator{Reply: "abc"} // a, b, c, EOS: the first is the prefill's token on a decode
		ts, _ := newServer(t, server.Config{Generator: gen, Mode: c.mode, Vouchers: server.VoucherPolicy{AllowUnsigned: true},
			PrepareDisagg: func(ctx context.Context, req *engine.Request, b server.Bootstrap) error { return nil }})
		if status, body := post(t, ts.URL+"/generate", `{"text": "Hi", `+boot+`}`); status != 200 || !strings.Contains(string(body), `"completion_tokens":4`) {
			t.Fatalf("%s: %d %s", c.mode, status, body)
		}
		mfs := scrapeFamilies(t, ts.URL)
		if p, g := value(t, mfs, "sglang:prompt_tokens_total", testModel), value(t, mfs, "sglang:generation_tokens_total", testModel); p != c.prompt || g != c.gens {
			t.Errorf("%s: prompt %v generation %v, want %v %v", c.mode, p, g, c.prompt, c.gens)
		}
	}
}
