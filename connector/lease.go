package connector

import (
	"container/heap"
	"context"
	"fmt"
	"sync"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Lease errors; each maps to a wire code.
var (
	// ErrUnknownRequest: no lease was ever issued for the request id here.
	ErrUnknownRequest = codes.New(v1.Code_CODE_NOT_FOUND, "connector: unknown request")
	// ErrLeaseExpired: the request's lease expired and its blocks were freed.
	ErrLeaseExpired = codes.New(v1.Code_CODE_LEASE_EXPIRED, "connector: lease expired")
)

// consumer identifies one decode rank that notifies a request.
type consumer struct {
	engine string
	rank   uint32
}

// lease holds a finished prefill request's blocks until every expected
// consumer has notified or the deadline passes.
type lease struct {
	id        string
	blocks    []int
	expires   time.Time
	consumers map[consumer]struct{}
	index     int // in the heap
	// pins counts READs being served from the blocks; a lease released
	// while pinned (pending) frees its blocks when the last pin goes.
	pins    int
	pending bool
	expired bool
	// read: a consumer has started reading; a draining prefill waits for
	// its notification.
	read bool
}

type leaseHeap []*lease

func (h leaseHeap) Len() int           { return len(h) }
func (h leaseHeap) Less(i, j int) bool { return h[i].expires.Before(h[j].expires) }
func (h leaseHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *leaseHeap) Push(x any) { l := x.(*lease); l.index = len(*h); *h = append(*h, l) }
func (h *leaseHeap) Pop() any {
	old := *h
	l := old[len(old)-1]
	*h = old[:len(old)-1]
	l.index = -1
	return l
}

// leaseTable is the scheduler side's set of held requests, reaped in
// deadline order by one goroutine it owns.
type leaseTable struct {
	ttl  time.Duration
	free func(id string, blocks []int, expired bool) // called without the lock held

	mu      sync.Mutex
	byID    map[string]*lease
	order   leaseHeap
	ended   *lru.Cache[string, string] // recently ended ids -> how they ended
	wake    chan struct{}
	closed  bool
	pins    int           // READs being served from leased blocks
	changed chan struct{} // closed and replaced when a pin or a lease goes

	cancel context.CancelFunc
	done   chan struct{}
}

// recentIDs bounds how many expired or finished request ids are remembered
// to tell "lease expired" from "unknown request".
const recentIDs = 65536

func newLeaseTable(ttl time.Duration, free func(id string, blocks []int, expired bool)) *leaseTable {
	recent, _ := lru.New[string, string](recentIDs)
	ctx, cancel := context.WithCancel(context.Background())
	t := &leaseTable{ttl: ttl, free: free, byID: map[string]*lease{}, ended: recent,
		wake: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{}), changed: make(chan struct{})}
	go t.reap(ctx)
	return t
}

// add holds blocks for id until every consumer notified or ttl passes.
func (t *leaseTable) add(id string, blocks []int) (time.Time, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return time.Time{}, codes.New(v1.Code_CODE_UNAVAILABLE, "connector: shutting down; request %q not held", id)
	}
	if _, ok := t.byID[id]; ok {
		return time.Time{}, codes.New(v1.Code_CODE_ALREADY_EXISTS, "connector: request %q already holds a lease", id)
	}
	l := &lease{id: id, blocks: blocks, expires: time.Now().Add(t.ttl),
		consumers: map[consumer]struct{}{}}
	t.byID[id] = l
	t.ended.Remove(id)
	heap.Push(&t.order, l)
	if l.index == 0 {
		t.kick()
	}
	return l.expires, nil
}

func (t *leaseTable) kick() {
	select {
	case t.wake <- struct{}{}:
	default:
	}
}

// get returns the live lease of id, or ErrLeaseExpired / ErrUnknownRequest.
// The caller holds t.mu.
func (t *leaseTable) getLocked(id string) (*lease, error) {
	if l, ok := t.byID[id]; ok && time.Now().Before(l.expires) {
		return l, nil
	} else if ok {
		return nil, fmt.Errorf("%w: request %q: its lease expired", ErrLeaseExpired, id)
	} else if how, ok := t.ended.Get(id); ok {
		return nil, fmt.Errorf("%w: request %q: %s", ErrLeaseExpired, id, how)
	}
	return nil, fmt.Errorf("%w: request %q has no lease here", ErrUnknownRequest, id)
}

