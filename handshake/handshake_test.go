package handshake_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var geom = &v1.ModelGeometry{Model: "llama-3.1-8b", NumLayers: 2, NumKvHeads: 8, HeadDim: 128,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}

// rankMeta builds the metadata of rank r of a prefill group of tpSize.
func rankMeta(engine string, r, tpSize int, inc uint64) *handshake.Metadata {
	heads := 8 / tpSize
	blockLen := uint64(16 * heads * 128 * 2)
	md := &handshake.Metadata{EngineID: engine, AgentName: fmt.Sprintf("%s/tp%d", engine, r), Incarnation: inc,
		TPRank: r, TPSize: tpSize, ModelHash: handshake.ModelHash(geom), Geometry: geom, BlockSize: 16,
		NumBlocks: 64, HeadsPerRank: heads, Addr: addrOf(r), CapabilityKeyID: fmt.Sprintf("%016x", 0xc0ffee00+r)}
	for l := range 2 {
		for _, k := range []v1.RegionKind{v1.RegionKind_REGION_KIND_K, v1.RegionKind_REGION_KIND_V} {
			md.Regions = append(md.Regions, handshake.Region{Base: uint64(0x7f0000000000 + len(md.Regions)<<24),
				Len: 64 * blockLen, BlockLen: blockLen, Layer: uint32(l), Kind: k})
		}
	}
	return md
}

func addrOf(r int) string { return fmt.Sprintf("127.0.0.1:%d", 5600+r) }

// wireCaller serves handshakes of a group of Servers in process, passing
// every request and response through its wire encoding, and counts calls.
type wireCaller struct {
	mu      sync.Mutex
	servers map[string]*handshake.Server
	calls   map[string]int
	gate    chan struct{} // when non-nil, each call waits for a token
}

func newGroup(t testing.TB, engine string, tpSize int, inc uint64) *wireCaller {
	t.Helper()
	wc := &wireCaller{servers: map[string]*handshake.Server{}, calls: map[string]int{}}
	for r := range tpSize {
		s, err := handshake.NewServer(rankMeta(engine, r, tpSize, inc))
		require.NoError(t, err)
		wc.servers[addrOf(r)] = s
	}
	return wc
}

func (wc *wireCaller) Handshake(ctx context.Context, addr string, req *v1.HandshakeRequest) (*v1.HandshakeResponse, error) {
	wc.mu.Lock()
	wc.calls[addr]++
	s := wc.servers[addr]
	gate := wc.gate
	wc.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
	if s == nil {
		return nil, fmt.Errorf("dial %s: connection refused", addr)
	}
	b, err := proto.Marshal(req)
	if err != nil {
		return nil, err
	}
	var in v1.HandshakeRequest
	if err := proto.Unmarshal(b, &in); err != nil {
		return nil, err
	}
	b, err = proto.Marshal(s.Handle(ctx, &in))
	if err != nil {
		return nil, err
	}
	var out v1.HandshakeResponse
	return &out, proto.Unmarshal(b, &out)
}

func (wc *wireCaller) count(addr string) int {
	wc.mu.Lock()
	defer wc.mu.Unlock()
	return wc.calls[addr]
}

func target(engine string, rank, tp int) handshake.Target {
	return handshake.Target{
		Expect: handshake.Expect{EngineID: engine, TPRank: rank, TPSize: tp, ModelHash: handshake.ModelHash(geom), NumRegions: 4},
		Addr:   addrOf(rank), Rank0Addr: addrOf(0),
	}
}

func newClient(t testing.TB, c handshake.Caller, mode handshake.Mode, reg prometheus.Registerer) *handshake.Client {
	t.Helper()
	cl, err := handshake.NewClient(&handshake.Config{Caller: c, Mode: mode, Registerer: reg})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, cl.Close()) })
	return cl
}

