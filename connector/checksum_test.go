package connector_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// blockBytes is block b of region reg in pool p, in place.
func blockBytes(t testing.TB, p *vmm.Pool, reg vmm.RegionInfo, b uint32) []byte {
	t.Helper()
	buf, err := p.HostBytes(reg.Index, reg.BlockOffset(int(b)), reg.BlockLen)
	require.NoError(t, err)
	return buf
}

// TestChecksumsNameTheBlocksThatDiffer: with checksums on (the default),
// three faults that QUIC cannot see are each reported as a load error for
// exactly the blocks they touch, never as done: a block the prefill engine
// overwrote after the export, a block whose K and V regions were swapped
// after the export, and one byte flipped in one head of a block after the
// export. Each decode rank names only the blocks whose bytes it read
// differ (the checksums fold as the bytes land; every block is verified:
// SameHostVerifyEvery 1 on the same-host path); every other block is
// byte-exact; the prefill is notified and frees its blocks. Both TP
// directions: a decode rank reading some heads of a prefill rank
// (P1 → D2), and reading two prefill ranks into one block (P2 → D1).
//
// fault-matrix: checksum-mismatch
func TestChecksumsNameTheBlocksThatDiffer(t *testing.T) {
	for _, pd := range [][2]int{{1, 2}, {2, 1}} {
		p, d := pd[0], pd[1]
		t.Run(name(p, d), func(t *testing.T) {
			pre := newInstance(t, instOpts{engine: "pre-crc-" + name(p, d), tp: p, geom: gqa8})
			dec := newInstance(t, instOpts{engine: "dec-crc-" + name(p, d), tp: d, geom: gqa8, verifyEvery: 1})
			const key = 99
			blocks := pre.alloc(t, 6)
			pre.fill(t, key, blocks)
			params := pre.finish(t, "req-crc", blocks)
			for _, e := range params.GetRankExports() {
				require.Len(t, e.GetBlockChecksums(), 4*6*int(e.GetChecksumHeads()), "a CRC per block and head")
				require.Equal(t, uint32(8/p), e.GetChecksumHeads())
			}
			// After the export: the last prefill rank's engine overwrites
			// block 1 of region 0, and swaps block 3's K and V of layer 0.
			last := p - 1
			regs := pre.pools[last].Regions()
			clear(blockBytes(t, pre.pools[last], regs[0], blocks[1]))
			k, v := blockBytes(t, pre.pools[last], regs[0], blocks[3]), blockBytes(t, pre.pools[last], regs[1], blocks[3])
			tmp := append([]byte(nil), k...)
			copy(k, v)
			copy(v, tmp)

			// On prefill rank 0, one byte of block 4 flips: in head 0,
			// which decode rank 0 reads.
			blockBytes(t, pre.pools[0], pre.pools[0].Regions()[2], blocks[4])[17] ^= 0x40

			local := dec.alloc(t, 6)
			dec.startLoad(t, "dec-crc", local, params)
			fails := dec.wait(t, "dec-crc")
			for r, f := range fails {
				require.NotNil(t, f, "decode rank %d reported a load with wrong bytes done", r)
				require.Equal(t, v1.Code_CODE_DATA_LOSS, codes.Of(f.Err), "%v", f.Err)
				want := []int{int(local[1]), int(local[3])}
				if r == 0 {
					want = append(want, int(local[4]))
				}
				require.ElementsMatch(t, want, f.BlockIDs, "decode rank %d: exactly the blocks that differ", r)
				require.ErrorContains(t, f.Err, "differ from the CRC-32C their prefill recorded")
			}
			for _, k := range []int{0, 2, 5} {
				dec.check(t, key, []uint32{local[k]}, k)
			}
			for r := range pre.ranks {
				pre.waitSent(t, r, "req-crc")
			}
		})
	}
}

// TestSameHostChecksumsSample: on the same-host path a decode rank folds
// the checksums of one block in 16 (the default), so a request the prefill
// overwrote half of after the export is caught by the sample and every block
// of the load is reported for recompute, not only the sampled ones; over
// QUIC every block is checked and exactly the ones that differ are named.
//
// fault-matrix: checksum-mismatch
func TestSameHostChecksumsSample(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "pre-sample", tp: 1, geom: gqa8, numBlocks: 256})
	dec := newInstance(t, instOpts{engine: "dec-sample", tp: 1, geom: gqa8, numBlocks: 256})
	const n = 64
	blocks := pre.alloc(t, n)
	pre.fill(t, 5, blocks)
	params := pre.finish(t, "req", blocks)
	for _, reg := range pre.pools[0].Regions() {
		for _, b := range blocks[:n/2] { // the first half differs
			clear(blockBytes(t, pre.pools[0], reg, b))
		}
	}
	local := dec.alloc(t, n)
	dec.startLoad(t, "req", local, params)
	f := dec.wait(t, "req")[0]
	require.NotNil(t, f, "a load of overwritten blocks is never done")
	require.Equal(t, v1.Code_CODE_DATA_LOSS, codes.Of(f.Err), "%v", f.Err)
	var ce *connector.ChecksumError
	require.ErrorAs(t, f.Err, &ce)
	if sameHostOn() {
		require.Len(t, ce.Sampled, n/2/connector.DefaultSameHostVerifyEvery, "one block in %d is checked", connector.DefaultSameHostVerifyEvery)
		require.ElementsMatch(t, kvgeom.Ints(local), f.BlockIDs, "every block of the load is recomputed")
		require.ErrorContains(t, f.Err, "sampled blocks differ")
	} else {
		require.Nil(t, ce.Sampled, "over QUIC every block is checked")
		require.ElementsMatch(t, kvgeom.Ints(local[:n/2]), f.BlockIDs, "exactly the blocks that differ")
	}
	pre.waitSent(t, 0, "req")
}
