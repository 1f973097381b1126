package localapi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/fdpass"
	"github.com/kvsidecar/kvsidecar/internal/promutil"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// Defaults of ServerConfig and ClientConfig.
const (
	// DefaultMaxRequestBytes bounds one local API request frame (1 MiB:
	// 200,000 block ids).
	DefaultMaxRequestBytes = 1 << 20
	// DefaultMaxReplyBytes bounds one reply frame (64 MiB: about three
	// million page mappings).
	DefaultMaxReplyBytes = 64 << 20
	// DefaultCallTimeout bounds the work of one call on the server.
	DefaultCallTimeout = 30 * time.Second
	// DefaultWriteTimeout bounds writing one reply to a client.
	DefaultWriteTimeout = 10 * time.Second
)

// Cache is the KV cache a Server serves, built by
// ServerConfig.Open for the first CreateKVCache.
type Cache struct {
	// Pool holds the rank's pages. Required.
	Pool *vmm.Pool
	// Rank is the rank's connector over Pool. Required.
	Rank *connector.Rank
	// Tracker sees every map and unmap of Pool (its PageHook, or the
	// TP-group follower wrapper). Required.
	Tracker *PageTracker
	// Create is the request the cache was built for; a later attach must
	// match its geometry, tp rank and size.
	Create *v1.CreateKVCache
	// EngineID is advertised in KVCacheInfo.
	EngineID string
	// DeviceMemory: the pages are CUDA memory (fds per page) rather than
	// ranges of a host memfd.
	DeviceMemory bool
	// Close releases what Open built besides Rank (the pool, the TP group,
	// the backend); called by Server after the rank drained. Optional.
	Close func() error
}

// ServerConfig configures NewServer. Path and Open are required.
type ServerConfig struct {
	// Path is the socket path (see SocketPath). Required. A stale
	// socket there is replaced; a live one is ErrSocketInUse.
	Path string
	// Open builds the KV cache for the first CreateKVCache (validated:
	// geometry present, tp_rank < tp_size). Its error is returned to the
	// engine with its code. Required.
	Open func(ctx context.Context, req *v1.CreateKVCache) (*Cache, error)
	// Geometry, when set, is used for a CreateKVCache that carries none (the
	// sidecar was started with the model's geometry). Default nil: the
	// engine must send one.
	Geometry *v1.ModelGeometry
	// MaxRequestBytes bounds a request frame. Default DefaultMaxRequestBytes.
	MaxRequestBytes int
	// MaxReplyBytes bounds a reply frame. Default DefaultMaxReplyBytes.
	MaxReplyBytes int
	// CallTimeout bounds one call's work. Default DefaultCallTimeout.
	CallTimeout time.Duration
	// WriteTimeout bounds writing one reply. Default DefaultWriteTimeout.
	WriteTimeout time.Duration
	// Logger: default discards.
	Logger *slog.Logger
	// Registerer receives kvsidecar_local_* metrics. Default none.
	Registerer prometheus.Registerer
}

