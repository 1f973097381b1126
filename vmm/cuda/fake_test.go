//go:build linux && cgo

package cuda

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
	"github.com/kvsidecar/kvsidecar/vmm/vmmtest"
)

// newFake returns a backend on the fake driver (cudatest.Library) with a
// fresh call trace. At cleanup, after Close, it checks that no call broke
// one of the driver's rules and that every handle, mapping, reservation,
// host buffer, stream and event was given back.
func newFake(t testing.TB) (*Backend, *cudatest.Trace) {
	t.Helper()
	lib := cudatest.Library(t)
	tr := cudatest.StartTrace(t)
	b, err := New(&Config{Library: lib})
	require.NoError(t, err)
	require.Equal(t, lib, b.LibraryPath())
	require.Equal(t, 12040, b.DriverVersion())
	t.Cleanup(func() {
		if err := b.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			t.Errorf("close cuda backend: %v", err)
		}
		calls := tr.Calls(t)
		if refused := cudatest.Refused(calls); len(refused) > 0 {
			t.Errorf("kvsidecar broke the driver's rules: %v", refused)
		}
		if left := cudatest.Left(calls); left != (cudatest.Outstanding{}) {
			t.Errorf("after Close the driver still holds %+v", left)
		}
	})
	return b, tr
}

// TestFakeConformance is the pool conformance suite the host backend runs,
// through the real cgo code and the fake driver.
func TestFakeConformance(t *testing.T) {
	vmmtest.RunConformance(t, func(t testing.TB) vmm.Backend {
		b, _ := newFake(t)
		return b
	})
}

func TestFakeDevicePoolWriteReadBack(t *testing.T) {
	b, _ := newFake(t)
	devicePoolWriteReadBack(t, b)
}

// TestFakeCallSequence pins the driver calls of New and of one page's life.
func TestFakeCallSequence(t *testing.T) {
	b, tr := newFake(t)
	require.Equal(t, []string{
		"cuDriverGetVersion", "cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
		"cuDeviceGetAttribute", "cuDeviceGetAttribute", // VMM and POSIX-fd support
		"cuCtxSetCurrent", "cuMemGetAllocationGranularity",
		"cuCtxSetCurrent", "cuMemCreate", "cuMemExportToShareableHandle", "cuMemRelease", // the probe
		"cuCtxSetCurrent", "cuStreamCreate", // the copy stream
	}, cudatest.Names(tr.Calls(t)))
	start := len(tr.Calls(t))

	g := b.Granularity()
	base, err := b.Reserve(2 * g)
	require.NoError(t, err)
	h, err := b.Create()
	require.NoError(t, err)
	require.NoError(t, b.Map(base+g, h))
	require.NoError(t, b.SetAccess(base+g, g))
	require.NoError(t, b.CopyIn(base+g+5, []byte("kv")))
	got := make([]byte, 2)
	require.NoError(t, b.CopyOut(base+g+5, got))
	require.Equal(t, "kv", string(got))
	require.NoError(t, b.Unmap(base+g))
	require.NoError(t, b.Release(h))
	require.NoError(t, b.FreeReservation(base, 2*g))
	require.NoError(t, b.Close())
	var want []string
	for _, c := range []string{"cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemcpyHtoD_v2",
		"cuMemcpyDtoH_v2", "cuMemUnmap", "cuMemRelease", "cuMemAddressFree"} {
		want = append(want, "cuCtxSetCurrent", c)
	}
	want = append(want, "cuCtxSetCurrent", "cuStreamSynchronize", "cuStreamDestroy_v2", "cuDevicePrimaryCtxRelease_v2")
	require.Equal(t, want, cudatest.Names(tr.Calls(t)[start:]))
}

