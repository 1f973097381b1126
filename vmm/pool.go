package vmm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"sync"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// DefaultPreallocPages is the prealloc reserve when Config.PreallocPages is
// 0: one page index (one physical page per region) kept mapped but free, so
// the next Alloc that needs a fresh page rarely waits for the backend.
const DefaultPreallocPages = 1

// DefaultUnmapHookTimeout is Config.UnmapHookTimeout when it is zero: it
// exceeds tpgroup's default PeerTimeout (5 s) so the hook's own deadline
// normally ends first.
const DefaultUnmapHookTimeout = 30 * time.Second

// MaxUnmapHookTimeout is the largest Config.UnmapHookTimeout accepted.
const MaxUnmapHookTimeout = 10 * time.Minute

// PageHook is told about page indices a coordinated-mode rank 0 maps and
// unmaps, so ranks 1..N-1 map the same pages.
//
// MapPages is called after the pages were mapped locally and checked, before
// any block in them is handed out (for Alloc) or before they join the
// reserve (for the background refill); if it fails, the pool unmaps the
// pages locally and the Alloc fails with a *HookError wrapping the hook's
// error, nothing left allocated. UnmapPages is called after the local unmap,
// so rank 0 unmaps first, then ranks 1..N-1; it gets every page that was
// unmapped (even when another page's unmap failed) and a ctx detached from
// the caller's, bounded by Config.UnmapHookTimeout. Page 0 (the null block) is
// mapped by every pool at NewPool and never passed to the hook.
type PageHook interface {
	MapPages(ctx context.Context, pages []int) error
	UnmapPages(ctx context.Context, pages []int) error
}

// Config configures NewPool. A nil *Config is rejected only because Layout
// and NumBlocks have no sensible default; every other zero field works.
type Config struct {
	// Backend provides the pages. Default (nil): NewHostBackend(nil), owned
	// and closed by the Pool. A Backend passed in is not closed by Close (the
	// Pool frees only its own reservations and pages).
	Backend Backend
	// Layout of this rank's KV cache; required (see Layout.Validate).
	Layout Layout
	// NumBlocks is the number of blocks per region, ids 0..NumBlocks-1; block
	// 0 is the null block, allocated at NewPool and never handed out.
	// Required, at least 2.
	NumBlocks int
	// MemoryLimit caps the bytes of mapped pages across all regions (reserve
	// and in-flight maps included). Default (0): no limit beyond the
	// reservation. It must leave room for page 0 (one page per region).
	MemoryLimit uint64
	// PreallocPages is the bounded reserve of mapped-but-free page indices
	// that a background goroutine keeps filled. Default (0):
	// DefaultPreallocPages; negative: no reserve (followers in coordinated
	// mode should use -1 so their pages are mapped only by MapPages).
	PreallocPages int
	// PageHook, when set, is told about every page index mapped or unmapped
	// (except page 0). Default (nil): none.
	PageHook PageHook
	// UnmapHookTimeout bounds each PageHook.UnmapPages call. That call runs
	// detached from the caller's ctx (context.WithoutCancel), so a caller
	// that gives up after the local unmap cannot leave the followers still
	// mapping pages rank 0 will reuse. Default (0): DefaultUnmapHookTimeout
	// (30 s); it must be in [0, MaxUnmapHookTimeout].
	UnmapHookTimeout time.Duration
	// Logger receives Debug per page and Warn on failures. Default (nil):
	// discard.
	Logger *slog.Logger
	// Registerer receives the kvsidecar_vmm_* metrics. Default (nil): none.
	Registerer prometheus.Registerer
}

