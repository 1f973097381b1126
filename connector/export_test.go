package connector_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// allocRank allocates n blocks on prefill rank r alone and returns them.
func (in *instance) allocRank(t testing.TB, r, n int) []uint32 {
	t.Helper()
	got, err := in.pools[r].Alloc(t.Context(), n)
	require.NoError(t, err)
	out := make([]uint32, n)
	for i, id := range got {
		out[i] = uint32(id)
	}
	return out
}

// fillRank writes request key's KV (rank r's heads) into rank r's blocks.
func (in *instance) fillRank(t testing.TB, r int, key uint64, blocks []uint32) {
	t.Helper()
	p, s, bs := in.pools[r], in.shape(t, r), int(in.opts.geom.GetBlockSize())
	for _, reg := range p.Regions() {
		for k, b := range blocks {
			buf, err := p.HostBytes(reg.Index, reg.BlockOffset(int(b)), reg.BlockLen)
			require.NoError(t, err)
			kvgen.FillBlock(buf, s, key, reg.Index, k*bs)
		}
	}
}

// finishRanks calls RequestFinished on every rank with that rank's own
// blocks and returns each rank's params.
func (in *instance) finishRanks(t testing.TB, id string, blocks [][]uint32) []*v1.KVTransferParams {
	t.Helper()
	var parts []*v1.KVTransferParams
	for r, rk := range in.ranks {
		p, err := rk.RequestFinished(t.Context(), id, blocks[r], v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.NoError(t, err)
		parts = append(parts, p)
	}
	return parts
}

// TestRanksWithDifferentBlockIDs: prefill ranks that hold one request in
// different block ids (rank 1 restarted, or freed in another order) are each
// read at their own ids, by decode TP 2 and TP 1, byte-exact; with only rank
// 0's params a decode rank that needs rank 1 fails naming it, every local
// block reported, and reads nothing.
//
// fault-matrix: ranks-disagree-on-block-ids
func TestRanksWithDifferentBlockIDs(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 2, geom: gqa8, numBlocks: 256})
	const n = 40
	// Rank 1's pool is shifted (a restarted rank's fresh pool against an
	// older one), and its ids are in another order too.
	pre.allocRank(t, 1, 17)
	const key = 5
	// export allocates and fills the request's blocks on each rank (the
	// ranks' leases free them once read).
	export := func(t *testing.T) [][]uint32 {
		ids := [][]uint32{pre.allocRank(t, 0, n), pre.allocRank(t, 1, n)}
		for i, j := 0, n-1; i < j; i, j = i+1, j-1 {
			ids[1][i], ids[1][j] = ids[1][j], ids[1][i]
		}
		require.NotEqual(t, ids[0], ids[1])
		for r := range 2 {
			pre.fillRank(t, r, key, ids[r])
		}
		return ids
	}

	for _, dtp := range []int{2, 1} {
		t.Run(name(2, dtp), func(t *testing.T) {
			dec := newInstance(t, instOpts{engine: "decode", tp: dtp, geom: gqa8, numBlocks: 256})
			id, ids := name(2, dtp), export(t)
			params, err := connector.MergeExports(pre.finishRanks(t, id, ids)...)
			require.NoError(t, err)
			require.Empty(t, connector.ExportOf(params, 0).GetBlockIds(), "rank 0's ids are remote_block_ids")
			require.Equal(t, ids[1], connector.ExportOf(params, 1).GetBlockIds(), "rank 1's own ids travel")
			local := dec.alloc(t, n)
			dec.startLoad(t, id, local, roundTrip(t, params))
			requireAllDone(t, dec.wait(t, id))
			dec.check(t, key, local, 0)
		})
	}

	t.Run("rank 1's export missing", func(t *testing.T) {
		dec := newInstance(t, instOpts{engine: "decode", tp: 2, geom: gqa8, numBlocks: 256})
		parts := pre.finishRanks(t, "only-rank-0", export(t))
		local := dec.alloc(t, n)
		dec.fill(t, 99, local)
		dec.startLoad(t, "only-rank-0", local, roundTrip(t, parts[0]))
		fails := dec.wait(t, "only-rank-0")
		require.Nil(t, fails[0], "decode rank 0 reads prefill rank 0 only")
		require.NotNil(t, fails[1])
		require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(fails[1].Err), "%v", fails[1].Err)
		require.ErrorContains(t, fails[1].Err, "no export of prefill rank 1")
		require.Len(t, fails[1].BlockIDs, n, "every local block is reported for recompute")
		s1 := dec.shape(t, 1)
		for _, reg := range dec.pools[1].Regions() {
			for k, b := range local {
				buf, err := dec.pools[1].HostBytes(reg.Index, reg.BlockOffset(int(b)), reg.BlockLen)
				require.NoError(t, err)
				bad, _ := kvgen.CheckBlock(buf, s1, 99, reg.Index, k*16)
				require.Zero(t, bad, "nothing written into decode rank 1's block %d", b)
			}
		}
	})
}

