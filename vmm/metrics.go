package vmm

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/promutil"
)

// metrics of one Pool; names follow kvsidecar_vmm_<what>_{total,bytes,seconds}.
type metrics struct {
	pools        *poolGauges
	mapSeconds   *prometheus.HistogramVec // op = map | unmap
	failures     *prometheus.CounterVec   // op = map | unmap | hook_map | hook_unmap | hook_free
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
		pools: newPoolGauges(),
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
	for _, op := range []string{"map", "unmap", "hook_map", "hook_unmap", "hook_free"} {
		m.failures.WithLabelValues(op)
	}
	// Several pools in one process share one registry's collectors.
	for _, err := range []error{
		promutil.Register(reg, &m.pools), promutil.Register(reg, &m.mapSeconds), promutil.Register(reg, &m.failures),
		promutil.Register(reg, &m.allocRefused),
	} {
		if err != nil {
			return nil, configError("Config.Registerer", "%v", err)
		}
	}
	return m, nil
}

// poolGauges is the Collector of the pool gauges. At scrape time it sums
// Stats over every open Pool that reports into its registry (one per rank
// when several ranks share a process), so a pool keeps no running total:
// kvsidecar_vmm_pages_mapped (Stats.PagesMapped), kvsidecar_vmm_mapped_bytes
// (Stats.BytesMapped), kvsidecar_vmm_blocks_used (Stats.BlocksUsed) and
// kvsidecar_vmm_memory_limit_bytes (Stats.MemoryLimit), each 0 while no pool
// is open. Its lock is taken before a pool's, never while holding one.
type poolGauges struct {
	pagesMapped, bytesMapped, blocksUsed, limitBytes *prometheus.Desc

	mu    sync.Mutex
	pools map[*Pool]struct{}
}

func newPoolGauges() *poolGauges {
	return &poolGauges{
		pagesMapped: prometheus.NewDesc("kvsidecar_vmm_pages_mapped",
			"Page indices mapped in every region (reserve included).", nil, nil),
		bytesMapped: prometheus.NewDesc("kvsidecar_vmm_mapped_bytes",
			"Bytes of physical pages mapped across all regions.", nil, nil),
		blocksUsed: prometheus.NewDesc("kvsidecar_vmm_blocks_used",
			"KV blocks allocated (the null block excluded).", nil, nil),
		limitBytes: prometheus.NewDesc("kvsidecar_vmm_memory_limit_bytes",
			"Memory limit on mapped pages in bytes; 0 means none.", nil, nil),
		pools: map[*Pool]struct{}{},
	}
}

// Describe sends the four descriptors.
func (g *poolGauges) Describe(ch chan<- *prometheus.Desc) {
	ch <- g.pagesMapped
	ch <- g.bytesMapped
	ch <- g.blocksUsed
	ch <- g.limitBytes
}

// Collect sends each gauge summed over the open pools.
func (g *poolGauges) Collect(ch chan<- prometheus.Metric) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var pages, bytes, used, limit float64
	for p := range g.pools {
		s := p.Stats()
		pages += float64(s.PagesMapped)
		bytes += float64(s.BytesMapped)
		used += float64(s.BlocksUsed)
		limit += float64(s.MemoryLimit)
	}
	ch <- prometheus.MustNewConstMetric(g.pagesMapped, prometheus.GaugeValue, pages)
	ch <- prometheus.MustNewConstMetric(g.bytesMapped, prometheus.GaugeValue, bytes)
	ch <- prometheus.MustNewConstMetric(g.blocksUsed, prometheus.GaugeValue, used)
	ch <- prometheus.MustNewConstMetric(g.limitBytes, prometheus.GaugeValue, limit)
}

// add counts p from now on; the caller holds no pool lock.
func (g *poolGauges) add(p *Pool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.pools[p] = struct{}{}
}

// remove stops counting p (a closed pool counts nothing); the caller holds
// no pool lock.
func (g *poolGauges) remove(p *Pool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.pools, p)
}
