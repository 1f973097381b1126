package vmm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"sync"

	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// RegionInfo describes one reserved region of a Pool. Block b of the region
// lives at Base + BlockOffset(b): blocks are packed PageSize/BlockLen to a
// page and never straddle one (kvgeom.Packing), so when BlockLen divides
// PageSize (every power-of-2 geometry) BlockOffset(b) == b × BlockLen.
type RegionInfo struct {
	Index    int
	Base     uint64 // virtual address: host pointer or CUdeviceptr
	Len      uint64 // bytes reserved: pages × PageSize
	BlockLen uint64 // bytes of one block in this region
	DevID    int
	Layer    int
	Kind     v1.RegionKind
	PageSize uint64 // bytes of one page (the backend's granularity); 0: blocks back to back
}

// Packing returns how the region's blocks sit in its pages.
func (r RegionInfo) Packing() kvgeom.Packing {
	return kvgeom.Packing{BlockLen: r.BlockLen, PageSize: r.PageSize}
}

// BlockOffset returns the byte offset of block b inside the region:
// r.Packing().Offset(b). A RegionInfo built by hand with PageSize 0 reads as
// blocks back to back, b × BlockLen.
func (r RegionInfo) BlockOffset(b int) uint64 {
	return r.Packing().Offset(kvgeom.BlockID(b))
}

// Proto converts r for AgentMetadata.
func (r RegionInfo) Proto() *v1.Region {
	return &v1.Region{Base: r.Base, Len: r.Len, BlockLen: r.BlockLen, DevId: uint32(r.DevID), Layer: uint32(r.Layer), Kind: r.Kind}
}

// Stats is a snapshot of a Pool.
type Stats struct {
	Pages         int    // page indices in the reservation of each region
	PagesMapped   int    // page indices mapped (reserve and follower pages included)
	BytesMapped   uint64 // PagesMapped × PageSize × NumRegions
	ReservePages  int    // mapped page indices with no allocated block (the prealloc reserve)
	BlocksUsed    int    // allocated blocks, the null block excluded
	BlocksTotal   int    // allocatable blocks: NumBlocks - 1
	Available     int    // blocks Alloc could hand out now under the limit
	MemoryLimit   uint64 // bytes; 0 = none
	PageSize      uint64
	NumRegions    int
	BlocksPerPage int
}

// Pool is the elastic KV cache of one rank: every region is reserved at
// NewPool, and page p of every region is mapped when a block in it is first
// allocated and unmapped when its last block is freed (or kept in the
// prealloc reserve). Methods are safe for concurrent use. The pool lock is
// never held across a backend call: pages in flight are marked busy and
// counted against the limit, so Available stays consistent and no page is
// mapped twice.
type Pool struct {
	cfg       Config
	be        Backend
	ownBE     bool
	log       *slog.Logger
	m         *metrics
	ps        uint64 // page size
	pack      kvgeom.Packing
	bpp       int
	nPages    int
	nRegions  int
	pageBytes uint64 // ps × nRegions: the cost of one page index
	regions   []RegionInfo
	handles   [][]Handle // [page][region]; written only by the holder of the page's busy state

	ctx    context.Context
	cancel context.CancelFunc
	kick   chan chan struct{}
	bg     sync.WaitGroup // the refill goroutine
	ops    sync.WaitGroup // public calls in flight

	mu          sync.Mutex
	closed      bool
	limit       uint64
	pages       []page
	blockUsed   []bool
	partial     idxSet            // local mapped pages with free and used blocks
	empty       idxSet            // local mapped pages with no used block (the reserve)
	unmapped    []int32           // unmapped pages; the short last page, if any, kept at the bottom
	unmappedCap int               // blocks in unmapped pages
	committed   int               // pages busy, mapped or broken: what the limit counts
	mappedCnt   int               // pages in pageMapped
	freeMapped  int               // free blocks in partial and empty pages
	used        int               // allocated blocks, null block excluded
	refilling   int               // pages the refill goroutine is mapping
	refillCap   int               // blocks of the pages the refill goroutine is mapping
	pins        map[*pin]struct{} // transfers' holds on blocks (Pin)
	pagePins    []int32           // pins per page index
	unpinned    chan struct{}     // closed and cleared when a pin goes
	trimPinned  bool              // a trim skipped an empty page under a pin: the last unpin trims again

	onCommit func(committed, limitPages int) // tests: called under mu when a page is committed
}