func (c *ServerConfig) withDefaults() (ServerConfig, error) {
	var out ServerConfig
	if c != nil {
		out = *c
	}
	if out.MaxRequestBytes == 0 {
		out.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if out.MaxReplyBytes == 0 {
		out.MaxReplyBytes = DefaultMaxReplyBytes
	}
	if out.CallTimeout == 0 {
		out.CallTimeout = DefaultCallTimeout
	}
	if out.WriteTimeout == 0 {
		out.WriteTimeout = DefaultWriteTimeout
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	bad := func(field, format string, a ...any) (ServerConfig, error) {
		return ServerConfig{}, fmt.Errorf("%w: ServerConfig.%s: %s", ErrInvalidArgument, field, fmt.Sprintf(format, a...))
	}
	switch {
	case out.Path == "":
		return bad("Path", "required")
	case out.Open == nil:
		return bad("Open", "required")
	case out.MaxRequestBytes < 64:
		return bad("MaxRequestBytes", "%d must be at least 64", out.MaxRequestBytes)
	case out.MaxReplyBytes < 64:
		return bad("MaxReplyBytes", "%d must be at least 64", out.MaxReplyBytes)
	case out.CallTimeout < 0 || out.WriteTimeout < 0:
		return bad("CallTimeout", "CallTimeout and WriteTimeout must be positive")
	}
	return out, nil
}

// Server serves the local API (docs/engine-integration.md) of one rank on a
// unix socket: one goroutine per connection, one call at a time per
// connection. Every reply to a connection that attached the cache carries a
// MappingDelta with the fds of pages to map. Bad input gets an error reply,
// or the connection is closed when the stream cannot be resynchronized; it
// never affects other connections.
type Server struct {
	cfg ServerConfig
	ln  *net.UnixListener
	m   *serverMetrics

	ctx    context.Context
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup

	openMu sync.Mutex // serializes Open

	mu       sync.Mutex
	cache    *Cache
	conns    map[*fdpass.Conn]struct{}
	eng      *engineState
	draining bool
	closed   bool
}

// NewServer listens on cfg.Path (mode 0600; its directory must be
// owned by this user and grant nothing to group or others, or it fails with
// class CODE_INVALID_ARGUMENT) and starts accepting.
func NewServer(ctx context.Context, cfg *ServerConfig) (*Server, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m, err := newServerMetrics(c.Registerer)
	if err != nil {
		return nil, err
	}
	ln, err := unixsock.Listen(ctx, c.Path)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: c, ln: ln, m: m, conns: map[*fdpass.Conn]struct{}{}, eng: newEngineState()}
	s.ctx, s.cancel = context.WithCancelCause(context.WithoutCancel(ctx))
	s.wg.Go(s.acceptLoop)
	c.Logger.Info("local API listening", "path", c.Path)
	return s, nil
}

// Path is the socket path.
func (s *Server) Path() string { return s.cfg.Path }

// Cache returns the KV cache, nil before an engine created it.
func (s *Server) Cache() *Cache {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cache
}

// Ready reports whether the KV cache exists (and so the rank's QUIC
// listener is up) and the server is not draining, and says which condition
// holds: "KV cache attached, QUIC listener up", "no KV cache yet (no engine
// has attached with a create call)", "draining: shutting down, new requests
// are refused" or "stopped".
func (s *Server) Ready() (ok bool, why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return false, "stopped"
	case s.draining:
		return false, "draining: shutting down, new requests are refused"
	case s.cache == nil:
		return false, "no KV cache yet (no engine has attached with a create call)"
	}
	return true, "KV cache attached, QUIC listener up"
}

func (s *Server) acceptLoop() {
	for {
		uc, err := s.ln.AcceptUnix()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				s.cfg.Logger.Error("local API accept failed", "err", err)
			}
			return
		}
		c := fdpass.New(uc)
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			_ = c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.mu.Unlock()
		s.m.conns.Inc()
		s.wg.Go(func() {
			s.serveConn(c)
			s.mu.Lock()
			delete(s.conns, c)
			s.mu.Unlock()
			_ = c.Close()
			s.m.conns.Dec()
		})
	}
}

// connState is what the server knows about one connection.
type connState struct {
	attached bool
	known    map[int]uint64 // pages the engine mapped -> generation
}