func (c *Config) withDefaults() Config {
	var out Config
	if c != nil {
		out = *c
	}
	if out.PreallocPages == 0 {
		out.PreallocPages = DefaultPreallocPages
	}
	if out.PreallocPages < 0 {
		out.PreallocPages = 0
	}
	if out.UnmapHookTimeout == 0 {
		out.UnmapHookTimeout = DefaultUnmapHookTimeout
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return out
}

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

type pageStatus uint8

const (
	pageUnmapped pageStatus = iota
	pageBusy                // a map or unmap of it is in flight (it counts as committed)
	pageMapped
	pageBroken // an unmap failed part way; kept committed, never reused, retried at Close
)

type page struct {
	status pageStatus
	ext    bool    // mapped by MapPages (a follower); no blocks are handed out of it
	used   int32   // allocated blocks in it (page 0 counts the null block)
	free   []int32 // free block ids when mapped locally; popped from the end
}

// Pool is the elastic KV cache of one rank: every region is reserved at
// NewPool, and page p of every region is mapped when a block in it is first
// allocated and unmapped when its last block is freed (or kept in the
// prealloc reserve). Methods are safe for concurrent use. The pool lock is
// never held across a backend call: pages in flight are marked busy and
// counted against the limit, so Available stays consistent and no page is
// mapped twice.
type Pool struct {
	cfg   Config
	be    Backend
	ownBE bool
	log   *slog.Logger
	m     *metrics
	// gauged is what this pool last added to the shared gauges.
	gauged struct {
		mapped, used int
		limit        uint64
	}
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
	partial     idxSet  // local mapped pages with free and used blocks
	empty       idxSet  // local mapped pages with no used block (the reserve)
	unmapped    []int32 // unmapped pages; the short last page, if any, kept at the bottom
	unmappedCap int     // blocks in unmapped pages
	committed   int     // pages busy, mapped or broken: what the limit counts
	mappedCnt   int     // pages in pageMapped
	freeMapped  int     // free blocks in partial and empty pages
	used        int     // allocated blocks, null block excluded
	refilling   int     // pages the refill goroutine is mapping

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
	p.updateGaugesLocked()
	p.mu.Unlock()
	p.setLimitGauge(c.MemoryLimit)
	return p, nil
}

func (p *Pool) freeReservations() {
	for _, r := range p.regions {
		if err := p.be.FreeReservation(r.Base, r.Len); err != nil {
			p.log.Warn("vmm: free reservation", "region", r.Index, "err", err)
		}
	}
	p.regions = nil
}

// capOf is the number of block ids in page pg.
func (p *Pool) capOf(pg int) int {
	lo := pg * p.bpp
	return min(p.bpp, p.cfg.NumBlocks-lo)
}

// limitPagesLocked is how many page indices the limit allows in total.
func (p *Pool) limitPagesLocked() int {
	if p.limit == 0 {
		return p.nPages
	}
	return int(min(p.limit/p.pageBytes, uint64(p.nPages)))
}

// newPagesAllowedLocked is how many more pages may be mapped now.
func (p *Pool) newPagesAllowedLocked() int {
	return max(0, min(len(p.unmapped), p.limitPagesLocked()-p.committed))
}

func (p *Pool) availableLocked() int {
	k := p.newPagesAllowedLocked()
	newCap := k * p.bpp
	if k == len(p.unmapped) {
		newCap = p.unmappedCap
	}
	return p.freeMapped + newCap
}

// popUnmappedLocked takes the next unmapped page and marks it busy.
func (p *Pool) popUnmappedLocked() int {
	n := len(p.unmapped)
	pg := int(p.unmapped[n-1])
	p.unmapped = p.unmapped[:n-1]
	p.unmappedCap -= p.capOf(pg)
	p.pages[pg].status = pageBusy
	p.committed++
	if p.onCommit != nil {
		p.onCommit(p.committed, p.limitPagesLocked())
	}
	return pg
}

// pushUnmappedLocked returns a page to the unmapped stack.
func (p *Pool) pushUnmappedLocked(pg int) {
	p.pages[pg] = page{status: pageUnmapped, free: p.pages[pg].free[:0]}
	p.committed--
	p.unmappedCap += p.capOf(pg)
	if p.capOf(pg) < p.bpp {
		p.unmapped = append([]int32{int32(pg)}, p.unmapped...)
		return
	}
	p.unmapped = append(p.unmapped, int32(pg))
}

// setMappedLocked turns a busy page into a mapped local page with every
// block free; the page joins the empty set.
func (p *Pool) setMappedLocked(pg int) {
	ps := &p.pages[pg]
	ps.status, ps.ext, ps.used = pageMapped, false, 0
	lo, n := pg*p.bpp, p.capOf(pg)
	if cap(ps.free) < n {
		ps.free = make([]int32, 0, n)
	}
	ps.free = ps.free[:0]
	for b := lo + n - 1; b >= lo; b-- {
		ps.free = append(ps.free, int32(b))
	}
	p.freeMapped += n
	p.mappedCnt++
	p.empty.add(pg)
}

// takeFromPageLocked allocates up to n blocks of local mapped page pg.
func (p *Pool) takeFromPageLocked(pg, n int, ids []int) []int {
	ps := &p.pages[pg]
	if ps.used == 0 && len(ps.free) > 0 {
		p.empty.remove(pg)
		p.partial.add(pg)
	}
	k := min(n, len(ps.free))
	for i := 0; i < k; i++ {
		b := ps.free[len(ps.free)-1]
		ps.free = ps.free[:len(ps.free)-1]
		p.blockUsed[b] = true
		ids = append(ids, int(b))
	}
	ps.used += int32(k)
	p.freeMapped -= k
	p.used += k
	if len(ps.free) == 0 {
		p.partial.remove(pg)
	}
	return ids
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
		p.updateGaugesLocked()
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
		p.updateGaugesLocked()
		p.mu.Unlock()
		p.unmapTrimmed(ctx, trim)
		return nil, err
	}
	for _, pg := range fresh {
		p.setMappedLocked(pg)
		ids = p.takeFromPageLocked(pg, n-len(ids), ids)
	}
	p.updateGaugesLocked()
	p.mu.Unlock()
	p.nudge()
	return ids, nil
}

