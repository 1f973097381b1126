package tpgroup

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// startFollower starts rank r of a coordinated group with a fresh pool, as
// a sidecar process does; stop closes both (a process that dies), and runs
// at the end of the test unless called before.
func startFollower(t *testing.T, r, tpSize int, cfg *Config) (g *Group, p *vmm.Pool, stop func()) {
	t.Helper()
	p, _ = newPool(t, r, tpSize, nil)
	g, err := New(t.Context(), Member{EngineID: "eng", TPSize: tpSize, TPRank: r}, p, cfg)
	require.NoError(t, err)
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			require.NoError(t, g.Close())
		}
	}
	t.Cleanup(stop)
	return g, p, stop
}

// TestCoordinatedFollowerRestart: rank 2 of a coordinated group dies and a
// new process takes its place with a fresh pool, while rank 0 keeps the
// pages it mapped and goes on handing out blocks of them without a message.
// The new follower's Sync (run before its engine's attach is answered)
// brings it every page rank 0 has mapped; an op rank 0 sends on its
// connection to the dead process dials the new one, syncs it and succeeds;
// unmaps afterwards succeed on every rank.
//
// fault-matrix: coordinated-follower-restart
func TestCoordinatedFollowerRestart(t *testing.T) {
	ctx := t.Context()
	cfg := &Config{Dir: sockDir(t)}
	_, p1, _ := startFollower(t, 1, 3, cfg)
	_, p2, stop2 := startFollower(t, 2, 3, cfg)
	g0 := startGroup(t, Member{EngineID: "eng", TPSize: 3}, nil, cfg)
	p0, _ := newPool(t, 0, 3, g0.Hook())
	bpp := p0.Stats().BlocksPerPage

	held, err := p0.Alloc(ctx, 2*bpp) // page 0's rest, page 1, one block of page 2
	require.NoError(t, err)
	require.Equal(t, []int{3, 3, 3}, pagesMapped([]*vmm.Pool{p0, p1, p2}))

	t.Run("synced before the engine attaches", func(t *testing.T) {
		stop2()
		g2, p2, stop2 := startFollower(t, 2, 3, cfg)
		require.Equal(t, 1, p2.Stats().PagesMapped, "a new process holds page 0 only")
		require.NoError(t, g2.Sync(ctx))
		require.Equal(t, 3, p2.Stats().PagesMapped, "every page rank 0 has mapped")
		require.Equal(t, []int{1, 2}, g2.heldPages())
		require.True(t, g2.synced.Load())
		// A block of page 2, which rank 0 mapped before the restart: no
		// message, and mapped on the new rank 2.
		more, err := p0.Alloc(ctx, 1)
		require.NoError(t, err)
		require.NoError(t, p2.CheckMapped(more))
		require.NoError(t, p0.Free(ctx, more))

		require.NoError(t, p0.Free(ctx, held))
		require.Equal(t, []int{1, 1, 1}, pagesMapped([]*vmm.Pool{p0, p1, p2}), "unmapped on every rank, the new one too")
		require.Zero(t, g0.Counters().Rollbacks)
		held, err = p0.Alloc(ctx, 2*bpp)
		require.NoError(t, err)
		stop2()
	})

	t.Run("an op on the dead connection dials the new process", func(t *testing.T) {
		_, p2, _ := startFollower(t, 2, 3, cfg)
		// No Sync: rank 0 still holds its connection to the closed group.
		ids, err := p0.Alloc(ctx, bpp) // page 2's rest and one block of page 3
		require.NoError(t, err)
		require.Equal(t, 4, p2.Stats().PagesMapped, "synced (pages 1, 2), then page 3 mapped")
		require.NoError(t, p0.Free(ctx, append(held, ids...)))
		require.Equal(t, []int{1, 1, 1}, pagesMapped([]*vmm.Pool{p0, p1, p2}))
	})
}

// TestCoordinatedRank0Restart: rank 0 is started again while its followers
// keep the pages the old rank 0 mapped. Its first connection to each
// follower syncs it to rank 0's (empty) page set, so the first map of the
// same pages succeeds instead of failing with "already mapped" for good.
//
// fault-matrix: coordinated-rank0-restart
func TestCoordinatedRank0Restart(t *testing.T) {
	ctx := t.Context()
	cfg := &Config{Dir: sockDir(t)}
	_, p1, _ := startFollower(t, 1, 2, cfg)
	g0, err := New(ctx, Member{EngineID: "eng", TPSize: 2}, nil, cfg)
	require.NoError(t, err)
	require.NoError(t, g0.Hook().MapPages(ctx, []int{1, 2}))
	require.Equal(t, 3, p1.Stats().PagesMapped)
	require.NoError(t, g0.Close()) // rank 0 dies with its pages

	g0 = startGroup(t, Member{EngineID: "eng", TPSize: 2}, nil, cfg)
	p0, _ := newPool(t, 0, 2, g0.Hook())
	ids, err := p0.Alloc(ctx, p0.Stats().BlocksPerPage)
	require.NoError(t, err, "page 1 maps on rank 1, which held it from the old rank 0")
	require.Equal(t, 2, p1.Stats().PagesMapped, "page 2 went with the sync")
	require.NoError(t, p0.Free(ctx, ids))
	require.Equal(t, 1, p1.Stats().PagesMapped)
}

// TestFollowerSyncWithoutRank0: a follower that starts before rank 0 built
// its group (no socket), or after rank 0 died (a dead socket), has nothing
// to hold: Sync returns at once. It is a no-op on rank 0 and in local
// ownership.
func TestFollowerSyncWithoutRank0(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	cfg := &Config{Dir: sockDir(t)}
	g1, _, _ := startFollower(t, 1, 2, cfg)
	require.NoError(t, g1.Sync(ctx), "no rank 0 socket")
	require.False(t, g1.synced.Load())

	g0 := startGroup(t, Member{EngineID: "eng", TPSize: 2}, nil, cfg)
	require.NoError(t, g0.Sync(ctx), "rank 0 asks nobody")
	require.NoError(t, g1.Sync(ctx))
	require.True(t, g1.synced.Load(), "rank 0 synced it")
	require.Equal(t, []uint64{0, 1}, g0.Counters().Sent, "one sync")

	local := startGroup(t, Member{EngineID: "loc", TPSize: 2, TPRank: 1}, nil, &Config{Dir: cfg.Dir, Ownership: OwnershipLocal})
	require.NoError(t, local.Sync(ctx))
	resp := rawCall(t, g1.Info().SocketPath, &v1.GroupRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, EngineId: "eng",
		TpSize: 2, FromRank: 0, ToRank: 1, Body: &v1.GroupRequest_Resync{Resync: true}})
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, resp.GetError().GetCode())
	require.Contains(t, resp.GetError().GetMessage(), "only rank 0 maps pages on the others")
}
