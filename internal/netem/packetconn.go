package netem

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// PacketConn wraps a net.PacketConn. It can delay every outgoing datagram
// by a fixed one-way delay (so a pair of wrapped sockets sees an RTT of
// twice the sum of their delays) and can go dark: after Kill,
// or once KillAfter's byte budget of sent datagrams is spent, every datagram
// in either direction is dropped, as if the host had died without a word.
//
// A PacketConn hides the optional batch interfaces of *net.UDPConn, so
// quic-go falls back to plain ReadFrom/WriteTo on it.
type PacketConn struct {
	net.PacketConn
	delay time.Duration

	sent      atomic.Int64
	killAt    atomic.Int64 // <= 0: no budget
	dead      atomic.Bool
	deadCh    chan struct{}
	deadOnce  sync.Once
	closeOnce sync.Once
	closed    chan struct{}
	wg        sync.WaitGroup
}

// New wraps pc. delay is the one-way delay added to every sent datagram;
// 0 sends at once. Close closes pc.
func New(pc net.PacketConn, delay time.Duration) *PacketConn {
	return &PacketConn{PacketConn: pc, delay: delay, deadCh: make(chan struct{}), closed: make(chan struct{})}
}

// Kill makes the socket go dark now. Dead returns a channel closed by then.
func (c *PacketConn) Kill() {
	c.deadOnce.Do(func() {
		c.dead.Store(true)
		close(c.deadCh)
	})
}

// KillAfter makes the socket go dark once n more bytes of datagrams have been
// sent through it.
func (c *PacketConn) KillAfter(n int64) { c.killAt.Store(c.sent.Load() + n) }

// Dead is closed when the socket has gone dark.
func (c *PacketConn) Dead() <-chan struct{} { return c.deadCh }

// SentBytes is the number of datagram bytes sent so far (delivered or not).
func (c *PacketConn) SentBytes() int64 { return c.sent.Load() }

// WriteTo sends p to addr after the configured delay, or drops it when the
// socket is dark. It never blocks on the delay.
func (c *PacketConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	n := c.sent.Add(int64(len(p)))
	if k := c.killAt.Load(); k > 0 && n >= k {
		c.Kill()
	}
	if c.dead.Load() {
		return len(p), nil
	}
	if c.delay <= 0 {
		return c.PacketConn.WriteTo(p, addr)
	}
	b := append([]byte(nil), p...)
	c.wg.Add(1)
	time.AfterFunc(c.delay, func() {
		defer c.wg.Done()
		if !c.dead.Load() {
			_, _ = c.PacketConn.WriteTo(b, addr)
		}
	})
	return len(p), nil
}

// ReadFrom reads the next datagram; datagrams that arrive while the socket is
// dark are discarded.
func (c *PacketConn) ReadFrom(p []byte) (int, net.Addr, error) {
	for {
		n, addr, err := c.PacketConn.ReadFrom(p)
		if err != nil || !c.dead.Load() {
			return n, addr, err
		}
	}
}

// Close closes the socket once and waits for delayed datagrams in flight.
func (c *PacketConn) Close() error {
	var err error
	c.closeOnce.Do(func() {
		err = c.PacketConn.Close()
		close(c.closed)
		c.wg.Wait()
	})
	return err
}
