//go:build linux

package vmm

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
)

// poolGaugeText is the exposition of the four pool gauges.
func poolGaugeText(pages, bytes, used, limit uint64) string {
	return fmt.Sprintf(`
# HELP kvsidecar_vmm_blocks_used KV blocks allocated (the null block excluded).
# TYPE kvsidecar_vmm_blocks_used gauge
kvsidecar_vmm_blocks_used %d
# HELP kvsidecar_vmm_mapped_bytes Bytes of physical pages mapped across all regions.
# TYPE kvsidecar_vmm_mapped_bytes gauge
kvsidecar_vmm_mapped_bytes %d
# HELP kvsidecar_vmm_memory_limit_bytes Memory limit on mapped pages in bytes; 0 means none.
# TYPE kvsidecar_vmm_memory_limit_bytes gauge
kvsidecar_vmm_memory_limit_bytes %d
# HELP kvsidecar_vmm_pages_mapped Page indices mapped in every region (reserve included).
# TYPE kvsidecar_vmm_pages_mapped gauge
kvsidecar_vmm_pages_mapped %d
`, used, bytes, limit, pages)
}

// TestPoolGaugesSumPools: two pools reporting into one registry (two ranks
// in one process) show the sum of their Stats at each scrape, a closed pool
// counts nothing, and the families read 0 before the first pool.
func TestPoolGaugesSumPools(t *testing.T) {
	reg := prometheus.NewRegistry()
	names := []string{"kvsidecar_vmm_pages_mapped", "kvsidecar_vmm_mapped_bytes", "kvsidecar_vmm_blocks_used", "kvsidecar_vmm_memory_limit_bytes"}
	scrape := func(pages, bytes, used, limit uint64) {
		t.Helper()
		require.NoError(t, promtest.GatherAndCompare(reg, strings.NewReader(poolGaugeText(pages, bytes, used, limit)), names...))
	}
	require.NoError(t, RegisterMetrics(reg))
	scrape(0, 0, 0, 0)

	const pageBytes = 4 * testPage // testLayout has 4 regions
	ctx := context.Background()
	p1 := newTestPool(t, Config{PreallocPages: -1, MemoryLimit: 8 * pageBytes, Registerer: reg})
	p2 := newTestPool(t, Config{PreallocPages: -1, Registerer: reg})
	scrape(2, 2*pageBytes, 0, 8*pageBytes) // page 0 of each

	_, err := p1.Alloc(ctx, 40) // 31 from page 0, 9 from page 1
	require.NoError(t, err)
	_, err = p2.Alloc(ctx, 1)
	require.NoError(t, err)
	scrape(3, 3*pageBytes, 41, 8*pageBytes)

	require.NoError(t, p2.SetMemoryLimit(4*pageBytes))
	scrape(3, 3*pageBytes, 41, 12*pageBytes)

	require.NoError(t, p1.Close())
	scrape(1, pageBytes, 1, 4*pageBytes)
	require.NoError(t, p2.Close())
	scrape(0, 0, 0, 0)
}
