package localapi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/fdpass"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// ClientConfig configures Dial. A nil *ClientConfig is the
// zero value.
type ClientConfig struct {
	// MaxReplyBytes bounds a reply frame. Default DefaultMaxReplyBytes.
	MaxReplyBytes int
	// Logger: default discards.
	Logger *slog.Logger
	// DeviceImporter maps the pages of a sidecar whose KV cache is device
	// memory (--backend cuda): pass the *cuda.Backend (vmm/cuda) of the
	// engine's device. Default nil: Attach to such a sidecar fails with an
	// error wrapping errors.ErrUnsupported.
	DeviceImporter DeviceImporter
}

// Client is an engine's (or an operator tool's) connection to its
// sidecar's local API. After Attach it maps the sidecar's pages into its own
// reservation (one PROT_NONE range per region; each passed memfd range
// mapped MAP_FIXED|MAP_SHARED at its region offset), so Region and Block
// address the same physical memory as the sidecar. Device memory (CUDA) is
// imported instead through ClientConfig.DeviceImporter into device
// reservations: BlockAddr, ReadBlock and WriteBlock address it. Every reply
// brings the pages mapped and unmapped since the previous one, so a mapping
// of a page the sidecar released never outlives the next call. Calls are serialized;
// safe for concurrent use.
type Client struct {
	cfg  ClientConfig
	conn *fdpass.Conn
	r    *wire.Reader

	mu     sync.Mutex // one call at a time
	nextID uint64
	broken error

	mapMu   sync.RWMutex
	info    *v1.KVCacheInfo
	regions [][]byte   // host reservations, one per region
	dev     *deviceMap // device memory instead of regions
	mapped  [][]bool   // [region][page]
	closed  bool
}

// Dial connects to the local API socket at path.
func Dial(ctx context.Context, path string, cfg *ClientConfig) (*Client, error) {
	var c ClientConfig
	if cfg != nil {
		c = *cfg
	}
	if c.MaxReplyBytes == 0 {
		c.MaxReplyBytes = DefaultMaxReplyBytes
	}
	if c.MaxReplyBytes < 64 {
		return nil, fmt.Errorf("%w: ClientConfig.MaxReplyBytes %d must be at least 64", ErrInvalidArgument, c.MaxReplyBytes)
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, fmt.Errorf("localapi: client: dial %s: %w", path, err)
	}
	fc := fdpass.New(nc.(*net.UnixConn))
	return &Client{cfg: c, conn: fc, r: wire.NewReader(fc, c.MaxReplyBytes)}, nil
}

// call sends req and waits for its reply; it applies the reply's
// MappingDelta, then returns the reply's error (a *codes.Error carrying the
// sidecar's code) or the reply. A request that cannot be encoded (a string
// that is not UTF-8, a frame over the limit) is not sent: it is
// ErrInvalidArgument naming the field, and the connection stays usable.
func (c *Client) call(ctx context.Context, req *v1.LocalRequest) (*v1.LocalReply, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken != nil {
		return nil, fmt.Errorf("%w: %w", ErrBrokenConn, c.broken)
	}
	if err := ctx.Err(); err != nil {
		return nil, context.Cause(ctx)
	}
	c.nextID++
	req.WireVersion = v1.WireVersion_WIRE_VERSION_1
	req.CallId = c.nextID
	frame, err := requestFrame(req)
	if err != nil {
		return nil, err
	}
	rep, err := c.exchange(ctx, frame, req.GetCallId())
	if err != nil {
		// The socket deadline is ctx's: when it fired, ctx is done or about
		// to be (its timer may run a moment later), and its cause says what
		// timed out better than "i/o timeout".
		if dl, ok := ctx.Deadline(); ctx.Err() != nil || ok && !time.Now().Before(dl) {
			<-ctx.Done()
			err = context.Cause(ctx)
		}
		c.broken = err
		return nil, err
	}
	if err := c.apply(rep.GetMappings()); err != nil {
		c.broken = err
		return nil, err
	}
	if e := rep.GetError(); e.GetCode() != v1.Code_CODE_OK {
		return nil, codes.FromProto("kvsidecar", e)
	}
	return rep, nil
}

// requestFrame encodes req. A request that cannot be encoded is not sent:
// its error is ErrInvalidArgument naming the field, and the connection is
// untouched.
func requestFrame(req *v1.LocalRequest) ([]byte, error) {
	frame, err := wire.AppendFrame(nil, req, DefaultMaxRequestBytes)
	if err != nil {
		return nil, fmt.Errorf("%w: localapi: client: request not sent: %w", ErrInvalidArgument, err)
	}
	return frame, nil
}

