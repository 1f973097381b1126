package kvgeom_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

func TestModelTable(t *testing.T) {
	names := kvgeom.ModelNames()
	require.Len(t, names, 7)
	require.IsIncreasing(t, names)
	_, err := kvgeom.Model("gpt-5")
	var ke *kvgeom.Error
	require.ErrorAs(t, err, &ke)
	require.Equal(t, []string{"model"}, ke.Fields)
	require.Contains(t, err.Error(), "llama-3.1-8b")
	a, err := kvgeom.Model("qwen3-8b")
	require.NoError(t, err)
	a.NumLayers = 1
	b, err := kvgeom.Model("qwen3-8b")
	require.NoError(t, err)
	require.EqualValues(t, 36, b.GetNumLayers(), "Model returns a copy")
	for _, n := range names {
		g, err := kvgeom.Model(n)
		require.NoError(t, err)
		require.Equal(t, n, g.GetModel())
		require.EqualValues(t, kvgeom.DefaultBlockSize, g.GetBlockSize())
	}
}

func TestDTypeBytes(t *testing.T) {
	tests := []struct {
		d    v1.DType
		want int
	}{
		{v1.DType_DTYPE_FLOAT16, 2},
		{v1.DType_DTYPE_BFLOAT16, 2},
		{v1.DType_DTYPE_FLOAT32, 4},
		{v1.DType_DTYPE_FP8_E4M3, 1},
		{v1.DType_DTYPE_FP8_E5M2, 1},
	}
	for _, tc := range tests {
		t.Run(tc.d.String(), func(t *testing.T) {
			n, err := kvgeom.DTypeBytes(tc.d)
			require.NoError(t, err)
			require.Equal(t, tc.want, n)
		})
	}
	for _, d := range []v1.DType{v1.DType_DTYPE_UNSPECIFIED, v1.DType(99)} {
		_, err := kvgeom.DTypeBytes(d)
		var ke *kvgeom.Error
		require.True(t, errors.As(err, &ke), "%v", err)
		require.Equal(t, []string{"dtype"}, ke.Fields)
		require.ErrorContains(t, err, "has no known element size")
	}
}
