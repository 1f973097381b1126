package vmm

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/promutil"
)

// metrics of one Pool; names follow kvsidecar_vmm_<what>_{total,bytes,seconds}.
type metrics struct {
	pagesMapped  prometheus.Gauge
	bytesMapped  prometheus.Gauge
	blocksUsed   prometheus.Gauge
	limitBytes   prometheus.Gauge
	mapSeconds   *prometheus.HistogramVec // op = map | unmap
	failures     *prometheus.CounterVec   // op = map | unmap | hook_map | hook_unmap
	allocRefused prometheus.Counter
}

// RegisterMetrics registers the package's metric families on reg, every
// bounded label value at 0, so a scrape shows them (as 0) before the first
// Pool exists; the Pools later created with reg count into them. Errors:
// another collector of the same name on reg.
func RegisterMetrics(reg prometheus.Registerer) error {
	_, err := newMetrics(reg)
	return err
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		pagesMapped: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvsidecar_vmm_pages_mapped",
			Help: "Page indices mapped in every region (reserve included).",
		}),
		bytesMapped: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvsidecar_vmm_mapped_bytes",
			Help: "Bytes of physical pages mapped across all regions.",
		}),
		blocksUsed: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvsidecar_vmm_blocks_used",
			Help: "KV blocks allocated (the null block excluded).",
		}),
		limitBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvsidecar_vmm_memory_limit_bytes",
			Help: "Memory limit on mapped pages in bytes; 0 means none.",
		}),
		mapSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvsidecar_vmm_page_op_seconds",
			Help:    "Time to map or unmap one page index in every region.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12),
		}, []string{"op"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_vmm_failures_total",
			Help: "Backend or page hook failures by operation.",
		}, []string{"op"}),
		allocRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvsidecar_vmm_alloc_refused_total",
			Help: "Alloc calls refused because the limit or the reservation had no room.",
		}),
	}
	for _, op := range []string{"map", "unmap"} {
		m.mapSeconds.WithLabelValues(op)
	}
	for _, op := range []string{"map", "unmap", "hook_map", "hook_unmap"} {
		m.failures.WithLabelValues(op)
	}
	// Several pools in one process share one registry's collectors.
	for _, err := range []error{
		promutil.Register(reg, &m.pagesMapped), promutil.Register(reg, &m.bytesMapped),
		promutil.Register(reg, &m.blocksUsed), promutil.Register(reg, &m.limitBytes),
		promutil.Register(reg, &m.mapSeconds), promutil.Register(reg, &m.failures),
		promutil.Register(reg, &m.allocRefused),
	} {
		if err != nil {
			return nil, configError("Config.Registerer", "%v", err)
		}
	}
	return m, nil
}
