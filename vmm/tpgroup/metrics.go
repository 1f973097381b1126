package tpgroup

import (
	"fmt"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/promutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
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

func newMetrics(reg prometheus.Registerer, tpSize int) (*metrics, error) {
	m := &metrics{
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_tpgroup_messages_sent_total",
			Help: "Group messages this member sent, by target tp_rank.",
		}, []string{"to_rank"}),
		served: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_tpgroup_requests_served_total",
			Help: "Group requests this member answered, by kind (map, unmap, free, sync, resync, ping, invalid) and reply code.",
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
	for r := 1; r < tpSize; r++ {
		m.sent.WithLabelValues(rankLabel(r))
	}
	for _, kind := range []string{"map", "unmap", "free"} {
		m.served.WithLabelValues(kind, v1.Code_CODE_OK.String())
		m.opSeconds.WithLabelValues(kind)
	}
	// A group created again (an engine's retried create) counts into the
	// collectors of its predecessor.
	for _, err := range []error{promutil.Register(reg, &m.sent), promutil.Register(reg, &m.served),
		promutil.Register(reg, &m.rollbacks), promutil.Register(reg, &m.opSeconds)} {
		if err != nil {
			return nil, fmt.Errorf("tpgroup: register metrics: %w", err)
		}
	}
	return m, nil
}

// RegisterMetrics registers the package's metric families on reg, the
// messages to ranks 1..tpSize-1 and the successful map and unmap at 0, so a
// scrape shows them before the group starts; a Group later created with reg
// counts into them. Errors: another collector of the same name on reg.
func RegisterMetrics(reg prometheus.Registerer, tpSize int) error {
	_, err := newMetrics(reg, tpSize)
	return err
}

func rankLabel(r int) string { return strconv.Itoa(r) }
