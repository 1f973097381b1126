package localapi

import (
	"context"
	"fmt"
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

// engineState is what the local server remembers of the engine session
// attached to its cache (see session.go): its id, the blocks allocated
// through the local API in this session and not freed by the engine (the
// blocks its RequestFinished and Free may name), those of them that are
// still the engine's to free (not taken over by the Rank), and the loads it
// started, so the server can release them when the engine goes away
// without freeing.
type engineState struct {
	mu        sync.Mutex
	attached  int                 // open connections that sent create
	session   uint64              // current session; 0 before the first attach
	last      uint64              // last session id handed out
	allocated map[int]struct{}    // allocated in this session, not freed by the engine
	blocks    map[int]struct{}    // of allocated: still the engine's to free
	loads     map[string]struct{} // request ids started via StartLoad
}

func newEngineState() *engineState {
	return &engineState{allocated: map[int]struct{}{}, blocks: map[int]struct{}{}, loads: map[string]struct{}{}}
}

// attach adds an attached connection and returns the session it belongs
// to; started is true when it begins a new session.
func (e *engineState) attach() (session uint64, started bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.attached++; e.attached == 1 {
		e.last++
		e.session = e.last
		started = true
	}
	return e.session, started
}

// current returns the live session, 0 when no engine is attached.
func (e *engineState) current() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.attached == 0 {
		return 0
	}
	return e.session
}

// detach drops one attached connection; when it was the last one it
// returns the session that ended with its blocks still the engine's
// (sorted) and its loads, and forgets them.
func (e *engineState) detach() (session uint64, blocks []int, loads []string, last bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.attached--; e.attached > 0 {
		return 0, nil, nil, false
	}
	blocks = slices.Sorted(maps.Keys(e.blocks))
	loads = slices.Sorted(maps.Keys(e.loads))
	clear(e.allocated)
	clear(e.blocks)
	clear(e.loads)
	return e.session, blocks, loads, true
}

// checkOwned returns an error naming the first id of ids (field[i]) that
// was not allocated in this session, or was freed since. Ids outside
// [1, numBlocks) are left to the pool's range check, which names them
// with their own code.
func (e *engineState) checkOwned(field string, ids []uint32, numBlocks int) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, b := range ids {
		if b == 0 || int(b) >= numBlocks {
			continue
		}
		if _, ok := e.allocated[int(b)]; !ok {
			return fmt.Errorf("%w: %s[%d]=%d was not allocated by this engine session on this rank (or it freed it since); nothing was changed",
				ErrInvalidArgument, field, i, b)
		}
	}
	return nil
}

func (e *engineState) addBlocks(ids []int) {
	e.mu.Lock()
	for _, b := range ids {
		e.allocated[b] = struct{}{}
		e.blocks[b] = struct{}{}
	}
	e.mu.Unlock()
}

// takeOver records that the Rank took blocks over (it frees them).
func (e *engineState) takeOver(ids []int) {
	e.mu.Lock()
	for _, b := range ids {
		delete(e.blocks, b)
	}
	e.mu.Unlock()
}

// freed records that the engine freed blocks.
func (e *engineState) freed(ids []int) {
	e.mu.Lock()
	for _, b := range ids {
		delete(e.allocated, b)
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