// roundTrip passes params through JSON, as a proxy does.
func roundTrip(t testing.TB, p *v1.KVTransferParams) *v1.KVTransferParams {
	t.Helper()
	b, err := connector.MarshalKVTransferParams(p)
	require.NoError(t, err)
	out, err := connector.UnmarshalKVTransferParams(b)
	require.NoError(t, err)
	return out
}

// TestStaleParamsOfAReusedRequestID: the params of an export that ended, for
// a request id a new export reuses over the same blocks, read nothing and
// release nothing; the new export's own load is byte-exact afterwards.
//
// fault-matrix: stale-reused-request-id
func TestStaleParamsOfAReusedRequestID(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8})
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8})
	blocks := pre.alloc(t, 1)
	pre.fill(t, 1, blocks)
	old := pre.finish(t, "R", blocks)
	local := dec.alloc(t, 1)
	dec.startLoad(t, "first", local, old)
	requireAllDone(t, dec.wait(t, "first"))
	dec.check(t, 1, local, 0)
	f, err := pre.ranks[0].WaitFinished(t.Context())
	require.NoError(t, err)
	require.Equal(t, []string{"R"}, f.DoneSending)

	again := pre.alloc(t, 1)
	require.Equal(t, blocks, again, "the freed block is handed out again")
	pre.fill(t, 2, again)
	fresh := pre.finish(t, "R", again)
	require.NotEqual(t, connector.ExportOf(old, 0).GetExportId(), connector.ExportOf(fresh, 0).GetExportId())

	stale := dec.alloc(t, 1)
	dec.fill(t, 99, stale)
	dec.startLoad(t, "stale", stale, old)
	fails := dec.wait(t, "stale")
	require.NotNil(t, fails[0], "the stale load fails")
	require.Equal(t, v1.Code_CODE_LEASE_EXPIRED, codes.Of(fails[0].Err), "%v", fails[0].Err)
	require.ErrorContains(t, fails[0].Err, `request "R" export`)
	dec.check(t, 99, stale, 0) // no byte written

	dec.startLoad(t, "new", local, fresh)
	requireAllDone(t, dec.wait(t, "new"))
	dec.check(t, 2, local, 0)
}