func TestPiggybackContactsOnlyTheTarget(t *testing.T) {
	wc := newGroup(t, "prefill", 4, 1)
	reg := prometheus.NewRegistry()
	cl := newClient(t, wc, handshake.ModePiggyback, reg)

	md, err := cl.Get(t.Context(), target("prefill", 3, 4))
	require.NoError(t, err)
	require.Equal(t, 3, md.TPRank)
	require.Equal(t, 4, md.TPSize)
	require.Equal(t, uint64(16*2*128*2), md.Regions[0].BlockLen)
	require.Equal(t, "00000000c0ffee03", md.CapabilityKeyID, "the rank's key id crossed the wire")
	require.Equal(t, 0, wc.count(addrOf(0)), "rank 0 never contacted")
	require.Equal(t, 1, wc.count(addrOf(3)))

	// Cached: no second exchange.
	_, err = cl.Get(t.Context(), target("prefill", 3, 4))
	require.NoError(t, err)
	require.Equal(t, 1, wc.count(addrOf(3)))
	require.Equal(t, 1.0, counterValue(t, reg, "kvsidecar_handshake_cache_hits_total"))
	require.Equal(t, 2, promtest.CollectAndCount(reg, "kvsidecar_handshake_seconds"), "the ok series of both modes, present from the start")
}

// counterValue gathers reg and returns the value of counter name.
func counterValue(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("metric %s not found", name)
	return 0
}

func TestLegacyAsksRankZeroFirst(t *testing.T) {
	wc := newGroup(t, "prefill", 4, 1)
	cl := newClient(t, wc, handshake.ModeLegacy, nil)
	tg := target("prefill", 2, 4)
	tg.TPSize = 0 // legacy does not know it
	md, err := cl.Get(t.Context(), tg)
	require.NoError(t, err)
	require.Equal(t, 2, md.TPRank)
	require.Equal(t, 1, wc.count(addrOf(0)), "rank 0 queried first")
	require.Equal(t, 1, wc.count(addrOf(2)))
	require.Equal(t, 1, cl.Exchanges(addrOf(0)))
}

func TestTPSizeMismatchRefusedByServer(t *testing.T) {
	wc := newGroup(t, "prefill", 4, 1)
	cl := newClient(t, wc, handshake.ModePiggyback, nil)
	_, err := cl.Get(t.Context(), target("prefill", 1, 2))
	require.ErrorIs(t, err, codes.Sentinel(v1.Code_CODE_TP_MISMATCH))
	require.ErrorContains(t, err, "has tp_size=4, the request said tp_size=2")
}

func TestPiggybackNeedsTPSize(t *testing.T) {
	wc := newGroup(t, "prefill", 2, 1)
	cl := newClient(t, wc, handshake.ModePiggyback, nil)
	_, err := cl.Get(t.Context(), target("prefill", 1, 0))
	require.ErrorIs(t, err, handshake.ErrTPMismatch)
	require.Zero(t, wc.count(addrOf(1)))
}

