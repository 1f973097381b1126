package vmm

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

func TestLayoutFor(t *testing.T) {
	tests := []struct {
		model         string
		rank, size    int
		heads         int
		regions       int
		blockLen      uint64
		bytesPerToken uint64
	}{
		// llama-3.1-8b: 2 × 32 × 8 × 128 × 2 = 128 KiB per token at TP 1.
		{"llama-3.1-8b", 0, 1, 8, 64, 16 * 8 * 128 * 2, 131072},
		{"llama-3.1-8b", 3, 4, 2, 64, 16 * 2 * 128 * 2, 131072 / 4},
		{"llama-3.1-70b", 7, 8, 1, 160, 16 * 128 * 2, 2 * 80 * 128 * 2},
		// Replicated: TP 16 > 8 heads, one head per rank.
		{"llama-3.1-8b", 15, 16, 1, 64, 16 * 128 * 2, 2 * 32 * 128 * 2},
		{"qwen2.5-0.5b", 1, 2, 1, 48, 16 * 64 * 2, 2 * 24 * 64 * 2},
		// MLA: the whole latent on every rank, one region per layer.
		{"deepseek-v2-lite", 1, 2, 1, 27, 16 * 576 * 2, 27 * 576 * 2},
	}
	for _, tc := range tests {
		t.Run(tc.model, func(t *testing.T) {
			g, err := kvgeom.Model(tc.model)
			require.NoError(t, err)
			l, err := LayoutFor(g, tc.rank, tc.size)
			require.NoError(t, err)
			require.Equal(t, tc.heads, l.HeadsPerRank)
			require.Equal(t, tc.regions, l.NumRegions())
			require.Equal(t, tc.blockLen, l.BlockLen())
			require.Equal(t, tc.bytesPerToken, l.BytesPerToken())
		})
	}
}

// TestLayoutForCompoundKV: the H2ND and HN2D layouts keep K and V of a
// layer in one region, so a rank holds half the regions, each block twice
// as long, and a token costs the same bytes as in HND.
func TestLayoutForCompoundKV(t *testing.T) {
	for _, layout := range []v1.Layout{v1.Layout_LAYOUT_H2ND, v1.Layout_LAYOUT_HN2D} {
		t.Run(layout.String(), func(t *testing.T) {
			g, err := kvgeom.Model("llama-3.1-8b")
			require.NoError(t, err)
			g.Layout = layout
			l, err := LayoutFor(g, 1, 4)
			require.NoError(t, err)
			require.True(t, l.Compound)
			require.Equal(t, 32, l.NumRegions())
			require.Equal(t, uint64(2*16*2*128*2), l.BlockLen())
			require.Equal(t, uint64(131072/4), l.BytesPerToken())
			layer, kind := l.Region(5)
			require.Equal(t, 5, layer)
			require.Equal(t, v1.RegionKind_REGION_KIND_COMPOUND, kind)
		})
	}
}

