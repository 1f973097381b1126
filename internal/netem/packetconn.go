package netem

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// MaxQueuedBytes bounds the datagram bytes a delaying socket holds at once
// (its "link buffer"); a datagram that would exceed it is dropped, as a
// router's full queue drops it. At 64 MiB a 50 ms RTT path carries over
// 1 GB/s before it drops anything.
const MaxQueuedBytes = 64 << 20

// PacketConn wraps a net.PacketConn. It can delay every outgoing datagram
// by a fixed one-way delay (so a pair of wrapped sockets sees an RTT of
// twice the sum of their delays) and can go dark: after Kill, or once
// KillAfter's byte budget of sent datagrams is spent, every datagram in
// either direction is dropped, as if the host had died without a word.
//
// Delayed datagrams wait in one FIFO queue per socket, released in order by
// one goroutine when their time comes, so the delay never reorders them;
// what was sent in one write (a GSO batch of a UDPConn) leaves in one write.
// What still differs from a real link of that RTT: the only bandwidth
// limit is the host's (a writer that gets more than a 16th of the delay, at
// most 1 ms, ahead of the release goroutine waits, as on a full socket
// buffer, so no queueing delay builds up in the emulator; nothing is
// dropped below MaxQueuedBytes); no jitter and no random loss of its own;
// the release goroutine's wake-ups add tens of microseconds to the delay,
// more on a loaded host; and a receiver that cannot keep up queues packets
// in its socket, which the sender sees as a longer RTT, as over a real
// path to a busy host.
//
// A PacketConn from New hides the optional batch interfaces of the socket
// it wraps, so quic-go falls back to plain ReadFrom/WriteTo on it; a UDPConn
// (NewUDP) keeps them.
type PacketConn struct {
	net.PacketConn
	delay time.Duration
	udp   *net.UDPConn // set by NewUDP: datagrams leave with WriteMsgUDP

	sent      atomic.Int64
	killAt    atomic.Int64 // <= 0: no budget
	dropped   atomic.Int64
	dead      atomic.Bool
	deadCh    chan struct{}
	deadOnce  sync.Once
	closeOnce sync.Once
	closed    chan struct{}
	wg        sync.WaitGroup

	mu     sync.Mutex
	cond   *sync.Cond // on mu: the release goroutine wrote a datagram, or Close
	queue  []datagram // FIFO, due times non-decreasing
	queued int        // bytes in queue
	wake   chan struct{}
}

// datagram is one delayed write: a datagram, or a GSO batch of them.
type datagram struct {
	due  time.Time
	b    []byte
	oob  []byte
	addr net.Addr
}

// New wraps pc. delay is the one-way delay added to every sent datagram;
// 0 sends at once. Close closes pc.
func New(pc net.PacketConn, delay time.Duration) *PacketConn {
	c := &PacketConn{PacketConn: pc, delay: delay, deadCh: make(chan struct{}), closed: make(chan struct{}),
		wake: make(chan struct{}, 1)}
	c.cond = sync.NewCond(&c.mu)
	if delay > 0 {
		c.wg.Go(c.release)
	}
	return c
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

// DroppedBytes is the number of datagram bytes dropped because the delay
// queue held MaxQueuedBytes (not counting those a dark socket swallowed).
func (c *PacketConn) DroppedBytes() int64 { return c.dropped.Load() }

// WriteTo sends p to addr after the configured delay, or drops it when the
// socket is dark. It never blocks on the delay.
func (c *PacketConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	if c.count(len(p)) {
		return len(p), nil
	}
	if c.delay <= 0 {
		return c.PacketConn.WriteTo(p, addr)
	}
	c.enqueue(p, nil, addr)
	return len(p), nil
}

// count adds n sent bytes and reports whether the socket is dark.
func (c *PacketConn) count(n int) bool {
	sent := c.sent.Add(int64(n))
	if k := c.killAt.Load(); k > 0 && sent >= k {
		c.Kill()
	}
	return c.dead.Load()
}

// enqueue copies a write into the delay queue. While the release goroutine
// is behind by more than maxLag (the host cannot move datagrams as fast as
// they are written), it blocks, as a write to a socket whose send buffer is
// full does: the delay then models propagation only, and a sender that
// outruns the host is held back rather than piling up queueing delay that
// its peer would read as a growing RTT (and, past 9/8 of it, as loss).
func (c *PacketConn) enqueue(p, oob []byte, addr net.Addr) {
	d := datagram{b: append([]byte(nil), p...), addr: addr}
	if len(oob) > 0 {
		d.oob = append([]byte(nil), oob...)
	}
	c.mu.Lock()
	for len(c.queue) > 0 && time.Since(c.queue[0].due) > c.maxLag() && !c.isClosed() {
		c.cond.Wait()
	}
	if c.queued+len(p) > MaxQueuedBytes {
		c.mu.Unlock()
		c.dropped.Add(int64(len(p)))
		return
	}
	d.due = time.Now().Add(c.delay)
	c.queue = append(c.queue, d)
	c.queued += len(p)
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// maxLag is how far behind its datagrams' due times the release goroutine
// may fall before writers wait: a 16th of the delay, at most 1 ms.
func (c *PacketConn) maxLag() time.Duration { return min(time.Millisecond, c.delay/16) }

func (c *PacketConn) isClosed() bool {
	select {
	case <-c.closed:
		return true
	default:
		return false
	}
}

// release writes queued datagrams in order, each when its time comes,
// until the socket closes.
func (c *PacketConn) release() {
	t := time.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		c.mu.Lock()
		var wait time.Duration = -1
		var d datagram
		sendNow := false
		if len(c.queue) > 0 {
			if wait = time.Until(c.queue[0].due); wait <= 0 {
				d, sendNow = c.queue[0], true
				c.queue[0] = datagram{}
				c.queue = c.queue[1:]
				c.queued -= len(d.b)
				if len(c.queue) == 0 {
					c.queue = nil // let the backing array go
				}
			}
		}
		c.mu.Unlock()
		if sendNow {
			if !c.dead.Load() {
				c.send(d)
			}
			c.cond.Broadcast()
			continue
		}
		if wait >= 0 {
			t.Reset(wait)
		}
		select {
		case <-c.closed:
			return
		case <-c.wake:
			t.Stop() // Go 1.23 timers: no stale tick after Stop
		case <-t.C:
		}
	}
}

// send writes one due datagram (or GSO batch) to the socket.
func (c *PacketConn) send(d datagram) {
	if c.udp != nil {
		ua, _ := d.addr.(*net.UDPAddr)
		_, _, _ = c.udp.WriteMsgUDP(d.b, d.oob, ua)
		return
	}
	_, _ = c.PacketConn.WriteTo(d.b, d.addr)
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

// Close closes the socket once, dropping delayed datagrams not yet sent,
// and waits for the release goroutine.
func (c *PacketConn) Close() error {
	var err error
	c.closeOnce.Do(func() {
		err = c.PacketConn.Close()
		c.mu.Lock()
		close(c.closed)
		c.cond.Broadcast()
		c.mu.Unlock()
		c.wg.Wait()
	})
	return err
}
