package vmm

import (
	"errors"
	"fmt"

	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Layout is the KV cache layout of one rank: Layers layers, each either a K
// and a V region or one compound region (MLA latent, or K and V together),
// of blocks of BlockSize tokens × HeadsPerRank heads × HeadDim elements ×
// DTypeBytes bytes, heads outermost inside a block (HND; a compound K and V
// block holds K and V inside each head, as the geometry's Layout says:
// H2ND or HN2D).
type Layout struct {
	Layers       int  // num_hidden_layers, > 0
	Compound     bool // one region per layer (K and V of each head together in a block); false: a K and a V region
	MLA          bool // multi-head latent attention: one latent per token per layer, Compound implied
	BlockSize    int  // tokens per block, > 0
	HeadsPerRank int  // KV heads held by this rank, > 0 (1 for MLA)
	HeadDim      int  // elements per head, > 0 (kv_lora_rank + qk_rope_head_dim for MLA)
	DTypeBytes   int  // bytes per element: 1, 2 or 4
	TPRank       int  // informational: this rank
	TPSize       int  // informational: the group's TP size (0 read as 1)
}

// Validate checks every field; errors wrap ErrInvalidConfig and name the field.
func (l Layout) Validate() error {
	switch {
	case l.Layers <= 0:
		return configError("Layout.Layers", "%d must be > 0", l.Layers)
	case l.BlockSize <= 0:
		return configError("Layout.BlockSize", "%d must be > 0", l.BlockSize)
	case l.HeadsPerRank <= 0:
		return configError("Layout.HeadsPerRank", "%d must be > 0", l.HeadsPerRank)
	case l.HeadDim <= 0:
		return configError("Layout.HeadDim", "%d must be > 0", l.HeadDim)
	case l.DTypeBytes != 1 && l.DTypeBytes != 2 && l.DTypeBytes != 4:
		return configError("Layout.DTypeBytes", "%d must be 1, 2 or 4", l.DTypeBytes)
	case l.TPSize < 0 || l.TPRank < 0 || (l.TPSize > 0 && l.TPRank >= l.TPSize):
		return configError("Layout.TPRank", "rank %d must be in [0, TPSize %d)", l.TPRank, l.TPSize)
	}
	return nil
}

// BlockLen is the bytes of one block in one region: BlockSize × HeadsPerRank
// × HeadDim × DTypeBytes, doubled for a compound non-MLA region.
func (l Layout) BlockLen() uint64 {
	n := uint64(l.BlockSize) * uint64(l.HeadsPerRank) * uint64(l.HeadDim) * uint64(l.DTypeBytes)
	if l.Compound && !l.MLA {
		n *= 2
	}
	return n
}

// NumRegions is Layers for a compound or MLA layout, 2 × Layers otherwise.
func (l Layout) NumRegions() int {
	if l.Compound || l.MLA {
		return l.Layers
	}
	return 2 * l.Layers
}

// Region returns the layer and kind of region i (for each layer K then V, or
// one compound region).
func (l Layout) Region(i int) (layer int, kind v1.RegionKind) {
	if l.Compound || l.MLA {
		return i, v1.RegionKind_REGION_KIND_COMPOUND
	}
	if i%2 == 0 {
		return i / 2, v1.RegionKind_REGION_KIND_K
	}
	return i / 2, v1.RegionKind_REGION_KIND_V
}

// BytesPerToken is the KV bytes one token costs on this rank, all regions.
func (l Layout) BytesPerToken() uint64 {
	return l.BlockLen() / uint64(l.BlockSize) * uint64(l.NumRegions())
}

// Limits of a geometry LayoutFor accepts. They are far above any published
// model (the largest in the table has 80 layers, 8 KV heads, head_dim 576)
// and keep the block arithmetic far inside 64 bits: 65,536 tokens × 4,096
// heads × 65,536 elements × 4 bytes is 2^46.
const (
	MaxLayers    = 4096
	MaxKVHeads   = 4096
	MaxHeadDim   = 65536
	MaxBlockSize = 65536
)

// GeometryError reports a geometry LayoutFor refuses: Fields are the
// ModelGeometry field names involved (num_layers, num_kv_heads, head_dim,
// block_size, dtype, layout, attention) plus "tp_size" and "tp_rank" where
// the rule involves the TP group, so a caller can name its own flags or
// fields; Rule says what was wrong with which values. It wraps
// ErrInvalidConfig (CODE_INVALID_ARGUMENT).
type GeometryError struct {
	Fields []string
	Rule   string
}

func (e *GeometryError) Error() string { return "vmm: geometry: " + e.Rule }

// Unwrap returns ErrInvalidConfig.
func (e *GeometryError) Unwrap() error { return ErrInvalidConfig }

func geometryError(fields []string, format string, a ...any) error {
	return &GeometryError{Fields: fields, Rule: fmt.Sprintf(format, a...)}
}

// geometryFrom returns the *GeometryError of a *kvgeom.Error: the same
// fields and rule.
func geometryFrom(err error) error {
	var ke *kvgeom.Error
	if !errors.As(err, &ke) {
		return configError("ModelGeometry", "%v", err)
	}
	return &GeometryError{Fields: ke.Fields, Rule: ke.Rule}
}

// LayoutFor derives the layout of rank tpRank of a TP group of tpSize ranks.
// GQA: each rank holds num_kv_heads / tpSize heads,
// which must divide; when tpSize > num_kv_heads the heads are replicated, one
// per rank, and tpSize must be a multiple of num_kv_heads. MLA: every rank
// holds the whole latent, one "head" of head_dim elements (kv_lora_rank +
// qk_rope_head_dim), so num_kv_heads must be 1. num_layers, num_kv_heads,
// head_dim and block_size must be positive and at most MaxLayers,
// MaxKVHeads, MaxHeadDim and MaxBlockSize. A rule a geometry breaks is a
// *GeometryError naming the fields and both values; other errors wrap
// ErrInvalidConfig and name the field.
func LayoutFor(g *v1.ModelGeometry, tpRank, tpSize int) (Layout, error) {
	if g == nil {
		return Layout{}, configError("ModelGeometry", "nil")
	}
	if tpSize <= 0 {
		return Layout{}, geometryError([]string{"tp_size"}, "tp_size=%d must be > 0", tpSize)
	}
	if tpRank < 0 || tpRank >= tpSize {
		return Layout{}, geometryError([]string{"tp_rank"}, "tp_rank=%d must be in [0, tp_size=%d)", tpRank, tpSize)
	}
	compound := kvgeom.CompoundKV(g.GetLayout())
	if _, known := v1.Layout_name[int32(g.GetLayout())]; !known {
		return Layout{}, geometryError([]string{"layout"}, "layout %v is unknown; want HND, H2ND or HN2D", g.GetLayout())
	}
	db, err := kvgeom.DTypeBytes(g.GetDtype())
	if err != nil {
		return Layout{}, geometryFrom(err)
	}
	for _, f := range []struct {
		name string
		v    uint32
		max  int
	}{{"num_layers", g.GetNumLayers(), MaxLayers}, {"num_kv_heads", g.GetNumKvHeads(), MaxKVHeads},
		{"head_dim", g.GetHeadDim(), MaxHeadDim}, {"block_size", g.GetBlockSize(), MaxBlockSize}} {
		if f.v < 1 || int64(f.v) > int64(f.max) {
			return Layout{}, geometryError([]string{f.name}, "%s=%d must be in [1, %d]", f.name, f.v, f.max)
		}
	}
	kv := int(g.GetNumKvHeads())
	l := Layout{
		Layers:     int(g.GetNumLayers()),
		BlockSize:  int(g.GetBlockSize()),
		HeadDim:    int(g.GetHeadDim()),
		DTypeBytes: db,
		TPRank:     tpRank,
		TPSize:     tpSize,
	}
	switch g.GetAttention() {
	case v1.Attention_ATTENTION_MLA:
		if compound {
			return Layout{}, geometryError([]string{"attention", "layout"},
				"layout %v with attention MLA: an MLA cache holds one latent per token and layer, no K and V to place; use HND", g.GetLayout())
		}
		if kv != 1 {
			return Layout{}, geometryError([]string{"attention", "num_kv_heads"},
				"num_kv_heads=%d with attention MLA: MLA caches one latent per token and layer, so num_kv_heads must be 1 (head_dim holds kv_lora_rank + qk_rope_head_dim)", kv)
		}
		l.MLA, l.Compound, l.HeadsPerRank = true, true, 1
	case v1.Attention_ATTENTION_GQA, v1.Attention_ATTENTION_UNSPECIFIED:
		// tp_size, tp_rank and num_kv_heads are in range: the split fails
		// only when neither of tp_size and num_kv_heads divides the other.
		heads, err := kvgeom.RankHeads(kv, tpSize, tpRank)
		if err != nil {
			return Layout{}, geometryError([]string{"num_kv_heads", "tp_size"},
				"tp_size=%d and num_kv_heads=%d: one must divide the other (num_kv_heads %% tp_size == 0, or tp_size %% num_kv_heads == 0 to replicate heads)", tpSize, kv)
		}
		l.HeadsPerRank, l.Compound = heads.Count, compound
	default:
		return Layout{}, geometryError([]string{"attention"}, "attention %v is unknown", g.GetAttention())
	}
	if err := l.Validate(); err != nil {
		return Layout{}, err
	}
	return l, nil
}

func (l Layout) String() string {
	return fmt.Sprintf("layers=%d regions=%d block_size=%d heads=%d head_dim=%d dtype_bytes=%d block_len=%d",
		l.Layers, l.NumRegions(), l.BlockSize, l.HeadsPerRank, l.HeadDim, l.DTypeBytes, l.BlockLen())
}