func TestMergeExports(t *testing.T) {
	part := func(rank uint32, ids []uint32, expires int64) *v1.KVTransferParams {
		p := validParams()
		p.Capability = nil
		p.RemoteBlockIds = ids
		p.LeaseExpiresUnixMs = expires
		p.RankExports = []*v1.RankExport{{TpRank: rank, ExportId: uint64(100 + rank), Capability: []byte{byte(rank)}}}
		return p
	}
	p0, p1 := part(0, []uint32{7, 8, 9}, 2000), part(1, []uint32{3, 2, 1}, 1000)
	got, err := connector.MergeExports(p1, p0)
	require.NoError(t, err)
	require.Equal(t, []uint32{7, 8, 9}, got.GetRemoteBlockIds(), "rank 0's ids are the base")
	require.Len(t, got.GetRankExports(), 2)
	require.Empty(t, got.GetRankExports()[0].GetBlockIds())
	require.Equal(t, []uint32{3, 2, 1}, got.GetRankExports()[1].GetBlockIds())
	require.Equal(t, int64(1000), got.GetLeaseExpiresUnixMs(), "the earliest lease")
	require.Equal(t, []uint32{3, 2, 1}, p1.GetRemoteBlockIds(), "parts are not modified")
	require.NoError(t, connector.ValidateRemotePrefill(got))

	same := part(1, []uint32{7, 8, 9}, 2000)
	got, err = connector.MergeExports(p0, same)
	require.NoError(t, err)
	require.Empty(t, got.GetRankExports()[1].GetBlockIds(), "equal ids are not repeated")

	tests := []struct {
		name   string
		parts  []*v1.KVTransferParams
		field  string
		reason codes.Reason
		want   string
	}{
		{"rank twice", []*v1.KVTransferParams{p0, part(0, []uint32{7, 8, 9}, 1)}, "rank_exports", codes.ReasonParamsRankRepeated,
			"connector: MergeExports: part 1: rank_exports=rank 0: part 0 exports the same rank"},
		{"another request", []*v1.KVTransferParams{p0, func() *v1.KVTransferParams {
			p := part(1, []uint32{1, 2, 3}, 1)
			p.RemoteRequestId = "other"
			return p
		}()}, "remote_request_id", codes.ReasonMergePartsDiffer, `connector: MergeExports: part 1: remote_request_id="other": differs from "cmpl-123"`},
		{"another block count", []*v1.KVTransferParams{p0, part(1, []uint32{1, 2}, 1)}, "remote_block_ids", codes.ReasonMergePartsDiffer,
			"connector: MergeExports: part 1: remote_block_ids=2 entries: every rank holds the same 3 token blocks"},
		{"a part that breaks a rule", []*v1.KVTransferParams{p0, part(2, []uint32{1, 2, 3}, 1)}, "rank_exports[0].tp_rank", codes.ReasonParamsOutOfRange,
			"connector: MergeExports: part 1: rank_exports[0].tp_rank=2: must be below tp_size=2"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := connector.MergeExports(tc.parts...)
			require.ErrorIs(t, err, connector.ErrInvalidParams)
			var pe *connector.PartError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, 1, pe.Part)
			require.Equal(t, tc.field, pe.Err.Field)
			require.Equal(t, tc.reason, codes.ReasonOf(err))
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err))
			require.EqualError(t, err, tc.want)
		})
	}
	_, err = connector.MergeExports()
	require.Equal(t, codes.ReasonMergeNoParts, codes.ReasonOf(err))
	require.NotErrorAs(t, err, new(*connector.PartError), "no part to name")
}

