//go:build linux && cgo

package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/testutil"
	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

// TestExampleCUDA runs the example with --backend cuda on the fake driver:
// the engine imports every sidecar's device pages and verifies the same
// bytes as on the host backend, and no call breaks a driver rule.
func TestExampleCUDA(t *testing.T) {
	lib := cudatest.Library(t)
	tr := cudatest.StartTrace(t) // this process; the sidecars inherit it
	// wallclock: the example runs real kvsidecar processes; a generous scaled bound on the whole run.
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(2*time.Minute))
	defer cancel()
	var report strings.Builder
	require.NoError(t, run(ctx, buildKvsidecar(t), 1000, lib, &report))
	t.Log(report.String())
	require.Contains(t, report.String(), "prefill TP 2 -> decode TP 4: 33030144 bytes verified, 0 mismatches")
	calls := tr.Calls(t)
	require.Empty(t, cudatest.Refused(calls), "calls that broke the driver's rules")
	h, m := cudatest.Held(calls)
	require.Zero(t, h, "allocation handles left by the sidecars and the engine")
	require.Zero(t, m, "mappings left")
}
