package vmm

import (
	"context"
	"io"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// DefaultPreallocPages is the prealloc reserve when Config.PreallocPages is
// 0: one page index (one physical page per region) kept mapped but free, so
// the next Alloc that needs a fresh page rarely waits for the backend.
const DefaultPreallocPages = 1

// DefaultUnmapHookTimeout is Config.UnmapHookTimeout when it is zero: it
// exceeds tpgroup's default PeerTimeout (5 s) so the hook's own deadline
// normally ends first.
const DefaultUnmapHookTimeout = 30 * time.Second

// MaxUnmapHookTimeout is the largest Config.UnmapHookTimeout accepted.
const MaxUnmapHookTimeout = 10 * time.Minute

// PageHook is told about page indices a coordinated-mode rank 0 maps and
// unmaps, so ranks 1..N-1 map the same pages.
//
// MapPages is called after the pages were mapped locally and checked, before
// any block in them is handed out (for Alloc) or before they join the
// reserve (for the background refill); if it fails, the pool unmaps the
// pages locally and the Alloc fails with a *HookError wrapping the hook's
// error, nothing left allocated. UnmapPages is called after the local unmap,
// so rank 0 unmaps first, then ranks 1..N-1; it gets every page that was
// unmapped (even when another page's unmap failed) and a ctx detached from
// the caller's, bounded by Config.UnmapHookTimeout. Page 0 (the null block) is
// mapped by every pool at NewPool and never passed to the hook.
type PageHook interface {
	MapPages(ctx context.Context, pages []int) error
	UnmapPages(ctx context.Context, pages []int) error
}

// Config configures NewPool. A nil *Config is rejected only because Layout
// and NumBlocks have no sensible default; every other zero field works.
type Config struct {
	// Backend provides the pages. Default (nil): NewHostBackend(nil), owned
	// and closed by the Pool. A Backend passed in is not closed by Close (the
	// Pool frees only its own reservations and pages).
	Backend Backend
	// Layout of this rank's KV cache; required (see Layout.Validate).
	Layout Layout
	// NumBlocks is the number of blocks per region, ids 0..NumBlocks-1; block
	// 0 is the null block, allocated at NewPool and never handed out.
	// Required, at least 2.
	NumBlocks int
	// MemoryLimit caps the bytes of mapped pages across all regions (reserve
	// and in-flight maps included). Default (0): no limit beyond the
	// reservation. It must leave room for page 0 (one page per region).
	MemoryLimit uint64
	// PreallocPages is the bounded reserve of mapped-but-free page indices
	// that a background goroutine keeps filled. Default (0):
	// DefaultPreallocPages; negative: no reserve (followers in coordinated
	// mode should use -1 so their pages are mapped only by MapPages).
	PreallocPages int
	// PageHook, when set, is told about every page index mapped or unmapped
	// (except page 0). Default (nil): none.
	PageHook PageHook
	// FreeHook, when set, is called by Free with the ids to free after they
	// were validated and before any is released: rank 0 of a coordinated TP
	// group waits there until ranks 1..N-1 stopped every transfer that
	// reads or writes them (tpgroup.Group.FreeBlocks), so no rank serves a
	// block that rank 0 hands out again or unmaps. It runs detached from
	// Free's ctx, bounded by UnmapHookTimeout. Default (nil): none.
	FreeHook func(ctx context.Context, ids []int) error
	// UnmapHookTimeout bounds each PageHook.UnmapPages (and FreeHook) call. That call runs
	// detached from the caller's ctx (context.WithoutCancel), so a caller
	// that gives up after the local unmap cannot leave the followers still
	// mapping pages rank 0 will reuse. Default (0): DefaultUnmapHookTimeout
	// (30 s); it must be in [0, MaxUnmapHookTimeout].
	UnmapHookTimeout time.Duration
	// Logger receives Debug per page and Warn on failures. Default (nil):
	// discard.
	Logger *slog.Logger
	// Registerer receives the kvsidecar_vmm_* metrics. Default (nil): none.
	Registerer prometheus.Registerer
}

func (c *Config) withDefaults() Config {
	var out Config
	if c != nil {
		out = *c
	}
	if out.PreallocPages == 0 {
		out.PreallocPages = DefaultPreallocPages
	}
	if out.PreallocPages < 0 {
		out.PreallocPages = 0
	}
	if out.UnmapHookTimeout == 0 {
		out.UnmapHookTimeout = DefaultUnmapHookTimeout
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return out
}