func TestRankExportsValidation(t *testing.T) {
	tests := []struct {
		name string
		e    []*v1.RankExport
		want string
	}{
		{"rank beyond tp_size", []*v1.RankExport{{TpRank: 2, ExportId: 1, Capability: []byte{1}}}, "rank_exports[0].tp_rank=2: must be below tp_size=2"},
		{"no export id", []*v1.RankExport{{TpRank: 0, Capability: []byte{1}}}, "rank_exports[0].export_id: missing"},
		{"no capability", []*v1.RankExport{{TpRank: 0, ExportId: 1}}, "rank_exports[0].capability: missing"},
		{"block ids of another length", []*v1.RankExport{{TpRank: 1, ExportId: 1, Capability: []byte{1}, BlockIds: []uint32{1}}}, "rank_exports[0].block_ids=1 entries"},
		{"rank twice", []*v1.RankExport{{TpRank: 1, ExportId: 1, Capability: []byte{1}}, {TpRank: 1, ExportId: 2, Capability: []byte{1}}},
			"rank_exports[1].tp_rank=1: rank_exports[0] names the same rank"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := validParams()
			p.RankExports = tc.e
			err := connector.ValidateRemotePrefill(p)
			require.ErrorIs(t, err, connector.ErrInvalidParams)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestAlignBlocks(t *testing.T) {
	remote := []uint32{11, 12, 13, 14}
	tests := []struct {
		name           string
		local          int
		hit            *uint32
		surplus        uint32
		wantHit, wantN int
		err            string
	}{
		{"all read", 4, new(uint32(0)), 0, 0, 4, ""},
		{"prefix hit", 3, new(uint32(1)), 0, 1, 3, ""},
		{"hit and surplus", 3, new(uint32(2)), 1, 2, 2, ""},
		{"several hit and surplus", 4, new(uint32(2)), 2, 2, 2, ""},
		{"full hit, nothing local", 0, nil, 0, 0, 0, ""},
		{"full hit plus a surplus block", 1, new(uint32(4)), 1, 4, 0, ""},
		{"hit not said", 3, nil, 0, 0, 0, "remote_hit_blocks is required with 3 local_block_ids"},
		{"hit not passed, surplus present", 4, new(uint32(0)), 1, 0, 0, "is 3 blocks to fill, but remote_block_ids (4) minus remote_hit_blocks (0) is 4"},
		{"more local than remote", 5, new(uint32(0)), 0, 0, 0, "cannot be aligned"},
		{"surplus beyond local", 2, new(uint32(2)), 3, 0, 0, "local_surplus_blocks=3 exceeds the 2 local_block_ids"},
		{"hit beyond remote", 1, new(uint32(5)), 0, 0, 0, "remote_hit_blocks=5 exceeds the 4 remote_block_ids"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			meta := &v1.ReqMeta{RequestId: "r", LocalBlockIds: make([]uint32, tc.local), RemoteHitBlocks: tc.hit,
				LocalSurplusBlocks: tc.surplus, Params: &v1.KVTransferParams{RemoteBlockIds: remote}}
			hit, n, err := connector.AlignBlocks(meta)
			if tc.err != "" {
				require.ErrorIs(t, err, connector.ErrInvalidArgument)
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.wantHit, hit)
			require.Equal(t, tc.wantN, n)
		})
	}
}

// TestSurplusAndHitLand: remote block 1 lands in local[0] when the decode
// says one remote block is a hit, and the surplus local[1] keeps its bytes.
//
// fault-matrix: load-alignment
func TestSurplusAndHitLand(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8})
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8})
	blocks := pre.alloc(t, 2)
	pre.fill(t, 3, blocks)
	params := pre.finish(t, "r", blocks)
	local := dec.alloc(t, 2)
	dec.fill(t, 99, local)
	meta := &v1.ReqMeta{RequestId: "r", LocalBlockIds: local, Params: params, RemoteHitBlocks: new(uint32(1)), LocalSurplusBlocks: 1}
	require.NoError(t, dec.ranks[0].StartLoad(t.Context(), proto.Clone(meta).(*v1.ReqMeta)))
	requireAllDone(t, dec.wait(t, "r"))
	dec.check(t, 3, local[:1], 1)  // remote block 1
	dec.check(t, 99, local[1:], 1) // untouched
}

// TestReadOfAnUnmappedPageRefused: an export whose page went away under it
// (an engine freed the blocks behind the rank's back, as a coordinated
// engine freeing through rank 0 before every rank reported done_sending does
// to a follower) is refused before the first byte with a code and a message
// that say so, instead of failing with CODE_INTERNAL mid-READ.
func TestReadOfAnUnmappedPageRefused(t *testing.T) {
	reg := prometheus.NewRegistry()
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8, numBlocks: 256, prealloc: -1})
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8, numBlocks: 256, reg: reg})
	all := pre.alloc(t, 129) // 1..127 fill page 0; 128 and 129 open page 1
	blocks := all[127:]
	require.Equal(t, []uint32{128, 129}, blocks)
	params := pre.finish(t, "x", blocks)
	require.NoError(t, pre.pools[0].Free(t.Context(), []int{128, 129}))
	require.Error(t, pre.pools[0].CheckMapped([]int{128}), "page 1 is gone")

	local := dec.alloc(t, 2)
	dec.startLoad(t, "x", local, params)
	f := dec.wait(t, "x")[0]
	require.NotNil(t, f)
	require.Equal(t, v1.Code_CODE_NOT_FOUND, codes.Of(f.Err), "%v", f.Err)
	require.ErrorContains(t, f.Err, `request "x" export`)
	require.ErrorContains(t, f.Err, "block 128: its page is not mapped; no byte was read")
	require.Zero(t, counter(t, reg, "kvsidecar_connector_read_bytes_total"))
}
