package tpgroup

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// coordinator is rank 0's page hook in coordinated mode.
type coordinator struct{ g *Group }

// Hook returns the vmm page hook of this member: on rank 0 of a coordinated
// group, a hook whose MapPages asks ranks 1..N-1 (never rank 0) to map the
// same pages in parallel within PeerTimeout and rolls every rank that mapped
// back when any rank fails or times out, returning an *OpError naming the
// failed ranks; its UnmapPages asks them to unmap. It is nil in local mode
// and on ranks other than 0, where no hook is set.
func (g *Group) Hook() PagePool {
	if g.cfg.Ownership != OwnershipCoordinated || g.m.TPRank != 0 {
		return nil
	}
	return coordinator{g}
}

// MapPages is called by rank 0's pool after it mapped pages locally.
func (c coordinator) MapPages(ctx context.Context, pages []int) error {
	return c.g.broadcast(ctx, v1.PageOp_KIND_MAP, pages)
}

// UnmapPages is called by rank 0's pool after it unmapped pages locally.
func (c coordinator) UnmapPages(ctx context.Context, pages []int) error {
	return c.g.broadcast(ctx, v1.PageOp_KIND_UNMAP, pages)
}

// FreeBlocks is rank 0's vmm.Config.FreeHook in coordinated mode: it tells
// ranks 1..N-1, in parallel and within PeerTimeout, that rank 0 is about to
// free blocks, and returns once each answered that it no longer uses them
// (Config.OnFree): no follower then reads or writes a block rank 0 hands
// out again or unmaps. A rank that fails or does not answer is named in an
// *OpError; nothing is rolled back (the blocks are the engine's to free).
// It is a no-op on a group of one rank.
func (g *Group) FreeBlocks(ctx context.Context, blocks []int) error {
	return g.broadcast(ctx, v1.PageOp_KIND_FREE, blocks)
}

func checkPages(pages []int) error {
	if len(pages) == 0 {
		return fmt.Errorf("%w: empty page list", ErrInvalidArgument)
	}
	for _, p := range pages {
		if p < 0 || p > math.MaxUint32 {
			return fmt.Errorf("%w: page %d: must be in [0, %d]", ErrInvalidArgument, p, uint32(math.MaxUint32))
		}
	}
	return nil
}

// fanOut runs one page op on every rank in ranks in parallel and returns the
// failures by rank.
func (g *Group) fanOut(ctx context.Context, ranks []int, kind v1.PageOp_Kind, pages []int) (ok []int, failed []*RankError) {
	errs := make([]*RankError, len(ranks))
	var wg sync.WaitGroup
	for i, r := range ranks {
		wg.Go(func() { errs[i] = g.pageOp(ctx, r, kind, pages) })
	}
	wg.Wait()
	for i, e := range errs {
		if e != nil {
			failed = append(failed, e)
		} else {
			ok = append(ok, ranks[i])
		}
	}
	sortRankErrors(failed)
	return ok, failed
}

// broadcast is the coordinated map/unmap on ranks 1..N-1.
func (g *Group) broadcast(ctx context.Context, kind v1.PageOp_Kind, pages []int) error {
	if g.cfg.Ownership != OwnershipCoordinated || g.m.TPRank != 0 {
		return fmt.Errorf("%w: rank %d, ownership %v", ErrNotCoordinator, g.m.TPRank, g.cfg.Ownership)
	}
	if err := checkPages(pages); err != nil {
		return err
	}
	if g.m.TPSize == 1 {
		return nil
	}
	if err := g.begin(); err != nil {
		return err
	}
	defer g.wg.Done()
	start := time.Now()
	op := opName(kind)
	defer func() { g.met.opSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds()) }()

	ranks := make([]int, 0, g.m.TPSize-1)
	for r := 1; r < g.m.TPSize; r++ {
		ranks = append(ranks, r)
	}
	octx, cancel := g.opContext(ctx)
	mapped, failed := g.fanOut(octx, ranks, kind, pages)
	cancel()
	if len(failed) == 0 {
		return nil
	}
	oe := &OpError{Op: op, Pages: len(pages), Failed: failed}
	if kind == v1.PageOp_KIND_FREE {
		g.log.Warn("tpgroup free barrier failed", "blocks", len(pages), "failed_ranks", oe.Ranks(), "err", oe)
		return oe
	}
	if kind == v1.PageOp_KIND_MAP && len(mapped) > 0 {
		// The caller may have given up already; the rollback still runs,
		// under its own PeerTimeout.
		rctx, cancel := g.opContext(context.WithoutCancel(ctx))
		oe.RolledBack, oe.RollbackFailed = g.fanOut(rctx, mapped, v1.PageOp_KIND_UNMAP, pages)
		cancel()
	}
	if kind == v1.PageOp_KIND_MAP {
		g.rollbacks.Add(1)
		g.met.rollbacks.Inc()
	}
	g.log.Warn("tpgroup page op failed", "op", op, "pages", len(pages), "failed_ranks", oe.Ranks(), "err", oe)
	return oe
}

// opName is the name of a page op kind in messages and metric labels.
func opName(kind v1.PageOp_Kind) string {
	switch kind {
	case v1.PageOp_KIND_UNMAP:
		return "unmap"
	case v1.PageOp_KIND_FREE:
		return "free"
	}
	return "map"
}