func TestValidationErrors(t *testing.T) {
	wc := newGroup(t, "prefill", 2, 7)
	// local sets the target's expectation to this rank's geometry after f.
	local := func(f func(g *v1.ModelGeometry)) func(*handshake.Target) {
		return func(tg *handshake.Target) {
			g := proto.Clone(geom).(*v1.ModelGeometry)
			g.Model = "decode-model"
			f(g)
			tg.ModelHash, tg.Geometry = handshake.ModelHash(g), g
		}
	}
	tests := []struct {
		name   string
		mutate func(*handshake.Target)
		want   error
		msg    string
	}{
		{"unknown engine", func(tg *handshake.Target) { tg.EngineID = "other" }, codes.Sentinel(v1.Code_CODE_NOT_FOUND), `is engine_id "prefill", not "other"`},
		{"model hash", func(tg *handshake.Target) { h := sha256.Sum256([]byte("x")); tg.ModelHash = h[:] }, handshake.ErrIncompatible, "model hash"},
		// With the local geometry known, the fields that differ are named
		// with both values, not a hash (the reported case: block_size 32 vs 16 was
		// reported as a model hash and only the prefill's 32).
		{"block size", local(func(g *v1.ModelGeometry) { g.BlockSize = 32 }), handshake.ErrIncompatible,
			`peer prefill/tp1 (model "llama-3.1-8b") and this rank (model "decode-model") differ in block_size: peer 16, local 32`},
		{"dtype", local(func(g *v1.ModelGeometry) { g.Dtype = v1.DType_DTYPE_FLOAT16 }), handshake.ErrIncompatible,
			"differ in dtype: peer DTYPE_BFLOAT16, local DTYPE_FLOAT16"},
		{"head dim and heads", local(func(g *v1.ModelGeometry) { g.HeadDim, g.NumKvHeads = 64, 4 }), handshake.ErrIncompatible,
			"differ in num_kv_heads: peer 8, local 4; head_dim: peer 128, local 64"},
		{"layers and attention", local(func(g *v1.ModelGeometry) { g.NumLayers, g.Attention = 3, v1.Attention_ATTENTION_MLA }), handshake.ErrIncompatible,
			"differ in num_layers: peer 2, local 3; attention: peer ATTENTION_GQA, local ATTENTION_MLA"},
		{"region count", func(tg *handshake.Target) { tg.NumRegions = 6 }, handshake.ErrIncompatible,
			"has 4 regions, local layout has 6 (region layout: 2 K, 2 V, 0 compound on the peer)"},
		{"block_len", func(tg *handshake.Target) { tg.BlockLen = 4096 }, handshake.ErrIncompatible, "block_len=16384, the TP mapping needs 4096"},
		{"incarnation", func(tg *handshake.Target) { tg.Incarnation = 8 }, handshake.ErrUnknownEngine, "incarnation 0x7"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cl := newClient(t, wc, handshake.ModePiggyback, nil)
			tg := target("prefill", 1, 2)
			tc.mutate(&tg)
			_, err := cl.Get(t.Context(), tg)
			require.ErrorIs(t, err, tc.want)
			require.ErrorContains(t, err, tc.msg)
		})
	}
}

func TestNewIncarnationRefetches(t *testing.T) {
	wc := newGroup(t, "prefill", 2, 1)
	cl := newClient(t, wc, handshake.ModePiggyback, nil)
	tg := target("prefill", 1, 2)
	tg.Incarnation = 1
	_, err := cl.Get(t.Context(), tg)
	require.NoError(t, err)

	// The prefill restarts on the same address with a new incarnation.
	restarted := newGroup(t, "prefill", 2, 2)
	wc.mu.Lock()
	wc.servers = restarted.servers
	wc.mu.Unlock()
	tg.Incarnation = 2
	md, err := cl.Get(t.Context(), tg)
	require.NoError(t, err)
	require.Equal(t, uint64(2), md.Incarnation)
	require.Equal(t, 2, wc.count(addrOf(1)), "re-handshaked")

	// Forget (connection lost) also forces a new exchange.
	cl.Forget(addrOf(1))
	_, err = cl.Get(t.Context(), tg)
	require.NoError(t, err)
	require.Equal(t, 3, wc.count(addrOf(1)))
}

func TestConcurrentGetsShareOneExchange(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		wc := newGroup(t, "prefill", 2, 1)
		wc.gate = make(chan struct{})
		cl, err := handshake.NewClient(&handshake.Config{Caller: wc})
		require.NoError(t, err)
		defer cl.Close()
		var wg sync.WaitGroup
		errs := make([]error, 8)
		for i := range errs {
			wg.Go(func() { _, errs[i] = cl.Get(t.Context(), target("prefill", 1, 2)) })
		}
		synctest.Wait()
		close(wc.gate)
		wg.Wait()
		for _, err := range errs {
			require.NoError(t, err)
		}
		require.Equal(t, 1, wc.count(addrOf(1)))
	})
}

func TestTimeoutAndCallerCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		wc := newGroup(t, "prefill", 2, 1)
		wc.gate = make(chan struct{}) // never opened: the peer never answers
		cl, err := handshake.NewClient(&handshake.Config{Caller: wc, Timeout: 3 * time.Second})
		require.NoError(t, err)
		defer cl.Close()

		// A caller that gives up returns its own cause at once.
		ctx, cancel := context.WithCancelCause(t.Context())
		cancel(fmt.Errorf("request aborted"))
		_, err = cl.Get(ctx, target("prefill", 1, 2))
		require.EqualError(t, err, "request aborted")

		start := time.Now()
		_, err = cl.Get(t.Context(), target("prefill", 1, 2))
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, 3*time.Second, time.Since(start), "bounded by Config.Timeout")
	})
}

func TestGetAllParallel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		wc := newGroup(t, "prefill", 4, 1)
		wc.gate = make(chan struct{})
		cl, err := handshake.NewClient(&handshake.Config{Caller: wc})
		require.NoError(t, err)
		defer cl.Close()
		done := make(chan []*handshake.Metadata)
		go func() {
			mds, err := cl.GetAll(t.Context(), []handshake.Target{target("prefill", 2, 4), target("prefill", 3, 4)})
			require.NoError(t, err)
			done <- mds
		}()
		synctest.Wait()
		// Both exchanges are in flight before either is answered.
		require.Equal(t, 1, wc.count(addrOf(2)))
		require.Equal(t, 1, wc.count(addrOf(3)))
		close(wc.gate)
		mds := <-done
		require.Equal(t, 2, mds[0].TPRank)
		require.Equal(t, 3, mds[1].TPRank)
	})
}

func TestCloseTwice(t *testing.T) {
	cl, err := handshake.NewClient(&handshake.Config{Caller: newGroup(t, "p", 1, 1)})
	require.NoError(t, err)
	require.NoError(t, cl.Close())
	require.ErrorContains(t, cl.Close(), "already closed")
	_, err = cl.Get(t.Context(), target("p", 0, 1))
	require.ErrorContains(t, err, "client closed")
}

func FuzzMetadata(f *testing.F) {
	b, err := proto.Marshal(rankMeta("prefill", 1, 2, 9).Proto())
	require.NoError(f, err)
	f.Add(b)
	f.Fuzz(func(t *testing.T, in []byte) {
		var m v1.AgentMetadata
		if proto.Unmarshal(in, &m) != nil {
			return
		}
		md, err := handshake.FromProto(&m)
		if err != nil {
			return
		}
		// Valid metadata survives its own round trip.
		md2, err := handshake.FromProto(md.Proto())
		require.NoError(t, err)
		require.Equal(t, md.Regions, md2.Regions)
		for _, r := range md.Regions {
			require.LessOrEqual(t, r.BlockLen*uint64(md.NumBlocks), r.Len)
		}
	})
}

// TestInflightKeyedByAddress is a regression test: Gets for one rank at two
// addresses (a stale and a fresh remote_rank_addrs after a restart) shared
// the first exchange, so the second got metadata of another process.
func TestInflightKeyedByAddress(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		wc := newGroup(t, "prefill", 2, 1)
		other := newGroup(t, "prefill", 2, 1)
		wc.servers["127.0.0.1:7001"] = other.servers[addrOf(1)]
		wc.gate = make(chan struct{})
		cl, err := handshake.NewClient(&handshake.Config{Caller: wc})
		require.NoError(t, err)
		defer cl.Close()
		a, b := target("prefill", 1, 2), target("prefill", 1, 2)
		b.Addr = "127.0.0.1:7001"
		var mdA, mdB *handshake.Metadata
		var wg sync.WaitGroup
		wg.Go(func() { mdA, _ = cl.Get(t.Context(), a) })
		wg.Go(func() { mdB, _ = cl.Get(t.Context(), b) })
		synctest.Wait()
		require.Equal(t, 1, wc.count(a.Addr))
		require.Equal(t, 1, wc.count(b.Addr), "the second address got its own exchange")
		close(wc.gate)
		wg.Wait()
		require.Equal(t, a.Addr, mdA.Addr)
		require.Equal(t, b.Addr, mdB.Addr)
	})
}

