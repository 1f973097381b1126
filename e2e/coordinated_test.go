package e2e

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// The faults of a coordinated TP group (serve --ownership coordinated: rank
// 0 allocates and frees for the group and maps every page on the followers)
// when one of its processes goes away: a follower sidecar killed and
// started again, an engine that ends while rank 0's blocks are leased.
// vLLM's zero-copy workers touch exactly the pages their rank's sidecar
// reports, so a block rank 0 hands out must be mapped on every rank.

// coordGroup starts a coordinated TP-2 group with extra serve flags and
// attaches an engine to each rank, rank 1 first (rank 0 maps its pages on
// rank 1 from its first page on). It returns the sidecars and engines by
// rank, rank 0's reserve settled.
func coordGroup(t *testing.T, env *Env, name string, extra ...string) ([]*Sidecar, []*engine) {
	t.Helper()
	ranks := env.StartGroup(t, SidecarOpts{Engine: name, TPSize: 2, Args: faultArgs(append([]string{"--ownership", "coordinated"}, extra...)...)})
	e1 := attach(t, ranks[1], 4096)
	e0 := attach(t, ranks[0], 4096)
	e0.settledPages(t)
	return ranks, []*engine{e0, e1}
}

// waitStat polls `ctl stats` until key reads want, or fails after timeout
// (scaled).
func waitStat(t testing.TB, s *Sidecar, key string, want uint64, timeout time.Duration) {
	t.Helper()
	waitEqual(t, timeout, want, func() uint64 { return s.Stats(t)[key] }, "%s: %s", s.Name, key)
}

// logsWith returns the log lines of p whose msg is msg.
func logsWith(p *Proc, msg string) []map[string]any {
	var out []map[string]any
	for _, l := range p.Logs() {
		if l["msg"] == msg {
			out = append(out, l)
		}
	}
	return out
}

// requireNoDoubleFree fails when p logged a double free anywhere.
func requireNoDoubleFree(t testing.TB, p *Proc) {
	t.Helper()
	for _, l := range p.Logs() {
		require.NotContains(t, fmt.Sprint(l), "double free", "%s logged a double free", p.Name)
	}
}

// TestFaultCoordinatedFollowerRestart: rank 1's sidecar of a coordinated
// group is SIGKILLed while rank 0 has pages mapped beyond page 0, and is
// started again with its engine (vLLM's zero-copy repro: the fresh follower
// had only page 0 while rank 0 went on handing out blocks of the pages it
// believed mapped there, and the rank-1 worker touched an unmapped block).
// The restarted follower answers its engine's attach only once it holds
// every page rank 0 has mapped; a block rank 0 allocates next, in a page it
// mapped before the restart, is mapped on rank 1, written and read there, and
// taken by rank 1's RequestFinished; freeing it unmaps on both ranks with no
// failure and no double free.
//
// fault-matrix: coordinated-follower-restart
func TestFaultCoordinatedFollowerRestart(t *testing.T) {
	env := NewEnv(t)
	ranks, es := coordGroup(t, env, "coord-restart")
	perPage := int(es[0].info.GetPageSize() / es[0].info.GetBlockLen())
	// The rest of page 0 and the first block of page 1: rank 0's reserve
	// page becomes a page in use, and the refill maps another one.
	_, err := es[0].Alloc(t.Context(), perPage)
	require.NoError(t, err)
	es[0].settledPages(t)
	require.Equal(t, ranks[0].Stats(t)["pages_mapped"], ranks[1].Stats(t)["pages_mapped"], "rank 1 maps what rank 0 maps")

	// Rank 1 dies; its engine with it (a zero-copy engine stops), and the
	// engine's rank-0 side goes too, ending rank 0's session.
	ranks[1].Kill(t)
	require.NoError(t, es[0].Close())
	ranks[0].WaitLog(t, "engine session ended", StartTimeout)
	_ = es[1].Close()
	mapped0 := ranks[0].Stats(t)["pages_mapped"]
	require.Greater(t, mapped0, uint64(1), "rank 0 keeps a reserve page beyond page 0")

	failedBefore := len(logsWith(ranks[0].Proc, "tpgroup page op failed")) // while rank 1 was dead
	r1 := env.Restart(t, ranks[1])
	e1 := attach(t, r1, 4096)
	line := ranks[0].WaitLog(t, "tpgroup follower resynced", StartTimeout)
	require.EqualValues(t, 1, line["peer"], "the new rank 1 asked rank 0 for its pages")
	e0 := attach(t, ranks[0], 4096)
	require.Equal(t, ranks[0].Stats(t)["pages_mapped"], r1.Stats(t)["pages_mapped"],
		"the restarted rank 1 holds every page rank 0 has mapped once its engine's attach is answered")

	// Blocks in the pages rank 0 mapped before the restart: no new map.
	ids, err := e0.Alloc(t.Context(), perPage+1)
	require.NoError(t, err)
	require.GreaterOrEqual(t, int(slices.Max(ids)), perPage, "a block beyond page 0, in a page rank 0 mapped before rank 1 restarted")
	require.NoError(t, e1.Sync(t.Context()))
	e1.fillShape(t, heads(1, 2), 7, ids) // an unmapped page fails here instead of faulting
	e1.checkAt(t, heads(1, 2), 7, ids, 0)
	_, err = e1.RequestFinished(t.Context(), "after-restart", ids, v1.FinishStatus_FINISH_STATUS_STOP, nil)
	require.NoError(t, err, "rank 1 holds every block rank 0 allocated")
	_, err = e0.RequestFinished(t.Context(), "after-restart", ids, v1.FinishStatus_FINISH_STATUS_STOP, nil)
	require.NoError(t, err)
	require.NoError(t, e0.Free(t.Context(), ids))

	e0.requirePages(t, mapped0, "rank 0 back to its pages before")
	waitStat(t, r1, "pages_mapped", mapped0, 30*time.Second)
	require.Len(t, logsWith(ranks[0].Proc, "tpgroup page op failed"), failedBefore, "no page op failed on rank 1 after it restarted")
	requireNoDoubleFree(t, ranks[0].Proc)
	require.Zero(t, ranks[0].Stats(t)["blocks_used"])
}

