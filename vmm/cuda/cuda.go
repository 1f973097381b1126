//go:build linux && cgo

package cuda

/*
#cgo CFLAGS: -I${SRCDIR}/internal/cudaabi
#cgo LDFLAGS: -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// The table of the driver's entry points (kvs.h), over the driver API's
// types and enum values: the vendored header this package shares with the
// fake driver of cudatest (internal/cudaabi).
#include "kvs.h"

// kvs_load opens the driver library name (RTLD_NOW | RTLD_LOCAL) and
// resolves every entry point, the _v2 ones where the driver has them. It
// returns 0, or -1 with the dlerror text or the missing symbol in err; path
// receives the file the dynamic loader opened.
static int kvs_load(const char *name, kvs_lib *l, char *path, size_t pathlen, char *err, size_t errlen) {
	void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		return -1;
	}
#define KVS_SYM(field, sym) do { \
		*(void **)(&l->field) = dlsym(lib, sym); \
		if (!l->field) { snprintf(err, errlen, "%s: symbol %s not found", name, sym); dlclose(lib); return -1; } \
	} while (0)
	KVS_SYM(cuInit, "cuInit");
	KVS_SYM(cuDriverGetVersion, "cuDriverGetVersion");
	KVS_SYM(cuDeviceGet, "cuDeviceGet");
	KVS_SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute");
	KVS_SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	KVS_SYM(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
	KVS_SYM(cuCtxSetCurrent, "cuCtxSetCurrent");
	KVS_SYM(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
	KVS_SYM(cuMemAddressReserve, "cuMemAddressReserve");
	KVS_SYM(cuMemAddressFree, "cuMemAddressFree");
	KVS_SYM(cuMemCreate, "cuMemCreate");
	KVS_SYM(cuMemRelease, "cuMemRelease");
	KVS_SYM(cuMemMap, "cuMemMap");
	KVS_SYM(cuMemUnmap, "cuMemUnmap");
	KVS_SYM(cuMemSetAccess, "cuMemSetAccess");
	KVS_SYM(cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
	KVS_SYM(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
	KVS_SYM(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
	KVS_SYM(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
	KVS_SYM(cuMemHostAlloc, "cuMemHostAlloc");
	KVS_SYM(cuMemFreeHost, "cuMemFreeHost");
	KVS_SYM(cuStreamCreate, "cuStreamCreate");
	KVS_SYM(cuStreamDestroy, "cuStreamDestroy_v2");
	KVS_SYM(cuStreamSynchronize, "cuStreamSynchronize");
	KVS_SYM(cuEventCreate, "cuEventCreate");
	KVS_SYM(cuEventRecord, "cuEventRecord");
	KVS_SYM(cuEventSynchronize, "cuEventSynchronize");
	KVS_SYM(cuEventDestroy, "cuEventDestroy_v2");
	KVS_SYM(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
	KVS_SYM(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
	KVS_SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
	KVS_SYM(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
	KVS_SYM(cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
#undef KVS_SYM
	Dl_info info;
	if (dladdr(*(void **)(&l->cuInit), &info) && info.dli_fname) snprintf(path, pathlen, "%s", info.dli_fname);
	else snprintf(path, pathlen, "%s", name);
	return 0;
}

// kvs_prop fills the properties of every allocation: pinned device memory
// exportable as a POSIX file descriptor.
static void kvs_prop(CUmemAllocationProp *p, int dev) {
	memset(p, 0, sizeof *p);
	p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p->location.id = dev;
}

static CUresult kvs_version(const kvs_lib *l, int *v) { return l->cuDriverGetVersion(v); }

static CUresult kvs_open(const kvs_lib *l, int ordinal, CUdevice *dev, CUcontext *ctx) {
	CUresult r = l->cuInit(0);
	if (r) return r;
	r = l->cuDeviceGet(dev, ordinal);
	if (r) return r;
	r = l->cuDevicePrimaryCtxRetain(ctx, *dev);
	if (r) return r;
	r = l->cuCtxSetCurrent(*ctx);
	if (r) l->cuDevicePrimaryCtxRelease(*dev);
	return r;
}

static CUresult kvs_close(const kvs_lib *l, CUdevice dev) { return l->cuDevicePrimaryCtxRelease(dev); }

static CUresult kvs_attr(const kvs_lib *l, CUdevice dev, int attr, int *v) { return l->cuDeviceGetAttribute(v, attr, dev); }

// Every call below sets the context first: the calling OS thread may be any.
static CUresult kvs_granularity(const kvs_lib *l, CUcontext ctx, CUdevice dev, size_t *gran) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	if (r) return r;
	CUmemAllocationProp prop;
	kvs_prop(&prop, dev);
	return l->cuMemGetAllocationGranularity(gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
}

// kvs_probe creates one page with the allocation properties, exports it as
// a POSIX file descriptor and gives both back; *stage says which call
// failed (0 cuMemCreate, 1 cuMemExportToShareableHandle, 2 cuMemRelease).
static CUresult kvs_probe(const kvs_lib *l, CUcontext ctx, CUdevice dev, size_t gran, int *stage) {
	*stage = 0;
	CUresult r = l->cuCtxSetCurrent(ctx);
	if (r) return r;
	CUmemAllocationProp prop;
	kvs_prop(&prop, dev);
	CUmemGenericAllocationHandle h;
	r = l->cuMemCreate(&h, gran, &prop, 0);
	if (r) return r;
	int fd = -1;
	*stage = 1;
	r = l->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (fd >= 0) close(fd);
	CUresult rr = l->cuMemRelease(h);
	if (!r && rr) *stage = 2;
	return r ? r : rr;
}

static CUresult kvs_create(const kvs_lib *l, CUcontext ctx, CUdevice dev, size_t size, CUmemGenericAllocationHandle *h) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	if (r) return r;
	CUmemAllocationProp prop;
	kvs_prop(&prop, dev);
	return l->cuMemCreate(h, size, &prop, 0);
}

static CUresult kvs_export(const kvs_lib *l, CUcontext ctx, CUmemGenericAllocationHandle h, int *fd) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}

static CUresult kvs_htod(const kvs_lib *l, CUcontext ctx, CUdeviceptr dst, const void *src, size_t n) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemcpyHtoD(dst, src, n);
}

static CUresult kvs_dtoh(const kvs_lib *l, CUcontext ctx, void *dst, CUdeviceptr src, size_t n) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemcpyDtoH(dst, src, n);
}
*/
import "C"

