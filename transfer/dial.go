package transfer

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// dialer is the dialing half of an Agent: the connections it dials, one
// cached connection per peer address (lane 0, with its READ lanes), and
// what it keeps per address beyond one connection: the dials counted, the
// connection that last ended refused or could not be dialed, the in-flight
// byte budget of transfers to it; and the READ lanes' sockets. The calls on
// those connections (client.go) go through withConn (redial.go). Its lock
// is its own (the serving half never takes it); its goroutines, a dial,
// and a dialed connection's watcher with its probe, are in wg.
type dialer struct {
	*core
	tls      *tls.Config // Config.ClientTLS for TLS 1.3 and ALPN; nil: the agent does not dial
	sessions tls.ClientSessionCache

	mu     sync.Mutex
	closed bool // the agent is closing: no peer is added, no goroutine started
	peers  map[string]*peer
	dials  map[string]int
	// failedDials[addr] is the last connection to addr that ended refused
	// or could not be dialed, and the calls it answers (see peerFor).
	failedDials map[string]failedDial
	budgets     map[string]*budget // of transfers dialed to addr (budgetFor)
	laneTrs     []*quic.Transport  // READ lane i's transport at i-1, opened on first use
	local       localDialer        // same-host connections (samehost_dial.go)

	wg sync.WaitGroup

	calls    atomic.Uint64 // numbers the calls into withConn, in start order
	nextXfer atomic.Uint64
	nextList atomic.Uint64
}

// newDialer makes the dialing half of an agent on co (with
// co.cfg.ClientTLS nil: one that cannot dial).
func newDialer(co *core) *dialer {
	d := &dialer{core: co, peers: make(map[string]*peer), dials: make(map[string]int),
		failedDials: make(map[string]failedDial), budgets: make(map[string]*budget)}
	ct := co.cfg.ClientTLS
	if ct == nil {
		return d
	}
	d.tls = ct.Clone()
	d.tls.MinVersion = tls.VersionTLS13
	d.tls.NextProtos = []string{ALPN}
	d.sessions = d.tls.ClientSessionCache
	if d.sessions == nil {
		d.sessions = tls.NewLRUClientSessionCache(256)
	}
	return d
}

// cached returns the cached connection to addr (or the dial in progress),
// nil when there is none.
func (d *dialer) cached(addr string) *peer {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.peers[addr]
}

// shut marks the dialer closed, so no dial starts from now on, and returns
// the connections to close: every dialed one, READ lanes included.
func (d *dialer) shut() []*quic.Conn {
	d.mu.Lock()
	d.closed = true
	var up []*peer
	for _, p := range d.peers {
		select {
		case <-p.ready:
			if p.conn != nil {
				up = append(up, p)
			}
		default:
		}
	}
	d.mu.Unlock()
	var conns []*quic.Conn
	for _, p := range up {
		conns = append(conns, p.conn)
		conns = append(conns, p.laneConns()...) // lanes lock p.lanes.mu, then d.mu
	}
	d.shutLocal()
	return conns
}

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

// failedDial records a connection to an address that ended refused (a TLS
// alert, a close with a code) or was never had (the dial failed): err, the
// error of the call that met it, answers every call numbered up to call.
type failedDial struct {
	p    *peer // whose connection it was
	call uint64
	err  error
}

// dropFailed drops p, whose connection ended refused or could not be had,
// from the cache and records err for its address in the same step (a call
// in between would find neither and dial again): the calls already started
// (they raced the one that met the refusal, as a connector's metadata
// exchange and READ to a new peer do) get err instead of dialing again;
// calls started from now on dial anew, once each. With keep, a record of
// p's failure made already stays: a call's error (what a caller reads
// off the stream) names it better than the cause the watcher has.
func (d *dialer) dropFailed(p *peer, err error, keep bool) {
	d.mu.Lock()
	if d.peers[p.addr] == p {
		delete(d.peers, p.addr)
	}
	if f, ok := d.failedDials[p.addr]; !keep || !ok || f.p != p {
		d.failedDials[p.addr] = failedDial{p: p, call: d.calls.Load(), err: err}
	}
	d.mu.Unlock()
}

