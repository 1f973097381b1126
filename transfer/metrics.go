package transfer

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/promutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
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
	tlsRefused *prometheus.CounterVec

	sameHostFallbacks prometheus.Counter
	sameHostBytesVec  *prometheus.CounterVec
	sameHostBytes     [2]prometheus.Counter // by role

	// byOp holds the children of the per-transfer series, looked up once
	// (WithLabelValues hashes its labels and takes a lock on every call):
	// [opIndex] then [role] then [result].
	byOp [2]opMetrics
}

// Indexes of opMetrics' arrays.
const (
	roleClient = 0 // a transfer this agent dialed
	roleServer = 1 // a transfer this agent served
)

// opMetrics are one op's children of the per-transfer series.
type opMetrics struct {
	bytes    [2]prometheus.Counter    // by role
	xfers    [2][2]prometheus.Counter // by role, then ok (0) / error (1)
	xferSecs prometheus.Observer
	postSecs prometheus.Observer
}

// op returns op's children; an op that is neither READ nor WRITE counts as
// READ, as its label does.
func (m *metrics) op(op Op) *opMetrics {
	if op == OpWrite {
		return &m.byOp[1]
	}
	return &m.byOp[0]
}

// xferDone counts a finished transfer of op in role (roleClient,
// roleServer), ok or not.
func (m *metrics) xferDone(op Op, role int, ok bool) {
	res := 1
	if ok {
		res = 0
	}
	m.op(op).xfers[role][res].Inc()
}

// RegisterMetrics registers the package's metric families on reg, every
// bounded label value (op, role, result, code) at 0, so a scrape shows them
// before the first Agent exists; Agents later created with reg count into
// them. Errors: another collector of the same name on reg.
func RegisterMetrics(reg prometheus.Registerer) error {
	_, err := newMetrics(reg)
	return err
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
		tlsRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_tls_refused_total",
			Help: "TLS handshakes this agent refused as the serving side, by reason (no_certificate, unknown_authority, expired, not_yet_valid, key_usage, invalid).",
		}, []string{"reason"}),
		sameHostFallbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_same_host_fallbacks_total",
			Help: "Same-host peers whose socket this agent could not use (unreachable, another agent or uid, pages it cannot map): their READs go over QUIC.",
		}),
		sameHostBytesVec: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_transfer_same_host_bytes_total",
			Help: "Payload bytes of READs that moved on the same-host path (mapped pages, no QUIC), by role; they count in kvsidecar_transfer_bytes_total too.",
		}, []string{"role"}),
	}
	for _, r := range tlsRefusalReasons {
		m.tlsRefused.WithLabelValues(r)
	}
	for c := range v1.Code_name {
		if code := v1.Code(c); code != v1.Code_CODE_OK {
			m.failures.WithLabelValues(code.String())
		}
		m.notifs.WithLabelValues(v1.Code(c).String())
	}
	// Several agents in one process (one per rank) share one registry.
	for _, err := range []error{
		promutil.Register(reg, &m.bytes), promutil.Register(reg, &m.xfers), promutil.Register(reg, &m.xferSecs),
		promutil.Register(reg, &m.postSecs), promutil.Register(reg, &m.failures), promutil.Register(reg, &m.inflight),
		promutil.Register(reg, &m.reconnects), promutil.Register(reg, &m.dials), promutil.Register(reg, &m.zeroRTT),
		promutil.Register(reg, &m.notifs), promutil.Register(reg, &m.tlsRefused), promutil.Register(reg, &m.sameHostFallbacks),
		promutil.Register(reg, &m.sameHostBytesVec),
	} {
		if err != nil {
			return nil, fmt.Errorf("transfer: Config.Registerer: %w", err)
		}
	}
	// After registering: the children belong to the collectors the
	// registry holds, which may be another agent's.
	for r, role := range []string{"client", "server"} {
		m.sameHostBytes[r] = m.sameHostBytesVec.WithLabelValues(role)
	}
	for i, op := range []Op{OpRead, OpWrite} {
		om := &m.byOp[i]
		om.xferSecs = m.xferSecs.WithLabelValues(op.label())
		om.postSecs = m.postSecs.WithLabelValues(op.label())
		for r, role := range []string{"client", "server"} {
			om.bytes[r] = m.bytes.WithLabelValues(op.label(), role)
			for k, result := range []string{"ok", "error"} {
				om.xfers[r][k] = m.xfers.WithLabelValues(op.label(), role, result)
			}
		}
	}
	return m, nil
}