// TestFaultCoordinatedSessionEndLeased: the engine of a coordinated group
// goes away while blocks rank 0 allocated are held under a prefill lease
// (exported, decode not done): the session's other blocks are freed at once,
// the leased ones when their lease ends, by rank 0, so blocks_used returns
// to 0 with no engine attached and every rank's pages return to idle
// (before, they stayed allocated for good: under coordinated ownership the
// engine frees after done_sending, and the engine was gone).
//
// fault-matrix: coordinated-session-end-leased
func TestFaultCoordinatedSessionEndLeased(t *testing.T) {
	const ttl = 3 * time.Second
	env := NewEnv(t)
	ranks, es := coordGroup(t, env, "coord-leased", "--lease-ttl", flagDur(ttl))
	idle := []uint64{ranks[0].Stats(t)["pages_mapped"], ranks[1].Stats(t)["pages_mapped"]}
	perPage := int(es[0].info.GetPageSize() / es[0].info.GetBlockLen())

	leased, err := es[0].Alloc(t.Context(), perPage+4) // beyond page 0
	require.NoError(t, err)
	other, err := es[0].Alloc(t.Context(), 3)
	require.NoError(t, err)
	require.NoError(t, es[1].Sync(t.Context())) // rank 1 learns of the pages rank 0 mapped
	for r := 1; r >= 0; r-- {
		es[r].fillShape(t, heads(r, 2), 3, leased)
		_, err := es[r].RequestFinished(t.Context(), "leased", leased, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.NoError(t, err, "rank %d", r)
		require.Equal(t, uint64(1), ranks[r].Stats(t)["leases_held"], "rank %d", r)
	}

	require.NoError(t, es[1].Close())
	require.NoError(t, es[0].Close())
	gone := ranks[0].WaitLog(t, "engine session ended", StartTimeout)
	require.EqualValues(t, len(other), gone["blocks_freed"], "the blocks no lease holds are freed at once")
	require.EqualValues(t, 0, gone["blocks_free_failed"])
	require.Equal(t, uint64(len(leased)), ranks[0].Stats(t)["blocks_used"], "leased blocks stay until their lease ends")

	for r := range ranks {
		waitStat(t, ranks[r], "leases_held", 0, ttl+slack)
	}
	waitStat(t, ranks[0], "blocks_used", 0, slack)
	for r := range ranks {
		waitStat(t, ranks[r], "pages_mapped", idle[r], slack)
	}
	requireNoDoubleFree(t, ranks[0].Proc)
}

// TestFaultCoordinatedFollowerKilledFreesOnce: rank 1 of a coordinated group
// is SIGKILLed while rank 0's engine holds blocks over several pages. The
// engine's free returns OK (its blocks are freed once, whatever rank 1's
// unmap did) and a second free of them is refused as not this session's;
// when the engine goes, rank 0 frees the rest of its blocks exactly once
// (before, a free whose unmap on rank 1 failed reported an error although
// the blocks were freed, and the session's end freed them again: one
// `double free` line per block).
//
// fault-matrix: coordinated-follower-killed
func TestFaultCoordinatedFollowerKilledFreesOnce(t *testing.T) {
	env := NewEnv(t)
	ranks, es := coordGroup(t, env, "coord-killed")
	perPage := int(es[0].info.GetPageSize() / es[0].info.GetBlockLen())
	a, err := es[0].Alloc(t.Context(), 2*perPage)
	require.NoError(t, err)
	b, err := es[0].Alloc(t.Context(), 2*perPage)
	require.NoError(t, err)

	ranks[1].Kill(t)
	_ = es[1].Close()
	require.NoError(t, es[0].Free(t.Context(), a), "the blocks are freed on rank 0 whatever rank 1 answers")
	err = es[0].Free(t.Context(), a[:1])
	require.ErrorContains(t, err, "not allocated by this engine session", "a freed block is not freed twice")

	require.NoError(t, es[0].Close())
	gone := ranks[0].WaitLog(t, "engine session ended", StartTimeout)
	require.EqualValues(t, len(b), gone["blocks_freed"])
	require.EqualValues(t, 0, gone["blocks_free_failed"])
	require.Empty(t, logsWith(ranks[0].Proc, "engine gone: freeing its block failed"))
	requireNoDoubleFree(t, ranks[0].Proc)
	require.Zero(t, ranks[0].Stats(t)["blocks_used"])
}
