package lb

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	requests *prometheus.CounterVec
	seconds  prometheus.Histogram
	healthy  *prometheus.GaugeVec
	retries  *prometheus.CounterVec
	idle     *prometheus.CounterVec
	split    prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_lb_requests_total", Help: "Requests through the load balancer by HTTP status.",
		}, []string{"code"}),
		seconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mooncake_lb_request_seconds", Help: "Time from request to the end of the response.",
			Buckets: prometheus.ExponentialBuckets(1e-3, 2, 16),
		}),
		healthy: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mooncake_lb_backend_healthy", Help: "1 if the server passed its last health check, by role and index (its place in --prefill or --decode; /get_server_info has the URLs).",
		}, []string{"role", "index"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_lb_retries_total", Help: "Requests sent again to another pair, by the side that failed first and why (unreachable, overloaded, error, rejected).",
		}, []string{"role", "cause"}),
		idle: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_lb_upstream_idle_timeouts_total", Help: "Decode answers ended by --upstream-idle-timeout, before the response started or in the middle of it.",
		}, []string{"stage"}),
		split: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mooncake_lb_split_generations_total", Help: "Generations of batches and n > 1 requests, each sent as a request of its own (one room).",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.seconds, m.healthy, m.retries, m.idle, m.split)
	}
	return m
}