import (
	"fmt"
	"net"
	"os"
	"slices"
	"sort"
	"sync"
	"unsafe"

	"github.com/kvsidecar/kvsidecar/vmm"
	// The header the C code above includes: importing its package makes
	// a change to it rebuild this one (the go command tracks only the
	// headers in a package's own directory).
	_ "github.com/kvsidecar/kvsidecar/vmm/cuda/internal/cudaabi"
)

// library is one loaded driver library. Its C table is never freed: a
// driver, once loaded, stays loaded for the life of the process.
type library struct {
	c    *C.kvs_lib
	path string // the file the dynamic loader opened
}

var libs struct {
	sync.Mutex
	m map[string]*library // by Config.Library
}

// load opens the driver library name once per process; a failed load is
// tried again by the next New.
func load(name string) (*library, error) {
	libs.Lock()
	defer libs.Unlock()
	if l, ok := libs.m[name]; ok {
		return l, nil
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var path, msg [4096]C.char
	tbl := (*C.kvs_lib)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvs_lib{}))))
	if C.kvs_load(cname, tbl, &path[0], C.size_t(len(path)), &msg[0], C.size_t(len(msg))) != 0 {
		C.free(unsafe.Pointer(tbl))
		return nil, fmt.Errorf("cuda: load %s: %s: %w", name, C.GoString(&msg[0]), ErrNoGPU)
	}
	l := &library{c: tbl, path: C.GoString(&path[0])}
	if libs.m == nil {
		libs.m = map[string]*library{}
	}
	libs.m[name] = l
	return l, nil
}

