package localapi

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"

	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// The engine lifecycle: the first create builds the cache, every create
// attaches its connection, and the engine session runs from the first attach
// until the last attached connection closes, when what the engine left
// behind (its loads, the blocks it still owns) is released.

// create builds the cache on the first call and attaches the connection.
// A refused create is logged (the engine usually stops on it, and the
// sidecar's log should say why without the engine's).
func (s *Server) create(c *call) (rep *v1.LocalReply, err error) {
	defer func() {
		if err != nil {
			s.cfg.Logger.Warn("engine attach refused", "code", codes.Of(err).String(), "err", err)
		}
	}()
	if c.draining {
		return nil, fmt.Errorf("%w: local API refuses new caches", connector.ErrDraining)
	}
	ctx, st, req := c.ctx, c.st, c.req.GetCreate()
	if req.GetGeometry() == nil && s.cfg.Geometry != nil {
		req = proto.Clone(req).(*v1.CreateKVCache)
		req.Geometry = proto.Clone(s.cfg.Geometry).(*v1.ModelGeometry)
	}
	switch {
	case req.GetTpSize() < 1 || req.GetTpSize() > connector.MaxTPSize:
		return nil, fmt.Errorf("%w: create: tp_size %d must be in [1, %d]", ErrInvalidArgument, req.GetTpSize(), connector.MaxTPSize)
	case req.GetTpRank() >= req.GetTpSize():
		return nil, fmt.Errorf("%w: create: tp_rank %d must be in [0, tp_size=%d)", ErrInvalidArgument, req.GetTpRank(), req.GetTpSize())
	}
	s.openMu.Lock()
	defer s.openMu.Unlock()
	cache := s.Cache()
	if cache == nil {
		if req.GetGeometry() == nil {
			return nil, fmt.Errorf("%w: create: the sidecar was started without --model or an explicit geometry, and no engine created its KV cache yet", ErrGeometryRequired)
		}
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
			s.cfg.Logger.Info("engine session started", "session", id, "engine_id", cache.EngineID,
				"tp_rank", cache.Create.GetTpRank(), "tp_size", cache.Create.GetTpSize())
		}
	}
	return &v1.LocalReply{Result: &v1.LocalReply_Cache{Cache: cacheInfo(cache)}}, nil
}

