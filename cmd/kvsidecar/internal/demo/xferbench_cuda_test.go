//go:build linux && cgo

package demo

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

// TestTransferBenchCUDAFake: with a cuda backend (the fake driver) the
// path rows read device pages, on the same-host path (every byte on it:
// pathBench.read checks) and over QUIC, with the cuda floors in place of
// memcpy, every byte checked; the JSON carries
// every field of the device kind, each ratio the quotient of its fields,
// and nothing is left allocated or mapped.
func TestTransferBenchCUDAFake(t *testing.T) {
	lib := cudatest.Library(t)
	t.Cleanup(cudatest.Cleanup)
	tr := cudatest.StartTrace(t)
	res, err := RunTransferBench(t.Context(), &TransferConfig{BlockSizes: []int{1 << 20}, BatchSizes: []int{1},
		Ops: []transfer.Op{transfer.OpRead}, MaxTransferBytes: 3 << 20, CellTime: time.Millisecond, BulkRounds: 1,
		LatencySamples: 1, Lanes: []int{2}, Check: true,
		Backend: func(string, int) (vmm.Backend, error) { return cuda.New(&cuda.Config{Library: lib}) }})
	require.NoError(t, err)
	b, err := json.Marshal(res)
	require.NoError(t, err)
	var got map[string]any
	require.NoError(t, json.Unmarshal(b, &got))
	checkPathFields(t, got, true, 1<<20, 3<<20, []int{1, 2})
	calls := tr.Calls(t)
	require.Empty(t, cudatest.Refused(calls), "calls that broke the driver's rules")
	h, m := cudatest.Held(calls)
	require.Zero(t, h, "allocation handles left")
	require.Zero(t, m, "mappings left")
}

// TestTransferBenchNoDriver: a cuda backend whose driver does not load
// fails the bench, naming the library: the pools are made before
// anything is measured.
func TestTransferBenchNoDriver(t *testing.T) {
	_, err := RunTransferBench(t.Context(), &TransferConfig{BlockSizes: []int{1 << 20}, BatchSizes: []int{1}, MaxTransferBytes: 1 << 20,
		Backend: func(string, int) (vmm.Backend, error) {
			return cuda.New(&cuda.Config{Library: "/nonexistent/libcuda.so.1"})
		}})
	require.ErrorIs(t, err, cuda.ErrNoGPU)
	require.ErrorContains(t, err, "demo: transfer bench: prefill backend: cuda: load /nonexistent/libcuda.so.1")
}
