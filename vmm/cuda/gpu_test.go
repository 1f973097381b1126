package cuda

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/vmmtest"
)

// The GPU tests are named TestGPU*: make gpu-check runs them (and only them
// in this package) with KVSIDECAR_REQUIRE_GPU=1. fake_test.go runs the same
// suites against the fake driver on every machine.

// newGPU returns a CUDA backend on device 0 of the real driver
// (DefaultLibrary), skipping the test when there is no GPU, or failing
// instead when KVSIDECAR_REQUIRE_GPU=1 (make gpu-check).
func newGPU(t testing.TB) *Backend {
	t.Helper()
	b, err := New(nil)
	if err != nil {
		if os.Getenv("KVSIDECAR_REQUIRE_GPU") == "1" {
			t.Fatalf("KVSIDECAR_REQUIRE_GPU=1 but no GPU backend: %v", err)
		}
		if errors.Is(err, ErrNoGPU) || errors.Is(err, errors.ErrUnsupported) {
			t.Skipf("no GPU: %v", err)
		}
		t.Fatal(err)
	}
	if strings.Contains(b.LibraryPath(), "fakecuda") {
		t.Fatalf("the GPU tests loaded the fake driver %s: is it on LD_LIBRARY_PATH?", b.LibraryPath())
	}
	t.Logf("CUDA driver %d.%d from %s, device 0, granularity %d bytes", b.DriverVersion()/1000, b.DriverVersion()%1000/10, b.LibraryPath(), b.Granularity())
	t.Cleanup(func() {
		if err := b.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			t.Errorf("close cuda backend: %v", err)
		}
	})
	return b
}

func TestGPUConformance(t *testing.T) {
	vmmtest.RunConformance(t, func(t testing.TB) vmm.Backend { return newGPU(t) })
}

func TestGPUDevicePoolWriteReadBack(t *testing.T) {
	devicePoolWriteReadBack(t, newGPU(t))
}

func TestGPUStagingAndPeerCopies(t *testing.T) {
	stagingAndPeerCopies(t, newGPU(t))
}

// stagingAndPeerCopies writes a page through a page-locked buffer
// (CopyInAsync), reads it back (CopyOutAsync), imports the page's own
// POSIX fd read-only as a peer's page would be, copies it device to device
// into a second page in two coalescing halves, and reads that back; then
// gives everything back.
func stagingAndPeerCopies(t *testing.T, b *Backend) {
	g := b.Granularity()
	base, err := b.Reserve(2 * g)
	require.NoError(t, err)
	var hs []vmm.Handle
	for i := range uint64(2) {
		h, err := b.Create()
		require.NoError(t, err)
		require.NoError(t, b.Map(base+i*g, h))
		hs = append(hs, h)
	}
	require.NoError(t, b.SetAccess(base, 2*g))
	buf, free, err := b.HostBuffer(int(g))
	require.NoError(t, err)
	defer func() { require.NoError(t, free()) }()
	for i := range buf {
		buf[i] = byte(i*7 + i>>12)
	}
	want := bytes.Clone(buf)
	wait, err := b.CopyInAsync(base, buf)
	require.NoError(t, err)
	require.NoError(t, wait())
	clear(buf)
	wait, err = b.CopyOutAsync(base, buf)
	require.NoError(t, err)
	require.NoError(t, wait())
	require.True(t, bytes.Equal(want, buf), "staging copies round trip")

	f, _, err := b.Export(hs[0])
	require.NoError(t, err)
	defer f.Close()
	peer, release, err := b.ImportPeerPages([]*os.File{f}, []uint64{g})
	require.NoError(t, err)
	half := g / 2
	require.NoError(t, b.CopyDeviceToDevice([]uint64{base + g, base + g + half}, []uint64{peer[0], peer[0] + half}, []uint64{half, half}))
	require.NoError(t, release())
	got := make([]byte, g)
	require.NoError(t, b.CopyOut(base+g, got))
	require.True(t, bytes.Equal(want, got), "device-to-device copy from the imported page")
	for i, h := range hs {
		require.NoError(t, b.Unmap(base+uint64(i)*g))
		require.NoError(t, b.Release(h))
	}
	require.NoError(t, b.FreeReservation(base, 2*g))
}

// devicePoolWriteReadBack runs a Pool on device pages: blocks written with
// CopyIn read back with CopyOut, HostBytes refuses device memory, and a page
// exported as a POSIX fd imports to the same bytes.
func devicePoolWriteReadBack(t *testing.T, b *Backend) {
	g, err := kvgeom.Model("llama-3.1-8b")
	require.NoError(t, err)
	l, err := vmm.LayoutFor(g, 0, 1)
	require.NoError(t, err)
	l.Layers = 2
	ctx := context.Background()
	p, err := vmm.NewPool(ctx, &vmm.Config{Backend: b, Layout: l, NumBlocks: 512})
	require.NoError(t, err)
	defer func() { require.NoError(t, p.Close()) }()
	ids, err := p.Alloc(ctx, 100)
	require.NoError(t, err)
	blen := l.BlockLen()
	for r := range p.Regions() {
		for _, id := range []int{ids[0], ids[99]} {
			want := bytes.Repeat([]byte{byte(r), byte(id)}, int(blen/2))
			require.NoError(t, p.CopyIn(r, p.BlockOffset(id), want))
			got := make([]byte, blen)
			require.NoError(t, p.CopyOut(r, p.BlockOffset(id), got))
			require.True(t, bytes.Equal(want, got), "region %d block %d read back differs", r, id)
		}
	}
	_, err = p.HostBytes(0, 0, 8)
	require.ErrorIs(t, err, errors.ErrUnsupported)

	ex, err := p.Export([]int{0})
	require.NoError(t, err)
	defer ex.Close()
	require.Len(t, ex.Files, l.NumRegions(), "one POSIX fd per physical page")
	m := ex.Mappings[1]
	h, err := b.Import(ex.Files[m.File], m.FileOffset)
	require.NoError(t, err)
	base, err := b.Reserve(b.Granularity())
	require.NoError(t, err)
	require.NoError(t, b.Map(base, h))
	require.NoError(t, b.SetAccess(base, b.Granularity()))
	got := make([]byte, blen)
	require.NoError(t, b.CopyOut(base+p.BlockOffset(ids[0]), got))
	require.Equal(t, bytes.Repeat([]byte{1, byte(ids[0])}, int(blen/2)), got)
	require.NoError(t, b.Unmap(base))
	require.NoError(t, b.Release(h))
	require.NoError(t, b.FreeReservation(base, b.Granularity()))
	require.NoError(t, p.Free(ctx, ids))
}
