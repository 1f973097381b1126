package localapi

import (
	"context"
	"maps"
	"sync"

	"github.com/kvsidecar/kvsidecar/vmm"
)

// PageTracker records which page indices of a vmm.Pool are mapped, with a
// generation per mapping, so the local API can tell each attached engine
// exactly which pages to map, remap or drop. It is a vmm.PageHook (set it as
// Config.PageHook of the pool, wrapping the TP group's hook on rank 0) and,
// for a coordinated follower, the tpgroup.PagePool the group drives
// (wrapping the follower's pool). Page 0 is mapped by every pool at NewPool
// and counts as mapped from the start. Safe for concurrent use.
type PageTracker struct {
	next vmm.PageHook

	mu   sync.Mutex
	gen  map[int]uint64 // page index -> generation of its current mapping
	last uint64
}

// NewPageTracker returns a tracker that forwards every call to next first
// (nil: none): the TP group's coordinator hook on rank 0, or the follower's
// *vmm.Pool.
func NewPageTracker(next vmm.PageHook) *PageTracker {
	return &PageTracker{next: next, gen: map[int]uint64{0: 1}, last: 1}
}

// MapPages forwards to next and, when it succeeds, records the pages as
// freshly mapped.
func (t *PageTracker) MapPages(ctx context.Context, pages []int) error {
	if t.next != nil {
		if err := t.next.MapPages(ctx, pages); err != nil {
			return err
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range pages {
		t.last++
		t.gen[p] = t.last
	}
	return nil
}

// UnmapPages records the pages as unmapped, then forwards to next. They
// are recorded even when next fails: an engine that drops a mapping it could
// have kept loses nothing, one that keeps a stale mapping could alias a
// reused range.
func (t *PageTracker) UnmapPages(ctx context.Context, pages []int) error {
	t.mu.Lock()
	for _, p := range pages {
		if p != 0 {
			delete(t.gen, p)
		}
	}
	t.mu.Unlock()
	if t.next != nil {
		return t.next.UnmapPages(ctx, pages)
	}
	return nil
}

// Snapshot returns the mapped page indices and their generations.
func (t *PageTracker) Snapshot() map[int]uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return maps.Clone(t.gen)
}
