//go:build linux

package vmm

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sort"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// DefaultHostPageSize is the host backend's page size when HostConfig leaves
// it zero: 2 MiB, the CUDA VMM granularity of current GPUs (kvcached uses the
// same 2 MiB page), so host and device pools have the same layout.
const DefaultHostPageSize = 2 << 20

// HostConfig configures NewHostBackend. The zero value and nil are valid.
type HostConfig struct {
	// PageSize is the page (granularity) in bytes. Default (0):
	// DefaultHostPageSize. It must be a multiple of the OS page size.
	PageSize uint64
	// Name names the memfd (visible in /proc/<pid>/fd). Default (""):
	// "kvsidecar-vmm".
	Name string
}

// HostBackend is the Linux host-memory Backend: one
// memfd holds every physical page (page = a Granularity-sized slot of it,
// the file grown with ftruncate); a reservation is a PROT_NONE anonymous
// mapping; Map is mmap(MAP_FIXED|MAP_SHARED) of the slot over the
// reservation (no access until SetAccess, as with CUDA); Unmap puts a
// PROT_NONE anonymous placeholder back; Release punches the slot out of the
// memfd (fallocate PUNCH_HOLE|KEEP_SIZE), so its memory returns to the OS, and
// the slot is reused by a later Create.
type HostBackend struct {
	gran uint64
	name string

	mu        sync.Mutex
	fd        int
	closed    bool
	slots     uint64              // memfd size in slots
	freeSlots []uint64            // released slots, reused first
	live      map[Handle]int      // handle → mappings of it
	mapped    map[uint64]Handle   // page address → handle
	access    map[uint64]struct{} // mapped pages with read-write access
	res       []reservation       // sorted by base
}

type reservation struct {
	base uint64
	size uint64
	ptr  unsafe.Pointer
}

var _ Backend = (*HostBackend)(nil)
var _ HostMemory = (*HostBackend)(nil)
var _ SharedFileBackend = (*HostBackend)(nil)

// NewHostBackend creates the memfd. Errors wrap ErrInvalidConfig (a page
// size that is not a positive multiple of the OS page size) or ErrBackend
// (memfd_create failed).
func NewHostBackend(cfg *HostConfig) (*HostBackend, error) {
	var c HostConfig
	if cfg != nil {
		c = *cfg
	}
	if c.PageSize == 0 {
		c.PageSize = DefaultHostPageSize
	}
	if c.Name == "" {
		c.Name = "kvsidecar-vmm"
	}
	osPage := uint64(os.Getpagesize())
	if c.PageSize%osPage != 0 {
		return nil, configError("HostConfig.PageSize", "%d is not a multiple of the OS page size %d", c.PageSize, osPage)
	}
	fd, err := unix.MemfdCreate(c.Name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, &BackendError{Op: "memfd_create", Err: err}
	}
	return &HostBackend{
		gran:   c.PageSize,
		name:   c.Name,
		fd:     fd,
		live:   make(map[Handle]int),
		mapped: make(map[uint64]Handle),
		access: make(map[uint64]struct{}),
	}, nil
}

// Granularity returns the page size in bytes.
func (b *HostBackend) Granularity() uint64 { return b.gran }

// DevID returns 0: host memory.
func (b *HostBackend) DevID() int { return 0 }

func (b *HostBackend) closedErr() error {
	return fmt.Errorf("vmm: host backend: %w", net.ErrClosed)
}

