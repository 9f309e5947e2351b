package transfer

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	bytes    *prometheus.CounterVec   // transport, op
	batches  *prometheus.CounterVec   // transport, result
	tasks    *prometheus.CounterVec   // transport, result
	seconds  *prometheus.HistogramVec // transport
	notifies *prometheus.CounterVec   // direction
	// handshakes counts accepted connections by the handshake's result:
	// accepted, auth_failed, busy (refused at accept), error.
	handshakes *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_transfer_bytes_total", Help: "Bytes moved by completed transfer tasks.",
		}, []string{"transport", "op"}),
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_transfer_batches_total", Help: "Transfer batches (per transport used) by result.",
		}, []string{"transport", "result"}),
		tasks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_transfer_tasks_total", Help: "Transfer tasks by result.",
		}, []string{"transport", "result"}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "mooncake_transfer_batch_seconds", Help: "Time from submit to the last task of a batch.",
			Buckets: prometheus.ExponentialBuckets(20e-6, 2.5, 14),
		}, []string{"transport"}),
		notifies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_transfer_notifications_total", Help: "Notifications sent and received.",
		}, []string{"direction"}),
		handshakes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_transfer_handshakes_total", Help: "Handshakes of accepted connections by result: accepted, auth_failed, busy (refused at accept: too many awaiting proof), error.",
		}, []string{"result"}),
	}
	for _, r := range []string{"accepted", "auth_failed", "busy", "error"} {
		m.handshakes.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(m.bytes, m.batches, m.tasks, m.seconds, m.notifies, m.handshakes)
	}
	return m
}
