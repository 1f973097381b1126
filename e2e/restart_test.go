package e2e

import (
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// holdProxy relays UDP datagrams between clients and a server address,
// each client through a socket of its own towards the server (as a NAT
// would), so that a decode's READ lanes, each from its own socket, keep
// their own paths. While holding, the server's datagrams to the clients
// are kept back (and counted) instead of delivered, until Release delivers
// them in order.
type holdProxy struct {
	front  net.PacketConn // the address the clients dial
	server net.Addr
	t      testing.TB
	wg     sync.WaitGroup

	mu      sync.Mutex
	closed  bool
	backs   map[string]net.PacketConn // a client's socket towards the server, by client address
	holding bool
	held    []heldDatagram
	// minReq, bigSent, answered: see Hold.
	minReq   int
	bigSent  bool
	answered chan struct{}
}

// heldDatagram is a server datagram kept back for a client.
type heldDatagram struct {
	b      []byte
	client net.Addr
}

// startHoldProxy relays between clients and a server on loopback until
// the test ends; Server is the address the server must listen on (free
// when the proxy started; picked after the proxy's own socket, so it is
// not it).
func startHoldProxy(t testing.TB) *holdProxy {
	t.Helper()
	front, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	sa, err := net.ResolveUDPAddr("udp", FreeUDPAddrs(t, "127.0.0.1", 1)[0])
	require.NoError(t, err)
	p := &holdProxy{front: front, server: sa, t: t, backs: map[string]net.PacketConn{}}
	p.wg.Add(1)
	go p.relay(front, func(b []byte, from net.Addr) {
		back := p.backFor(from)
		if back == nil {
			return
		}
		p.mu.Lock()
		if p.holding && len(b) >= p.minReq {
			p.bigSent = true
		}
		p.mu.Unlock()
		_, _ = back.WriteTo(b, sa)
	})
	t.Cleanup(func() {
		p.mu.Lock()
		p.closed = true
		backs := p.backs
		p.mu.Unlock()
		_ = front.Close()
		for _, b := range backs {
			_ = b.Close()
		}
		p.wg.Wait()
	})
	return p
}

// backFor returns client's socket towards the server, opening it (and its
// relay back to client) on the client's first datagram; nil once the
// proxy is closed.
func (p *holdProxy) backFor(client net.Addr) net.PacketConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	if b := p.backs[client.String()]; b != nil {
		return b
	}
	back, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		p.t.Errorf("proxy: socket towards the server for %s: %v", client, err)
		return nil
	}
	p.backs[client.String()] = back
	p.wg.Add(1)
	go p.relay(back, func(b []byte, _ net.Addr) {
		p.mu.Lock()
		if p.holding {
			if p.bigSent && p.answered != nil {
				close(p.answered)
				p.answered = nil
			}
			p.held = append(p.held, heldDatagram{b, client})
			p.mu.Unlock()
			return
		}
		p.mu.Unlock()
		_, _ = p.front.WriteTo(b, client)
	})
	return back
}

func (p *holdProxy) relay(pc net.PacketConn, deliver func([]byte, net.Addr)) {
	defer p.wg.Done()
	buf := make([]byte, 64<<10)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		deliver(append([]byte(nil), buf[:n]...), from)
	}
}

// Addr is the address clients dial.
func (p *holdProxy) Addr() string { return p.front.LocalAddr().String() }

// Server is the address the proxy relays to.
func (p *holdProxy) Server() string { return p.server.String() }

// Hold starts keeping the server's datagrams back. The channel it returns
// is closed when one is kept that came after a client datagram of at least
// minReq bytes: a request, not a keep-alive (a PING is about 25 bytes, a
// probe about 75), was answered.
func (p *holdProxy) Hold(minReq int) (answered <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	ch := make(chan struct{})
	p.holding, p.held, p.minReq, p.bigSent, p.answered = true, nil, minReq, false, ch
	return ch
}

// Release delivers the datagrams held back, in order, stops holding and
// returns how many there were.
func (p *holdProxy) Release() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, h := range p.held {
		_, _ = p.front.WriteTo(h.b, h.client)
	}
	n := len(p.held)
	p.holding, p.held = false, nil
	return n
}

