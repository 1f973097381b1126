//go:build linux && cgo

package cuda

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

// The tests of the copies that keep up (issue 32): staging copies through
// page-locked buffers on the backend's stream, and device-to-device copies
// from a peer's imported pages, on the fake driver.

// traced is a call with its arguments, for comparing traces.
type traced struct {
	Name string
	Args map[string]string
}

// without returns calls, less the context switches every C call starts
// with, as name and arguments.
func without(calls []cudatest.Call) []traced {
	var out []traced
	for _, c := range calls {
		if c.Name != "cuCtxSetCurrent" {
			out = append(out, traced{c.Name, c.Args})
		}
	}
	return out
}

// named returns the calls of entry point name.
func named(calls []cudatest.Call, name string) []cudatest.Call {
	var out []cudatest.Call
	for _, c := range calls {
		if c.Name == name {
			out = append(out, c)
		}
	}
	return out
}

// streams returns the handles cuStreamCreate returned, in order.
func streams(calls []cudatest.Call) []string {
	var out []string
	for _, c := range named(calls, "cuStreamCreate") {
		out = append(out, c.Args["stream"])
	}
	return out
}

// requireNoHostCopy fails when calls copied between host and device.
func requireNoHostCopy(t *testing.T, calls []cudatest.Call) {
	t.Helper()
	for _, c := range calls {
		switch c.Name {
		case "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2":
			t.Fatalf("a host copy on the device path: %v %v", c, c.Args)
		}
	}
}

// hostBuffer returns n bytes of page-locked memory of p, freed at cleanup.
func hostBuffer(t *testing.T, p *vmm.Pool, n int) []byte {
	t.Helper()
	buf, free, err := p.HostBuffer(n)
	require.NoError(t, err)
	require.Len(t, buf, n)
	t.Cleanup(func() { require.NoError(t, free()) })
	return buf
}

// pattern returns n bytes that differ with seed and position.
func pattern(seed, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(seed*131 + i*7 + i>>9)
	}
	return b
}

// TestFakeStagingAndPeerCopies is the GPU test of the same name on the
// fake driver: two coalescing halves make one device-to-device copy.
func TestFakeStagingAndPeerCopies(t *testing.T) {
	b, tr := newFake(t)
	stagingAndPeerCopies(t, b)
	calls := tr.Calls(t)
	require.Len(t, named(calls, "cuMemcpyDtoDAsync_v2"), 1)
	require.Equal(t, "2097152", named(calls, "cuMemcpyDtoDAsync_v2")[0].Args["bytes"])
	for _, c := range append(named(calls, "cuMemcpyHtoDAsync_v2"), named(calls, "cuMemcpyDtoHAsync_v2")...) {
		require.Equal(t, "pinned", c.Args["host"])
	}
}