func (p *Pool) limitSnapshot() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.limit
}

// callMapHook tells the hook about pages mapped locally; on failure it
// unmaps them locally again.
func (p *Pool) callMapHook(ctx context.Context, pages []int) error {
	if p.cfg.PageHook == nil {
		return nil
	}
	if err := p.cfg.PageHook.MapPages(ctx, pages); err != nil {
		p.m.failures.WithLabelValues("hook_map").Inc()
		if uerr := p.unmapBackend(pages); uerr != nil {
			p.log.Warn("vmm: unmap after page hook failure", "pages", pages, "err", uerr)
		}
		return &HookError{Op: "map", Pages: pages, Err: err}
	}
	return nil
}

// Free frees blocks; it validates every id first and frees nothing when one
// is bad: *BlockError wrapping ErrBlockOutOfRange, ErrNullBlock or
// ErrDoubleFree (also for an id named twice). Pages whose last block was
// freed are unmapped, except those kept for the prealloc reserve; when the
// pool is over its limit, empty pages are unmapped first. An error of the
// unmap (a *PageError), of PageHook.UnmapPages (a *HookError), or both
// (errors.Join) is returned after the blocks were freed; the hook is told
// about every page that was unmapped, whatever ctx has become since.
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
	trim := p.releaseLocked(ids)
	p.updateGaugesLocked()
	if len(trim) == 0 {
		p.mu.Unlock()
		return nil
	}
	p.ops.Add(1)
	p.mu.Unlock()
	defer p.ops.Done()
	return p.unmapTrimmed(ctx, trim)
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