// notify records that consumer c finished with id; when count distinct
// consumers have notified, the lease is released and its blocks freed. It
// returns whether the lease was released.
func (t *leaseTable) notify(id string, c consumer, count int, verify func() error) (bool, error) {
	t.mu.Lock()
	l, err := t.getLocked(id)
	if err == nil {
		err = verify()
	}
	if err != nil {
		t.mu.Unlock()
		return false, err
	}
	l.consumers[c] = struct{}{}
	if len(l.consumers) < max(count, 1) {
		t.mu.Unlock()
		return false, nil
	}
	t.removeLocked(l, fmt.Sprintf("released: its %d consumer(s) notified", len(l.consumers)))
	freeNow := t.endLocked(l, false)
	t.mu.Unlock()
	if freeNow {
		t.free(l.id, l.blocks, false)
	}
	return true, nil
}

// endLocked marks a removed lease released; it reports whether its blocks
// may be freed now (no READ is being served from them).
func (t *leaseTable) endLocked(l *lease, expired bool) bool {
	l.expired = expired
	if l.pins > 0 {
		l.pending = true
		return false
	}
	return true
}

// pin keeps id's blocks from being freed while a READ is served from them;
// it fails like check for a request without a live lease.
func (t *leaseTable) pin(id string) (*lease, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	l, err := t.getLocked(id)
	if err != nil {
		return nil, err
	}
	l.pins++
	l.read = true
	t.pins++
	return l, nil
}

// unpin drops a pin; the last pin of a released lease frees its blocks.
func (t *leaseTable) unpin(l *lease) {
	t.mu.Lock()
	l.pins--
	t.pins--
	freeNow := l.pins == 0 && l.pending
	if freeNow {
		l.pending = false
	}
	t.signalLocked()
	t.mu.Unlock()
	if freeNow {
		t.free(l.id, l.blocks, l.expired)
	}
}

// signalLocked wakes waitDrained; t.mu is held.
func (t *leaseTable) signalLocked() {
	close(t.changed)
	t.changed = make(chan struct{})
}

// waitDrained blocks until no READ is served from leased blocks and every
// lease some consumer has started reading was released by its consumers,
// or ctx is done. A draining prefill lets the loads in flight finish and
// notify instead of refusing their notifications.
func (t *leaseTable) waitDrained(ctx context.Context) error {
	for {
		t.mu.Lock()
		busy := t.pins > 0
		for _, l := range t.byID {
			busy = busy || l.read
		}
		ch := t.changed
		t.mu.Unlock()
		if !busy {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

// extend moves the deadline of each live id to now + ttl and returns the
// new deadlines (zero for ids that are unknown or expired).
func (t *leaseTable) extend(ids []string) []time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]time.Time, len(ids))
	now := time.Now()
	for i, id := range ids {
		l, err := t.getLocked(id)
		if err != nil {
			continue
		}
		l.expires = now.Add(t.ttl)
		heap.Fix(&t.order, l.index)
		out[i] = l.expires
	}
	return out
}

// removeLocked ends l; how says how, for later requests naming it.
func (t *leaseTable) removeLocked(l *lease, how string) {
	heap.Remove(&t.order, l.index)
	delete(t.byID, l.id)
	t.ended.Add(l.id, how)
	t.signalLocked()
}

// held returns the number of leases and blocks held.
func (t *leaseTable) held() (leases, blocks int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, l := range t.byID {
		blocks += len(l.blocks)
	}
	return len(t.byID), blocks
}

// reap frees expired leases in deadline order.
func (t *leaseTable) reap(ctx context.Context) {
	defer close(t.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		t.mu.Lock()
		var due []*lease
		now := time.Now()
		for len(t.order) > 0 && !now.Before(t.order[0].expires) {
			l := t.order[0]
			t.removeLocked(l, "its lease expired")
			if t.endLocked(l, true) {
				due = append(due, l)
			}
		}
		next := time.Hour
		if len(t.order) > 0 {
			next = t.order[0].expires.Sub(now)
		}
		t.mu.Unlock()
		for _, l := range due {
			t.free(l.id, l.blocks, true)
		}
		timer.Reset(next)
		select {
		case <-ctx.Done():
			return
		case <-t.wake:
		case <-timer.C:
		}
	}
}

// close stops the reaper and releases every lease (freeing its blocks, or,
// for a lease a READ is being served from, when that READ ends); it returns
// the ids released.
func (t *leaseTable) close() []string {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	t.mu.Unlock()
	t.cancel()
	<-t.done
	t.mu.Lock()
	var ids []string
	var free []*lease
	for len(t.order) > 0 {
		l := t.order[0]
		t.removeLocked(l, "released: the sidecar is shutting down")
		ids = append(ids, l.id)
		if t.endLocked(l, false) {
			free = append(free, l)
		}
	}
	t.mu.Unlock()
	for _, l := range free {
		t.free(l.id, l.blocks, false)
	}
	return ids
}