// NewPool reserves every region, maps page 0 and allocates the null block
// (block 0) before anything else can take it, and starts the refill
// goroutine. Errors wrap ErrInvalidConfig (naming the field), ErrOverLimit
// or ErrBackend; nothing is left reserved or mapped on error.
func NewPool(ctx context.Context, cfg *Config) (*Pool, error) {
	if cfg == nil {
		return nil, configError("Config", "nil: Layout and NumBlocks are required")
	}
	c := cfg.withDefaults()
	if err := c.Layout.Validate(); err != nil {
		return nil, err
	}
	if c.NumBlocks < 2 || c.NumBlocks > math.MaxInt32 {
		return nil, configError("Config.NumBlocks", "%d must be in [2, %d] (block 0 is the null block)", c.NumBlocks, math.MaxInt32)
	}
	if c.UnmapHookTimeout < 0 || c.UnmapHookTimeout > MaxUnmapHookTimeout {
		return nil, configError("Config.UnmapHookTimeout", "%v must be in [0, %v]", c.UnmapHookTimeout, MaxUnmapHookTimeout)
	}
	be, own := c.Backend, false
	if be == nil {
		hb, err := NewHostBackend(nil)
		if err != nil {
			return nil, err
		}
		be, own = hb, true
	}
	p, err := newPool(ctx, c, be)
	if err != nil {
		if own {
			_ = be.Close()
		}
		return nil, err
	}
	p.ownBE = own
	p.bg.Add(1)
	go p.refillLoop()
	p.nudge()
	return p, nil
}

func newPool(ctx context.Context, c Config, be Backend) (*Pool, error) {
	ps := be.Granularity()
	if ps == 0 {
		return nil, configError("Config.Backend", "granularity 0")
	}
	pack, err := kvgeom.NewPacking(c.Layout.BlockLen(), ps)
	if err != nil {
		return nil, configError("Config.Layout", "%v", err)
	}
	bpp := int(pack.BlocksPerPage())
	nPages := (c.NumBlocks + bpp - 1) / bpp
	m, err := newMetrics(c.Registerer)
	if err != nil {
		return nil, err
	}
	p := &Pool{
		cfg: c, be: be, log: c.Logger, m: m,
		ps: ps, pack: pack, bpp: bpp, nPages: nPages,
		nRegions:  c.Layout.NumRegions(),
		pageBytes: ps * uint64(c.Layout.NumRegions()),
		kick:      make(chan chan struct{}, 1),
		limit:     c.MemoryLimit,
		pages:     make([]page, nPages),
		blockUsed: make([]bool, c.NumBlocks),
		partial:   newIdxSet(nPages),
		empty:     newIdxSet(nPages),
	}
	if c.MemoryLimit != 0 && c.MemoryLimit < p.pageBytes {
		return nil, configError("Config.MemoryLimit", "%d bytes is below one page of every region (%d × %d = %d bytes), which the null block needs",
			c.MemoryLimit, ps, p.nRegions, p.pageBytes)
	}
	p.handles = make([][]Handle, nPages)
	for i := range p.handles {
		p.handles[i] = make([]Handle, p.nRegions)
	}
	// Reserve every region; roll back on failure.
	size := uint64(nPages) * ps
	for r := 0; r < p.nRegions; r++ {
		base, err := be.Reserve(size)
		if err != nil {
			p.freeReservations()
			return nil, fmt.Errorf("vmm: reserve region %d of %d bytes: %w", r, size, err)
		}
		layer, kind := c.Layout.Region(r)
		p.regions = append(p.regions, RegionInfo{Index: r, Base: base, Len: size, BlockLen: pack.BlockLen,
			DevID: be.DevID(), Layer: layer, Kind: kind, PageSize: ps})
	}
	// Unmapped stack: the short last page (if any) at the bottom, then
	// descending so page 1 is popped first.
	for pg := nPages - 1; pg >= 1; pg-- {
		p.unmapped = append(p.unmapped, int32(pg))
		p.unmappedCap += p.capOf(pg)
	}
	// Page 0 and the null block.
	p.pages[0].status = pageBusy
	p.committed = 1
	if err := p.mapBackend(ctx, []int{0}); err != nil {
		p.freeReservations()
		return nil, err
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.mu.Lock()
	p.setMappedLocked(0)
	p.takeFromPageLocked(0, 1, nil) // pops block 0, the lowest id
	p.blockUsed[0] = true
	p.used = 0 // the null block is not counted as used
	p.mu.Unlock()
	p.m.pools.add(p)
	return p, nil
}

// Alloc allocates n blocks (ids in [1, NumBlocks)), mapping pages as needed;
// it is all-or-nothing. Errors: a *LimitError (ErrOverLimit) when fewer than
// n blocks are available under the limit; a *PageError or *HookError when a
// map fails (rolled back, nothing left allocated); context.Cause(ctx) when
// ctx ends first; net.ErrClosed after Close.
func (p *Pool) Alloc(ctx context.Context, n int) ([]int, error) {
	if n < 0 {
		return nil, configError("Alloc n", "%d must be >= 0", n)
	}
	if err := ctx.Err(); err != nil {
		return nil, context.Cause(ctx)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, p.closedErr()
	}
	if n == 0 {
		p.mu.Unlock()
		return []int{}, nil
	}
	// A page the background refill is mapping is neither free nor
	// unmapped: wait for the refill instead of refusing blocks it brings.
	for n > p.availableLocked() && p.refilling > 0 {
		p.mu.Unlock()
		p.settle()
		if err := ctx.Err(); err != nil {
			return nil, context.Cause(ctx)
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, p.closedErr()
		}
	}
	if avail := p.availableLocked(); n > avail {
		p.mu.Unlock()
		p.m.allocRefused.Inc()
		return nil, &LimitError{Want: n, Available: avail, Limit: p.limitSnapshot()}
	}
	ids := make([]int, 0, n)
	for len(ids) < n {
		var pg int
		switch {
		case p.partial.len() > 0:
			pg = p.partial.last()
		case p.empty.len() > 0:
			pg = p.empty.last()
		default:
			pg = -1
		}
		if pg < 0 {
			break
		}
		ids = p.takeFromPageLocked(pg, n-len(ids), ids)
	}
	var fresh []int
	for need := n - len(ids); need > 0; {
		pg := p.popUnmappedLocked()
		fresh = append(fresh, pg)
		need -= p.capOf(pg)
	}
	if len(fresh) == 0 {
		p.mu.Unlock()
		p.nudge()
		return ids, nil
	}
	p.ops.Add(1)
	p.mu.Unlock()
	defer p.ops.Done()

	err := p.mapBackend(ctx, fresh)
	if err == nil {
		err = p.callMapHook(ctx, fresh)
	}
	p.mu.Lock()
	if err != nil {
		for _, pg := range fresh {
			if p.pages[pg].status != pageBroken {
				p.pushUnmappedLocked(pg)
			}
		}
		trim := p.releaseLocked(ids)
		p.mu.Unlock()
		p.unmapTrimmed(ctx, trim)
		return nil, err
	}
	for _, pg := range fresh {
		p.setMappedLocked(pg)
		ids = p.takeFromPageLocked(pg, n-len(ids), ids)
	}
	p.mu.Unlock()
	p.nudge()
	return ids, nil
}

func (p *Pool) limitSnapshot() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.limit
}