// releaseLocked frees valid allocated ids and returns the pages to unmap
// (already marked busy).
func (p *Pool) releaseLocked(ids []int) []int {
	for _, b := range ids {
		pg := b / p.bpp
		ps := &p.pages[pg]
		p.blockUsed[b] = false
		if len(ps.free) == 0 {
			p.partial.add(pg)
		}
		ps.free = append(ps.free, int32(b))
		ps.used--
		p.freeMapped++
		p.used--
		if ps.used == 0 {
			p.partial.remove(pg)
			p.empty.add(pg)
		}
	}
	return p.trimLocked(p.cfg.PreallocPages)
}

// trimLocked picks empty pages to unmap: those beyond keep, and any empty
// page while the pool is over its limit. They are marked busy.
func (p *Pool) trimLocked(keep int) []int {
	var out []int
	for p.empty.len() > 0 && (p.empty.len() > keep || (p.limit != 0 && uint64(p.committed)*p.pageBytes > p.limit)) {
		pg := p.empty.last()
		p.empty.remove(pg)
		ps := &p.pages[pg]
		p.freeMapped -= len(ps.free)
		ps.free = ps.free[:0]
		ps.status = pageBusy
		p.mappedCnt--
		out = append(out, pg)
	}
	return out
}

// unmapTrimmed unmaps busy pages picked by trimLocked and tells the hook
// about every page that was unmapped, even when others failed (those stay
// broken, still mapped here, and are not reported): a page missing from the
// hook's view stays mapped on the followers while this pool reuses its slot.
// The hook runs detached from ctx, bounded by Config.UnmapHookTimeout. The
// unmap's *PageError and the hook's *HookError are joined.
func (p *Pool) unmapTrimmed(ctx context.Context, pages []int) error {
	if len(pages) == 0 {
		return nil
	}
	err := p.unmapBackend(pages)
	p.mu.Lock()
	var done []int
	for _, pg := range pages {
		if p.pages[pg].status == pageBroken {
			continue
		}
		p.pushUnmappedLocked(pg)
		done = append(done, pg)
	}
	p.updateGaugesLocked()
	p.mu.Unlock()
	if p.cfg.PageHook != nil && len(done) > 0 {
		hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.UnmapHookTimeout)
		herr := p.cfg.PageHook.UnmapPages(hctx, done)
		cancel()
		if herr != nil {
			p.m.failures.WithLabelValues("hook_unmap").Inc()
			p.log.Warn("vmm: page hook unmap failed", "pages", done, "err", herr)
			err = errors.Join(err, &HookError{Op: "unmap", Pages: done, Err: herr})
		}
	}
	return err
}

// mapBackend maps busy pages in every region: create, map, set access. On
// any failure (or ctx ending) everything this call mapped is rolled back.
func (p *Pool) mapBackend(ctx context.Context, pages []int) error {
	type done struct{ pg, r int }
	var did []done
	rollback := func() {
		for i := len(did) - 1; i >= 0; i-- {
			d := did[i]
			p.dropHandle(d.pg, d.r)
		}
	}
	for _, pg := range pages {
		if err := ctx.Err(); err != nil {
			rollback()
			return context.Cause(ctx)
		}
		start := time.Now()
		for r := 0; r < p.nRegions; r++ {
			addr := p.regions[r].Base + uint64(pg)*p.ps
			h, err := p.be.Create()
			if err != nil {
				rollback()
				p.m.failures.WithLabelValues("map").Inc()
				return &PageError{Op: "map", Page: pg, Region: r, Err: err}
			}
			if err := p.be.Map(addr, h); err != nil {
				if rerr := p.be.Release(h); rerr != nil {
					p.log.Warn("vmm: release after map failure", "page", pg, "region", r, "err", rerr)
				}
				rollback()
				p.m.failures.WithLabelValues("map").Inc()
				return &PageError{Op: "map", Page: pg, Region: r, Err: err}
			}
			p.handles[pg][r] = h
			did = append(did, done{pg, r})
			if err := p.be.SetAccess(addr, p.ps); err != nil {
				rollback()
				p.m.failures.WithLabelValues("map").Inc()
				return &PageError{Op: "map", Page: pg, Region: r, Err: err}
			}
		}
		p.m.mapSeconds.WithLabelValues("map").Observe(time.Since(start).Seconds())
		p.log.Debug("vmm: page mapped", "page", pg)
	}
	return nil
}

