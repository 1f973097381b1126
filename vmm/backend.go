package vmm

import "os"

// Handle names one physical page of a Backend (a memfd slot for the host
// backend, a CUmemGenericAllocationHandle for CUDA). Its value is opaque.
type Handle uint64

// Backend is the virtual memory management a Pool drives: one physical page
// is Granularity() bytes; a reservation is a virtual range mapped page by
// page. It mirrors the CUDA driver's VMM calls (cuMemAddressReserve,
// cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease,
// cuMemExportToShareableHandle) so the host backend and vmm/cuda behave the
// same, including their errors.
//
// Addresses are uint64: a host pointer for the host backend, a CUdeviceptr
// for CUDA. Every method is safe for concurrent use. Errors wrap ErrBackend
// (the OS or driver failed), ErrAlreadyMapped, ErrNotMapped, ErrOverLimit or
// ErrBlockOutOfRange (an address outside every reservation).
type Backend interface {
	// Granularity is the page size in bytes (2 MiB on current GPUs).
	Granularity() uint64
	// DevID is the device ordinal the memory lives on (NIXL devID); 0 for host.
	DevID() int
	// Reserve reserves size bytes (a multiple of Granularity) of virtual
	// addresses with no access, and returns the base.
	Reserve(size uint64) (base uint64, err error)
	// FreeReservation gives back a range Reserve returned. Pages still
	// mapped in it are unmapped first.
	FreeReservation(base, size uint64) error
	// Create allocates one physical page. ErrOverLimit when the device or
	// the OS has no memory for it.
	Create() (Handle, error)
	// Release frees a physical page; its memory returns to the OS or the
	// device. Releasing a page that is still mapped is an error wrapping
	// ErrAlreadyMapped.
	Release(h Handle) error
	// Map maps page h at addr (Granularity-aligned, inside a reservation),
	// still without access. ErrAlreadyMapped when addr is mapped.
	Map(addr uint64, h Handle) error
	// Unmap unmaps the page at addr; the range returns to no access.
	// ErrNotMapped when addr is not mapped.
	Unmap(addr uint64) error
	// SetAccess grants read-write access to [addr, addr+size), which must be
	// mapped (ErrNotMapped otherwise).
	SetAccess(addr, size uint64) error
	// Export returns a file that holds page h at byte offset off, for
	// another process to map the same physical memory (memfd for the host
	// backend, a POSIX fd from cuMemExportToShareableHandle for CUDA). The
	// caller owns the file and closes it.
	Export(h Handle) (f *os.File, off uint64, err error)
	// CopyIn copies src to [addr, addr+len(src)); every page in the range
	// must be mapped (ErrNotMapped otherwise).
	CopyIn(addr uint64, src []byte) error
	// CopyOut copies [addr, addr+len(dst)) to dst; every page must be mapped.
	CopyOut(addr uint64, dst []byte) error
	// Close releases every page and reservation still held. A second Close
	// returns an error wrapping net.ErrClosed.
	Close() error
}

// HostMemory is implemented by backends whose pages are ordinary memory of
// this process (the host backend).
type HostMemory interface {
	// HostBytes returns [addr, addr+n) as a slice over the mapping itself
	// (zero copy). Every page in the range must be mapped (ErrNotMapped
	// otherwise). The slice is valid until the page is unmapped; touching it
	// after that faults.
	HostBytes(addr, n uint64) ([]byte, error)
}

// Importer is implemented by backends that can take in a page exported by
// Export (possibly from another process) as a new handle that Map accepts:
// vmm/cuda with cuMemImportFromShareableHandle. The host backend does not
// need it: an engine maps the exported memfd with mmap directly.
type Importer interface {
	// Import returns a handle for the page held by f at byte offset off.
	// f stays owned by the caller.
	Import(f *os.File, off uint64) (Handle, error)
}

// AsyncCopier is implemented by backends whose memory the host reaches only
// through copies, and that can run those copies in the background: vmm/cuda,
// on its own CUDA stream, from and into page-locked host buffers. The host
// backend has none (its pages are host memory: HostBytes).
type AsyncCopier interface {
	// HostBuffer returns n bytes of page-locked host memory, the host side
	// with which the copies below run asynchronously, and free, which gives
	// it back. buf is valid until free or the backend's Close.
	HostBuffer(n int) (buf []byte, free func() error, err error)
	// CopyOutAsync starts a copy of [addr, addr+len(dst)) into dst and
	// returns wait, which blocks until it is done and returns its error.
	// The caller leaves dst untouched until wait returns. Range errors as
	// for CopyOut.
	CopyOutAsync(addr uint64, dst []byte) (wait func() error, err error)
	// CopyInAsync starts a copy of src to [addr, addr+len(src)); src stays
	// unchanged until wait returns. Range errors as for CopyIn.
	CopyInAsync(addr uint64, src []byte) (wait func() error, err error)
}

// PeerCopier is implemented by backends that can map pages another process
// exported (Export's files, from a sidecar on the same host) read-only and
// copy from them device to device, with no copy through the host: vmm/cuda.
type PeerCopier interface {
	// ImportPeerPages imports each file (one exported page of sizes[i]
	// bytes from offset 0) and maps them read-only, back to back, in one new
	// range of addresses: addrs[i] is the first byte of file i. release
	// unmaps and releases them and frees the range. An error wrapping
	// errors.ErrUnsupported says this device cannot reach that memory (the
	// caller copies another way); nothing is left mapped after an error.
	ImportPeerPages(files []*os.File, sizes []uint64) (addrs []uint64, release func() error, err error)
	// CopyDeviceToDevice copies n[i] bytes from src[i] to dst[i] for every
	// i and returns when all are done. Each dst range is the backend's own
	// mapped pages; each src range those or imported peer pages. Entries
	// contiguous in both dst and src run as one copy (CoalesceCopies).
	CopyDeviceToDevice(dst, src, n []uint64) error
}
