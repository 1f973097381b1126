package transfer

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

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
type Agent struct {
	cfg       *Config
	tr        *quic.Transport
	ln        *quic.EarlyListener
	qconf     *quic.Config
	clientTLS *tls.Config
	sessions  tls.ClientSessionCache
	m         *metrics
	log       *slog.Logger

	ctx    context.Context
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup

	regMu   sync.RWMutex
	regions regionSet

	mu     sync.Mutex
	closed bool
	peers  map[string]*peer
	dials  map[string]int
	// failedDials[addr] is the last connection to addr that ended refused
	// or could not be dialed, and the calls it answers (see peerFor).
	failedDials map[string]failedDial
	budgets     map[string]*budget
	servConns   map[*quic.Conn]struct{}
	laneTrs     []*quic.Transport // READ lane i's transport at i-1, opened on first use

	calls    atomic.Uint64 // numbers the calls into withConn, in start order
	nextXfer atomic.Uint64
	nextList atomic.Uint64
	moved    atomic.Uint64 // payload bytes, counted as they move (meter)
	refusals refusalLog    // rate limit of the refusal log lines
}

// meter returns the counter of payload bytes of transfers of op in role
// (roleClient: dialed, roleServer: served), counted as they move rather than
// when a transfer ends, so kvsidecar_transfer_bytes_total and BytesMoved
// advance during a long transfer.
func (a *Agent) meter(op Op, role int) func(int) {
	c := a.m.op(op).bytes[role]
	return func(n int) {
		c.Add(float64(n))
		a.moved.Add(uint64(n))
	}
}

// BytesMoved is the payload bytes this agent's transfers moved so far, both
// ops and roles, transfers in flight included: for a READ it dialed, the
// bytes that landed in local memory; for one it served, the bytes written
// to the stream (WRITE the mirror).
func (a *Agent) BytesMoved() uint64 { return a.moved.Load() }

// peer is one dialed connection (or a dial in progress).
type peer struct {
	addr     string
	ready    chan struct{} // closed when the dial finished
	conn     *quic.Conn    // set before ready is closed, nil on error
	err      error
	notifMu  sync.Mutex // serializes notifications so they arrive in order
	attempt0 bool       // dialed with a session ticket available
	gone     sync.Once  // OnPeerGone runs once per connection
	lane     int        // 0: the cached connection; i > 0: READ lane i of one
	lanes    laneGroup  // lane 0's READ lanes 1..K-1
}

// PeerInfo describes the current connection to a remote agent.
type PeerInfo struct {
	// Addr is the remote address as dialed.
	Addr string
	// Dials counts connections dialed to Addr since the agent started.
	Dials int
	// Used0RTT is true when the server accepted this connection's 0-RTT data.
	Used0RTT bool
	// LocalAddr and RemoteAddr are the connection's UDP endpoints.
	LocalAddr, RemoteAddr net.Addr
	// ReadLanes is the number of connections to Addr with a completed
	// handshake that a large READ is striped over now, lane 0 included:
	// 1 when Config.ReadLanes is 1 or no other lane is up.
	ReadLanes int
}

