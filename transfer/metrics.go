package transfer

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/promutil"
)

// metrics are the agent's Prometheus collectors. Labels are bounded: op is
// read|write, role is client|server, result is ok|error, code is a v1.Code name.
type metrics struct {
	bytes      *prometheus.CounterVec
	xfers      *prometheus.CounterVec
	xferSecs   *prometheus.HistogramVec
	postSecs   *prometheus.HistogramVec
	failures   *prometheus.CounterVec
	inflight   prometheus.Gauge
	reconnects prometheus.Counter
	dials      prometheus.Counter
	zeroRTT    prometheus.Counter
	notifs     *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_bytes_total",
			Help: "Payload bytes moved by transfers, by op and role.",
		}, []string{"op", "role"}),
		xfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_xfers_total",
			Help: "Transfers finished, by op, role and result.",
		}, []string{"op", "role", "result"}),
		xferSecs: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvsidecar_transfer_xfer_seconds",
			Help:    "Seconds from posting a transfer (dialer side) to its completion.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{"op"}),
		postSecs: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvsidecar_transfer_post_seconds",
			Help:    "Seconds from calling Transfer until the request was on the wire (connection, back-pressure, prepare).",
			Buckets: prometheus.ExponentialBuckets(0.00005, 2, 16),
		}, []string{"op"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_failures_total",
			Help: "Failed transfers and refused requests, by error code.",
		}, []string{"code"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvsidecar_transfer_inflight_bytes",
			Help: "Bytes of transfers admitted and not yet finished, both roles.",
		}),
		reconnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_reconnects_total",
			Help: "Dials to a peer that had a connection before.",
		}),
		dials: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_dials_total",
			Help: "QUIC connections dialed.",
		}),
		zeroRTT: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_zero_rtt_total",
			Help: "Dialed connections whose 0-RTT data the server accepted.",
		}),
		notifs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_notifications_total",
			Help: "Notifications served, by result code.",
		}, []string{"code"}),
	}
	// Several agents in one process (one per rank) share one registry.
	for _, err := range []error{
		promutil.Register(reg, &m.bytes), promutil.Register(reg, &m.xfers), promutil.Register(reg, &m.xferSecs),
		promutil.Register(reg, &m.postSecs), promutil.Register(reg, &m.failures), promutil.Register(reg, &m.inflight),
		promutil.Register(reg, &m.reconnects), promutil.Register(reg, &m.dials), promutil.Register(reg, &m.zeroRTT),
		promutil.Register(reg, &m.notifs),
	} {
		if err != nil {
			return nil, fmt.Errorf("transfer: Config.Registerer: %w", err)
		}
	}
	return m, nil
}
