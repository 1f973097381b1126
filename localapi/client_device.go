package localapi

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"github.com/kvsidecar/kvsidecar/vmm"
)

// DeviceImporter maps device pages that a sidecar passes as POSIX file
// descriptors (CUDA allocations exported with cuMemExportToShareableHandle)
// into this process's device address space. *cuda.Backend of vmm/cuda
// implements it with cuMemImportFromShareableHandle, cuMemMap and
// cuMemSetAccess on its device; localapi takes it as an interface so it
// never links cgo. Addresses are device addresses (CUdeviceptr), sizes and
// offsets bytes; Map maps one page of Granularity bytes.
type DeviceImporter interface {
	// Granularity is the page size; it must equal the sidecar's page size.
	Granularity() uint64
	Reserve(size uint64) (base uint64, err error)
	FreeReservation(base, size uint64) error
	// Import returns a handle for the page held by f at byte offset off; f
	// stays owned by the caller.
	Import(f *os.File, off uint64) (vmm.Handle, error)
	Map(addr uint64, h vmm.Handle) error
	SetAccess(addr, size uint64) error
	Unmap(addr uint64) error
	Release(h vmm.Handle) error
	CopyIn(addr uint64, src []byte) error
	CopyOut(addr uint64, dst []byte) error
}

// deviceMap is a Client's mapping of a sidecar's device pages: one
// device reservation per region, one imported handle per mapped page.
type deviceMap struct {
	imp     DeviceImporter
	ps, rl  uint64
	bases   []uint64       // reservation of each region
	handles [][]vmm.Handle // [region][page]; 0: not mapped
}

// newDeviceMap reserves nr regions of rl bytes of pages of ps bytes.
func newDeviceMap(imp DeviceImporter, nr int, ps, rl uint64) (*deviceMap, error) {
	if g := imp.Granularity(); g != ps {
		return nil, fmt.Errorf("localapi: client: the sidecar's device pages are %d bytes, this process's device granularity (ClientConfig.DeviceImporter) is %d bytes: they must be equal", ps, g)
	}
	d := &deviceMap{imp: imp, ps: ps, rl: rl}
	for range nr {
		base, err := imp.Reserve(rl)
		if err != nil {
			_ = d.close()
			return nil, fmt.Errorf("localapi: client: reserve %d bytes of device addresses: %w", rl, err)
		}
		d.bases = append(d.bases, base)
		d.handles = append(d.handles, make([]vmm.Handle, rl/ps))
	}
	return d, nil
}

// mapPage imports the page f holds at fdOff and maps it at [off, off+n) of
// region r with read-write access, replacing whatever was mapped there.
func (d *deviceMap) mapPage(r int, off, n uint64, f *os.File, fdOff uint64) error {
	if n != d.ps {
		return fmt.Errorf("localapi: client: device mapping [%d, +%d) of region %d: one descriptor maps one page of %d bytes", off, n, r, d.ps)
	}
	pg := off / d.ps
	if err := d.unmap(r, pg); err != nil {
		return err
	}
	h, err := d.imp.Import(f, fdOff)
	if err != nil {
		return fmt.Errorf("localapi: client: import page %d of region %d: %w", pg, r, err)
	}
	addr := d.bases[r] + off
	if err := d.imp.Map(addr, h); err != nil {
		_ = d.imp.Release(h)
		return fmt.Errorf("localapi: client: map page %d of region %d: %w", pg, r, err)
	}
	if err := d.imp.SetAccess(addr, d.ps); err != nil {
		_ = d.imp.Unmap(addr)
		_ = d.imp.Release(h)
		return fmt.Errorf("localapi: client: set access of page %d of region %d: %w", pg, r, err)
	}
	d.handles[r][pg] = h
	return nil
}

