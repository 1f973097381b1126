package transfer

import (
	"sync"
	"sync/atomic"
	"time"
)

// watchdog enforces a progress deadline: when interval passes with no call
// to progress, it calls onStall once, at most interval after the last
// progress (or the start). It runs on a timer, not a goroutine of its own,
// so a small transfer pays no goroutine start or switch for it; stop ends
// it and waits for an onStall in progress. Timing uses only the time
// package, so tests run it in a testing/synctest bubble.
type watchdog struct {
	interval time.Duration
	start    time.Time
	last     atomic.Int64 // ns since start of the last progress
	onStall  func()
	t        *time.Timer

	mu      sync.Mutex // held by a firing timer and by stop
	stopped bool
	// count, when set before the transfer starts, receives the payload
	// bytes progress reports (Agent.meter).
	count func(n int)
}

// startWatchdog starts a watchdog; interval <= 0 disables it (stop still works).
func startWatchdog(interval time.Duration, onStall func()) *watchdog {
	w := &watchdog{interval: interval, start: time.Now(), onStall: onStall}
	if interval > 0 {
		w.t = time.AfterFunc(interval, w.fire)
	}
	return w
}

// fire runs when the timer expires: a stall when no progress came for an
// interval, else the timer is set for an interval after the last progress.
func (w *watchdog) fire() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		return
	}
	idle := time.Since(w.start) - time.Duration(w.last.Load())
	if idle >= w.interval {
		w.stopped = true
		w.onStall()
		return
	}
	w.t.Reset(w.interval - idle)
}

// progress records that n bytes (n may be 0: a frame, not payload) moved
// now, and hands n to count when set.
func (w *watchdog) progress(n int) {
	w.last.Store(int64(time.Since(w.start)))
	if w.count != nil && n > 0 {
		w.count(n)
	}
}

// stop ends the watchdog; once it returns, onStall is not running and will
// not run. Safe to call twice.
func (w *watchdog) stop() {
	if w.t == nil {
		return
	}
	w.t.Stop()
	w.mu.Lock()
	w.stopped = true
	w.mu.Unlock()
}

// budget is a counting semaphore of bytes with FIFO-free waiting: acquire
// blocks until n bytes fit under max (a request larger than max waits until
// nothing else is held, then runs alone).
type budget struct {
	mu      sync.Mutex
	max     uint64
	used    uint64
	changed chan struct{} // closed by the next release; nil while nobody waits
}

func newBudget(max uint64) *budget { return &budget{max: max} }

// acquire takes n bytes or returns context.Cause(ctx) / the done error.
func (b *budget) acquire(done <-chan struct{}, cause func() error, n uint64) error {
	for {
		b.mu.Lock()
		if b.used == 0 || b.used+n <= b.max {
			b.used += n
			b.mu.Unlock()
			return nil
		}
		if b.changed == nil {
			b.changed = make(chan struct{})
		}
		ch := b.changed
		b.mu.Unlock()
		select {
		case <-ch:
		case <-done:
			return cause()
		}
	}
}

// release returns n bytes.
func (b *budget) release(n uint64) {
	b.mu.Lock()
	b.used -= n
	if b.changed != nil {
		close(b.changed)
		b.changed = nil
	}
	b.mu.Unlock()
}