// exchange writes the frame of call id and reads its reply.
func (c *Client) exchange(ctx context.Context, frame []byte, id uint64) (*v1.LocalReply, error) {
	uc := c.conn.Unix()
	dl, _ := ctx.Deadline()
	_ = uc.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { _ = uc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if _, err := uc.Write(frame); err != nil {
		return nil, fmt.Errorf("localapi: client: send: wire: write frame: %w", err)
	}
	rep := &v1.LocalReply{}
	if err := c.r.ReadMsg(rep); err != nil {
		return nil, fmt.Errorf("localapi: client: reply: %w", err)
	}
	if rep.GetCallId() != id {
		return nil, fmt.Errorf("localapi: client: reply for call %d, want %d", rep.GetCallId(), id)
	}
	return rep, nil
}

// apply maps and unmaps what d says; d's fds are closed after.
func (c *Client) apply(d *v1.MappingDelta) error {
	if d == nil {
		return nil
	}
	files, err := c.conn.TakeFiles(int(d.GetNumFds()))
	if err != nil {
		return fmt.Errorf("localapi: client: %w", err)
	}
	defer func() {
		for _, f := range files {
			_ = f.Close()
		}
	}()
	c.mapMu.Lock()
	defer c.mapMu.Unlock()
	if c.info == nil {
		return fmt.Errorf("localapi: client: mappings before attach")
	}
	ps := c.info.GetPageSize()
	for _, pg := range d.GetUnmappedPages() {
		if int(pg) >= len(c.mapped[0]) {
			return fmt.Errorf("localapi: client: unmapped page %d outside [0, %d)", pg, len(c.mapped[0]))
		}
		for r := range c.mapped {
			var err error
			if c.dev != nil {
				err = c.dev.unmap(r, uint64(pg))
			} else {
				err = c.protNone(r, uint64(pg)*ps, ps)
			}
			if err != nil {
				return err
			}
			c.mapped[r][pg] = false
		}
	}
	for _, m := range d.GetMap() {
		r, off, n := int(m.GetRegion()), m.GetRegionOffset(), m.GetLen()
		switch {
		case r >= len(c.mapped):
			return fmt.Errorf("localapi: client: mapping of region %d outside [0, %d)", r, len(c.mapped))
		case n == 0 || off%ps != 0 || n%ps != 0 || off+n < off || off+n > c.info.GetRegionLen():
			return fmt.Errorf("localapi: client: mapping [%d, +%d) of region %d is not whole pages of %d inside %d bytes",
				off, n, r, ps, c.info.GetRegionLen())
		case int(m.GetFdIndex()) >= len(files):
			return fmt.Errorf("localapi: client: fd_index %d outside the %d passed fds", m.GetFdIndex(), len(files))
		}
		f := files[m.GetFdIndex()]
		if c.dev != nil {
			if err := c.dev.mapPage(r, off, n, f, m.GetFdOffset()); err != nil {
				return err
			}
			c.mapped[r][off/ps] = true
			continue
		}
		addr := unsafe.Pointer(&c.regions[r][off])
		if _, err := unix.MmapPtr(int(f.Fd()), int64(m.GetFdOffset()), addr, uintptr(n),
			unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
			return fmt.Errorf("localapi: client: mmap region %d [%d, +%d) at fd offset %d: %w", r, off, n, m.GetFdOffset(), err)
		}
		for pg := off / ps; pg < (off+n)/ps; pg++ {
			c.mapped[r][pg] = true
		}
	}
	return nil
}

// protNone returns [off, off+n) of region r to an inaccessible anonymous
// mapping, dropping whatever shared page was there.
func (c *Client) protNone(r int, off, n uint64) error {
	addr := unsafe.Pointer(&c.regions[r][off])
	if _, err := unix.MmapPtr(-1, 0, addr, uintptr(n), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED|unix.MAP_NORESERVE); err != nil {
		return fmt.Errorf("localapi: client: unmap region %d [%d, +%d): %w", r, off, n, err)
	}
	return nil
}

// Attach creates the sidecar's KV cache (or attaches to the existing one,
// which must have the same geometry, tp rank and size: CODE_ALREADY_EXISTS
// otherwise), reserves the regions in this process and maps every page
// the sidecar has mapped. Device memory (CUDA) is imported through
// ClientConfig.DeviceImporter; without one it is refused with an error
// wrapping errors.ErrUnsupported.
func (c *Client) Attach(ctx context.Context, req *v1.CreateKVCache) (*v1.KVCacheInfo, error) {
	c.mapMu.RLock()
	attached := c.info != nil
	c.mapMu.RUnlock()
	if attached {
		return nil, fmt.Errorf("%w: client already attached", ErrInvalidArgument)
	}
	// The reply's mappings need the reservation, which needs the reply:
	// attach, reserve, then apply (call applies after reserving through
	// the hook below).
	c.mu.Lock()
	if c.broken != nil {
		c.mu.Unlock()
		return nil, fmt.Errorf("%w: %w", ErrBrokenConn, c.broken)
	}
	c.nextID++
	r := &v1.LocalRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, CallId: c.nextID, Call: &v1.LocalRequest_Create{Create: req}}
	frame, err := requestFrame(r)
	if err != nil {
		c.mu.Unlock()
		return nil, err
	}
	rep, err := c.exchange(ctx, frame, r.GetCallId())
	if err != nil {
		if ctx.Err() != nil {
			err = context.Cause(ctx)
		}
		c.broken = err
		c.mu.Unlock()
		return nil, err
	}
	defer c.mu.Unlock()
	if e := rep.GetError(); e.GetCode() != v1.Code_CODE_OK {
		return nil, codes.FromProto("kvsidecar", e)
	}
	info := rep.GetCache()
	if err := c.reserve(info); err != nil {
		c.broken = err
		// Close the fds of the delta we cannot use.
		if files, ferr := c.conn.TakeFiles(int(rep.GetMappings().GetNumFds())); ferr == nil {
			for _, f := range files {
				_ = f.Close()
			}
		}
		return nil, err
	}
	if err := c.apply(rep.GetMappings()); err != nil {
		c.broken = err
		return nil, err
	}
	return info, nil
}