// unmap unmaps and releases page pg of region r if it is mapped.
func (d *deviceMap) unmap(r int, pg uint64) error {
	h := d.handles[r][pg]
	if h == 0 {
		return nil
	}
	if err := d.imp.Unmap(d.bases[r] + pg*d.ps); err != nil {
		return fmt.Errorf("localapi: client: unmap page %d of region %d: %w", pg, r, err)
	}
	d.handles[r][pg] = 0
	if err := d.imp.Release(h); err != nil {
		return fmt.Errorf("localapi: client: release page %d of region %d: %w", pg, r, err)
	}
	return nil
}

// close unmaps every page and frees the reservations.
func (d *deviceMap) close() error {
	var errs []error
	for r, base := range d.bases {
		for pg := range d.handles[r] {
			errs = append(errs, d.unmap(r, uint64(pg)))
		}
		errs = append(errs, d.imp.FreeReservation(base, d.rl))
	}
	d.bases, d.handles = nil, nil
	return errors.Join(errs...)
}

// blockLocked checks region and block b and returns the block's byte offset
// in the region; its page must be mapped here. Caller holds mapMu.
func (c *Client) blockLocked(region, b int) (uint64, error) {
	switch {
	case c.info == nil:
		return 0, fmt.Errorf("%w: client not attached", ErrInvalidArgument)
	case region < 0 || region >= len(c.mapped):
		return 0, fmt.Errorf("%w: region %d outside [0, %d)", ErrInvalidArgument, region, len(c.mapped))
	case b < 0 || b >= int(c.info.GetNumBlocks()):
		return 0, fmt.Errorf("%w: block %d outside [0, %d)", ErrInvalidArgument, b, c.info.GetNumBlocks())
	}
	off := c.blockOffsetLocked(b)
	if pg := off / c.info.GetPageSize(); !c.mapped[region][pg] {
		return 0, fmt.Errorf("%w: block %d of region %d: page %d is not mapped in this process", ErrInvalidArgument, b, region, pg)
	}
	return off, nil
}

// BlockAddr returns the address of block b of region in this process: a
// device address (CUdeviceptr) for device memory, a host address for host
// memory, for the engine's kernels. Errors as Block's. The address stays
// valid while the block stays allocated.
func (c *Client) BlockAddr(region, b int) (uint64, error) {
	c.mapMu.RLock()
	defer c.mapMu.RUnlock()
	off, err := c.blockLocked(region, b)
	if err != nil {
		return 0, err
	}
	if c.dev != nil {
		return c.dev.bases[region] + off, nil
	}
	return uint64(uintptr(unsafe.Pointer(&c.regions[region][off]))), nil
}

// ReadBlock copies the first len(dst) bytes (at most BlockLen) of block b of
// region into dst, from host or device memory (cuMemcpyDtoH through the
// DeviceImporter). Errors as Block's, or the importer's.
func (c *Client) ReadBlock(region, b int, dst []byte) error {
	return c.copyBlock(region, b, dst, false)
}

// WriteBlock copies src (at most BlockLen bytes) to the start of block b of
// region, in host or device memory (cuMemcpyHtoD through the
// DeviceImporter). Errors as Block's, or the importer's.
func (c *Client) WriteBlock(region, b int, src []byte) error {
	return c.copyBlock(region, b, src, true)
}

func (c *Client) copyBlock(region, b int, buf []byte, write bool) error {
	c.mapMu.RLock()
	defer c.mapMu.RUnlock()
	off, err := c.blockLocked(region, b)
	if err != nil {
		return err
	}
	if bl := c.info.GetBlockLen(); uint64(len(buf)) > bl {
		return fmt.Errorf("%w: %d bytes for block %d of region %d, which holds %d", ErrInvalidArgument, len(buf), b, region, bl)
	}
	switch {
	case c.dev != nil && write:
		return c.dev.imp.CopyIn(c.dev.bases[region]+off, buf)
	case c.dev != nil:
		return c.dev.imp.CopyOut(c.dev.bases[region]+off, buf)
	case write:
		copy(c.regions[region][off:], buf)
	default:
		copy(buf, c.regions[region][off:])
	}
	return nil
}