// New starts an agent: it opens (or adopts) the UDP socket and, when
// ServerTLS is set, starts accepting connections. It returns an error naming
// the Config field for an invalid config.
func New(cfg *Config) (*Agent, error) {
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
	a := &Agent{
		cfg:         c,
		tr:          &quic.Transport{Conn: pc, StatelessResetKey: c.StatelessResetKey},
		qconf:       QUICConfig(c),
		m:           m,
		log:         c.Logger,
		peers:       make(map[string]*peer),
		dials:       make(map[string]int),
		failedDials: make(map[string]failedDial),
		budgets:     make(map[string]*budget),
		servConns:   make(map[*quic.Conn]struct{}),
	}
	a.ctx, a.cancel = context.WithCancelCause(context.Background())
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
	if c.ClientTLS != nil {
		a.clientTLS = c.ClientTLS.Clone()
		a.clientTLS.MinVersion = tls.VersionTLS13
		a.clientTLS.NextProtos = []string{ALPN}
		a.sessions = a.clientTLS.ClientSessionCache
		if a.sessions == nil {
			a.sessions = tls.NewLRUClientSessionCache(256)
		}
	}
	if c.ServerTLS != nil {
		ln, err := a.tr.ListenEarly(a.servingTLS(servingBase(c.ServerTLS)), a.qconf)
		if err != nil {
			a.tr.Close()
			pc.Close()
			return nil, fmt.Errorf("transfer: listen: %w", err)
		}
		a.ln = ln
		a.wg.Add(1)
		go a.acceptLoop()
	}
	return a, nil
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

func (a *Agent) regionSet() regionSet {
	a.regMu.RLock()
	defer a.regMu.RUnlock()
	return a.regions
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
	var (
		conns []*quic.Conn
		up    []*peer
	)
	for _, p := range a.peers {
		select {
		case <-p.ready:
			if p.conn != nil {
				up = append(up, p)
			}
		default:
		}
	}
	for c := range a.servConns {
		conns = append(conns, c)
	}
	a.mu.Unlock()
	for _, p := range up {
		conns = append(conns, p.conn)
		conns = append(conns, p.laneConns()...) // lanes lock p.lanes.mu, then a.mu
	}
	a.cancel(fmt.Errorf("transfer: agent closed: %w", net.ErrClosed))
	for _, c := range conns {
		_ = c.CloseWithError(quic.ApplicationErrorCode(code), reason)
	}
	if a.ln != nil {
		_ = a.ln.Close()
	}
	err := errors.Join(a.tr.Close(), a.closeLaneTransports())
	a.wg.Wait()
	if cerr := a.tr.Conn.Close(); err == nil && cerr != nil && !errors.Is(cerr, net.ErrClosed) {
		err = cerr
	}
	return err
}

func (a *Agent) isClosed() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.closed
}

// errClosed is returned by calls on a closed agent.
func errClosed() error {
	return fmt.Errorf("%w: transfer: agent closed: %w", ErrUnavailable, net.ErrClosed)
}

// failedDial records a connection to an address that ended refused (a TLS
// alert, a close with a code) or was never had (the dial failed): err, the
// error of the call that met it, answers every call numbered up to call.
type failedDial struct {
	call uint64
	err  error
}

// noteFailedDial records that the connection to addr ended refused or could
// not be had, with err: the calls already started (they raced the one that
// met the refusal, as a connector's metadata exchange and READ to a new
// peer do) get err instead of dialing again; calls started from now on
// dial anew, once each.
func (a *Agent) noteFailedDial(addr string, err error) {
	a.mu.Lock()
	a.failedDials[addr] = failedDial{call: a.calls.Load(), err: err}
	a.mu.Unlock()
}