// Backend is the CUDA virtual memory management vmm.Backend of one device:
// pages are cuMemCreate allocations (PINNED, on the device, exportable as
// POSIX file descriptors), mapped into cuMemAddressReserve ranges with
// read-write access for the device. The primary context is retained at New
// and set inside every C call, so any goroutine may call it.
//
// Mapped and created pages are tracked in Go, so mapping a mapped address or
// unmapping an unmapped one fails with vmm.ErrAlreadyMapped / ErrNotMapped as
// the host backend does, before the driver is asked.
//
// Asynchronous copies (cuda_async.go) and device-to-device copies
// (cuda_peer.go) run on the backend's own stream, created by New with
// CU_STREAM_NON_BLOCKING.
type Backend struct {
	lib     *library
	version int
	dev     C.CUdevice
	ord     int
	ctx     C.CUcontext
	gran    uint64

	// smu guards the stream's life: a copy or a wait holds it for
	// reading, Close for writing. It is never taken while holding mu.
	smu    sync.RWMutex
	stream C.CUstream // nil once closed

	mu     sync.Mutex
	closed bool
	res    map[uint64]uint64        // reservation base → size
	live   map[vmm.Handle]int       // handle → mappings of it
	mapped map[uint64]vmm.Handle    // page address → handle
	access map[uint64]struct{}      // mapped pages with access set
	spans  []span                   // reservations and peer imports, by base
	events []C.CUevent              // every event made (cuda_async.go)
	idle   []C.CUevent              // of those, the ones free to record
	host   map[unsafe.Pointer]int   // cuMemHostAlloc buffers not yet freed → bytes
	peers  map[*peerImport]struct{} // ImportPeerPages not yet released (cuda_peer.go)
}

// span is one range of device addresses the backend holds: a reservation
// for its own pages (peer nil) or the pages ImportPeerPages mapped.
type span struct {
	base, size uint64
	peer       *peerImport
}

var (
	_ vmm.Backend     = (*Backend)(nil)
	_ vmm.Importer    = (*Backend)(nil)
	_ vmm.AsyncCopier = (*Backend)(nil)
	_ vmm.PeerCopier  = (*Backend)(nil)
)

// New loads the driver library (Config.Library), initialises the driver,
// retains the primary context of the device and checks, before any page is
// needed, that the device can serve kvsidecar's pages: virtual memory
// management supported, an allocation granularity (queried with the
// properties every page is created with) that is a power-of-two multiple of
// the host page, and one page created and exported as a POSIX file
// descriptor. A failed check names the granularity or the handle type and
// the allocation properties. It then creates the backend's copy stream.
// Errors wrap ErrNoGPU when the library or the device is missing or lacks
// virtual memory management or POSIX-fd export, vmm.ErrInvalidConfig for an
// unusable granularity, and the driver's Result otherwise
// (CUDA_ERROR_OUT_OF_MEMORY matches vmm.ErrOverLimit).
func New(cfg *Config) (*Backend, error) {
	c := cfg.withDefaults()
	if c.Device < 0 {
		return nil, fmt.Errorf("cuda: Config.Device %d must be >= 0: %w", c.Device, vmm.ErrInvalidConfig)
	}
	lib, err := load(c.Library)
	if err != nil {
		return nil, err
	}
	b := &Backend{lib: lib, ord: c.Device, res: map[uint64]uint64{}, live: map[vmm.Handle]int{},
		mapped: map[uint64]vmm.Handle{}, access: map[uint64]struct{}{}, host: map[unsafe.Pointer]int{}, peers: map[*peerImport]struct{}{}}
	var ver C.int
	if C.kvs_version(lib.c, &ver) == 0 {
		b.version = int(ver)
	}
	if r := Result(C.kvs_open(lib.c, C.int(c.Device), &b.dev, &b.ctx)); r != Success {
		return nil, fmt.Errorf("cuda: open device %d with %s: %w", c.Device, lib.path, r)
	}
	if err := b.check(); err != nil {
		C.kvs_close(lib.c, b.dev)
		return nil, err
	}
	if err := b.createStream(); err != nil {
		C.kvs_close(lib.c, b.dev)
		return nil, err
	}
	return b, nil
}

