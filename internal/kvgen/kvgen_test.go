package kvgen_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/kvgen"
)

func TestFillCheck(t *testing.T) {
	s := kvgen.Shape{BlockSize: 16, RowBytes: 256, FirstHead: 2, Heads: 2}
	require.NoError(t, s.Validate())
	buf := make([]byte, s.BlockLen())
	key := kvgen.Key(42)
	kvgen.FillBlock(buf, s, key, 3, 32)
	n, first := kvgen.CheckBlock(buf, s, key, 3, 32)
	require.Zero(t, n)
	require.Equal(t, -1, first)

	// Every coordinate changes the content: a misplaced slice is caught.
	for name, check := range map[string]func() (int, int){
		"key":    func() (int, int) { return kvgen.CheckBlock(buf, s, kvgen.Key(43), 3, 32) },
		"region": func() (int, int) { return kvgen.CheckBlock(buf, s, key, 4, 32) },
		"token":  func() (int, int) { return kvgen.CheckBlock(buf, s, key, 3, 48) },
		"head": func() (int, int) {
			s2 := s
			s2.FirstHead = 3
			return kvgen.CheckBlock(buf, s2, key, 3, 32)
		},
	} {
		n, first := check()
		require.Greater(t, n, len(buf)/2, name)
		require.Equal(t, 0, first, name)
	}

	// One flipped byte is counted once at its offset.
	buf[1000] ^= 0x10
	n, first = kvgen.CheckBlock(buf, s, key, 3, 32)
	require.Equal(t, 1, n)
	require.Equal(t, 1000, first)
}

func TestHeadSliceOfWiderBlock(t *testing.T) {
	// A prefill rank with heads 0..3 holds, at the offset of head 2, exactly
	// what a decode rank with heads 2..3 generates.
	wide := kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 0, Heads: 4}
	narrow := kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 2, Heads: 2}
	buf := make([]byte, wide.BlockLen())
	kvgen.FillBlock(buf, wide, 7, 0, 0)
	off := 2 * 16 * 128
	n, _ := kvgen.CheckBlock(buf[off:off+narrow.BlockLen()], narrow, 7, 0, 0)
	require.Zero(t, n)
}

func TestValidate(t *testing.T) {
	require.ErrorContains(t, kvgen.Shape{BlockSize: 16, RowBytes: 12, Heads: 1}.Validate(), "multiple of 8")
}

func BenchmarkFillCheck(b *testing.B) {
	s := kvgen.Shape{BlockSize: 16, RowBytes: 256, Heads: 4}
	buf := make([]byte, s.BlockLen())
	b.SetBytes(int64(2 * len(buf)))
	b.ReportAllocs()
	for b.Loop() {
		kvgen.FillBlock(buf, s, 1, 0, 0)
		kvgen.CheckBlock(buf, s, 1, 0, 0)
	}
}
