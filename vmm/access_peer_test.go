//go:build linux

package vmm

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCoalesceCopies(t *testing.T) {
	tests := []struct {
		name             string
		dst, src, n      []uint64
		wantD, wantS, wN []uint64
	}{
		{name: "none"},
		{name: "one", dst: []uint64{100}, src: []uint64{7}, n: []uint64{4},
			wantD: []uint64{100}, wantS: []uint64{7}, wN: []uint64{4}},
		{name: "contiguous on both sides: one copy", dst: []uint64{100, 104, 108, 112}, src: []uint64{0, 4, 8, 12}, n: []uint64{4, 4, 4, 4},
			wantD: []uint64{100}, wantS: []uint64{0}, wN: []uint64{16}},
		{name: "lengths differ but runs continue", dst: []uint64{100, 102, 110}, src: []uint64{0, 2, 10}, n: []uint64{2, 8, 1},
			wantD: []uint64{100}, wantS: []uint64{0}, wN: []uint64{11}},
		{name: "gap in dst", dst: []uint64{100, 105}, src: []uint64{0, 4}, n: []uint64{4, 4},
			wantD: []uint64{100, 105}, wantS: []uint64{0, 4}, wN: []uint64{4, 4}},
		{name: "gap in src", dst: []uint64{100, 104}, src: []uint64{0, 5}, n: []uint64{4, 4},
			wantD: []uint64{100, 104}, wantS: []uint64{0, 5}, wN: []uint64{4, 4}},
		{name: "out of order is not merged", dst: []uint64{104, 100}, src: []uint64{4, 0}, n: []uint64{4, 4},
			wantD: []uint64{104, 100}, wantS: []uint64{4, 0}, wN: []uint64{4, 4}},
		{name: "empty copies dropped, runs across them kept", dst: []uint64{100, 300, 104}, src: []uint64{0, 900, 4}, n: []uint64{4, 0, 4},
			wantD: []uint64{100}, wantS: []uint64{0}, wN: []uint64{8}},
		{name: "two runs", dst: []uint64{0, 8, 64, 72}, src: []uint64{800, 808, 100, 108}, n: []uint64{8, 8, 8, 8},
			wantD: []uint64{0, 64}, wantS: []uint64{800, 100}, wN: []uint64{16, 16}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			n := append([]uint64(nil), tc.n...)
			d, s, m := CoalesceCopies(tc.dst, tc.src, tc.n)
			require.Equal(t, tc.wantD, d)
			require.Equal(t, tc.wantS, s)
			require.Equal(t, tc.wN, m)
			require.Equal(t, n, tc.n, "input lengths changed")
		})
	}
	require.PanicsWithValue(t, "vmm: CoalesceCopies of 1 destinations, 0 sources, 0 lengths", func() { CoalesceCopies([]uint64{1}, nil, nil) })
}

func TestPeerPagesAddr(t *testing.T) {
	// Two regions of two 64 KiB pages, one file per page per region, in
	// Export's order (page, then region); file f was mapped at 1<<20 × (f+1).
	var maps []Mapping
	for pg := range 2 {
		for r := range 2 {
			maps = append(maps, Mapping{Region: r, Page: pg, RegionOffset: uint64(pg) * testPage, Len: testPage, File: 2*pg + r})
		}
	}
	pp := &PeerPages{addrs: []uint64{1 << 20, 2 << 20, 3 << 20, 4 << 20}}
	pp.maps = append(pp.maps, maps[0], maps[2], maps[1], maps[3]) // by region, then offset
	tests := []struct {
		name      string
		region    int
		off, n    uint64
		want      uint64
		notMapped bool
	}{
		{"region 0 page 0", 0, 100, 8, 1<<20 + 100, false},
		{"region 1 page 0", 1, 0, testPage, 2 << 20, false},
		{"region 0 page 1", 0, testPage + 2048, 2048, 3<<20 + 2048, false},
		{"region 1 last byte", 1, 2*testPage - 1, 1, 4<<20 + testPage - 1, false},
		{"straddles a page", 0, testPage - 8, 16, 0, true},
		{"past the export", 0, 2 * testPage, 8, 0, true},
		{"no such region", 2, 0, 8, 0, true},
		{"wraps", 0, 8, ^uint64(0), 0, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := pp.Addr(tc.region, tc.off, tc.n)
			if tc.notMapped {
				require.ErrorIs(t, err, ErrNotMapped)
				require.ErrorContains(t, err, "not in one exported mapping")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

// TestPoolCopiesOnHostBackend: the host backend has no asynchronous or
// peer copies; the async calls copy before they return, the others say
// errors.ErrUnsupported, and the range checks are those of CopyOut.
func TestPoolCopiesOnHostBackend(t *testing.T) {
	p := newTestPool(t, Config{})
	ids, err := p.Alloc(context.Background(), 2)
	require.NoError(t, err)
	off := p.BlockOffset(ids[1])
	wait, err := p.CopyInAsync(3, off, []byte("async"))
	require.NoError(t, err)
	require.NoError(t, wait())
	got := make([]byte, 5)
	wait, err = p.CopyOutAsync(3, off, got)
	require.NoError(t, err)
	require.Equal(t, "async", string(got), "copied before CopyOutAsync returned")
	require.NoError(t, wait())

	_, err = p.CopyOutAsync(0, 7*testPage, got)
	require.ErrorIs(t, err, ErrNotMapped)
	_, err = p.CopyInAsync(4, 0, got)
	require.ErrorIs(t, err, ErrBlockOutOfRange)
	_, _, err = p.HostBuffer(4096)
	require.ErrorIs(t, err, errors.ErrUnsupported)
	ex, err := p.Export([]int{0})
	require.NoError(t, err)
	defer ex.Close()
	_, err = p.ImportPeer(ex)
	require.ErrorIs(t, err, errors.ErrUnsupported)
	require.ErrorIs(t, p.CopyFromPeer([]PeerCopy{{Region: 0, Off: off, Src: 1, Len: 1}}), errors.ErrUnsupported)
}
