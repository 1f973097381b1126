package localapi

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/promutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

type serverMetrics struct {
	calls *prometheus.CounterVec
	conns prometheus.Gauge
}

func newServerMetrics(reg prometheus.Registerer) (*serverMetrics, error) {
	m := &serverMetrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_local_calls_total",
			Help: "Local API calls by call name and reply code.",
		}, []string{"call", "code"}),
		conns: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvsidecar_local_connections",
			Help: "Open local API connections.",
		}),
	}
	for _, call := range callNames() {
		m.calls.WithLabelValues(call, v1.Code_CODE_OK.String())
	}
	for _, err := range []error{promutil.Register(reg, &m.calls), promutil.Register(reg, &m.conns)} {
		if err != nil {
			return nil, err
		}
	}
	return m, nil
}
