package connector

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/promutil"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

type metrics struct {
	requests      *prometheus.CounterVec
	leasesExpired prometheus.Counter
	blocksHeld    prometheus.Gauge
	loadsInFlight prometheus.Gauge
	loadSeconds   prometheus.Histogram
	firstByte     prometheus.Histogram
	bytesRead     prometheus.Counter
	// checksumSeconds: time spent on end-to-end checksums, by op
	// (record on the prefill, verify on the decode).
	checksumSeconds    *prometheus.HistogramVec
	checksumMismatches prometheus.Counter
}

// RegisterMetrics registers the metric families of the connector (its
// outcomes that are not failure codes at 0) and of the packages a Rank
// drives (transfer, handshake, vmm) on reg, so a scrape shows them before
// the first engine attaches; the Ranks, agents, clients and pools later
// created with reg count into them. Errors: another collector of the same
// name on reg.
func RegisterMetrics(reg prometheus.Registerer) error {
	if _, err := newMetrics(reg); err != nil {
		return err
	}
	return errors.Join(transfer.RegisterMetrics(reg), handshake.RegisterMetrics(reg), vmm.RegisterMetrics(reg))
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_connector_requests_total",
			Help: "Requests by side (prefill, decode) and outcome (sent, freed_at_once, lease_expired, done, or the failure code).",
		}, []string{"side", "outcome"}),
		leasesExpired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_connector_leases_expired_total",
			Help: "Prefill leases that expired before every consumer notified.",
		}),
		blocksHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvsidecar_connector_blocks_held",
			Help: "Prefill blocks held under a lease for decode.",
		}),
		loadsInFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvsidecar_connector_loads_in_flight",
			Help: "Decode loads started and not finished.",
		}),
		loadSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvsidecar_connector_load_seconds",
			Help:    "Duration of a decode load from StartLoad to its last notification.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		firstByte: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvsidecar_connector_load_first_byte_seconds",
			Help:    "Time to first KV byte of a decode load: from StartLoad until its first KV byte is in local memory (loads that read nothing observe nothing).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}),
		bytesRead: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_connector_read_bytes_total",
			Help: "KV bytes read into local pages by decode loads.",
		}),
		checksumSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvsidecar_connector_checksum_seconds",
			Help:    "Time spent on end-to-end KV checksums per request, by op: record (prefill, at RequestFinished) or verify (decode, before a load is done).",
			Buckets: prometheus.ExponentialBuckets(0.00001, 2, 20),
		}, []string{"op"}),
		checksumMismatches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_connector_checksum_mismatches_total",
			Help: "Local blocks whose landed KV differed from the checksums their prefill recorded (reported as load errors).",
		}),
	}
	for _, op := range []string{"record", "verify"} {
		m.checksumSeconds.WithLabelValues(op)
	}
	for _, o := range []struct{ side, outcome string }{
		{"prefill", "sent"}, {"prefill", "freed_at_once"}, {"prefill", "lease_expired"}, {"decode", "done"},
	} {
		m.requests.WithLabelValues(o.side, o.outcome)
	}
	for _, err := range []error{
		promutil.Register(reg, &m.requests), promutil.Register(reg, &m.leasesExpired),
		promutil.Register(reg, &m.blocksHeld), promutil.Register(reg, &m.loadsInFlight),
		promutil.Register(reg, &m.loadSeconds), promutil.Register(reg, &m.bytesRead), promutil.Register(reg, &m.firstByte),
		promutil.Register(reg, &m.checksumSeconds), promutil.Register(reg, &m.checksumMismatches),
	} {
		if err != nil {
			return nil, err
		}
	}
	return m, nil
}
