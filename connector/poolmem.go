package connector

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// PoolMemory is a vmm.Pool as a transfer agent sees it: its regions
// (transfer.Memory, and transfer.AsyncMemory on a device pool, staged
// through page-locked buffers it caches), the pages it shares on the
// same-host path, and its device copier. A Rank builds one over its pool;
// the transfer benchmark builds agents over pools with it too. Close frees
// the cached buffers (after the agents using it closed).
type PoolMemory struct {
	pool    *vmm.Pool
	regions []vmm.RegionInfo
	hb      *hostBuffers
}

// NewPoolMemory returns pool's PoolMemory.
func NewPoolMemory(pool *vmm.Pool) *PoolMemory {
	return &PoolMemory{pool: pool, regions: pool.Regions(), hb: &hostBuffers{pool: pool}}
}

// Regions returns the pool's regions to register with a transfer agent,
// in the pool's order.
func (m *PoolMemory) Regions() []transfer.Region {
	out := make([]transfer.Region, len(m.regions))
	for i, ri := range m.regions {
		out[i] = transfer.Region{Base: ri.Base, Len: ri.Len, BlockLen: ri.BlockLen,
			PageSize: ri.PageSize, DevID: uint32(ri.DevID), Mem: poolMemory{m.pool, ri.Index, m.hb}}
	}
	return out
}

// ShareKind is the kind of pages Share passes: a memfd on the host
// backend, CUDA POSIX file descriptors otherwise (transfer.Config.ShareKind).
func (m *PoolMemory) ShareKind() v1.PageKind {
	if m.pool.HostAddressable() {
		return v1.PageKind_PAGE_KIND_MEMFD
	}
	return v1.PageKind_PAGE_KIND_CUDA_POSIX_FD
}

// PeerCopier is the pool's backend as a transfer.PeerCopier (device pools:
// the same-host path's device-to-device copies), nil otherwise.
func (m *PoolMemory) PeerCopier() transfer.PeerCopier {
	if pc := m.pool.PeerCopier(); pc != nil {
		return pc
	}
	return nil
}

// Close frees the cached page-locked buffers; buffers given back later are
// freed then.
func (m *PoolMemory) Close() error { return m.hb.close() }

// Share is transfer.Config.Share over the pool: the pages of ranges (in
// its registered regions) exported from the pool, one memfd for the host
// backend, one file per page and region for CUDA. Errors: a range outside
// one region; the pool's Export (a page not mapped).
func (m *PoolMemory) Share(ranges []transfer.Desc) (*transfer.SharedPages, error) {
	type key struct{ region, page int }
	touched := map[key]bool{}
	var pages []int
	for _, d := range ranges {
		ri := slices.IndexFunc(m.regions, func(reg vmm.RegionInfo) bool { return d.Addr >= reg.Base && d.Addr+d.Len <= reg.Base+reg.Len })
		if ri < 0 {
			return nil, fmt.Errorf("connector: share: range %v is not in one region", d)
		}
		reg := m.regions[ri]
		ps := reg.PageSize
		for pg := (d.Addr - reg.Base) / ps; pg*ps < d.Addr-reg.Base+d.Len; pg++ {
			k := key{ri, int(pg)}
			if !touched[k] {
				touched[k] = true
				if !slices.Contains(pages, int(pg)) {
					pages = append(pages, int(pg))
				}
			}
		}
	}
	ex, err := m.pool.Export(pages)
	if err != nil {
		return nil, err
	}
	sp := &transfer.SharedPages{Kind: m.ShareKind()}
	// Only the files of touched (region, page) pairs are passed; the
	// others are closed now.
	slot := make([]int, len(ex.Files)) // file → index in sp.Files, plus one
	for _, mp := range ex.Mappings {
		if !touched[key{mp.Region, mp.Page}] {
			continue
		}
		if slot[mp.File] == 0 {
			sp.Files = append(sp.Files, ex.Files[mp.File])
			slot[mp.File] = len(sp.Files)
		}
		sp.Pages = append(sp.Pages, transfer.SharedPage{Addr: m.regions[mp.Region].Base + mp.RegionOffset, Len: mp.Len,
			File: slot[mp.File] - 1, FileOffset: mp.FileOffset})
	}
	for f, k := range slot {
		if k == 0 {
			_ = ex.Files[f].Close()
		}
	}
	return sp, nil
}