// props describes the allocation properties of every page, for errors.
func props(dev int) string {
	return fmt.Sprintf("allocation properties {type: CU_MEM_ALLOCATION_TYPE_PINNED, location: CU_MEM_LOCATION_TYPE_DEVICE %d, "+
		"requestedHandleTypes: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR}", dev)
}

// check is New's start-up check of the device (see New).
func (b *Backend) check() error {
	attr := func(name string, a C.int) (int, error) {
		var v C.int
		if r := Result(C.kvs_attr(b.lib.c, b.dev, a, &v)); r != Success {
			return 0, fmt.Errorf("cuda: device %d: cuDeviceGetAttribute(%s): %w", b.ord, name, r)
		}
		return int(v), nil
	}
	vmmOK, err := attr("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", C.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
	if err != nil {
		return err
	}
	if vmmOK == 0 {
		return fmt.Errorf("cuda: device %d does not support virtual memory management (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0): %w", b.ord, ErrNoGPU)
	}
	fdOK, err := attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", C.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
	if err != nil {
		return err
	}
	if fdOK == 0 {
		return fmt.Errorf("cuda: device %d cannot export memory as CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "+
			"(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0), the handle type of the %s that the local API passes to engines: %w",
			b.ord, props(b.ord), ErrNoGPU)
	}
	var gran C.size_t
	if r := Result(C.kvs_granularity(b.lib.c, b.ctx, b.dev, &gran)); r != Success {
		return fmt.Errorf("cuda: device %d: cuMemGetAllocationGranularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM) with %s: %w", b.ord, props(b.ord), r)
	}
	g, host := uint64(gran), uint64(os.Getpagesize())
	if g == 0 || g&(g-1) != 0 || g%host != 0 {
		return fmt.Errorf("cuda: device %d: granularity %d bytes from cuMemGetAllocationGranularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM) with %s is not a power-of-two multiple of the %d-byte host page: %w",
			b.ord, g, props(b.ord), host, vmm.ErrInvalidConfig)
	}
	b.gran = g
	var stage C.int
	if r := Result(C.kvs_probe(b.lib.c, b.ctx, b.dev, gran, &stage)); r != Success {
		op := [...]string{"cuMemCreate of one page", "cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) of a page", "cuMemRelease of a page"}[stage]
		return fmt.Errorf("cuda: device %d: start-up probe: %s of %d bytes with %s: %w", b.ord, op, g, props(b.ord), r)
	}
	return nil
}

// LibraryPath returns the file of the driver library this backend uses, as
// the dynamic loader resolved Config.Library.
func (b *Backend) LibraryPath() string { return b.lib.path }

// DriverVersion returns cuDriverGetVersion (1000 × major + 10 × minor,
// 12040 for CUDA 12.4), 0 when the driver did not say.
func (b *Backend) DriverVersion() int { return b.version }

func (b *Backend) closedErr() error { return fmt.Errorf("cuda: backend: %w", net.ErrClosed) }

// Granularity returns cuMemGetAllocationGranularity (MINIMUM), 2 MiB on
// current GPUs.
func (b *Backend) Granularity() uint64 { return b.gran }

// DevID returns the device ordinal.
func (b *Backend) DevID() int { return b.ord }

// Reserve reserves size bytes of device virtual addresses aligned to the
// granularity.
func (b *Backend) Reserve(size uint64) (uint64, error) {
	if size == 0 || size%b.gran != 0 {
		return 0, fmt.Errorf("cuda: reserve size %d is not a positive multiple of %d: %w", size, b.gran, vmm.ErrInvalidConfig)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, b.closedErr()
	}
	var ptr C.CUdeviceptr
	if err := call("cuMemAddressReserve", Result(C.kvs_reserve(b.lib.c, b.ctx, C.size_t(size), C.size_t(b.gran), &ptr))); err != nil {
		return 0, err
	}
	b.res[uint64(ptr)] = size
	b.addSpan(span{base: uint64(ptr), size: size})
	return uint64(ptr), nil
}

// FreeReservation unmaps pages still mapped in the range and frees it.
func (b *Backend) FreeReservation(base, size uint64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	if b.res[base] != size {
		return &vmm.AddrError{Op: "free reservation", Addr: base, Err: fmt.Errorf("%w: no reservation of %d bytes there", vmm.ErrBlockOutOfRange, size)}
	}
	for a := base; a < base+size; a += b.gran {
		if _, ok := b.mapped[a]; ok {
			if err := b.unmapLocked(a); err != nil {
				return err
			}
		}
	}
	if err := call("cuMemAddressFree", Result(C.kvs_free(b.lib.c, b.ctx, C.CUdeviceptr(base), C.size_t(size)))); err != nil {
		return err
	}
	delete(b.res, base)
	b.removeSpan(base)
	return nil
}

// addSpan records s in b.spans, kept sorted by base. Caller holds b.mu.
func (b *Backend) addSpan(s span) {
	i := sort.Search(len(b.spans), func(i int) bool { return b.spans[i].base > s.base })
	b.spans = slices.Insert(b.spans, i, s)
}

// removeSpan forgets the span at base. Caller holds b.mu.
func (b *Backend) removeSpan(base uint64) {
	b.spans = slices.DeleteFunc(b.spans, func(s span) bool { return s.base == base })
}

// spanAt returns the span that holds addr. Caller holds b.mu.
func (b *Backend) spanAt(addr uint64) (span, bool) {
	i := sort.Search(len(b.spans), func(i int) bool { return b.spans[i].base > addr }) - 1
	if i < 0 || addr >= b.spans[i].base+b.spans[i].size {
		return span{}, false
	}
	return b.spans[i], true
}

// Create allocates one page of device memory (cuMemCreate).
// CUDA_ERROR_OUT_OF_MEMORY matches vmm.ErrOverLimit.
func (b *Backend) Create() (vmm.Handle, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, b.closedErr()
	}
	var h C.CUmemGenericAllocationHandle
	if err := call("cuMemCreate", Result(C.kvs_create(b.lib.c, b.ctx, b.dev, C.size_t(b.gran), &h))); err != nil {
		return 0, err
	}
	b.live[vmm.Handle(h)] = 0
	return vmm.Handle(h), nil
}