// TestFaultPrefillRestartRace: a prefill is killed and restarted on the same
// address while the decode holds a connection to it, and 50 requests are
// issued right after the restart. The race seen under load is made
// deterministic by a proxy between the two that holds the new prefill's
// answers: the decode's handshake goes out on the dead connection, the new
// process answers it with a stateless reset, and the proxy delivers that
// reset only while the handshake is in flight. The decode redials once and
// every request succeeds byte-exact.
//
// fault-matrix: prefill-restart-race
func TestFaultPrefillRestartRace(t *testing.T) {
	const requests = 50
	env := NewEnv(t)
	proxy := startHoldProxy(t)
	pre := attachSide(t, env.StartSidecar(t, SidecarOpts{Engine: "pre", Listen: proxy.Server(),
		Args: faultArgs("--advertise", proxy.Addr())}), 1024)
	dec := startSide(t, env, "dec", 1024)
	warm(t, pre, dec) // the decode now holds a connection, through the proxy, and the metadata
	dials := dec.Metric(t, "kvsidecar_transfer_dials_total")
	hs := dec.Metric(t, "kvsidecar_handshake_seconds_count")

	answered := proxy.Hold(200) // the handshake request carries the decode's metadata: several hundred bytes
	pre.Kill(t)
	// The same flags, TLS files (so the same stateless-reset key) and
	// --listen address (Restart would take the advertised one: the proxy's).
	pre2 := attachSide(t, env.StartSidecar(t, pre.Opts), 1024)
	params := make([]*v1.KVTransferParams, requests)
	for i := range params {
		params[i] = pre2.export(t, fmt.Sprint("r", i), uint64(100+i), 4)
	}
	dst := make([][]uint32, requests)
	for i, p := range params {
		dst[i] = dec.load(t, fmt.Sprint("r", i), p)
	}
	// The handshake with the new incarnation goes out on the dead
	// connection and the new process answers it with a stateless reset,
	// which the proxy keeps back (with the resets to keep-alive probes).
	select {
	case <-answered:
	case <-time.After(testutil.Scaled(30 * time.Second)):
		t.Fatal("the new prefill never answered the dead connection")
	}
	n := proxy.Release()
	t.Logf("released %d datagram(s) the new prefill sent to the dead connection", n)

	for i := range params {
		dec.requireDone(t, fmt.Sprint("r", i), uint64(100+i), dst[i])
	}
	redial := dec.WaitLog(t, "transfer: connection died under a call; redialing once", 10*time.Second)
	require.Contains(t, redial["err"], "stateless reset", "the reset the proxy held ended the dead connection under the handshake")
	require.Equal(t, dials+1, dec.Metric(t, "kvsidecar_transfer_dials_total"), "one redial for all %d requests", requests)
	require.Equal(t, hs+1, dec.Metric(t, "kvsidecar_handshake_seconds_count"), "one handshake with the new incarnation")
	for i := range params {
		pre2.waitSent(t, fmt.Sprint("r", i), 30*time.Second)
		dec.free(t, dst[i])
	}
	pre2.requireIdle(t)
	dec.requireIdle(t)
}

// TestFaultPrefillRestartBeforeAttach: a prefill sidecar SIGKILLed and
// started again on the same address (same TLS files) serves nothing until
// its engine attaches. A decode warm with the old process loads params the
// old one issued: its READ on the dead connection draws a stateless reset
// from the new process's standby, the redial is refused with the standby's
// reason, and the request fails at once with CODE_UNAVAILABLE, not after
// the 10 s progress deadline on an unread socket. Once the engine attached,
// new requests succeed.
//
// fault-matrix: prefill-restart-before-attach
func TestFaultPrefillRestartBeforeAttach(t *testing.T) {
	const deadline = 10 * time.Second
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 1024, "--progress-timeout", flagDur(deadline))
	dec := startSide(t, env, "dec", 1024, "--progress-timeout", flagDur(deadline))
	warm(t, pre, dec)
	old := pre.export(t, "old", 7, 4)

	pre.Kill(t)
	restarted := env.Restart(t, pre.Sidecar) // no engine attached
	start := time.Now()
	dst := dec.load(t, "old", old)
	f := dec.requireFailed(t, "old", dst, 30*time.Second)
	took := time.Since(start)
	t.Logf("failed after %v: %v %s", took, f.GetError().GetCode(), f.GetError().GetMessage())
	require.Equal(t, v1.Code_CODE_UNAVAILABLE, f.GetError().GetCode(), f.GetError().GetMessage())
	require.Contains(t, f.GetError().GetMessage(), "no engine is attached to this sidecar")
	require.Less(t, took, testutil.Scaled(deadline), "refused before the progress deadline")
	dec.free(t, dst)

	pre2 := attachSide(t, restarted, 1024)
	p := pre2.export(t, "new", 8, 4)
	dst = dec.load(t, "new", p)
	dec.requireDone(t, "new", 8, dst)
	pre2.waitSent(t, "new", 30*time.Second)
	dec.free(t, dst)
	pre2.requireIdle(t)
	dec.requireIdle(t)
}