// BenchmarkFakeCopyOut reads one 1 MiB range per iteration from device
// pages of the fake driver: synchronously into Go memory, or queued on the
// stream into a page-locked buffer and waited for.
func BenchmarkFakeCopyOut(b *testing.B) {
	be, err := New(&Config{Library: cudatest.Library(b)})
	require.NoError(b, err)
	defer func() { require.NoError(b, be.Close()) }()
	base, _ := ownPage(b, be)
	const n = 1 << 20
	b.Run("sync pageable", func(b *testing.B) {
		dst := make([]byte, n)
		b.SetBytes(n)
		b.ReportAllocs()
		for b.Loop() {
			if err := be.CopyOut(base, dst); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("async pinned", func(b *testing.B) {
		dst, free, err := be.HostBuffer(n)
		require.NoError(b, err)
		defer func() { require.NoError(b, free()) }()
		b.SetBytes(n)
		b.ReportAllocs()
		for b.Loop() {
			wait, err := be.CopyOutAsync(base, dst)
			if err == nil {
				err = wait()
			}
			if err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestFakeAsyncCopies: bytes written with CopyInAsync read back with
// CopyOutAsync across a page boundary. With page-locked buffers the copies
// are queued on the backend's stream (host=pinned in the trace), run when
// wait is called (the destination is untouched before), and no synchronous
// copy is made; with Go memory the driver copies at once (host=pageable).
// Freeing the buffers after the waits finds no copy still queued.
func TestFakeAsyncCopies(t *testing.T) {
	for _, tc := range []struct {
		name   string
		pinned bool
	}{{"page-locked buffers", true}, {"Go memory", false}} {
		t.Run(tc.name, func(t *testing.T) {
			p, tr := newFakePool(t)
			ids, err := p.Alloc(context.Background(), 40) // blocks 1..40: pages 0 and 1
			require.NoError(t, err)
			off, n := p.BlockOffset(ids[27]), 8*int(fakeLayout.BlockLen()) // blocks 28..35
			src, dst := make([]byte, n), make([]byte, n)
			if tc.pinned {
				src, dst = hostBuffer(t, p, n), hostBuffer(t, p, n)
			}
			copy(src, pattern(1, n))
			start := len(tr.Calls(t))

			wait, err := p.CopyInAsync(2, off, src)
			require.NoError(t, err)
			require.NoError(t, wait())
			wait, err = p.CopyOutAsync(2, off, dst)
			require.NoError(t, err)
			if tc.pinned {
				require.Equal(t, make([]byte, n), dst, "the copy ran before wait")
			} else {
				require.Equal(t, src, dst, "a copy into Go memory is done when the call returns")
			}
			require.NoError(t, wait())
			require.Equal(t, src, dst)
			require.NoError(t, wait(), "a second wait")

			calls := tr.Calls(t)
			stream := streams(calls)[0]
			host, ops := "pageable", "0"
			if tc.pinned {
				host, ops = "pinned", "1"
			}
			size := strconv.Itoa(n)
			require.Equal(t, []traced{
				{"cuEventCreate", map[string]string{"flags": "0x2"}},
				{"cuMemcpyHtoDAsync_v2", map[string]string{"bytes": size, "host": host, "stream": stream}},
				{"cuEventRecord", map[string]string{"stream": stream}},
				{"cuEventSynchronize", map[string]string{"ops": ops}},
				{"cuMemcpyDtoHAsync_v2", map[string]string{"bytes": size, "host": host, "stream": stream}}, // the event is reused
				{"cuEventRecord", map[string]string{"stream": stream}},
				{"cuEventSynchronize", map[string]string{"ops": ops}},
			}, without(calls[start:]))
			t.Cleanup(func() {
				for _, c := range named(tr.Calls(t), "cuMemFreeHost") {
					require.Equal(t, "0", c.Args["ops"], "a buffer freed while a copy of it was queued")
				}
			})
		})
	}
}

// TestFakeDoubleBuffer reads a region in chunks through two page-locked
// buffers: the copy into one is queued before the other is consumed. Every
// byte arrives, each wait runs only its own copy, and two events serve
// every copy.
func TestFakeDoubleBuffer(t *testing.T) {
	p, tr := newFakePool(t)
	ids, err := p.Alloc(context.Background(), 3*32) // pages 0..2
	require.NoError(t, err)
	const chunk, k = 24 << 10, 8
	want := pattern(3, chunk*k)
	require.NoError(t, p.CopyIn(1, 0, want))
	bufs := [2][]byte{hostBuffer(t, p, chunk), hostBuffer(t, p, chunk)}
	start := len(tr.Calls(t))

	var got []byte
	wait, err := p.CopyOutAsync(1, 0, bufs[0])
	require.NoError(t, err)
	for i := range k {
		next := func() error { return nil }
		if i+1 < k {
			next, err = p.CopyOutAsync(1, uint64((i+1)*chunk), bufs[(i+1)%2])
			require.NoError(t, err)
		}
		require.NoError(t, wait())
		got = append(got, bufs[i%2]...) // "send" it
		wait = next
	}
	require.Equal(t, want, got)
	calls := tr.Calls(t)[start:]
	require.Len(t, named(calls, "cuMemcpyDtoHAsync_v2"), k)
	require.Len(t, named(calls, "cuEventCreate"), 2)
	for _, c := range named(calls, "cuEventSynchronize") {
		require.Equal(t, "1", c.Args["ops"], "a wait ran another chunk's copy")
	}
	require.Empty(t, named(calls, "cuMemcpyDtoH_v2"))
	require.NoError(t, p.Free(context.Background(), ids))
}

// TestFakeAsyncErrors: a bad range is refused before the driver is asked;
// a refused call is named with its CUresult; a failed cuEventRecord leaves
// no copy running; wait reports a failure of the copy; nothing is usable
// after Close.
func TestFakeAsyncErrors(t *testing.T) {
	tests := []struct {
		name     string
		faults   []cudatest.Fault
		run      func(b *Backend, page uint64) error // page: a mapped page, followed by an unmapped one
		is       []error
		contains []string
		synced   bool // the refused call is followed by cuStreamSynchronize
	}{
		{name: "unmapped page", run: func(b *Backend, page uint64) error {
			_, err := b.CopyOutAsync(page+b.Granularity()-8, make([]byte, 16))
			return err
		}, is: []error{vmm.ErrNotMapped}, contains: []string{"vmm: copy out at 0x"}},
		{name: "outside every reservation", run: func(b *Backend, _ uint64) error {
			_, err := b.CopyInAsync(4096, []byte{1})
			return err
		}, is: []error{vmm.ErrBlockOutOfRange}, contains: []string{"not inside the reservations"}},
		{name: "copy refused", faults: []cudatest.Fault{{Call: "cuMemcpyDtoHAsync_v2", N: 1, Result: int(InvalidValue)}},
			run: func(b *Backend, page uint64) error {
				_, err := b.CopyOutAsync(page, make([]byte, 64))
				return err
			}, is: []error{InvalidValue, vmm.ErrBackend}, contains: []string{"cuda: copy out of 64 bytes at 0x", "cuMemcpyDtoHAsync_v2", "CUDA_ERROR_INVALID_VALUE"}},
		{name: "record refused", faults: []cudatest.Fault{{Call: "cuEventRecord", N: 1, Result: int(InvalidHandle)}},
			run: func(b *Backend, page uint64) error {
				_, err := b.CopyInAsync(page, make([]byte, 64))
				return err
			}, is: []error{InvalidHandle}, contains: []string{"cuda: copy in of 64 bytes", "cuEventRecord"}, synced: true},
		{name: "no event", faults: []cudatest.Fault{{Call: "cuEventCreate", N: 1, Result: int(OutOfMemory)}},
			run: func(b *Backend, page uint64) error {
				_, err := b.CopyInAsync(page, make([]byte, 64))
				return err
			}, is: []error{vmm.ErrOverLimit}, contains: []string{"cuEventCreate(CU_EVENT_DISABLE_TIMING)"}},
		{name: "wait fails", faults: []cudatest.Fault{{Call: "cuEventSynchronize", N: 1, Result: int(IllegalAddress)}},
			run: func(b *Backend, page uint64) error {
				wait, err := b.CopyOutAsync(page, make([]byte, 64))
				if err != nil {
					return err
				}
				return wait()
			}, is: []error{IllegalAddress}, contains: []string{"cuda: wait for copy out of 64 bytes at 0x", "cuEventSynchronize"}},
		{name: "host buffer of no bytes", run: func(b *Backend, _ uint64) error {
			_, _, err := b.HostBuffer(0)
			return err
		}, is: []error{vmm.ErrInvalidConfig}, contains: []string{"cuda: host buffer of 0 bytes"}},
		{name: "no page-locked memory", faults: []cudatest.Fault{{Call: "cuMemHostAlloc", N: 1, Result: int(OutOfMemory)}},
			run: func(b *Backend, _ uint64) error {
				_, _, err := b.HostBuffer(4096)
				return err
			}, is: []error{vmm.ErrOverLimit}, contains: []string{"cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, tr := newFake(t)
			g := b.Granularity()
			base, err := b.Reserve(2 * g)
			require.NoError(t, err)
			h, err := b.Create()
			require.NoError(t, err)
			require.NoError(t, b.Map(base, h))
			require.NoError(t, b.SetAccess(base, g))
			cudatest.Inject(t, tc.faults...)
			start := len(tr.Calls(t))
			err = tc.run(b, base)
			require.Error(t, err)
			for _, is := range tc.is {
				require.ErrorIs(t, err, is)
			}
			for _, s := range tc.contains {
				require.ErrorContains(t, err, s)
			}
			calls := tr.Calls(t)[start:]
			if len(tc.faults) == 0 {
				require.Empty(t, named(calls, "cuMemcpyDtoHAsync_v2"), "a bad range reached the driver")
				require.Empty(t, named(calls, "cuMemcpyHtoDAsync_v2"), "a bad range reached the driver")
			}
			for i, c := range calls {
				if c.Result != 0 {
					require.Equal(t, tc.synced, len(named(calls[i+1:], "cuStreamSynchronize")) == 1, "the copy left running")
					break
				}
			}
		})
	}
	t.Run("after Close", func(t *testing.T) {
		b, _ := newFake(t)
		base, _ := ownPage(t, b)
		buf, free, err := b.HostBuffer(64)
		require.NoError(t, err)
		wait, err := b.CopyOutAsync(base, buf)
		require.NoError(t, err)
		require.NoError(t, b.Close())
		require.ErrorIs(t, wait(), net.ErrClosed)
		require.NoError(t, free(), "Close freed it")
		_, _, err = b.HostBuffer(64)
		require.ErrorIs(t, err, net.ErrClosed)
		_, err = b.CopyInAsync(base, []byte{1})
		require.ErrorIs(t, err, net.ErrClosed)
		require.ErrorIs(t, b.CopyDeviceToDevice([]uint64{base}, []uint64{base + 8}, []uint64{8}), net.ErrClosed)
	})
}

// newFakePair returns two pools of fakeLayout on two backends of the fake
// driver (as two sidecars on one host would have) and the one trace of
// both.
func newFakePair(t *testing.T) (a, b *vmm.Pool, tr *cudatest.Trace) {
	t.Helper()
	a, tr = newFakePool(t)
	be, err := New(&Config{Library: cudatest.Library(t)})
	require.NoError(t, err)
	b, err = vmm.NewPool(context.Background(), &vmm.Config{Backend: be, Layout: fakeLayout, NumBlocks: 32 * 8, PreallocPages: -1})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, b.Close())
		require.NoError(t, be.Close())
	})
	return a, b, tr
}

// TestFakeCopyFromPeer: a decode pool imports the pages a prefill pool
// exported and copies blocks device to device into its own. Every byte
// arrives, no byte goes through the host, the peer's pages are mapped
// read-only and released afterwards, and a run of blocks contiguous on both
// sides (here across a page boundary) is one copy per region, all behind
// one synchronization.
func TestFakeCopyFromPeer(t *testing.T) {
	nr := fakeLayout.NumRegions()
	blen := fakeLayout.BlockLen()
	for _, tc := range []struct {
		name   string
		pick   func(ids []int) []int
		copies int // per region
	}{
		{"40 contiguous blocks", func(ids []int) []int { return ids }, 1},
		{"every other block", func(ids []int) []int {
			var out []int
			for i := 0; i < len(ids); i += 2 {
				out = append(out, ids[i])
			}
			return out
		}, 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pre, dec, tr := newFakePair(t)
			ctx := context.Background()
			src, err := pre.Alloc(ctx, 40) // blocks 1..40: pages 0 and 1
			require.NoError(t, err)
			for r := range nr {
				for _, id := range src {
					require.NoError(t, pre.CopyIn(r, pre.BlockOffset(id), pattern(100*r+id, int(blen))))
				}
			}
			dst, err := dec.Alloc(ctx, 40)
			require.NoError(t, err)
			ex, err := pre.Export([]int{0, 1})
			require.NoError(t, err)
			defer ex.Close()
			start := len(tr.Calls(t))

			pp, err := dec.ImportPeer(ex)
			require.NoError(t, err)
			var copies []vmm.PeerCopy
			sel, dsel := tc.pick(src), tc.pick(dst)
			for r := range nr {
				for k := range sel {
					at, err := pp.Addr(r, pre.BlockOffset(sel[k]), blen)
					require.NoError(t, err)
					copies = append(copies, vmm.PeerCopy{Region: r, Off: dec.BlockOffset(dsel[k]), Src: at, Len: blen})
				}
			}
			require.NoError(t, dec.CopyFromPeer(copies))
			require.NoError(t, pp.Release())
			require.NoError(t, pp.Release(), "a second release")

			calls := tr.Calls(t)[start:]
			requireNoHostCopy(t, calls)
			dtod := named(calls, "cuMemcpyDtoDAsync_v2")
			require.Len(t, dtod, tc.copies*nr)
			decStream := streams(tr.Calls(t))[1]
			for _, c := range dtod {
				require.Equal(t, decStream, c.Args["stream"], "on the decode backend's stream")
				require.Equal(t, strconv.Itoa(len(sel)/tc.copies*int(blen)), c.Args["bytes"])
			}
			require.Len(t, named(calls, "cuStreamSynchronize"), 1, "one synchronization for the batch")
			require.Len(t, named(calls, "cuMemImportFromShareableHandle"), 2*nr)
			require.Equal(t, cudatest.Outstanding{}, cudatest.Left(calls), "the peer's pages are not all given back")

			got := make([]byte, blen)
			for r := range nr {
				for k := range sel {
					require.NoError(t, dec.CopyOut(r, dec.BlockOffset(dsel[k]), got))
					require.True(t, bytes.Equal(pattern(100*r+sel[k], int(blen)), got), "region %d block %d", r, dsel[k])
				}
			}
		})
	}
}

// peerPage makes one page on backend a, fills it with pattern(seed) and
// exports it; the page is given back at cleanup.
func peerPage(t *testing.T, a *Backend, seed int) (*os.File, []byte) {
	t.Helper()
	g := a.Granularity()
	base, h := ownPage(t, a)
	want := pattern(seed, int(g))
	require.NoError(t, a.CopyIn(base, want))
	f, _, err := a.Export(h)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, f.Close())
		require.NoError(t, a.Unmap(base))
		require.NoError(t, a.Release(h))
		require.NoError(t, a.FreeReservation(base, g))
	})
	return f, want
}

