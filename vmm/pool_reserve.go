package vmm

// nudge wakes the refill goroutine without waiting.
func (p *Pool) nudge() {
	select {
	case p.kick <- nil:
	default:
	}
}

// settle wakes the refill goroutine and waits until it has run a full pass
// (tests use it to observe the reserve without sleeping).
func (p *Pool) settle() {
	done := make(chan struct{})
	select {
	case p.kick <- done:
	case <-p.ctx.Done():
		return
	}
	select {
	case <-done:
	case <-p.ctx.Done():
	}
}

func (p *Pool) refillLoop() {
	defer p.bg.Done()
	for {
		var done chan struct{}
		select {
		case <-p.ctx.Done():
			return
		case done = <-p.kick:
		}
		p.refill()
		if done != nil {
			close(done)
		}
	}
}

// refill maps pages one at a time until the reserve holds PreallocPages
// empty pages, the limit or the reservation is reached, or a map fails.
func (p *Pool) refill() {
	for {
		p.mu.Lock()
		if p.closed || p.empty.len()+p.refilling >= p.cfg.PreallocPages || p.newPagesAllowedLocked() == 0 {
			p.mu.Unlock()
			return
		}
		pg := p.popUnmappedLocked()
		p.refilling++
		p.refillCap += p.capOf(pg)
		p.mu.Unlock()
		err := p.mapBackend(p.ctx, []int{pg})
		if err == nil {
			err = p.callMapHook(p.ctx, []int{pg})
		}
		p.mu.Lock()
		p.refilling--
		p.refillCap -= p.capOf(pg)
		if err != nil {
			if p.pages[pg].status != pageBroken {
				p.pushUnmappedLocked(pg)
			}
			p.mu.Unlock()
			if p.ctx.Err() == nil {
				p.log.Warn("vmm: refill reserve", "page", pg, "err", err)
			}
			return
		}
		p.setMappedLocked(pg)
		trim := p.trimLocked(p.cfg.PreallocPages) // the limit may have dropped meanwhile
		p.mu.Unlock()
		if err := p.unmapTrimmed(p.ctx, trim); err != nil {
			p.log.Warn("vmm: trim after refill", "err", err)
			return
		}
	}
}
