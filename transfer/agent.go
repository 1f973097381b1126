package transfer

import (
	"bufio"
	"context"
	crand "crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/qlog"
	"github.com/quic-go/quic-go/qlogwriter"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Op is the direction of a transfer, seen from the dialer.
type Op int

const (
	// OpRead pulls bytes from the peer's memory into local memory.
	OpRead Op = 1
	// OpWrite pushes bytes from local memory into the peer's memory.
	OpWrite Op = 2
)

func (o Op) String() string {
	switch o {
	case OpRead:
		return "READ"
	case OpWrite:
		return "WRITE"
	}
	return fmt.Sprintf("Op(%d)", int(o))
}

func (o Op) label() string {
	if o == OpWrite {
		return "write"
	}
	return "read"
}

// Agent is one rank's transfer endpoint: a single UDP socket (one
// quic.Transport) that serves its registered memory to peers and dials
// peers, one cached QUIC connection per remote address. Safe for concurrent
// use. Close stops every goroutine it started.
//
// An agent is two halves on one socket, as quic-go keeps its Transport's
// dialing apart from its Server: the dialer (dial.go, lanes.go, redial.go
// and the calls of client.go), the connections it dials and the calls on
// them; and the server (serve.go), the connections it accepts and what it
// serves on them. Each half is its own type with its own methods, state,
// lock and goroutines, and holds no pointer to the other, so neither can
// take the other's lock. What both read is the core: the config, the
// socket, the registered regions, the metrics. Agent's exported methods
// are the public face of the two halves.
type Agent struct {
	*core
	dialer *dialer
	server *server

	// mu orders the life cycle, Start and Close; it guards started,
	// closed and server.ln. It is taken before dialer.mu or server.mu,
	// never while holding either.
	mu      sync.Mutex
	started bool
	closed  bool
}

// core is what both halves of an Agent read and neither owns: the config,
// the socket, the registered regions, the metrics and the logs.
type core struct {
	cfg   *Config
	tr    *quic.Transport
	qconf *quic.Config
	m     *metrics
	log   *slog.Logger

	// ctx ends when Close begins; dials and the accept loop run under it.
	ctx    context.Context
	cancel context.CancelCauseFunc
	// closing is set when Close begins.
	closing atomic.Bool

	regMu   sync.RWMutex
	regions regionSet

	moved      atomic.Uint64 // payload bytes, counted as they move (meter)
	localMoved atomic.Uint64 // payload bytes of dialed same-host READs (SameHostBytes)
	refusals   refusalLog    // rate limit of the refusal log lines
}

// meter returns the counter of payload bytes of transfers of op in role
// (roleClient: dialed, roleServer: served), counted as they move rather than
// when a transfer ends, so kvsidecar_transfer_bytes_total and BytesMoved
// advance during a long transfer.
func (c *core) meter(op Op, role int) func(int) {
	ctr := c.m.op(op).bytes[role]
	return func(n int) {
		ctr.Add(float64(n))
		c.moved.Add(uint64(n))
	}
}

// BytesMoved is the payload bytes this agent's transfers moved so far, both
// ops and roles, transfers in flight included: for a READ it dialed, the
// bytes that landed in local memory; for one it served, the bytes written
// to the stream (WRITE the mirror).
func (a *Agent) BytesMoved() uint64 { return a.moved.Load() }

// SameHostBytes is the payload bytes of the READs this agent dialed that
// landed through the same-host path (mapped pages, no QUIC); they count in
// BytesMoved too.
func (a *Agent) SameHostBytes() uint64 { return a.localMoved.Load() }

// Prepare registers descs (the peer's memory) with the peer, which validates
// them once; transfers then name entries by index. Errors carry the peer's
// class (ErrOutOfRange, ErrInvalidArgument, ...).
func (a *Agent) Prepare(ctx context.Context, addr string, descs []Desc) (*DescList, error) {
	return a.dialer.prepare(ctx, addr, descs)
}

// Handshake sends req to the agent at addr on the cached connection
// (dialing it, in 0-RTT when a ticket is cached; a rejected 0-RTT request is
// resent) and returns its answer. Errors: ErrUnavailable when the peer
// cannot be reached, context.Cause(ctx).
func (a *Agent) Handshake(ctx context.Context, addr string, req *v1.HandshakeRequest) (*v1.HandshakeResponse, error) {
	return a.dialer.handshake(ctx, addr, req)
}

// Heartbeat extends leases at the agent at addr and returns the new expiries.
// It is never sent in 0-RTT: a replayed heartbeat would extend leases the
// consumer already gave up, so it waits for the handshake to complete.
// Errors: the peer's class, ErrUnavailable, context.Cause(ctx).
func (a *Agent) Heartbeat(ctx context.Context, addr string, hb *v1.Heartbeat) (*v1.HeartbeatAck, error) {
	return a.dialer.heartbeat(ctx, addr, hb)
}

// Notify delivers n to the agent at addr and returns its answer: nil when
// accepted, an error of class ErrNotFound or ErrLeaseExpired when the
// request is unknown or expired (the data read for it may be stale).
// Notifications to one peer are delivered in call order; never in 0-RTT.
func (a *Agent) Notify(ctx context.Context, addr string, n *v1.Notification) error {
	return a.dialer.notify(ctx, addr, n)
}

// Transfer runs one READ or WRITE and returns when it is complete: for a
// READ every byte is in local memory; for a WRITE the peer acknowledged that
// every byte landed in its memory. On failure it returns an *XferError with
// the byte count reached; cancelling ctx aborts the transfer (the stream is
// reset with CODE_ABORTED) and the error wraps context.Cause(ctx). Transfer
// never returns before the stream is reset or drained, so the local range is
// the caller's again once it returns.
func (a *Agent) Transfer(ctx context.Context, x *Xfer) (Result, error) {
	return a.dialer.transfer(ctx, x)
}

// MarkCalls returns ctx marked with this moment: a call made with it (or
// with a context derived from it) counts as started now for the rule that
// a connection that ended refused, or a dial that failed, answers the calls
// already started instead of dialing again. A connector marks the context
// of a load whose metadata exchange and READ it pipelines to a new peer:
// a READ whose goroutine starts only after the exchange met the peer's
// refusal gets that refusal, and the peer sees one dial per load.
func (a *Agent) MarkCalls(ctx context.Context) context.Context {
	return a.dialer.markCalls(ctx)
}

// PeerInfo waits for the current connection to addr to finish its handshake
// and describes it. It returns an error of class ErrNotFound when there is no
// connection to addr, or context.Cause(ctx).
func (a *Agent) PeerInfo(ctx context.Context, addr string) (PeerInfo, error) {
	return a.dialer.peerInfo(ctx, addr)
}

// DialCount is the number of connections dialed to addr so far.
func (a *Agent) DialCount(addr string) int {
	return a.dialer.dialCount(addr)
}

// Alive reports whether the agent holds a connection to addr that is up
// (a dial in progress counts as up). A later call to addr on a dead one
// dials again.
func (a *Agent) Alive(addr string) bool {
	return a.dialer.alive(addr)
}

// Disconnect closes the connection to addr, if any, without closing the
// agent; the next call to addr dials again (with 0-RTT). OnPeerGone has
// been called for it when Disconnect returns.
func (a *Agent) Disconnect(addr string) {
	a.dialer.disconnect(addr)
}

// New starts an agent: it opens (or adopts) the UDP socket and, when
// ServerTLS is set, starts accepting connections. It returns an error naming
// the Config field for an invalid config. It is NewUnstarted, then Start.
func New(cfg *Config) (*Agent, error) {
	a, err := NewUnstarted(cfg)
	if err != nil {
		return nil, err
	}
	if err := a.Start(); err != nil {
		_ = a.Close()
		return nil, err
	}
	return a, nil
}

// NewUnstarted is New without the Start, as httptest.NewUnstartedServer is
// httptest.NewServer without it: the socket is open, Addr answers and the
// agent dials, but it accepts no connection until Start, so no serving
// callback of Config (Authorize, Release, OnHandshake, CheckExpect,
// OnNotification, OnHeartbeat) runs before then. Its owner can build what
// those callbacks reach out of the agent itself (its address, a client
// that calls through it) before any peer can reach them. Close closes an
// agent that never started as well.
func NewUnstarted(cfg *Config) (*Agent, error) {
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(c.Registerer)
	if err != nil {
		return nil, err
	}
	pc := c.PacketConn
	if pc == nil {
		udp, err := net.ListenPacket("udp", c.ListenAddr)
		if err != nil {
			return nil, fmt.Errorf("transfer: listen on Config.ListenAddr %q: %w", c.ListenAddr, err)
		}
		pc = udp
	}
	co := &core{
		cfg:   c,
		tr:    &quic.Transport{Conn: pc, StatelessResetKey: c.StatelessResetKey},
		qconf: QUICConfig(c),
		m:     m,
		log:   c.Logger,
	}
	co.ctx, co.cancel = context.WithCancelCause(context.Background())
	token := make([]byte, 16)
	_, _ = crand.Read(token)
	a := &Agent{core: co, dialer: newDialer(co), server: &server{core: co, conns: make(map[*quic.Conn]struct{}), token: token}}
	if c.QlogDir != "" {
		if err := os.MkdirAll(c.QlogDir, 0o755); err != nil {
			pc.Close()
			return nil, fmt.Errorf("transfer: Config.QlogDir: %w", err)
		}
		a.qconf.Tracer = qlogTracer(c.QlogDir, a.log)
	}
	for _, r := range c.Regions {
		r := r
		a.regions = append(a.regions, &r)
	}
	return a, nil
}

// Start starts serving: with Config.ServerTLS set, the agent accepts
// connections from now on (without it there is nothing to start). An agent
// from New is started already. Errors: a second Start; a closed agent
// (ErrUnavailable, wrapping net.ErrClosed); quic-go's listen error, after
// which the agent serves nothing and is to be closed.
func (a *Agent) Start() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case a.closed:
		return errClosed()
	case a.started:
		return errors.New("transfer: agent already started")
	}
	a.started = true
	if a.cfg.ServerTLS == nil {
		return nil
	}
	ln, err := a.tr.ListenEarly(a.server.servingTLS(servingBase(a.cfg.ServerTLS)), a.qconf)
	if err != nil {
		return fmt.Errorf("transfer: listen: %w", err)
	}
	a.server.ln = ln
	a.server.wg.Add(1)
	go a.server.acceptLoop()
	if a.cfg.LocalSocket != "" && sameHostSupported {
		if err := a.server.listenLocal(a.ctx, a.server.token); err != nil {
			return err
		}
	}
	return nil
}