// dropHandle unmaps and releases region r of page pg (rollback path).
func (p *Pool) dropHandle(pg, r int) {
	addr := p.regions[r].Base + uint64(pg)*p.ps
	if err := p.be.Unmap(addr); err != nil {
		p.log.Warn("vmm: rollback unmap", "page", pg, "region", r, "err", err)
	}
	if err := p.be.Release(p.handles[pg][r]); err != nil {
		p.log.Warn("vmm: rollback release", "page", pg, "region", r, "err", err)
	}
	p.handles[pg][r] = 0
}

// unmapBackend unmaps and releases busy pages in every region. A page whose
// unmap fails is marked broken (kept committed) and the first error returned.
func (p *Pool) unmapBackend(pages []int) error {
	var first error
	for _, pg := range pages {
		start := time.Now()
		var perr error
		for r := 0; r < p.nRegions; r++ {
			if p.handles[pg][r] == 0 {
				continue
			}
			addr := p.regions[r].Base + uint64(pg)*p.ps
			if err := p.be.Unmap(addr); err != nil && !errors.Is(err, ErrNotMapped) {
				perr = &PageError{Op: "unmap", Page: pg, Region: r, Err: err}
				continue
			}
			if err := p.be.Release(p.handles[pg][r]); err != nil {
				perr = &PageError{Op: "release", Page: pg, Region: r, Err: err}
				continue
			}
			p.handles[pg][r] = 0
		}
		if perr != nil {
			p.m.failures.WithLabelValues("unmap").Inc()
			p.log.Warn("vmm: unmap page failed", "page", pg, "err", perr)
			p.mu.Lock()
			p.pages[pg].status = pageBroken
			p.mu.Unlock()
			if first == nil {
				first = perr
			}
			continue
		}
		p.m.mapSeconds.WithLabelValues("unmap").Observe(time.Since(start).Seconds())
		p.log.Debug("vmm: page unmapped", "page", pg)
	}
	return first
}

// MapPages maps page indices on command, without allocating block ids: the
// follower side of coordinated TP mode. It is all-or-nothing: on any failure
// the pages this call mapped are unmapped again. An empty page of this pool's
// own reserve is taken over without a backend call. Errors: *PageError
// wrapping ErrBlockOutOfRange (index outside [0, Pages)) or ErrAlreadyMapped
// (mapped by an earlier MapPages, or holding blocks), *LimitError, or the
// backend's *PageError.
func (p *Pool) MapPages(ctx context.Context, pages []int) error {
	if err := ctx.Err(); err != nil {
		return context.Cause(ctx)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return p.closedErr()
	}
	seen := make(map[int]bool, len(pages))
	var fresh, adopt []int
	for _, pg := range pages {
		if pg < 0 || pg >= p.nPages {
			p.mu.Unlock()
			return &PageError{Op: "map", Page: pg, Region: -1, Err: fmt.Errorf("%w: page index outside [0, %d)", ErrBlockOutOfRange, p.nPages)}
		}
		ps := p.pages[pg]
		switch {
		case seen[pg] || ps.status != pageUnmapped && !(ps.status == pageMapped && !ps.ext && ps.used == 0):
			p.mu.Unlock()
			return &PageError{Op: "map", Page: pg, Region: -1, Err: ErrAlreadyMapped}
		case ps.status == pageUnmapped:
			fresh = append(fresh, pg)
		default:
			adopt = append(adopt, pg)
		}
		seen[pg] = true
	}
	if allowed := p.limitPagesLocked() - p.committed; len(fresh) > allowed {
		p.mu.Unlock()
		return &LimitError{Want: len(fresh), Available: max(0, allowed), Limit: p.limit}
	}
	for _, pg := range fresh {
		p.removeUnmappedLocked(pg)
	}
	for _, pg := range adopt {
		p.empty.remove(pg)
		ps := &p.pages[pg]
		p.freeMapped -= len(ps.free)
		ps.free = ps.free[:0]
		ps.ext = true
	}
	p.ops.Add(1)
	p.mu.Unlock()
	defer p.ops.Done()

	err := p.mapBackend(ctx, fresh)
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		for _, pg := range fresh {
			p.pushUnmappedLocked(pg)
		}
		for _, pg := range adopt {
			p.mappedCnt--
			p.setMappedLocked(pg)
		}
		p.updateGaugesLocked()
		return err
	}
	for _, pg := range fresh {
		p.pages[pg].status, p.pages[pg].ext = pageMapped, true
		p.mappedCnt++
	}
	p.updateGaugesLocked()
	return nil
}

