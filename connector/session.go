package connector

import (
	"context"
	"fmt"
	"slices"
	"time"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// An engine session of the local API runs from the first attach of an
// engine until its last attached connection closes (a vLLM scheduler and
// its workers are different processes of one session). Exports and loads
// carry the session that started them, so GetFinished answers a session
// only with its own results, and the results of a session that ended are
// dropped instead of reaching the next engine. Calls through the Go API
// outside the local API belong to session 0, which never ends.

type sessionKey struct{}

// WithSession returns ctx carrying engine session id: a StartLoad or
// RequestFinished under it reports to that session's GetFinished only (the
// local API, localapi, runs every call of an engine under its session).
func WithSession(ctx context.Context, id uint64) context.Context {
	return context.WithValue(ctx, sessionKey{}, id)
}

// sessionOf returns the engine session ctx carries, 0 for none.
func sessionOf(ctx context.Context) uint64 {
	id, _ := ctx.Value(sessionKey{}).(uint64)
	return id
}

// itemKind says which list of Finished an item belongs to.
type itemKind int

const (
	itemSent itemKind = iota
	itemRecv
	itemFailed
)

// finishedItem is one result waiting for GetFinished.
type finishedItem struct {
	kind    itemKind
	id      string
	session uint64
	failed  FailedLoad // itemFailed
}

// report queues a result for GetFinished; one of a session that ended is
// logged and dropped.
func (r *Rank) report(it finishedItem) {
	r.mu.Lock()
	if it.session != 0 && !r.sessions[it.session] {
		r.mu.Unlock()
		r.cfg.Logger.Info("dropped a result of an ended engine session", "session", it.session, "request_id", it.id,
			"kind", it.kind.String())
		return
	}
	r.items = append(r.items, it)
	r.signalLocked()
	r.mu.Unlock()
}

func (k itemKind) String() string {
	switch k {
	case itemSent:
		return "done_sending"
	case itemRecv:
		return "done_recving"
	}
	return "failed"
}

// takeLocked returns and forgets the queued results for which keep is
// true (all of them when keep is nil); r.mu is held.
func (r *Rank) takeLocked(keep func(finishedItem) bool) Finished {
	var f Finished
	rest := r.items[:0]
	for _, it := range r.items {
		if keep != nil && !keep(it) {
			rest = append(rest, it)
			continue
		}
		switch it.kind {
		case itemSent:
			f.DoneSending = append(f.DoneSending, it.id)
		case itemRecv:
			f.DoneRecving = append(f.DoneRecving, it.id)
		default:
			f.Failed = append(f.Failed, it.failed)
		}
	}
	if len(rest) < len(r.items) {
		r.signalLocked() // WaitCollected waits for results to go
	}
	clear(r.items[len(rest):])
	r.items = rest
	return f
}

// WaitCollected returns once every load result (done_recving, failed) of
// a live engine session was taken by GetFinished and, under local
// ownership, the engine freed the blocks of the loads Drain waited for
// (it has copied their KV out of them), or with context.Cause(ctx) when
// ctx ends first. A draining decode's local API keeps serving until then,
// so the engine collects what the drain let finish before the pages go
// away. done_sending results are not waited for: a drain releases every
// lease and an engine that stops does not need them.
func (r *Rank) WaitCollected(ctx context.Context) error {
	tick := time.NewTicker(collectPoll)
	defer tick.Stop()
	for {
		r.mu.Lock()
		n := 0
		for _, it := range r.items {
			if it.kind != itemSent && (it.session == 0 || r.sessions[it.session]) {
				n++
			}
		}
		held := 0
		if r.cfg.Ownership == v1.Ownership_OWNERSHIP_LOCAL && len(r.sessions) > 0 {
			for _, b := range r.drainBlocks {
				if r.pool.CheckAllocated([]int{b}) == nil {
					held++
				}
			}
		}
		ch := r.changed
		r.mu.Unlock()
		if n == 0 && held == 0 {
			return nil
		}
		select {
		case <-ch:
		case <-tick.C: // frees signal nothing here
		case <-ctx.Done():
			return fmt.Errorf("connector: %d load results not collected and %d loaded blocks not freed by the engine: %w", n, held, context.Cause(ctx))
		}
	}
}

// collectPoll is how often WaitCollected looks at the blocks the engine
// frees.
const collectPoll = 10 * time.Millisecond

// BeginSession makes engine session id live: its results are queued.
func (r *Rank) BeginSession(id uint64) {
	r.mu.Lock()
	r.sessions[id] = true
	r.mu.Unlock()
}

// TakeSession returns and forgets the queued results of session id: the
// GetFinished of an engine session.
func (r *Rank) TakeSession(id uint64) Finished {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.takeLocked(func(it finishedItem) bool { return it.session == id })
}

// EndSession ends session id: its queued results are returned (for the
// caller to log) and forgotten, and later ones are dropped on arrival.
func (r *Rank) EndSession(id uint64) Finished {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.sessions, id)
	return r.takeLocked(func(it finishedItem) bool { return it.session == id })
}

// RequestIDs returns the request ids of f, sorted, for a log line.
func (f Finished) RequestIDs() []string {
	out := slices.Concat(f.DoneSending, f.DoneRecving)
	for _, fl := range f.Failed {
		out = append(out, fl.RequestID)
	}
	slices.Sort(out)
	return out
}