// Release frees a page that is no longer mapped (cuMemRelease).
func (b *Backend) Release(h vmm.Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	n, ok := b.live[h]
	if !ok {
		return fmt.Errorf("cuda: release handle %#x: %w", uint64(h), vmm.ErrNotMapped)
	}
	if n > 0 {
		return fmt.Errorf("cuda: release handle %#x: still mapped %d times: %w", uint64(h), n, vmm.ErrAlreadyMapped)
	}
	if err := call("cuMemRelease", Result(C.kvs_release(b.lib.c, b.ctx, C.CUmemGenericAllocationHandle(h)))); err != nil {
		return err
	}
	delete(b.live, h)
	return nil
}

// inRes reports whether [addr, addr+n) lies in one reservation for the
// backend's own pages. Caller holds b.mu.
func (b *Backend) inRes(addr, n uint64) bool {
	s, ok := b.spanAt(addr)
	return ok && s.peer == nil && addr+n >= addr && addr+n <= s.base+s.size
}

// Map maps page h at addr (cuMemMap), without access until SetAccess.
func (b *Backend) Map(addr uint64, h vmm.Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	if !b.inRes(addr, b.gran) || addr%b.gran != 0 {
		return &vmm.AddrError{Op: "map", Addr: addr, Err: fmt.Errorf("%w: not an aligned page inside a reservation", vmm.ErrBlockOutOfRange)}
	}
	if _, ok := b.live[h]; !ok {
		return &vmm.AddrError{Op: "map", Addr: addr, Err: fmt.Errorf("%w: unknown handle %#x", vmm.ErrInvalidConfig, uint64(h))}
	}
	if _, ok := b.mapped[addr]; ok {
		return &vmm.AddrError{Op: "map", Addr: addr, Err: vmm.ErrAlreadyMapped}
	}
	if err := call("cuMemMap", Result(C.kvs_map(b.lib.c, b.ctx, C.CUdeviceptr(addr), C.size_t(b.gran), C.CUmemGenericAllocationHandle(h)))); err != nil {
		return err
	}
	b.mapped[addr] = h
	b.live[h]++
	return nil
}