// removeUnmappedLocked takes a specific page off the unmapped stack and
// marks it busy.
func (p *Pool) removeUnmappedLocked(pg int) {
	for i, q := range p.unmapped {
		if int(q) == pg {
			p.unmapped = append(p.unmapped[:i], p.unmapped[i+1:]...)
			break
		}
	}
	p.unmappedCap -= p.capOf(pg)
	p.pages[pg].status = pageBusy
	p.committed++
	if p.onCommit != nil {
		p.onCommit(p.committed, p.limitPagesLocked())
	}
}

// UnmapPages unmaps page indices mapped by MapPages. Every index is checked
// first (a *PageError wrapping ErrNotMapped or ErrBlockOutOfRange, nothing
// unmapped); a backend failure is returned as a *PageError.
func (p *Pool) UnmapPages(ctx context.Context, pages []int) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return p.closedErr()
	}
	seen := make(map[int]bool, len(pages))
	for _, pg := range pages {
		if pg < 0 || pg >= p.nPages {
			p.mu.Unlock()
			return &PageError{Op: "unmap", Page: pg, Region: -1, Err: fmt.Errorf("%w: page index outside [0, %d)", ErrBlockOutOfRange, p.nPages)}
		}
		if seen[pg] || p.pages[pg].status != pageMapped || !p.pages[pg].ext {
			p.mu.Unlock()
			return &PageError{Op: "unmap", Page: pg, Region: -1, Err: ErrNotMapped}
		}
		seen[pg] = true
	}
	for _, pg := range pages {
		p.pages[pg].status = pageBusy
		p.mappedCnt--
	}
	p.ops.Add(1)
	p.mu.Unlock()
	defer p.ops.Done()
	err := p.unmapBackend(pages)
	p.mu.Lock()
	for _, pg := range pages {
		if p.pages[pg].status != pageBroken {
			p.pushUnmappedLocked(pg)
		}
	}
	p.updateGaugesLocked()
	p.mu.Unlock()
	return err
}

// Available returns the blocks Alloc could hand out now: free blocks in
// mapped pages plus those of pages the limit still allows to map. Never
// negative.
func (p *Pool) Available() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0
	}
	return p.availableLocked()
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
	p.updateGaugesLocked()
	p.setLimitGauge(bytes)
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
		s.Available = p.availableLocked()
	}
	return s
}

// updateGaugesLocked adds this pool's changes since the last update to the
// gauges, so several pools reporting into one registry (one per rank in
// one process) sum instead of overwriting each other.
func (p *Pool) updateGaugesLocked() {
	mapped, used := p.mappedCnt, p.used
	if p.closed {
		mapped, used = 0, 0
	}
	p.m.pagesMapped.Add(float64(mapped - p.gauged.mapped))
	p.m.bytesMapped.Add(float64(mapped-p.gauged.mapped) * float64(p.pageBytes))
	p.m.blocksUsed.Add(float64(used - p.gauged.used))
	p.gauged.mapped, p.gauged.used = mapped, used
}

