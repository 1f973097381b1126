package handshake

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/promutil"
)

type metrics struct {
	seconds   *prometheus.HistogramVec
	cacheHits prometheus.Counter
}

// RegisterMetrics registers the package's metric families on reg (the
// "ok" result of each mode at 0), so a scrape shows them before the first
// Client exists; Clients later created with reg count into them. Errors:
// another collector of the same name on reg.
func RegisterMetrics(reg prometheus.Registerer) error {
	_, err := newMetrics(reg)
	return err
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvsidecar_handshake_seconds",
			Help:    "Duration of handshake exchanges (connection set-up included), by mode and result code.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{"mode", "result"}),
		cacheHits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_handshake_cache_hits_total",
			Help: "Handshakes answered from the metadata cache.",
		}),
	}
	for _, mode := range []Mode{ModePiggyback, ModeLegacy} {
		m.seconds.WithLabelValues(mode.String(), "ok")
	}
	// Several clients in one process (one per rank) share the collectors.
	if err := promutil.Register(reg, &m.seconds); err != nil {
		return nil, err
	}
	if err := promutil.Register(reg, &m.cacheHits); err != nil {
		return nil, err
	}
	return m, nil
}