// Free frees blocks, all or nothing: an error means no block was freed. It
// validates every id first and frees nothing when one is bad: *BlockError
// wrapping ErrBlockOutOfRange, ErrNullBlock or ErrDoubleFree (also for an
// id named twice); after Close an error wrapping net.ErrClosed. Pages whose
// last block was freed are unmapped, except those kept for the prealloc
// reserve; when the pool is over its limit, empty pages are unmapped first.
// A failure of that unmap (a page kept broken, retried at Close) or of
// PageHook.UnmapPages (the other ranks repair the page before their next
// op) comes after the blocks were freed: it is logged and counted
// (kvsidecar_vmm_failures_total, op "unmap" or "hook_unmap"), never
// returned, so a caller never frees the blocks again. The hook is told
// about every page that was unmapped, whatever ctx has become since. With a
// Config.FreeHook, it runs first (the blocks still allocated), detached
// from ctx and bounded by UnmapHookTimeout; its failure is logged and
// counted, and the blocks are freed anyway.
func (p *Pool) Free(ctx context.Context, ids []int) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return p.closedErr()
	}
	if err := p.validateFreeLocked(ids); err != nil {
		p.mu.Unlock()
		return err
	}
	if p.cfg.FreeHook != nil && len(ids) > 0 {
		// The blocks stay allocated while the hook waits: nobody can be
		// handed them before every other rank stopped using them.
		p.ops.Add(1)
		p.mu.Unlock()
		hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.UnmapHookTimeout)
		herr := p.cfg.FreeHook(hctx, ids)
		cancel()
		if herr != nil {
			p.m.failures.WithLabelValues("hook_free").Inc()
			p.log.Warn("vmm: free hook failed; freeing anyway", "blocks", len(ids), "err", herr)
		}
		p.mu.Lock()
		p.ops.Done()
		if p.closed {
			p.mu.Unlock()
			return p.closedErr()
		}
		if err := p.validateFreeLocked(ids); err != nil {
			p.mu.Unlock()
			return err // freed by another call meanwhile
		}
	}
	trim := p.releaseLocked(ids)
	if len(trim) == 0 {
		p.mu.Unlock()
		return nil
	}
	p.ops.Add(1)
	p.mu.Unlock()
	defer p.ops.Done()
	// Logged and counted by unmapTrimmed; the blocks are free either way.
	_ = p.unmapTrimmed(ctx, trim)
	return nil
}

