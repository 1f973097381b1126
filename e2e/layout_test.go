package e2e

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// Region layouts compared before a byte moves (issue 26, part 1). A rank
// registers its regions per layer, K then V; a peer built otherwise may list
// the same regions in another order (all K, then all V), or other regions
// with the same count and block length. The expectations every READ carries
// name the reader's layout, so the serving rank maps it by layer and kind,
// or refuses it before any byte, naming both layouts.

const (
	kindK = v1.RegionKind_REGION_KIND_K
	kindV = v1.RegionKind_REGION_KIND_V
)

// layoutOf lists regions as (layer, kind) pairs: layoutOf(0, kindK, 0, kindV).
func layoutOf(spec ...any) []handshake.RegionShape {
	var out []handshake.RegionShape
	for i := 0; i < len(spec); i += 2 {
		out = append(out, handshake.RegionShape{Layer: uint32(spec[i].(int)), Kind: spec[i+1].(v1.RegionKind)})
	}
	return out
}

// rawPrefill is a prefill rank in the test process: a transfer agent whose
// regions are registered in the order its layout gives, with the
// handshake's own server answering handshakes and checking every READ's
// expectations, and every export authorized. Region (layer l, kind k) holds
// the KV a kvsidecar rank keeps in its region 2l (K) or 2l+1 (V), block b
// that of token block b-1.
type rawPrefill struct {
	agent  *transfer.Agent
	reg    *prometheus.Registry
	served atomic.Int64 // READs authorized
}

func startRawPrefill(t testing.TB, env *Env, layout []handshake.RegionShape, key uint64, blocks int) *rawPrefill {
	t.Helper()
	f := env.TLS(t, "raw-prefill", "127.0.0.1")
	srvTLS, cliTLS, err := transfer.LoadTLSFiles(f.CA, f.Cert, f.Key)
	require.NoError(t, err)
	blockLen := uint64(shape.BlockLen())
	md := &handshake.Metadata{EngineID: "raw-prefill", AgentName: "raw-prefill/tp0", Incarnation: 1, TPRank: 0, TPSize: 1,
		ModelHash: handshake.ModelHash(geom), Geometry: geom, BlockSize: 16, NumBlocks: blocks, HeadsPerRank: 8}
	var regions []transfer.Region
	for _, s := range layout {
		mem := make([]byte, uint64(blocks)*blockLen)
		for b := 1; b < blocks; b++ { // block b holds token block b-1 (params name blocks 1..n)
			kvgen.FillBlock(mem[uint64(b)*blockLen:uint64(b+1)*blockLen], shape, key, 2*int(s.Layer)+int(s.Kind-kindK), (b-1)*16)
		}
		r := transfer.SliceRegion(mem, blockLen, 0)
		regions = append(regions, r)
		md.Regions = append(md.Regions, handshake.Region{Base: r.Base, Len: r.Len, BlockLen: blockLen, Layer: s.Layer, Kind: s.Kind})
	}
	hs, err := handshake.NewServer(md)
	require.NoError(t, err)
	p := &rawPrefill{reg: prometheus.NewRegistry()}
	p.agent, err = transfer.New(&transfer.Config{ListenAddr: "127.0.0.1:0", ServerTLS: srvTLS, ClientTLS: cliTLS, Regions: regions,
		OnHandshake: hs.Handle, CheckExpect: hs.CheckExpect, Registerer: p.reg,
		Authorize:      func(context.Context, *transfer.Access) error { p.served.Add(1); return nil },
		OnNotification: func(context.Context, string, *v1.Notification) error { return nil }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.agent.Close() })
	return p
}

// params are kv_transfer_params naming blocks 1..n of the raw prefill.
func (p *rawPrefill) params(id string, n int) *v1.KVTransferParams {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(i + 1)
	}
	return &v1.KVTransferParams{DoRemotePrefill: true, RemoteEngineId: "raw-prefill", RemoteRequestId: id, RemoteBlockIds: ids,
		RemoteRankAddrs: []string{p.agent.Addr().String()}, TpSize: new(uint32(1)),
		RankExports: []*v1.RankExport{{TpRank: 0, ExportId: 7, Capability: []byte("raw")}}}
}

