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
	// Staging of GPU memory without GPUDirect RDMA.
	regions   *prometheus.GaugeVec   // kind (host, dmabuf, staged): registered regions
	fallbacks *prometheus.CounterVec // reason: GPU regions staged for want of GPUDirect RDMA
	staged    *prometheus.CounterVec // side (local, remote), op: bytes moved through staging
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
		regions: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mooncake_rdma_registered_regions", Help: "Local regions registered with rdma, by kind: host (ibv_reg_mr), dmabuf (GPUDirect RDMA), staged (GPU memory through host buffers).",
		}, []string{"kind"}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_rdma_staging_fallbacks_total", Help: "GPU regions staged through host buffers for want of GPUDirect RDMA, by reason (no_dmabuf, dmabuf_export, reg_dmabuf_mr).",
		}, []string{"reason"}),
		staged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_rdma_staged_bytes_total", Help: "Bytes of staged pieces moved, by the side whose GPU memory was staged (local: at least this side; remote: only the peer's) and op.",
		}, []string{"side", "op"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.bytes, m.errors, m.retries, m.qps, m.regions, m.fallbacks, m.staged} {
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
