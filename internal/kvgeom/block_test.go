package kvgeom_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
)

func TestPackingOffset(t *testing.T) {
	tests := []struct {
		name string
		p    kvgeom.Packing
		b    kvgeom.BlockID
		want uint64
	}{
		{"packed power of 2", kvgeom.Packing{BlockLen: 2048, PageSize: 64 << 10}, 37, 37 * 2048},
		{"gap at page end", kvgeom.Packing{BlockLen: 3000, PageSize: 8192}, 3, 8192 + 3000},
		{"one block a page", kvgeom.Packing{BlockLen: 8192, PageSize: 8192}, 3, 3 * 8192},
		{"no page size", kvgeom.Packing{BlockLen: 512}, 5, 5 * 512},
		{"block 0", kvgeom.Packing{BlockLen: 2048}, 0, 0},
		{"largest id", kvgeom.Packing{BlockLen: 3000, PageSize: 8192}, 1<<32 - 1, (1<<32-1)/2*8192 + 3000},
		// A Packing that fails Check never divides by zero.
		{"no block length", kvgeom.Packing{PageSize: 8192}, 9, 0},
		{"block beyond the page", kvgeom.Packing{BlockLen: 3000, PageSize: 2048}, 2, 6000},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, tc.p.Offset(tc.b))
		})
	}
}

func TestPackingCheck(t *testing.T) {
	tests := []struct {
		name               string
		blockLen, pageSize uint64
		fields             []string
		rule               string
	}{
		{"no block length", 0, 8192, []string{"block_len"}, "block_len=0 must be > 0"},
		{"no block length, no pages", 0, 0, []string{"block_len"}, "block_len=0 must be > 0"},
		{"block beyond the page", 3000, 2048, []string{"block_len", "page_size"},
			"block_len=3000 exceeds the page size (page_size=2048): blocks never straddle a page"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := kvgeom.NewPacking(tc.blockLen, tc.pageSize)
			var ke *kvgeom.Error
			require.ErrorAs(t, err, &ke)
			require.Equal(t, tc.fields, ke.Fields)
			require.Equal(t, tc.rule, ke.Rule)
		})
	}
	p, err := kvgeom.NewPacking(3000, 8192)
	require.NoError(t, err)
	require.Equal(t, kvgeom.Packing{BlockLen: 3000, PageSize: 8192}, p)
	require.EqualValues(t, 2, p.BlocksPerPage())
	require.Zero(t, kvgeom.Packing{BlockLen: 3000}.BlocksPerPage(), "no pages")
}

// TestPackingBlockAt: for every small packing that passes Check, every byte
// of block b maps back to b, no block straddles a page, and the padding at a
// page's end belongs to the page's last block.
func TestPackingBlockAt(t *testing.T) {
	for bl := uint64(1); bl <= 24; bl++ {
		for ps := uint64(0); ps <= 64; ps++ {
			p := kvgeom.Packing{BlockLen: bl, PageSize: ps}
			if p.Check() != nil {
				continue
			}
			end := uint64(0) // the end of the previous block
			for b := range kvgeom.BlockID(40) {
				off := p.Offset(b)
				require.GreaterOrEqual(t, off, end, "bl=%d ps=%d block %d overlaps", bl, ps, b)
				for pad := end; pad < off; pad++ {
					require.Equal(t, uint64(b)-1, p.BlockAt(pad), "bl=%d ps=%d padding byte %d", bl, ps, pad)
				}
				if ps > 0 {
					require.Equal(t, off/ps, (off+bl-1)/ps, "bl=%d ps=%d block %d straddles a page", bl, ps, b)
				}
				require.Equal(t, uint64(b), p.BlockAt(off))
				require.Equal(t, uint64(b), p.BlockAt(off+bl-1))
				end = off + bl
			}
		}
	}
	require.Zero(t, kvgeom.Packing{PageSize: 4096}.BlockAt(5000), "no blocks: never divides by zero")
}

func TestBlockIDForms(t *testing.T) {
	pool := []int{1, 7, 4095, 1<<31 - 1}
	wire := kvgeom.Wire(pool)
	require.Equal(t, []uint32{1, 7, 4095, 1<<31 - 1}, wire)
	require.Equal(t, pool, kvgeom.Ints(wire))
	require.Equal(t, []int{3, 9}, kvgeom.Ints([]kvgeom.BlockID{3, 9}))
	require.Empty(t, kvgeom.Wire([]int(nil)))
}
