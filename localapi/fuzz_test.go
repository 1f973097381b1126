package localapi

import (
	"bytes"
	"context"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// FuzzLocalRequest decodes arbitrary bytes as a local API request frame and
// runs every decodable request through a server holding a real cache: no
// input may panic, and every reply must carry a code. StartLoad is decoded
// but not run (it would dial whatever address the fuzzer invents).
func FuzzLocalRequest(f *testing.F) {
	geom := &v1.ModelGeometry{Model: "fz", NumLayers: 1, NumKvHeads: 2, HeadDim: 64, Dtype: v1.DType_DTYPE_BFLOAT16,
		BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}
	for _, req := range []*v1.LocalRequest{
		{WireVersion: 1, Call: &v1.LocalRequest_Create{Create: &v1.CreateKVCache{Geometry: geom, TpSize: 1, NumBlocks: 64}}},
		{WireVersion: 1, Call: &v1.LocalRequest_Alloc{Alloc: &v1.AllocBlocks{Count: 3}}},
		{WireVersion: 1, Call: &v1.LocalRequest_Free{Free: &v1.FreeBlocks{BlockIds: []uint32{1, 2}}}},
		{WireVersion: 1, Call: &v1.LocalRequest_SetLimit{SetLimit: &v1.SetMemoryLimit{Bytes: 8 << 20, Strict: true}}},
		{WireVersion: 1, Call: &v1.LocalRequest_RequestFinished{RequestFinished: &v1.RequestFinished{RequestId: "r", BlockIds: []uint32{1},
			Status: v1.FinishStatus_FINISH_STATUS_LENGTH, Params: &v1.KVTransferParams{DoRemoteDecode: true}}}},
		{WireVersion: 1, Call: &v1.LocalRequest_GetFinished{GetFinished: &v1.GetFinished{}}},
		{WireVersion: 1, Call: &v1.LocalRequest_Abort{Abort: &v1.Abort{RequestId: "r"}}},
		{WireVersion: 1, Call: &v1.LocalRequest_Stats{Stats: &v1.Stats{}}},
		{WireVersion: 1, Call: &v1.LocalRequest_Sync{Sync: true}},
	} {
		b, err := wire.AppendFrame(nil, req, 0)
		require.NoError(f, err)
		f.Add(b)
	}
	ca, err := devtls.NewCA()
	require.NoError(f, err)
	srvTLS, err := ca.ServerConfig()
	require.NoError(f, err)
	cliTLS, err := ca.ClientConfig()
	require.NoError(f, err)
	open := func(ctx context.Context, req *v1.CreateKVCache) (*Cache, error) {
		layout, err := vmm.LayoutFor(req.GetGeometry(), int(req.GetTpRank()), int(req.GetTpSize()))
		if err != nil {
			return nil, err
		}
		tr := NewPageTracker(nil)
		pool, err := vmm.NewPool(ctx, &vmm.Config{Layout: layout, NumBlocks: 64, PageHook: tr})
		if err != nil {
			return nil, err
		}
		rank, err := connector.NewRank(ctx, &connector.Config{EngineID: "fz", TPSize: 1, Geometry: req.GetGeometry(), Pool: pool,
			Transfer: &transfer.Config{ListenAddr: "127.0.0.1:0", ServerTLS: srvTLS, ClientTLS: cliTLS}})
		if err != nil {
			_ = pool.Close()
			return nil, err
		}
		return &Cache{Pool: pool, Rank: rank, Tracker: tr, Create: req, EngineID: "fz", Close: pool.Close}, nil
	}
	dir := f.TempDir()
	require.NoError(f, os.Chmod(dir, 0o700), "a socket directory grants nothing to others")
	s, err := NewServer(f.Context(), &ServerConfig{Path: dir + "/fz.sock", Open: open})
	require.NoError(f, err)
	f.Cleanup(func() { _ = s.Close() })
	f.Fuzz(func(t *testing.T, data []byte) {
		req := &v1.LocalRequest{}
		if err := wire.NewReader(bytes.NewReader(data), DefaultMaxRequestBytes).ReadMsg(req); err != nil {
			return
		}
		if _, ok := req.GetCall().(*v1.LocalRequest_StartLoad); ok {
			return
		}
		st := &connState{known: map[int]uint64{}}
		rep := s.handle(st, req)
		if rep.GetError() != nil {
			require.NotEqual(t, v1.Code_CODE_OK, rep.GetError().GetCode(), rep.GetError().GetMessage())
		}
		if st.attached {
			d, ex := s.delta(st)
			if ex != nil {
				require.Equal(t, len(ex.Files), int(d.GetNumFds()))
				require.NoError(t, ex.Close())
			}
		}
	})
}