// setLimitGauge adds the change of this pool's limit to the limit gauge.
func (p *Pool) setLimitGauge(limit uint64) {
	p.m.limitBytes.Add(float64(limit) - float64(p.gauged.limit))
	p.gauged.limit = limit
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

// nudge wakes the refill goroutine without waiting.
func (p *Pool) nudge() {
	select {
	case p.kick <- nil:
	default:
	}
}

// settle wakes the refill goroutine and waits until it has run a full pass
// (tests use it to observe the reserve without sleeping).
func (p *Pool) settle() {
	done := make(chan struct{})
	select {
	case p.kick <- done:
	case <-p.ctx.Done():
		return
	}
	select {
	case <-done:
	case <-p.ctx.Done():
	}
}

func (p *Pool) refillLoop() {
	defer p.bg.Done()
	for {
		var done chan struct{}
		select {
		case <-p.ctx.Done():
			return
		case done = <-p.kick:
		}
		p.refill()
		if done != nil {
			close(done)
		}
	}
}

// refill maps pages one at a time until the reserve holds PreallocPages
// empty pages, the limit or the reservation is reached, or a map fails.
func (p *Pool) refill() {
	for {
		p.mu.Lock()
		if p.closed || p.empty.len()+p.refilling >= p.cfg.PreallocPages || p.newPagesAllowedLocked() == 0 {
			p.mu.Unlock()
			return
		}
		pg := p.popUnmappedLocked()
		p.refilling++
		p.mu.Unlock()
		err := p.mapBackend(p.ctx, []int{pg})
		if err == nil {
			err = p.callMapHook(p.ctx, []int{pg})
		}
		p.mu.Lock()
		p.refilling--
		if err != nil {
			if p.pages[pg].status != pageBroken {
				p.pushUnmappedLocked(pg)
			}
			p.mu.Unlock()
			if p.ctx.Err() == nil {
				p.log.Warn("vmm: refill reserve", "page", pg, "err", err)
			}
			return
		}
		p.setMappedLocked(pg)
		trim := p.trimLocked(p.cfg.PreallocPages) // the limit may have dropped meanwhile
		p.updateGaugesLocked()
		p.mu.Unlock()
		if err := p.unmapTrimmed(p.ctx, trim); err != nil {
			p.log.Warn("vmm: trim after refill", "err", err)
			return
		}
	}
}

// Close stops the refill goroutine, waits for calls in flight, unmaps and
// releases every page, frees the reservations and, when the Pool created it,
// closes the backend. The PageHook is not called. A second Close returns an
// error wrapping net.ErrClosed.
func (p *Pool) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return p.closedErr()
	}
	p.closed = true
	p.updateGaugesLocked() // a closed pool counts nothing in the shared gauges
	p.setLimitGauge(0)
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
	p.updateGaugesLocked()
	p.mu.Unlock()
	if p.ownBE {
		if err := p.be.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// idxSet is a set of page indices with O(1) add, remove and last.
type idxSet struct {
	items []int32
	pos   []int32 // index in items + 1; 0 = absent
}

func newIdxSet(n int) idxSet { return idxSet{pos: make([]int32, n)} }

func (s *idxSet) len() int  { return len(s.items) }
func (s *idxSet) last() int { return int(s.items[len(s.items)-1]) }

func (s *idxSet) add(i int) {
	if s.pos[i] != 0 {
		return
	}
	s.items = append(s.items, int32(i))
	s.pos[i] = int32(len(s.items))
}

func (s *idxSet) remove(i int) {
	at := s.pos[i] - 1
	if at < 0 {
		return
	}
	lastIdx := len(s.items) - 1
	moved := s.items[lastIdx]
	s.items[at] = moved
	s.pos[moved] = at + 1
	s.items = s.items[:lastIdx]
	s.pos[i] = 0
}
