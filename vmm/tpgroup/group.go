package tpgroup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// PagePool is what a follower rank needs of its pool: map and unmap the
// given page indices (page p of every region) on command, each call
// all-or-nothing. *vmm.Pool implements it. The coordinator's hook (Hook)
// has the same method set: it is vmm.PageHook.
type PagePool interface {
	MapPages(ctx context.Context, pages []int) error
	UnmapPages(ctx context.Context, pages []int) error
}

// Info is what a member advertises about itself.
type Info struct {
	Member
	// Ownership is the group's ownership mode.
	Ownership Ownership
	// SocketPath is this rank's listening socket ("" when the group runs on
	// an in-memory transport in this package's tests).
	SocketPath string
}

// Counters are the group's message counters since New, for tests and
// operators. The same numbers are exported as Prometheus metrics.
type Counters struct {
	// Sent counts the requests this member sent, indexed by target rank
	// (len TPSize); a request counts once its write started.
	Sent []uint64
	// Received counts requests received and answered, refused ones included.
	Received uint64
	// MapsServed and UnmapsServed count page ops served successfully.
	MapsServed, UnmapsServed uint64
	// Refused counts requests answered with a non-OK code.
	Refused uint64
	// Rollbacks counts coordinated maps rolled back after a rank failed.
	Rollbacks uint64
}

// Group is one member (one rank) of the TP group of an engine instance. It
// listens on its rank's socket and serves the other members' requests; on
// rank 0 in coordinated mode its Hook fans page maps out to ranks 1..N-1.
// Its methods are safe for concurrent use. Close stops it.
type Group struct {
	m    Member
	cfg  *Config
	pool PagePool
	path string
	ln   net.Listener
	dial func(ctx context.Context, rank int) (net.Conn, error)
	log  *slog.Logger
	met  *metrics

	timeoutCause error
	peers        []*peer // by rank; nil at this member's own rank

	ctx    context.Context
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{}

	// A follower of a coordinated group (follower.go): opMu serializes the
	// page ops it serves (a MAP still running on a connection rank 0
	// dropped, and the SYNC on its new one); held is what rank 0 mapped
	// here through the group; synced is set once it served a SYNC.
	opMu   sync.Mutex
	held   map[int]struct{} // guarded by opMu
	synced atomic.Bool

	sent                                                   []atomic.Uint64
	received, mapsServed, unmapsServed, refused, rollbacks atomic.Uint64
}

// errGroupClosed is the cause of the group's context once Close started.
var errGroupClosed = fmt.Errorf("tpgroup: group closed: %w", net.ErrClosed)

// New starts member m of a TP group: it prepares Config.Dir, listens on
// SocketPath(Dir, m.EngineID, m.TPRank) (mode 0600; a stale socket of a dead
// process is replaced, a live one is not: ErrSocketInUse) and serves the
// other members. pool serves page ops: it is required on ranks 1..N-1 in
// coordinated mode and unused otherwise (rank 0 passes its pool's hook the
// other way round: vmm.Config.PageHook = g.Hook()). ctx bounds the start
// only. Errors: ErrInvalidConfig naming the field, ErrUnsafeDir,
// ErrSocketInUse, a file at the socket path that is not a socket (class
// CODE_INVALID_ARGUMENT), or a listen error.
func New(ctx context.Context, m Member, pool PagePool, cfg *Config) (*Group, error) {
	return newGroup(ctx, m, pool, cfg, nil, nil)
}

