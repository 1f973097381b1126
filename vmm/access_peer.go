package vmm

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
)

// CoalesceCopies merges copies (n[i] bytes from src[i] to dst[i]) that
// continue the one before them in both dst and src into one, and drops
// empty ones: N blocks contiguous on both sides become one copy. Only
// neighbours in the given order merge; the order of the copies is kept. The
// inputs are not changed. It panics if the three lengths differ.
func CoalesceCopies(dst, src, n []uint64) (cdst, csrc, cn []uint64) {
	if len(dst) != len(src) || len(dst) != len(n) {
		panic(fmt.Sprintf("vmm: CoalesceCopies of %d destinations, %d sources, %d lengths", len(dst), len(src), len(n)))
	}
	for i := range dst {
		if n[i] == 0 {
			continue
		}
		if k := len(cn) - 1; k >= 0 && cdst[k]+cn[k] == dst[i] && csrc[k]+cn[k] == src[i] {
			cn[k] += n[i]
			continue
		}
		cdst, csrc, cn = append(cdst, dst[i]), append(csrc, src[i]), append(cn, n[i])
	}
	return cdst, csrc, cn
}

// PeerPages are the pages of another pool's Export (a sidecar on the same
// host) mapped read-only into this pool's backend by Pool.ImportPeer, for
// CopyFromPeer to copy from, device to device.
type PeerPages struct {
	maps    []Mapping // by Region, then RegionOffset
	addrs   []uint64  // device address of each file's first byte (Export.Files order)
	once    sync.Once
	release func() error
	err     error
}

// ImportPeer maps every file of ex (exported by another pool's Export and
// passed here with SCM_RIGHTS) read-only into this pool's backend. The
// caller keeps owning ex, and calls Release on the result when the copies
// are done; the backend's Close releases what is left. Errors: one wrapping
// errors.ErrUnsupported when the backend is not a PeerCopier or its device
// cannot reach the peer's memory (copy another way); one wrapping
// ErrInvalidConfig for a Mapping naming a file ex does not have; the
// backend's otherwise, with nothing left mapped.
func (p *Pool) ImportPeer(ex *Export) (*PeerPages, error) {
	pc, ok := p.be.(PeerCopier)
	if !ok {
		return nil, fmt.Errorf("vmm: import peer pages: backend %T cannot map another process's pages: %w", p.be, errors.ErrUnsupported)
	}
	maps := slices.Clone(ex.Mappings)
	slices.SortFunc(maps, func(a, b Mapping) int {
		return cmp.Or(cmp.Compare(a.Region, b.Region), cmp.Compare(a.RegionOffset, b.RegionOffset))
	})
	// The files go to the backend in the order of the regions' bytes they
	// hold, so a region's pages land back to back and a run of blocks
	// across a page boundary stays one copy; files no mapping names are
	// left out.
	var files []*os.File
	var sizes []uint64
	slot := make([]int, len(ex.Files)) // file → index in files, plus one
	for _, m := range maps {
		if m.File < 0 || m.File >= len(ex.Files) {
			return nil, fmt.Errorf("vmm: import peer pages: mapping of region %d page %d names file %d of %d: %w", m.Region, m.Page, m.File, len(ex.Files), ErrInvalidConfig)
		}
		if slot[m.File] == 0 {
			files, sizes = append(files, ex.Files[m.File]), append(sizes, 0)
			slot[m.File] = len(files)
		}
		sizes[slot[m.File]-1] = max(sizes[slot[m.File]-1], m.FileOffset+m.Len)
	}
	addrs, release, err := pc.ImportPeerPages(files, sizes)
	if err != nil {
		return nil, err
	}
	pp := &PeerPages{maps: maps, addrs: make([]uint64, len(ex.Files)), release: release}
	for f, k := range slot {
		if k > 0 {
			pp.addrs[f] = addrs[k-1]
		}
	}
	return pp, nil
}

// Addr returns the device address of bytes [off, off+n) of the peer's
// region, which must lie in one exported Mapping (a block never straddles a
// page); an error wrapping ErrNotMapped otherwise.
func (pp *PeerPages) Addr(region int, off, n uint64) (uint64, error) {
	i, _ := slices.BinarySearchFunc(pp.maps, off, func(m Mapping, off uint64) int {
		return cmp.Or(cmp.Compare(m.Region, region), cmp.Compare(m.RegionOffset, off+1))
	})
	if i--; i < 0 || pp.maps[i].Region != region || off+n < off || off+n > pp.maps[i].RegionOffset+pp.maps[i].Len {
		return 0, fmt.Errorf("vmm: peer region %d bytes [%d, %d+%d) are not in one exported mapping: %w", region, off, off, n, ErrNotMapped)
	}
	m := pp.maps[i]
	return pp.addrs[m.File] + m.FileOffset + off - m.RegionOffset, nil
}

// Release unmaps the peer's pages. Later calls return the first's result.
func (pp *PeerPages) Release() error {
	pp.once.Do(func() { pp.err = pp.release() })
	return pp.err
}

// PeerCopy is one copy of CopyFromPeer: Len bytes from device address Src
// (PeerPages.Addr) into bytes [Off, Off+Len) of this pool's region Region.
type PeerCopy struct {
	Region int
	Off    uint64
	Src    uint64
	Len    uint64
}

// CopyFromPeer runs copies, device to device, and returns when all are
// done; copies contiguous on both sides run as one (CoalesceCopies). Every
// destination range must be in mapped pages of this pool (errors as for
// CopyIn); the blocks stay allocated until it returns. A backend that is not a PeerCopier returns an error wrapping
// errors.ErrUnsupported.
func (p *Pool) CopyFromPeer(copies []PeerCopy) error {
	pc, ok := p.be.(PeerCopier)
	if !ok {
		return fmt.Errorf("vmm: copy from peer: backend %T has no device-to-device copies: %w", p.be, errors.ErrUnsupported)
	}
	dst, src, n := make([]uint64, len(copies)), make([]uint64, len(copies)), make([]uint64, len(copies))
	for i, c := range copies {
		addr, err := p.checkRange("write", c.Region, c.Off, c.Len)
		if err != nil {
			return err
		}
		dst[i], src[i], n[i] = addr, c.Src, c.Len
	}
	return pc.CopyDeviceToDevice(dst, src, n)
}

// PeerCopier returns the pool's backend as a PeerCopier, for a transfer
// layer that copies from another process's pages device to device; nil
// when the backend is none (the host backend: its pages are mapped with
// mmap).
func (p *Pool) PeerCopier() PeerCopier {
	pc, _ := p.be.(PeerCopier)
	return pc
}

// HostAddressable reports whether the pool's pages are host memory that
// HostBytes reaches, and its Export one shared file (the host backend's
// memfd) a peer maps with mmap; false for device pages, exported one file
// per page.
func (p *Pool) HostAddressable() bool {
	_, ok := p.be.(HostMemory)
	return ok
}
