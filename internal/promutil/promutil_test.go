package promutil_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/promutil"
)

func TestRegisterShares(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := prometheus.NewCounter(prometheus.CounterOpts{Name: "x_total", Help: "x"})
	b := prometheus.NewCounter(prometheus.CounterOpts{Name: "x_total", Help: "x"})
	require.NoError(t, promutil.Register(reg, &a))
	require.NoError(t, promutil.Register(reg, &b))
	a.Inc()
	b.Inc()
	require.Equal(t, 2.0, testutil.ToFloat64(a), "both instances count into the registered collector")

	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x_total", Help: "other type"})
	require.Error(t, promutil.Register(reg, &g))
	require.NoError(t, promutil.Register[prometheus.Counter](nil, &a))
}
