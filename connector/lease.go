package connector

import (
	"container/heap"
	"context"
	"crypto/hmac"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Lease errors; each maps to a wire code.
var (
	// ErrUnknownRequest: no lease was ever issued for the request id here.
	ErrUnknownRequest = codes.New(v1.Code_CODE_NOT_FOUND, "connector: unknown request")
	// ErrLeaseExpired: the export named is not held here (any more): its
	// lease expired or was released, or an earlier process of this rank made
	// it. Bytes read under it may be stale.
	ErrLeaseExpired = codes.New(v1.Code_CODE_LEASE_EXPIRED, "connector: lease expired")
	// ErrCapabilityDenied: the capability, request id or blocks named do not
	// belong to the export named.
	ErrCapabilityDenied = codes.New(v1.Code_CODE_CAPABILITY_DENIED, "connector: capability denied")
)

// consumer identifies one decode rank that notifies a request.
type consumer struct {
	engine string
	rank   uint32
}

// lease holds one export: the blocks this rank holds for one finished
// prefill request until every expected consumer has notified or the
// deadline passes. Only the table's lock guards its mutable fields; id,
// export, blocks, sorted, capability and session never change.
type lease struct {
	id     string   // request id
	export uint64   // export id, unique on this rank
	blocks []int    // in token order
	ids    []uint32 // blocks, as the capability covers them
	sorted []uint32
	// capability is the token issued for the export; a consumer's resent
	// notification after the lease ended is matched against it.
	capability []byte
	// session is the local API engine session that made the export (0
	// outside the local API).
	session uint64

	expires   time.Time
	consumers map[consumer]struct{}
	index     int // in the heap
	// pins counts READs being served from the blocks; a lease released
	// while pinned (pending) frees its blocks when the last pin goes.
	pins    int
	pending bool
	expired bool
	// readers: the consumers that started reading (a READ of theirs was
	// authorized and its dialer proved its keys); a draining prefill waits
	// for the notification of each, not for those that never read.
	readers map[consumer]struct{}
}

// tokens returns the blocks in token order, as the capability covers them.
func (l *lease) tokens() []uint32 { return l.ids }

// has reports whether block b is one of the lease's.
func (l *lease) has(b uint32) bool {
	_, ok := slices.BinarySearch(l.sorted, b)
	return ok
}

// exportRef is how a READ, notification or heartbeat names an export.
type exportRef struct {
	id     string
	export uint64
}

// ended is what the table remembers of a lease that ended, so later
// messages naming it learn how, and a consumer's resent notification is
// acknowledged.
type ended struct {
	id         string
	how        string
	capability []byte
	notified   map[consumer]struct{}
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

// leaseTable is the scheduler side's set of exports of one rank, reaped in
// deadline order by one goroutine it owns. Every message from a peer names
// an export by its id; a request id names at most one live export.
type leaseTable struct {
	ttl  time.Duration
	rank int                          // this rank, for messages
	free func(l *lease, expired bool) // called once per lease, without the lock held

	mu       sync.Mutex
	byExport map[uint64]*lease
	byID     map[string]*lease
	order    leaseHeap
	ended    *lru.Cache[uint64, *ended] // recently ended exports
	wake     chan struct{}
	closed   bool
	pins     int           // READs being served from leased blocks
	changed  chan struct{} // closed and replaced when a pin or a lease goes
	stats    drainStats

	cancel context.CancelFunc
	done   chan struct{}
}

// drainStats counts what happened to leases, for the drain summary.
type drainStats struct {
	readsServed int      // READs served to the end
	notified    int      // leases released by their consumers
	dropped     []string // request ids of leases released by close
}

// errExportTaken: an export id is in use, or was recently, on this rank.
var errExportTaken = errors.New("connector: export id taken")

// recentExports bounds how many ended exports are remembered to say how
// they ended and to acknowledge resent notifications.
const recentExports = 65536

func newLeaseTable(ttl time.Duration, rank int, free func(l *lease, expired bool)) *leaseTable {
	recent, _ := lru.New[uint64, *ended](recentExports)
	ctx, cancel := context.WithCancel(context.Background())
	t := &leaseTable{ttl: ttl, rank: rank, free: free, byExport: map[uint64]*lease{}, byID: map[string]*lease{}, ended: recent,
		wake: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{}), changed: make(chan struct{})}
	go t.reap(ctx)
	return t
}

// add holds blocks (in token order) for request id as export, until every
// consumer notified or ttl passes. issue makes the export's capability.
// The export id must be new on this rank.
func (t *leaseTable) add(id string, export uint64, blocks []int, session uint64, issue func() []byte) (time.Time, error) {
	ids := kvgeom.Wire(blocks)
	sorted := slices.Sorted(slices.Values(ids))
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return time.Time{}, codes.New(v1.Code_CODE_UNAVAILABLE, "connector: shutting down; request %q not held", id)
	}
	if _, ok := t.byID[id]; ok {
		return time.Time{}, codes.New(v1.Code_CODE_ALREADY_EXISTS, "connector: request %q already holds a lease on rank %d", id, t.rank)
	}
	if _, live := t.byExport[export]; live || t.ended.Contains(export) || export == 0 {
		return time.Time{}, fmt.Errorf("%w: %016x on rank %d", errExportTaken, export, t.rank)
	}
	l := &lease{id: id, export: export, blocks: blocks, ids: ids, sorted: sorted, capability: issue(), session: session,
		expires: time.Now().Add(t.ttl), consumers: map[consumer]struct{}{}, readers: map[consumer]struct{}{}}
	t.byExport[export] = l
	t.byID[id] = l
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

// getLocked returns the live lease of export r, or an error of class
// ErrLeaseExpired (the export ended or is not known here) or
// ErrCapabilityDenied (it belongs to another request). The caller holds
// t.mu.
func (t *leaseTable) getLocked(r exportRef) (*lease, error) {
	if r.export == 0 {
		return nil, fmt.Errorf("%w: request %q names no export (kv_transfer_params rank_exports)", ErrCapabilityDenied, r.id)
	}
	l, ok := t.byExport[r.export]
	switch {
	case ok && l.id != r.id:
		return nil, fmt.Errorf("%w: export %016x on rank %d belongs to another request, not %q", ErrCapabilityDenied, r.export, t.rank, r.id)
	case ok && time.Now().Before(l.expires):
		return l, nil
	case ok:
		return nil, fmt.Errorf("%w: request %q export %016x on rank %d: its lease expired", ErrLeaseExpired, r.id, r.export, t.rank)
	}
	if e, ok := t.ended.Peek(r.export); ok {
		if e.id != r.id {
			return nil, fmt.Errorf("%w: export %016x on rank %d belonged to another request, not %q", ErrCapabilityDenied, r.export, t.rank, r.id)
		}
		return nil, fmt.Errorf("%w: request %q export %016x on rank %d: %s", ErrLeaseExpired, r.id, r.export, t.rank, e.how)
	}
	if maker := exportRank(r.export); maker != t.rank {
		return nil, fmt.Errorf("%w: request %q export %016x was made by prefill rank %d, not by this rank %d: the kv_transfer_params' rank_exports entry of rank %d names rank %d's export (swapped or edited entries)",
			ErrCapabilityDenied, r.id, r.export, maker, t.rank, t.rank, maker)
	}
	return nil, fmt.Errorf("%w: request %q export %016x is not held on rank %d: it ended, or an earlier process of this rank made it",
		ErrLeaseExpired, r.id, r.export, t.rank)
}

// notify records that consumer c finished with export r; verify checks the
// notification's capability against the live lease. When count distinct
// consumers have notified, the lease is released and its blocks freed. A
// consumer that already notified r is acknowledged again whatever became
// of the lease since (a resend after a lost acknowledgement), if its
// capability matches the one issued. It returns whether this call released
// the lease.
func (t *leaseTable) notify(r exportRef, c consumer, count int, capability []byte, verify func(l *lease) error) (bool, error) {
	t.mu.Lock()
	if e, ok := t.ended.Peek(r.export); ok && r.export != 0 && e.id == r.id {
		_, again := e.notified[c]
		t.mu.Unlock()
		switch {
		case again && hmac.Equal(capability, e.capability):
			return false, nil
		case again:
			return false, fmt.Errorf("%w: capability is not valid for request %q export %016x on rank %d", ErrCapabilityDenied, r.id, r.export, t.rank)
		}
		return false, fmt.Errorf("%w: request %q export %016x on rank %d: %s", ErrLeaseExpired, r.id, r.export, t.rank, e.how)
	}
	l, err := t.getLocked(r)
	if err == nil {
		err = verify(l)
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
	t.stats.notified++
	freeNow := t.endLocked(l, false)
	t.mu.Unlock()
	if freeNow {
		t.free(l, false)
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

// pin keeps export r's blocks from being freed while a READ of consumer c
// is served from them; check (called with the lease, under the table's
// lock) decides whether the READ may be served. It fails like getLocked
// for an export that is not live. genuine is false for a READ that arrived
// in 0-RTT before its handshake completed: it may be a replay, so it does
// not mark the lease as read by c (which a drain waits on).
func (t *leaseTable) pin(r exportRef, c consumer, genuine bool, check func(l *lease) error) (*lease, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	l, err := t.getLocked(r)
	if err == nil {
		err = check(l)
	}
	if err != nil {
		return nil, err
	}
	l.pins++
	if genuine {
		l.readers[c] = struct{}{}
	}
	t.pins++
	return l, nil
}

// unpin drops a pin of consumer c's READ; the last pin of a released lease
// frees its blocks. completed says the READ was served to its end; genuine
// that its dialer proved it holds the connection's keys (not a 0-RTT
// replay), which only then marks the lease as read by c and counts the
// READ.
func (t *leaseTable) unpin(l *lease, c consumer, completed, genuine bool) {
	t.mu.Lock()
	l.pins--
	t.pins--
	if genuine {
		l.readers[c] = struct{}{}
		if completed {
			t.stats.readsServed++
		}
	}
	freeNow := l.pins == 0 && l.pending
	if freeNow {
		l.pending = false
	}
	t.signalLocked()
	t.mu.Unlock()
	if freeNow {
		t.free(l, l.expired)
	}
}

// signalLocked wakes waitDrained; t.mu is held.
func (t *leaseTable) signalLocked() {
	close(t.changed)
	t.changed = make(chan struct{})
}

// waitDrained blocks until no READ is served from leased blocks and every
// consumer that started reading a lease still held has notified it, or ctx
// is done. A draining prefill lets the loads in flight finish and notify
// instead of refusing their notifications, and does not wait for consumers
// that never read (one decode rank of two read and notified, the other
// never started).
func (t *leaseTable) waitDrained(ctx context.Context) error {
	return t.waitUntil(ctx, func() bool {
		if t.pins > 0 {
			return false
		}
		for _, l := range t.byExport {
			for c := range l.readers {
				if _, ok := l.consumers[c]; !ok {
					return false
				}
			}
		}
		return true
	})
}

// waitUntil blocks until done (called under t.mu) holds or ctx is done.
func (t *leaseTable) waitUntil(ctx context.Context, done func() bool) error {
	for {
		t.mu.Lock()
		ok := done()
		ch := t.changed
		t.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

// extend moves the deadline of each live export in refs whose verify
// passes to now + ttl and returns the new deadlines (zero for the others).
func (t *leaseTable) extend(refs []exportRef, verify func(i int, l *lease) error) []time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]time.Time, len(refs))
	now := time.Now()
	for i, r := range refs {
		l, err := t.getLocked(r)
		if err != nil || verify(i, l) != nil {
			continue
		}
		l.expires = now.Add(t.ttl)
		heap.Fix(&t.order, l.index)
		out[i] = l.expires
	}
	return out
}

// withdraw ends the live lease of request id, if any, saying how; it
// reports whether there was one. A pinned lease frees its blocks when its
// READs stop.
func (t *leaseTable) withdraw(id, how string) bool {
	t.mu.Lock()
	l, ok := t.byID[id]
	if !ok {
		t.mu.Unlock()
		return false
	}
	t.removeLocked(l, how)
	freeNow := t.endLocked(l, false)
	t.mu.Unlock()
	if freeNow {
		t.free(l, false)
	}
	return true
}

// revoke ends every live lease holding one of blocks (rank 0 freed them)
// and returns how many it ended; a pinned one frees its blocks when its
// READs stop.
func (t *leaseTable) revoke(blocks []int) int {
	t.mu.Lock()
	var free []*lease
	n := 0
	for _, l := range t.byExport {
		for _, b := range blocks {
			if b < 0 || !l.has(uint32(b)) {
				continue
			}
			t.removeLocked(l, fmt.Sprintf("rank 0 freed block %d while the export held it", b))
			if t.endLocked(l, false) {
				free = append(free, l)
			}
			n++
			break
		}
	}
	t.mu.Unlock()
	for _, l := range free {
		t.free(l, false)
	}
	return n
}

// removeLocked ends l; how says how, for later messages naming it.
func (t *leaseTable) removeLocked(l *lease, how string) {
	heap.Remove(&t.order, l.index)
	delete(t.byExport, l.export)
	if t.byID[l.id] == l {
		delete(t.byID, l.id)
	}
	t.ended.Add(l.export, &ended{id: l.id, how: how, capability: l.capability, notified: l.consumers})
	t.signalLocked()
}

// resetStats starts counting drainStats afresh (when a drain starts).
func (t *leaseTable) resetStats() {
	t.mu.Lock()
	t.stats = drainStats{}
	t.mu.Unlock()
}

// held returns the number of leases and blocks held.
func (t *leaseTable) held() (leases, blocks, pins int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, l := range t.byExport {
		blocks += len(l.blocks)
	}
	return len(t.byExport), blocks, t.pins
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
			t.free(l, true)
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
// for a lease a READ is being served from, when that READ ends). It returns
// what the table saw since it started: READs served, leases released by
// their consumers, and the request ids close released.
func (t *leaseTable) close() drainStats {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return drainStats{}
	}
	t.closed = true
	t.mu.Unlock()
	t.cancel()
	<-t.done
	t.mu.Lock()
	var free []*lease
	for len(t.order) > 0 {
		l := t.order[0]
		t.removeLocked(l, "released: the sidecar is shutting down")
		t.stats.dropped = append(t.stats.dropped, l.id)
		if t.endLocked(l, false) {
			free = append(free, l)
		}
	}
	st := t.stats
	t.mu.Unlock()
	for _, l := range free {
		t.free(l, false)
	}
	return st
}
