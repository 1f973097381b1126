package tpgroup

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// testLayout: one compound region, 4 KiB blocks; with 64 KiB pages that is
// 16 blocks a page and 4 pages for 64 blocks.
var testLayout = vmm.Layout{Layers: 1, Compound: true, BlockSize: 16, HeadsPerRank: 1, HeadDim: 64, DTypeBytes: 2}

const (
	testPageSize  = 64 << 10
	testNumBlocks = 64
)

// countingBackend is the real host backend with its Map calls counted.
type countingBackend struct {
	vmm.Backend
	maps, unmaps atomic.Int64
}

func (b *countingBackend) Map(addr uint64, h vmm.Handle) error {
	b.maps.Add(1)
	return b.Backend.Map(addr, h)
}

func (b *countingBackend) Unmap(addr uint64) error {
	b.unmaps.Add(1)
	return b.Backend.Unmap(addr)
}

// newPool returns a real vmm.Pool on the host backend with no prealloc
// reserve, closed at the end of the test.
func newPool(t testing.TB, rank, tpSize int, hook vmm.PageHook) (*vmm.Pool, *countingBackend) {
	t.Helper()
	hb, err := vmm.NewHostBackend(&vmm.HostConfig{PageSize: testPageSize})
	require.NoError(t, err)
	be := &countingBackend{Backend: hb}
	l := testLayout
	l.TPRank, l.TPSize = rank, tpSize
	p, err := vmm.NewPool(context.Background(), &vmm.Config{
		Backend: be, Layout: l, NumBlocks: testNumBlocks, PreallocPages: -1, PageHook: hook,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, p.Close())
		require.NoError(t, hb.Close())
	})
	return p, be
}

// coordinated starts a coordinated group of tpSize ranks on real unix
// sockets, each with a real pool; rank 0's pool has the group's hook.
func coordinated(t testing.TB, tpSize int, cfg *Config) ([]*Group, []*vmm.Pool, []*countingBackend) {
	t.Helper()
	groups := make([]*Group, tpSize)
	pools := make([]*vmm.Pool, tpSize)
	bes := make([]*countingBackend, tpSize)
	for r := 1; r < tpSize; r++ {
		pools[r], bes[r] = newPool(t, r, tpSize, nil)
		groups[r] = startGroup(t, Member{EngineID: "eng", TPSize: tpSize, TPRank: r, Device: tpSize - r}, pools[r], cfg)
	}
	groups[0] = startGroup(t, Member{EngineID: "eng", TPSize: tpSize, TPRank: 0, Device: tpSize}, nil, cfg)
	pools[0], bes[0] = newPool(t, 0, tpSize, groups[0].Hook())
	return groups, pools, bes
}

func pagesMapped(pools []*vmm.Pool) []int {
	out := make([]int, len(pools))
	for i, p := range pools {
		out[i] = p.Stats().PagesMapped
	}
	return out
}

// TestCoordinatedMap: coordinated, tp_size=4.
//
// fault-matrix: coordinated-map
func TestCoordinatedMap(t *testing.T) {
	ctx := t.Context()
	groups, pools, bes := coordinated(t, 4, &Config{Dir: sockDir(t)})
	bpp := pools[0].Stats().BlocksPerPage
	require.Equal(t, 16, bpp)

	// Blocks 1..15 live in page 0, mapped by every pool at start: no message.
	first, err := pools[0].Alloc(ctx, bpp-1)
	require.NoError(t, err)
	require.Equal(t, []uint64{0, 0, 0, 0}, groups[0].Counters().Sent)
	require.Equal(t, []int{1, 1, 1, 1}, pagesMapped(pools))
	maps0 := bes[0].maps.Load()

	// One more block needs page 1: rank 0 maps it once, ranks 1..3 once each.
	ids, err := pools[0].Alloc(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, []int{bpp}, ids)
	require.Equal(t, maps0+1, bes[0].maps.Load(), "rank 0 maps page 1 exactly once")
	require.Equal(t, []uint64{0, 2, 2, 2}, groups[0].Counters().Sent, "never a message to rank 0; a sync opens each connection")
	for r := 1; r < 4; r++ {
		c := groups[r].Counters()
		require.Equal(t, uint64(1), c.MapsServed, "rank %d", r)
		require.Equal(t, int64(2), bes[r].maps.Load(), "rank %d: page 0 at start, page 1 on command", r)
		require.Equal(t, make([]uint64, 4), c.Sent, "rank %d sends nothing", r)
	}
	require.Equal(t, []int{2, 2, 2, 2}, pagesMapped(pools))

	// Unmap follows: rank 0 locally, then ranks 1..3.
	require.NoError(t, pools[0].Free(ctx, ids))
	require.Equal(t, []int{2 - 1, 1, 1, 1}, pagesMapped(pools))
	for r := 1; r < 4; r++ {
		require.Equal(t, uint64(1), groups[r].Counters().UnmapsServed, "rank %d", r)
	}
	require.Equal(t, []uint64{0, 3, 3, 3}, groups[0].Counters().Sent)
	require.NoError(t, pools[0].Free(ctx, first))
}

