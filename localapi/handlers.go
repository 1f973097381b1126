package localapi

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// need is what a call needs before its handler runs.
type need int

const (
	// needNothing: the call runs before any cache exists (create, stats).
	needNothing need = iota
	// needCache: the KV cache, on any connection (an operator tool's too).
	needCache
	// needAttached: the KV cache, attached by this connection's create; the
	// call runs under the engine session.
	needAttached
)

// handler is one call of the local API.
type handler struct {
	needs need
	// refusedWhileDraining: the call starts work a draining sidecar would
	// have to finish (an allocation, an export, a load); it is refused with
	// connector.ErrDraining once Shutdown began.
	refusedWhileDraining bool
	serve                func(s *Server, c *call) (*v1.LocalReply, error)
}

// handlers is the local API: one entry per field of LocalRequest's call
// oneof, by its name, which is also the call's metric label.
var handlers = map[protoreflect.Name]handler{
	"create":           {needs: needNothing, serve: (*Server).create},
	"stats":            {needs: needNothing, serve: (*Server).stats},
	"available":        {needs: needCache, serve: (*Server).available},
	"set_limit":        {needs: needCache, serve: (*Server).setLimit},
	"alloc":            {needs: needAttached, refusedWhileDraining: true, serve: (*Server).alloc},
	"free":             {needs: needAttached, serve: (*Server).free},
	"request_finished": {needs: needAttached, refusedWhileDraining: true, serve: (*Server).requestFinished},
	"start_load":       {needs: needAttached, refusedWhileDraining: true, serve: (*Server).startLoad},
	"get_finished":     {needs: needAttached, serve: (*Server).getFinished},
	"abort":            {needs: needAttached, serve: (*Server).abort},
	"sync":             {needs: needAttached, serve: (*Server).sync},
}

// callNames are the calls of handlers, sorted; their CODE_OK series start
// at 0.
func callNames() []string {
	var out []string
	for name := range maps.Keys(handlers) {
		out = append(out, string(name))
	}
	slices.Sort(out)
	return out
}

// callOneof is LocalRequest's call oneof.
var callOneof = (&v1.LocalRequest{}).ProtoReflect().Descriptor().Oneofs().ByName("call")

// callName is the bounded metric label of a request: the name of its call
// field, "unknown" when none is set (or one this sidecar does not know).
func callName(req *v1.LocalRequest) string {
	if fd := req.ProtoReflect().WhichOneof(callOneof); fd != nil {
		return string(fd.Name())
	}
	return "unknown"
}

// call is one request being served.
type call struct {
	ctx      context.Context // the call's deadline; the engine session for needAttached calls
	name     string
	req      *v1.LocalRequest
	st       *connState
	cache    *Cache // nil before the first create
	draining bool   // Shutdown or Close began
	session  uint64 // the engine session (needAttached calls)
	// follower: under coordinated ownership ranks 1..N-1 allocate nothing
	// (rank 0 does, for every rank): their engine's block ids are checked
	// by the Rank against the pages rank 0 mapped here.
	follower bool
}

func errorReply(err error) *v1.LocalReply {
	return &v1.LocalReply{Error: codes.ToProto(err)}
}

func (s *Server) handle(st *connState, req *v1.LocalRequest) *v1.LocalReply {
	name := callName(req)
	rep, err := s.dispatch(st, req, name)
	if err != nil {
		rep = errorReply(err)
	}
	s.m.calls.WithLabelValues(name, rep.GetError().GetCode().String()).Inc()
	return rep
}

// dispatch checks what the call's handler needs, then runs it.
func (s *Server) dispatch(st *connState, req *v1.LocalRequest, name string) (*v1.LocalReply, error) {
	if v := req.GetWireVersion(); v != v1.WireVersion_WIRE_VERSION_1 {
		return nil, codes.New(v1.Code_CODE_INCOMPATIBLE_MODEL, "localapi: wire_version %v, this sidecar speaks %v", v, v1.WireVersion_WIRE_VERSION_1)
	}
	h, ok := handlers[protoreflect.Name(name)]
	if !ok {
		return nil, fmt.Errorf("%w: unknown call (no call set, or a call this sidecar does not know)", ErrInvalidArgument)
	}
	s.mu.Lock()
	c := &call{name: name, req: req, st: st, cache: s.cache, draining: s.draining || s.closed}
	s.mu.Unlock()
	switch {
	case h.needs >= needCache && c.cache == nil:
		return nil, fmt.Errorf("%w: call %s needs the KV cache; an engine must send create first", ErrNotAttached, name)
	case h.needs == needAttached && !st.attached:
		return nil, fmt.Errorf("%w: call %s on a connection that did not send create", ErrNotAttached, name)
	case h.refusedWhileDraining && c.draining:
		return nil, fmt.Errorf("%w: %s refused while shutting down", connector.ErrDraining, name)
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.CallTimeout)
	defer cancel()
	c.ctx = ctx
	if h.needs == needAttached {
		c.session = s.eng.current()
		c.ctx = connector.WithSession(ctx, c.session)
		c.follower = c.cache.Create.GetOwnership() == v1.Ownership_OWNERSHIP_COORDINATED && c.cache.Create.GetTpRank() != 0
	}
	return h.serve(s, c)
}