func (s *Server) serveConn(c *fdpass.Conn) {
	r := wire.NewReader(c, s.cfg.MaxRequestBytes)
	st := &connState{known: map[int]uint64{}}
	defer s.detach(st)
	for {
		req := &v1.LocalRequest{}
		err := r.ReadMsg(req)
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
				return
			}
			// The stream cannot be resynchronized after a bad frame: say
			// why, then close.
			s.m.calls.WithLabelValues("bad_frame", v1.Code_CODE_INVALID_ARGUMENT.String()).Inc()
			s.cfg.Logger.Warn("local API: bad frame, closing connection", "err", err)
			s.write(c, &v1.LocalReply{Error: &v1.Error{Code: v1.Code_CODE_INVALID_ARGUMENT,
				Message: fmt.Sprintf("localapi: unreadable request frame (limit %d bytes): %v", s.cfg.MaxRequestBytes, err)}}, nil)
			return
		}
		var rep *v1.LocalReply
		if n := c.DiscardFiles(); n > 0 {
			rep = errorReply(fmt.Errorf("%w: request carried %d file descriptors; requests carry none", ErrInvalidArgument, n))
		} else {
			rep = s.handle(st, req)
		}
		rep.CallId = req.GetCallId()
		var ex *vmm.Export
		if st.attached {
			rep.Mappings, ex = s.delta(st)
		}
		var files []*os.File
		if ex != nil {
			files = ex.Files
		}
		err = s.write(c, rep, files)
		if ex != nil {
			_ = ex.Close()
		}
		if err != nil {
			s.cfg.Logger.Warn("local API: write failed, closing connection", "err", err)
			return
		}
	}
}

func (s *Server) write(c *fdpass.Conn, rep *v1.LocalReply, files []*os.File) error {
	b, err := wire.AppendFrame(nil, rep, s.cfg.MaxReplyBytes)
	if err != nil {
		return err
	}
	_ = c.Unix().SetWriteDeadline(time.Now().Add(s.cfg.WriteTimeout))
	return c.WriteWithFiles(b, files)
}

func errorReply(err error) *v1.LocalReply {
	return &v1.LocalReply{Error: codes.ToProto(err)}
}

// callNames are the calls callName names; their CODE_OK series start
// at 0.
var callNames = []string{"create", "alloc", "free", "available", "set_limit", "request_finished",
	"start_load", "get_finished", "abort", "stats", "sync"}

// callName is the bounded metric label of a request.
func callName(req *v1.LocalRequest) string {
	switch req.GetCall().(type) {
	case *v1.LocalRequest_Create:
		return "create"
	case *v1.LocalRequest_Alloc:
		return "alloc"
	case *v1.LocalRequest_Free:
		return "free"
	case *v1.LocalRequest_Available:
		return "available"
	case *v1.LocalRequest_SetLimit:
		return "set_limit"
	case *v1.LocalRequest_RequestFinished:
		return "request_finished"
	case *v1.LocalRequest_StartLoad:
		return "start_load"
	case *v1.LocalRequest_GetFinished:
		return "get_finished"
	case *v1.LocalRequest_Abort:
		return "abort"
	case *v1.LocalRequest_Stats:
		return "stats"
	case *v1.LocalRequest_Sync:
		return "sync"
	}
	return "unknown"
}

func (s *Server) handle(st *connState, req *v1.LocalRequest) *v1.LocalReply {
	name := callName(req)
	rep, err := s.dispatch(st, req)
	if err != nil {
		rep = errorReply(err)
	}
	s.m.calls.WithLabelValues(name, rep.GetError().GetCode().String()).Inc()
	return rep
}

