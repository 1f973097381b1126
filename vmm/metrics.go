package vmm

import (
	"github.com/prometheus/client_golang/prometheus"
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
	if reg != nil {
		for _, c := range []prometheus.Collector{m.pagesMapped, m.bytesMapped, m.blocksUsed, m.limitBytes, m.mapSeconds, m.failures, m.allocRefused} {
			if err := reg.Register(c); err != nil {
				return nil, configError("Config.Registerer", "%v", err)
			}
		}
	}
	return m, nil
}