// callMark is the context key under which MarkCalls keeps the number of
// the first call made after it, per agent.
type callMark struct{ d *dialer }

// markCalls is Agent.MarkCalls.
func (d *dialer) markCalls(ctx context.Context) context.Context {
	return context.WithValue(ctx, callMark{d}, d.calls.Load()+1)
}

// markedCall is call, or the call number ctx was marked with when lower.
func (d *dialer) markedCall(ctx context.Context, call uint64) uint64 {
	if m, ok := ctx.Value(callMark{d}).(uint64); ok {
		return min(call, m)
	}
	return call
}

// peerFor returns a usable connection to addr for call (its number from
// Agent.calls), dialing (with 0-RTT when a session ticket is cached) if
// there is none, unless a connection to addr ended refused or failed to
// dial after call started: then that error.
func (d *dialer) peerFor(ctx context.Context, addr string, call uint64) (*peer, error) {
	if d.tls == nil {
		return nil, fmt.Errorf("%w: transfer: Config.ClientTLS is nil, this agent cannot dial %s", ErrInvalidArgument, addr)
	}
	for {
		d.mu.Lock()
		if d.closed {
			d.mu.Unlock()
			return nil, errClosed()
		}
		p := d.peers[addr]
		if f, ok := d.failedDials[addr]; p == nil && ok && call <= f.call {
			d.mu.Unlock()
			return nil, f.err
		}
		if p == nil {
			p = &peer{addr: addr, ready: make(chan struct{})}
			d.peers[addr] = p
			if d.dials[addr] > 0 {
				d.m.reconnects.Inc()
			}
			d.dials[addr]++
			// The dial belongs to the agent, not to this caller: a caller
			// that gives up leaves it running for the others waiting on p.
			d.wg.Add(1)
			d.mu.Unlock()
			go d.dial(p, d.tr)
		} else {
			d.mu.Unlock()
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
			d.dropFailed(p, p.err, false)
			return nil, p.err
		}
		// The connection died and its watcher may not have said so yet:
		// tell OnPeerGone before a new connection to addr is used, so what
		// was learned on the old one (agent metadata) is dropped first.
		d.peerGone(p)
	}
}

// peerGone drops p's connection, which has ended, from the cache (recording
// a refusal that ended it, as dropFailed does, whoever noticed it first) and
// tells OnPeerGone, once per connection, whoever notices first: the
// watcher, a caller finding it dead, or the redial rule.
func (d *dialer) peerGone(p *peer) {
	if cause := context.Cause(p.conn.Context()); connEnded(cause) && !connDied(cause) {
		d.dropFailed(p, d.streamErr(context.Background(), p.addr, cause), true)
	} else {
		d.dropPeer(p)
	}
	d.closeLanes(p)
	p.gone.Do(func() {
		if d.isClosed() {
			return
		}
		cause := context.Cause(p.conn.Context())
		d.log.Info("transfer: peer connection lost", "peer", p.addr, "err", cause)
		if d.cfg.OnPeerGone != nil {
			d.cfg.OnPeerGone(p.addr, cause)
		}
	})
}

func (d *dialer) dropPeer(p *peer) {
	d.mu.Lock()
	if d.peers[p.addr] == p {
		delete(d.peers, p.addr)
	}
	d.mu.Unlock()
}

