package e2e

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
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
	gone := ranks[0].WaitLog(t, "engine gone: released its state", StartTimeout)
	require.EqualValues(t, len(b), gone["blocks_freed"])
	require.EqualValues(t, 0, gone["blocks_free_failed"])
	require.Empty(t, logsWith(ranks[0].Proc, "engine gone: freeing its block failed"))
	requireNoDoubleFree(t, ranks[0].Proc)
	require.Zero(t, ranks[0].Stats(t)["blocks_used"])
}