// TestFakeStartupChecks: a device that cannot serve kvsidecar's pages is a
// start-up error naming the granularity or the handle type and the
// allocation properties, never a CUDA_ERROR_INVALID_VALUE at the first page
// the pool maps; the primary context retained is given back.
func TestFakeStartupChecks(t *testing.T) {
	lib := cudatest.Library(t)
	props := "allocation properties {type: CU_MEM_ALLOCATION_TYPE_PINNED, location: CU_MEM_LOCATION_TYPE_DEVICE 0, requestedHandleTypes: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR}"
	tests := []struct {
		name   string
		env    map[string]string
		faults []cudatest.Fault
		cfg    Config
		want   []string
		is     error
	}{
		{name: "granularity not a power of two", env: map[string]string{cudatest.EnvGranularity: "3000"},
			want: []string{"cuda: device 0: granularity 3000 bytes from cuMemGetAllocationGranularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM) with " + props,
				"not a power-of-two multiple of the " + strconv.Itoa(os.Getpagesize()) + "-byte host page"}, is: vmm.ErrInvalidConfig},
		{name: "granularity zero", env: map[string]string{cudatest.EnvGranularity: "0"},
			want: []string{"granularity 0 bytes", props}, is: vmm.ErrInvalidConfig},
		{name: "granularity below the host page", env: map[string]string{cudatest.EnvGranularity: "1024"},
			want: []string{"granularity 1024 bytes", props}, is: vmm.ErrInvalidConfig},
		{name: "no POSIX file descriptors", env: map[string]string{cudatest.EnvNoPOSIXFD: "1"},
			want: []string{"cuda: device 0 cannot export memory as CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)", props},
			is:   ErrNoGPU},
		{name: "export refused at the probe", faults: []cudatest.Fault{{Call: "cuMemExportToShareableHandle", N: 1, Result: int(InvalidValue)}},
			want: []string{"cuda: device 0: start-up probe: cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) of a page of 2097152 bytes with " + props,
				"CUDA_ERROR_INVALID_VALUE"}, is: InvalidValue},
		{name: "no memory at the probe", faults: []cudatest.Fault{{Call: "cuMemCreate", N: 1, Result: int(OutOfMemory)}},
			want: []string{"start-up probe: cuMemCreate of one page of 2097152 bytes with " + props}, is: vmm.ErrOverLimit},
		{name: "no such device", cfg: Config{Device: 1},
			want: []string{"cuda: open device 1 with " + lib + ": cuda: CUDA_ERROR_INVALID_DEVICE (101)"}, is: ErrNoGPU},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			cudatest.Inject(t, tc.faults...)
			tr := cudatest.StartTrace(t)
			cfg := tc.cfg
			cfg.Library = lib
			b, err := New(&cfg)
			require.Error(t, err)
			require.Nil(t, b)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.ErrorIs(t, err, tc.is)
			calls := tr.Calls(t)
			retained, released := 0, 0
			for _, c := range calls {
				switch {
				case c.Name == "cuDevicePrimaryCtxRetain" && c.Result == 0:
					retained++
				case c.Name == "cuDevicePrimaryCtxRelease_v2" && c.Result == 0:
					released++
				}
			}
			require.Equal(t, retained, released, "primary context retains and releases: %v", calls)
			h, m := cudatest.Held(calls)
			require.Zero(t, h, "allocations left: %v", calls)
			require.Zero(t, m)
		})
	}
	t.Run("missing library", func(t *testing.T) {
		_, err := New(&Config{Library: t.TempDir() + "/libcuda.so.1"})
		require.ErrorIs(t, err, ErrNoGPU)
		require.ErrorContains(t, err, "libcuda.so.1: cannot open shared object file")
	})
}

// fakeLayout: 2 layers × K/V = 4 regions, 2 KiB blocks; with 64 KiB pages
// (FAKECUDA_GRANULARITY) 32 blocks a page.
var fakeLayout = vmm.Layout{Layers: 2, BlockSize: 16, HeadsPerRank: 1, HeadDim: 64, DTypeBytes: 2}

// newFakePool returns a pool of 8 pages of fakeLayout on the fake driver
// with 64 KiB pages and no prealloc reserve, closed (before the backend's
// checks) at cleanup.
func newFakePool(t *testing.T) (*vmm.Pool, *cudatest.Trace) {
	t.Helper()
	t.Setenv(cudatest.EnvGranularity, strconv.Itoa(64<<10))
	b, tr := newFake(t)
	p, err := vmm.NewPool(context.Background(), &vmm.Config{Backend: b, Layout: fakeLayout, NumBlocks: 32 * 8, PreallocPages: -1})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p, tr
}

// TestFakePoolPartialFailure is the host backend's partial-failure test on
// the CUDA backend: cuMemCreate out of memory, cuMemMap or cuMemSetAccess
// failing at the k-th page of an Alloc that maps two pages in every region
// rolls back with nothing mapped or created, and the same Alloc works once
// the driver does.
func TestFakePoolPartialFailure(t *testing.T) {
	nr := fakeLayout.NumRegions()
	for _, call := range []struct {
		name   string
		result Result
		is     error
	}{{"cuMemCreate", OutOfMemory, vmm.ErrOverLimit}, {"cuMemMap", InvalidValue, vmm.ErrBackend}, {"cuMemSetAccess", InvalidValue, vmm.ErrBackend}} {
		for k := 1; k <= 2*nr; k++ {
			t.Run(fmt.Sprintf("%s %d of %d fails", call.name, k, 2*nr), func(t *testing.T) {
				p, tr := newFakePool(t)
				ctx := context.Background()
				held, err := p.Alloc(ctx, 20) // inside page 0
				require.NoError(t, err)
				before := p.Stats()
				hBefore, mBefore := cudatest.Held(tr.Calls(t))
				cudatest.Inject(t, cudatest.Fault{Call: call.name, N: k, Result: int(call.result)})
				// 11 blocks left on page 0, then pages 1 and 2: 2×nr pages.
				_, err = p.Alloc(ctx, 11+32+1)
				require.ErrorIs(t, err, call.result)
				require.ErrorIs(t, err, call.is)
				var pe *vmm.PageError
				require.ErrorAs(t, err, &pe)
				require.Equal(t, (k-1)%nr, pe.Region, "region named in %v", err)
				require.Equal(t, before, p.Stats(), "pool changed by a failed Alloc")
				h, m := cudatest.Held(tr.Calls(t))
				require.Equal(t, hBefore, h, "allocation left created")
				require.Equal(t, mBefore, m, "page left mapped")
				ids, err := p.Alloc(ctx, 11+32+1)
				require.NoError(t, err, "the same Alloc once the driver works")
				require.NoError(t, p.Free(ctx, append(ids, held...)))
				require.Equal(t, 1, p.Stats().PagesMapped)
			})
		}
	}
}