// TestCheckExpect: the expectations a READ carries instead of a handshake
// are refused with the handshake's classes, naming both values, and a
// READ expecting exactly this rank passes.
//
// fault-matrix: region-layout-differs
func TestCheckExpect(t *testing.T) {
	md := rankMeta("prefill", 1, 2, 0x77)
	md.CapabilityKeyID = "k1"
	s, err := handshake.NewServer(md)
	require.NoError(t, err)
	e := handshake.Expect{EngineID: "prefill", TPRank: 1, TPSize: 2, ModelHash: md.ModelHash, Geometry: md.Geometry,
		NumRegions: len(md.Regions), BlockLen: md.Regions[0].BlockLen, Incarnation: 0x77, Layout: handshake.Shapes(md.Regions)}
	regions, err := s.CheckExpect(t.Context(), handshake.ExpectOf(e, "k1"))
	require.NoError(t, err)
	require.Equal(t, []int{0, 1, 2, 3}, regions, "the reader's layout is this rank's, in its order")

	other := proto.Clone(md.Geometry).(*v1.ModelGeometry)
	other.NumLayers++
	tests := []struct {
		name string
		edit func(x *v1.PeerExpect)
		want v1.Code
		msg  string
	}{
		{"engine", func(x *v1.PeerExpect) { x.EngineId = "decode" }, v1.Code_CODE_NOT_FOUND, `engine_id "prefill", the READ expects "decode"`},
		{"rank", func(x *v1.PeerExpect) { x.TpRank = 0 }, v1.Code_CODE_NOT_FOUND, "tp_rank 1, the READ expects 0"},
		{"tp_size", func(x *v1.PeerExpect) { x.TpSize = 4 }, v1.Code_CODE_TP_MISMATCH, "tp_size=2, kv_transfer_params said tp_size=4"},
		{"geometry", func(x *v1.PeerExpect) { x.Geometry, x.ModelHash = other, handshake.ModelHash(other) }, v1.Code_CODE_INCOMPATIBLE_MODEL,
			fmt.Sprintf("num_layers: this agent %d, reader %d", md.Geometry.GetNumLayers(), other.GetNumLayers())},
		{"regions", func(x *v1.PeerExpect) { x.NumRegions++ }, v1.Code_CODE_INCOMPATIBLE_MODEL, "regions, the reader's layout has"},
		{"block_len", func(x *v1.PeerExpect) { x.BlockLen++ }, v1.Code_CODE_INCOMPATIBLE_MODEL, "the reader's TP mapping needs"},
		{"incarnation", func(x *v1.PeerExpect) { x.Incarnation = 0x99 }, v1.Code_CODE_NOT_FOUND, "kv_transfer_params said 0x99"},
		{"capability key", func(x *v1.PeerExpect) { x.CapabilityKeyId = "k2" }, v1.Code_CODE_CAPABILITY_DENIED, "holds capability key id k1, the export was signed with key id k2"},
		{"layout: V where this rank holds K", func(x *v1.PeerExpect) { x.Layout[0].Kind = v1.RegionKind_REGION_KIND_V }, v1.Code_CODE_INCOMPATIBLE_MODEL,
			"the reader lists layer 0 V twice (this agent: [layer 0 K, layer 0 V, layer 1 K, layer 1 V]; the reader: [layer 0 V, layer 0 V, layer 1 K, layer 1 V])"},
		{"layout: another layer", func(x *v1.PeerExpect) { x.Layout[3].Layer = 2 }, v1.Code_CODE_INCOMPATIBLE_MODEL,
			"the reader regions[3] is layer 2 V, this agent has no layer 2 V (its regions[3] is layer 1 V)"},
		{"layout: one region's block length", func(x *v1.PeerExpect) { x.Layout[2].BlockLen *= 2 }, v1.Code_CODE_INCOMPATIBLE_MODEL,
			fmt.Sprintf("layer 1 K: block_len %d on this agent, the reader needs %d", md.Regions[2].BlockLen, 2*md.Regions[2].BlockLen)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := handshake.ExpectOf(e, "k1")
			tt.edit(x)
			_, err := s.CheckExpect(t.Context(), x)
			require.Equal(t, tt.want, codes.Of(err), "%v", err)
			require.ErrorContains(t, err, tt.msg)
		})
	}
}