// SameHost is the agent's offer of its pages to readers on its host, for
// its metadata (AgentMetadata.same_host): the socket of
// Config.LocalSocket, the token its hello carries and Config.ShareKind.
// Nil when the agent offers none (no LocalSocket, or not Linux).
func (a *Agent) SameHost() *SameHostPeer {
	if a.cfg.LocalSocket == "" || !sameHostSupported {
		return nil
	}
	return &SameHostPeer{Socket: a.cfg.LocalSocket, Token: a.server.token, Kind: a.cfg.ShareKind}
}

// Addr is the agent's UDP address, e.g. 127.0.0.1:41234.
func (a *Agent) Addr() net.Addr { return a.tr.Conn.LocalAddr() }

// Register adds regions of local memory that peers may read and write and
// that local descriptors may name. Regions must not overlap existing ones.
func (a *Agent) Register(regions ...Region) error {
	a.regMu.Lock()
	defer a.regMu.Unlock()
	next := append(regionSet(nil), a.regions...)
	for i, r := range regions {
		if err := validateRegion(i, r); err != nil {
			return err
		}
		for _, o := range next {
			if r.Base < o.Base+o.Len && o.Base < r.Base+r.Len {
				return errorf(v1.Code_CODE_ALREADY_EXISTS, "region %d [%#x, +%d) overlaps registered region [%#x, +%d)", i, r.Base, r.Len, o.Base, o.Len)
			}
		}
		r := r
		next = append(next, &r)
	}
	a.regions = next
	return nil
}