// ownPage reserves, creates, maps and opens one page of b (Close gives it
// back) and returns its address and handle.
func ownPage(t testing.TB, b *Backend) (uint64, vmm.Handle) {
	t.Helper()
	g := b.Granularity()
	base, err := b.Reserve(g)
	require.NoError(t, err)
	h, err := b.Create()
	require.NoError(t, err)
	require.NoError(t, b.Map(base, h))
	require.NoError(t, b.SetAccess(base, g))
	return base, h
}

// TestFakePeerAcrossDevices: memory on another device is imported and
// copied from when cuDeviceCanAccessPeer says this device reaches it, and
// refused up front, naming both devices, with errors.ErrUnsupported and
// nothing left held, when it says not.
func TestFakePeerAcrossDevices(t *testing.T) {
	for _, tc := range []struct {
		name string
		peer bool
	}{{"peer access", true}, {"no peer access", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(cudatest.EnvDevices, "2")
			if !tc.peer {
				t.Setenv(cudatest.EnvNoPeerAccess, "1")
			}
			b, tr := newFake(t) // device 0: the reader
			a, err := New(&Config{Library: cudatest.Library(t), Device: 1})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, a.Close()) })
			g := b.Granularity()
			f, want := peerPage(t, a, 5)
			dst, _ := ownPage(t, b)
			start := len(tr.Calls(t))
			addrs, release, err := b.ImportPeerPages([]*os.File{f}, []uint64{g})
			calls := tr.Calls(t)[start:]
			require.Len(t, named(calls, "cuDeviceCanAccessPeer"), 1)
			if !tc.peer {
				require.ErrorIs(t, err, errors.ErrUnsupported)
				require.ErrorContains(t, err, "cuda: import peer page 0 of 1 (cuda-page-0x")
				require.ErrorContains(t, err, "its memory is on device 1, which device 0 cannot access (cuDeviceCanAccessPeer(0, 1) is 0)")
				require.Equal(t, cudatest.Outstanding{}, cudatest.Left(calls))
				return
			}
			require.NoError(t, err)
			require.NoError(t, b.CopyDeviceToDevice([]uint64{dst}, []uint64{addrs[0]}, []uint64{g}))
			require.NoError(t, release())
			calls = tr.Calls(t)[start:]
			requireNoHostCopy(t, calls)
			require.Equal(t, cudatest.Outstanding{}, cudatest.Left(calls))
			got := make([]byte, g)
			require.NoError(t, b.CopyOut(dst, got))
			require.True(t, bytes.Equal(want, got), "the bytes of device 1's page")
		})
	}
}