// TestCoordinatedMapFailsOnRank2: a failing map on rank 2 is rolled back
// everywhere.
//
// fault-matrix: coordinated-map-rollback
func TestCoordinatedMapFailsOnRank2(t *testing.T) {
	ctx := t.Context()
	groups, pools, _ := coordinated(t, 4, &Config{Dir: sockDir(t)})
	bpp := pools[0].Stats().BlocksPerPage
	// Rank 2 may keep only page 0 mapped: its next map is refused (BUSY).
	require.NoError(t, pools[2].SetMemoryLimit(testPageSize))

	ids, err := pools[0].Alloc(ctx, bpp)
	require.Error(t, err)
	require.Nil(t, ids)
	var oe *OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, []int{2}, oe.Ranks())
	require.Equal(t, []int{1, 3}, oe.RolledBack)
	require.Empty(t, oe.RollbackFailed)
	var re *RankError
	require.ErrorAs(t, err, &re)
	require.Equal(t, 2, re.Rank)
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err))
	require.ErrorContains(t, err, "rank 2")

	require.Equal(t, []int{1, 1, 1, 1}, pagesMapped(pools), "no rank keeps page 1")
	require.Equal(t, 0, pools[0].Stats().BlocksUsed)
	for _, r := range []int{1, 3} {
		c := groups[r].Counters()
		require.Equal(t, uint64(1), c.MapsServed, "rank %d", r)
		require.Equal(t, uint64(1), c.UnmapsServed, "rank %d rolled back", r)
	}
	require.Equal(t, uint64(0), groups[2].Counters().MapsServed)
	require.Equal(t, uint64(1), groups[0].Counters().Rollbacks)

	// Once rank 2 has room again the same alloc succeeds everywhere.
	require.NoError(t, pools[2].SetMemoryLimit(0))
	ids, err = pools[0].Alloc(ctx, bpp)
	require.NoError(t, err)
	require.Len(t, ids, bpp)
	require.Equal(t, []int{2, 2, 2, 2}, pagesMapped(pools))
}

// TestLocalNoBroadcast: local ownership, tp_size=2.
//
// fault-matrix: local-ownership-no-broadcast
func TestLocalNoBroadcast(t *testing.T) {
	dir := sockDir(t)
	cfg := &Config{Dir: dir, Ownership: OwnershipLocal}
	groups := make([]*Group, 2)
	pools := make([]*vmm.Pool, 2)
	for r := range 2 {
		// Each rank drives its own pool and reserves its own null block.
		hb, err := vmm.NewHostBackend(&vmm.HostConfig{PageSize: testPageSize})
		require.NoError(t, err)
		l := testLayout
		l.TPRank, l.TPSize = r, 2
		p, err := vmm.NewPool(t.Context(), &vmm.Config{Backend: hb, Layout: l, NumBlocks: testNumBlocks})
		require.NoError(t, err)
		t.Cleanup(func() {
			require.NoError(t, p.Close())
			require.NoError(t, hb.Close())
		})
		pools[r] = p
		groups[r] = startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: r}, p, cfg)
		require.Nil(t, groups[r].Hook())
		require.Equal(t, 2, groups[r].Info().TPSize, "the real tp_size is advertised")
	}
	require.NotEqual(t, groups[0].Info().SocketPath, groups[1].Info().SocketPath)

	var alreadyMapped, otherErrs atomic.Int64
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(r), 42))
			var held [][]int
			for range 1000 {
				if len(held) > 0 && (rng.IntN(2) == 0 || pools[r].Available() < 8) {
					i := rng.IntN(len(held))
					err := pools[r].Free(t.Context(), held[i])
					held = append(held[:i], held[i+1:]...)
					count(err, &alreadyMapped, &otherErrs)
					continue
				}
				ids, err := pools[r].Alloc(t.Context(), 1+rng.IntN(8))
				count(err, &alreadyMapped, &otherErrs)
				if err == nil {
					held = append(held, ids)
				}
			}
			for _, ids := range held {
				count(pools[r].Free(t.Context(), ids), &alreadyMapped, &otherErrs)
			}
		})
	}
	wg.Wait()
	require.Zero(t, alreadyMapped.Load(), `"already mapped" errors`)
	require.Zero(t, otherErrs.Load())
	for r := range 2 {
		c := groups[r].Counters()
		require.Equal(t, []uint64{0, 0}, c.Sent, "rank %d sent nothing", r)
		require.Zero(t, c.Received, "rank %d received nothing", r)
		require.Equal(t, 0, pools[r].Stats().BlocksUsed)
	}
}

