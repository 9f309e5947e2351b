package compute

import (
	"errors"
	"fmt"
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/internal/collective"
)

// TPMetrics are the per-rank metrics of a tensor-parallel backend.
type TPMetrics struct {
	Forward    *prometheus.CounterVec // tp_rank
	Collective *prometheus.CounterVec // tp_rank, op; nil unless asked for
	Failures   *prometheus.CounterVec // tp_rank
}

// NewTPMetrics makes (and registers with reg, when set) the metrics of tp
// ranks, with collective time by op for ops (a backend whose collectives
// run asynchronously on a device passes none: it cannot time them).
func NewTPMetrics(reg prometheus.Registerer, tp int, ops ...string) *TPMetrics {
	m := &TPMetrics{
		Forward: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_tp_forward_seconds_total", Help: "Time each tensor-parallel rank spent in forward passes.",
		}, []string{"tp_rank"}),
		Failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_tp_failures_total", Help: "Forward passes a tensor-parallel rank failed (the pass's requests fail with it).",
		}, []string{"tp_rank"}),
	}
	cs := []prometheus.Collector{m.Forward, m.Failures}
	if len(ops) > 0 {
		m.Collective = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_tp_collective_seconds_total", Help: "Time each tensor-parallel rank spent in collectives (waiting for the others included), by operation.",
		}, []string{"tp_rank", "op"})
		cs = append(cs, m.Collective)
	}
	for r := range tp {
		l := fmt.Sprint(r)
		m.Forward.WithLabelValues(l)
		m.Failures.WithLabelValues(l)
		for _, op := range ops {
			m.Collective.WithLabelValues(l, op)
		}
	}
	if reg != nil {
		reg.MustRegister(cs...)
	}
	return m
}

// FirstRankError is the failure of a pass whose ranks returned errs: the
// first rank that failed on its own (not aborted by another rank's
// failure), else the first that failed; nil when none did.
func FirstRankError(errs []error) *RankError {
	cause := -1
	for i, err := range errs {
		var ce *collective.Error
		if err == nil || errors.As(err, &ce) && ce.Rank != i {
			continue // aborted by the rank that failed
		}
		cause = i
		break
	}
	if cause < 0 {
		cause = slices.IndexFunc(errs, func(err error) bool { return err != nil })
	}
	if cause < 0 {
		return nil
	}
	return &RankError{Rank: cause, Err: errs[cause]}
}