// TestFakePeerImportFaults: a driver call that fails at any step of
// ImportPeerPages is named in the error with the file, and leaves nothing
// imported, mapped or reserved; when undoing fails too, both are said and
// Close gives back the rest.
func TestFakePeerImportFaults(t *testing.T) {
	tests := []struct {
		name     string
		faults   []cudatest.Fault
		is       error
		contains []string
		stuck    bool // the undo failed: something stays until Close
	}{
		{name: "no address space", faults: []cudatest.Fault{{Call: "cuMemAddressReserve", N: 1, Result: int(OutOfMemory)}},
			is: vmm.ErrOverLimit, contains: []string{"cuda: import 3 peer pages: reserve", "cuMemAddressReserve"}},
		{name: "third import refused", faults: []cudatest.Fault{{Call: "cuMemImportFromShareableHandle", N: 3, Result: int(InvalidValue)}},
			is: InvalidValue, contains: []string{"cuda: import peer page 2 of 3 (cuda-page-0x", "cuMemImportFromShareableHandle"}},
		{name: "properties refused", faults: []cudatest.Fault{{Call: "cuMemGetAllocationPropertiesFromHandle", N: 2, Result: int(InvalidValue)}},
			is: InvalidValue, contains: []string{"import peer page 1 of 3", "cuMemGetAllocationPropertiesFromHandle"}},
		{name: "second map refused", faults: []cudatest.Fault{{Call: "cuMemMap", N: 2, Result: int(InvalidValue)}},
			is: InvalidValue, contains: []string{"import peer page 1 of 3", "map 2097152 bytes at 0x", "cuMemMap"}},
		{name: "read access refused", faults: []cudatest.Fault{{Call: "cuMemSetAccess", N: 1, Result: int(NotSupported)}},
			is: NotSupported, contains: []string{"cuda: import 3 peer pages: 6291456 bytes at 0x", "cuMemSetAccess(CU_MEM_ACCESS_FLAGS_PROT_READ)"}},
		{name: "undo fails too", faults: []cudatest.Fault{{Call: "cuMemMap", N: 3, Result: int(InvalidValue)}, {Call: "cuMemUnmap", N: 1, Result: int(InvalidValue)}},
			is: InvalidValue, contains: []string{"import peer page 2 of 3", "undo a failed import of peer pages", "cuda: unmap peer page at 0x"}, stuck: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, tr := newFake(t)
			var files []*os.File
			for i := range 3 {
				f, _ := peerPage(t, a, i)
				files = append(files, f)
			}
			start := len(tr.Calls(t))
			b, err := New(&Config{Library: cudatest.Library(t)}) // the reader, traced from its start
			require.NoError(t, err)
			g := b.Granularity()
			cudatest.Inject(t, tc.faults...)
			_, _, err = b.ImportPeerPages(files, []uint64{g, g, g})
			require.ErrorIs(t, err, tc.is)
			for _, s := range tc.contains {
				require.ErrorContains(t, err, s)
			}
			left := cudatest.Left(tr.Calls(t)[start:])
			if !tc.stuck {
				require.Equal(t, cudatest.Outstanding{Streams: 1}, left, "held after the failed import, besides the stream")
			} else {
				require.Equal(t, 1, left.Mappings, "the page whose unmap failed")
			}
			cudatest.Inject(t)
			require.NoError(t, b.Close())
			require.Equal(t, cudatest.Outstanding{}, cudatest.Left(tr.Calls(t)[start:]), "held after Close")
		})
	}
}