func (c *Client) reserve(info *v1.KVCacheInfo) error {
	ps, rl, nr := info.GetPageSize(), info.GetRegionLen(), info.GetNumRegions()
	switch {
	case info.GetDeviceMemory() && c.cfg.DeviceImporter == nil:
		return fmt.Errorf("localapi: client: the sidecar's pages are device memory; set ClientConfig.DeviceImporter (vmm/cuda's Backend) to import their POSIX fds: %w", errors.ErrUnsupported)
	case ps == 0 || ps%uint64(os.Getpagesize()) != 0 || rl == 0 || rl%ps != 0 || nr == 0 || info.GetBlockLen() == 0 || info.GetBlockLen() > ps:
		return fmt.Errorf("localapi: client: cache info page_size=%d region_len=%d num_regions=%d block_len=%d is not a usable layout",
			ps, rl, nr, info.GetBlockLen())
	}
	c.mapMu.Lock()
	defer c.mapMu.Unlock()
	if info.GetDeviceMemory() {
		d, err := newDeviceMap(c.cfg.DeviceImporter, int(nr), ps, rl)
		if err != nil {
			return err
		}
		c.dev, c.mapped, c.info = d, make([][]bool, nr), info
		for r := range c.mapped {
			c.mapped[r] = make([]bool, rl/ps)
		}
		return nil
	}
	for range nr {
		b, err := unix.Mmap(-1, 0, int(rl), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
		if err != nil {
			c.unreserveLocked()
			return fmt.Errorf("localapi: client: reserve %d bytes: %w", rl, err)
		}
		c.regions = append(c.regions, b)
		c.mapped = append(c.mapped, make([]bool, rl/ps))
	}
	c.info = info
	return nil
}

func (c *Client) unreserveLocked() {
	for _, b := range c.regions {
		_ = unix.Munmap(b)
	}
	if c.dev != nil {
		if err := c.dev.close(); err != nil {
			c.cfg.Logger.Warn("localapi client: unmap device pages", "err", err)
		}
	}
	c.regions, c.dev, c.mapped, c.info = nil, nil, nil, nil
}

// Info returns the attached cache's description (nil before Attach).
func (c *Client) Info() *v1.KVCacheInfo {
	c.mapMu.RLock()
	defer c.mapMu.RUnlock()
	return c.info
}

// Region returns region i's whole reservation in this process. Only pages
// that are mapped may be touched (the rest fault); use Block for checked
// access. Nil before Attach, for i out of range and for device memory.
func (c *Client) Region(i int) []byte {
	c.mapMu.RLock()
	defer c.mapMu.RUnlock()
	if i < 0 || i >= len(c.regions) {
		return nil
	}
	return c.regions[i]
}

// BlockOffset returns the byte offset of block b in every region (blocks
// never straddle a page).
func (c *Client) BlockOffset(b int) uint64 {
	c.mapMu.RLock()
	defer c.mapMu.RUnlock()
	return c.blockOffsetLocked(b)
}

func (c *Client) blockOffsetLocked(b int) uint64 {
	return kvgeom.Packing{BlockLen: c.info.GetBlockLen(), PageSize: c.info.GetPageSize()}.Offset(kvgeom.BlockID(b))
}

// Block returns block b of region as a slice of this process's mapping of
// the shared page. Errors (ErrInvalidArgument): not attached, region or
// block out of range, or the page not mapped here (the block is not
// allocated; Sync first if it was allocated through another connection);
// ErrDeviceMemory when the cache is device memory. The slice stays valid
// while the block stays allocated.
func (c *Client) Block(region, b int) ([]byte, error) {
	c.mapMu.RLock()
	defer c.mapMu.RUnlock()
	if c.dev != nil {
		return nil, fmt.Errorf("block %d of region %d: %w; use ReadBlock, WriteBlock or BlockAddr", b, region, ErrDeviceMemory)
	}
	off, err := c.blockLocked(region, b)
	if err != nil {
		return nil, err
	}
	bl := c.info.GetBlockLen()
	return c.regions[region][off : off+bl : off+bl], nil
}

// Alloc allocates n blocks; the pages they need are mapped here before it
// returns. Over the memory limit: a *codes.Error with CODE_BUSY.
func (c *Client) Alloc(ctx context.Context, n int) ([]uint32, error) {
	if n < 1 || n > 1<<31 {
		return nil, fmt.Errorf("%w: alloc count %d must be at least 1", ErrInvalidArgument, n)
	}
	rep, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_Alloc{Alloc: &v1.AllocBlocks{Count: uint32(n)}}})
	if err != nil {
		return nil, err
	}
	return rep.GetAlloc().GetBlockIds(), nil
}

