package connector

import (
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
)

type freed struct {
	id      string
	blocks  []int
	expired bool
	at      time.Duration
}

// testTable is a lease table whose exports are numbered by the test and
// whose capability of export e is the byte e.
type testTable struct {
	*leaseTable
	freedList func() []freed
}

func newTestTable(t *testing.T, ttl time.Duration) (*testTable, func() []freed) {
	var mu sync.Mutex
	var got []freed
	start := time.Now()
	lt := newLeaseTable(ttl, 0, func(l *lease, expired bool) {
		mu.Lock()
		got = append(got, freed{l.id, l.blocks, expired, time.Since(start)})
		mu.Unlock()
	})
	list := func() []freed {
		mu.Lock()
		defer mu.Unlock()
		return append([]freed(nil), got...)
	}
	return &testTable{lt, list}, list
}

func capOf(export uint64) []byte { return []byte{byte(export)} }

func (t *testTable) addExport(id string, export uint64, blocks ...int) error {
	_, err := t.add(id, export, blocks, 0, func() []byte { return capOf(export) })
	return err
}

// notifyExport notifies export e of id as consumer c, with the capability
// issued for e.
func (t *testTable) notifyExport(id string, e uint64, c consumer, count int) (bool, error) {
	return t.notify(exportRef{id, e}, c, count, capOf(e), func(*lease) error { return nil })
}

// reader is the consumer the tests' READs are for.
var reader = consumer{"d", 0}

func (t *testTable) pinExport(id string, e uint64) (*lease, error) {
	return t.pin(exportRef{id, e}, reader, true, func(*lease) error { return nil })
}

func (t *testTable) extendExports(refs ...exportRef) []time.Time {
	return t.extend(refs, func(int, *lease) error { return nil })
}

func TestLeasesExpireInDeadlineOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, freedList := newTestTable(t, 10*time.Second)
		defer lt.close()

		require.NoError(t, lt.addExport("A", 1, 1, 2))
		time.Sleep(time.Second) // fake time inside the bubble
		require.NoError(t, lt.addExport("B", 2, 3))
		require.NoError(t, lt.addExport("C", 3, 4))

		// A is heartbeated every 5 s; B and C are not.
		for range 4 {
			time.Sleep(5 * time.Second)
			dl := lt.extendExports(exportRef{"A", 1}, exportRef{"B-unknown", 9}, exportRef{"B", 1})
			require.False(t, dl[0].IsZero())
			require.True(t, dl[1].IsZero())
			require.True(t, dl[2].IsZero(), "B naming A's export extends nothing")
		}
		synctest.Wait()
		got := freedList()
		require.Len(t, got, 2, "B and C expired, A held: %+v", got)
		require.Equal(t, "B", got[0].id)
		require.Equal(t, "C", got[1].id)
		require.Equal(t, 11*time.Second, got[0].at, "freed exactly at its deadline")
		require.True(t, got[0].expired)
		leases, blocks, pins := lt.held()
		require.Zero(t, pins)
		require.Equal(t, 1, leases)
		require.Equal(t, 2, blocks)

		// A notify after expiry is answered with lease-expired, also for an
		// export never seen here.
		_, err := lt.notifyExport("B", 2, consumer{"d", 0}, 1)
		require.ErrorIs(t, err, ErrLeaseExpired)
		require.ErrorContains(t, err, "its lease expired")
		_, err = lt.notifyExport("Z", 99, consumer{"d", 0}, 1)
		require.ErrorIs(t, err, ErrLeaseExpired)
		require.ErrorContains(t, err, "an earlier process of this rank made it")
		_, err = lt.pinExport("C", 3)
		require.ErrorIs(t, err, ErrLeaseExpired)

		// A is released by its two consumers, counted once each.
		done, err := lt.notifyExport("A", 1, consumer{"d", 0}, 2)
		require.NoError(t, err)
		require.False(t, done)
		done, err = lt.notifyExport("A", 1, consumer{"d", 0}, 2)
		require.NoError(t, err)
		require.False(t, done, "a repeated notification counts once")
		done, err = lt.notifyExport("A", 1, consumer{"d", 1}, 2)
		require.NoError(t, err)
		require.True(t, done)
		got = freedList()
		require.Len(t, got, 3)
		require.Equal(t, freed{"A", []int{1, 2}, false, 21 * time.Second}, got[2])
	})
}