// poolMemory adapts one region of a vmm.Pool to transfer.Memory, and to
// transfer.AsyncMemory: on a device pool a transfer stages its bytes
// through the rank's cached page-locked buffers with the backend's
// asynchronous copies (one stream: they complete in order).
type poolMemory struct {
	p      *vmm.Pool
	region int
	hb     *hostBuffers
}

func (m poolMemory) HostBytes(off, n uint64) ([]byte, error) { return m.p.HostBytes(m.region, off, n) }
func (m poolMemory) CopyOut(off uint64, dst []byte) error    { return m.p.CopyOut(m.region, off, dst) }
func (m poolMemory) CopyIn(off uint64, src []byte) error     { return m.p.CopyIn(m.region, off, src) }
func (m poolMemory) HostBuffer(n int) ([]byte, func() error, error) {
	return m.hb.get(n)
}
func (m poolMemory) CopyOutAsync(off uint64, dst []byte) (func() error, error) {
	return m.p.CopyOutAsync(m.region, off, dst)
}
func (m poolMemory) CopyInAsync(off uint64, src []byte) (func() error, error) {
	return m.p.CopyInAsync(m.region, off, src)
}

var _ transfer.AsyncMemory = poolMemory{}

// maxCachedHostBuffers bounds the page-locked buffers a rank keeps between
// transfers: two per transfer in flight, for a few READ lanes each way.
const maxCachedHostBuffers = 16

// hostBuffers caches a device pool's page-locked staging buffers
// (vmm.Pool.HostBuffer: cuMemHostAlloc, which costs far more than staging
// one transfer's bytes), by size, until the rank closes.
type hostBuffers struct {
	pool *vmm.Pool

	mu     sync.Mutex
	closed bool
	free   map[int][]hostBuffer
	cached int
}

type hostBuffer struct {
	b    []byte
	free func() error
}

// get returns a buffer of n bytes and its release, which keeps it for the
// next transfer (or frees it once enough are kept, or the rank closed).
func (h *hostBuffers) get(n int) ([]byte, func() error, error) {
	h.mu.Lock()
	if fs := h.free[n]; len(fs) > 0 {
		hb := fs[len(fs)-1]
		h.free[n] = fs[:len(fs)-1]
		h.cached--
		h.mu.Unlock()
		return hb.b, h.release(n, hb), nil
	}
	h.mu.Unlock()
	b, free, err := h.pool.HostBuffer(n)
	if err != nil {
		return nil, nil, err
	}
	return b, h.release(n, hostBuffer{b, free}), nil
}

func (h *hostBuffers) release(n int, hb hostBuffer) func() error {
	var once sync.Once
	return func() error {
		var err error
		once.Do(func() {
			h.mu.Lock()
			if !h.closed && h.cached < maxCachedHostBuffers {
				if h.free == nil {
					h.free = map[int][]hostBuffer{}
				}
				h.free[n] = append(h.free[n], hb)
				h.cached++
				h.mu.Unlock()
				return
			}
			h.mu.Unlock()
			err = hb.free()
		})
		return err
	}
}

// close frees every cached buffer; buffers given back later are freed.
func (h *hostBuffers) close() error {
	h.mu.Lock()
	h.closed = true
	fs := h.free
	h.free, h.cached = nil, 0
	h.mu.Unlock()
	var errs []error
	for _, list := range fs {
		for _, hb := range list {
			errs = append(errs, hb.free())
		}
	}
	return errors.Join(errs...)
}
