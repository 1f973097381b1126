package handshake_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/handshake"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// FuzzHandshakeRequest decodes arbitrary bytes as the HandshakeRequest a
// dialer sends and answers it as a serving rank does: never a panic, and
// either the rank's own metadata (only when every expectation the request
// states holds) or an error with a code, never both.
func FuzzHandshakeRequest(f *testing.F) {
	local := rankMeta("prefill", 1, 2, 9)
	srv, err := handshake.NewServer(local)
	require.NoError(f, err)
	for _, req := range []*v1.HandshakeRequest{
		{WireVersion: handshake.WireVersion, ExpectedEngineId: "prefill", ExpectedTpRank: 1, ExpectedTpSize: 2},
		{WireVersion: handshake.WireVersion, ExpectedTpRank: 1},
		{WireVersion: handshake.WireVersion, ExpectedEngineId: "other", ExpectedTpRank: 1, ExpectedTpSize: 4,
			Dialer: rankMeta("decode", 0, 4, 3).Proto()},
	} {
		b, err := proto.Marshal(req)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		var req v1.HandshakeRequest
		if proto.Unmarshal(in, &req) != nil {
			return
		}
		resp := srv.Handle(context.Background(), &req)
		if resp.GetError() != nil {
			require.Nil(t, resp.GetMetadata(), "metadata sent with an error")
			require.Contains(t, []v1.Code{v1.Code_CODE_INCOMPATIBLE_MODEL, v1.Code_CODE_NOT_FOUND, v1.Code_CODE_TP_MISMATCH},
				resp.GetError().GetCode(), resp.GetError().GetMessage())
			return
		}
		require.Equal(t, handshake.WireVersion, req.GetWireVersion())
		require.Contains(t, []string{"", "prefill"}, req.GetExpectedEngineId())
		require.Equal(t, uint32(1), req.GetExpectedTpRank())
		require.Contains(t, []uint32{0, 2}, req.GetExpectedTpSize())
		md, err := handshake.FromProto(resp.GetMetadata())
		require.NoError(t, err)
		require.Equal(t, local.Regions, md.Regions)
	})
}

// FuzzHandshakeResponse decodes arbitrary bytes as the HandshakeResponse
// a dialer receives and validates its metadata as the client does
// (FromProto, then the request's expectations): never a panic, and
// metadata that passes both names the expected engine, rank, tp_size,
// model and region geometry, with every block inside its region.
func FuzzHandshakeResponse(f *testing.F) {
	want := rankMeta("prefill", 1, 2, 9)
	for _, resp := range []*v1.HandshakeResponse{
		{Metadata: want.Proto()},
		{Metadata: rankMeta("prefill", 0, 4, 1).Proto()},
		{Error: &v1.Error{Code: v1.Code_CODE_TP_MISMATCH, Message: "tp_size=4"}},
	} {
		b, err := proto.Marshal(resp)
		require.NoError(f, err)
		f.Add(b)
	}
	expect := handshake.Expect{EngineID: "prefill", TPRank: 1, TPSize: 2, ModelHash: handshake.ModelHash(geom),
		NumRegions: len(want.Regions), BlockLen: want.Regions[0].BlockLen}
	f.Fuzz(func(t *testing.T, in []byte) {
		var resp v1.HandshakeResponse
		if proto.Unmarshal(in, &resp) != nil || resp.GetError() != nil {
			return
		}
		md, err := handshake.FromProto(resp.GetMetadata())
		if err != nil {
			return
		}
		if expect.Check(md) != nil {
			return
		}
		require.Equal(t, "prefill", md.EngineID)
		require.Equal(t, 1, md.TPRank)
		require.Equal(t, 2, md.TPSize)
		require.Len(t, md.Regions, len(want.Regions))
		for _, r := range md.Regions {
			require.Equal(t, expect.BlockLen, r.BlockLen)
			if md.NumBlocks > 0 {
				end := r.BlockOffset(md.NumBlocks-1) + r.BlockLen
				require.LessOrEqual(t, end, r.Len, "last block leaves its region")
			}
		}
	})
}
