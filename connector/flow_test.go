package connector_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// runPair moves one request of nBlocks from a prefill instance of tp p to a
// decode instance of tp d and checks every byte of every decode rank.
func runPair(t *testing.T, geom *v1.ModelGeometry, p, d, nBlocks int) {
	t.Helper()
	nb := max(64, nBlocks+8)
	pre := newInstance(t, instOpts{engine: "prefill-" + name(p, d), tp: p, geom: geom, numBlocks: nb})
	dec := newInstance(t, instOpts{engine: "decode-" + name(p, d), tp: d, geom: geom, numBlocks: nb})
	key := kvgen.Key(int64(p*100 + d))
	blocks := pre.alloc(t, nBlocks)
	pre.fill(t, key, blocks)
	params := pre.finish(t, "req-1", blocks)
	require.Equal(t, uint32(p), params.GetTpSize())

	local := dec.alloc(t, nBlocks)
	dec.startLoad(t, "dec-1", local, params)
	requireAllDone(t, dec.wait(t, "dec-1"))
	checked := dec.check(t, key, local, 0)
	require.Positive(t, checked)
	dec.requirePath(t)

	// Every consumer notified: every prefill rank released its lease and
	// freed the blocks.
	for r, rank := range pre.ranks {
		f, err := rank.WaitFinished(t.Context())
		require.NoError(t, err)
		require.Equal(t, []string{"req-1"}, f.DoneSending, "prefill rank %d", r)
		require.Equal(t, 0, rank.Stats().LeasesHeld)
		require.Equal(t, 0, pre.pools[r].Stats().BlocksUsed, "prefill rank %d blocks freed", r)
	}
}

// TestHeterogeneousTP: every (P, D) in {1,2,4,8}² with 8 KV heads, 2 KV
// heads with D=4 (replicated heads), MLA, and 8 KV heads with K and V in
// one region per layer (H2ND: a decode rank's slice of heads holds both).
//
// fault-matrix: heterogeneous-tp
func TestHeterogeneousTP(t *testing.T) {
	for _, p := range []int{1, 2, 4, 8} {
		for _, d := range []int{1, 2, 4, 8} {
			t.Run("gqa8_"+name(p, d), func(t *testing.T) { runPair(t, gqa8, p, d, 5) })
		}
	}
	for _, p := range []int{1, 2, 4} {
		t.Run("gqa2_"+name(p, 4), func(t *testing.T) { runPair(t, gqa2, p, 4, 3) })
	}
	for _, pd := range [][2]int{{1, 2}, {2, 1}, {4, 2}} {
		t.Run(fmt.Sprintf("mla_%s", name(pd[0], pd[1])), func(t *testing.T) { runPair(t, mlaGeom, pd[0], pd[1], 150) })
	}
	for _, pd := range [][2]int{{1, 1}, {2, 4}, {4, 2}} {
		t.Run("gqa8_h2nd_"+name(pd[0], pd[1]), func(t *testing.T) { runPair(t, gqa8KV, pd[0], pd[1], 5) })
	}
}
