package kvgeom_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
)

func TestRankHeads(t *testing.T) {
	tests := []struct {
		h, tp, r int
		want     kvgeom.HeadSpan
	}{
		{8, 1, 0, kvgeom.HeadSpan{First: 0, Count: 8}},
		{8, 4, 3, kvgeom.HeadSpan{First: 6, Count: 2}},
		{8, 8, 5, kvgeom.HeadSpan{First: 5, Count: 1}},
		// Replicated: 16 ranks over 8 heads, two ranks per head.
		{8, 16, 0, kvgeom.HeadSpan{First: 0, Count: 1}},
		{8, 16, 15, kvgeom.HeadSpan{First: 7, Count: 1}},
		// MLA: one latent on every rank.
		{1, 4, 2, kvgeom.HeadSpan{First: 0, Count: 1}},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("H%d_TP%d_R%d", tc.h, tc.tp, tc.r), func(t *testing.T) {
			got, err := kvgeom.RankHeads(tc.h, tc.tp, tc.r)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

// TestRankHeadsCoverEveryHead: over a group, every head is held by the same
// number of ranks and each rank's span is inside [0, h).
func TestRankHeadsCoverEveryHead(t *testing.T) {
	for _, h := range []int{1, 2, 6, 8} {
		for _, tp := range []int{1, 2, 3, 4, 6, 8, 16} {
			if (tp <= h && h%tp != 0) || (tp > h && tp%h != 0) {
				continue
			}
			held := make([]int, h)
			for r := range tp {
				s, err := kvgeom.RankHeads(h, tp, r)
				require.NoError(t, err)
				require.GreaterOrEqual(t, s.First, 0)
				require.LessOrEqual(t, s.First+s.Count, h)
				for i := s.First; i < s.First+s.Count; i++ {
					held[i]++
				}
			}
			for i, n := range held {
				require.Equal(t, max(1, tp/h), n, "h=%d tp=%d head %d", h, tp, i)
			}
		}
	}
}

func TestRankHeadsErrors(t *testing.T) {
	tests := []struct {
		name     string
		h, tp, r int
		fields   []string
		rule     string
	}{
		{"no heads", 0, 1, 0, []string{"num_kv_heads"}, "num_kv_heads=0 must be at least 1"},
		{"no ranks", 8, 0, 0, []string{"tp_size"}, "tp_size=0 must be at least 1"},
		{"rank beyond size", 8, 4, 4, []string{"tp_rank"}, "tp_rank=4 must be in [0, 4)"},
		{"negative rank", 8, 4, -1, []string{"tp_rank"}, "tp_rank=-1 must be in [0, 4)"},
		{"tp does not divide heads", 8, 3, 0, []string{"num_kv_heads", "tp_size"}, "tp_size=3 does not divide num_kv_heads=8"},
		{"heads do not divide tp", 8, 12, 0, []string{"num_kv_heads", "tp_size"}, "num_kv_heads=8 does not divide tp_size=12 (replicated heads)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := kvgeom.RankHeads(tc.h, tc.tp, tc.r)
			var ke *kvgeom.Error
			require.ErrorAs(t, err, &ke)
			require.Equal(t, tc.fields, ke.Fields)
			require.Equal(t, tc.rule, ke.Rule)
			require.Equal(t, "kvgeom: "+tc.rule, err.Error())
		})
	}
}

func TestHeadSpanContains(t *testing.T) {
	outer := kvgeom.HeadSpan{First: 2, Count: 4} // heads 2..5
	for _, tc := range []struct {
		in   kvgeom.HeadSpan
		want bool
	}{
		{kvgeom.HeadSpan{First: 2, Count: 4}, true},
		{kvgeom.HeadSpan{First: 3, Count: 1}, true},
		{kvgeom.HeadSpan{First: 5, Count: 1}, true},
		{kvgeom.HeadSpan{First: 1, Count: 2}, false},
		{kvgeom.HeadSpan{First: 5, Count: 2}, false},
		{kvgeom.HeadSpan{First: 0, Count: 8}, false},
	} {
		require.Equal(t, tc.want, outer.Contains(tc.in), "%+v", tc.in)
	}
}