// CheckAllocated reports whether every id in ids is a block allocated now
// (handed out by Alloc and not freed since), so its page is mapped and
// cannot be trimmed: the check a caller makes before writing into blocks,
// e.g. the connector before a READ lands in them. It does not block beyond
// the pool's lock and costs O(len(ids)); an empty ids is nil. Errors: a
// *BlockError naming the first bad id, wrapping ErrBlockOutOfRange (outside
// [0, NumBlocks)), ErrNullBlock (id 0) or ErrNotAllocated (free, perhaps in
// a reserve page that SetMemoryLimit or the refill may unmap at any time);
// an error wrapping net.ErrClosed after Close. A block Free'd right after a
// nil answer is the caller's race to avoid.
func (p *Pool) CheckAllocated(ids []int) error { return p.checkBlocks(ids, true) }

// CheckMapped reports whether the page of every id in ids is mapped now,
// allocated or not: the check of a rank whose blocks another rank allocates
// (a coordinated TP group follower, whose pages rank 0 maps), and of a
// server before it reads a block. Errors: a *BlockError naming the first
// bad id, wrapping ErrBlockOutOfRange, ErrNullBlock or ErrNotMapped; an
// error wrapping net.ErrClosed after Close.
func (p *Pool) CheckMapped(ids []int) error { return p.checkBlocks(ids, false) }

// checkBlocks is CheckAllocated (allocated) or CheckMapped.
func (p *Pool) checkBlocks(ids []int, allocated bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return p.closedErr()
	}
	for _, b := range ids {
		if err := p.checkBlockLocked(b, allocated); err != nil {
			return err
		}
	}
	return nil
}

// checkBlockLocked is checkBlocks of one id; p.mu is held.
func (p *Pool) checkBlockLocked(b int, allocated bool) error {
	var bad error
	switch {
	case b < 0 || b >= p.cfg.NumBlocks:
		bad = ErrBlockOutOfRange
	case b == 0:
		bad = ErrNullBlock
	case allocated && (!p.blockUsed[b] || p.pages[b/p.bpp].status != pageMapped):
		bad = ErrNotAllocated
	case p.pages[b/p.bpp].status != pageMapped:
		bad = ErrNotMapped
	}
	if bad != nil {
		return &BlockError{Block: b, NumBlocks: p.cfg.NumBlocks, Err: bad}
	}
	return nil
}

func (p *Pool) validateFreeLocked(ids []int) error {
	var bad error
	n := 0
	for _, b := range ids {
		switch {
		case b < 0 || b >= p.cfg.NumBlocks:
			bad = &BlockError{Block: b, NumBlocks: p.cfg.NumBlocks, Err: ErrBlockOutOfRange}
		case b == 0:
			bad = &BlockError{Block: b, NumBlocks: p.cfg.NumBlocks, Err: ErrNullBlock}
		case !p.blockUsed[b]:
			bad = &BlockError{Block: b, NumBlocks: p.cfg.NumBlocks, Err: ErrDoubleFree}
		}
		if bad != nil {
			break
		}
		p.blockUsed[b] = false // for now, to catch an id named twice
		n++
	}
	for _, b := range ids[:n] {
		p.blockUsed[b] = true
	}
	return bad
}

// Available returns the blocks Alloc could hand out now: free blocks in
// mapped pages plus those of pages the limit still allows to map. Never
// negative.
func (p *Pool) Available() int {
	n, _ := p.AvailableOverLimit()
	return n
}

// AvailableOverLimit returns Available and whether more pages are mapped
// than the memory limit allows (a limit lowered below them): blocks freed
// then unmap their emptied pages without making room for others until the
// mapped pages fall to the limit, so they may leave fewer blocks available.
func (p *Pool) AvailableOverLimit() (blocks int, overLimit bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, false
	}
	return p.reportedAvailableLocked()
}

