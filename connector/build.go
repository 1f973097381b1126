package connector

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/tpgroup"
)

// BuildConfig is what BuildRank assembles one rank of an engine from: its
// pool (the layout of Rank.Geometry for Rank.TPRank of Rank.TPSize), the TP
// group under coordinated ownership, and the Rank. `kvsidecar serve`, the
// demo and the connector tests all build their ranks with it.
type BuildConfig struct {
	// Rank configures the Rank; its Pool must be nil (BuildRank makes it).
	// Rank.Ownership OWNERSHIP_COORDINATED with Rank.TPSize > 1 builds the
	// TP group: rank 0 maps pages on ranks 1..N-1 through it.
	Rank Config
	// NumBlocks of the pool, at least 2 (block 0 is the null block).
	NumBlocks int
	// Backend provides the pages; nil: the host backend (memfd). BuildRank
	// owns it from the call on: it is closed by Built.Close, or on failure.
	Backend vmm.Backend
	// PreallocPages is vmm.Config.PreallocPages of a pool that maps its own
	// pages (0: vmm's default); a coordinated follower keeps no reserve.
	PreallocPages int
	// Group configures the TP group of coordinated ownership (its socket
	// directory, timeouts, logger, registerer); nil: tpgroup's defaults.
	// Its Ownership is set by BuildRank.
	Group *tpgroup.Config
	// Device is the device ordinal the TP group advertises. Default 0.
	Device int
	// Track, when set, wraps the pool's page hook: it gets the hook that
	// maps pages beyond this pool (rank 0: the TP group's; a follower: its
	// own pool, which the group maps through; otherwise nil) and returns
	// the hook to use instead, e.g. the local API's page tracker.
	Track func(next vmm.PageHook) vmm.PageHook
	// BeforeRank, when set, runs once the pool exists and before the Rank
	// starts, e.g. to set a memory limit; its error fails the build.
	BeforeRank func(p *vmm.Pool) error
}

// Built is one rank as BuildRank assembled it.
type Built struct {
	// Pool holds the rank's KV pages.
	Pool *vmm.Pool
	// Group is the TP group; nil unless coordinated with TPSize > 1.
	Group *tpgroup.Group
	// Rank serves and loads the rank's KV.
	Rank *Rank
	// closers run in reverse order by Close.
	closers []func() error
}

// Coordinated reports whether c builds a TP group: coordinated ownership
// with more than one rank.
func (c *BuildConfig) Coordinated() bool {
	return c.Rank.Ownership == v1.Ownership_OWNERSHIP_COORDINATED && c.Rank.TPSize > 1
}

// BuildRank makes the pool, the TP group (coordinated ownership only; rank
// 0's group maps pages on ranks 1..N-1, so under coordinated ownership the
// followers are built first or concurrently) and the Rank. On error
// everything made so far is closed, the Backend included. Errors: the
// layout's (ErrInvalidArgument), vmm's, tpgroup's, BeforeRank's, NewRank's.
func BuildRank(ctx context.Context, cfg *BuildConfig) (_ *Built, err error) {
	if cfg == nil {
		return nil, fmt.Errorf("%w: nil BuildConfig", ErrInvalidArgument)
	}
	b := &Built{}
	if cfg.Backend != nil {
		b.closers = append(b.closers, cfg.Backend.Close)
	}
	defer func() {
		if err != nil {
			_ = b.Close()
		}
	}()
	if cfg.Rank.Pool != nil {
		return nil, fmt.Errorf("%w: BuildConfig.Rank.Pool must be nil: BuildRank makes the pool", ErrInvalidArgument)
	}
	layout, err := vmm.LayoutFor(cfg.Rank.Geometry, cfg.Rank.TPRank, cfg.Rank.TPSize)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	}
	vc := &vmm.Config{Backend: cfg.Backend, Layout: layout, NumBlocks: cfg.NumBlocks, PreallocPages: cfg.PreallocPages,
		Logger: cfg.Rank.Logger, Registerer: cfg.Rank.Registerer}
	track := cfg.Track
	if track == nil {
		track = func(next vmm.PageHook) vmm.PageHook { return next }
	}
	var gcfg tpgroup.Config
	if cfg.Group != nil {
		gcfg = *cfg.Group
	}
	gcfg.Ownership = tpgroup.OwnershipCoordinated
	member := tpgroup.Member{EngineID: cfg.Rank.EngineID, TPSize: cfg.Rank.TPSize, TPRank: cfg.Rank.TPRank, Device: cfg.Device}
	// A follower's answer to rank 0's free: no export of this rank holds
	// the blocks any more, and no transfer of this rank touches them.
	var rank atomic.Pointer[Rank]
	gcfg.OnFree = func(ctx context.Context, blocks []int) error {
		if r := rank.Load(); r != nil {
			r.ownerFreed(blocks)
		}
		return b.Pool.WaitUnpinned(ctx, blocks)
	}
	newPool := func() error {
		p, err := vmm.NewPool(ctx, vc)
		if err != nil {
			return err
		}
		b.Pool = p
		b.closers = append(b.closers, p.Close)
		return nil
	}
	newGroup := func(pool tpgroup.PagePool) error {
		g, err := tpgroup.New(ctx, member, pool, &gcfg)
		if err != nil {
			return err
		}
		b.Group = g
		b.closers = append(b.closers, g.Close)
		return nil
	}
	switch {
	case cfg.Coordinated() && cfg.Rank.TPRank == 0:
		if err := newGroup(nil); err != nil {
			return nil, err
		}
		vc.PageHook = track(b.Group.Hook())
		vc.FreeHook = b.Group.FreeBlocks
		if err := newPool(); err != nil {
			return nil, err
		}
	case cfg.Coordinated():
		vc.PreallocPages = -1
		if err := newPool(); err != nil {
			return nil, err
		}
		if err := newGroup(track(b.Pool)); err != nil {
			return nil, err
		}
		// The engine is answered once this rank holds every page rank 0
		// has mapped: after a restart of this sidecar, rank 0 hands out
		// blocks of pages it mapped before without a message.
		if err := b.Group.Sync(ctx); err != nil {
			return nil, err
		}
	default:
		vc.PageHook = track(nil)
		if err := newPool(); err != nil {
			return nil, err
		}
	}
	if cfg.BeforeRank != nil {
		if err := cfg.BeforeRank(b.Pool); err != nil {
			return nil, err
		}
	}
	rc := cfg.Rank
	rc.Pool = b.Pool
	if b.Rank, err = NewRank(ctx, &rc); err != nil {
		return nil, err
	}
	rank.Store(b.Rank)
	b.closers = append(b.closers, func() error {
		if err := b.Rank.Close(); !errors.Is(err, net.ErrClosed) {
			return err
		}
		return nil
	})
	return b, nil
}

// Close closes the Rank (unless closed already), the TP group, the pool and
// the backend, in that order, and joins their errors.
func (b *Built) Close() error {
	var errs []error
	for i := len(b.closers) - 1; i >= 0; i-- {
		errs = append(errs, b.closers[i]())
	}
	b.closers = nil
	return errors.Join(errs...)
}