// Unmap unmaps the page at addr (cuMemUnmap).
func (b *Backend) Unmap(addr uint64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	if _, ok := b.mapped[addr]; !ok {
		return &vmm.AddrError{Op: "unmap", Addr: addr, Err: vmm.ErrNotMapped}
	}
	return b.unmapLocked(addr)
}

func (b *Backend) unmapLocked(addr uint64) error {
	if err := call("cuMemUnmap", Result(C.kvs_unmap(b.lib.c, b.ctx, C.CUdeviceptr(addr), C.size_t(b.gran)))); err != nil {
		return err
	}
	b.live[b.mapped[addr]]--
	delete(b.mapped, addr)
	delete(b.access, addr)
	return nil
}

// SetAccess grants the device read-write access (cuMemSetAccess).
func (b *Backend) SetAccess(addr, size uint64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	if size == 0 || size%b.gran != 0 || addr%b.gran != 0 {
		return &vmm.AddrError{Op: "set access", Addr: addr, Err: fmt.Errorf("%w: %d bytes not whole aligned pages of %d", vmm.ErrInvalidConfig, size, b.gran)}
	}
	for a := addr; a < addr+size; a += b.gran {
		if _, ok := b.mapped[a]; !ok {
			return &vmm.AddrError{Op: "set access", Addr: a, Err: vmm.ErrNotMapped}
		}
	}
	if err := call("cuMemSetAccess", Result(C.kvs_set_access(b.lib.c, b.ctx, b.dev, C.CUdeviceptr(addr), C.size_t(size), C.CU_MEM_ACCESS_FLAGS_PROT_READWRITE))); err != nil {
		return err
	}
	for a := addr; a < addr+size; a += b.gran {
		b.access[a] = struct{}{}
	}
	return nil
}

// Export returns a POSIX file descriptor for page h
// (cuMemExportToShareableHandle); the page starts at offset 0 of it.
func (b *Backend) Export(h vmm.Handle) (*os.File, uint64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, 0, b.closedErr()
	}
	if _, ok := b.live[h]; !ok {
		return nil, 0, fmt.Errorf("cuda: export handle %#x: %w: unknown handle", uint64(h), vmm.ErrInvalidConfig)
	}
	var fd C.int
	if err := call("cuMemExportToShareableHandle", Result(C.kvs_export(b.lib.c, b.ctx, C.CUmemGenericAllocationHandle(h), &fd))); err != nil {
		return nil, 0, err
	}
	return os.NewFile(uintptr(fd), fmt.Sprintf("cuda-page-%#x", uint64(h))), 0, nil
}

// Import takes in a page exported as a POSIX fd
// (cuMemImportFromShareableHandle); off must be 0.
func (b *Backend) Import(f *os.File, off uint64) (vmm.Handle, error) {
	if off != 0 {
		return 0, fmt.Errorf("cuda: import at offset %d: %w: CUDA pages start at 0", off, vmm.ErrInvalidConfig)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, b.closedErr()
	}
	var h C.CUmemGenericAllocationHandle
	if err := call("cuMemImportFromShareableHandle", Result(C.kvs_import(b.lib.c, b.ctx, C.int(f.Fd()), &h))); err != nil {
		return 0, err
	}
	b.live[vmm.Handle(h)] = 0
	return vmm.Handle(h), nil
}

