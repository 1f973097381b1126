package netem

import (
	"net"
	"syscall"
	"time"

	"golang.org/x/net/ipv4"
)

// UDPConn is a PacketConn over a *net.UDPConn that keeps the socket's batch
// interfaces, which quic-go uses when a socket offers them
// (quic.OOBCapablePacketConn): reads of many datagrams per system call
// (recvmmsg), and writes of a GSO batch (one buffer, many datagrams) or ECN
// marks through WriteMsgUDP. A delayed GSO batch stays one write. Going
// dark works as on a PacketConn.
type UDPConn struct {
	*PacketConn
	batch *ipv4.PacketConn
}

// NewUDP wraps udp like New, keeping its batch interfaces. Close closes
// udp.
func NewUDP(udp *net.UDPConn, delay time.Duration) *UDPConn {
	c := New(udp, delay)
	c.udp = udp
	return &UDPConn{PacketConn: c, batch: ipv4.NewPacketConn(udp)}
}

// SyscallConn is the socket's.
func (c *UDPConn) SyscallConn() (syscall.RawConn, error) { return c.udp.SyscallConn() }

// SetReadBuffer sets the socket's receive buffer.
func (c *UDPConn) SetReadBuffer(n int) error { return c.udp.SetReadBuffer(n) }

// SetWriteBuffer sets the socket's send buffer.
func (c *UDPConn) SetWriteBuffer(n int) error { return c.udp.SetWriteBuffer(n) }

// WriteMsgUDP sends b (one datagram, or a GSO batch when oob says so) with
// its control message after the delay, or drops it when the socket is
// dark. It never blocks on the delay.
func (c *UDPConn) WriteMsgUDP(b, oob []byte, addr *net.UDPAddr) (n, oobn int, err error) {
	if c.count(len(b)) {
		return len(b), len(oob), nil
	}
	if c.delay <= 0 {
		return c.udp.WriteMsgUDP(b, oob, addr)
	}
	c.enqueue(b, oob, addr)
	return len(b), len(oob), nil
}

// ReadMsgUDP reads the next datagram and its control message, discarding
// those that arrive while the socket is dark.
func (c *UDPConn) ReadMsgUDP(b, oob []byte) (n, oobn, flags int, addr *net.UDPAddr, err error) {
	for {
		n, oobn, flags, addr, err = c.udp.ReadMsgUDP(b, oob)
		if err != nil || !c.dead.Load() {
			return n, oobn, flags, addr, err
		}
	}
}

// ReadBatch reads up to len(ms) datagrams in one system call (quic-go's
// batch reads), discarding those that arrive while the socket is dark.
func (c *UDPConn) ReadBatch(ms []ipv4.Message, flags int) (int, error) {
	for {
		n, err := c.batch.ReadBatch(ms, flags)
		if err != nil || !c.dead.Load() {
			return n, err
		}
	}
}
