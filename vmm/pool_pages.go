package vmm

type pageStatus uint8

const (
	pageUnmapped pageStatus = iota
	pageBusy                // a map or unmap of it is in flight (it counts as committed)
	pageMapped
	pageBroken // an unmap failed part way; kept committed, never reused, retried at Close
)

type page struct {
	status pageStatus
	ext    bool    // mapped by MapPages (a follower); no blocks are handed out of it
	used   int32   // allocated blocks in it (page 0 counts the null block)
	free   []int32 // free block ids when mapped locally; popped from the end
}

// capOf is the number of block ids in page pg.
func (p *Pool) capOf(pg int) int {
	lo := pg * p.bpp
	return min(p.bpp, p.cfg.NumBlocks-lo)
}

// limitPagesLocked is how many page indices the limit allows in total.
func (p *Pool) limitPagesLocked() int {
	if p.limit == 0 {
		return p.nPages
	}
	return int(min(p.limit/p.pageBytes, uint64(p.nPages)))
}

// newPagesAllowedLocked is how many more pages may be mapped now.
func (p *Pool) newPagesAllowedLocked() int {
	return max(0, min(len(p.unmapped), p.limitPagesLocked()-p.committed))
}

func (p *Pool) availableLocked() int {
	k := p.newPagesAllowedLocked()
	newCap := k * p.bpp
	if k == len(p.unmapped) {
		newCap = p.unmappedCap
	}
	return p.freeMapped + newCap
}

// popUnmappedLocked takes the next unmapped page and marks it busy.
func (p *Pool) popUnmappedLocked() int {
	n := len(p.unmapped)
	pg := int(p.unmapped[n-1])
	p.unmapped = p.unmapped[:n-1]
	p.unmappedCap -= p.capOf(pg)
	p.pages[pg].status = pageBusy
	p.committed++
	if p.onCommit != nil {
		p.onCommit(p.committed, p.limitPagesLocked())
	}
	return pg
}

// pushUnmappedLocked returns a page to the unmapped stack.
func (p *Pool) pushUnmappedLocked(pg int) {
	p.pages[pg] = page{status: pageUnmapped, free: p.pages[pg].free[:0]}
	p.committed--
	p.unmappedCap += p.capOf(pg)
	if p.capOf(pg) < p.bpp {
		p.unmapped = append([]int32{int32(pg)}, p.unmapped...)
		return
	}
	p.unmapped = append(p.unmapped, int32(pg))
}

// setMappedLocked turns a busy page into a mapped local page with every
// block free; the page joins the empty set.
func (p *Pool) setMappedLocked(pg int) {
	ps := &p.pages[pg]
	ps.status, ps.ext, ps.used = pageMapped, false, 0
	lo, n := pg*p.bpp, p.capOf(pg)
	if cap(ps.free) < n {
		ps.free = make([]int32, 0, n)
	}
	ps.free = ps.free[:0]
	for b := lo + n - 1; b >= lo; b-- {
		ps.free = append(ps.free, int32(b))
	}
	p.freeMapped += n
	p.mappedCnt++
	p.empty.add(pg)
}

// takeFromPageLocked allocates up to n blocks of local mapped page pg.
func (p *Pool) takeFromPageLocked(pg, n int, ids []int) []int {
	ps := &p.pages[pg]
	if ps.used == 0 && len(ps.free) > 0 {
		p.empty.remove(pg)
		p.partial.add(pg)
	}
	k := min(n, len(ps.free))
	for i := 0; i < k; i++ {
		b := ps.free[len(ps.free)-1]
		ps.free = ps.free[:len(ps.free)-1]
		p.blockUsed[b] = true
		ids = append(ids, int(b))
	}
	ps.used += int32(k)
	p.freeMapped -= k
	p.used += k
	if len(ps.free) == 0 {
		p.partial.remove(pg)
	}
	return ids
}

// releaseLocked frees valid allocated ids and returns the pages to unmap
// (already marked busy).
func (p *Pool) releaseLocked(ids []int) []int {
	for _, b := range ids {
		pg := b / p.bpp
		ps := &p.pages[pg]
		p.blockUsed[b] = false
		if len(ps.free) == 0 {
			p.partial.add(pg)
		}
		ps.free = append(ps.free, int32(b))
		ps.used--
		p.freeMapped++
		p.used--
		if ps.used == 0 {
			p.partial.remove(pg)
			p.empty.add(pg)
		}
	}
	return p.trimLocked(p.cfg.PreallocPages)
}

// trimLocked picks empty pages to unmap: those beyond keep, and any empty
// page while the pool is over its limit. They are marked busy.
func (p *Pool) trimLocked(keep int) []int {
	var out []int
	var skipped []int
	for p.empty.len() > 0 && (p.empty.len() > keep || (p.limit != 0 && uint64(p.committed)*p.pageBytes > p.limit)) {
		pg := p.empty.last()
		if p.pinnedPageLocked(pg) {
			// A transfer still touches it (a pin on a freed block): not
			// now; the unpin trims again.
			p.empty.remove(pg)
			skipped = append(skipped, pg)
			p.trimPinned = true
			continue
		}
		p.empty.remove(pg)
		ps := &p.pages[pg]
		p.freeMapped -= len(ps.free)
		ps.free = ps.free[:0]
		ps.status = pageBusy
		p.mappedCnt--
		out = append(out, pg)
	}
	for _, pg := range skipped {
		p.empty.add(pg)
	}
	return out
}

// removeUnmappedLocked takes a specific page off the unmapped stack and
// marks it busy.
func (p *Pool) removeUnmappedLocked(pg int) {
	for i, q := range p.unmapped {
		if int(q) == pg {
			p.unmapped = append(p.unmapped[:i], p.unmapped[i+1:]...)
			break
		}
	}
	p.unmappedCap -= p.capOf(pg)
	p.pages[pg].status = pageBusy
	p.committed++
	if p.onCommit != nil {
		p.onCommit(p.committed, p.limitPagesLocked())
	}
}

// idxSet is a set of page indices with O(1) add, remove and last.
type idxSet struct {
	items []int32
	pos   []int32 // index in items + 1; 0 = absent
}

func newIdxSet(n int) idxSet { return idxSet{pos: make([]int32, n)} }

func (s *idxSet) len() int  { return len(s.items) }
func (s *idxSet) last() int { return int(s.items[len(s.items)-1]) }

func (s *idxSet) add(i int) {
	if s.pos[i] != 0 {
		return
	}
	s.items = append(s.items, int32(i))
	s.pos[i] = int32(len(s.items))
}

func (s *idxSet) remove(i int) {
	at := s.pos[i] - 1
	if at < 0 {
		return
	}
	lastIdx := len(s.items) - 1
	moved := s.items[lastIdx]
	s.items[at] = moved
	s.pos[moved] = at + 1
	s.items = s.items[:lastIdx]
	s.pos[i] = 0
}
