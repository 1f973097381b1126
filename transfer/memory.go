package transfer

import (
	"cmp"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"unsafe"

	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Memory is one registered region's bytes, addressed by offset from the
// region's base. An adapter over a vmm.Pool region is three one-line methods.
// Implementations must be safe for concurrent use on disjoint ranges.
type Memory interface {
	// HostBytes returns the mapped host bytes [off, off+n) without a copy,
	// or an error when any page of the range is unmapped or the memory is
	// not host-addressable (device memory). The agent then falls back to
	// CopyOut/CopyIn through a bounded staging buffer.
	HostBytes(off, n uint64) ([]byte, error)
	// CopyOut copies len(dst) bytes starting at off into dst.
	CopyOut(off uint64, dst []byte) error
	// CopyIn copies src into the region starting at off.
	CopyIn(off uint64, src []byte) error
}

// Region is one registered virtual range (NIXL: a registered memory
// descriptor). Descriptors naming it use absolute addresses in
// [Base, Base+Len).
type Region struct {
	// Base is the virtual base address in this process (or the device
	// pointer); it is only a name for the range, never dereferenced.
	Base uint64
	// Len is the region's length in bytes, > 0.
	Len uint64
	// BlockLen is the bytes of one KV block in this region; 0 means the
	// region is not divided into blocks and capabilities are checked on
	// block 0 only.
	BlockLen uint64
	// PageSize, when > 0, says blocks are packed PageSize/BlockLen to a page
	// and never straddle one (vmm layouts where BlockLen does not divide the
	// page; kvgeom.Packing). Bytes of a page's padding count as its last
	// block. 0 means blocks are contiguous: block b starts at b·BlockLen.
	PageSize uint64
	// DevID is the device the memory lives on (NIXL devID).
	DevID uint32
	// Mem gives access to the bytes.
	Mem Memory
}

// Desc is one contiguous range in an agent's registered memory
// (NIXL: addr, len, devID).
type Desc struct {
	Addr  uint64
	Len   uint64
	DevID uint32
}

func (d Desc) String() string { return fmt.Sprintf("{addr %#x len %d dev %d}", d.Addr, d.Len, d.DevID) }

// SliceMemory is the Memory of host bytes that are always mapped, such as an
// mmap'd range: HostBytes returns sub-slices of it.
type SliceMemory []byte

// HostBytes returns m[off:off+n].
func (m SliceMemory) HostBytes(off, n uint64) ([]byte, error) {
	if off > uint64(len(m)) || n > uint64(len(m))-off {
		return nil, errorf(v1.Code_CODE_OUT_OF_RANGE, "range [%d, +%d) outside %d bytes", off, n, len(m))
	}
	return m[off : off+n : off+n], nil
}

// CopyOut copies m[off:] into dst.
func (m SliceMemory) CopyOut(off uint64, dst []byte) error {
	b, err := m.HostBytes(off, uint64(len(dst)))
	if err == nil {
		copy(dst, b)
	}
	return err
}

// CopyIn copies src into m[off:].
func (m SliceMemory) CopyIn(off uint64, src []byte) error {
	b, err := m.HostBytes(off, uint64(len(src)))
	if err == nil {
		copy(b, src)
	}
	return err
}

// SliceRegion registers b (e.g. an mmap'd range) as a region whose base is
// b's address.
func SliceRegion(b []byte, blockLen uint64, devID uint32) Region {
	return Region{Base: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))), Len: uint64(len(b)), BlockLen: blockLen, DevID: devID, Mem: SliceMemory(b)}
}

// span is a validated descriptor: its region and offset inside it, and,
// for a dialed transfer's local descriptors, its offset in the transfer's
// local byte stream (Local's descriptors back to back: Xfer.OnLanded).
type span struct {
	reg *Region
	off uint64
	n   uint64
	at  uint64
}

// blockAt returns the id of the block holding byte off of the region.
func (r *Region) blockAt(off uint64) uint64 {
	return kvgeom.Packing{BlockLen: r.BlockLen, PageSize: r.PageSize}.BlockAt(off)
}

// regions is an immutable set of registered regions sorted by nothing in
// particular; lookups are linear since agents hold a few hundred regions at
// most and a descriptor list is validated once.
type regionSet []*Region

