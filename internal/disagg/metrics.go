package disagg

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	requests  *prometheus.CounterVec // mode, result
	failures  *prometheus.CounterVec // mode, reason
	rooms     *prometheus.GaugeVec   // mode, state
	bootstrap prometheus.Histogram
	wait      prometheus.Histogram
	xferSecs  prometheus.Histogram
	xferBytes prometheus.Counter
	rankBytes *prometheus.CounterVec // tp_rank: decode: what each of its ranks received
	xferGBps  prometheus.Histogram
	pushes    *prometheus.CounterVec // by: layer | pass
	tail      prometheus.Histogram
	// authFailures counts bootstrap requests or answers that failed the
	// cluster-secret check.
	authFailures prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, mode string) *metrics {
	b := prometheus.ExponentialBuckets(1e-4, 2, 18)
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_disagg_requests_total", Help: "Disaggregated requests by result.",
		}, []string{"mode", "result"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_disagg_failures_total", Help: "Failed rooms by reason.",
		}, []string{"mode", "reason"}),
		rooms: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mooncake_disagg_rooms", Help: "Rooms by state.",
		}, []string{"mode", "state"}),
		bootstrap: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mooncake_disagg_bootstrap_seconds", Help: "Decode: time to reserve pages and register the room with the prefill server.",
			Buckets: b, ConstLabels: prometheus.Labels{"mode": mode},
		}),
		wait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mooncake_disagg_kv_wait_seconds", Help: "Decode: time from room registration to the KV being in place.",
			Buckets: b, ConstLabels: prometheus.Labels{"mode": mode},
		}),
		xferSecs: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mooncake_disagg_transfer_seconds", Help: "Prefill: time spent in KV transfers per room.",
			Buckets: b, ConstLabels: prometheus.Labels{"mode": mode},
		}),
		xferBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mooncake_disagg_transfer_bytes_total", Help: "KV bytes moved for disaggregated requests (prefill: pushed; decode: received, as the prefill reports them).",
			ConstLabels: prometheus.Labels{"mode": mode},
		}),
		rankBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_disagg_rank_transfer_bytes_total", Help: "Decode: KV bytes each tensor-parallel rank's pool received, as the prefill reports them.",
			ConstLabels: prometheus.Labels{"mode": mode},
		}, []string{"tp_rank"}),
		xferGBps: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mooncake_disagg_transfer_gbps", Help: "Prefill: KV transfer rate per room (GB/s).",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 16), ConstLabels: prometheus.Labels{"mode": mode},
		}),
		pushes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_disagg_pushes_total", Help: "Prefill: KV transfer batches, by what made the pages ready: a layer report during a pass, or a pass's end.",
			ConstLabels: prometheus.Labels{"mode": mode},
		}, []string{"by"}),
		tail: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mooncake_disagg_kv_tail_seconds", Help: "Prefill: time from the first token's sampling to the notification of decode (the KV push not hidden behind compute).",
			Buckets: b, ConstLabels: prometheus.Labels{"mode": mode},
		}),
		authFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mooncake_disagg_auth_failures_total", Help: "Bootstrap requests (prefill) or answers (decode) refused by the cluster-secret check.",
			ConstLabels: prometheus.Labels{"mode": mode},
		}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.failures, m.rooms, m.bootstrap, m.wait, m.xferSecs, m.xferBytes, m.rankBytes, m.xferGBps, m.pushes, m.tail, m.authFailures)
	}
	return m
}