func count(err error, already, other *atomic.Int64) {
	switch {
	case err == nil:
	case errorsIsAlreadyMapped(err):
		already.Add(1)
	default:
		other.Add(1)
	}
}

// TestCoordinatedMapPeerNeverAnswers: a rank that never answers. Under
// synctest the group runs on net.Pipe (durably blocking); the pools are
// real.
//
// fault-matrix: tp-peer-never-answers
func TestCoordinatedMapPeerNeverAnswers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const timeout = 2 * time.Second
		ctx := context.Background()
		pn := newPipeNet()
		cfg := &Config{Dir: "/unused", PeerTimeout: timeout}
		dial := pn.dial
		groups := make([]*Group, 4)
		pools := make([]*vmm.Pool, 4)
		start := func(r int) {
			pools[r], _ = newPool(t, r, 4, nil)
			g, err := newGroup(ctx, Member{EngineID: "eng", TPSize: 4, TPRank: r}, pools[r], cfg, pn.listener(r, 0), dial)
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, g.Close()) })
			groups[r] = g
		}
		start(1)
		start(2)
		// Rank 3 accepts connections into its backlog and never reads them.
		pn.listener(3, 4)
		g0, err := newGroup(ctx, Member{EngineID: "eng", TPSize: 4, TPRank: 0}, nil, cfg, pn.listener(0, 0), dial)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, g0.Close()) })
		groups[0] = g0
		pools[0], _ = newPool(t, 0, 4, g0.Hook())
		bpp := pools[0].Stats().BlocksPerPage

		began := time.Now()
		ids, err := pools[0].Alloc(ctx, bpp)
		require.Equal(t, timeout, time.Since(began), "fails exactly at the deadline")
		require.Nil(t, ids)
		var oe *OpError
		require.ErrorAs(t, err, &oe)
		require.Equal(t, []int{3}, oe.Ranks())
		require.Equal(t, []int{1, 2}, oe.RolledBack)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, v1.Code_CODE_TIMEOUT, codes.Of(err))
		require.Equal(t, []int{1, 1, 1}, pagesMapped(pools[:3]), "nothing left mapped")
		require.Equal(t, 0, pools[0].Stats().BlocksUsed)

		// Rank 3 comes up for real. Its state was unknown (the sync that
		// opened the connection was never answered), so the next connection
		// to rank 3 syncs it first, then the map goes through on every rank.
		start(3)
		ids, err = pools[0].Alloc(ctx, bpp)
		require.NoError(t, err)
		require.Len(t, ids, bpp)
		require.Equal(t, []int{2, 2, 2, 2}, pagesMapped(pools))
		c3 := groups[3].Counters()
		require.Equal(t, uint64(2), c3.Received, "sync, then map")
		require.Equal(t, uint64(1), c3.MapsServed)
		require.Equal(t, []uint64{0, 4, 4, 3}, g0.Counters().Sent, "sync, map, rollback, map; rank 3: lost sync, sync, map")
		require.Zero(t, time.Since(began)-timeout, "the second alloc took no time")
	})
}

func errorsIsAlreadyMapped(err error) bool { return errors.Is(err, vmm.ErrAlreadyMapped) }