func validateRegion(i int, r Region) error {
	switch {
	case r.Len == 0:
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "region %d: Len must be > 0", i)
	case r.Base+r.Len < r.Base:
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "region %d: Base %#x + Len %d overflows", i, r.Base, r.Len)
	case r.Mem == nil:
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "region %d: Mem must not be nil", i)
	case r.PageSize > 0 && r.BlockLen > r.PageSize:
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "region %d: BlockLen %d exceeds PageSize %d", i, r.BlockLen, r.PageSize)
	case r.BlockLen > r.Len:
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "region %d: BlockLen %d exceeds Len %d", i, r.BlockLen, r.Len)
	}
	return nil
}

// resolve checks d and returns its span: len > 0, addr+len does not
// overflow, the range lies inside one registered region of the same device.
func (rs regionSet) resolve(d Desc) (span, error) {
	if d.Len == 0 {
		return span{}, errorf(v1.Code_CODE_INVALID_ARGUMENT, "descriptor %v: length must be > 0", d)
	}
	end, carry := bits.Add64(d.Addr, d.Len, 0)
	if carry != 0 {
		return span{}, errorf(v1.Code_CODE_OUT_OF_RANGE, "descriptor %v: addr+len overflows 64 bits", d)
	}
	for _, r := range rs {
		if d.Addr >= r.Base && end <= r.Base+r.Len {
			if r.DevID != d.DevID {
				return span{}, errorf(v1.Code_CODE_OUT_OF_RANGE, "descriptor %v: region at %#x is on device %d", d, r.Base, r.DevID)
			}
			return span{reg: r, off: d.Addr - r.Base, n: d.Len}, nil
		}
	}
	return span{}, errorf(v1.Code_CODE_OUT_OF_RANGE, "descriptor %v: not inside one registered region", d)
}

// resolveAll resolves every descriptor; the first violation fails the list.
func (rs regionSet) resolveAll(ds []Desc) ([]span, uint64, error) {
	out := make([]span, len(ds))
	var total uint64
	for i, d := range ds {
		s, err := rs.resolve(d)
		if err != nil {
			return nil, 0, fmt.Errorf("descriptor %d: %w", i, err)
		}
		s.at = total
		out[i] = s
		total += s.n
	}
	return out, total, nil
}

// mergeSpans merges each span into the one before it when it continues it
// in the same region (the bytes move in the same order to the same
// places, in fewer, larger runs). It reuses spans' array.
func mergeSpans(spans []span) []span {
	out := spans[:0]
	for _, s := range spans {
		if n := len(out) - 1; n >= 0 && out[n].reg == s.reg && out[n].off+out[n].n == s.off && out[n].at+out[n].n == s.at {
			out[n].n += s.n
			continue
		}
		out = append(out, s)
	}
	return out
}

// MaxBlocksPerTransfer bounds the block ids one served READ or WRITE may
// touch (counted per descriptor, before duplicates are merged): 2^20 blocks
// is 16 GiB of 16 KiB blocks, far beyond one request's KV cache, and keeps
// Access.BlockIDs at most 4 MiB. A transfer beyond it is refused with
// ErrInvalidArgument before Authorize runs.
const MaxBlocksPerTransfer = 1 << 20

// blockIDs returns the sorted, deduplicated block ids the spans touch
// (Region.blockAt of the span's first and last byte, and every id between).
// The count is summed per span from its first and last block before any id
// is listed: more than MaxBlocksPerTransfer fails with ErrInvalidArgument,
// and a block id beyond uint32 (the capability's id space) with
// ErrOutOfRange.
func blockIDs(spans []span) ([]uint32, error) {
	type run struct{ first, last uint64 }
	runs := make([]run, len(spans))
	var count uint64 // at most len(spans) × 2^32: no overflow
	for i, s := range spans {
		var r run
		if s.reg.BlockLen > 0 {
			r = run{s.reg.blockAt(s.off), s.reg.blockAt(s.off + s.n - 1)}
		}
		if r.last > math.MaxUint32 {
			return nil, errorf(v1.Code_CODE_OUT_OF_RANGE, "descriptor %d reaches block %d, beyond the uint32 block ids capabilities name", i, r.last)
		}
		runs[i] = r
		count += r.last - r.first + 1
	}
	if count > MaxBlocksPerTransfer {
		return nil, errorf(v1.Code_CODE_INVALID_ARGUMENT, "descriptors touch %d blocks, more than the limit of %d per transfer", count, MaxBlocksPerTransfer)
	}
	slices.SortFunc(runs, func(a, b run) int { return cmp.Compare(a.first, b.first) })
	var ids []uint32
	next := uint64(0) // the smallest id not yet listed
	for _, r := range runs {
		for b := max(r.first, next); b <= r.last; b++ {
			ids = append(ids, uint32(b))
		}
		next = max(next, r.last+1)
	}
	return ids, nil
}