func TestLayoutForRejects(t *testing.T) {
	g, err := kvgeom.Model("llama-3.1-8b")
	require.NoError(t, err)
	noDtype := proto.Clone(g).(*v1.ModelGeometry)
	noDtype.Dtype = v1.DType_DTYPE_UNSPECIFIED
	with := func(f func(g *v1.ModelGeometry)) *v1.ModelGeometry {
		c := proto.Clone(g).(*v1.ModelGeometry)
		f(c)
		return c
	}
	tests := []struct {
		name       string
		g          *v1.ModelGeometry
		rank, size int
		msg        string
		fields     []string // of the *GeometryError; nil: another error
	}{
		{"nil geometry", nil, 0, 1, "ModelGeometry", nil},
		{"tp 3 of 8 heads", g, 0, 3, "tp_size=3 and num_kv_heads=8: one must divide the other", []string{"num_kv_heads", "tp_size"}},
		{"tp 12 of 8 heads", g, 0, 12, "tp_size=12", []string{"num_kv_heads", "tp_size"}},
		{"rank beyond size", g, 4, 4, "tp_rank=4", []string{"tp_rank"}},
		{"zero size", g, 0, 0, "tp_size=0", []string{"tp_size"}},
		{"no dtype", noDtype, 0, 1, "dtype", []string{"dtype"}},
		// The reported input: a DeepSeek-style latent declared with 16 heads
		// made blocks 16 times too large and failed every load later.
		{"mla with 16 heads", with(func(g *v1.ModelGeometry) {
			g.Attention, g.NumKvHeads, g.HeadDim, g.NumLayers = v1.Attention_ATTENTION_MLA, 16, 576, 2
		}), 0, 1, "num_kv_heads=16 with attention MLA", []string{"attention", "num_kv_heads"}},
		{"mla in a compound layout", with(func(g *v1.ModelGeometry) {
			g.Attention, g.NumKvHeads, g.HeadDim, g.Layout = v1.Attention_ATTENTION_MLA, 1, 576, v1.Layout_LAYOUT_H2ND
		}), 0, 1, "layout LAYOUT_H2ND with attention MLA", []string{"attention", "layout"}},
		{"unknown layout", with(func(g *v1.ModelGeometry) { g.Layout = 9 }), 0, 1, "layout 9 is unknown; want HND, H2ND or HN2D", []string{"layout"}},
		{"no layers", with(func(g *v1.ModelGeometry) { g.NumLayers = 0 }), 0, 1, "num_layers=0 must be in [1, 4096]", []string{"num_layers"}},
		{"too many layers", with(func(g *v1.ModelGeometry) { g.NumLayers = MaxLayers + 1 }), 0, 1, "num_layers=4097", []string{"num_layers"}},
		{"no heads", with(func(g *v1.ModelGeometry) { g.NumKvHeads = 0 }), 0, 1, "num_kv_heads=0", []string{"num_kv_heads"}},
		{"head dim 0", with(func(g *v1.ModelGeometry) { g.HeadDim = 0 }), 0, 1, "head_dim=0 must be in [1, 65536]", []string{"head_dim"}},
		{"block size 0", with(func(g *v1.ModelGeometry) { g.BlockSize = 0 }), 0, 1, "block_size=0", []string{"block_size"}},
		{"block size too large", with(func(g *v1.ModelGeometry) { g.BlockSize = MaxBlockSize + 1 }), 0, 1, "block_size=65537", []string{"block_size"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LayoutFor(tc.g, tc.rank, tc.size)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err))
			require.Contains(t, err.Error(), tc.msg)
			var ge *GeometryError
			if tc.fields == nil {
				require.False(t, errors.As(err, &ge), "%v", err)
				return
			}
			require.ErrorAs(t, err, &ge)
			require.Equal(t, tc.fields, ge.Fields)
		})
	}
}

// FuzzLayoutFor checks that any geometry either is rejected or yields a
// layout whose arithmetic holds.
func FuzzLayoutFor(f *testing.F) {
	for _, n := range kvgeom.ModelNames() {
		g, _ := kvgeom.Model(n)
		b, _ := proto.Marshal(g)
		f.Add(b, 0, 1)
		f.Add(b, 1, 2)
	}
	f.Fuzz(func(t *testing.T, raw []byte, rank, size int) {
		var g v1.ModelGeometry
		if proto.Unmarshal(raw, &g) != nil {
			return
		}
		l, err := LayoutFor(&g, rank, size)
		if err != nil {
			require.ErrorIs(t, err, ErrInvalidConfig)
			return
		}
		require.NoError(t, l.Validate())
		require.Positive(t, l.BlockLen())
		if g.GetAttention() != v1.Attention_ATTENTION_MLA {
			kv := int(g.GetNumKvHeads())
			require.True(t, l.HeadsPerRank*size == kv || (l.HeadsPerRank == 1 && size%kv == 0),
				"heads %d × tp %d vs kv %d", l.HeadsPerRank, size, kv)
		}
	})
}

func TestRegionInfoBlockOffset(t *testing.T) {
	tests := []struct {
		name string
		r    RegionInfo
		b    int
		want uint64
	}{
		{"packed power of 2", RegionInfo{BlockLen: 2048, PageSize: 64 << 10}, 37, 37 * 2048},
		{"gap at page end", RegionInfo{BlockLen: 3000, PageSize: 8192}, 3, 8192 + 3000},
		{"hand built, no page size either", RegionInfo{BlockLen: 512}, 5, 5 * 512},
		{"block 0", RegionInfo{BlockLen: 2048}, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, tc.r.BlockOffset(tc.b))
		})
	}
}
