package tpgroup

import (
	"context"
	"errors"
	"maps"
	"slices"
	"syscall"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// A follower of a coordinated group holds the pages rank 0 mapped on it and
// nothing else. Rank 0 keeps, per follower, the pages it mapped there, and
// sends them as a KIND_SYNC first on every connection it dials to the
// follower; a follower that starts asks rank 0 for that (Sync, a resync
// request) before its engine's attach is answered. So a follower that was
// killed and started again holds every page of rank 0's blocks before its
// engine can touch one, though rank 0 hands out blocks of pages it mapped
// long ago without a message.

// Sync, on a follower of a coordinated group, asks rank 0 to bring this
// rank's pages in line with its own and returns once this rank holds every
// page rank 0 has mapped (rank 0 drops its connection to this rank, dials
// again and sends KIND_SYNC). The local API answers an engine's attach
// only after it, so a block rank 0 hands out is mapped here before the
// engine can touch it, also after this sidecar restarted. When no rank 0
// listens (no socket, or a dead process's: rank 0 has not built its cache
// yet, or is gone) rank 0 has no page mapped, and it returns nil: a rank 0
// that starts later syncs this rank on its first connection, before any
// other op. A rank 0 that cannot be reached otherwise, or does not answer
// within PeerTimeout, is asked again until ctx ends. Errors: rank 0's
// refusal (this rank cannot map its pages: over the memory limit), or
// context.Cause(ctx). A no-op on rank 0 and in local ownership.
func (g *Group) Sync(ctx context.Context) error {
	if g.cfg.Ownership != OwnershipCoordinated || g.m.TPRank == 0 {
		return nil
	}
	if err := g.begin(); err != nil {
		return err
	}
	defer g.wg.Done()
	backoff := time.Millisecond
	for !g.synced.Load() {
		err := g.askResync(ctx)
		switch c := codes.Of(err); {
		case err == nil:
			return nil
		case errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT):
			g.log.Info("tpgroup rank 0 not listening: no page to sync", "err", err)
			return nil
		case ctx.Err() != nil || g.ctx.Err() != nil:
			return err
		case c != v1.Code_CODE_UNAVAILABLE && c != v1.Code_CODE_TIMEOUT:
			return err
		default:
			g.log.Warn("tpgroup resync with rank 0 failed; trying again", "err", err, "retry_in", backoff)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return context.Cause(ctx)
		case <-g.ctx.Done():
			t.Stop()
			return context.Cause(g.ctx)
		case <-t.C:
		}
		backoff = min(2*backoff, time.Second)
	}
	return nil
}

// askResync sends one resync request to rank 0 and waits for its answer,
// within PeerTimeout.
func (g *Group) askResync(ctx context.Context) error {
	ctx, cancel := g.opContext(ctx)
	defer cancel()
	p := g.peers[0]
	if err := p.acquire(ctx); err != nil {
		return &RankError{Rank: 0, Op: "resync", Err: err}
	}
	defer p.release()
	defer p.drop() // a follower has nothing else to ask rank 0
	req := g.request(0)
	req.Body = &v1.GroupRequest_Resync{Resync: true}
	if _, _, err := g.exchange(ctx, p, req); err != nil {
		return &RankError{Rank: 0, Op: "resync", Err: err}
	}
	return nil
}

// serveResync is rank 0's answer to a follower that asks to be brought in
// sync: its connection to the follower is dropped (the follower may be a
// new process that rank 0 still holds a dead connection to) and dialed
// again, with KIND_SYNC first.
func (g *Group) serveResync(from int) *v1.GroupResponse {
	ctx, cancel := g.opContext(g.ctx)
	defer cancel()
	p := g.peers[from]
	if err := p.acquire(ctx); err != nil {
		return g.reply("resync", &RankError{Rank: from, Op: "sync", Err: err})
	}
	defer p.release()
	p.drop()
	if err := g.syncPeer(ctx, p); err != nil {
		g.log.Warn("tpgroup resync of a follower failed", "peer", from, "err", err)
		return g.reply("resync", &RankError{Rank: from, Op: "sync", Err: err})
	}
	g.log.Info("tpgroup follower resynced", "peer", from, "pages", len(p.mappedPages()))
	return g.reply("resync", nil)
}

// serveSync makes the pages rank 0 mapped here exactly pages: those it no
// longer has are unmapped (waiting for the transfers that pin them, as an
// UNMAP does), those missing are mapped. Both run even when the other
// fails; this rank counts as synced once both succeeded.
func (g *Group) serveSync(pages []int) *v1.GroupResponse {
	ctx, cancel := g.opContext(g.ctx)
	defer cancel()
	g.opMu.Lock()
	defer g.opMu.Unlock()
	want := make(map[int]struct{}, len(pages))
	for _, pg := range pages {
		want[pg] = struct{}{}
	}
	var extra, missing []int
	for pg := range g.held {
		if _, ok := want[pg]; !ok {
			extra = append(extra, pg)
		}
	}
	for pg := range want {
		if _, ok := g.held[pg]; !ok {
			missing = append(missing, pg)
		}
	}
	slices.Sort(extra)
	slices.Sort(missing)
	var errs []error
	if len(extra) > 0 {
		errs = append(errs, g.unmapLocked(ctx, extra))
	}
	if len(missing) > 0 {
		err := g.pool.MapPages(ctx, missing)
		if err == nil {
			g.holdLocked(missing)
		}
		errs = append(errs, err)
	}
	err := errors.Join(errs...)
	if err == nil {
		g.synced.Store(true)
	}
	if len(extra)+len(missing) > 0 || err != nil {
		g.log.Info("tpgroup pages synced with rank 0", "pages", len(want), "mapped", len(missing), "unmapped", len(extra), "err", err)
	}
	return g.reply("sync", err)
}

// holdLocked records pages as mapped here by rank 0; g.opMu is held.
func (g *Group) holdLocked(pages []int) {
	for _, pg := range pages {
		g.held[pg] = struct{}{}
	}
}

// unmapLocked unmaps pages in this rank's pool, all or nothing; when the
// pool does not hold one of them mapped it unmaps the others one by one,
// and a page not mapped counts as done: rank 0 wants it unmapped, and it
// is (a follower that restarted never had it). g.opMu is held.
func (g *Group) unmapLocked(ctx context.Context, pages []int) error {
	err := g.pool.UnmapPages(ctx, pages)
	if err == nil || !errors.Is(err, vmm.ErrNotMapped) {
		if err == nil {
			for _, pg := range pages {
				delete(g.held, pg)
			}
		}
		return err
	}
	var errs []error
	absent := 0
	for _, pg := range pages {
		switch err := g.pool.UnmapPages(ctx, []int{pg}); {
		case errors.Is(err, vmm.ErrNotMapped):
			absent++
			delete(g.held, pg)
		case err != nil:
			errs = append(errs, err)
		default:
			delete(g.held, pg)
		}
	}
	g.log.Info("tpgroup rank 0 unmapped pages this rank did not hold", "pages", absent)
	return errors.Join(errs...)
}

// heldPages returns the pages rank 0 mapped here, ascending (tests).
func (g *Group) heldPages() []int {
	g.opMu.Lock()
	defer g.opMu.Unlock()
	return slices.Sorted(maps.Keys(g.held))
}
