package connector_test

import (
	"net"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
)

// stoppableConn drops every datagram, both ways, while stopped: a process
// SIGSTOPped, as its peers see it.
type stoppableConn struct {
	net.PacketConn
	stopped atomic.Bool
}

func (c *stoppableConn) ReadFrom(b []byte) (int, net.Addr, error) {
	for {
		n, addr, err := c.PacketConn.ReadFrom(b)
		if err != nil || !c.stopped.Load() {
			return n, addr, err
		}
	}
}

func (c *stoppableConn) WriteTo(b []byte, addr net.Addr) (int, error) {
	if c.stopped.Load() {
		return len(b), nil
	}
	return c.PacketConn.WriteTo(b, addr)
}

// TestLostNotificationRetried is a regression test: a notification lost
// while the prefill was stopped (after the decode's READ completed) was
// never sent again, so the prefill held the blocks for the lease's whole
// TTL. The decode reports the load done, then sends the notification
// again, with growing waits, until the lease would end: once the prefill
// runs again it releases the lease, long before the TTL, and none expires.
//
// fault-matrix: lost-notification
func TestLostNotificationRetried(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ttl = 2 * time.Minute
		o := simOpts(t, time.Millisecond)
		o.engine, o.tp, o.geom, o.leaseTTL = "prefill", 1, gqa8, ttl
		stop := &stoppableConn{}
		o.tap = func(_ int, pc net.PacketConn) net.PacketConn { stop.PacketConn = pc; return stop }
		pre := newInstance(t, o)
		o.engine, o.tap = "decode", nil
		dec := newInstance(t, o)
		blocks := pre.alloc(t, 2)
		pre.fill(t, 3, blocks)
		params := pre.finish(t, "a", blocks)
		start := time.Now()
		// The prefill stops once the READ landed, before the notification.
		connector.SetAfterRead(dec.ranks[0], func(string) { stop.stopped.Store(true) })
		local := dec.alloc(t, 2)
		dec.startLoad(t, "a", local, params)
		requireAllDone(t, dec.wait(t, "a"))
		dec.check(t, 3, local, 0)
		require.Less(t, time.Since(start), 30*time.Second)

		time.Sleep(start.Add(40 * time.Second).Sub(time.Now()))
		require.Equal(t, 1, pre.ranks[0].Stats().LeasesHeld, "stopped: the notification has not arrived")
		stop.stopped.Store(false) // SIGCONT
		pre.waitSent(t, 0, "a")
		released := time.Since(start)
		t.Logf("released %v after the export, the TTL being %v", released, ttl)
		require.Less(t, released, ttl/2, "the notification was sent again, the lease did not run its TTL")
		require.Zero(t, pre.ranks[0].Stats().LeasesHeld)
	})
}