func (s *Server) stats(c *call) (*v1.LocalReply, error) {
	st := statsOf(c.cache)
	if session, conns, _ := s.eng.status(); conns > 0 {
		st.EngineAttached, st.EngineSession = true, session
	}
	return &v1.LocalReply{Result: &v1.LocalReply_Stats{Stats: st}}, nil
}

func (s *Server) available(c *call) (*v1.LocalReply, error) {
	blocks, over := c.cache.Pool.AvailableOverLimit()
	return &v1.LocalReply{Result: &v1.LocalReply_Available{Available: &v1.AvailableReply{Blocks: uint64(blocks), OverLimit: over}}}, nil
}

// setLimit applies a memory limit: 0 (none) or [one page of every region,
// the reservation]; with strict, not below the pages that hold allocated
// blocks.
func (s *Server) setLimit(c *call) (*v1.LocalReply, error) {
	req := c.req.GetSetLimit()
	ps := c.cache.Pool.Stats()
	pageBytes := ps.PageSize * uint64(ps.NumRegions)
	reserved := uint64(ps.Pages) * pageBytes
	b := req.GetBytes()
	if b != 0 && (b < pageBytes || b > reserved) {
		return nil, fmt.Errorf("%w: memory limit %d bytes outside the accepted range [%d, %d] (one page of every region up to the reservation; 0 = no limit)",
			ErrInvalidArgument, b, pageBytes, reserved)
	}
	if inUse := uint64(ps.PagesMapped-ps.ReservePages) * pageBytes; req.GetStrict() && b != 0 && b < inUse {
		return nil, fmt.Errorf("%w: memory limit %d bytes is below the %d bytes in use (strict): accepted range [%d, %d]",
			ErrInvalidArgument, b, inUse, inUse, reserved)
	}
	if err := c.cache.Pool.SetMemoryLimit(b); err != nil {
		return nil, err
	}
	return &v1.LocalReply{}, nil
}

func (s *Server) alloc(c *call) (*v1.LocalReply, error) {
	pool := c.cache.Pool
	n := c.req.GetAlloc().GetCount()
	if n == 0 || int(n) >= pool.NumBlocks() {
		return nil, fmt.Errorf("%w: alloc count %d must be in [1, %d)", ErrInvalidArgument, n, pool.NumBlocks())
	}
	ids, err := pool.Alloc(c.ctx, int(n))
	if err != nil {
		return nil, err
	}
	s.eng.addBlocks(ids)
	return &v1.LocalReply{Result: &v1.LocalReply_Alloc{Alloc: &v1.AllocBlocksReply{BlockIds: kvgeom.Wire(ids)}}}, nil
}

func (s *Server) free(c *call) (*v1.LocalReply, error) {
	req := c.req.GetFree()
	if err := s.eng.checkOwned("block_ids", req.GetBlockIds(), c.cache.Pool.NumBlocks()); err != nil && !c.follower {
		return nil, err
	}
	ids := kvgeom.Ints(req.GetBlockIds())
	if err := c.cache.Rank.FreeBlocks(c.ctx, ids); err != nil {
		return nil, err
	}
	s.eng.freed(ids)
	return &v1.LocalReply{}, nil
}

func (s *Server) requestFinished(c *call) (*v1.LocalReply, error) {
	rf := c.req.GetRequestFinished()
	if err := s.eng.checkOwned("block_ids", rf.GetBlockIds(), c.cache.Pool.NumBlocks()); err != nil && !c.follower {
		return nil, err
	}
	p, err := c.cache.Rank.RequestFinished(c.ctx, rf.GetRequestId(), rf.GetBlockIds(), rf.GetStatus(), rf.GetParams())
	if err != nil {
		return nil, err
	}
	if c.cache.Create.GetOwnership() != v1.Ownership_OWNERSHIP_COORDINATED {
		// The Rank took the blocks over and frees them itself.
		s.eng.takeOver(kvgeom.Ints(rf.GetBlockIds()))
	}
	return &v1.LocalReply{Result: &v1.LocalReply_RequestFinished{RequestFinished: &v1.RequestFinishedReply{Params: p, DelayFree: p != nil}}}, nil
}

func (s *Server) startLoad(c *call) (*v1.LocalReply, error) {
	meta := c.req.GetStartLoad().GetMeta()
	if err := c.cache.Rank.StartLoad(c.ctx, meta); err != nil {
		return nil, err
	}
	s.eng.addLoad(meta.GetRequestId())
	return &v1.LocalReply{}, nil
}

func (s *Server) getFinished(c *call) (*v1.LocalReply, error) {
	f := c.cache.Rank.TakeSession(c.session)
	s.eng.removeLoads(f.DoneRecving...)
	for _, fl := range f.Failed {
		s.eng.removeLoads(fl.RequestID)
	}
	return &v1.LocalReply{Result: &v1.LocalReply_GetFinished{GetFinished: finishedProto(f)}}, nil
}

func (s *Server) abort(c *call) (*v1.LocalReply, error) {
	id := c.req.GetAbort().GetRequestId()
	if id == "" {
		return nil, fmt.Errorf("%w: abort: request_id is empty", ErrInvalidArgument)
	}
	if err := c.cache.Rank.Abort(c.ctx, id); err != nil {
		return nil, err
	}
	s.eng.removeLoads(id)
	return &v1.LocalReply{}, nil
}

// sync asks for nothing but the reply's MappingDelta.
func (s *Server) sync(*call) (*v1.LocalReply, error) { return &v1.LocalReply{}, nil }
