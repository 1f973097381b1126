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

func newTestTable(t *testing.T, ttl time.Duration) (*leaseTable, func() []freed) {
	var mu sync.Mutex
	var got []freed
	start := time.Now()
	lt := newLeaseTable(ttl, func(id string, blocks []int, expired bool) {
		mu.Lock()
		got = append(got, freed{id, blocks, expired, time.Since(start)})
		mu.Unlock()
	})
	return lt, func() []freed {
		mu.Lock()
		defer mu.Unlock()
		return append([]freed(nil), got...)
	}
}

func TestLeasesExpireInDeadlineOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, freedList := newTestTable(t, 10*time.Second)
		defer lt.close()
		ok := func() error { return nil }

		_, err := lt.add("A", []int{1, 2})
		require.NoError(t, err)
		time.Sleep(time.Second) // fake time inside the bubble
		_, err = lt.add("B", []int{3})
		require.NoError(t, err)
		_, err = lt.add("C", []int{4})
		require.NoError(t, err)

		// A is heartbeated every 5 s; B and C are not.
		for range 4 {
			time.Sleep(5 * time.Second)
			dl := lt.extend([]string{"A", "B-unknown"})
			require.False(t, dl[0].IsZero())
			require.True(t, dl[1].IsZero())
		}
		synctest.Wait()
		got := freedList()
		require.Len(t, got, 2, "B and C expired, A held: %+v", got)
		require.Equal(t, "B", got[0].id)
		require.Equal(t, "C", got[1].id)
		require.Equal(t, 11*time.Second, got[0].at, "freed exactly at its deadline")
		require.True(t, got[0].expired)
		leases, blocks := lt.held()
		require.Equal(t, 1, leases)
		require.Equal(t, 2, blocks)

		// A notify after expiry is answered with lease-expired; never seen: unknown.
		_, err = lt.notify("B", consumer{"d", 0}, 1, ok)
		require.ErrorIs(t, err, ErrLeaseExpired)
		_, err = lt.notify("Z", consumer{"d", 0}, 1, ok)
		require.ErrorIs(t, err, ErrUnknownRequest)
		_, err = lt.pin("C")
		require.ErrorIs(t, err, ErrLeaseExpired)

		// A is released by its two consumers, counted once each.
		done, err := lt.notify("A", consumer{"d", 0}, 2, ok)
		require.NoError(t, err)
		require.False(t, done)
		done, err = lt.notify("A", consumer{"d", 0}, 2, ok)
		require.NoError(t, err)
		require.False(t, done, "a repeated notification counts once")
		done, err = lt.notify("A", consumer{"d", 1}, 2, ok)
		require.NoError(t, err)
		require.True(t, done)
		got = freedList()
		require.Len(t, got, 3)
		require.Equal(t, freed{"A", []int{1, 2}, false, 21 * time.Second}, got[2])
	})
}

func TestLeaseCloseReleasesAll(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, freedList := newTestTable(t, time.Minute)
		_, err := lt.add("A", []int{1})
		require.NoError(t, err)
		_, err = lt.add("A", []int{2})
		require.ErrorContains(t, err, `request "A" already holds a lease`)
		require.Equal(t, []string{"A"}, lt.close())
		require.Len(t, freedList(), 1)
		_, err = lt.add("B", []int{1})
		require.ErrorContains(t, err, "shutting down")
		require.Nil(t, lt.close())
	})
}

// TestPinnedLeaseFreesAfterTheRead: a lease that expires (or is notified)
// while a READ is being served from its blocks frees them only when the
// READ ends, so no page is unmapped under a running READ.
func TestPinnedLeaseFreesAfterTheRead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lt, freedList := newTestTable(t, 10*time.Second)
		defer lt.close()
		_, err := lt.add("A", []int{1})
		require.NoError(t, err)
		_, err = lt.add("B", []int{2})
		require.NoError(t, err)
		la, err := lt.pin("A")
		require.NoError(t, err)
		lb, err := lt.pin("B")
		require.NoError(t, err)

		time.Sleep(11 * time.Second) // A expires while its READ runs
		synctest.Wait()
		_, err = lt.pin("A")
		require.ErrorIs(t, err, ErrLeaseExpired, "no new READ of an expired lease")
		done, err := lt.notify("B", consumer{"d", 0}, 1, func() error { return nil })
		require.ErrorIs(t, err, ErrLeaseExpired, "B expired too")
		require.False(t, done)
		require.Empty(t, freedList(), "nothing freed while READs run")

		waited := make(chan error, 1)
		go func() { waited <- lt.waitDrained(t.Context()) }()
		lt.unpin(la)
		got := freedList()
		require.Len(t, got, 1)
		require.Equal(t, freed{"A", []int{1}, true, 11 * time.Second}, got[0])
		synctest.Wait()
		require.Empty(t, waited, "B still pinned")
		lt.unpin(lb)
		require.NoError(t, <-waited)
		require.Len(t, freedList(), 2)
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
		defer lt.close()
		ok := func() error { return nil }
		_, err := lt.add("read", []int{1})
		require.NoError(t, err)
		_, err = lt.add("unread", []int{2})
		require.NoError(t, err)
		l, err := lt.pin("read")
		require.NoError(t, err)
		lt.unpin(l) // its READ finished; the notification is still to come

		waited := make(chan error, 1)
		go func() { waited <- lt.waitDrained(t.Context()) }()
		synctest.Wait()
		require.Empty(t, waited, "a read lease is waited for")
		done, err := lt.notify("read", consumer{"d", 0}, 1, ok)
		require.NoError(t, err)
		require.True(t, done)
		require.NoError(t, <-waited, "the unread lease is not waited for")

		_, err = lt.pin("read")
		require.ErrorIs(t, err, ErrLeaseExpired)
		require.ErrorContains(t, err, `request "read": released: its 1 consumer(s) notified`)
	})
}