// checkCopy verifies that the device may read (or, with write, write)
// every byte of [addr, addr+n): each page of the backend's own that it
// covers is mapped with access, and the rest lies in pages ImportPeerPages
// mapped, which are read-only. The range may run across adjacent spans, as
// a coalesced copy may. Caller holds b.mu.
func (b *Backend) checkCopy(op string, addr, n uint64, write bool) error {
	if b.closed {
		return b.closedErr()
	}
	end := addr + n
	if end < addr {
		return &vmm.AddrError{Op: op, Addr: addr, Err: fmt.Errorf("%w: %d bytes wrap around", vmm.ErrBlockOutOfRange, n)}
	}
	for at := addr; at < end; {
		s, ok := b.spanAt(at)
		if !ok {
			return &vmm.AddrError{Op: op, Addr: at, Err: fmt.Errorf("%w: %d bytes at %#x not inside the reservations", vmm.ErrBlockOutOfRange, n, addr)}
		}
		stop := min(end, s.base+s.size)
		if s.peer != nil && write {
			return &vmm.AddrError{Op: op, Addr: at, Err: fmt.Errorf("%w: a peer's page, mapped read-only by ImportPeerPages, is not a copy destination", vmm.ErrInvalidConfig)}
		}
		for a := at / b.gran * b.gran; s.peer == nil && a < stop; a += b.gran {
			if _, ok := b.access[a]; !ok {
				return &vmm.AddrError{Op: op, Addr: a, Err: vmm.ErrNotMapped}
			}
		}
		at = stop
	}
	return nil
}

// CopyIn copies host bytes to device pages (cuMemcpyHtoD_v2, synchronous).
func (b *Backend) CopyIn(addr uint64, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	b.mu.Lock()
	err := b.checkCopy("copy in", addr, uint64(len(src)), true)
	b.mu.Unlock()
	if err != nil {
		return err
	}
	return call("cuMemcpyHtoD_v2", Result(C.kvs_htod(b.lib.c, b.ctx, C.CUdeviceptr(addr), unsafe.Pointer(&src[0]), C.size_t(len(src)))))
}

// CopyOut copies device pages to host bytes (cuMemcpyDtoH_v2, synchronous).
func (b *Backend) CopyOut(addr uint64, dst []byte) error {
	if len(dst) == 0 {
		return nil
	}
	b.mu.Lock()
	err := b.checkCopy("copy out", addr, uint64(len(dst)), false)
	b.mu.Unlock()
	if err != nil {
		return err
	}
	return call("cuMemcpyDtoH_v2", Result(C.kvs_dtoh(b.lib.c, b.ctx, unsafe.Pointer(&dst[0]), C.CUdeviceptr(addr), C.size_t(len(dst)))))
}

// Close waits for the copies on the backend's stream and destroys it with
// its events, frees the host buffers HostBuffer made, releases what
// ImportPeerPages mapped, unmaps and releases every page, frees every
// reservation and releases the primary context. A wait, free or release
// function called after Close returns an error wrapping net.ErrClosed or
// nil (see each). A second Close returns an error wrapping net.ErrClosed.
func (b *Backend) Close() error {
	b.smu.Lock()
	defer b.smu.Unlock()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	var first error
	keep := func(err error) {
		if err != nil && first == nil {
			first = err
		}
	}
	keep(b.closeStreamLocked())
	for pi := range b.peers {
		keep(b.releasePeerLocked(pi))
	}
	for a := range b.mapped {
		keep(b.unmapLocked(a))
	}
	for h := range b.live {
		keep(call("cuMemRelease", Result(C.kvs_release(b.lib.c, b.ctx, C.CUmemGenericAllocationHandle(h)))))
	}
	for base, size := range b.res {
		keep(call("cuMemAddressFree", Result(C.kvs_free(b.lib.c, b.ctx, C.CUdeviceptr(base), C.size_t(size)))))
	}
	keep(call("cuDevicePrimaryCtxRelease_v2", Result(C.kvs_close(b.lib.c, b.dev))))
	b.closed = true
	return first
}