// reportedAvailableLocked is AvailableOverLimit under p.mu. A page the
// refill is mapping is neither free nor unmapped: within the limit its
// blocks are Alloc's (Alloc waits for the refill); over it (the limit
// lowered while it maps) it is unmapped as soon as it is mapped, so it
// neither counts nor keeps the pool over the limit.
func (p *Pool) reportedAvailableLocked() (blocks int, overLimit bool) {
	if p.limit == 0 || p.committed <= p.limitPagesLocked() {
		return p.availableLocked() + p.refillCap, false
	}
	return p.availableLocked(), p.committed-p.refilling > p.limitPagesLocked()
}

// SetMemoryLimit sets the limit on mapped bytes across all regions (0 = no
// limit). Lowering it below what is mapped stops new maps at once, unmaps
// empty pages (the reserve included) now, and the rest as blocks are freed;
// raising it lets the pool grow and refills the reserve. A limit below one
// page of every region is rejected (ErrInvalidConfig): page 0 always stays.
func (p *Pool) SetMemoryLimit(bytes uint64) error {
	if bytes != 0 && bytes < p.pageBytes {
		return configError("memory limit", "%d bytes is below one page of every region (%d bytes), which the null block needs", bytes, p.pageBytes)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return p.closedErr()
	}
	p.limit = bytes
	trim := p.trimLocked(p.cfg.PreallocPages)
	p.ops.Add(1)
	p.mu.Unlock()
	defer p.ops.Done()
	err := p.unmapTrimmed(p.ctx, trim)
	p.nudge()
	return err
}

// Stats returns a snapshot.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := Stats{
		Pages: p.nPages, PagesMapped: p.mappedCnt, ReservePages: p.empty.len(),
		BlocksUsed: p.used, BlocksTotal: p.cfg.NumBlocks - 1, MemoryLimit: p.limit,
		PageSize: p.ps, NumRegions: p.nRegions, BlocksPerPage: p.bpp,
	}
	s.BytesMapped = uint64(s.PagesMapped) * p.pageBytes
	if !p.closed {
		s.Available, _ = p.reportedAvailableLocked()
	}
	return s
}

// Layout returns the pool's layout.
func (p *Pool) Layout() Layout { return p.cfg.Layout }

// NumBlocks returns the blocks per region (ids 0..NumBlocks-1).
func (p *Pool) NumBlocks() int { return p.cfg.NumBlocks }

// PageSize returns the page (granularity) size in bytes.
func (p *Pool) PageSize() uint64 { return p.ps }

// Regions returns the reserved regions in order (for each layer K then V, or
// one compound region). The slice is a copy.
func (p *Pool) Regions() []RegionInfo {
	return append([]RegionInfo(nil), p.regions...)
}

// BlockOffset returns the byte offset of block b inside every region.
func (p *Pool) BlockOffset(b int) uint64 {
	return p.pack.Offset(kvgeom.BlockID(b))
}

func (p *Pool) closedErr() error { return fmt.Errorf("vmm: pool: %w", net.ErrClosed) }

// Close stops the refill goroutine, waits for calls in flight, unmaps and
// releases every page, frees the reservations and, when the Pool created it,
// closes the backend. The PageHook is not called. A second Close returns an
// error wrapping net.ErrClosed.
func (p *Pool) Close() error {
	p.m.pools.remove(p) // a closed pool counts nothing in the shared gauges
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return p.closedErr()
	}
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	p.bg.Wait()
	p.ops.Wait()
	var errs []error
	for pg := range p.pages {
		for r := 0; r < p.nRegions; r++ {
			h := p.handles[pg][r]
			if h == 0 {
				continue
			}
			addr := p.regions[r].Base + uint64(pg)*p.ps
			if err := p.be.Unmap(addr); err != nil && !errors.Is(err, ErrNotMapped) {
				errs = append(errs, &PageError{Op: "unmap", Page: pg, Region: r, Err: err})
			}
			if err := p.be.Release(h); err != nil {
				errs = append(errs, &PageError{Op: "release", Page: pg, Region: r, Err: err})
			}
			p.handles[pg][r] = 0
		}
	}
	p.freeReservations()
	p.mu.Lock()
	p.mappedCnt, p.committed = 0, 0
	p.mu.Unlock()
	if p.ownBE {
		if err := p.be.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