func (s *Server) dispatch(st *connState, req *v1.LocalRequest) (*v1.LocalReply, error) {
	if v := req.GetWireVersion(); v != v1.WireVersion_WIRE_VERSION_1 {
		return nil, codes.New(v1.Code_CODE_INCOMPATIBLE_MODEL, "localapi: wire_version %v, this sidecar speaks %v", v, v1.WireVersion_WIRE_VERSION_1)
	}
	s.mu.Lock()
	draining, cache := s.draining || s.closed, s.cache
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.CallTimeout)
	defer cancel()

	switch call := req.GetCall().(type) {
	case *v1.LocalRequest_Create:
		if draining {
			return nil, fmt.Errorf("%w: local API refuses new caches", connector.ErrDraining)
		}
		return s.create(ctx, st, call.Create)
	case *v1.LocalRequest_Stats:
		return &v1.LocalReply{Result: &v1.LocalReply_Stats{Stats: statsOf(cache)}}, nil
	case nil:
		return nil, fmt.Errorf("%w: unknown call (no call set, or a call this sidecar does not know)", ErrInvalidArgument)
	}
	if cache == nil {
		return nil, fmt.Errorf("%w: call %s needs the KV cache; an engine must send create first", ErrNotAttached, callName(req))
	}
	switch call := req.GetCall().(type) {
	case *v1.LocalRequest_Available:
		return &v1.LocalReply{Result: &v1.LocalReply_Available{Available: &v1.AvailableReply{Blocks: uint64(cache.Pool.Available())}}}, nil
	case *v1.LocalRequest_SetLimit:
		return &v1.LocalReply{}, setLimit(cache, call.SetLimit)
	}
	if !st.attached {
		return nil, fmt.Errorf("%w: call %s on a connection that did not send create", ErrNotAttached, callName(req))
	}
	if draining {
		switch req.GetCall().(type) {
		case *v1.LocalRequest_Alloc, *v1.LocalRequest_RequestFinished, *v1.LocalRequest_StartLoad:
			return nil, fmt.Errorf("%w: %s refused while shutting down", connector.ErrDraining, callName(req))
		}
	}
	pool, rank := cache.Pool, cache.Rank
	session := s.eng.current()
	ctx = connector.WithSession(ctx, session)
	// Under coordinated ownership ranks 1..N-1 allocate nothing (rank 0
	// does, for every rank): their engine's block ids are checked by the
	// Rank against the pages rank 0 mapped here.
	follower := cache.Create.GetOwnership() == v1.Ownership_OWNERSHIP_COORDINATED && cache.Create.GetTpRank() != 0
	switch call := req.GetCall().(type) {
	case *v1.LocalRequest_Alloc:
		n := call.Alloc.GetCount()
		if n == 0 || int(n) >= pool.NumBlocks() {
			return nil, fmt.Errorf("%w: alloc count %d must be in [1, %d)", ErrInvalidArgument, n, pool.NumBlocks())
		}
		ids, err := pool.Alloc(ctx, int(n))
		if err != nil {
			return nil, err
		}
		s.eng.addBlocks(ids)
		out := make([]uint32, len(ids))
		for i, id := range ids {
			out[i] = uint32(id)
		}
		return &v1.LocalReply{Result: &v1.LocalReply_Alloc{Alloc: &v1.AllocBlocksReply{BlockIds: out}}}, nil
	case *v1.LocalRequest_Free:
		if err := s.eng.checkOwned("block_ids", call.Free.GetBlockIds(), pool.NumBlocks()); err != nil && !follower {
			return nil, err
		}
		ids := blockInts(call.Free.GetBlockIds())
		if err := rank.FreeBlocks(ctx, ids); err != nil {
			return nil, err
		}
		s.eng.freed(ids)
		return &v1.LocalReply{}, nil
	case *v1.LocalRequest_RequestFinished:
		rf := call.RequestFinished
		if err := s.eng.checkOwned("block_ids", rf.GetBlockIds(), pool.NumBlocks()); err != nil && !follower {
			return nil, err
		}
		p, err := rank.RequestFinished(ctx, rf.GetRequestId(), rf.GetBlockIds(), rf.GetStatus(), rf.GetParams())
		if err != nil {
			return nil, err
		}
		if cache.Create.GetOwnership() != v1.Ownership_OWNERSHIP_COORDINATED {
			// The Rank took the blocks over and frees them itself.
			s.eng.takeOver(blockInts(rf.GetBlockIds()))
		}
		return &v1.LocalReply{Result: &v1.LocalReply_RequestFinished{RequestFinished: &v1.RequestFinishedReply{Params: p, DelayFree: p != nil}}}, nil
	case *v1.LocalRequest_StartLoad:
		if err := rank.StartLoad(ctx, call.StartLoad.GetMeta()); err != nil {
			return nil, err
		}
		s.eng.addLoad(call.StartLoad.GetMeta().GetRequestId())
		return &v1.LocalReply{}, nil
	case *v1.LocalRequest_GetFinished:
		f := rank.TakeSession(session)
		s.eng.removeLoads(f.DoneRecving...)
		for _, fl := range f.Failed {
			s.eng.removeLoads(fl.RequestID)
		}
		return &v1.LocalReply{Result: &v1.LocalReply_GetFinished{GetFinished: finishedProto(f)}}, nil
	case *v1.LocalRequest_Abort:
		if call.Abort.GetRequestId() == "" {
			return nil, fmt.Errorf("%w: abort: request_id is empty", ErrInvalidArgument)
		}
		if err := rank.Abort(ctx, call.Abort.GetRequestId()); err != nil {
			return nil, err
		}
		s.eng.removeLoads(call.Abort.GetRequestId())
		return &v1.LocalReply{}, nil
	case *v1.LocalRequest_Sync:
		return &v1.LocalReply{}, nil
	}
	return nil, fmt.Errorf("%w: unknown call %T", ErrInvalidArgument, req.GetCall())
}

