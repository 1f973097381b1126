//go:build linux && cgo

package cuda

/*
#cgo CFLAGS: -I${SRCDIR}/internal/cudaabi
#include "kvs.h"

// kvs_host_alloc allocates n bytes of page-locked host memory that every
// context may use (CU_MEMHOSTALLOC_PORTABLE).
static CUresult kvs_host_alloc(const kvs_lib *l, CUcontext ctx, size_t n, void **p) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemHostAlloc(p, n, CU_MEMHOSTALLOC_PORTABLE);
}

static CUresult kvs_host_free(const kvs_lib *l, CUcontext ctx, void *p) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemFreeHost(p);
}

// kvs_stream_create creates the backend's stream: CU_STREAM_NON_BLOCKING,
// so its copies neither wait for nor hold up work on the NULL stream.
static CUresult kvs_stream_create(const kvs_lib *l, CUcontext ctx, CUstream *s) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuStreamCreate(s, CU_STREAM_NON_BLOCKING);
}

// kvs_stream_close waits for the copies queued on s, then destroys it;
// *stage is 1 when cuStreamDestroy_v2 failed.
static CUresult kvs_stream_close(const kvs_lib *l, CUcontext ctx, CUstream s, int *stage) {
	*stage = 0;
	CUresult r = l->cuCtxSetCurrent(ctx);
	if (!r) r = l->cuStreamSynchronize(s);
	CUresult rd = l->cuStreamDestroy(s);
	if (rd && !r) *stage = 1;
	return r ? r : rd;
}

// kvs_event_create makes an event for completion only: CU_EVENT_DISABLE_TIMING
// keeps cuEventRecord and cuEventSynchronize cheap.
static CUresult kvs_event_create(const kvs_lib *l, CUcontext ctx, CUevent *e) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuEventCreate(e, CU_EVENT_DISABLE_TIMING);
}

static CUresult kvs_event_sync(const kvs_lib *l, CUcontext ctx, CUevent e) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuEventSynchronize(e);
}

static CUresult kvs_event_destroy(const kvs_lib *l, CUcontext ctx, CUevent e) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuEventDestroy(e);
}

// kvs_copy_async queues one copy between host memory h and device memory d
// on s (device to host when out) and records e after it. *stage says which
// call failed: 0 the copy, 1 cuEventRecord (then s is synchronized, so the
// copy is not left running), 2 that cuStreamSynchronize.
static CUresult kvs_copy_async(const kvs_lib *l, CUcontext ctx, int out, CUdeviceptr d, void *h, size_t n, CUstream s, CUevent e, int *stage) {
	*stage = 0;
	CUresult r = l->cuCtxSetCurrent(ctx);
	if (r) return r;
	r = out ? l->cuMemcpyDtoHAsync(h, d, n, s) : l->cuMemcpyHtoDAsync(d, h, n, s);
	if (r) return r;
	*stage = 1;
	r = l->cuEventRecord(e, s);
	if (r) {
		CUresult rs = l->cuStreamSynchronize(s);
		if (rs) {
			*stage = 2;
			return rs;
		}
	}
	return r;
}
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/kvsidecar/kvsidecar/vmm"
)

// createStream creates the backend's copy stream (New).
func (b *Backend) createStream() error {
	if r := Result(C.kvs_stream_create(b.lib.c, b.ctx, &b.stream)); r != Success {
		return fmt.Errorf("cuda: device %d: cuStreamCreate(CU_STREAM_NON_BLOCKING) of the backend's copy stream: %w", b.ord, r)
	}
	return nil
}

// closeStreamLocked waits for the copies on the stream, destroys it and
// its events, and frees every host buffer still held (after the wait, so
// no copy still uses one); it returns the first failure. Caller holds b.smu
// and b.mu (Close).
func (b *Backend) closeStreamLocked() error {
	var stage C.int
	r := Result(C.kvs_stream_close(b.lib.c, b.ctx, b.stream, &stage))
	errs := []error{call([...]string{"cuStreamSynchronize", "cuStreamDestroy_v2"}[stage], r)}
	b.stream = nil
	for _, e := range b.events {
		errs = append(errs, call("cuEventDestroy_v2", Result(C.kvs_event_destroy(b.lib.c, b.ctx, e))))
	}
	b.events, b.idle = nil, nil
	for p := range b.host {
		errs = append(errs, call("cuMemFreeHost", Result(C.kvs_host_free(b.lib.c, b.ctx, p))))
	}
	clear(b.host)
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// HostBuffer returns n bytes of page-locked host memory (cuMemHostAlloc
// with CU_MEMHOSTALLOC_PORTABLE; CUDA Driver API reference, "Memory
// Management"), the host side for CopyOutAsync and CopyInAsync to run
// asynchronously, and free, which gives it back with cuMemFreeHost. The
// memory is the driver's, outside the Go heap; buf is valid until free or
// Close (which frees every buffer still held); touching it after that is a
// use after free (a fault on the fake driver). free is safe to call more than once (later calls return the
// first's result) and returns nil after Close.
//
// cuMemHostAlloc rather than cuMemHostRegister of Go memory: an
// asynchronous copy keeps using the host pointer after the cgo call
// returns, which cgo's pointer rules forbid for Go memory, and the
// garbage collector would free a registered slice the caller dropped while
// the device still writes it. Driver memory has neither problem, and the
// driver picks its alignment.
//
// Errors: n <= 0 wraps vmm.ErrInvalidConfig; CUDA_ERROR_OUT_OF_MEMORY
// matches vmm.ErrOverLimit; a closed backend wraps net.ErrClosed.
func (b *Backend) HostBuffer(n int) (buf []byte, free func() error, err error) {
	if n <= 0 {
		return nil, nil, fmt.Errorf("cuda: host buffer of %d bytes: %w: want a positive size", n, vmm.ErrInvalidConfig)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, nil, b.closedErr()
	}
	var p unsafe.Pointer
	if r := Result(C.kvs_host_alloc(b.lib.c, b.ctx, C.size_t(n), &p)); r != Success {
		return nil, nil, fmt.Errorf("cuda: host buffer of %d bytes: %w", n, call("cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)", r))
	}
	b.host[p] = n
	var once sync.Once
	var ferr error
	free = func() error {
		once.Do(func() { ferr = b.freeHost(p) })
		return ferr
	}
	return unsafe.Slice((*byte)(p), n), free, nil
}

// freeHost gives back a HostBuffer; nil when Close already did.
func (b *Backend) freeHost(p unsafe.Pointer) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	n, ok := b.host[p]
	if b.closed || !ok {
		return nil
	}
	if r := Result(C.kvs_host_free(b.lib.c, b.ctx, p)); r != Success {
		return fmt.Errorf("cuda: free host buffer of %d bytes at %p: %w", n, p, call("cuMemFreeHost", r))
	}
	delete(b.host, p)
	return nil
}

// CopyOutAsync queues a copy of [addr, addr+len(dst)) to dst on the
// backend's stream (cuMemcpyDtoHAsync_v2) and returns wait, which blocks
// until the copy is done (cuEventSynchronize of an event recorded after
// it) and returns its error. The range must be mapped with access, as for
// CopyOut, or lie in pages ImportPeerPages mapped. dst must stay referenced
// and untouched until wait returns: the device writes it meanwhile. With dst
// from HostBuffer the copy runs while the caller works (double buffering:
// queue the copy into buffer B, send buffer A, wait for B); with other
// (pageable) memory the driver may copy before the call returns ("API
// synchronization behavior": transfers with pageable host memory "might be
// synchronous"), so use HostBuffer where the overlap matters.
//
// wait may be called more than once (later calls return the first's
// result); after Close it returns an error wrapping net.ErrClosed. Errors
// of CopyOutAsync: those of CopyOut, and a *vmm.BackendError naming
// cuMemcpyDtoHAsync_v2 or cuEventRecord.
func (b *Backend) CopyOutAsync(addr uint64, dst []byte) (wait func() error, err error) {
	return b.copyAsync("copy out", true, addr, dst)
}

// CopyInAsync queues a copy of src to [addr, addr+len(src)) on the
// backend's stream (cuMemcpyHtoDAsync_v2); as CopyOutAsync otherwise. src
// must stay referenced and unchanged until wait returns. The range must be
// the backend's own pages mapped with access (pages of a peer are
// read-only).
func (b *Backend) CopyInAsync(addr uint64, src []byte) (wait func() error, err error) {
	return b.copyAsync("copy in", false, addr, src)
}

func noWait() error { return nil }

func (b *Backend) copyAsync(op string, out bool, addr uint64, buf []byte) (func() error, error) {
	if len(buf) == 0 {
		return noWait, nil
	}
	b.smu.RLock()
	defer b.smu.RUnlock()
	b.mu.Lock()
	err := b.checkCopy(op, addr, uint64(len(buf)), !out)
	var ev C.CUevent
	if err == nil {
		ev, err = b.eventLocked()
	}
	b.mu.Unlock()
	if err != nil {
		return nil, err
	}
	var stage C.int
	r := Result(C.kvs_copy_async(b.lib.c, b.ctx, boolInt(out), C.CUdeviceptr(addr), unsafe.Pointer(&buf[0]), C.size_t(len(buf)), b.stream, ev, &stage))
	if r != Success {
		b.putEvent(ev) // never recorded, or the stream is synchronized
		name := [...]string{"cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuStreamSynchronize"}[stage]
		if out && stage == 0 {
			name = "cuMemcpyDtoHAsync_v2"
		}
		return nil, fmt.Errorf("cuda: %s of %d bytes at %#x: %w", op, len(buf), addr, call(name, r))
	}
	w := &pending{b: b, op: op, addr: addr, n: len(buf), ev: ev}
	return w.wait, nil
}

// pending is one queued copy; wait is its wait function.
type pending struct {
	b    *Backend
	op   string
	addr uint64
	n    int
	ev   C.CUevent
	once sync.Once
	err  error
}

func (w *pending) wait() error {
	w.once.Do(func() { w.err = w.b.wait(w.op, w.addr, w.n, w.ev) })
	return w.err
}

func boolInt(v bool) C.int {
	if v {
		return 1
	}
	return 0
}

// eventLocked returns an idle event, or a new one. Caller holds b.mu (and
// b.smu for reading).
func (b *Backend) eventLocked() (C.CUevent, error) {
	if n := len(b.idle); n > 0 {
		e := b.idle[n-1]
		b.idle = b.idle[:n-1]
		return e, nil
	}
	var e C.CUevent
	if r := Result(C.kvs_event_create(b.lib.c, b.ctx, &e)); r != Success {
		return nil, fmt.Errorf("cuda: copy completion event: %w", call("cuEventCreate(CU_EVENT_DISABLE_TIMING)", r))
	}
	b.events = append(b.events, e)
	return e, nil
}

// putEvent makes e idle again, unless Close destroyed it.
func (b *Backend) putEvent(e C.CUevent) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.closed {
		b.idle = append(b.idle, e)
	}
}

// wait blocks until the copy recorded by e is done.
func (b *Backend) wait(op string, addr uint64, n int, e C.CUevent) error {
	b.smu.RLock()
	defer b.smu.RUnlock()
	if b.stream == nil {
		return fmt.Errorf("cuda: wait for %s of %d bytes at %#x: %w", op, n, addr, b.closedErr())
	}
	r := Result(C.kvs_event_sync(b.lib.c, b.ctx, e))
	b.putEvent(e)
	if r != Success {
		return fmt.Errorf("cuda: wait for %s of %d bytes at %#x: %w", op, n, addr, call("cuEventSynchronize", r))
	}
	return nil
}
