package transfer

import (
	"sync"
	"sync/atomic"
	"time"
)

// watchdog enforces a progress deadline: when interval passes with no call
// to progress, it calls onStall once, at most interval after the last
// progress (or the start). It owns one goroutine; stop ends it and waits.
// Timing uses only the time package, so tests run it in a testing/synctest
// bubble.
type watchdog struct {
	interval time.Duration
	start    time.Time
	last     atomic.Int64 // ns since start of the last progress
	stopc    chan struct{}
	done     chan struct{}
	once     sync.Once
	// count, when set before the transfer starts, receives the payload
	// bytes progress reports (Agent.meter).
	count func(n int)
}

// startWatchdog starts a watchdog; interval <= 0 disables it (stop still works).
func startWatchdog(interval time.Duration, onStall func()) *watchdog {
	w := &watchdog{interval: interval, start: time.Now(), stopc: make(chan struct{}), done: make(chan struct{})}
	if interval <= 0 {
		close(w.done)
		return w
	}
	go func() {
		defer close(w.done)
		t := time.NewTimer(interval)
		defer t.Stop()
		for {
			select {
			case <-w.stopc:
				return
			case <-t.C:
				idle := time.Since(w.start) - time.Duration(w.last.Load())
				if idle >= interval {
					onStall()
					return
				}
				t.Reset(interval - idle)
			}
		}
	}()
	return w
}

// progress records that n bytes (n may be 0: a frame, not payload) moved
// now, and hands n to count when set.
func (w *watchdog) progress(n int) {
	w.last.Store(int64(time.Since(w.start)))
	if w.count != nil && n > 0 {
		w.count(n)
	}
}

// stop ends the watchdog and waits for its goroutine; safe to call twice.
func (w *watchdog) stop() {
	w.once.Do(func() { close(w.stopc) })
	<-w.done
}

// budget is a counting semaphore of bytes with FIFO-free waiting: acquire
// blocks until n bytes fit under max (a request larger than max waits until
// nothing else is held, then runs alone).
type budget struct {
	mu      sync.Mutex
	max     uint64
	used    uint64
	changed chan struct{} // closed and replaced on every release
}

func newBudget(max uint64) *budget { return &budget{max: max, changed: make(chan struct{})} }

// acquire takes n bytes or returns context.Cause(ctx) / the done error.
func (b *budget) acquire(done <-chan struct{}, cause func() error, n uint64) error {
	for {
		b.mu.Lock()
		if b.used == 0 || b.used+n <= b.max {
			b.used += n
			b.mu.Unlock()
			return nil
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
	close(b.changed)
	b.changed = make(chan struct{})
	b.mu.Unlock()
}
