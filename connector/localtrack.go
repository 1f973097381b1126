package connector

import (
	"context"
	"maps"
	"slices"
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

// engineState is what the local server remembers of the engine attached to
// its cache, so it can release it when the engine goes away without
// freeing: the blocks allocated through the local API and not yet freed or
// taken over by the Rank, and the loads the engine started.
type engineState struct {
	mu       sync.Mutex
	attached int                 // open connections that sent create
	blocks   map[int]struct{}    // allocated through the server, still the engine's
	loads    map[string]struct{} // request ids started via StartLoad
}

func newEngineState() *engineState {
	return &engineState{blocks: map[int]struct{}{}, loads: map[string]struct{}{}}
}

func (e *engineState) attach() {
	e.mu.Lock()
	e.attached++
	e.mu.Unlock()
}

// detach drops one attached connection; when it was the last one it
// returns the engine's blocks (sorted) and loads and forgets them.
func (e *engineState) detach() (blocks []int, loads []string, last bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.attached--; e.attached > 0 {
		return nil, nil, false
	}
	blocks = slices.Sorted(maps.Keys(e.blocks))
	loads = slices.Sorted(maps.Keys(e.loads))
	clear(e.blocks)
	clear(e.loads)
	return blocks, loads, true
}

func (e *engineState) addBlocks(ids []int) {
	e.mu.Lock()
	for _, b := range ids {
		e.blocks[b] = struct{}{}
	}
	e.mu.Unlock()
}

func (e *engineState) removeBlocks(ids []int) {
	e.mu.Lock()
	for _, b := range ids {
		delete(e.blocks, b)
	}
	e.mu.Unlock()
}

func (e *engineState) addLoad(id string) {
	e.mu.Lock()
	e.loads[id] = struct{}{}
	e.mu.Unlock()
}

func (e *engineState) removeLoads(ids ...string) {
	e.mu.Lock()
	for _, id := range ids {
		delete(e.loads, id)
	}
	e.mu.Unlock()
}
