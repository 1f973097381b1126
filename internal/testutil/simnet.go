package testutil

import (
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quic-go/quic-go/testutils/simnet"

	"github.com/kvsidecar/kvsidecar/internal/netem"
)

// SimNet is an in-memory UDP network (quic-go's testutils/simnet) for tests
// that run under testing/synctest: a datagram takes a fixed one-way delay of
// virtual time, so timeouts, keep-alives and RTTs are exact however loaded
// the machine is. A full receive buffer holds the sender back instead of
// dropping datagrams.
type SimNet struct {
	router simnet.PerfectRouter
	delay  time.Duration
	port   atomic.Uint32 // the last port Listen gave out for port 0
}

// NewSimNet returns a network whose datagrams take oneWay to arrive.
func NewSimNet(oneWay time.Duration) *SimNet { return &SimNet{delay: oneWay} }

// Listen opens a socket at addr ("10.0.0.1:5600"; port 0 picks one not
// given out before, from 20000 up) and closes it when the test ends. A later Listen on the same address takes its datagrams over,
// as a process restarted on the address would: Kill the old socket first so
// the old process says nothing more. The socket can go dark like one from
// ListenUDP.
func (n *SimNet) Listen(t testing.TB, addr string) *netem.PacketConn {
	t.Helper()
	pc, err := n.ListenPacket(addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pc.Close() })
	return pc
}

// ListenPacket is Listen for code that has no testing.TB; the caller
// closes the socket.
func (n *SimNet) ListenPacket(addr string) (*netem.PacketConn, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, fmt.Errorf("testutil: sim address %q: %w", addr, err)
	}
	// The 4-byte form of an IPv4 address, as the agents' resolver gives it:
	// simnet routes by the address's bytes.
	port := ap.Port()
	if port == 0 {
		port = uint16(20000 + n.port.Add(1))
	}
	ua := net.UDPAddrFromAddrPort(netip.AddrPortFrom(ap.Addr().Unmap(), port))
	sc := simnet.NewBlockingSimConn(ua, &n.router)
	n.router.AddNode(ua, delayed{sc, n.delay})
	return netem.New(sc, 0), nil
}

// delayed delivers each datagram to its socket after a fixed delay.
type delayed struct {
	to    simnet.PacketReceiver
	delay time.Duration
}

func (d delayed) RecvPacket(p simnet.Packet) {
	if d.delay <= 0 {
		d.to.RecvPacket(p)
		return
	}
	time.AfterFunc(d.delay, func() { d.to.RecvPacket(p) })
}
