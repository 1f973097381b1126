package vmm

import (
	"context"
	"fmt"
	"slices"
)

// MapPages maps page indices on command, without allocating block ids: the
// follower side of coordinated TP mode. It is all-or-nothing: on any failure
// the pages this call mapped are unmapped again. An empty page of this pool's
// own reserve is taken over without a backend call. Errors: *PageError
// wrapping ErrBlockOutOfRange (index outside [0, Pages)) or ErrAlreadyMapped
// (mapped by an earlier MapPages, or holding blocks), *LimitError, or the
// backend's *PageError.
func (p *Pool) MapPages(ctx context.Context, pages []int) error {
	if err := ctx.Err(); err != nil {
		return context.Cause(ctx)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return p.closedErr()
	}
	seen := make(map[int]bool, len(pages))
	var fresh, adopt []int
	for _, pg := range pages {
		if pg < 0 || pg >= p.nPages {
			p.mu.Unlock()
			return &PageError{Op: "map", Page: pg, Region: -1, Err: fmt.Errorf("%w: page index outside [0, %d)", ErrBlockOutOfRange, p.nPages)}
		}
		ps := p.pages[pg]
		switch {
		case seen[pg] || ps.status != pageUnmapped && !(ps.status == pageMapped && !ps.ext && ps.used == 0):
			p.mu.Unlock()
			return &PageError{Op: "map", Page: pg, Region: -1, Err: ErrAlreadyMapped}
		case ps.status == pageUnmapped:
			fresh = append(fresh, pg)
		default:
			adopt = append(adopt, pg)
		}
		seen[pg] = true
	}
	if allowed := p.limitPagesLocked() - p.committed; len(fresh) > allowed {
		p.mu.Unlock()
		return &LimitError{Want: len(fresh), Available: max(0, allowed), Limit: p.limit}
	}
	for _, pg := range fresh {
		p.removeUnmappedLocked(pg)
	}
	for _, pg := range adopt {
		p.empty.remove(pg)
		ps := &p.pages[pg]
		p.freeMapped -= len(ps.free)
		ps.free = ps.free[:0]
		ps.ext = true
	}
	p.ops.Add(1)
	p.mu.Unlock()
	defer p.ops.Done()

	err := p.mapBackend(ctx, fresh)
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		for _, pg := range fresh {
			p.pushUnmappedLocked(pg)
		}
		for _, pg := range adopt {
			p.mappedCnt--
			p.setMappedLocked(pg)
		}
		return err
	}
	for _, pg := range fresh {
		p.pages[pg].status, p.pages[pg].ext = pageMapped, true
		p.mappedCnt++
	}
	return nil
}

// UnmapPages unmaps page indices mapped by MapPages. Every index is checked
// first (a *PageError wrapping ErrNotMapped or ErrBlockOutOfRange, nothing
// unmapped); a page with a pinned block (Pool.Pin: a transfer reads or
// writes it) is unmapped only once it is unpinned: the call waits, asks
// the transfers to abort when half of ctx's deadline passed, and fails
// with ErrPinned, nothing unmapped, if they did not stop by its end. A
// backend failure is returned as a *PageError.
func (p *Pool) UnmapPages(ctx context.Context, pages []int) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return p.closedErr()
	}
	check := func() error {
		seen := make(map[int]bool, len(pages))
		for _, pg := range pages {
			if pg < 0 || pg >= p.nPages {
				return &PageError{Op: "unmap", Page: pg, Region: -1, Err: fmt.Errorf("%w: page index outside [0, %d)", ErrBlockOutOfRange, p.nPages)}
			}
			if seen[pg] || p.pages[pg].status != pageMapped || !p.pages[pg].ext {
				return &PageError{Op: "unmap", Page: pg, Region: -1, Err: ErrNotMapped}
			}
			seen[pg] = true
		}
		return nil
	}
	if err := check(); err != nil {
		p.mu.Unlock()
		return err
	}
	err := p.waitUnpinnedLocked(ctx, "unmap", func(pn *pin) bool {
		for _, pg := range pn.pages {
			if slices.Contains(pages, pg) {
				return true
			}
		}
		return false
	})
	if err == nil && p.closed {
		err = p.closedErr()
	}
	if err == nil {
		err = check() // the pages may have changed while it waited
	}
	if err != nil {
		p.mu.Unlock()
		return err
	}
	for _, pg := range pages {
		p.pages[pg].status = pageBusy
		p.mappedCnt--
	}
	p.ops.Add(1)
	p.mu.Unlock()
	defer p.ops.Done()
	err = p.unmapBackend(pages)
	p.mu.Lock()
	for _, pg := range pages {
		if p.pages[pg].status != pageBroken {
			p.pushUnmappedLocked(pg)
		}
	}
	p.mu.Unlock()
	return err
}