// sameCache checks that an attach asks for the cache that exists; a field
// left unset takes the cache's (the geometry: whichever connection created
// the cache, a scheduler process attaching after its workers, say).
func sameCache(have, want *v1.CreateKVCache) error {
	diff := func(field string, h, w any) error {
		return codes.New(v1.Code_CODE_ALREADY_EXISTS, "localapi: a KV cache with %s=%v exists; this engine asks for %v", field, h, w)
	}
	switch {
	case want.GetGeometry() != nil && !proto.Equal(have.GetGeometry(), want.GetGeometry()):
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

// Why an engine session ended, the reason attribute of "engine session
// ended" and of a not-ready /readyz: the last attached connection's end.
const (
	endClosed   = "the engine closed its connection (it exited, stopped or was killed)"
	endLost     = "the engine's connection was lost (a socket error: killed with a reply unread, say)"
	endBadFrame = "the engine sent an unreadable frame; the connection was closed"
	endWrite    = "a reply could not be written to the engine; the connection was closed"
	endShutdown = "the sidecar is shutting down"
)

// detach runs when a connection ends, why being one of the end* reasons.
// When it was the last connection attached to the cache, the engine
// session ends: every load it started is aborted (Rank.Abort returns once
// the READ stopped) and the blocks it allocated and still owns are freed,
// each exactly once: those held under a prefill lease when their last
// lease ends (Rank.FreeSessionBlocks; under coordinated ownership the
// engine would have freed them after done_sending, but it is gone). The
// session's results that no GetFinished took (and those that arrive later,
// such as a lease released afterwards) are dropped: the next engine never
// sees them. One line, "engine session ended", says why and what was
// released and dropped. Nothing is freed while the server closes (Close
// closes the rank and the pool).
func (s *Server) detach(st *connState, why string) {
	if !st.attached {
		return
	}
	s.mu.Lock()
	closed, cache := s.closed, s.cache
	s.mu.Unlock()
	if closed {
		why = endShutdown
	}
	session, blocks, loads, last := s.eng.detach(why)
	if !last || cache == nil {
		return
	}
	log := s.cfg.Logger
	aborted, freed, leased, failed := 0, 0, 0, 0
	if !closed && (len(blocks) > 0 || len(loads) > 0) {
		ctx, cancel := context.WithTimeout(s.ctx, s.cfg.CallTimeout)
		defer cancel()
		for _, id := range loads {
			if err := cache.Rank.Abort(ctx, id); err != nil {
				log.Error("engine gone: aborting its load failed", "request_id", id, "err", err)
				continue
			}
			aborted++
		}
		freed, leased, failed = s.freeAll(ctx, cache.Rank, blocks)
	}
	f := cache.Rank.EndSession(session)
	attrs := []any{"session", session, "engine_id", cache.EngineID, "reason", why,
		"loads_aborted", aborted, "blocks_freed", freed, "blocks_freed_when_leases_end", leased, "blocks_free_failed", failed}
	if ids := f.RequestIDs(); len(ids) > 0 {
		// Results no GetFinished took: dropped, the next engine never sees them.
		attrs = append(attrs, "dropped_done_sending", len(f.DoneSending), "dropped_done_recving", len(f.DoneRecving),
			"dropped_failed", len(f.Failed), "request_ids", ids)
	}
	log.Info("engine session ended", attrs...)
}

// freeAll frees the blocks of an ended session through rank, all at once
// when it can, else one by one (an error frees nothing, so no block is
// freed twice), and counts the blocks freed now, left to their leases, and
// refused.
func (s *Server) freeAll(ctx context.Context, rank *connector.Rank, blocks []int) (freed, leased, failed int) {
	if len(blocks) == 0 {
		return 0, 0, 0
	}
	now, held, err := rank.FreeSessionBlocks(ctx, blocks)
	if err == nil {
		return len(now), len(held), 0
	}
	leased = len(held)
	for _, b := range blocks {
		now, _, err := rank.FreeSessionBlocks(ctx, []int{b}) // a leased one was counted above
		if err != nil {
			failed++
			s.cfg.Logger.Error("engine gone: freeing its block failed", "block", b, "err", err)
			continue
		}
		freed += len(now)
	}
	return freed, leased, failed
}

// engineState is what the server remembers of the engine session attached
// to its cache (connector's session.go says what a session is): its id, the
// blocks allocated through the local API in this session and not freed by
// the engine (the blocks its RequestFinished and Free may name), those of
// them that are still the engine's to free (not taken over by the Rank), and
// the loads it started, so the server can release them when the engine goes
// away without freeing.
type engineState struct {
	mu        sync.Mutex
	attached  int                 // open connections that sent create
	session   uint64              // current session; 0 before the first attach
	last      uint64              // last session id handed out
	endReason string              // why the last ended session ended; "" while none ended
	allocated map[int]struct{}    // allocated in this session, not freed by the engine
	blocks    map[int]struct{}    // of allocated: still the engine's to free
	loads     map[string]struct{} // request ids started via StartLoad
}

func newEngineState() *engineState {
	return &engineState{allocated: map[int]struct{}{}, blocks: map[int]struct{}{}, loads: map[string]struct{}{}}
}

// attach adds an attached connection and returns the session it belongs
// to; started is true when it begins a new session.
func (e *engineState) attach() (session uint64, started bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.attached++; e.attached == 1 {
		e.last++
		e.session = e.last
		started = true
	}
	return e.session, started
}

// current returns the live session, 0 when no engine is attached.
func (e *engineState) current() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.attached == 0 {
		return 0
	}
	return e.session
}

// status returns the latest session and its attached connections; when
// conns is 0 that session ended (why says why) or none began (session 0).
func (e *engineState) status() (session uint64, conns int, why string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.session, e.attached, e.endReason
}

// detach drops one attached connection; when it was the last one it
// records why the session ended and returns the session with its blocks
// still the engine's (sorted) and its loads, and forgets them.
func (e *engineState) detach(why string) (session uint64, blocks []int, loads []string, last bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.attached--; e.attached > 0 {
		return 0, nil, nil, false
	}
	e.endReason = why
	blocks = slices.Sorted(maps.Keys(e.blocks))
	loads = slices.Sorted(maps.Keys(e.loads))
	clear(e.allocated)
	clear(e.blocks)
	clear(e.loads)
	return e.session, blocks, loads, true
}

// checkOwned returns an error naming the first id of ids (field[i]) that
// was not allocated in this session, or was freed since. Ids outside
// [1, numBlocks) are left to the pool's range check, which names them
// with their own code.
func (e *engineState) checkOwned(field string, ids []uint32, numBlocks int) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, b := range ids {
		if b == 0 || int(b) >= numBlocks {
			continue
		}
		if _, ok := e.allocated[int(b)]; !ok {
			return fmt.Errorf("%w: %s[%d]=%d was not allocated by this engine session on this rank (or it freed it since); nothing was changed",
				ErrInvalidArgument, field, i, b)
		}
	}
	return nil
}

func (e *engineState) addBlocks(ids []int) {
	e.mu.Lock()
	for _, b := range ids {
		e.allocated[b] = struct{}{}
		e.blocks[b] = struct{}{}
	}
	e.mu.Unlock()
}

// takeOver records that the Rank took blocks over (it frees them).
func (e *engineState) takeOver(ids []int) {
	e.mu.Lock()
	for _, b := range ids {
		delete(e.blocks, b)
	}
	e.mu.Unlock()
}

// freed records that the engine freed blocks.
func (e *engineState) freed(ids []int) {
	e.mu.Lock()
	for _, b := range ids {
		delete(e.allocated, b)
		delete(e.blocks, b)
	}
	e.mu.Unlock()
}

func (e *engineState) addLoad(id string) {
	e.mu.Lock()
	e.loads[id] = struct{}{}
	e.mu.Unlock()
}

func (e *engineState) removeLoads(ids ...string) {
	e.mu.Lock()
	for _, id := range ids {
		delete(e.loads, id)
	}
	e.mu.Unlock()
}