// bytesServed is what the raw prefill's agent served.
func (p *rawPrefill) bytesServed(t testing.TB) float64 {
	t.Helper()
	mfs, err := p.reg.Gather()
	require.NoError(t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "kvsidecar_transfer_bytes_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "role" && l.GetValue() == "server" {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

// TestLayoutPeerListsRegionsInAnotherOrder: a decode `kvsidecar serve`
// loads from a raw prefill peer whose regions are this decode's, listed all
// K then all V, or V before K in one layer: every byte lands where it
// belongs (the serving side maps the READ's regions by layer and kind). A
// peer whose regions differ in kind or layer by more than order (layer 0 V
// twice; a layer 2 for a layer 1), with the same count, block length and
// model hash, is refused before any byte: the load fails naming both
// layouts, the peer served 0 bytes and authorized no READ, and the
// decode's blocks keep their bytes.
//
// fault-matrix: region-layout-order
// fault-matrix: region-layout-differs
func TestLayoutPeerListsRegionsInAnotherOrder(t *testing.T) {
	env := NewEnv(t)
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-l", Role: "decode", Args: geomFlags})
	de := attach(t, dec, 256)
	const key, sentinel, n = 41, 77, 4
	tests := []struct {
		name   string
		layout []handshake.RegionShape
		want   string // the refusal's message; "" when read
	}{
		{"same order", layoutOf(0, kindK, 0, kindV, 1, kindK, 1, kindV), ""},
		{"all K then all V", layoutOf(0, kindK, 1, kindK, 0, kindV, 1, kindV), ""},
		{"V before K in layer 1", layoutOf(0, kindK, 0, kindV, 1, kindV, 1, kindK), ""},
		{"layer 0 V twice", layoutOf(0, kindV, 0, kindV, 1, kindK, 1, kindV),
			"peer raw-prefill/tp0 lists layer 0 V twice (regions[0] and regions[1]) (peer raw-prefill/tp0: [layer 0 V, layer 0 V, layer 1 K, layer 1 V]; this rank: [layer 0 K, layer 0 V, layer 1 K, layer 1 V])"},
		{"layer 2 for layer 1", layoutOf(0, kindK, 0, kindV, 2, kindK, 2, kindV),
			"this rank regions[2] is layer 1 K, peer raw-prefill/tp0 has no layer 1 K (its regions[2] is layer 2 K)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pre := startRawPrefill(t, env, tc.layout, key, 8)
			dst, err := de.Alloc(t.Context(), n)
			require.NoError(t, err)
			de.fill(t, sentinel, dst)
			failed := de.load(t, "layout-"+tc.name, dst, pre.params("req", n))
			if tc.want == "" {
				require.Nil(t, failed, "load failed: %v", failed.GetError())
				de.check(t, key, dst)
				require.Equal(t, float64(4*n*shape.BlockLen()), pre.bytesServed(t), "4 regions × n blocks")
			} else {
				require.NotNil(t, failed, "the load must fail")
				require.Equal(t, v1.Code_CODE_INCOMPATIBLE_MODEL, failed.GetError().GetCode(), failed.GetError().GetMessage())
				require.Contains(t, failed.GetError().GetMessage(), tc.want)
				require.ElementsMatch(t, dst, failed.GetBlockIds(), "every local block is reported for recompute")
				require.Zero(t, pre.bytesServed(t), "0 bytes served before the refusal")
				require.Zero(t, pre.served.Load(), "no READ reached the capability check")
				de.check(t, sentinel, dst)
			}
			require.NoError(t, de.Free(t.Context(), dst))
		})
	}
}

// TestLayoutReaderNamesAnotherOrder: a raw decode peer READs from a
// prefill `kvsidecar serve` by region and block, naming its own layout: in
// another order it gets the bytes of the regions it named (layer 1 V
// first), and a layout that is not the prefill's set of regions is refused
// with CODE_INCOMPATIBLE_MODEL naming both layouts, with no byte served
// and a refusal logged on the prefill.
//
// fault-matrix: region-layout-differs
func TestLayoutReaderNamesAnotherOrder(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "prefill-l", 256, "--role", "prefill")
	const key, n = 43, 3
	p := pre.export(t, "req-l", key, n)
	addr := rankAddr(p)
	e := p.GetRankExports()[0]
	raw := dialRaw(t, addr, peerTLS(t, env, "raw-reader"))
	bl := uint64(shape.BlockLen())
	read := func(layout []handshake.RegionShape) rawReply {
		x := &v1.XferRequest{Op: v1.XferOp_XFER_OP_READ, RequestId: "req-l", ExportId: e.GetExportId(), Capability: e.GetCapability(), XferId: 1,
			TotalLen: uint64(2*n) * bl, Expect: handshake.ExpectOf(handshake.Expect{EngineID: "prefill-l", Layout: layout}, ""),
			Descs: &v1.XferRequest_Blocks{Blocks: &v1.BlockDescs{FirstRegion: 2, NumRegions: 2, Len: bl, BlockIds: p.GetRemoteBlockIds()}}}
		return raw.send(t, &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, Body: &v1.PeerRequest_Xfer{Xfer: x}}, x.TotalLen)
	}

	// The reader's regions 2 and 3 are layer 1 V and layer 1 K: the
	// prefill's regions 3 and 2.
	got := read(layoutOf(0, kindK, 0, kindV, 1, kindV, 1, kindK))
	require.Equal(t, v1.Code_CODE_OK, got.Code, got.Msg)
	for i, region := range []int{3, 2} {
		for k := range n {
			at := (i*n + k) * int(bl)
			bad, first := kvgen.CheckBlock(got.Data[at:at+int(bl)], shape, key, region, k*16)
			require.Zero(t, bad, "reader region %d (prefill region %d) block %d: %d bytes differ, first at %d", 2+i, region, k, bad, first)
		}
	}
	servedBefore := pre.Sidecar.Metric(t, "kvsidecar_transfer_bytes_total", `role="server"`)
	require.Equal(t, float64(2*n)*float64(bl), servedBefore)

	got = read(layoutOf(0, kindK, 0, kindV, 1, kindK, 1, kindK))
	require.Equal(t, v1.Code_CODE_INCOMPATIBLE_MODEL, got.Code, got.Msg)
	require.Contains(t, got.Msg, "the reader lists layer 1 K twice (this agent: [layer 0 K, layer 0 V, layer 1 K, layer 1 V]; the reader: [layer 0 K, layer 0 V, layer 1 K, layer 1 K])")
	require.Equal(t, servedBefore, pre.Sidecar.Metric(t, "kvsidecar_transfer_bytes_total", `role="server"`), "no byte served")
	l := pre.WaitLog(t, "transfer: refused a READ", 10*time.Second)
	require.Contains(t, l["err"], "region layouts differ")

	// The lease is untouched: a decode reads the export intact.
	dec := startSide(t, env, "decode-l2", 256, "--role", "decode")
	dst := dec.load(t, "after", p)
	dec.requireDone(t, "after", key, dst)
	dec.free(t, dst)
	pre.waitSent(t, "req-l", 30*time.Second)
}
