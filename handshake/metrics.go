package handshake

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	seconds   *prometheus.HistogramVec
	cacheHits prometheus.Counter
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
	if reg == nil {
		return m, nil
	}
	// Several clients in one process (one per rank) share the collectors.
	if err := register(reg, &m.seconds); err != nil {
		return nil, err
	}
	if err := register(reg, &m.cacheHits); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers *c, or replaces *c with the collector already
// registered under the same descriptor.
func register[C prometheus.Collector](reg prometheus.Registerer, c *C) error {
	err := reg.Register(*c)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			*c = existing
			return nil
		}
	}
	return err
}