// newGroup is New with an optional transport: when ln is non-nil the group
// serves ln instead of a unix socket and dials peers with dial (this
// package's synctest tests use net.Pipe, which is durably blocking).
func newGroup(ctx context.Context, m Member, pool PagePool, cfg *Config, ln net.Listener, dial func(context.Context, int) (net.Conn, error)) (*Group, error) {
	if err := m.validate(); err != nil {
		return nil, err
	}
	c, err := cfg.populate()
	if err != nil {
		return nil, err
	}
	if pool == nil && c.Ownership == OwnershipCoordinated && m.TPRank != 0 {
		return nil, fmt.Errorf("%w: pool is nil: rank %d of a coordinated group serves rank 0's page ops with its pool", ErrInvalidConfig, m.TPRank)
	}
	met, err := newMetrics(c.Registerer, m.TPSize)
	if err != nil {
		return nil, err
	}
	g := &Group{
		m: m, cfg: c, pool: pool, ln: ln, dial: dial, met: met,
		log:   c.Logger.With("engine_id", m.EngineID, "tp_rank", m.TPRank, "tp_size", m.TPSize),
		peers: make([]*peer, m.TPSize),
		conns: make(map[net.Conn]struct{}),
		held:  make(map[int]struct{}),
		sent:  make([]atomic.Uint64, m.TPSize),
		timeoutCause: fmt.Errorf("tpgroup: no answer within PeerTimeout=%v: %w",
			c.PeerTimeout, context.DeadlineExceeded),
	}
	for r := range g.peers {
		if r != m.TPRank {
			g.peers[r] = newPeer(r)
		}
	}
	if g.ln == nil {
		if err := g.listen(ctx); err != nil {
			return nil, err
		}
	}
	g.ctx, g.cancel = context.WithCancelCause(context.Background())
	g.wg.Go(g.acceptLoop)
	g.log.Info("tpgroup started", "ownership", c.Ownership.String(), "socket", g.path, "device", m.Device)
	return g, nil
}

func (g *Group) listen(ctx context.Context) error {
	path, err := SocketPath(g.cfg.Dir, g.m.EngineID, g.m.TPRank)
	if err != nil {
		return err
	}
	if err := unixsock.PrepareDir(g.cfg.Dir); err != nil {
		return err
	}
	ln, err := unixsock.Listen(ctx, path)
	if err != nil {
		return err
	}
	g.path, g.ln = path, ln
	g.dial = func(ctx context.Context, rank int) (net.Conn, error) {
		p, err := SocketPath(g.cfg.Dir, g.m.EngineID, rank)
		if err != nil {
			return nil, err
		}
		var d net.Dialer
		return d.DialContext(ctx, "unix", p)
	}
	return nil
}

// Info returns what this member advertises: its Member (TPSize as fixed at
// New), ownership and socket path.
func (g *Group) Info() Info {
	return Info{Member: g.m, Ownership: g.cfg.Ownership, SocketPath: g.path}
}

// TPSize returns the TP size fixed at New. Nothing changes it later.
func (g *Group) TPSize() int { return g.m.TPSize }

// Counters returns a snapshot of the message counters.
func (g *Group) Counters() Counters {
	c := Counters{
		Sent:         make([]uint64, len(g.sent)),
		Received:     g.received.Load(),
		MapsServed:   g.mapsServed.Load(),
		UnmapsServed: g.unmapsServed.Load(),
		Refused:      g.refused.Load(),
		Rollbacks:    g.rollbacks.Load(),
	}
	for i := range g.sent {
		c.Sent[i] = g.sent[i].Load()
	}
	return c
}

// Close stops serving, removes the socket, cancels in-flight operations and
// waits for the group's goroutines. A second Close returns an error wrapping
// net.ErrClosed.
func (g *Group) Close() error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return fmt.Errorf("tpgroup: close: %w", net.ErrClosed)
	}
	g.closed = true
	for c := range g.conns {
		c.Close()
	}
	g.mu.Unlock()
	g.cancel(errGroupClosed)
	err := g.ln.Close()
	g.wg.Wait()
	for _, p := range g.peers {
		if p != nil {
			p.drop()
		}
	}
	g.log.Info("tpgroup closed")
	if err != nil && !errors.Is(err, net.ErrClosed) {
		return fmt.Errorf("tpgroup: close listener: %w", err)
	}
	return nil
}

// begin registers an operation with the group so Close waits for it. It
// fails with net.ErrClosed once Close started.
func (g *Group) begin() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return errGroupClosed
	}
	g.wg.Add(1)
	return nil
}

// opContext derives the context of one group operation from parent: the
// PeerTimeout deadline on top of parent's, and cancelled when Close starts.
func (g *Group) opContext(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancelTimeout := context.WithTimeoutCause(parent, g.cfg.PeerTimeout, g.timeoutCause)
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(g.ctx, func() { cancel(context.Cause(g.ctx)) })
	return ctx, func() {
		stop()
		cancel(nil)
		cancelTimeout()
	}
}

