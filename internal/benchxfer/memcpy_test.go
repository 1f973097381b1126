package benchxfer

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMemcpyCopiesEveryByte: every share of the bytes lands in its
// descriptor, for thread counts that do and do not divide the bytes and
// more threads than descriptors.
func TestMemcpyCopiesEveryByte(t *testing.T) {
	sizes := []int{1, 4096, 777, 3 << 10}
	for _, threads := range []int{1, 2, 3, 7} {
		src, dst := make([][]byte, len(sizes)), make([][]byte, len(sizes))
		for i, n := range sizes {
			src[i], dst[i] = make([]byte, n), make([]byte, n)
			for j := range src[i] {
				src[i][j] = byte(i*31 + j*7 + 1)
			}
		}
		d, err := Memcpy(dst, src, threads)
		require.NoError(t, err)
		require.Positive(t, d)
		require.Equal(t, src, dst, "%d threads", threads)
	}
}

func TestMemcpyRefusesMismatch(t *testing.T) {
	_, err := Memcpy([][]byte{make([]byte, 2)}, [][]byte{make([]byte, 3)}, 1)
	require.ErrorContains(t, err, "source 0 has 3 bytes, its destination 2")
	_, err = Memcpy(nil, nil, 0)
	require.ErrorContains(t, err, "on 0 threads")
}
