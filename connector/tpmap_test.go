package connector_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestPlanRankCoversEveryHead simulates heterogeneous TP: every decode
// rank's block is assembled from its sources, head by head, and each slot
// must hold exactly the head it should; every prefill rank must be targeted
// by exactly Consumers decode ranks.
func TestPlanRankCoversEveryHead(t *testing.T) {
	const hb = 8 // bytes per head per block
	for _, h := range []int{1, 2, 8} {
		for _, p := range []int{1, 2, 4, 8} {
			for _, d := range []int{1, 2, 4, 8} {
				t.Run(fmt.Sprintf("H%d_P%d_D%d", h, p, d), func(t *testing.T) {
					s := connector.TPShape{NumKVHeads: h, HeadBlockBytes: hb}
					targeted := make([]int, p)
					var consumers int
					for dr := range d {
						plan, err := connector.PlanRank(s, p, d, dr)
						require.NoError(t, err)
						consumers = plan.Consumers
						local, err := connector.RankHeads(h, d, dr)
						require.NoError(t, err)
						require.Equal(t, uint64(local.Count*hb), plan.LocalBlockLen)
						got := make([]int, plan.LocalBlockLen) // head id per local byte, -1 = unfilled
						for i := range got {
							got[i] = -1
						}
						for _, src := range plan.Sources {
							targeted[src.PrefillRank]++
							if src.NotifyOnly {
								require.Zero(t, src.Len)
								continue
							}
							rem, err := connector.RankHeads(h, p, src.PrefillRank)
							require.NoError(t, err)
							require.LessOrEqual(t, src.RemoteOffset+src.Len, uint64(rem.Count*hb))
							for i := range src.Len {
								head := rem.First + int((src.RemoteOffset+i)/hb)
								require.Equal(t, -1, got[src.LocalOffset+i], "byte written twice")
								got[src.LocalOffset+i] = head
							}
						}
						for i, head := range got {
							require.Equal(t, local.First+i/hb, head, "local byte %d", i)
						}
					}
					for pr, n := range targeted {
						require.Equal(t, consumers, n, "prefill rank %d targeted by %d decode ranks, want %d", pr, n, consumers)
					}
				})
			}
		}
	}
}

func TestPlanRankExamples(t *testing.T) {
	s := connector.TPShape{NumKVHeads: 8, HeadBlockBytes: 100}
	// D=4 ≥ P=2: decode rank 3 reads the second half of prefill rank 1's block.
	plan, err := connector.PlanRank(s, 2, 4, 3)
	require.NoError(t, err)
	require.Equal(t, []connector.Source{{PrefillRank: 1, RemoteOffset: 200, Len: 200}}, plan.Sources)
	require.Equal(t, uint64(400), plan.RemoteBlockLen)
	require.Equal(t, 2, plan.Consumers)

	// P=4 > D=2: decode rank 1 reads prefill ranks 2 and 3 into two chunks.
	plan, err = connector.PlanRank(s, 4, 2, 1)
	require.NoError(t, err)
	require.Equal(t, []connector.Source{{PrefillRank: 2, Len: 200}, {PrefillRank: 3, LocalOffset: 200, Len: 200}}, plan.Sources)

	// MLA (one replicated latent), P=4 > D=2: one source read, one notify-only.
	plan, err = connector.PlanRank(connector.TPShape{NumKVHeads: 1, HeadBlockBytes: 100}, 4, 2, 1)
	require.NoError(t, err)
	require.Equal(t, []connector.Source{{PrefillRank: 2, Len: 100}, {PrefillRank: 3, NotifyOnly: true}}, plan.Sources)
}

// TestShapeOfCompoundKV: a head of one block is block_size × head_dim
// elements in HND, twice that where K and V of a head share a region (H2ND,
// HN2D), so a decode rank's slice of a compound block holds both.
func TestShapeOfCompoundKV(t *testing.T) {
	g := &v1.ModelGeometry{NumLayers: 4, NumKvHeads: 8, HeadDim: 64, Dtype: v1.DType_DTYPE_FLOAT32, BlockSize: 32,
		Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}
	for layout, want := range map[v1.Layout]uint64{v1.Layout_LAYOUT_HND: 32 * 64 * 4,
		v1.Layout_LAYOUT_H2ND: 2 * 32 * 64 * 4, v1.Layout_LAYOUT_HN2D: 2 * 32 * 64 * 4} {
		g.Layout = layout
		s, err := connector.ShapeOf(g)
		require.NoError(t, err)
		require.Equal(t, connector.TPShape{NumKVHeads: 8, HeadBlockBytes: want}, s, layout.String())
	}
}

func TestPlanRankErrors(t *testing.T) {
	tests := []struct {
		name      string
		h, p, d   int
		wantError string
	}{
		{"non-dividing sizes", 8, 3, 2, "prefill tp_size=3 and decode tp_size=2 must divide one another"},
		{"prefill does not divide heads", 8, 3, 1, "prefill side: connector: no TP mapping: tp_size=3 does not divide num_kv_heads=8"},
		{"heads do not divide decode", 6, 1, 4, "decode side: connector: no TP mapping: tp_size=4 does not divide num_kv_heads=6"},
		{"zero tp", 8, 0, 2, "prefill tp_size=0 and decode tp_size=2"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := connector.PlanRank(connector.TPShape{NumKVHeads: tc.h, HeadBlockBytes: 1}, tc.p, tc.d, 0)
			require.ErrorIs(t, err, connector.ErrTPMapping)
			require.ErrorContains(t, err, tc.wantError)
			require.Equal(t, v1.Code_CODE_TP_MISMATCH, codes.Of(err), "a configuration error, not CODE_INTERNAL")
		})
	}
}
