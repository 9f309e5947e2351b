package server

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics are the server's own Prometheus metrics. The engine exports
// mooncake_request_ttft_seconds and _itl_seconds from submission; these are
// measured at the HTTP layer from the arrival of the request (tokenization
// and disaggregation's preparation included): what a client sees.
type metrics struct {
	requests *prometheus.CounterVec // mooncake_server_requests_total{endpoint,code}
	inflight prometheus.Gauge       // mooncake_server_inflight_requests
	ttft     prometheus.Histogram   // mooncake_server_ttft_seconds
	e2e      prometheus.Histogram   // mooncake_server_e2e_seconds
}

var latencyBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
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
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.inflight, m.ttft, m.e2e} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("server: registering metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) done(endpoint string, status int) {
	m.requests.WithLabelValues(endpoint, strconv.Itoa(status)).Inc()
}

func (s *Server) handleMetrics(w http.ResponseWriter, r *http.Request) {
	g := s.cfg.Gatherer
	if g == nil {
		g = prometheus.NewRegistry()
	}
	promhttp.HandlerFor(g, promhttp.HandlerOpts{ErrorLog: zapPrintln{s.lg}}).ServeHTTP(w, r)
}
