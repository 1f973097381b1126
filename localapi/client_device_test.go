//go:build linux && cgo

package localapi_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/localapi"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

var _ localapi.DeviceImporter = (*cuda.Backend)(nil)

// TestLocalDeviceMemory: a sidecar whose pool is CUDA device memory (the
// fake driver here) passes its pages as POSIX fds; the Go client imports
// them through the DeviceImporter it was given, and bytes written through
// either side are read through the other. No driver rule is broken and
// nothing stays allocated or mapped once both sides closed.
func TestLocalDeviceMemory(t *testing.T) {
	lib := cudatest.Library(t)
	tr := cudatest.StartTrace(t)
	s := newLocalSidecarWith(t, "device", nil, nil, func() (vmm.Backend, error) { return cuda.New(&cuda.Config{Library: lib}) })
	imp, err := cuda.New(&cuda.Config{Library: lib})
	require.NoError(t, err)

	t.Run("no importer", func(t *testing.T) {
		c := dialLocal(t, s)
		_, err := c.Attach(t.Context(), createReq(gqa8, 512))
		require.ErrorIs(t, err, errors.ErrUnsupported)
		require.ErrorContains(t, err, "ClientConfig.DeviceImporter")
	})

	c, err := localapi.Dial(t.Context(), s.srv.Path(), &localapi.ClientConfig{DeviceImporter: imp})
	require.NoError(t, err)
	info, err := c.Attach(t.Context(), createReq(gqa8, 512))
	require.NoError(t, err)
	require.True(t, info.GetDeviceMemory())
	require.Equal(t, imp.Granularity(), info.GetPageSize())
	pool := s.srv.Cache().Pool
	require.Nil(t, c.Region(0), "no host view of device memory")

	ids, err := c.Alloc(t.Context(), 200)
	require.NoError(t, err)
	_, err = c.Block(0, int(ids[0]))
	require.ErrorIs(t, err, localapi.ErrDeviceMemory)
	require.ErrorIs(t, err, errors.ErrUnsupported)

	// The engine writes through its imported mapping; the sidecar reads it.
	shape := kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 0, Heads: 8}
	buf := make([]byte, info.GetBlockLen())
	for r := range int(info.GetNumRegions()) {
		for k, id := range ids {
			kvgen.FillBlock(buf, shape, 5, r, k*16)
			require.NoError(t, c.WriteBlock(r, int(id), buf))
		}
	}
	got := make([]byte, info.GetBlockLen())
	for r := range int(info.GetNumRegions()) {
		for k, id := range ids {
			require.NoError(t, pool.CopyOut(r, pool.BlockOffset(int(id)), got))
			bad, first := kvgen.CheckBlock(got, shape, 5, r, k*16)
			require.Zero(t, bad, "sidecar's view of region %d block %d: first bad byte %d", r, id, first)
		}
	}
	// And the other way.
	require.NoError(t, pool.CopyIn(2, pool.BlockOffset(int(ids[150])), []byte("from the sidecar")))
	part := make([]byte, 16)
	require.NoError(t, c.ReadBlock(2, int(ids[150]), part))
	require.Equal(t, "from the sidecar", string(part))
	require.ErrorIs(t, c.ReadBlock(2, int(ids[150]), make([]byte, info.GetBlockLen()+1)), localapi.ErrInvalidArgument)

	// BlockAddr is a device address in this process's reservation: a copy
	// through it reads the block.
	addr, err := c.BlockAddr(2, int(ids[150]))
	require.NoError(t, err)
	require.NoError(t, imp.CopyOut(addr, part))
	require.Equal(t, "from the sidecar", string(part))

	// Freeing unmaps the pages in the engine too.
	before := pool.Stats().PagesMapped
	require.NoError(t, c.Free(t.Context(), ids))
	require.Less(t, pool.Stats().PagesMapped, before)
	require.ErrorIs(t, c.ReadBlock(0, int(ids[len(ids)-1]), part), localapi.ErrInvalidArgument,
		"the engine dropped its mapping of the unmapped page")
	ids, err = c.Alloc(t.Context(), 100)
	require.NoError(t, err)
	require.NoError(t, c.WriteBlock(3, int(ids[99]), bytes.Repeat([]byte{7}, 64)))

	require.NoError(t, c.Close())
	require.NoError(t, imp.Close())
	require.NoError(t, s.srv.Close())
	calls := tr.Calls(t)
	require.Empty(t, cudatest.Refused(calls), "calls that broke the driver's rules")
	h, m := cudatest.Held(calls)
	require.Zero(t, h, "allocation handles left")
	require.Zero(t, m, "mappings left")
	require.Positive(t, countCalls(calls, "cuMemImportFromShareableHandle"))
}

func countCalls(calls []cudatest.Call, name string) int {
	n := 0
	for _, c := range calls {
		if c.Name == name && c.Result == 0 {
			n++
		}
	}
	return n
}