// peerFor returns a usable connection to addr for call (its number from
// Agent.calls), dialing (with 0-RTT when a session ticket is cached) if
// there is none, unless a connection to addr ended refused or failed to
// dial after call started: then that error.
func (a *Agent) peerFor(ctx context.Context, addr string, call uint64) (*peer, error) {
	if a.clientTLS == nil {
		return nil, fmt.Errorf("%w: transfer: Config.ClientTLS is nil, this agent cannot dial %s", ErrInvalidArgument, addr)
	}
	for {
		a.mu.Lock()
		if a.closed {
			a.mu.Unlock()
			return nil, errClosed()
		}
		p := a.peers[addr]
		if f, ok := a.failedDials[addr]; p == nil && ok && call <= f.call {
			a.mu.Unlock()
			return nil, f.err
		}
		if p == nil {
			p = &peer{addr: addr, ready: make(chan struct{})}
			a.peers[addr] = p
			if a.dials[addr] > 0 {
				a.m.reconnects.Inc()
			}
			a.dials[addr]++
			// The dial belongs to the agent, not to this caller: a caller
			// that gives up leaves it running for the others waiting on p.
			a.wg.Add(1)
			a.mu.Unlock()
			go a.dial(p, a.tr)
		} else {
			a.mu.Unlock()
		}
		select {
		case <-p.ready:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
		if p.err == nil && p.conn.Context().Err() == nil {
			return p, nil
		}
		if p.err != nil {
			a.dropPeer(p)
			a.noteFailedDial(addr, p.err)
			return nil, p.err
		}
		// The connection died and its watcher may not have said so yet:
		// tell OnPeerGone before a new connection to addr is used, so what
		// was learned on the old one (agent metadata) is dropped first.
		a.peerGone(p)
	}
}

// peerGone drops p's connection, which has ended, from the cache and tells
// OnPeerGone, once per connection, whoever notices first: the watcher, a
// caller finding it dead, or the redial rule.
func (a *Agent) peerGone(p *peer) {
	a.dropPeer(p)
	a.closeLanes(p)
	p.gone.Do(func() {
		if a.isClosed() {
			return
		}
		cause := context.Cause(p.conn.Context())
		a.log.Info("transfer: peer connection lost", "peer", p.addr, "err", cause)
		if a.cfg.OnPeerGone != nil {
			a.cfg.OnPeerGone(p.addr, cause)
		}
	})
}

func (a *Agent) dropPeer(p *peer) {
	a.mu.Lock()
	if a.peers[p.addr] == p {
		delete(a.peers, p.addr)
	}
	a.mu.Unlock()
}

// dial connects p from tr and closes p.ready. It runs on the agent's goroutine
// under the agent's context bounded by Config.HandshakeTimeout (address
// resolution included), never under a caller's: every caller waiting on p
// shares its outcome, whichever of them gives up first.
func (a *Agent) dial(p *peer, tr *quic.Transport) {
	defer a.wg.Done()
	defer close(p.ready)
	ctx, cancel := context.WithTimeoutCause(a.ctx, a.cfg.HandshakeTimeout,
		fmt.Errorf("transfer: dial %s: no handshake within Config.HandshakeTimeout %v: %w", p.addr, a.cfg.HandshakeTimeout, context.DeadlineExceeded))
	defer cancel()
	udp, err := resolveUDP(ctx, p.addr)
	if err != nil {
		if a.isClosed() {
			err = errClosed()
		}
		p.err = err
		return
	}
	if ap := a.cfg.AllowedPeers; ap != nil {
		if err := ap.check(p.addr, udp.AddrPort()); err != nil {
			a.log.Warn("transfer: refused to dial a peer outside the allowed peers", "peer", p.addr, "resolved", udp.String(), "allowed", ap.String())
			p.err = err
			return
		}
	}
	tc := a.clientTLS.Clone()
	// Session tickets are kept per peer address, not per host name, so
	// agents sharing an IP do not try each other's tickets.
	key := p.addr
	if p.lane > 0 {
		// A READ lane keeps its own ticket: the lanes dial at once, and
		// one ticket resumed by concurrent dials is written by quic-go
		// while crypto/tls reads it (quic-go v0.65 crypto_setup.go
		// QUICResumeSession sets SessionState.EarlyData; the race
		// detector reports it).
		key = fmt.Sprintf("%s#lane%d", p.addr, p.lane)
	}
	tc.ClientSessionCache = keyedCache{a.sessions, key}
	if tc.ServerName == "" {
		// Verify the name dialled: an IP address against the certificate's
		// IP SANs, a DNS name against its DNS SANs (what serve checks its
		// own certificate against at start).
		tc.ServerName, _, _ = net.SplitHostPort(p.addr)
	}
	a.dialingTLS(tc, p.addr)
	var conn *quic.Conn
	if p.lane == 0 {
		a.m.dials.Inc()
		conn, err = tr.DialEarly(ctx, udp, tc, a.qconf)
	} else {
		// A READ lane carries nothing before its handshake completes, so
		// it never sends 0-RTT: no stream of it can meet a rejection.
		conn, err = tr.Dial(ctx, udp, tc, a.qconf)
	}
	if err != nil {
		if a.isClosed() {
			err = errClosed()
		} else if ctx.Err() != nil {
			err = context.Cause(ctx)
		}
		p.err = fmt.Errorf("%w: transfer: dial %s: %w", ErrUnavailable, p.addr, err)
		return
	}
	p.conn = conn
	a.mu.Lock()
	closed := a.closed
	if !closed {
		a.wg.Add(1)
	}
	a.mu.Unlock()
	if closed {
		_ = conn.CloseWithError(0, "agent closing")
		p.conn, p.err = nil, errClosed()
		return
	}
	go a.watch(p)
}

// resolveUDP resolves a peer's host:port with net.DefaultResolver under
// ctx, so a slow name server cannot hold a dial past its deadline. Like
// net.ResolveUDPAddr it prefers an IPv4 address. Errors: ErrInvalidArgument
// for a malformed address or a name that does not exist, ErrUnavailable when
// the lookup fails otherwise (context.Cause(ctx) when it ran out of time).
func resolveUDP(ctx context.Context, addr string) (*net.UDPAddr, error) {
	host, port, err := net.SplitHostPort(addr)
	if err == nil && host == "" {
		err = errors.New("no host")
	}
	if err != nil {
		return nil, fmt.Errorf("%w: transfer: peer address %q: %w", ErrInvalidArgument, addr, err)
	}
	pn, err := net.DefaultResolver.LookupPort(ctx, "udp", port)
	if err != nil {
		return nil, fmt.Errorf("%w: transfer: peer address %q: port: %w", ErrInvalidArgument, addr, err)
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		return net.UDPAddrFromAddrPort(netip.AddrPortFrom(ip, uint16(pn))), nil
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		var de *net.DNSError
		if errors.As(err, &de) && de.IsNotFound {
			return nil, fmt.Errorf("%w: transfer: peer address %q: %w", ErrInvalidArgument, addr, err)
		}
		if ctx.Err() != nil {
			err = context.Cause(ctx)
		}
		return nil, fmt.Errorf("%w: transfer: resolve peer address %q: %w", ErrUnavailable, addr, err)
	}
	if len(ips) == 0 {
		return nil, fmt.Errorf("%w: transfer: peer address %q: host has no address", ErrInvalidArgument, addr)
	}
	best := ips[0]
	for _, ip := range ips {
		if ip.Unmap().Is4() {
			best = ip
			break
		}
	}
	return net.UDPAddrFromAddrPort(netip.AddrPortFrom(best.Unmap(), uint16(pn))), nil
}

// watch follows one dialed connection: it records whether 0-RTT was
// accepted, re-enables streams after a 0-RTT rejection, probes it while it
// lasts, and reports the peer gone when lane 0 ends.
func (a *Agent) watch(p *peer) {
	defer a.wg.Done()
	conn := p.conn
	select {
	case <-conn.HandshakeComplete():
		_, _ = conn.NextConnection(conn.Context())
		if conn.ConnectionState().Used0RTT {
			a.m.zeroRTT.Inc()
		}
	case <-conn.Context().Done():
	}
	a.probe(conn)
	if p.lane == 0 {
		a.peerGone(p)
	}
}

// probeBytes is the payload of a keep-alive probe. quic-go answers a packet
// of a connection it does not know with a stateless reset only when the
// packet is larger than 42 bytes (protocol.MinStatelessResetSize, quic-go
// v0.65), and its keep-alive PINGs are about 25: a probe carries enough to
// draw the reset, whatever the header sizes.
const probeBytes = 48

// probe sends a QUIC datagram of probeBytes on conn every KeepAlivePeriod
// until conn ends, so an idle connection to a peer that restarted on its
// address learns of it from the new process's stateless reset within one
// period. The serving agent discards the probes (serveConn).
func (a *Agent) probe(conn *quic.Conn) {
	if !conn.ConnectionState().SupportsDatagrams.Remote {
		<-conn.Context().Done() // a peer without datagrams: quic-go's PINGs only
		return
	}
	t := time.NewTicker(a.cfg.KeepAlivePeriod)
	defer t.Stop()
	payload := make([]byte, probeBytes)
	for {
		select {
		case <-conn.Context().Done():
			return
		case <-t.C:
			_ = conn.SendDatagram(payload) // fails only once conn ended
		}
	}
}

// PeerInfo waits for the current connection to addr to finish its handshake
// and describes it. It returns an error of class ErrNotFound when there is no
// connection to addr, or context.Cause(ctx).
func (a *Agent) PeerInfo(ctx context.Context, addr string) (PeerInfo, error) {
	a.mu.Lock()
	p, dials := a.peers[addr], a.dials[addr]
	a.mu.Unlock()
	if p == nil {
		return PeerInfo{Addr: addr, Dials: dials}, errorf(v1.Code_CODE_NOT_FOUND, "no connection to %s", addr)
	}
	select {
	case <-p.ready:
	case <-ctx.Done():
		return PeerInfo{}, context.Cause(ctx)
	}
	if p.err != nil {
		return PeerInfo{Addr: addr, Dials: dials}, p.err
	}
	select {
	case <-p.conn.HandshakeComplete():
	case <-p.conn.Context().Done():
	case <-ctx.Done():
		return PeerInfo{}, context.Cause(ctx)
	}
	lanes := 1
	for _, c := range p.laneConns() {
		if c.Context().Err() == nil && handshakeDone(c) {
			lanes++
		}
	}
	return PeerInfo{
		Addr: addr, Dials: dials, Used0RTT: p.conn.ConnectionState().Used0RTT,
		LocalAddr: p.conn.LocalAddr(), RemoteAddr: p.conn.RemoteAddr(), ReadLanes: lanes,
	}, nil
}

// DialCount is the number of connections dialed to addr so far.
func (a *Agent) DialCount(addr string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.dials[addr]
}

// Alive reports whether the agent holds a connection to addr that is up
// (a dial in progress counts as up). A later call to addr on a dead one
// dials again.
func (a *Agent) Alive(addr string) bool {
	a.mu.Lock()
	p := a.peers[addr]
	a.mu.Unlock()
	if p == nil {
		return false
	}
	select {
	case <-p.ready:
		return p.err == nil && p.conn.Context().Err() == nil
	default:
		return true
	}
}

// Disconnect closes the connection to addr, if any, without closing the
// agent; the next call to addr dials again (with 0-RTT). OnPeerGone has
// been called for it when Disconnect returns.
func (a *Agent) Disconnect(addr string) {
	a.mu.Lock()
	p := a.peers[addr]
	a.mu.Unlock()
	if p == nil {
		return
	}
	<-p.ready
	if p.conn != nil {
		_ = p.conn.CloseWithError(0, "disconnect")
		<-p.conn.Context().Done()
		a.peerGone(p) // before returning, as the doc says, not when the watcher gets to it
		return
	}
	a.dropPeer(p)
}

// budgetFor returns the in-flight byte budget of dialed transfers to addr.
func (a *Agent) budgetFor(addr string) *budget {
	a.mu.Lock()
	defer a.mu.Unlock()
	b := a.budgets[addr]
	if b == nil {
		b = newBudget(a.cfg.MaxInflightPerPeer)
		a.budgets[addr] = b
	}
	return b
}

// keyedCache stores session tickets under the peer address.
type keyedCache struct {
	c   tls.ClientSessionCache
	key string
}

func (k keyedCache) Get(string) (*tls.ClientSessionState, bool) { return k.c.Get(k.key) }
func (k keyedCache) Put(_ string, cs *tls.ClientSessionState)   { k.c.Put(k.key, cs) }

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