// Free frees blocks; pages the sidecar unmapped are unmapped here before it
// returns.
func (c *Client) Free(ctx context.Context, ids []uint32) error {
	_, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_Free{Free: &v1.FreeBlocks{BlockIds: ids}}})
	return err
}

// Available returns the blocks the sidecar could allocate now.
func (c *Client) Available(ctx context.Context) (uint64, error) {
	rep, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_Available{Available: true}})
	return rep.GetAvailable().GetBlocks(), err
}

// SetMemoryLimit sets the limit on mapped bytes (0 = none). With strict, a
// limit below what is in use is refused.
func (c *Client) SetMemoryLimit(ctx context.Context, bytes uint64, strict bool) error {
	_, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_SetLimit{SetLimit: &v1.SetMemoryLimit{Bytes: bytes, Strict: strict}}})
	return err
}

// RequestFinished is Rank.RequestFinished through the sidecar: params for
// decode when the blocks are held under a lease, nil when freed at once.
func (c *Client) RequestFinished(ctx context.Context, requestID string, blockIDs []uint32, status v1.FinishStatus, in *v1.KVTransferParams) (*v1.KVTransferParams, error) {
	rep, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_RequestFinished{RequestFinished: &v1.RequestFinished{
		RequestId: requestID, BlockIds: blockIDs, Status: status, Params: in}}})
	if err != nil {
		return nil, err
	}
	return rep.GetRequestFinished().GetParams(), nil
}

// StartLoad is Rank.StartLoad through the sidecar.
func (c *Client) StartLoad(ctx context.Context, meta *v1.ReqMeta) error {
	_, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_StartLoad{StartLoad: &v1.StartLoad{Meta: meta}}})
	return err
}

// GetFinished returns, and the sidecar forgets, what finished since the
// last call.
func (c *Client) GetFinished(ctx context.Context) (*v1.GetFinishedReply, error) {
	rep, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_GetFinished{GetFinished: &v1.GetFinished{}}})
	if err != nil {
		return nil, err
	}
	return rep.GetGetFinished(), nil
}

// Abort stops a load; it returns after the READ stopped.
func (c *Client) Abort(ctx context.Context, requestID string) error {
	_, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_Abort{Abort: &v1.Abort{RequestId: requestID}}})
	return err
}

// Stats returns the sidecar's pool and connector counters (cache_ready
// false before any engine created the cache).
func (c *Client) Stats(ctx context.Context) (*v1.StatsReply, error) {
	rep, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_Stats{Stats: &v1.Stats{}}})
	if err != nil {
		return nil, err
	}
	return rep.GetStats(), nil
}

// Sync brings this process's mappings up to date without doing anything
// else (after another connection allocated, or the limit trimmed pages).
func (c *Client) Sync(ctx context.Context) error {
	_, err := c.call(ctx, &v1.LocalRequest{Call: &v1.LocalRequest_Sync{Sync: true}})
	return err
}

// Close closes the connection and unmaps every region. Slices from Region
// and Block must not be used after. A second Close returns an error
// wrapping net.ErrClosed.
func (c *Client) Close() error {
	c.mapMu.Lock()
	if c.closed {
		c.mapMu.Unlock()
		return fmt.Errorf("localapi: client: %w", net.ErrClosed)
	}
	c.closed = true
	c.unreserveLocked()
	c.mapMu.Unlock()
	return c.conn.Close()
}