// Reserve reserves size bytes of PROT_NONE address space (MAP_NORESERVE, so
// it costs no memory).
func (b *HostBackend) Reserve(size uint64) (uint64, error) {
	if size == 0 || size%b.gran != 0 {
		return 0, configError("reserve size", "%d is not a positive multiple of the page size %d", size, b.gran)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, b.closedErr()
	}
	// Over-reserve by one page and trim, so the base is aligned to the page
	// size as cuMemAddressReserve's is (and huge pages can back it).
	raw, err := unix.MmapPtr(-1, 0, nil, uintptr(size+b.gran), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return 0, &BackendError{Op: "mmap reserve", Err: err}
	}
	head := (b.gran - uint64(uintptr(raw))%b.gran) % b.gran
	if head > 0 {
		if err := unix.MunmapPtr(raw, uintptr(head)); err != nil {
			return 0, &BackendError{Op: "munmap reserve head", Err: err}
		}
	}
	ptr := unsafe.Add(raw, head)
	if tail := b.gran - head; tail > 0 {
		if err := unix.MunmapPtr(unsafe.Add(ptr, size), uintptr(tail)); err != nil {
			return 0, &BackendError{Op: "munmap reserve tail", Err: err}
		}
	}
	r := reservation{base: uint64(uintptr(ptr)), size: size, ptr: ptr}
	i := sort.Search(len(b.res), func(i int) bool { return b.res[i].base > r.base })
	b.res = append(b.res, reservation{})
	copy(b.res[i+1:], b.res[i:])
	b.res[i] = r
	return r.base, nil
}

// FreeReservation unmaps any page still mapped in the range and gives the
// range back to the OS.
func (b *HostBackend) FreeReservation(base, size uint64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	i := sort.Search(len(b.res), func(i int) bool { return b.res[i].base >= base })
	if i == len(b.res) || b.res[i].base != base || b.res[i].size != size {
		return &AddrError{Op: "free reservation", Addr: base, Err: fmt.Errorf("%w: no reservation of %d bytes there", ErrBlockOutOfRange, size)}
	}
	r := b.res[i]
	for addr := r.base; addr < r.base+r.size; addr += b.gran {
		if h, ok := b.mapped[addr]; ok {
			b.dropMapping(addr, h)
		}
	}
	if err := unix.MunmapPtr(r.ptr, uintptr(r.size)); err != nil {
		return &BackendError{Op: "munmap reservation", Err: err}
	}
	b.res = append(b.res[:i], b.res[i+1:]...)
	return nil
}

// Create allocates one slot of the memfd, growing the file when no released
// slot is free, and its memory (fallocate), as cuMemCreate allocates a
// device page: the page is the pool's from now on, and a host out of memory
// says so here, as ErrOverLimit, not as a SIGBUS at the first write into it
// in the middle of a transfer.
func (b *HostBackend) Create() (Handle, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, b.closedErr()
	}
	var slot uint64
	grown := false
	if n := len(b.freeSlots); n > 0 {
		slot = b.freeSlots[n-1]
		b.freeSlots = b.freeSlots[:n-1]
	} else {
		if err := unix.Ftruncate(b.fd, int64((b.slots+1)*b.gran)); err != nil {
			return 0, &BackendError{Op: "ftruncate", Err: err}
		}
		slot = b.slots
		b.slots++
		grown = true
	}
	if err := unix.Fallocate(b.fd, 0, int64(slot*b.gran), int64(b.gran)); err != nil {
		if grown {
			b.slots--
			_ = unix.Ftruncate(b.fd, int64(b.slots*b.gran))
		} else {
			b.freeSlots = append(b.freeSlots, slot)
		}
		if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.ENOMEM) {
			return 0, fmt.Errorf("vmm: host backend: allocate a page of %d bytes: %w: %w", b.gran, ErrOverLimit, err)
		}
		return 0, &BackendError{Op: "fallocate", Err: err}
	}
	h := Handle(slot + 1) // 0 is never a valid handle
	b.live[h] = 0
	return h, nil
}

// Release punches the page's slot out of the memfd and keeps the slot for
// reuse.
func (b *HostBackend) Release(h Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	n, ok := b.live[h]
	if !ok {
		return fmt.Errorf("vmm: release handle %d: %w", h, ErrNotMapped)
	}
	if n > 0 {
		return fmt.Errorf("vmm: release handle %d: still mapped %d times: %w", h, n, ErrAlreadyMapped)
	}
	slot := uint64(h) - 1
	if err := unix.Fallocate(b.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(slot*b.gran), int64(b.gran)); err != nil {
		return &BackendError{Op: "fallocate punch hole", Err: err}
	}
	delete(b.live, h)
	b.freeSlots = append(b.freeSlots, slot)
	return nil
}

