package handshake

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/promutil"
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
	// Several clients in one process (one per rank) share the collectors.
	if err := promutil.Register(reg, &m.seconds); err != nil {
		return nil, err
	}
	if err := promutil.Register(reg, &m.cacheHits); err != nil {
		return nil, err
	}
	return m, nil
}