// An unmap of a page a follower does not hold (it restarted, or lost it
// behind the coordinator's back) counts as done on that follower: its other
// pages are unmapped, and nothing is reported failed or left pending.
//
// fault-matrix: coordinated-follower-restart
func TestCoordinatedUnmapOfAPageNotHeld(t *testing.T) {
	ctx := t.Context()
	groups, pools, _ := coordinated(t, 4, &Config{Dir: sockDir(t)})
	hook := groups[0].Hook()
	require.NoError(t, hook.MapPages(ctx, []int{2, 3}))
	require.Equal(t, []int{1, 3, 3, 3}, pagesMapped(pools), "the hook alone maps ranks 1..3")
	// Rank 2 loses page 3 behind the coordinator's back.
	require.NoError(t, pools[2].UnmapPages(ctx, []int{3}))

	require.NoError(t, hook.UnmapPages(ctx, []int{2, 3}))
	require.Equal(t, []int{1, 1, 1, 1}, pagesMapped(pools), "rank 2 unmapped page 2")
	require.Empty(t, groups[0].peers[2].pendingPages())
	require.Empty(t, groups[2].heldPages())
	require.Equal(t, uint64(1), groups[2].Counters().UnmapsServed)
	require.Zero(t, groups[2].Counters().Refused)

	// The pages map again on every rank.
	require.NoError(t, hook.MapPages(ctx, []int{2, 3}))
	require.Equal(t, []int{1, 3, 3, 3}, pagesMapped(pools))
	require.NoError(t, hook.UnmapPages(ctx, []int{2, 3}))

	t.Run("bad arguments", func(t *testing.T) {
		require.ErrorIs(t, hook.MapPages(ctx, nil), ErrInvalidArgument)
		require.ErrorIs(t, hook.MapPages(ctx, []int{-1}), ErrInvalidArgument)
		require.ErrorIs(t, groups[1].broadcast(ctx, v1.PageOp_KIND_MAP, []int{1}), ErrNotCoordinator)
	})
}

// An UNMAP that is never sent, because it cannot take the peer's slot or
// the repair step before it fails, still leaves its pages pending on that
// peer: the next MAP of the same page repairs it instead of failing with
// "already mapped" forever.
func TestCoordinatedUnmapNeverSentIsRepaired(t *testing.T) {
	tests := []struct {
		name string
		// block makes rank 2's UNMAP of page 2 fail before it is sent and
		// returns what undoes that.
		block func(t *testing.T, g *Group) (ctx context.Context, undo func())
		op    string
	}{
		{"slot busy", func(t *testing.T, g *Group) (context.Context, func()) {
			p := g.peers[2]
			require.NoError(t, p.acquire(t.Context()))
			ctx, cancel := context.WithCancelCause(t.Context())
			cancel(errors.New("caller gave up"))
			return ctx, p.release
		}, "unmap"},
		{"repair fails", func(t *testing.T, g *Group) (context.Context, func()) {
			// Page 99 is outside rank 2's pool: the repair's UNMAP of it is
			// refused with INVALID_ARGUMENT, which repair does not accept.
			p := g.peers[2]
			p.markPending([]int{99})
			return t.Context(), func() { p.clearPending([]int{99}) }
		}, "repair"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := t.Context()
			groups, pools, _ := coordinated(t, 4, &Config{Dir: sockDir(t)})
			hook := groups[0].Hook()
			require.NoError(t, hook.MapPages(ctx, []int{2}))
			require.Equal(t, []int{1, 2, 2, 2}, pagesMapped(pools))

			uctx, undo := tt.block(t, groups[0])
			err := hook.UnmapPages(uctx, []int{2})
			undo()
			var oe *OpError
			require.ErrorAs(t, err, &oe)
			require.Contains(t, oe.Ranks(), 2)
			var re *RankError
			require.ErrorAs(t, err, &re)
			require.Equal(t, tt.op, re.Op)
			require.Equal(t, 2, pagesMapped(pools)[2], "rank 2 never got the unmap")
			require.Equal(t, []int{2}, groups[0].peers[2].pendingPages())

			// The next MAP of page 2 first unmaps it on rank 2.
			require.NoError(t, hook.MapPages(ctx, []int{2}))
			require.Equal(t, []int{1, 2, 2, 2}, pagesMapped(pools))
			require.Empty(t, groups[0].peers[2].pendingPages())
			require.NoError(t, hook.UnmapPages(ctx, []int{2}))
			require.Equal(t, []int{1, 1, 1, 1}, pagesMapped(pools))
		})
	}
}
