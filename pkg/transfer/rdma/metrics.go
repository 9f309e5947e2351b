package rdma

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
)

// metrics are the transport's Prometheus series; labels are bounded: the
// NICs in use, two ops, the ibverbs completion statuses.
type metrics struct {
	requests *prometheus.CounterVec // nic, op: work requests posted
	bytes    *prometheus.CounterVec // nic, op: bytes of completed requests
	errors   *prometheus.CounterVec // nic, status: completions in error
	retries  *prometheus.CounterVec // nic: slices posted again after a failure on nic
	qps      *prometheus.GaugeVec   // nic: queue pairs set up to peers
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_rdma_work_requests_total", Help: "RDMA work requests posted, by local NIC and op.",
		}, []string{"nic", "op"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_rdma_bytes_total", Help: "Bytes of RDMA work requests completed successfully, by local NIC and op.",
		}, []string{"nic", "op"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_rdma_completion_errors_total", Help: "RDMA completions in error, by local NIC and ibverbs status.",
		}, []string{"nic", "status"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_rdma_retries_total", Help: "Slices posted again on another queue pair after failing on this NIC.",
		}, []string{"nic"}),
		qps: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mooncake_rdma_queue_pairs", Help: "Initiator queue pairs set up to peers, by local NIC.",
		}, []string{"nic"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.bytes, m.errors, m.retries, m.qps} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return nil, err
			}
		}
	}
	return m, nil
}

func opLabel(o verbs.Opcode) string {
	if o == verbs.OpRead {
		return "read"
	}
	return "write"
}

// statusLabel keeps the label set bounded: known statuses by name, the
// rest as "other".
func statusLabel(s verbs.Status) string {
	if _, ok := statusKnown[s]; ok {
		return s.String()
	}
	return "other"
}

var statusKnown = map[verbs.Status]bool{
	verbs.StatusLocLenErr: true, verbs.StatusLocQPOpErr: true, verbs.StatusLocProtErr: true, verbs.StatusFlushErr: true,
	verbs.StatusLocAccess: true, verbs.StatusRemInvReq: true, verbs.StatusRemAccess: true, verbs.StatusRemOpErr: true,
	verbs.StatusRetryExc: true, verbs.StatusRNRRetryExc: true, verbs.StatusFatal: true, verbs.StatusGeneral: true,
}