// TestMatchLayout: a reader's layout maps onto a peer holding the same
// regions in another order (all K then all V; V before K in one layer) by
// layer and kind, and is refused, naming both layouts, when the sets
// differ; the handshake's own check on the decode (Expect.Check) agrees.
//
// fault-matrix: region-layout-order
// fault-matrix: region-layout-differs
func TestMatchLayout(t *testing.T) {
	K, V := v1.RegionKind_REGION_KIND_K, v1.RegionKind_REGION_KIND_V
	sh := func(spec ...any) []handshake.RegionShape {
		var out []handshake.RegionShape
		for i := 0; i < len(spec); i += 2 {
			out = append(out, handshake.RegionShape{Layer: uint32(spec[i].(int)), Kind: spec[i+1].(v1.RegionKind), BlockLen: 4096})
		}
		return out
	}
	local := sh(0, K, 0, V, 1, K, 1, V)
	tests := []struct {
		name   string
		served []handshake.RegionShape
		want   []int  // the served index of each local region
		msg    string // the error, when refused
	}{
		{"same order", sh(0, K, 0, V, 1, K, 1, V), []int{0, 1, 2, 3}, ""},
		{"all K then all V", sh(0, K, 1, K, 0, V, 1, V), []int{0, 2, 1, 3}, ""},
		{"V before K in layer 1", sh(0, K, 0, V, 1, V, 1, K), []int{0, 1, 3, 2}, ""},
		{"V instead of K", sh(0, V, 0, V, 1, K, 1, V), nil, "peer p lists layer 0 V twice (regions[0] and regions[1])"},
		{"a layer missing", sh(0, K, 0, V, 2, K, 2, V), nil,
			"region layouts differ: this rank regions[2] is layer 1 K, peer p has no layer 1 K (its regions[2] is layer 2 K) (peer p: [layer 0 K, layer 0 V, layer 2 K, layer 2 V]; this rank: [layer 0 K, layer 0 V, layer 1 K, layer 1 V])"},
		{"one region fewer", sh(0, K, 0, V, 1, K), nil, "peer p has 3 regions, this rank 4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := handshake.MatchLayout(tt.served, local, "peer p", "this rank")
			if tt.msg != "" {
				require.ErrorIs(t, err, handshake.ErrIncompatible)
				require.ErrorContains(t, err, tt.msg)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
			for i, j := range got {
				require.Equal(t, local[i], tt.served[j], "local region %d reads served region %d", i, j)
			}
		})
	}

	md := rankMeta("prefill", 0, 1, 1)
	e := handshake.Expect{EngineID: "prefill", TPRank: 0, Layout: handshake.Shapes(md.Regions)}
	md.Regions[1], md.Regions[2] = md.Regions[2], md.Regions[1] // all K, then all V
	require.NoError(t, e.Check(md), "the same regions in another order are read by layer and kind")
	md.Regions[1].Kind = v1.RegionKind_REGION_KIND_V
	err := e.Check(md)
	require.Equal(t, v1.Code_CODE_INCOMPATIBLE_MODEL, codes.Of(err))
	require.ErrorContains(t, err, "peer prefill/tp0 lists layer 1 V twice")
}