// create builds the cache on the first call and attaches the connection.
func (s *Server) create(ctx context.Context, st *connState, req *v1.CreateKVCache) (*v1.LocalReply, error) {
	if req.GetGeometry() == nil && s.cfg.Geometry != nil {
		req = proto.Clone(req).(*v1.CreateKVCache)
		req.Geometry = proto.Clone(s.cfg.Geometry).(*v1.ModelGeometry)
	}
	switch {
	case req.GetGeometry() == nil:
		return nil, fmt.Errorf("%w: create: geometry is required (the sidecar was started without --model or an explicit geometry)", ErrInvalidArgument)
	case req.GetTpSize() < 1 || req.GetTpSize() > connector.MaxTPSize:
		return nil, fmt.Errorf("%w: create: tp_size %d must be in [1, %d]", ErrInvalidArgument, req.GetTpSize(), connector.MaxTPSize)
	case req.GetTpRank() >= req.GetTpSize():
		return nil, fmt.Errorf("%w: create: tp_rank %d must be in [0, tp_size=%d)", ErrInvalidArgument, req.GetTpRank(), req.GetTpSize())
	}
	s.openMu.Lock()
	defer s.openMu.Unlock()
	cache := s.Cache()
	if cache == nil {
		c, err := s.cfg.Open(ctx, req)
		if err != nil {
			return nil, err
		}
		s.mu.Lock()
		if s.draining || s.closed {
			s.mu.Unlock()
			_ = c.Rank.Close() // its agent and goroutines, like Close does
			_ = closeCache(c)
			return nil, fmt.Errorf("%w: local API refuses new caches", connector.ErrDraining)
		}
		s.cache, cache = c, c
		s.mu.Unlock()
		s.cfg.Logger.Info("KV cache created", "model", req.GetGeometry().GetModel(), "tp_rank", req.GetTpRank(),
			"tp_size", req.GetTpSize(), "num_blocks", c.Pool.NumBlocks())
	} else if err := sameCache(cache.Create, req); err != nil {
		return nil, err
	}
	if !st.attached {
		st.attached = true
		if id, started := s.eng.attach(); started {
			cache.Rank.BeginSession(id)
			s.cfg.Logger.Info("engine session started", "session", id)
		}
	}
	return &v1.LocalReply{Result: &v1.LocalReply_Cache{Cache: cacheInfo(cache)}}, nil
}