// TestNotifyIsIdempotentPerExport: a consumer's notification resent after
// the lease was released (its acknowledgement was lost on a dead connection)
// is acknowledged, not turned into CODE_LEASE_EXPIRED for a load that
// succeeded; another consumer's, or one with another capability, is not.
func TestNotifyIsIdempotentPerExport(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, freedList := newTestTable(t, time.Minute)
		defer lt.close()
		require.NoError(t, lt.addExport("R", 7, 1))
		done, err := lt.notifyExport("R", 7, consumer{"d", 0}, 1)
		require.NoError(t, err)
		require.True(t, done)
		done, err = lt.notifyExport("R", 7, consumer{"d", 0}, 1)
		require.NoError(t, err, "the resend is acknowledged")
		require.False(t, done, "and releases nothing again")
		require.Len(t, freedList(), 1)

		_, err = lt.notifyExport("R", 7, consumer{"d", 1}, 1)
		require.ErrorIs(t, err, ErrLeaseExpired, "a consumer that never notified learns the lease ended")
		_, err = lt.notify(exportRef{"R", 7}, consumer{"d", 0}, 1, capOf(8), func(*lease) error { return nil })
		require.ErrorIs(t, err, ErrCapabilityDenied, "a resend must carry the export's capability")
	})
}

// TestStaleExportNeverReachesANewOne: a request id reused by a new export;
// the first export's id neither reads nor releases the new one.
//
// fault-matrix: stale-reused-request-id
func TestStaleExportNeverReachesANewOne(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, freedList := newTestTable(t, time.Minute)
		defer lt.close()
		require.NoError(t, lt.addExport("R", 1, 5))
		_, err := lt.notifyExport("R", 1, consumer{"d", 0}, 1)
		require.NoError(t, err)
		require.NoError(t, lt.addExport("R", 2, 5), "the request id is free again")

		_, err = lt.pinExport("R", 1)
		require.ErrorIs(t, err, ErrLeaseExpired)
		require.ErrorContains(t, err, `request "R" export 0000000000000001 on rank 0: released: its 1 consumer(s) notified`)
		_, err = lt.notifyExport("R", 1, consumer{"d", 1}, 1)
		require.ErrorIs(t, err, ErrLeaseExpired)
		require.True(t, lt.extendExports(exportRef{"R", 1})[0].IsZero())
		require.Len(t, freedList(), 1, "the new export is still held")

		_, err = lt.pinExport("S", 2)
		require.ErrorIs(t, err, ErrCapabilityDenied, "another request naming the export")
		_, err = lt.pinExport("R", 0)
		require.ErrorIs(t, err, ErrCapabilityDenied, "no export named")

		l, err := lt.pinExport("R", 2)
		require.NoError(t, err)
		lt.unpin(l, reader, true, true)
		require.Error(t, lt.addExport("R", 3, 6), "one live export per request id")
		require.ErrorIs(t, lt.addExport("Q", 1, 6), errExportTaken, "a recent export id is not reused")
	})
}

func TestLeaseCloseReleasesAll(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, freedList := newTestTable(t, time.Minute)
		require.NoError(t, lt.addExport("A", 1, 1))
		require.ErrorContains(t, lt.addExport("A", 2, 2), `request "A" already holds a lease`)
		require.Equal(t, []string{"A"}, lt.close().dropped)
		require.Len(t, freedList(), 1)
		require.ErrorContains(t, lt.addExport("B", 3, 1), "shutting down")
		require.Nil(t, lt.close().dropped)
	})
}

// TestPinnedLeaseFreesAfterTheRead: a lease that expires (or is notified)
// while a READ is being served from its blocks frees them only when the READ
// ends, so no page is unmapped under a running READ.
func TestPinnedLeaseFreesAfterTheRead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, freedList := newTestTable(t, 10*time.Second)
		defer lt.close()
		require.NoError(t, lt.addExport("A", 1, 1))
		require.NoError(t, lt.addExport("B", 2, 2))
		la, err := lt.pinExport("A", 1)
		require.NoError(t, err)
		lb, err := lt.pinExport("B", 2)
		require.NoError(t, err)

		time.Sleep(11 * time.Second) // A expires while its READ runs
		synctest.Wait()
		_, err = lt.pinExport("A", 1)
		require.ErrorIs(t, err, ErrLeaseExpired, "no new READ of an expired lease")
		done, err := lt.notifyExport("B", 2, consumer{"d", 0}, 1)
		require.ErrorIs(t, err, ErrLeaseExpired, "B expired too")
		require.False(t, done)
		require.Empty(t, freedList(), "nothing freed while READs run")

		waited := make(chan error, 1)
		go func() { waited <- lt.waitDrained(t.Context()) }()
		lt.unpin(la, reader, true, true)
		got := freedList()
		require.Len(t, got, 1)
		require.Equal(t, freed{"A", []int{1}, true, 11 * time.Second}, got[0])
		synctest.Wait()
		require.Empty(t, waited, "B still pinned")
		lt.unpin(lb, reader, false, true)
		require.NoError(t, <-waited)
		require.Len(t, freedList(), 2)
		require.Equal(t, 1, lt.close().readsServed, "one READ served to its end")
	})
}

