package tpgroup

import (
	"fmt"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the group's Prometheus collectors. Labels are bounded: to_rank
// by the TP size (at most MaxTPSize), kind by the message kinds, code by the
// v1.Code enum.
type metrics struct {
	sent      *prometheus.CounterVec // to_rank
	served    *prometheus.CounterVec // kind, code
	rollbacks prometheus.Counter
	opSeconds *prometheus.HistogramVec // kind
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_tpgroup_messages_sent_total",
			Help: "Group messages this member sent, by target tp_rank.",
		}, []string{"to_rank"}),
		served: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_tpgroup_requests_served_total",
			Help: "Group requests this member answered, by kind (map, unmap, ping, invalid) and reply code.",
		}, []string{"kind", "code"}),
		rollbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_tpgroup_rollbacks_total",
			Help: "Coordinated maps that failed on some rank and were rolled back on the others.",
		}),
		opSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvsidecar_tpgroup_op_seconds",
			Help:    "Duration of a coordinated map or unmap fan-out to ranks 1..N-1, rollback included.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 4, 10),
		}, []string{"kind"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.sent, m.served, m.rollbacks, m.opSeconds} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("tpgroup: register metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) unregister(reg prometheus.Registerer) {
	if reg == nil {
		return
	}
	for _, c := range []prometheus.Collector{m.sent, m.served, m.rollbacks, m.opSeconds} {
		reg.Unregister(c)
	}
}

func rankLabel(r int) string { return strconv.Itoa(r) }
