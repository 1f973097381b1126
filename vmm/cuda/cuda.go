//go:build linux && cgo

package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// Vendored minimal CUDA driver API typedefs (no cuda.h, no toolkit). Values
// and layouts from the CUDA Driver API reference (cuda.h 12.x): CUdeviceptr
// is 64-bit on LP64 (the _v2 API); CUmemAllocationProp and CUmemAccessDesc
// as in "Virtual Memory Management"; enum values:
//   CU_MEM_ALLOCATION_TYPE_PINNED = 1, CU_MEM_LOCATION_TYPE_DEVICE = 1,
//   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
//   CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
//   CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0.
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
	int type;
	int requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

enum {
	KVS_ALLOC_PINNED = 1,
	KVS_LOC_DEVICE = 1,
	KVS_HANDLE_POSIX_FD = 1,
	KVS_ACCESS_RW = 3,
	KVS_GRAN_MINIMUM = 0,
};

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRelease)(CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
static CUresult (*p_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*p_cuMemAddressFree)(CUdeviceptr, size_t);
static CUresult (*p_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
static CUresult (*p_cuMemRelease)(CUmemGenericAllocationHandle);
static CUresult (*p_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
static CUresult (*p_cuMemUnmap)(CUdeviceptr, size_t);
static CUresult (*p_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
static CUresult (*p_cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
static CUresult (*p_cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
static CUresult (*p_cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*p_cuMemcpyDtoH)(void *, CUdeviceptr, size_t);

// kvs_load opens libcuda.so.1 (RTLD_NOW) and resolves every symbol, the _v2
// ones where the driver has them. It returns NULL or the missing name /
// dlerror text.
static const char *kvs_load(void) {
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib) return dlerror();
#define KVS_SYM(var, name) do { *(void **)(&var) = dlsym(lib, name); if (!var) return name; } while (0)
	KVS_SYM(p_cuInit, "cuInit");
	KVS_SYM(p_cuDeviceGet, "cuDeviceGet");
	KVS_SYM(p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	KVS_SYM(p_cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
	KVS_SYM(p_cuCtxSetCurrent, "cuCtxSetCurrent");
	KVS_SYM(p_cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
	KVS_SYM(p_cuMemAddressReserve, "cuMemAddressReserve");
	KVS_SYM(p_cuMemAddressFree, "cuMemAddressFree");
	KVS_SYM(p_cuMemCreate, "cuMemCreate");
	KVS_SYM(p_cuMemRelease, "cuMemRelease");
	KVS_SYM(p_cuMemMap, "cuMemMap");
	KVS_SYM(p_cuMemUnmap, "cuMemUnmap");
	KVS_SYM(p_cuMemSetAccess, "cuMemSetAccess");
	KVS_SYM(p_cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
	KVS_SYM(p_cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
	KVS_SYM(p_cuMemcpyHtoD, "cuMemcpyHtoD_v2");
	KVS_SYM(p_cuMemcpyDtoH, "cuMemcpyDtoH_v2");
#undef KVS_SYM
	return NULL;
}

static void kvs_prop(CUmemAllocationProp *p, int dev) {
	memset(p, 0, sizeof *p);
	p->type = KVS_ALLOC_PINNED;
	p->requestedHandleTypes = KVS_HANDLE_POSIX_FD;
	p->location.type = KVS_LOC_DEVICE;
	p->location.id = dev;
}

static CUresult kvs_open(int ordinal, CUdevice *dev, CUcontext *ctx, size_t *gran) {
	CUresult r = p_cuInit(0);
	if (r) return r;
	r = p_cuDeviceGet(dev, ordinal);
	if (r) return r;
	r = p_cuDevicePrimaryCtxRetain(ctx, *dev);
	if (r) return r;
	r = p_cuCtxSetCurrent(*ctx);
	if (r) { p_cuDevicePrimaryCtxRelease(*dev); return r; }
	CUmemAllocationProp prop;
	kvs_prop(&prop, *dev);
	r = p_cuMemGetAllocationGranularity(gran, &prop, KVS_GRAN_MINIMUM);
	if (r) p_cuDevicePrimaryCtxRelease(*dev);
	return r;
}

static CUresult kvs_close(CUdevice dev) { return p_cuDevicePrimaryCtxRelease(dev); }

// Every call below sets the context first: the calling OS thread may be any.
static CUresult kvs_reserve(CUcontext ctx, size_t size, size_t align, CUdeviceptr *ptr) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	return r ? r : p_cuMemAddressReserve(ptr, size, align, 0, 0);
}

static CUresult kvs_free(CUcontext ctx, CUdeviceptr ptr, size_t size) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	return r ? r : p_cuMemAddressFree(ptr, size);
}

static CUresult kvs_create(CUcontext ctx, CUdevice dev, size_t size, CUmemGenericAllocationHandle *h) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	if (r) return r;
	CUmemAllocationProp prop;
	kvs_prop(&prop, dev);
	return p_cuMemCreate(h, size, &prop, 0);
}

static CUresult kvs_release(CUcontext ctx, CUmemGenericAllocationHandle h) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	return r ? r : p_cuMemRelease(h);
}

static CUresult kvs_map(CUcontext ctx, CUdeviceptr ptr, size_t size, CUmemGenericAllocationHandle h) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	return r ? r : p_cuMemMap(ptr, size, 0, h, 0);
}

static CUresult kvs_unmap(CUcontext ctx, CUdeviceptr ptr, size_t size) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	return r ? r : p_cuMemUnmap(ptr, size);
}

static CUresult kvs_set_access(CUcontext ctx, CUdevice dev, CUdeviceptr ptr, size_t size) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	if (r) return r;
	CUmemAccessDesc d;
	memset(&d, 0, sizeof d);
	d.location.type = KVS_LOC_DEVICE;
	d.location.id = dev;
	d.flags = KVS_ACCESS_RW;
	return p_cuMemSetAccess(ptr, size, &d, 1);
}

static CUresult kvs_export(CUcontext ctx, CUmemGenericAllocationHandle h, int *fd) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	return r ? r : p_cuMemExportToShareableHandle(fd, h, KVS_HANDLE_POSIX_FD, 0);
}

static CUresult kvs_import(CUcontext ctx, int fd, CUmemGenericAllocationHandle *h) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	return r ? r : p_cuMemImportFromShareableHandle(h, (void *)(intptr_t)fd, KVS_HANDLE_POSIX_FD);
}

static CUresult kvs_htod(CUcontext ctx, CUdeviceptr dst, const void *src, size_t n) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	return r ? r : p_cuMemcpyHtoD(dst, src, n);
}

