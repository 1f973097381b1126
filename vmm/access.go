package vmm

import (
	"errors"
	"fmt"
	"os"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// SharedFileBackend is implemented by backends whose pages all live in one
// file (the host backend's memfd): Export of any page returns that same
// file, so a Pool exports it once and asks only for the offsets of the rest.
type SharedFileBackend interface {
	// FileOffset returns the byte offset of page h in the shared file.
	FileOffset(h Handle) (uint64, error)
}

// checkRange validates [off, off+n) of region and that every page in it is
// mapped now; it returns the virtual address of off.
func (p *Pool) checkRange(op string, region int, off, n uint64) (uint64, error) {
	if region < 0 || region >= len(p.regions) {
		return 0, fmt.Errorf("vmm: %s: region %d outside [0, %d): %w", op, region, len(p.regions), ErrBlockOutOfRange)
	}
	r := p.regions[region]
	if off+n < off || off+n > r.Len {
		return 0, fmt.Errorf("vmm: %s: bytes [%d, %d+%d) outside region %d of %d bytes: %w", op, off, off, n, region, r.Len, ErrBlockOutOfRange)
	}
	if n == 0 {
		return r.Base + off, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, p.closedErr()
	}
	for pg := off / p.ps; pg <= (off+n-1)/p.ps; pg++ {
		if p.pages[pg].status != pageMapped {
			return 0, &PageError{Op: op, Page: int(pg), Region: region, Err: ErrNotMapped}
		}
	}
	return r.Base + off, nil
}

// HostBytes returns a zero-copy slice of bytes [off, off+n) of region when
// the backend is host memory and every page in the range is mapped. Errors:
// a *PageError wrapping ErrNotMapped naming the first unmapped page; one
// wrapping ErrBlockOutOfRange for a range outside the region; one wrapping
// errors.ErrUnsupported for device memory (use CopyOut/CopyIn). The slice
// stays valid while a block in each page stays allocated; touching it after
// its page is unmapped faults.
func (p *Pool) HostBytes(region int, off, n uint64) ([]byte, error) {
	hm, ok := p.be.(HostMemory)
	if !ok {
		return nil, fmt.Errorf("vmm: host bytes: backend %T holds device memory: %w", p.be, errors.ErrUnsupported)
	}
	addr, err := p.checkRange("read", region, off, n)
	if err != nil || n == 0 {
		return nil, err
	}
	return hm.HostBytes(addr, n)
}

// CopyOut copies bytes [off, off+len(dst)) of region into dst (device or
// host memory). Errors as for HostBytes, plus the backend's.
func (p *Pool) CopyOut(region int, off uint64, dst []byte) error {
	addr, err := p.checkRange("read", region, off, uint64(len(dst)))
	if err != nil || len(dst) == 0 {
		return err
	}
	return p.be.CopyOut(addr, dst)
}

// CopyIn copies src into bytes [off, off+len(src)) of region.
func (p *Pool) CopyIn(region int, off uint64, src []byte) error {
	addr, err := p.checkRange("write", region, off, uint64(len(src)))
	if err != nil || len(src) == 0 {
		return err
	}
	return p.be.CopyIn(addr, src)
}

// Mapping says that bytes [FileOffset, FileOffset+Len) of Export.Files[File]
// back bytes [RegionOffset, RegionOffset+Len) of region Region (page Page).
type Mapping struct {
	Region       int
	Page         int
	RegionOffset uint64
	Len          uint64
	File         int
	FileOffset   uint64
}

// Proto converts m for the local API (PageMapping.fd_index = File).
func (m Mapping) Proto() *v1.PageMapping {
	return &v1.PageMapping{Region: uint32(m.Region), RegionOffset: m.RegionOffset, Len: m.Len,
		FdIndex: uint32(m.File), FdOffset: m.FileOffset}
}

// Export is what an engine process needs to map the same physical pages as
// a Pool: the files to pass with SCM_RIGHTS and where each range belongs.
// For the host backend there is one file (the memfd) and one Mapping per
// page per region; for CUDA one file per physical page (a POSIX fd from
// cuMemExportToShareableHandle, offset 0), which the engine imports with
// cuMemImportFromShareableHandle and maps at its own reservation.
type Export struct {
	Files    []*os.File
	Mappings []Mapping
}

// Close closes every file; the Export's owner calls it once the files were
// sent.
func (e *Export) Close() error {
	var errs []error
	for _, f := range e.Files {
		if err := f.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	e.Files = nil
	return errors.Join(errs...)
}

// Export exports the given page indices (nil: every mapped page) of every
// region. A page that is not mapped (or is unmapped while exporting) is a
// *PageError wrapping ErrNotMapped, and nothing is returned. The caller owns
// the result and closes it.
func (p *Pool) Export(pages []int) (*Export, error) {
	type item struct {
		pg, r int
		h     Handle
	}
	var items []item
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, p.closedErr()
	}
	if pages == nil {
		for pg := range p.pages {
			if p.pages[pg].status == pageMapped {
				pages = append(pages, pg)
			}
		}
	}
	for _, pg := range pages {
		if pg < 0 || pg >= p.nPages {
			p.mu.Unlock()
			return nil, &PageError{Op: "export", Page: pg, Region: -1, Err: fmt.Errorf("%w: page index outside [0, %d)", ErrBlockOutOfRange, p.nPages)}
		}
		if p.pages[pg].status != pageMapped {
			p.mu.Unlock()
			return nil, &PageError{Op: "export", Page: pg, Region: -1, Err: ErrNotMapped}
		}
		for r := 0; r < p.nRegions; r++ {
			items = append(items, item{pg, r, p.handles[pg][r]})
		}
	}
	p.mu.Unlock()

	// Backend calls run without the lock; the handles are re-checked after,
	// so an export raced by an unmap fails instead of naming stale memory.
	ex := &Export{}
	shared, isShared := p.be.(SharedFileBackend)
	for _, it := range items {
		m := Mapping{Region: it.r, Page: it.pg, RegionOffset: uint64(it.pg) * p.ps, Len: p.ps}
		var err error
		if isShared && len(ex.Files) > 0 {
			m.FileOffset, err = shared.FileOffset(it.h)
		} else {
			var f *os.File
			f, m.FileOffset, err = p.be.Export(it.h)
			if err == nil {
				ex.Files = append(ex.Files, f)
			}
		}
		if err != nil {
			_ = ex.Close()
			return nil, &PageError{Op: "export", Page: it.pg, Region: it.r, Err: err}
		}
		m.File = len(ex.Files) - 1
		ex.Mappings = append(ex.Mappings, m)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, it := range items {
		if p.pages[it.pg].status != pageMapped || p.handles[it.pg][it.r] != it.h {
			_ = ex.Close()
			return nil, &PageError{Op: "export", Page: it.pg, Region: it.r, Err: ErrNotMapped}
		}
	}
	return ex, nil
}
