package connector_test

import (
	"net"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
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
		pre, dec, stop, params := stoppablePrefill(t, ttl)
		start := time.Now()
		// The prefill stops once the READ landed, before the notification.
		connector.SetAfterRead(dec.ranks[0], func(string) { stop.stopped.Store(true) })
		local := dec.alloc(t, 2)
		dec.startLoad(t, "a", local, params)
		requireAllDone(t, dec.wait(t, "a"))
		dec.check(t, 3, local, 0)
		require.Less(t, time.Since(start), 30*time.Second)

		time.Sleep(start.Add(40 * time.Second).Sub(time.Now()))
		requireReleasedOnResume(t, pre, stop, start, ttl, "the notification was sent again")
	})
}

// TestAbortWhileHandshakingStillNotifies is a regression test: a load
// aborted while its source's handshake was still unanswered (the prefill
// stopped, the decode never talked to it before) notified nobody, because
// only sources whose handshake succeeded counted as reached, so the
// prefill held the export's blocks for the lease's whole TTL. A handshake
// that went unanswered (aborted or timed out first) is no refusal: the
// source is notified like one that answered, again until it runs.
//
// fault-matrix: lost-notification
func TestAbortWhileHandshakingStillNotifies(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ttl = 2 * time.Minute
		pre, dec, stop, params := stoppablePrefill(t, ttl)
		start := time.Now()
		stop.stopped.Store(true) // SIGSTOP before the decode's first packet
		dec.startLoad(t, "a", dec.alloc(t, 2), params)
		time.Sleep(time.Second)
		require.Equal(t, 1, dec.ranks[0].Stats().LoadsInFlight, "the handshake is unanswered")
		require.NoError(t, dec.ranks[0].Abort(t.Context(), "a"))
		f := dec.ranks[0].GetFinished()
		require.Len(t, f.Failed, 1)
		require.Equal(t, v1.Code_CODE_ABORTED, codes.Of(f.Failed[0].Err), "%v", f.Failed[0].Err)

		time.Sleep(5 * time.Second)
		requireReleasedOnResume(t, pre, stop, start, ttl, "the aborted load notified the prefill")
	})
}

// stoppablePrefill starts a prefill (TP 1, whose packets stop can drop) and
// a decode in the test's synctest bubble, with the prefill's lease TTL ttl,
// and exports request "a" (2 blocks filled with seed 3) from the prefill.
func stoppablePrefill(t *testing.T, ttl time.Duration) (pre, dec *instance, stop *stoppableConn, params *v1.KVTransferParams) {
	o := simOpts(t, time.Millisecond)
	o.engine, o.tp, o.geom, o.leaseTTL = "prefill", 1, gqa8, ttl
	stop = &stoppableConn{}
	o.tap = func(_ int, pc net.PacketConn) net.PacketConn { stop.PacketConn = pc; return stop }
	pre = newInstance(t, o)
	o.engine, o.tap = "decode", nil
	dec = newInstance(t, o)
	blocks := pre.alloc(t, 2)
	pre.fill(t, 3, blocks)
	return pre, dec, stop, pre.finish(t, "a", blocks)
}

// requireReleasedOnResume checks that the stopped prefill still holds
// request "a"'s lease, resumes it (SIGCONT), and requires the lease
// released (the decode's notification arrived) within half the TTL from
// start; why says what sent it.
func requireReleasedOnResume(t *testing.T, pre *instance, stop *stoppableConn, start time.Time, ttl time.Duration, why string) {
	t.Helper()
	require.Equal(t, 1, pre.ranks[0].Stats().LeasesHeld, "stopped: the notification has not arrived")
	stop.stopped.Store(false) // SIGCONT
	pre.waitSent(t, 0, "a")
	released := time.Since(start)
	t.Logf("released %v after the export, the TTL being %v", released, ttl)
	require.Less(t, released, ttl/2, "%s, the lease did not run its TTL", why)
	require.Zero(t, pre.ranks[0].Stats().LeasesHeld)
}

// TestFullPrefixHitRetriesEveryLostNotification is a regression test: a
// full prefix hit (nothing to read, every source only notified) returned
// at the first lost notification, before it had set the others' retries
// going, so a prefill TP 2 stopped under a decode TP 1 got one rank's
// lease released on resume and the other's only at its TTL.
//
// fault-matrix: lost-notification
func TestFullPrefixHitRetriesEveryLostNotification(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ttl = 2 * time.Minute
		o := simOpts(t, time.Millisecond)
		o.engine, o.tp, o.geom, o.leaseTTL = "prefill", 2, gqa8, ttl
		stops := []*stoppableConn{{}, {}}
		o.tap = func(r int, pc net.PacketConn) net.PacketConn { stops[r].PacketConn = pc; return stops[r] }
		pre := newInstance(t, o)
		o.engine, o.tp, o.tap = "decode", 1, nil
		dec := newInstance(t, o)
		params := pre.finish(t, "full", pre.alloc(t, 2))
		start := time.Now()
		for _, s := range stops {
			s.stopped.Store(true)
		}
		dec.startLoad(t, "full", nil, params)
		f := dec.wait(t, "full")[0]
		require.NotNil(t, f, "the prefill ranks never answered")
		t.Logf("failed after %v: %v", time.Since(start), f.Err)
		time.Sleep(5 * time.Second)
		for r, s := range stops {
			require.Equal(t, 1, pre.ranks[r].Stats().LeasesHeld, "rank %d stopped: nothing has arrived", r)
			s.stopped.Store(false) // SIGCONT
		}
		for r := range stops {
			pre.waitSent(t, r, "full")
			require.Less(t, time.Since(start), ttl/2, "rank %d: the lost notification was sent again", r)
			require.Zero(t, pre.ranks[r].Stats().LeasesHeld, "rank %d", r)
		}
	})
}
