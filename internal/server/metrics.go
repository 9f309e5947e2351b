package server

import (
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/mooncake-go/mooncake-go/internal/engine"
)

// metrics are the server's own Prometheus metrics. The engine exports
// mooncake_request_ttft_seconds and _itl_seconds from submission; these are
// measured at the HTTP layer from the arrival of the request (tokenization
// and disaggregation's preparation included): what a client sees. Health
// checks (/health_generate) are not requests here.
type metrics struct {
	requests *prometheus.CounterVec // mooncake_server_requests_total{endpoint,code}
	inflight prometheus.Gauge       // mooncake_server_inflight_requests
	ttft     prometheus.Histogram   // mooncake_server_ttft_seconds
	e2e      prometheus.Histogram   // mooncake_server_e2e_seconds

	sg *sglangMetrics
}

var latencyBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}

func newMetrics(cfg *Config) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_server_requests_total",
			Help: "HTTP requests to the generation endpoints, by endpoint and status code.",
		}, []string{"endpoint", "code"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mooncake_server_inflight_requests",
			Help: "Generation requests being served over HTTP.",
		}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "mooncake_server_ttft_seconds",
			Help:    "Time from the arrival of an HTTP request to its first output token.",
			Buckets: latencyBuckets,
		}),
		e2e: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "mooncake_server_e2e_seconds",
			Help:    "Time from the arrival of an HTTP request to its last output token.",
			Buckets: latencyBuckets,
		}),
	}
	sg, err := newSGLangMetrics(cfg)
	if err != nil {
		return nil, err
	}
	m.sg = sg
	if cfg.Registerer == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.inflight, m.ttft, m.e2e} {
		if err := cfg.Registerer.Register(c); err != nil {
			return nil, fmt.Errorf("server: registering metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) done(endpoint string, status int) {
	m.requests.WithLabelValues(endpoint, strconv.Itoa(status)).Inc()
}

// firstToken observes a generation's first output token, ttft after its request
// arrived.
func (m *metrics) firstToken(ttft time.Duration) {
	m.ttft.Observe(ttft.Seconds())
	m.sg.ttft.Observe(ttft.Seconds())
	m.sg.generated(1)
}

// nextToken observes a later output token, gap after the one before.
func (m *metrics) nextToken(gap time.Duration) {
	m.sg.itl.Observe(gap.Seconds())
	m.sg.generated(1)
}

// lastToken observes the end of a generation that produced output.
func (m *metrics) lastToken(rn *run, now time.Time) {
	m.e2e.Observe(now.Sub(rn.start).Seconds())
	if n := len(rn.ids); n > 1 {
		m.sg.tpot.Observe(rn.last.Sub(rn.first).Seconds() / float64(n-1))
	}
}

// finished counts a generation when its run ends.
func (m *metrics) finished(rn *run) {
	sg := m.sg
	switch {
	case rn.req == nil || rn.finish == nil: // refused before or at submission
		return
	case rn.finish.Type == "abort":
		sg.aborted.Inc()
		return
	}
	sg.requests.Inc()
	sg.e2e.Observe(time.Since(rn.start).Seconds())
	if sg.mode != ModeDecode { // the decode computes no prompt: its prefill counted it
		sg.promptTokens.Add(float64(rn.promptTokens()))
		sg.cachedTokens.Add(float64(rn.cachedTokens()))
	}
	if sg.mode != ModePrefill { // the prefill's one token is the decode's first
		sg.genTokens.Add(float64(rn.completionTokens()))
	}
}

// LoadReporter is an optional Generator method: the engine's load, read for
// SGLang's gauges (sglang:num_running_reqs, _num_queue_reqs, _token_usage...).
// *engine.Engine implements it.
type LoadReporter interface {
	Stats() engine.Stats
}

var _ LoadReporter = (*engine.Engine)(nil)

// SGLang's metric names (its Prometheus exporter and Grafana dashboard), with the
// label model_name. They are served on /metrics from the server's own registry: the
// cache hit rate reads the engine's counters from Config.Gatherer.
const (
	SGLangPromptTokens     = "sglang:prompt_tokens_total"
	SGLangGenerationTokens = "sglang:generation_tokens_total"
	SGLangCachedTokens     = "sglang:cached_tokens_total"
	SGLangRequests         = "sglang:num_requests_total"
	SGLangAborted          = "sglang:num_aborted_requests_total"
	SGLangRunning          = "sglang:num_running_reqs"
	SGLangQueued           = "sglang:num_queue_reqs"
	SGLangUsedTokens       = "sglang:num_used_tokens"
	SGLangMaxTokens        = "sglang:max_total_num_tokens"
	SGLangTokenUsage       = "sglang:token_usage"
	SGLangCacheHitRate     = "sglang:cache_hit_rate"
	SGLangGenThroughput    = "sglang:gen_throughput"
	SGLangTTFT             = "sglang:time_to_first_token_seconds"
	SGLangITL              = "sglang:inter_token_latency_seconds"
	SGLangTPOT             = "sglang:time_per_output_token_seconds"
	SGLangE2E              = "sglang:e2e_request_latency_seconds"
)

// The engine's prefix-cache counters cache_hit_rate is computed from.
const (
	radixQueryTokens = "mooncake_radix_cache_query_tokens_total"
	radixHitTokens   = "mooncake_radix_cache_hit_tokens_total"
)

type sglangMetrics struct {
	reg  *prometheus.Registry
	mode string

	promptTokens, genTokens, cachedTokens, requests, aborted prometheus.Counter
	ttft, itl, tpot, e2e                                     prometheus.Histogram
	rate                                                     *tokenRate
}

// SGLang's default buckets.
var (
	sglangTTFTBuckets = []float64{0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400}
	sglangE2EBuckets  = []float64{0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400}
	sglangITLBuckets  = []float64{0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
		0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000}
	sglangTPOTBuckets = []float64{0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5}
)

func newSGLangMetrics(cfg *Config) (*sglangMetrics, error) {
	labels := prometheus.Labels{"model_name": cfg.ModelName}
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels})
	}
	histogram := func(name, help string, b []float64) prometheus.Histogram {
		return prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: b, ConstLabels: labels})
	}
	m := &sglangMetrics{
		reg:          prometheus.NewRegistry(),
		mode:         cfg.Mode,
		promptTokens: counter(SGLangPromptTokens, "Prompt tokens of finished requests (counted where they are computed: not on a decode server)."),
		genTokens:    counter(SGLangGenerationTokens, "Output tokens of finished requests (on a decode server every one, the first sampled by the prefill included; none on a prefill server)."),
		cachedTokens: counter(SGLangCachedTokens, "Prompt tokens taken from the prefix cache."),
		requests:     counter(SGLangRequests, "Finished requests (health checks excluded)."),
		aborted:      counter(SGLangAborted, "Requests aborted (client gone, failures, shutdown)."),
		ttft:         histogram(SGLangTTFT, "Time from a request's arrival to its first output token.", sglangTTFTBuckets),
		itl:          histogram(SGLangITL, "Time between consecutive output tokens of a request.", sglangITLBuckets),
		tpot:         histogram(SGLangTPOT, "A request's mean time per output token after the first.", sglangTPOTBuckets),
		e2e:          histogram(SGLangE2E, "Time from a request's arrival to its end.", sglangE2EBuckets),
		rate:         newTokenRate(10),
	}
	load, _ := cfg.Generator.(LoadReporter)
	page := float64(max(cfg.PageSize, 1))
	stat := func(f func(engine.Stats) float64) func() float64 {
		return func() float64 {
			if load == nil {
				return 0
			}
			return f(load.Stats())
		}
	}
	used := func(st engine.Stats) float64 { return float64(st.TotalPages-st.FreePages-st.CachedPages) * page }
	gauge := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels}, f)
	}
	g := cfg.Gatherer
	cs := []prometheus.Collector{m.promptTokens, m.genTokens, m.cachedTokens, m.requests, m.aborted, m.ttft, m.itl, m.tpot, m.e2e,
		gauge(SGLangRunning, "Requests in the running batch.", stat(func(st engine.Stats) float64 { return float64(st.Running) })),
		gauge(SGLangQueued, "Requests waiting for admission.", stat(func(st engine.Stats) float64 { return float64(st.Queued) })),
		gauge(SGLangUsedTokens, "KV pool tokens in use by requests (the prefix cache's idle pages excluded).", stat(used)),
		gauge(SGLangMaxTokens, "KV pool tokens.", stat(func(st engine.Stats) float64 { return float64(st.TotalPages) * page })),
		gauge(SGLangTokenUsage, "Share of the KV pool in use by requests.", stat(func(st engine.Stats) float64 {
			if st.TotalPages == 0 {
				return 0
			}
			return used(st) / (float64(st.TotalPages) * page)
		})),
		gauge(SGLangCacheHitRate, "Share of looked-up prompt tokens the prefix cache held, since the start ("+radixHitTokens+" / "+radixQueryTokens+").",
			func() float64 { return cacheHitRate(g) }),
		gauge(SGLangGenThroughput, "Output tokens per second over the last 10 seconds.", m.rate.perSecond),
	}
	for _, c := range cs {
		if err := m.reg.Register(c); err != nil {
			return nil, fmt.Errorf("server: registering metrics: %w", err)
		}
	}
	return m, nil
}