static CUresult kvs_dtoh(CUcontext ctx, void *dst, CUdeviceptr src, size_t n) {
	CUresult r = p_cuCtxSetCurrent(ctx);
	return r ? r : p_cuMemcpyDtoH(dst, src, n);
}
*/
import "C"

import (
	"fmt"
	"net"
	"os"
	"sync"
	"unsafe"

	"github.com/kvsidecar/kvsidecar/vmm"
)

var (
	loadOnce sync.Once
	loadErr  error
)

func load() error {
	loadOnce.Do(func() {
		if msg := C.kvs_load(); msg != nil {
			loadErr = fmt.Errorf("cuda: load libcuda.so.1: %s: %w", C.GoString(msg), ErrNoGPU)
		}
	})
	return loadErr
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
type Backend struct {
	dev  C.CUdevice
	ord  int
	ctx  C.CUcontext
	gran uint64

	mu     sync.Mutex
	closed bool
	res    map[uint64]uint64     // reservation base → size
	live   map[vmm.Handle]int    // handle → mappings of it
	mapped map[uint64]vmm.Handle // page address → handle
	access map[uint64]struct{}   // mapped pages with access set
}

var _ vmm.Backend = (*Backend)(nil)
var _ vmm.Importer = (*Backend)(nil)

// New loads libcuda.so.1, initialises the driver, retains the primary
// context of the device and queries the allocation granularity. Errors wrap
// ErrNoGPU when the library or the device is missing.
func New(cfg *Config) (*Backend, error) {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Device < 0 {
		return nil, fmt.Errorf("cuda: Config.Device %d must be >= 0: %w", c.Device, vmm.ErrInvalidConfig)
	}
	if err := load(); err != nil {
		return nil, err
	}
	b := &Backend{ord: c.Device, res: map[uint64]uint64{}, live: map[vmm.Handle]int{},
		mapped: map[uint64]vmm.Handle{}, access: map[uint64]struct{}{}}
	var gran C.size_t
	if r := Result(C.kvs_open(C.int(c.Device), &b.dev, &b.ctx, &gran)); r != Success {
		return nil, fmt.Errorf("cuda: open device %d: %w", c.Device, r)
	}
	b.gran = uint64(gran)
	return b, nil
}

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
	if err := call("cuMemAddressReserve", Result(C.kvs_reserve(b.ctx, C.size_t(size), C.size_t(b.gran), &ptr))); err != nil {
		return 0, err
	}
	b.res[uint64(ptr)] = size
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
	if err := call("cuMemAddressFree", Result(C.kvs_free(b.ctx, C.CUdeviceptr(base), C.size_t(size)))); err != nil {
		return err
	}
	delete(b.res, base)
	return nil
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
	if err := call("cuMemCreate", Result(C.kvs_create(b.ctx, b.dev, C.size_t(b.gran), &h))); err != nil {
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
	if err := call("cuMemRelease", Result(C.kvs_release(b.ctx, C.CUmemGenericAllocationHandle(h)))); err != nil {
		return err
	}
	delete(b.live, h)
	return nil
}

// inRes reports whether [addr, addr+n) lies in one reservation with addr
// page-aligned relative to it. Caller holds b.mu.
func (b *Backend) inRes(addr, n uint64) bool {
	for base, size := range b.res {
		if addr >= base && addr+n <= base+size && addr+n >= addr {
			return true
		}
	}
	return false
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
	if err := call("cuMemMap", Result(C.kvs_map(b.ctx, C.CUdeviceptr(addr), C.size_t(b.gran), C.CUmemGenericAllocationHandle(h)))); err != nil {
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
	if err := call("cuMemUnmap", Result(C.kvs_unmap(b.ctx, C.CUdeviceptr(addr), C.size_t(b.gran)))); err != nil {
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
	if err := call("cuMemSetAccess", Result(C.kvs_set_access(b.ctx, b.dev, C.CUdeviceptr(addr), C.size_t(size)))); err != nil {
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
	if err := call("cuMemExportToShareableHandle", Result(C.kvs_export(b.ctx, C.CUmemGenericAllocationHandle(h), &fd))); err != nil {
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
	if err := call("cuMemImportFromShareableHandle", Result(C.kvs_import(b.ctx, C.int(f.Fd()), &h))); err != nil {
		return 0, err
	}
	b.live[vmm.Handle(h)] = 0
	return vmm.Handle(h), nil
}

// checkCopy verifies every page of [addr, addr+n) is mapped with access.
func (b *Backend) checkCopy(op string, addr, n uint64) error {
	if b.closed {
		return b.closedErr()
	}
	if !b.inRes(addr, n) {
		return &vmm.AddrError{Op: op, Addr: addr, Err: fmt.Errorf("%w: %d bytes not inside one reservation", vmm.ErrBlockOutOfRange, n)}
	}
	for a := addr / b.gran * b.gran; a < addr+n; a += b.gran {
		if _, ok := b.access[a]; !ok {
			return &vmm.AddrError{Op: op, Addr: a, Err: vmm.ErrNotMapped}
		}
	}
	return nil
}

// CopyIn copies host bytes to device pages (cuMemcpyHtoD_v2, synchronous).
func (b *Backend) CopyIn(addr uint64, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	b.mu.Lock()
	err := b.checkCopy("copy in", addr, uint64(len(src)))
	b.mu.Unlock()
	if err != nil {
		return err
	}
	return call("cuMemcpyHtoD_v2", Result(C.kvs_htod(b.ctx, C.CUdeviceptr(addr), unsafe.Pointer(&src[0]), C.size_t(len(src)))))
}

// CopyOut copies device pages to host bytes (cuMemcpyDtoH_v2, synchronous).
func (b *Backend) CopyOut(addr uint64, dst []byte) error {
	if len(dst) == 0 {
		return nil
	}
	b.mu.Lock()
	err := b.checkCopy("copy out", addr, uint64(len(dst)))
	b.mu.Unlock()
	if err != nil {
		return err
	}
	return call("cuMemcpyDtoH_v2", Result(C.kvs_dtoh(b.ctx, unsafe.Pointer(&dst[0]), C.CUdeviceptr(addr), C.size_t(len(dst)))))
}

// Close unmaps and releases every page, frees every reservation and releases
// the primary context. A second Close returns an error wrapping net.ErrClosed.
func (b *Backend) Close() error {
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
	for a := range b.mapped {
		keep(b.unmapLocked(a))
	}
	for h := range b.live {
		keep(call("cuMemRelease", Result(C.kvs_release(b.ctx, C.CUmemGenericAllocationHandle(h)))))
	}
	for base, size := range b.res {
		keep(call("cuMemAddressFree", Result(C.kvs_free(b.ctx, C.CUdeviceptr(base), C.size_t(size)))))
	}
	keep(call("cuDevicePrimaryCtxRelease_v2", Result(C.kvs_close(b.dev))))
	b.closed = true
	return first
}
