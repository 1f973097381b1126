//go:build linux

package vmm_test

import (
	"errors"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/vmmtest"
)

func newHost(t testing.TB) vmm.Backend {
	t.Helper()
	b, err := vmm.NewHostBackend(&vmm.HostConfig{PageSize: 64 << 10})
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := b.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			t.Errorf("close host backend: %v", err)
		}
	})
	return b
}

func TestHostConformance(t *testing.T) {
	vmmtest.RunConformance(t, newHost)
}

func TestHostConformance2MiB(t *testing.T) {
	vmmtest.RunConformance(t, func(t testing.TB) vmm.Backend {
		t.Helper()
		b, err := vmm.NewHostBackend(nil)
		require.NoError(t, err)
		require.EqualValues(t, 2<<20, b.Granularity())
		t.Cleanup(func() { _ = b.Close() })
		return b
	})
}

func TestHostConfigRejects(t *testing.T) {
	_, err := vmm.NewHostBackend(&vmm.HostConfig{PageSize: 1000})
	require.ErrorIs(t, err, vmm.ErrInvalidConfig)
	require.Contains(t, err.Error(), "HostConfig.PageSize")
}