// detach runs when a connection ends. When it was the last connection
// attached to the cache, the engine session ends: every load it started is
// aborted (Rank.Abort returns once the READ stopped) and the blocks it
// allocated and still owns are freed. Blocks held under a prefill lease are
// refused (connector.ErrBusy) and skipped: under local ownership the Rank frees them
// when the lease ends. The session's results that no GetFinished took (and
// those that arrive later, such as a lease released afterwards) are logged
// once and dropped: the next engine never sees them. Nothing is freed while
// the server closes (Close closes the rank and the pool).
func (s *Server) detach(st *connState) {
	if !st.attached {
		return
	}
	session, blocks, loads, last := s.eng.detach()
	if !last {
		return
	}
	s.mu.Lock()
	closed, cache := s.closed, s.cache
	s.mu.Unlock()
	if cache == nil {
		return
	}
	defer func() {
		if f := cache.Rank.EndSession(session); len(f.RequestIDs()) > 0 {
			s.cfg.Logger.Info("engine session ended: dropped its results no GetFinished took", "session", session,
				"done_sending", len(f.DoneSending), "done_recving", len(f.DoneRecving), "failed", len(f.Failed), "request_ids", f.RequestIDs())
		}
	}()
	if closed || (len(blocks) == 0 && len(loads) == 0) {
		return
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.CallTimeout)
	defer cancel()
	log := s.cfg.Logger
	aborted := 0
	for _, id := range loads {
		if err := cache.Rank.Abort(ctx, id); err != nil {
			log.Error("engine gone: aborting its load failed", "request_id", id, "err", err)
			continue
		}
		aborted++
	}
	freed, leased, failed := s.freeAll(ctx, cache.Rank, blocks)
	log.Info("engine gone: released its state", "loads_aborted", aborted, "blocks_freed", freed,
		"blocks_leased_skipped", leased, "blocks_free_failed", failed)
}

// freeAll frees blocks through rank, all at once when it can, else one by
// one, and counts the blocks freed, refused as busy (leased) and failed.
func (s *Server) freeAll(ctx context.Context, rank *connector.Rank, blocks []int) (freed, busy, failed int) {
	if len(blocks) == 0 {
		return 0, 0, 0
	}
	if err := rank.FreeBlocks(ctx, blocks); err == nil {
		return len(blocks), 0, 0
	}
	for _, b := range blocks {
		err := rank.FreeBlocks(ctx, []int{b})
		switch {
		case err == nil:
			freed++
		case errors.Is(err, connector.ErrBusy):
			busy++
		default:
			failed++
			s.cfg.Logger.Error("engine gone: freeing its block failed", "block", b, "err", err)
		}
	}
	return freed, busy, failed
}

func blockInts(ids []uint32) []int {
	out := make([]int, len(ids))
	for i, id := range ids {
		out[i] = int(id)
	}
	return out
}

// sameCache checks that an attach asks for the cache that exists.
func sameCache(have, want *v1.CreateKVCache) error {
	diff := func(field string, h, w any) error {
		return codes.New(v1.Code_CODE_ALREADY_EXISTS, "localapi: a KV cache with %s=%v exists; this engine asks for %v", field, h, w)
	}
	switch {
	case !proto.Equal(have.GetGeometry(), want.GetGeometry()):
		return diff("geometry", have.GetGeometry(), want.GetGeometry())
	case have.GetTpRank() != want.GetTpRank():
		return diff("tp_rank", have.GetTpRank(), want.GetTpRank())
	case have.GetTpSize() != want.GetTpSize():
		return diff("tp_size", have.GetTpSize(), want.GetTpSize())
	case want.GetNumBlocks() != 0 && want.GetNumBlocks() != have.GetNumBlocks():
		return diff("num_blocks", have.GetNumBlocks(), want.GetNumBlocks())
	case want.GetOwnership() != v1.Ownership_OWNERSHIP_UNSPECIFIED && want.GetOwnership() != have.GetOwnership():
		return diff("ownership", have.GetOwnership(), want.GetOwnership())
	}
	return nil
}