// TestFakePeerCopyChecks: the peer's pages are read-only to every copy;
// ranges are checked before any copy is queued; a copy the driver refuses
// in a batch is named with its index, after the copies before it ran; a
// released import is gone.
func TestFakePeerCopyChecks(t *testing.T) {
	a, tr := newFake(t)
	b, err := New(&Config{Library: cudatest.Library(t)})
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	g := b.Granularity()
	f0, want0 := peerPage(t, a, 7)
	f1, want1 := peerPage(t, a, 8)
	peer, release, err := b.ImportPeerPages([]*os.File{f0, f1}, []uint64{g, g})
	require.NoError(t, err)
	require.Equal(t, []uint64{peer[0], peer[0] + g}, peer, "one range, back to back")
	own, _ := ownPage(t, b)
	unmapped, err := b.Reserve(g)
	require.NoError(t, err)

	got := make([]byte, 64)
	wait, err := b.CopyOutAsync(peer[1]+g-64, got)
	require.NoError(t, err, "a peer's page reads")
	require.NoError(t, wait())
	require.Equal(t, want1[g-64:], got)

	for _, tc := range []struct {
		name     string
		run      func() error
		is       error
		contains string
	}{
		{"into a peer's page", func() error { return b.CopyDeviceToDevice([]uint64{peer[0]}, []uint64{own}, []uint64{8}) },
			vmm.ErrInvalidConfig, "mapped read-only by ImportPeerPages, is not a copy destination"},
		{"async into a peer's page", func() error { _, err := b.CopyInAsync(peer[1], []byte{1}); return err },
			vmm.ErrInvalidConfig, "is not a copy destination"},
		{"past the peer's pages", func() error { return b.CopyDeviceToDevice([]uint64{own}, []uint64{peer[1] + g - 8}, []uint64{16}) },
			vmm.ErrBlockOutOfRange, "not inside the reservations"},
		{"from an unmapped page", func() error { return b.CopyDeviceToDevice([]uint64{own}, []uint64{unmapped}, []uint64{16}) },
			vmm.ErrNotMapped, "vmm: copy device to device at 0x"},
		{"a bad second range", func() error {
			return b.CopyDeviceToDevice([]uint64{own, own + 64}, []uint64{peer[0], unmapped}, []uint64{8, 8})
		}, vmm.ErrNotMapped, "copy device to device"},
		{"lengths differ", func() error { return b.CopyDeviceToDevice([]uint64{own}, nil, []uint64{8}) },
			vmm.ErrInvalidConfig, "1 destinations, 0 sources, 1 lengths"},
		{"no files", func() error { _, _, err := b.ImportPeerPages(nil, nil); return err }, vmm.ErrInvalidConfig, "0 files and 0 sizes"},
		{"a size off the granularity", func() error { _, _, err := b.ImportPeerPages([]*os.File{f0}, []uint64{g / 2}); return err },
			vmm.ErrInvalidConfig, "size 1048576 of file 0 is not a positive multiple of the granularity 2097152"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := len(tr.Calls(t))
			err := tc.run()
			require.ErrorIs(t, err, tc.is)
			require.ErrorContains(t, err, tc.contains)
			require.Empty(t, named(tr.Calls(t)[start:], "cuMemcpyDtoDAsync_v2"), "a copy was queued")
		})
	}

	t.Run("refused in a batch", func(t *testing.T) {
		for _, tc := range []struct {
			fault    cudatest.Fault
			is       Result
			contains string
			landed   bool // the first copy ran
		}{
			{cudatest.Fault{Call: "cuMemcpyDtoDAsync_v2", N: 2, Result: int(InvalidValue)}, InvalidValue,
				"cuda: copy device to device 1 of 3 (64 bytes from 0x", true},
			{cudatest.Fault{Call: "cuStreamSynchronize", N: 1, Result: int(IllegalAddress)}, IllegalAddress,
				"cuda: copy device to device: wait for 3 copies", false},
		} {
			t.Run(tc.fault.Call, func(t *testing.T) {
				require.NoError(t, b.CopyIn(own, make([]byte, 256)))
				cudatest.Inject(t, tc.fault)
				start := len(tr.Calls(t))
				// Three copies that do not coalesce (gaps on the destination).
				err := b.CopyDeviceToDevice([]uint64{own, own + 100, own + 200}, []uint64{peer[0], peer[0] + 64, peer[0] + 128}, []uint64{64, 64, 64})
				require.ErrorIs(t, err, tc.is)
				require.ErrorContains(t, err, tc.contains)
				calls := tr.Calls(t)[start:]
				require.Len(t, named(calls, "cuStreamSynchronize"), 1, "the stream is synchronized after a refused copy")
				cudatest.Inject(t)
				got := make([]byte, 64)
				require.NoError(t, b.CopyOut(own, got))
				require.Equal(t, tc.landed, bytes.Equal(want0[:64], got))
			})
		}
	})

	require.NoError(t, release())
	require.NoError(t, release(), "a second release")
	err = b.CopyDeviceToDevice([]uint64{own}, []uint64{peer[0]}, []uint64{8})
	require.ErrorIs(t, err, vmm.ErrBlockOutOfRange, "the released range")
}