// dial connects p from tr and closes p.ready. It runs on the agent's goroutine
// under the agent's context bounded by Config.HandshakeTimeout (address
// resolution included), never under a caller's: every caller waiting on p
// shares its outcome, whichever of them gives up first. The caller added
// it to the dialer's goroutines.
func (d *dialer) dial(p *peer, tr *quic.Transport) {
	defer d.wg.Done()
	defer close(p.ready)
	ctx, cancel := context.WithTimeoutCause(d.ctx, d.cfg.HandshakeTimeout,
		fmt.Errorf("transfer: dial %s: no handshake within Config.HandshakeTimeout %v: %w", p.addr, d.cfg.HandshakeTimeout, context.DeadlineExceeded))
	defer cancel()
	udp, err := resolveUDP(ctx, p.addr)
	if err != nil {
		if d.isClosed() {
			err = errClosed()
		}
		p.err = err
		return
	}
	if ap := d.cfg.AllowedPeers; ap != nil {
		if err := ap.check(p.addr, udp.AddrPort()); err != nil {
			d.log.Warn("transfer: refused to dial a peer outside the allowed peers", "peer", p.addr, "resolved", udp.String(), "allowed", ap.String())
			p.err = err
			return
		}
	}
	tc := d.tls.Clone()
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
	tc.ClientSessionCache = keyedCache{d.sessions, key}
	if tc.ServerName == "" {
		// Verify the name dialled: an IP address against the certificate's
		// IP SANs, a DNS name against its DNS SANs (what serve checks its
		// own certificate against at start).
		tc.ServerName, _, _ = net.SplitHostPort(p.addr)
	}
	d.dialingTLS(tc, p.addr)
	var conn *quic.Conn
	if p.lane == 0 {
		d.m.dials.Inc()
		conn, err = tr.DialEarly(ctx, udp, tc, d.qconf)
	} else {
		// A READ lane carries nothing before its handshake completes, so
		// it never sends 0-RTT: no stream of it can meet a rejection.
		conn, err = tr.Dial(ctx, udp, tc, d.qconf)
	}
	if err != nil {
		if d.isClosed() {
			err = errClosed()
		} else if ctx.Err() != nil {
			err = context.Cause(ctx)
		}
		p.err = fmt.Errorf("%w: transfer: dial %s: %w", ErrUnavailable, p.addr, err)
		return
	}
	p.conn = conn
	d.mu.Lock()
	closed := d.closed
	if !closed {
		d.wg.Add(1)
	}
	d.mu.Unlock()
	if closed {
		_ = conn.CloseWithError(0, "agent closing")
		p.conn, p.err = nil, errClosed()
		return
	}
	go d.watch(p)
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
func (d *dialer) watch(p *peer) {
	defer d.wg.Done()
	conn := p.conn
	select {
	case <-conn.HandshakeComplete():
		_, _ = conn.NextConnection(conn.Context())
		if conn.ConnectionState().Used0RTT {
			d.m.zeroRTT.Inc()
		}
	case <-conn.Context().Done():
	}
	d.probe(conn)
	if p.lane == 0 {
		d.peerGone(p)
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
func (d *dialer) probe(conn *quic.Conn) {
	if !conn.ConnectionState().SupportsDatagrams.Remote {
		<-conn.Context().Done() // a peer without datagrams: quic-go's PINGs only
		return
	}
	t := time.NewTicker(d.cfg.KeepAlivePeriod)
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

// peerInfo is Agent.PeerInfo.
func (d *dialer) peerInfo(ctx context.Context, addr string) (PeerInfo, error) {
	d.mu.Lock()
	p, dials := d.peers[addr], d.dials[addr]
	d.mu.Unlock()
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

// dialCount is Agent.DialCount.
func (d *dialer) dialCount(addr string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dials[addr]
}

// alive is Agent.Alive.
func (d *dialer) alive(addr string) bool {
	p := d.cached(addr)
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

// disconnect is Agent.Disconnect.
func (d *dialer) disconnect(addr string) {
	p := d.cached(addr)
	if p == nil {
		return
	}
	<-p.ready
	if p.conn != nil {
		_ = p.conn.CloseWithError(0, "disconnect")
		<-p.conn.Context().Done()
		d.peerGone(p) // before returning, as the doc says, not when the watcher gets to it
		return
	}
	d.dropPeer(p)
}

// budgetFor returns the in-flight byte budget of dialed transfers to addr.
func (d *dialer) budgetFor(addr string) *budget {
	d.mu.Lock()
	defer d.mu.Unlock()
	b := d.budgets[addr]
	if b == nil {
		b = newBudget(d.cfg.MaxInflightPerPeer)
		d.budgets[addr] = b
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