// TestDrainWaitsForReadLeases is a regression test: a draining prefill
// released every lease at once, so a decode that had read its blocks got
// its notification refused ("the bytes read may be stale") and failed. A
// lease a consumer started reading is now waited for until notified; one
// nobody read is not. A later request for a released lease says how it
// ended.
func TestDrainWaitsForReadLeases(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, _ := newTestTable(t, time.Minute)
		require.NoError(t, lt.addExport("read", 1, 1))
		require.NoError(t, lt.addExport("unread", 2, 2))
		l, err := lt.pinExport("read", 1)
		require.NoError(t, err)
		lt.unpin(l, reader, true, true) // its READ finished; the notification is still to come

		waited := make(chan error, 1)
		go func() { waited <- lt.waitDrained(t.Context()) }()
		synctest.Wait()
		require.Empty(t, waited, "a read lease is waited for")
		done, err := lt.notifyExport("read", 1, consumer{"d", 0}, 1)
		require.NoError(t, err)
		require.True(t, done)
		require.NoError(t, <-waited, "the unread lease is not waited for")

		_, err = lt.pinExport("read", 1)
		require.ErrorIs(t, err, ErrLeaseExpired)
		require.ErrorContains(t, err, `request "read" export 0000000000000001 on rank 0: released: its 1 consumer(s) notified`)
		st := lt.close()
		require.Equal(t, drainStats{readsServed: 1, notified: 1, dropped: []string{"unread"}}, st)
	})
}

// TestEarlyReadMarksNothing: a READ served from 0-RTT data before its
// handshake completed may be a replay. Its pin holds the blocks while it
// runs, but if the handshake never completed it neither marks the lease as
// read (a drain does not wait for it) nor counts as served; once the
// handshake completed it counts like any READ.
//
// fault-matrix: replayed-0rtt-read
func TestEarlyReadMarksNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, _ := newTestTable(t, time.Minute)
		require.NoError(t, lt.addExport("replayed", 1, 1))
		l, err := lt.pin(exportRef{"replayed", 1}, reader, false, func(*lease) error { return nil })
		require.NoError(t, err)
		waited := make(chan error, 1)
		go func() { waited <- lt.waitDrained(t.Context()) }()
		synctest.Wait()
		require.Empty(t, waited, "a drain waits for the READ being served")
		lt.unpin(l, reader, true, false) // its handshake never completed
		require.NoError(t, <-waited, "nobody proved they read the lease: the drain does not wait for a notification")

		require.NoError(t, lt.addExport("confirmed", 2, 2))
		l, err = lt.pin(exportRef{"confirmed", 2}, reader, false, func(*lease) error { return nil })
		require.NoError(t, err)
		lt.unpin(l, reader, true, true) // the handshake completed while it was served
		go func() { waited <- lt.waitDrained(t.Context()) }()
		synctest.Wait()
		require.Empty(t, waited, "a READ whose dialer proved its keys marks the lease as read")
		_, err = lt.notifyExport("confirmed", 2, consumer{"d", 0}, 1)
		require.NoError(t, err)
		require.NoError(t, <-waited)
		st := lt.close()
		require.Equal(t, 1, st.readsServed, "only the confirmed READ counts")
	})
}

// TestDrainWaitsOnlyForConsumersThatRead is a regression test: a lease
// announced for two consumers, read and notified by one while the other
// never started, held a draining prefill for its whole deadline (a
// restart cost 30 s). A drain now waits for the notification of each
// consumer that read, and of no other.
//
// fault-matrix: drain-partial-consumers
func TestDrainWaitsOnlyForConsumersThatRead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, _ := newTestTable(t, time.Minute)
		require.NoError(t, lt.addExport("two", 1, 1))
		d0, d1 := consumer{"dec", 0}, consumer{"dec", 1}
		l, err := lt.pin(exportRef{"two", 1}, d0, true, func(*lease) error { return nil })
		require.NoError(t, err)
		lt.unpin(l, d0, true, true)
		done, err := lt.notifyExport("two", 1, d0, 2)
		require.NoError(t, err)
		require.False(t, done, "one of two consumers notified")
		start := time.Now()
		require.NoError(t, lt.waitDrained(t.Context()))
		require.Zero(t, time.Since(start), "the consumer that never read is not waited for")

		// The second consumer starts reading: now the drain waits for it.
		l, err = lt.pin(exportRef{"two", 1}, d1, true, func(*lease) error { return nil })
		require.NoError(t, err)
		lt.unpin(l, d1, true, true)
		waited := make(chan error, 1)
		go func() { waited <- lt.waitDrained(t.Context()) }()
		synctest.Wait()
		require.Empty(t, waited, "a consumer that read is waited for")
		done, err = lt.notifyExport("two", 1, d1, 2)
		require.NoError(t, err)
		require.True(t, done)
		require.NoError(t, <-waited)
		lt.close()
	})
}