func cacheInfo(c *Cache) *v1.KVCacheInfo {
	regs := c.Pool.Regions()
	layout := c.Pool.Layout()
	return &v1.KVCacheInfo{
		Geometry: c.Create.GetGeometry(), TpRank: c.Create.GetTpRank(), TpSize: c.Create.GetTpSize(),
		NumBlocks: uint32(c.Pool.NumBlocks()), HeadsPerRank: uint32(layout.HeadsPerRank),
		BlockLen: regs[0].BlockLen, RegionLen: regs[0].Len, NumRegions: uint32(len(regs)),
		PageSize: c.Pool.PageSize(), EngineId: c.EngineID, DeviceMemory: c.DeviceMemory,
		Ownership: c.Create.GetOwnership(),
	}
}

func statsOf(c *Cache) *v1.StatsReply {
	if c == nil {
		return &v1.StatsReply{}
	}
	ps := c.Pool.Stats()
	rs := c.Rank.Stats()
	regs := c.Pool.Regions()
	var reserved uint64
	for _, r := range regs {
		reserved += r.Len
	}
	return &v1.StatsReply{
		PagesMapped: uint64(ps.PagesMapped), BytesMapped: ps.BytesMapped, BlocksUsed: uint64(ps.BlocksUsed),
		BlocksTotal: uint64(ps.BlocksTotal), MemoryLimitBytes: ps.MemoryLimit, LeasesHeld: uint64(rs.LeasesHeld),
		LoadsInFlight: uint64(rs.LoadsInFlight), DeviceBytes: reserved, ReservePages: uint64(ps.ReservePages),
		ReservationBytes: reserved, PageSize: ps.PageSize, NumRegions: uint64(ps.NumRegions), CacheReady: true,
	}
}

// setLimit applies a memory limit: 0 (none) or [one page of every region,
// the reservation]; with strict, not below the pages that hold allocated
// blocks.
func setLimit(c *Cache, req *v1.SetMemoryLimit) error {
	ps := c.Pool.Stats()
	pageBytes := ps.PageSize * uint64(ps.NumRegions)
	reserved := uint64(ps.Pages) * pageBytes
	b := req.GetBytes()
	if b != 0 && (b < pageBytes || b > reserved) {
		return fmt.Errorf("%w: memory limit %d bytes outside the accepted range [%d, %d] (one page of every region up to the reservation; 0 = no limit)",
			ErrInvalidArgument, b, pageBytes, reserved)
	}
	if inUse := uint64(ps.PagesMapped-ps.ReservePages) * pageBytes; req.GetStrict() && b != 0 && b < inUse {
		return fmt.Errorf("%w: memory limit %d bytes is below the %d bytes in use (strict): accepted range [%d, %d]",
			ErrInvalidArgument, b, inUse, inUse, reserved)
	}
	return c.Pool.SetMemoryLimit(b)
}

func finishedProto(f connector.Finished) *v1.GetFinishedReply {
	out := &v1.GetFinishedReply{DoneSending: f.DoneSending, DoneRecving: f.DoneRecving}
	for _, fl := range f.Failed {
		fr := &v1.FailedRequest{RequestId: fl.RequestID, Error: codes.ToProto(fl.Err)}
		for _, b := range fl.BlockIDs {
			fr.BlockIds = append(fr.BlockIds, uint32(b))
			out.InvalidBlockIds = append(out.InvalidBlockIds, uint32(b))
		}
		out.Failed = append(out.Failed, fr)
	}
	slices.Sort(out.InvalidBlockIds)
	out.InvalidBlockIds = slices.Compact(out.InvalidBlockIds)
	return out
}