// page finds the reservation holding addr and checks alignment. Caller
// holds b.mu.
func (b *HostBackend) page(op string, addr uint64) (unsafe.Pointer, error) {
	r, ok := b.find(addr, b.gran)
	if !ok {
		return nil, &AddrError{Op: op, Addr: addr, Err: fmt.Errorf("%w: not inside a reservation", ErrBlockOutOfRange)}
	}
	if (addr-r.base)%b.gran != 0 {
		return nil, &AddrError{Op: op, Addr: addr, Err: fmt.Errorf("%w: not aligned to the page size %d", ErrInvalidConfig, b.gran)}
	}
	return unsafe.Add(r.ptr, addr-r.base), nil
}

// find returns the reservation that holds [addr, addr+n). Caller holds b.mu.
func (b *HostBackend) find(addr, n uint64) (reservation, bool) {
	i := sort.Search(len(b.res), func(i int) bool { return b.res[i].base > addr }) - 1
	if i < 0 {
		return reservation{}, false
	}
	r := b.res[i]
	if addr+n < addr || addr+n > r.base+r.size {
		return reservation{}, false
	}
	return r, true
}

// Map maps page h at addr with PROT_NONE; SetAccess grants access.
func (b *HostBackend) Map(addr uint64, h Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	ptr, err := b.page("map", addr)
	if err != nil {
		return err
	}
	if _, ok := b.live[h]; !ok {
		return &AddrError{Op: "map", Addr: addr, Err: fmt.Errorf("%w: unknown handle %d", ErrInvalidConfig, h)}
	}
	if _, ok := b.mapped[addr]; ok {
		return &AddrError{Op: "map", Addr: addr, Err: ErrAlreadyMapped}
	}
	slot := uint64(h) - 1
	if _, err := unix.MmapPtr(b.fd, int64(slot*b.gran), ptr, uintptr(b.gran), unix.PROT_NONE,
		unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
		return &BackendError{Op: "mmap MAP_FIXED|MAP_SHARED", Err: err}
	}
	b.mapped[addr] = h
	b.live[h]++
	return nil
}

// Unmap puts a PROT_NONE placeholder back over the page at addr.
func (b *HostBackend) Unmap(addr uint64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	if _, err := b.page("unmap", addr); err != nil {
		return err
	}
	h, ok := b.mapped[addr]
	if !ok {
		return &AddrError{Op: "unmap", Addr: addr, Err: ErrNotMapped}
	}
	return b.dropMapping(addr, h)
}

// dropMapping replaces the mapping at addr by a placeholder. Caller holds b.mu.
func (b *HostBackend) dropMapping(addr uint64, h Handle) error {
	ptr, err := b.page("unmap", addr)
	if err != nil {
		return err
	}
	if _, err := unix.MmapPtr(-1, 0, ptr, uintptr(b.gran), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED); err != nil {
		return &BackendError{Op: "mmap placeholder", Err: err}
	}
	delete(b.mapped, addr)
	delete(b.access, addr)
	b.live[h]--
	return nil
}

// SetAccess makes [addr, addr+size) readable and writable; every page in it
// must be mapped.
func (b *HostBackend) SetAccess(addr, size uint64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	if size == 0 || size%b.gran != 0 {
		return &AddrError{Op: "set access", Addr: addr, Err: fmt.Errorf("%w: size %d is not a positive multiple of the page size %d", ErrInvalidConfig, size, b.gran)}
	}
	ptr, err := b.page("set access", addr)
	if err != nil {
		return err
	}
	if _, ok := b.find(addr, size); !ok {
		return &AddrError{Op: "set access", Addr: addr, Err: fmt.Errorf("%w: %d bytes overrun the reservation", ErrBlockOutOfRange, size)}
	}
	for a := addr; a < addr+size; a += b.gran {
		if _, ok := b.mapped[a]; !ok {
			return &AddrError{Op: "set access", Addr: a, Err: ErrNotMapped}
		}
	}
	mem := unsafe.Slice((*byte)(ptr), size)
	if err := unix.Mprotect(mem, unix.PROT_READ|unix.PROT_WRITE); err != nil {
		return &BackendError{Op: "mprotect", Err: err}
	}
	// The page tables, at once (the pages are allocated since Create): a
	// transfer writing into the pages later takes no fault per 4 KiB.
	// Kernels before 5.14 know no MADV_POPULATE_WRITE: the pages fault in
	// on first touch there.
	if err := unix.Madvise(mem, unix.MADV_POPULATE_WRITE); err != nil && !errors.Is(err, unix.EINVAL) {
		return &BackendError{Op: "madvise MADV_POPULATE_WRITE", Err: err}
	}
	for a := addr; a < addr+size; a += b.gran {
		b.access[a] = struct{}{}
	}
	return nil
}