// TestFakeExportFailure: an export that fails at the k-th page gives back
// the descriptors exported before it.
func TestFakeExportFailure(t *testing.T) {
	p, tr := newFakePool(t)
	ctx := context.Background()
	ids, err := p.Alloc(ctx, 40) // pages 0 and 1
	require.NoError(t, err)
	fds := openFDs(t)
	hBefore, mBefore := cudatest.Held(tr.Calls(t))
	for k := 1; k <= 2*fakeLayout.NumRegions(); k++ {
		cudatest.Inject(t, cudatest.Fault{Call: "cuMemExportToShareableHandle", N: k, Result: int(NotSupported)})
		_, err := p.Export([]int{0, 1})
		require.ErrorIs(t, err, NotSupported, "export failing at descriptor %d", k)
		require.Equal(t, fds, openFDs(t), "descriptors left open after a failed export at %d", k)
	}
	cudatest.Inject(t)
	ex, err := p.Export([]int{0, 1})
	require.NoError(t, err)
	require.Len(t, ex.Files, 2*fakeLayout.NumRegions(), "one POSIX fd per page per region")
	require.NoError(t, ex.Close())
	require.Equal(t, fds, openFDs(t))
	h, m := cudatest.Held(tr.Calls(t))
	require.Equal(t, []int{hBefore, mBefore}, []int{h, m})
	require.NoError(t, p.Free(ctx, ids))
}

func openFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// TestFakeHostTouchFaults: device memory is not host memory; Go code that
// dereferences a device address faults (here turned into a panic) instead
// of reading the bytes, and a copy reads them.
func TestFakeHostTouchFaults(t *testing.T) {
	b, _ := newFake(t)
	base, h := ownPage(t, b)
	require.NoError(t, b.CopyIn(base, []byte{42}))
	got := []byte{0}
	require.NoError(t, b.CopyOut(base, got))
	require.Equal(t, byte(42), got[0])

	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	var fault any
	func() {
		defer func() { fault = recover() }()
		sink = *(*byte)(unsafe.Add(unsafe.Pointer(nil), base))
	}()
	re, ok := fault.(runtime.Error)
	require.True(t, ok, "reading device address %#x from the host did not fault: %v", base, fault)
	addr, ok := re.(interface{ Addr() uintptr })
	require.True(t, ok, "%v", re)
	require.Equal(t, uintptr(base), addr.Addr())
	require.NoError(t, b.Unmap(base))
	require.NoError(t, b.Release(h))
}

var sink byte

// TestFakeImportAcrossBackends: two backends (as two processes would) share
// a page through its POSIX fd; writes through one are read through the
// other.
func TestFakeImportAcrossBackends(t *testing.T) {
	a, _ := newFake(t)
	b, err := New(&Config{Library: cudatest.Library(t)})
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	g := a.Granularity()
	ha, err := a.Create()
	require.NoError(t, err)
	f, off, err := a.Export(ha)
	require.NoError(t, err)
	defer f.Close()
	require.Zero(t, off)
	hb, err := b.Import(f, off)
	require.NoError(t, err)
	baseA, err := a.Reserve(g)
	require.NoError(t, err)
	baseB, err := b.Reserve(g)
	require.NoError(t, err)
	require.NoError(t, a.Map(baseA, ha))
	require.NoError(t, a.SetAccess(baseA, g))
	require.NoError(t, b.Map(baseB, hb))
	require.NoError(t, b.SetAccess(baseB, g))
	want := bytes.Repeat([]byte("page"), 1000)
	require.NoError(t, a.CopyIn(baseA+g-uint64(len(want)), want))
	got := make([]byte, len(want))
	require.NoError(t, b.CopyOut(baseB+g-uint64(len(want)), got))
	require.Equal(t, want, got)
	_, err = b.Import(f, 4096)
	require.ErrorIs(t, err, vmm.ErrInvalidConfig, "CUDA pages start at offset 0")
}

// TestFakeNotPickedByDefault: once a process loaded the fake by path, the
// default library (what serve, demo and the GPU tests use) is still the
// real driver or nothing, never the fake.
func TestFakeNotPickedByDefault(t *testing.T) {
	newFake(t)
	b, err := New(nil)
	if err != nil {
		require.ErrorIs(t, err, ErrNoGPU)
		require.NotContains(t, err.Error(), "fakecuda")
		return
	}
	defer b.Close()
	require.NotContains(t, b.LibraryPath(), "fakecuda")
}