// delta computes what the connection must map and unmap to match the pool,
// and exports the pages to map. A page unmapped while exporting is dropped
// (and reported unmapped if the engine had it); the next reply catches up.
func (s *Server) delta(st *connState) (*v1.MappingDelta, *vmm.Export) {
	cache := s.Cache()
	if cache == nil {
		return nil, nil
	}
	snap := cache.Tracker.Snapshot()
	var want []int
	for pg, g := range snap {
		if st.known[pg] != g {
			want = append(want, pg)
		}
	}
	d := &v1.MappingDelta{}
	for pg := range st.known {
		if _, ok := snap[pg]; !ok {
			d.UnmappedPages = append(d.UnmappedPages, uint32(pg))
			delete(st.known, pg)
		}
	}
	slices.Sort(want)
	var ex *vmm.Export
	for len(want) > 0 {
		var err error
		ex, err = cache.Pool.Export(want)
		if err == nil {
			break
		}
		var pe *vmm.PageError
		if !errors.As(err, &pe) || !slices.Contains(want, pe.Page) {
			s.cfg.Logger.Error("local API: export failed", "pages", len(want), "err", err)
			want = nil
			break
		}
		want = slices.DeleteFunc(want, func(p int) bool { return p == pe.Page })
		if _, had := st.known[pe.Page]; had {
			d.UnmappedPages = append(d.UnmappedPages, uint32(pe.Page))
			delete(st.known, pe.Page)
		}
	}
	if ex != nil {
		for _, m := range ex.Mappings {
			d.Map = append(d.Map, m.Proto())
		}
		d.NumFds = uint32(len(ex.Files))
		for _, pg := range want {
			st.known[pg] = snap[pg]
		}
	}
	slices.Sort(d.UnmappedPages)
	if len(d.Map) == 0 && len(d.UnmappedPages) == 0 {
		return nil, ex
	}
	return d, ex
}

// Shutdown refuses new requests (create, alloc, RequestFinished and
// StartLoad get CODE_UNAVAILABLE; frees, GetFinished and stats keep
// working), drains the rank (loads in flight finish or are aborted when ctx
// ends; leases are released), then closes: listener, connections, cache.
// The socket file is removed.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.draining = true
	cache := s.cache
	s.mu.Unlock()
	var err error
	if cache != nil {
		if derr := cache.Rank.Drain(ctx); derr != nil && !errors.Is(derr, net.ErrClosed) {
			err = derr
		}
	}
	return errors.Join(err, s.Close())
}

// Close stops accepting, closes every connection, waits for their
// goroutines, closes the rank and the cache and removes the socket. A second
// Close returns an error wrapping net.ErrClosed.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return fmt.Errorf("localapi: server: %w", net.ErrClosed)
	}
	s.closed = true
	conns := make([]*fdpass.Conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	cache := s.cache
	s.mu.Unlock()
	s.cancel(fmt.Errorf("%w: local server closed", connector.ErrDraining))
	err := s.ln.Close()
	for _, c := range conns {
		_ = c.Unix().Close()
	}
	s.wg.Wait()
	if cache != nil {
		if rerr := cache.Rank.Close(); rerr != nil && !errors.Is(rerr, net.ErrClosed) {
			err = errors.Join(err, rerr)
		}
		err = errors.Join(err, closeCache(cache))
	}
	s.cfg.Logger.Info("local API closed", "path", s.cfg.Path)
	return err
}

func closeCache(c *Cache) error {
	if c.Close == nil {
		return nil
	}
	return c.Close()
}

type serverMetrics struct {
	calls *prometheus.CounterVec
	conns prometheus.Gauge
}

func newServerMetrics(reg prometheus.Registerer) (*serverMetrics, error) {
	m := &serverMetrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsidecar_local_calls_total",
			Help: "Local API calls by call name and reply code.",
		}, []string{"call", "code"}),
		conns: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvsidecar_local_connections",
			Help: "Open local API connections.",
		}),
	}
	for _, call := range callNames {
		m.calls.WithLabelValues(call, v1.Code_CODE_OK.String())
	}
	for _, err := range []error{promutil.Register(reg, &m.calls), promutil.Register(reg, &m.conns)} {
		if err != nil {
			return nil, err
		}
	}
	return m, nil
}