func descsToProto(ds []Desc) *v1.DescriptorList {
	out := &v1.DescriptorList{Descs: make([]*v1.Descriptor, len(ds))}
	for i, d := range ds {
		out.Descs[i] = &v1.Descriptor{Addr: d.Addr, Len: d.Len, DevId: d.DevID}
	}
	return out
}

func descsFromProto(l *v1.DescriptorList) []Desc {
	out := make([]Desc, len(l.GetDescs()))
	for i, d := range l.GetDescs() {
		out[i] = Desc{Addr: d.GetAddr(), Len: d.GetLen(), DevID: d.GetDevId()}
	}
	return out
}

// resolveBlocks checks b against the registered regions and returns its
// spans, region-major, each block's slice in b.BlockIds order: every region
// exists and is divided into blocks, offset+len fits one block, every block
// lies inside its region, and regions × blocks is at most maxEntries.
// b's region i is registered region regionMap[i], or region i when
// regionMap is nil (registration order). With merge, slices adjacent in
// memory become one span (fewer, larger writes; checksums need them apart).
func (rs regionSet) resolveBlocks(b *v1.BlockDescs, regionMap []int, maxEntries int, merge bool) ([]span, uint64, error) {
	ids := b.GetBlockIds()
	first, nr := uint64(b.GetFirstRegion()), uint64(b.GetNumRegions())
	entries := nr * uint64(len(ids))
	switch {
	case nr == 0 || len(ids) == 0 || b.GetLen() == 0:
		return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "block descriptors of %d regions × %d blocks × %d bytes name no byte; each must be > 0",
			nr, len(ids), b.GetLen())
	case entries > uint64(maxEntries):
		return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "block descriptors name %d regions × %d blocks = %d entries, at most %d allowed",
			nr, len(ids), entries, maxEntries)
	case first+nr > uint64(len(rs)):
		return nil, 0, errorf(v1.Code_CODE_OUT_OF_RANGE, "block descriptors name regions [%d, %d), this agent registered %d", first, first+nr, len(rs))
	case regionMap != nil && first+nr > uint64(len(regionMap)):
		return nil, 0, errorf(v1.Code_CODE_OUT_OF_RANGE, "block descriptors name regions [%d, %d), the request's layout lists %d", first, first+nr, len(regionMap))
	}
	out := make([]span, 0, entries)
	var total uint64
	for ri := first; ri < first+nr; ri++ {
		at := ri
		if regionMap != nil {
			at = uint64(regionMap[ri])
			if at >= uint64(len(rs)) {
				return nil, 0, errorf(v1.Code_CODE_OUT_OF_RANGE, "the request's region %d maps to region %d, this agent registered %d", ri, at, len(rs))
			}
		}
		r := rs[at]
		end, carry := bits.Add64(b.GetOffset(), b.GetLen(), 0)
		switch {
		case r.BlockLen == 0:
			return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "region %d is not divided into blocks; name its bytes by address", ri)
		case carry != 0 || end > r.BlockLen:
			return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "block slice offset %d + len %d exceeds region %d's block_len %d",
				b.GetOffset(), b.GetLen(), ri, r.BlockLen)
		}
		p := kvgeom.Packing{BlockLen: r.BlockLen, PageSize: r.PageSize}
		for k, id := range ids {
			off := p.Offset(kvgeom.BlockID(id))
			if off > r.Len || r.Len-off < r.BlockLen {
				return nil, 0, errorf(v1.Code_CODE_OUT_OF_RANGE, "block_ids[%d]=%d is beyond region %d (%d bytes of %d-byte blocks)", k, id, ri, r.Len, r.BlockLen)
			}
			s := span{reg: r, off: off + b.GetOffset(), n: b.GetLen()}
			if n := len(out); merge && n > 0 && out[n-1].reg == r && out[n-1].off+out[n-1].n == s.off {
				out[n-1].n += s.n
			} else {
				out = append(out, s)
			}
			total += s.n
		}
	}
	return out, total, nil
}
