package vmm

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// ErrPinned: blocks or pages in use by a transfer (Pool.Pin) did not come
// free within the deadline, also after the transfers were asked to abort;
// nothing was unmapped. v1.Code_CODE_BUSY.
var ErrPinned = codes.New(v1.Code_CODE_BUSY, "vmm: pinned by a transfer")

// pin is one transfer's hold on blocks (Pool.Pin).
type pin struct {
	blocks []int
	pages  []int // the distinct pages of blocks
	abort  func()
}

// Pin keeps the pages of ids mapped while a transfer reads or writes the
// blocks: a follower's UnmapPages of one of those pages, and a follower's
// WaitUnpinned of one of the blocks (rank 0 freeing it), wait until unpin
// is called, and ask the transfer to stop (abort, called once, from
// another goroutine) when half their deadline passed. The empty reserve
// pages trimmed by the limit or by Free skip a page with a pinned block.
// The check and the pin are one step: every id must be in [1, NumBlocks)
// on a mapped page, else a *BlockError (ErrBlockOutOfRange, ErrNullBlock,
// ErrNotMapped) and nothing is pinned; after Close an error wrapping
// net.ErrClosed. unpin may be called more than once; only the first call
// counts.
func (p *Pool) Pin(ids []int, abort func()) (unpin func(), err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, p.closedErr()
	}
	pn := &pin{blocks: slices.Clone(ids), abort: abort}
	for _, b := range ids {
		if err := p.checkBlockLocked(b, false); err != nil {
			return nil, err
		}
		if pg := b / p.bpp; !slices.Contains(pn.pages, pg) {
			pn.pages = append(pn.pages, pg)
		}
	}
	if p.pins == nil {
		p.pins = map[*pin]struct{}{}
		p.pagePins = make([]int32, p.nPages)
	}
	p.pins[pn] = struct{}{}
	for _, pg := range pn.pages {
		p.pagePins[pg]++
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			p.mu.Lock()
			delete(p.pins, pn)
			for _, pg := range pn.pages {
				p.pagePins[pg]--
			}
			if p.unpinned != nil {
				close(p.unpinned)
				p.unpinned = nil
			}
			// A Free (or a lowered limit) that left an empty page mapped
			// because this pin held it: trim now, or the page stays
			// mapped beyond the reserve until the next Free.
			var trim []int
			if p.trimPinned && !p.closed {
				p.trimPinned = false
				trim = p.trimLocked(p.cfg.PreallocPages)
			}
			if len(trim) == 0 {
				p.mu.Unlock()
				return
			}
			p.ops.Add(1)
			p.mu.Unlock()
			defer p.ops.Done()
			// Logged and counted by unmapTrimmed.
			_ = p.unmapTrimmed(p.ctx, trim)
		})
	}, nil
}

// pinnedPageLocked reports whether a block of page pg is pinned; p.mu is
// held.
func (p *Pool) pinnedPageLocked(pg int) bool {
	return p.pagePins != nil && p.pagePins[pg] > 0
}

// WaitUnpinned returns once no block of ids is pinned (Pool.Pin): what a
// follower of a coordinated TP group does before rank 0 frees the blocks,
// so rank 0 neither unmaps nor hands out a block while this rank still
// reads or writes it. When half of ctx's deadline (or of 5 s without one)
// passed, the transfers still holding a pin are asked to abort; if they
// did not stop when ctx ends, the error wraps ErrPinned and names the
// blocks.
func (p *Pool) WaitUnpinned(ctx context.Context, ids []int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waitUnpinnedLocked(ctx, "free", func(pn *pin) bool {
		for _, b := range pn.blocks {
			if slices.Contains(ids, b) {
				return true
			}
		}
		return false
	})
}

// waitUnpinnedLocked waits, with p.mu held (released while it waits, held
// again when it returns), until no pin matches; see WaitUnpinned.
func (p *Pool) waitUnpinnedLocked(ctx context.Context, op string, match func(*pin) bool) error {
	patience := 5 * time.Second / 2
	if dl, ok := ctx.Deadline(); ok {
		patience = time.Until(dl) / 2
	}
	timer := time.NewTimer(patience)
	defer timer.Stop()
	aborted := false
	for {
		var held []*pin
		for pn := range p.pins {
			if match(pn) {
				held = append(held, pn)
			}
		}
		if len(held) == 0 {
			return nil
		}
		if p.unpinned == nil {
			p.unpinned = make(chan struct{})
		}
		ch := p.unpinned
		p.mu.Unlock()
		select {
		case <-ch:
		case <-timer.C:
			if !aborted {
				aborted = true
				p.log.Warn("vmm: transfers still use blocks rank 0 frees or unmaps; aborting them", "op", op, "transfers", len(held))
				for _, pn := range held {
					if pn.abort != nil {
						pn.abort()
					}
				}
			}
		case <-ctx.Done():
			p.mu.Lock()
			var blocks []int
			for _, pn := range held {
				blocks = append(blocks, pn.blocks...)
			}
			slices.Sort(blocks)
			return fmt.Errorf("%w: %s: blocks %v are still read or written by %d transfer(s): %w", ErrPinned, op, slices.Compact(blocks), len(held), context.Cause(ctx))
		}
		p.mu.Lock()
	}
}