func (g *Group) acceptLoop() {
	backoff := time.Millisecond
	for {
		c, err := g.ln.Accept()
		if err != nil {
			if g.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE and the like: back off instead of spinning.
			g.log.Warn("tpgroup accept failed", "err", err, "retry_in", backoff)
			t := time.NewTimer(backoff)
			select {
			case <-g.ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = time.Millisecond
		g.mu.Lock()
		if g.closed {
			g.mu.Unlock()
			c.Close()
			return
		}
		g.conns[c] = struct{}{}
		g.wg.Add(1)
		g.mu.Unlock()
		go func() {
			defer g.wg.Done()
			g.serveConn(c)
		}()
	}
}

// serveConn answers the requests of one connection in order until the peer
// closes it, a frame is malformed, or the group closes.
func (g *Group) serveConn(c net.Conn) {
	defer func() {
		g.mu.Lock()
		delete(g.conns, c)
		g.mu.Unlock()
		c.Close()
	}()
	r := wire.NewReader(c, g.cfg.MaxFrame)
	for {
		var req v1.GroupRequest
		err := r.ReadMsg(&req)
		var resp *v1.GroupResponse
		switch {
		case err == nil:
			resp = g.handle(&req)
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
			g.ctx.Err() != nil || errors.Is(err, net.ErrClosed):
			// Closed, possibly mid-frame: nobody is left to answer.
			return
		default:
			// A frame we cannot parse: answer once, then drop the stream
			// because its framing can no longer be trusted.
			g.log.Warn("tpgroup bad frame", "err", err)
			resp = g.reply("invalid", fmt.Errorf("%w: %w", ErrInvalidArgument, err))
		}
		c.SetWriteDeadline(time.Now().Add(g.cfg.PeerTimeout))
		// Replies are small; MaxFrame limits what this member accepts.
		if werr := wire.WriteMsg(c, resp, 0); werr != nil {
			g.log.Warn("tpgroup reply failed", "err", werr)
			return
		}
		if err != nil {
			return
		}
	}
}

// handle answers one request.
func (g *Group) handle(req *v1.GroupRequest) *v1.GroupResponse {
	if err := g.checkRequest(req); err != nil {
		return g.reply("invalid", err)
	}
	switch b := req.GetBody().(type) {
	case *v1.GroupRequest_Ping:
		return g.reply("ping", nil)
	case *v1.GroupRequest_PageOp:
		return g.servePageOp(b.PageOp)
	case *v1.GroupRequest_Resync:
		return g.serveResync(int(req.GetFromRank()))
	}
	return g.reply("invalid", fmt.Errorf("%w: request from rank %d has no body", ErrInvalidArgument, req.GetFromRank()))
}

// checkRequest applies the envelope rules: wire version, engine id, the
// fixed tp_size, target rank and sender rank.
func (g *Group) checkRequest(req *v1.GroupRequest) error {
	switch {
	case req.GetWireVersion() != v1.WireVersion_WIRE_VERSION_1:
		return codes.New(v1.Code_CODE_INCOMPATIBLE_MODEL,
			"tpgroup: wire_version %v: want %v", req.GetWireVersion(), v1.WireVersion_WIRE_VERSION_1)
	case req.GetEngineId() != g.m.EngineID:
		return codes.New(v1.Code_CODE_NOT_FOUND,
			"tpgroup: engine_id %q: this member belongs to %q", req.GetEngineId(), g.m.EngineID)
	case int64(req.GetTpSize()) != int64(g.m.TPSize):
		return fmt.Errorf("%w: request claims tp_size=%d; this group was started with tp_size=%d, fixed for its life",
			ErrTPMismatch, req.GetTpSize(), g.m.TPSize)
	case int64(req.GetToRank()) != int64(g.m.TPRank):
		return fmt.Errorf("%w: request for rank %d reached rank %d", ErrInvalidArgument, req.GetToRank(), g.m.TPRank)
	case int64(req.GetFromRank()) >= int64(g.m.TPSize) || int64(req.GetFromRank()) == int64(g.m.TPRank):
		return fmt.Errorf("%w: from_rank=%d: must be another rank in [0, %d)", ErrInvalidArgument, req.GetFromRank(), g.m.TPSize)
	}
	if req.GetResync() {
		switch {
		case g.cfg.Ownership == OwnershipLocal:
			return fmt.Errorf("%w: resync from rank %d: ownership is local; no rank maps pages on another", ErrInvalidArgument, req.GetFromRank())
		case g.m.TPRank != 0:
			return fmt.Errorf("%w: resync from rank %d reached rank %d: only rank 0 maps pages on the others", ErrInvalidArgument, req.GetFromRank(), g.m.TPRank)
		}
	}
	if req.GetPageOp() != nil {
		switch {
		case g.cfg.Ownership == OwnershipLocal:
			return fmt.Errorf("%w: page op from rank %d: ownership is local; every rank maps its own pages and nothing is broadcast", ErrInvalidArgument, req.GetFromRank())
		case g.m.TPRank == 0:
			return fmt.Errorf("%w: page op from rank %d: rank 0 is the coordinator and never serves page ops", ErrInvalidArgument, req.GetFromRank())
		case req.GetFromRank() != 0:
			return fmt.Errorf("%w: page op from rank %d: only rank 0 coordinates page ops", ErrInvalidArgument, req.GetFromRank())
		}
	}
	return nil
}

func (g *Group) servePageOp(op *v1.PageOp) *v1.GroupResponse {
	kind := op.GetKind()
	if kind == v1.PageOp_KIND_FREE {
		return g.serveFree(op.GetBlocks())
	}
	pages := make([]int, len(op.GetPages()))
	for i, p := range op.GetPages() {
		pages[i] = int(p)
	}
	if kind == v1.PageOp_KIND_SYNC {
		return g.serveSync(pages)
	}
	if len(pages) == 0 {
		return g.reply("invalid", fmt.Errorf("%w: page op %v with no pages", ErrInvalidArgument, kind))
	}
	ctx, cancel := g.opContext(g.ctx)
	defer cancel()
	g.opMu.Lock()
	defer g.opMu.Unlock()
	switch kind {
	case v1.PageOp_KIND_MAP:
		err := g.pool.MapPages(ctx, pages)
		if err == nil {
			g.holdLocked(pages)
			g.mapsServed.Add(1)
		}
		return g.reply("map", err)
	case v1.PageOp_KIND_UNMAP:
		err := g.unmapLocked(ctx, pages)
		if err == nil {
			g.unmapsServed.Add(1)
		}
		return g.reply("unmap", err)
	}
	return g.reply("invalid", fmt.Errorf("%w: page op kind %v: want KIND_MAP, KIND_UNMAP, KIND_FREE or KIND_SYNC", ErrInvalidArgument, kind))
}

// serveFree answers rank 0's KIND_FREE: once Config.OnFree says this rank
// no longer uses the blocks.
func (g *Group) serveFree(ids []uint32) *v1.GroupResponse {
	if len(ids) == 0 {
		return g.reply("invalid", fmt.Errorf("%w: page op KIND_FREE with no blocks", ErrInvalidArgument))
	}
	if g.cfg.OnFree == nil {
		return g.reply("free", nil)
	}
	blocks := make([]int, len(ids))
	for i, b := range ids {
		blocks[i] = int(b)
	}
	ctx, cancel := g.opContext(g.ctx)
	defer cancel()
	return g.reply("free", g.cfg.OnFree(ctx, blocks))
}

// reply builds the response to a request of the given kind and counts it.
func (g *Group) reply(kind string, err error) *v1.GroupResponse {
	g.received.Add(1)
	code := codes.Of(err)
	g.met.served.WithLabelValues(kind, code.String()).Inc()
	resp := &v1.GroupResponse{TpRank: uint32(g.m.TPRank), TpSize: uint32(g.m.TPSize)}
	if err != nil {
		g.refused.Add(1)
		resp.Error = &v1.Error{Code: code, Message: err.Error()}
		g.log.Debug("tpgroup request refused", "kind", kind, "code", code.String(), "err", err)
	}
	return resp
}
