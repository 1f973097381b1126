package transfer

import (
	"bytes"
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestBlockDescsRead: a READ naming the peer's memory by region and block
// lands the same bytes as the explicit descriptors it stands for, in
// region-major order, whether the local side pairs one descriptor per
// entry (with checksums) or takes them all in one range; the peer checks
// the expectation it carries first.
func TestBlockDescsRead(t *testing.T) {
	const blockLen, nBlocks = 8 << 10, 8
	var srvRegs []Region
	for i := range 3 {
		m := mmapRegion(t, nBlocks*blockLen)
		fill(m, byte(10+i))
		srvRegs = append(srvRegs, SliceRegion(m, blockLen, 0))
	}
	key := NewCapabilityKey()
	var (
		mu      sync.Mutex
		engines []string
	)
	srv := startAgent(t, Config{Regions: srvRegs, CapabilityKey: key, CheckExpect: func(_ context.Context, e *v1.PeerExpect) ([]int, error) {
		mu.Lock()
		engines = append(engines, e.GetEngineId())
		mu.Unlock()
		if e.GetEngineId() != "prefill" {
			return nil, codes.New(v1.Code_CODE_NOT_FOUND, "this agent is engine_id %q, the READ expects %q", "prefill", e.GetEngineId())
		}
		if len(e.GetLayout()) > 0 {
			return []int{2, 0, 1}, nil // the reader's region i is this agent's 2, 0, 1
		}
		return nil, nil
	}})
	cliMem := mmapRegion(t, 128<<10)
	cliReg := SliceRegion(cliMem, 0, 0)
	cli := startAgent(t, Config{Regions: []Region{cliReg}})
	peer := srv.Addr().String()
	ids := []uint32{5, 2, 3}
	capab := key.Issue("req", ids...)
	// Regions 1 and 2, bytes [1024, 3072) of blocks 5, 2, 3: six entries.
	bd := &BlockDescs{FirstRegion: 1, NumRegions: 2, Offset: 1024, Len: 2048, BlockIDs: ids}
	var want []byte
	for r := 1; r <= 2; r++ {
		for _, b := range ids {
			off := int(b)*blockLen + 1024
			want = append(want, srvRegs[r].Mem.(SliceMemory)[off:off+2048]...)
		}
	}
	t.Run("one local range", func(t *testing.T) {
		clear(cliMem)
		res, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer, RequestID: "req", Capability: capab,
			Local: []Desc{{Addr: cliReg.Base, Len: uint64(len(want))}}, RemoteBlocks: bd, Expect: &v1.PeerExpect{EngineId: "prefill"}})
		require.NoError(t, err)
		require.Equal(t, uint64(6*2048), res.Bytes)
		require.True(t, bytes.Equal(want, cliMem[:len(want)]), "bytes differ from regions 1..2, blocks 5, 2, 3")
		mu.Lock()
		require.Equal(t, []string{"prefill"}, engines, "the peer checked the expectation")
		mu.Unlock()
	})
	t.Run("regions mapped by the expectation's layout", func(t *testing.T) {
		clear(cliMem)
		// The reader's regions 0 and 1 are this agent's 2 and 0.
		mapped := &BlockDescs{FirstRegion: 0, NumRegions: 2, Offset: 1024, Len: 2048, BlockIDs: ids}
		var want []byte
		for _, r := range []int{2, 0} {
			for _, b := range ids {
				off := int(b)*blockLen + 1024
				want = append(want, srvRegs[r].Mem.(SliceMemory)[off:off+2048]...)
			}
		}
		_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer, RequestID: "req", Capability: capab,
			Local: []Desc{{Addr: cliReg.Base, Len: uint64(len(want))}}, RemoteBlocks: mapped,
			Expect: &v1.PeerExpect{EngineId: "prefill", Layout: []*v1.RegionShape{{Layer: 1}, {Layer: 0}, {Layer: 0}}}})
		require.NoError(t, err)
		require.True(t, bytes.Equal(want, cliMem[:len(want)]), "bytes differ from regions 2 and 0")
	})
	t.Run("one local descriptor per entry, checksummed", func(t *testing.T) {
		clear(cliMem)
		var local []Desc
		for i := range 6 {
			local = append(local, Desc{Addr: cliReg.Base + uint64(i)*4096, Len: 2048}) // gaps between them
		}
		_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer, RequestID: "req", Capability: capab,
			Local: local, RemoteBlocks: bd, Checksum: true})
		require.NoError(t, err)
		for i := range 6 {
			require.True(t, bytes.Equal(want[i*2048:(i+1)*2048], cliMem[i*4096:i*4096+2048]), "entry %d", i)
		}
	})

	t.Run("many slices, gathered into few stream writes", func(t *testing.T) {
		// 3 regions × 8 blocks × 4 KiB = 96 KiB: above the one-write
		// small READ, each slice apart from the next in the peer's memory.
		all := []uint32{7, 0, 1, 2, 3, 4, 5, 6}
		big := &BlockDescs{NumRegions: 3, Offset: 2048, Len: 4096, BlockIDs: all}
		var want []byte
		for r := range 3 {
			for _, b := range all {
				off := int(b)*blockLen + 2048
				want = append(want, srvRegs[r].Mem.(SliceMemory)[off:off+4096]...)
			}
		}
		for _, checksum := range []bool{false, true} {
			clear(cliMem)
			var local []Desc
			for i := range 24 {
				local = append(local, Desc{Addr: cliReg.Base + uint64(i)*4096, Len: 4096})
			}
			if !checksum {
				local = []Desc{{Addr: cliReg.Base, Len: 24 * 4096}}
			}
			_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer, RequestID: "all", Capability: key.Issue("all", all...),
				Local: local, RemoteBlocks: big, Checksum: checksum})
			require.NoError(t, err)
			require.True(t, bytes.Equal(want, cliMem[:len(want)]), "checksum %v: bytes differ", checksum)
		}
	})

	refusals := []struct {
		name   string
		bd     BlockDescs
		expect *v1.PeerExpect
		want   error
		msg    string
	}{
		{"block beyond the region", BlockDescs{NumRegions: 1, Len: 512, BlockIDs: []uint32{nBlocks}}, nil, ErrOutOfRange,
			"block_ids[0]=8 is beyond region 0"},
		{"region beyond those registered", BlockDescs{FirstRegion: 2, NumRegions: 2, Len: 512, BlockIDs: []uint32{2}}, nil, ErrOutOfRange,
			"regions [2, 4), this agent registered 3"},
		{"slice beyond the block", BlockDescs{NumRegions: 1, Offset: blockLen - 256, Len: 512, BlockIDs: []uint32{2}}, nil, ErrInvalidArgument,
			"offset 7936 + len 512 exceeds region 0's block_len 8192"},
		{"block outside the export", BlockDescs{NumRegions: 1, Len: 512, BlockIDs: []uint32{4}}, nil, ErrCapabilityDenied, ""},
		{"another engine expected", BlockDescs{NumRegions: 1, Len: 512, BlockIDs: []uint32{2}}, &v1.PeerExpect{EngineId: "other"}, ErrNotFound,
			`the READ expects "other"`},
	}
	for _, tt := range refusals {
		t.Run(tt.name, func(t *testing.T) {
			clear(cliMem)
			_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer, RequestID: "req", Capability: capab,
				Local: []Desc{{Addr: cliReg.Base, Len: tt.bd.Entries() * tt.bd.Len}}, RemoteBlocks: &tt.bd, Expect: tt.expect})
			require.ErrorIs(t, err, tt.want)
			require.ErrorContains(t, err, tt.msg)
			var xe *XferError
			require.ErrorAs(t, err, &xe)
			require.Zero(t, xe.Bytes)
			require.Equal(t, make([]byte, 4096), cliMem[:4096], "nothing landed")
		})
	}

	t.Run("refused on the dialing side", func(t *testing.T) {
		for _, x := range []*Xfer{
			{Op: OpWrite, Local: []Desc{{Addr: cliReg.Base, Len: 512}}, RemoteBlocks: &BlockDescs{NumRegions: 1, Len: 512, BlockIDs: []uint32{2}}},
			{Op: OpRead, Local: []Desc{{Addr: cliReg.Base, Len: 512}}, RemoteBlocks: &BlockDescs{NumRegions: 1, Len: 512, BlockIDs: []uint32{2, 3}}},
			{Op: OpRead, Local: []Desc{{Addr: cliReg.Base, Len: 1024}}, RemoteBlocks: &BlockDescs{NumRegions: 1, Len: 512, BlockIDs: []uint32{2, 3}}, Checksum: true},
			{Op: OpRead, Local: []Desc{{Addr: cliReg.Base, Len: 512}}, RemoteBlocks: &BlockDescs{NumRegions: 0, Len: 512, BlockIDs: []uint32{2}}},
		} {
			x.Peer, x.RequestID, x.Capability = peer, "req", capab
			_, err := cli.Transfer(t.Context(), x)
			require.ErrorIs(t, err, ErrInvalidArgument, "%+v", x.RemoteBlocks)
			require.ErrorContains(t, err, "Xfer.")
		}
	})

	t.Run("no CheckExpect on the peer", func(t *testing.T) {
		plain := startAgent(t, Config{Regions: srvRegs, CapabilityKey: key})
		_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: plain.Addr().String(), RequestID: "req", Capability: capab,
			Local: []Desc{{Addr: cliReg.Base, Len: 512}}, RemoteBlocks: &BlockDescs{NumRegions: 1, Len: 512, BlockIDs: []uint32{2}},
			Expect: &v1.PeerExpect{EngineId: "prefill"}})
		require.ErrorIs(t, err, ErrUnavailable)
		require.ErrorContains(t, err, "no metadata to check")
	})
}
