//go:build linux && cgo

package cuda

/*
#cgo CFLAGS: -I${SRCDIR}/internal/cudaabi
#include "kvs.h"

// kvs_peer_import imports the page exported as POSIX fd fd and says which
// device its memory lives on; *stage is 1 when
// cuMemGetAllocationPropertiesFromHandle failed (the handle is then
// imported: the caller releases it).
static CUresult kvs_peer_import(const kvs_lib *l, CUcontext ctx, int fd, CUmemGenericAllocationHandle *h, int *owner, int *stage) {
	*stage = 0;
	CUresult r = kvs_import(l, ctx, fd, h);
	if (r) return r;
	*stage = 1;
	CUmemAllocationProp prop;
	memset(&prop, 0, sizeof prop);
	r = l->cuMemGetAllocationPropertiesFromHandle(&prop, *h);
	*owner = prop.location.id;
	return r;
}

static CUresult kvs_can_access_peer(const kvs_lib *l, CUdevice dev, CUdevice peer, int *can) {
	return l->cuDeviceCanAccessPeer(can, dev, peer);
}

// kvs_dtod_batch queues count device-to-device copies (n[i] bytes from
// src[i] to dst[i]) on s, then synchronizes s once. A copy the driver
// refuses stops the queueing; s is still synchronized, so nothing is left
// running, and *failed is its index. *failed is count when only
// cuStreamSynchronize failed.
static CUresult kvs_dtod_batch(const kvs_lib *l, CUcontext ctx, CUstream s, const CUdeviceptr *dst, const CUdeviceptr *src,
                               const size_t *n, size_t count, size_t *failed) {
	*failed = 0;
	CUresult r = l->cuCtxSetCurrent(ctx);
	if (r) return r;
	size_t i;
	for (i = 0; i < count; i++) {
		r = l->cuMemcpyDtoDAsync(dst[i], src[i], n[i], s);
		if (r) break;
	}
	*failed = i;
	CUresult rs = l->cuStreamSynchronize(s);
	return r ? r : rs;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"unsafe"

	"github.com/kvsidecar/kvsidecar/vmm"
)

// peerImport is what one ImportPeerPages holds: a reservation, the pages
// mapped in it, and their imported handles. Teardown removes from it what
// it gave back, so a failed release leaves only what is still held.
type peerImport struct {
	base, size uint64
	mapped     []uint64 // page addresses mapped, with the sizes below
	sizes      []uint64
	handles    []C.CUmemGenericAllocationHandle
}

// ImportPeerPages maps the pages another process exported (POSIX fds from
// cuMemExportToShareableHandle, such as vmm.Export's files from a sidecar on
// this host) read-only for this backend's device, back to back in one new
// reservation: file i, a page of sizes[i] bytes (a positive multiple of the
// granularity), is imported (cuMemImportFromShareableHandle), mapped at
// addrs[i] (cuMemMap), and the whole range gets CU_MEM_ACCESS_FLAGS_PROT_READ
// (cuMemSetAccess); CUDA Driver API reference, "Virtual Memory Management".
// The files stay the caller's. CopyOut, CopyOutAsync and CopyDeviceToDevice
// read from the range; nothing writes into it.
//
// Memory on another device needs cuDeviceCanAccessPeer ("Peer Context
// Memory Access") to say this device reaches it; when it does not, the
// error names both devices and wraps errors.ErrUnsupported, so the caller
// moves the bytes another way. release unmaps every page, releases the
// handles and frees the reservation; later calls return the first's
// result, and after Close (which releases what is left) it returns nil.
// On any error nothing stays imported, mapped or reserved, and the error
// names the driver call and the file. Other errors: lengths that differ or
// a bad size wrap vmm.ErrInvalidConfig; a closed backend wraps
// net.ErrClosed.
func (b *Backend) ImportPeerPages(files []*os.File, sizes []uint64) (addrs []uint64, release func() error, err error) {
	if len(files) == 0 || len(files) != len(sizes) {
		return nil, nil, fmt.Errorf("cuda: import peer pages: %d files and %d sizes: %w: want one size per file, at least one", len(files), len(sizes), vmm.ErrInvalidConfig)
	}
	var total uint64
	for i, s := range sizes {
		if s == 0 || s%b.gran != 0 || total+s < total {
			return nil, nil, fmt.Errorf("cuda: import peer pages: size %d of file %d is not a positive multiple of the granularity %d: %w", s, i, b.gran, vmm.ErrInvalidConfig)
		}
		total += s
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, nil, b.closedErr()
	}
	pi := &peerImport{size: total}
	fail := func(err error) ([]uint64, func() error, error) {
		if terr := b.teardownPeerLocked(pi); terr != nil {
			err = errors.Join(err, fmt.Errorf("cuda: undo a failed import of peer pages: %w", terr))
			b.peers[pi] = struct{}{} // what is still held, for Close
		}
		return nil, nil, err
	}
	var base C.CUdeviceptr
	if r := Result(C.kvs_reserve(b.lib.c, b.ctx, C.size_t(total), C.size_t(b.gran), &base)); r != Success {
		return fail(fmt.Errorf("cuda: import %d peer pages: reserve %d bytes: %w", len(files), total, call("cuMemAddressReserve", r)))
	}
	pi.base = uint64(base)
	reach := map[C.int]bool{}
	at := pi.base
	for i, f := range files {
		var h C.CUmemGenericAllocationHandle
		var owner, stage C.int
		r := Result(C.kvs_peer_import(b.lib.c, b.ctx, C.int(f.Fd()), &h, &owner, &stage))
		if stage == 1 {
			pi.handles = append(pi.handles, h)
		}
		if r != Success {
			name := [...]string{"cuMemImportFromShareableHandle", "cuMemGetAllocationPropertiesFromHandle"}[stage]
			return fail(fmt.Errorf("cuda: import peer page %d of %d (%s): %w", i, len(files), f.Name(), call(name, r)))
		}
		if C.CUdevice(owner) != b.dev {
			can, seen := reach[owner]
			if !seen {
				var v C.int
				if r := Result(C.kvs_can_access_peer(b.lib.c, b.dev, C.CUdevice(owner), &v)); r != Success {
					return fail(fmt.Errorf("cuda: import peer page %d of %d (%s): device %d to device %d: %w", i, len(files), f.Name(), b.ord, owner, call("cuDeviceCanAccessPeer", r)))
				}
				can = v != 0
				reach[owner] = can
			}
			if !can {
				return fail(fmt.Errorf("cuda: import peer page %d of %d (%s): its memory is on device %d, which device %d cannot access (cuDeviceCanAccessPeer(%d, %d) is 0): %w",
					i, len(files), f.Name(), owner, b.ord, b.ord, owner, errors.ErrUnsupported))
			}
		}
		if r := Result(C.kvs_map(b.lib.c, b.ctx, C.CUdeviceptr(at), C.size_t(sizes[i]), h)); r != Success {
			return fail(fmt.Errorf("cuda: import peer page %d of %d (%s): map %d bytes at %#x: %w", i, len(files), f.Name(), sizes[i], at, call("cuMemMap", r)))
		}
		pi.mapped, pi.sizes = append(pi.mapped, at), append(pi.sizes, sizes[i])
		at += sizes[i]
	}
	if r := Result(C.kvs_set_access(b.lib.c, b.ctx, b.dev, C.CUdeviceptr(pi.base), C.size_t(total), C.CU_MEM_ACCESS_FLAGS_PROT_READ)); r != Success {
		return fail(fmt.Errorf("cuda: import %d peer pages: %d bytes at %#x: %w", len(files), total, pi.base, call("cuMemSetAccess(CU_MEM_ACCESS_FLAGS_PROT_READ)", r)))
	}
	b.addSpan(span{base: pi.base, size: total, peer: pi})
	b.peers[pi] = struct{}{}
	var once sync.Once
	var rerr error
	release = func() error {
		once.Do(func() { rerr = b.releasePeer(pi) })
		return rerr
	}
	return slices.Clone(pi.mapped), release, nil
}

// releasePeer is the release function of ImportPeerPages.
func (b *Backend) releasePeer(pi *peerImport) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	return b.releasePeerLocked(pi)
}

// releasePeerLocked stops copies from reading an import and gives it back.
// What a failure leaves held stays in b.peers for Close to try again.
// Caller holds b.mu.
func (b *Backend) releasePeerLocked(pi *peerImport) error {
	if pi.base != 0 {
		b.removeSpan(pi.base)
	}
	err := b.teardownPeerLocked(pi)
	if pi.base == 0 && len(pi.handles) == 0 {
		delete(b.peers, pi)
	}
	return err
}

// teardownPeerLocked unmaps the pages of pi, releases its handles and frees
// its reservation (once nothing is mapped in it), dropping from pi what it
// gave back; it returns every failure, naming the call. Caller holds b.mu.
func (b *Backend) teardownPeerLocked(pi *peerImport) error {
	var errs []error
	mapped, sizes := pi.mapped[:0], pi.sizes[:0]
	for i, a := range pi.mapped {
		if r := Result(C.kvs_unmap(b.lib.c, b.ctx, C.CUdeviceptr(a), C.size_t(pi.sizes[i]))); r != Success {
			errs = append(errs, fmt.Errorf("cuda: unmap peer page at %#x: %w", a, call("cuMemUnmap", r)))
			mapped, sizes = append(mapped, a), append(sizes, pi.sizes[i])
		}
	}
	pi.mapped, pi.sizes = mapped, sizes
	handles := pi.handles[:0]
	for _, h := range pi.handles {
		if r := Result(C.kvs_release(b.lib.c, b.ctx, h)); r != Success {
			errs = append(errs, fmt.Errorf("cuda: release peer page handle %#x: %w", uint64(h), call("cuMemRelease", r)))
			handles = append(handles, h)
		}
	}
	pi.handles = handles
	if pi.base != 0 && len(pi.mapped) == 0 {
		if r := Result(C.kvs_free(b.lib.c, b.ctx, C.CUdeviceptr(pi.base), C.size_t(pi.size))); r != Success {
			errs = append(errs, fmt.Errorf("cuda: free the %d-byte reservation of peer pages at %#x: %w", pi.size, pi.base, call("cuMemAddressFree", r)))
		} else {
			pi.base = 0
		}
	}
	return errors.Join(errs...)
}

// CopyDeviceToDevice copies n[i] bytes from src[i] to dst[i] for every i,
// device to device on the backend's stream (cuMemcpyDtoDAsync_v2), and
// returns once all are done: the copies are queued, then the stream is
// synchronized once (cuStreamSynchronize); CUDA Driver API reference,
// "Memory Management" and "Stream Management". Entries contiguous in both
// dst and src run as one copy (vmm.CoalesceCopies), so N blocks contiguous
// on both sides cost one copy. Each dst range must be the backend's own
// pages mapped with access; each src range those or pages ImportPeerPages
// mapped. Nothing is copied when a range is bad (errors as for CopyIn and
// CopyOut, and vmm.ErrInvalidConfig for a peer's read-only page as a
// destination or lengths that differ). A copy the driver refuses stops
// the batch after the copies before it ran; the error names it
// (cuMemcpyDtoDAsync_v2, its index among the coalesced copies, bytes and
// addresses) or cuStreamSynchronize.
func (b *Backend) CopyDeviceToDevice(dst, src, n []uint64) error {
	if len(dst) != len(src) || len(dst) != len(n) {
		return fmt.Errorf("cuda: copy device to device: %d destinations, %d sources, %d lengths: %w", len(dst), len(src), len(n), vmm.ErrInvalidConfig)
	}
	d, s, m := vmm.CoalesceCopies(dst, src, n)
	if len(d) == 0 {
		return nil
	}
	b.smu.RLock()
	defer b.smu.RUnlock()
	b.mu.Lock()
	for i := range d {
		err := b.checkCopy("copy device to device", d[i], m[i], true)
		if err == nil {
			err = b.checkCopy("copy device to device", s[i], m[i], false)
		}
		if err != nil {
			b.mu.Unlock()
			return err
		}
	}
	b.mu.Unlock()
	var failed C.size_t
	r := Result(C.kvs_dtod_batch(b.lib.c, b.ctx, b.stream, (*C.CUdeviceptr)(unsafe.Pointer(&d[0])), (*C.CUdeviceptr)(unsafe.Pointer(&s[0])),
		(*C.size_t)(unsafe.Pointer(&m[0])), C.size_t(len(d)), &failed))
	if r == Success {
		return nil
	}
	if i := int(failed); i < len(d) {
		return fmt.Errorf("cuda: copy device to device %d of %d (%d bytes from %#x to %#x): %w", i, len(d), m[i], s[i], d[i], call("cuMemcpyDtoDAsync_v2", r))
	}
	return fmt.Errorf("cuda: copy device to device: wait for %d copies: %w", len(d), call("cuStreamSynchronize", r))
}