// Export returns a duplicate of the memfd (close-on-exec) and the byte
// offset of page h in it.
func (b *HostBackend) Export(h Handle) (*os.File, uint64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, 0, b.closedErr()
	}
	if _, ok := b.live[h]; !ok {
		return nil, 0, fmt.Errorf("vmm: export handle %d: %w: unknown handle", h, ErrInvalidConfig)
	}
	nfd, err := unix.FcntlInt(uintptr(b.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, 0, &BackendError{Op: "dup memfd", Err: err}
	}
	return os.NewFile(uintptr(nfd), b.name), (uint64(h) - 1) * b.gran, nil
}

// HostBytes returns [addr, addr+n) as a slice over the mapping; every page in
// the range must be mapped with access.
func (b *HostBackend) HostBytes(addr, n uint64) ([]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, b.closedErr()
	}
	return b.bytesLocked("host bytes", addr, n)
}

func (b *HostBackend) bytesLocked(op string, addr, n uint64) ([]byte, error) {
	if n == 0 {
		return nil, nil
	}
	r, ok := b.find(addr, n)
	if !ok {
		return nil, &AddrError{Op: op, Addr: addr, Err: fmt.Errorf("%w: %d bytes not inside one reservation", ErrBlockOutOfRange, n)}
	}
	first := r.base + (addr-r.base)/b.gran*b.gran
	for a := first; a < addr+n; a += b.gran {
		if _, ok := b.access[a]; !ok {
			return nil, &AddrError{Op: op, Addr: a, Err: ErrNotMapped}
		}
	}
	return unsafe.Slice((*byte)(unsafe.Add(r.ptr, addr-r.base)), n), nil
}

// CopyIn copies src into mapped pages at addr.
func (b *HostBackend) CopyIn(addr uint64, src []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	dst, err := b.bytesLocked("copy in", addr, uint64(len(src)))
	if err != nil {
		return err
	}
	copy(dst, src)
	return nil
}

// CopyOut copies mapped pages at addr into dst.
func (b *HostBackend) CopyOut(addr uint64, dst []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	src, err := b.bytesLocked("copy out", addr, uint64(len(dst)))
	if err != nil {
		return err
	}
	copy(dst, src)
	return nil
}

// Stat reports the memfd's size and the bytes the OS really holds for it
// (st_blocks × 512), for tests and operators checking that released pages
// went back to the OS.
func (b *HostBackend) Stat() (size, allocated uint64, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, 0, b.closedErr()
	}
	var st unix.Stat_t
	if err := unix.Fstat(b.fd, &st); err != nil {
		return 0, 0, &BackendError{Op: "fstat", Err: err}
	}
	return uint64(st.Size), uint64(st.Blocks) * 512, nil
}

// Close unmaps every reservation, releases every page and closes the memfd.
// A second Close returns an error wrapping net.ErrClosed.
func (b *HostBackend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.closedErr()
	}
	b.closed = true
	var first error
	for _, r := range b.res {
		if err := unix.MunmapPtr(r.ptr, uintptr(r.size)); err != nil && first == nil {
			first = &BackendError{Op: "munmap reservation", Err: err}
		}
	}
	b.res = nil
	clear(b.mapped)
	clear(b.access)
	clear(b.live)
	if err := unix.Close(b.fd); err != nil && first == nil {
		first = &BackendError{Op: "close memfd", Err: err}
	}
	return first
}

// FileOffset returns the byte offset of page h in the memfd.
func (b *HostBackend) FileOffset(h Handle) (uint64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, b.closedErr()
	}
	if _, ok := b.live[h]; !ok {
		return 0, fmt.Errorf("vmm: file offset of handle %d: %w: unknown handle", h, ErrInvalidConfig)
	}
	return (uint64(h) - 1) * b.gran, nil
}
