package vmm

import (
	"context"
	"errors"
	"time"
)

func (p *Pool) freeReservations() {
	for _, r := range p.regions {
		if err := p.be.FreeReservation(r.Base, r.Len); err != nil {
			p.log.Warn("vmm: free reservation", "region", r.Index, "err", err)
		}
	}
	p.regions = nil
}

// callMapHook tells the hook about pages mapped locally; on failure it
// unmaps them locally again.
func (p *Pool) callMapHook(ctx context.Context, pages []int) error {
	if p.cfg.PageHook == nil {
		return nil
	}
	if err := p.cfg.PageHook.MapPages(ctx, pages); err != nil {
		p.m.failures.WithLabelValues("hook_map").Inc()
		if uerr := p.unmapBackend(pages); uerr != nil {
			p.log.Warn("vmm: unmap after page hook failure", "pages", pages, "err", uerr)
		}
		return &HookError{Op: "map", Pages: pages, Err: err}
	}
	return nil
}

// unmapTrimmed unmaps busy pages picked by trimLocked and tells the hook
// about every page that was unmapped, even when others failed (those stay
// broken, still mapped here, and are not reported): a page missing from the
// hook's view stays mapped on the followers while this pool reuses its slot.
// The hook runs detached from ctx, bounded by Config.UnmapHookTimeout. The
// unmap's *PageError and the hook's *HookError are joined.
func (p *Pool) unmapTrimmed(ctx context.Context, pages []int) error {
	if len(pages) == 0 {
		return nil
	}
	err := p.unmapBackend(pages)
	p.mu.Lock()
	var done []int
	for _, pg := range pages {
		if p.pages[pg].status == pageBroken {
			continue
		}
		p.pushUnmappedLocked(pg)
		done = append(done, pg)
	}
	p.mu.Unlock()
	if p.cfg.PageHook != nil && len(done) > 0 {
		hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.UnmapHookTimeout)
		herr := p.cfg.PageHook.UnmapPages(hctx, done)
		cancel()
		if herr != nil {
			p.m.failures.WithLabelValues("hook_unmap").Inc()
			p.log.Warn("vmm: page hook unmap failed", "pages", done, "err", herr)
			err = errors.Join(err, &HookError{Op: "unmap", Pages: done, Err: herr})
		}
	}
	return err
}

// mapBackend maps busy pages in every region: create, map, set access. On
// any failure (or ctx ending) everything this call mapped is rolled back.
func (p *Pool) mapBackend(ctx context.Context, pages []int) error {
	type done struct{ pg, r int }
	var did []done
	rollback := func() {
		for i := len(did) - 1; i >= 0; i-- {
			d := did[i]
			p.dropHandle(d.pg, d.r)
		}
	}
	for _, pg := range pages {
		if err := ctx.Err(); err != nil {
			rollback()
			return context.Cause(ctx)
		}
		start := time.Now()
		for r := 0; r < p.nRegions; r++ {
			addr := p.regions[r].Base + uint64(pg)*p.ps
			h, err := p.be.Create()
			if err != nil {
				rollback()
				p.m.failures.WithLabelValues("map").Inc()
				return &PageError{Op: "map", Page: pg, Region: r, Err: err}
			}
			if err := p.be.Map(addr, h); err != nil {
				if rerr := p.be.Release(h); rerr != nil {
					p.log.Warn("vmm: release after map failure", "page", pg, "region", r, "err", rerr)
				}
				rollback()
				p.m.failures.WithLabelValues("map").Inc()
				return &PageError{Op: "map", Page: pg, Region: r, Err: err}
			}
			p.handles[pg][r] = h
			did = append(did, done{pg, r})
			if err := p.be.SetAccess(addr, p.ps); err != nil {
				rollback()
				p.m.failures.WithLabelValues("map").Inc()
				return &PageError{Op: "map", Page: pg, Region: r, Err: err}
			}
		}
		p.m.mapSeconds.WithLabelValues("map").Observe(time.Since(start).Seconds())
		p.log.Debug("vmm: page mapped", "page", pg)
	}
	return nil
}

// dropHandle unmaps and releases region r of page pg (rollback path).
func (p *Pool) dropHandle(pg, r int) {
	addr := p.regions[r].Base + uint64(pg)*p.ps
	if err := p.be.Unmap(addr); err != nil {
		p.log.Warn("vmm: rollback unmap", "page", pg, "region", r, "err", err)
	}
	if err := p.be.Release(p.handles[pg][r]); err != nil {
		p.log.Warn("vmm: rollback release", "page", pg, "region", r, "err", err)
	}
	p.handles[pg][r] = 0
}

// unmapBackend unmaps and releases busy pages in every region. A page whose
// unmap fails is marked broken (kept committed) and the first error returned.
func (p *Pool) unmapBackend(pages []int) error {
	var first error
	for _, pg := range pages {
		start := time.Now()
		var perr error
		for r := 0; r < p.nRegions; r++ {
			if p.handles[pg][r] == 0 {
				continue
			}
			addr := p.regions[r].Base + uint64(pg)*p.ps
			if err := p.be.Unmap(addr); err != nil && !errors.Is(err, ErrNotMapped) {
				perr = &PageError{Op: "unmap", Page: pg, Region: r, Err: err}
				continue
			}
			if err := p.be.Release(p.handles[pg][r]); err != nil {
				perr = &PageError{Op: "release", Page: pg, Region: r, Err: err}
				continue
			}
			p.handles[pg][r] = 0
		}
		if perr != nil {
			p.m.failures.WithLabelValues("unmap").Inc()
			p.log.Warn("vmm: unmap page failed", "page", pg, "err", perr)
			p.mu.Lock()
			p.pages[pg].status = pageBroken
			p.mu.Unlock()
			if first == nil {
				first = perr
			}
			continue
		}
		p.m.mapSeconds.WithLabelValues("unmap").Observe(time.Since(start).Seconds())
		p.log.Debug("vmm: page unmapped", "page", pg)
	}
	return first
}