// generated counts output tokens for gen_throughput (not on a prefill server).
func (m *sglangMetrics) generated(n int) {
	if m.mode != ModePrefill {
		m.rate.add(n)
	}
}

// cacheHitRate reads the engine's prefix-cache counters from g.
func cacheHitRate(g prometheus.Gatherer) float64 {
	if g == nil {
		return 0
	}
	mfs, err := g.Gather()
	if err != nil {
		return 0
	}
	var query, hit float64
	for _, mf := range mfs {
		var dst *float64
		switch mf.GetName() {
		case radixQueryTokens:
			dst = &query
		case radixHitTokens:
			dst = &hit
		default:
			continue
		}
		for _, m := range mf.GetMetric() {
			*dst += m.GetCounter().GetValue()
		}
	}
	if query == 0 {
		return 0
	}
	return hit / query
}

// tokenRate counts events in one-second buckets over a window.
type tokenRate struct {
	mu      sync.Mutex
	buckets []int64
	secs    []int64 // the unix second of each bucket
	now     func() time.Time
}

func newTokenRate(window int) *tokenRate {
	return &tokenRate{buckets: make([]int64, window), secs: make([]int64, window), now: time.Now}
}

func (r *tokenRate) add(n int) {
	sec := r.now().Unix()
	r.mu.Lock()
	i := int(sec % int64(len(r.buckets)))
	if r.secs[i] != sec {
		r.secs[i], r.buckets[i] = sec, 0
	}
	r.buckets[i] += int64(n)
	r.mu.Unlock()
}

// perSecond is the mean rate over the window's complete seconds (the current one
// is not).
func (r *tokenRate) perSecond() float64 {
	sec := r.now().Unix()
	w := int64(len(r.buckets)) - 1
	r.mu.Lock()
	defer r.mu.Unlock()
	var total int64
	for i, s := range r.secs {
		if s < sec && s >= sec-w {
			total += r.buckets[i]
		}
	}
	return float64(total) / float64(w)
}

func (s *Server) handleMetrics(w http.ResponseWriter, r *http.Request) {
	gs := prometheus.Gatherers{s.metrics.sg.reg}
	if s.cfg.Gatherer != nil {
		gs = append(gs, s.cfg.Gatherer)
	}
	promhttp.HandlerFor(gs, promhttp.HandlerOpts{ErrorLog: zapPrintln{s.lg}}).ServeHTTP(w, r)
}
