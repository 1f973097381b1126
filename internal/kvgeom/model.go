package kvgeom

import (
	"maps"
	"slices"
	"strings"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"google.golang.org/protobuf/proto"
)

// DefaultBlockSize is the tokens per block of the built-in model table:
// vLLM's default block_size on CUDA (vllm/config/cache.py, 16).
const DefaultBlockSize = 16

// models is the KV geometry of public models, taken from each model's
// published config.json (num_hidden_layers, num_key_value_heads, head_dim,
// torch_dtype; for MLA kv_lora_rank 512 + qk_rope_head_dim 64 = 576).
var models = map[string]*v1.ModelGeometry{
	"llama-3.1-8b":     gqa("llama-3.1-8b", 32, 8, 128),
	"llama-3.1-70b":    gqa("llama-3.1-70b", 80, 8, 128),
	"llama-3.2-1b":     gqa("llama-3.2-1b", 16, 8, 64),
	"qwen3-8b":         gqa("qwen3-8b", 36, 8, 128),
	"qwen3-0.6b":       gqa("qwen3-0.6b", 28, 8, 128),
	"qwen2.5-0.5b":     gqa("qwen2.5-0.5b", 24, 2, 64),
	"deepseek-v2-lite": mla("deepseek-v2-lite", 27, 1, 576),
}

func gqa(name string, layers, kv, dim uint32) *v1.ModelGeometry {
	return &v1.ModelGeometry{Model: name, NumLayers: layers, NumKvHeads: kv, HeadDim: dim,
		Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: DefaultBlockSize, Layout: v1.Layout_LAYOUT_HND,
		Attention: v1.Attention_ATTENTION_GQA}
}

func mla(name string, layers, kv, dim uint32) *v1.ModelGeometry {
	g := gqa(name, layers, kv, dim)
	g.Attention = v1.Attention_ATTENTION_MLA
	return g
}

// Model returns a copy of the built-in geometry of name (block_size
// DefaultBlockSize, bfloat16, HND). An unknown name is an *Error on field
// "model" that lists the known names.
func Model(name string) (*v1.ModelGeometry, error) {
	g, ok := models[name]
	if !ok {
		return nil, errorf([]string{"model"}, "model: unknown %q; known: %s", name, strings.Join(ModelNames(), ", "))
	}
	return proto.Clone(g).(*v1.ModelGeometry), nil
}

// ModelNames returns the names of the built-in model table, sorted.
func ModelNames() []string {
	return slices.Sorted(maps.Keys(models))
}

// DTypeBytes returns the element size of d in bytes: 2 for float16 and
// bfloat16, 4 for float32, 1 for the fp8 types. DTYPE_UNSPECIFIED or an
// unknown value is an *Error on field "dtype".
func DTypeBytes(d v1.DType) (int, error) {
	switch d {
	case v1.DType_DTYPE_FLOAT16, v1.DType_DTYPE_BFLOAT16:
		return 2, nil
	case v1.DType_DTYPE_FLOAT32:
		return 4, nil
	case v1.DType_DTYPE_FP8_E4M3, v1.DType_DTYPE_FP8_E5M2:
		return 1, nil
	}
	return 0, errorf([]string{"dtype"}, "dtype %v has no known element size", d)
}

// CompoundKV reports whether layout l keeps K and V of a layer in one
// region, each head's K and V together inside a block (H2ND, HN2D), so one
// head of one block is twice block_size × head_dim elements. HND and
// LAYOUT_UNSPECIFIED keep a K and a V region per layer.
func CompoundKV(l v1.Layout) bool {
	return l == v1.Layout_LAYOUT_H2ND || l == v1.Layout_LAYOUT_HN2D
}