func (c *core) regionSet() regionSet {
	c.regMu.RLock()
	defer c.regMu.RUnlock()
	return c.regions
}

// Close closes every connection, the listener and the socket, and waits for
// the agent's goroutines. Transfers in flight fail with ErrUnavailable. A
// second Close returns an error wrapping net.ErrClosed.
func (a *Agent) Close() error { return a.CloseWithReason(v1.Code_CODE_OK, "agent closing") }

// CloseWithReason is Close, telling every peer why: its connections are
// closed with code as the QUIC application error code and reason as the
// reason phrase, which the peer's errors quote (e.g. a draining sidecar
// whose deadline passed).
func (a *Agent) CloseWithReason(code v1.Code, reason string) error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return fmt.Errorf("transfer: agent already closed: %w", net.ErrClosed)
	}
	a.closed = true
	a.closing.Store(true)
	ln := a.server.ln
	a.mu.Unlock()
	conns := append(a.dialer.shut(), a.server.shut()...)
	a.cancel(fmt.Errorf("transfer: agent closed: %w", net.ErrClosed))
	for _, c := range conns {
		_ = c.CloseWithError(quic.ApplicationErrorCode(code), reason)
	}
	if ln != nil {
		_ = ln.Close()
	}
	err := errors.Join(a.tr.Close(), a.dialer.closeLaneTransports())
	a.dialer.wg.Wait()
	a.server.wg.Wait()
	if cerr := a.tr.Conn.Close(); err == nil && cerr != nil && !errors.Is(cerr, net.ErrClosed) {
		err = cerr
	}
	return err
}

// isClosed reports whether Close has begun.
func (c *core) isClosed() bool { return c.closing.Load() }

// errClosed is returned by calls on a closed agent.
func errClosed() error {
	return fmt.Errorf("%w: transfer: agent closed: %w", ErrUnavailable, net.ErrClosed)
}

// qlogTracer writes one qlog file per connection into dir.
func qlogTracer(dir string, log *slog.Logger) func(context.Context, bool, quic.ConnectionID) qlogwriter.Trace {
	_ = qlog.EventSchema // the import registers the QUIC event schema
	return func(_ context.Context, isClient bool, id quic.ConnectionID) qlogwriter.Trace {
		role := "server"
		if isClient {
			role = "client"
		}
		path := filepath.Join(dir, fmt.Sprintf("%s_%s.sqlog", id, role))
		f, err := os.Create(path)
		if err != nil {
			log.Warn("transfer: cannot create qlog file", "path", path, "err", err)
			return nil
		}
		seq := qlogwriter.NewConnectionFileSeq(&bufferedFile{bufio.NewWriterSize(f, 64<<10), f}, isClient, id)
		go seq.Run()
		return seq
	}
}

type bufferedFile struct {
	*bufio.Writer
	f *os.File
}

func (b *bufferedFile) Close() error {
	err := b.Flush()
	if cerr := b.f.Close(); err == nil {
		err = cerr
	}
	return err
}
