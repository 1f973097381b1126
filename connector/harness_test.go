package connector_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/quic-go/quic-go"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/internal/netem"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// gqa8 is a small GQA geometry with 8 KV heads (llama-like, 2 layers).
var gqa8 = &v1.ModelGeometry{Model: "tiny-gqa8", NumLayers: 2, NumKvHeads: 8, HeadDim: 64,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}

// gqa8KV is gqa8 with K and V of each layer in one region (vLLM's CPU
// backend's block layout, H2ND).
var gqa8KV = &v1.ModelGeometry{Model: "tiny-gqa8-h2nd", NumLayers: 2, NumKvHeads: 8, HeadDim: 64,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_H2ND, Attention: v1.Attention_ATTENTION_GQA}

// gqa2 has 2 KV heads, replicated when TP > 2.
var gqa2 = &v1.ModelGeometry{Model: "tiny-gqa2", NumLayers: 2, NumKvHeads: 2, HeadDim: 64,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}

// mlaGeom is an MLA geometry (deepseek-v2-lite's latent of 576 elements):
// its 18 KiB blocks do not divide a page, so blocks are padded per page.
var mlaGeom = &v1.ModelGeometry{Model: "tiny-mla", NumLayers: 2, NumKvHeads: 1, HeadDim: 576,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_MLA}

var testCA = func() *devtls.CA {
	ca, err := devtls.NewCA()
	if err != nil {
		panic(err)
	}
	return ca
}()

type instOpts struct {
	engine    string
	tp        int
	geom      *v1.ModelGeometry
	numBlocks int
	mode      handshake.Mode
	delay     time.Duration // one-way delay on every packet this instance sends
	leaseTTL  time.Duration
	addrs     []string // fixed listen addresses (restart on the same ports)
	secret    []byte
	reg       prometheus.Registerer
	prealloc  int                     // vmm.Config.PreallocPages (0: the default reserve)
	resetKey  *quic.StatelessResetKey // the agents' stateless-reset key (a restart keeps it)
	sim       *testutil.SimNet        // listen on this in-memory network instead of UDP (see simOpts)
	ca        *devtls.CA              // the TLS CA; default testCA
	// tap, when set, wraps rank r's socket before its agent gets it (to
	// watch or capture datagrams).
	tap func(r int, pc net.PacketConn) net.PacketConn
	// quicOnly turns the same-host path off for this instance, as
	// KVSIDECAR_SAME_HOST=off does for every instance (make test runs
	// this package both ways). Instances on the simulated network never
	// use it: its sockets are real.
	quicOnly bool
	// verifyEvery is connector.Config.SameHostVerifyEvery (0: its default).
	verifyEvery int
}

// sameHostOn reports whether instances use the same-host path by default
// (KVSIDECAR_SAME_HOST is not off, as `serve --same-host` reads it).
func sameHostOn() bool {
	v := os.Getenv("KVSIDECAR_SAME_HOST")
	return v != "off" && v != "false" && v != "0"
}

// simOpts returns options for instances on one in-memory network with the
// given one-way delay, for tests under testing/synctest: their certificates
// come from a CA made inside the bubble (its clock starts in 2000).
func simOpts(t testing.TB, oneWay time.Duration) instOpts {
	t.Helper()
	ca, err := devtls.NewCA()
	require.NoError(t, err)
	return instOpts{sim: testutil.NewSimNet(oneWay), ca: ca}
}

// instance is one engine instance: tp ranks, each with its pool and Rank.
type instance struct {
	opts  instOpts
	pools []*vmm.Pool
	ranks []*connector.Rank
	addrs []string
	pcs   []*netem.PacketConn
}

func newInstance(t testing.TB, o instOpts) *instance {
	t.Helper()
	if o.numBlocks == 0 {
		o.numBlocks = 64
	}
	if o.secret == nil {
		o.secret = []byte("0123456789abcdef-" + o.engine)
	}
	ca := o.ca
	if ca == nil {
		ca = testCA
	}
	srv, err := ca.ServerConfig()
	require.NoError(t, err)
	cli, err := ca.ClientConfig()
	require.NoError(t, err)
	in := &instance{opts: o}
	// Listen first so every rank knows every rank's address.
	for r := range o.tp {
		addr := "127.0.0.1:0"
		if o.addrs != nil {
			addr = o.addrs[r]
		}
		var pc *netem.PacketConn
		if o.sim != nil {
			pc = o.sim.Listen(t, addr)
		} else {
			udp, err := net.ListenPacket("udp", addr)
			require.NoError(t, err)
			pc = netem.New(udp, o.delay)
		}
		in.pcs = append(in.pcs, pc)
		in.addrs = append(in.addrs, pc.LocalAddr().String())
	}
	sockDir := ""
	if o.sim == nil && !o.quicOnly && sameHostOn() {
		dir, err := os.MkdirTemp("", "kvs-conn-") // short: a unix socket path holds 107 bytes
		require.NoError(t, err)
		t.Cleanup(func() { _ = os.RemoveAll(dir) })
		sockDir = dir
	}
	for r := range o.tp {
		var pc net.PacketConn = in.pcs[r]
		if o.tap != nil {
			pc = o.tap(r, pc)
		}
		sameHost := ""
		if sockDir != "" {
			var err error
			sameHost, err = connector.SameHostSocketPath(sockDir, o.engine, r)
			require.NoError(t, err)
		}
		b, err := connector.BuildRank(t.Context(), &connector.BuildConfig{NumBlocks: o.numBlocks, PreallocPages: o.prealloc,
			Rank: connector.Config{
				EngineID: o.engine, TPRank: r, TPSize: o.tp, Geometry: o.geom,
				// wallclock: without o.sim the instances run on real UDP, where the progress timer is the wall clock's; 5 s scaled is far above a loaded machine's stalls.
				Transfer: &transfer.Config{PacketConn: pc, ServerTLS: srv, ClientTLS: cli, ProgressTimeout: testutil.Scaled(5 * time.Second),
					StatelessResetKey: o.resetKey},
				RankAddrs: in.addrs, CapabilitySecret: o.secret, LeaseTTL: o.leaseTTL, HandshakeMode: o.mode, Registerer: o.reg,
				SameHostSocket: sameHost, SameHostVerifyEvery: o.verifyEvery,
			}})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, b.Close()) })
		in.pools = append(in.pools, b.Pool)
		in.ranks = append(in.ranks, b.Rank)
	}
	t.Cleanup(in.close)
	return in
}

// requirePath checks that the instance's READs took the path the
// environment asks for: through mapped pages with the same-host path on
// (each rank that read), over QUIC with it off.
func (in *instance) requirePath(t testing.TB) {
	t.Helper()
	var local, all uint64
	for _, r := range in.ranks {
		local += r.Agent().SameHostBytes()
		all += r.Agent().BytesMoved()
	}
	require.Positive(t, all, "the instance read something")
	if in.opts.sim == nil && !in.opts.quicOnly && sameHostOn() {
		require.Equal(t, all, local, "every byte read through the same-host path")
	} else {
		require.Zero(t, local, "no byte through the same-host path")
	}
}

func (in *instance) close() {
	for _, r := range in.ranks {
		_ = r.Close()
	}
}

// kill ends the instance as a killed process ends: its sockets go dark
// before the ranks close, so its peers hear nothing.
func (in *instance) kill() {
	for _, pc := range in.pcs {
		pc.Kill()
	}
	in.close()
}

// heads returns the head span of rank r.
func (in *instance) heads(t testing.TB, r int) connector.HeadSpan {
	t.Helper()
	h := int(in.opts.geom.GetNumKvHeads())
	if in.opts.geom.GetAttention() == v1.Attention_ATTENTION_MLA {
		h = 1
	}
	s, err := connector.RankHeads(h, in.opts.tp, r)
	require.NoError(t, err)
	return s
}

func (in *instance) shape(t testing.TB, r int) kvgen.Shape {
	hs := in.heads(t, r)
	rows := int(in.opts.geom.GetBlockSize())
	if kvgeom.CompoundKV(in.opts.geom.GetLayout()) {
		rows *= 2 // a head's K and V rows share the region
	}
	return kvgen.Shape{BlockSize: rows, RowBytes: int(in.opts.geom.GetHeadDim()) * 2, FirstHead: hs.First, Heads: hs.Count}
}

// alloc allocates n blocks on every rank in lockstep (each rank drives its
// own pool) and returns the ids, equal on every rank.
func (in *instance) alloc(t testing.TB, n int) []uint32 {
	t.Helper()
	var ids []int
	for r, p := range in.pools {
		got, err := p.Alloc(t.Context(), n)
		require.NoError(t, err)
		if r == 0 {
			ids = got
		}
		require.Equal(t, ids, got, "lockstep allocation gives every rank the same ids")
	}
	out := make([]uint32, n)
	for i, id := range ids {
		out[i] = uint32(id)
	}
	return out
}

// fill writes the deterministic KV of request key into blocks on every rank.
func (in *instance) fill(t testing.TB, key uint64, blocks []uint32) {
	t.Helper()
	bs := int(in.opts.geom.GetBlockSize())
	for r, p := range in.pools {
		s := in.shape(t, r)
		for _, reg := range p.Regions() {
			for k, b := range blocks {
				buf, err := p.HostBytes(reg.Index, reg.BlockOffset(int(b)), reg.BlockLen)
				require.NoError(t, err)
				kvgen.FillBlock(buf, s, key, reg.Index, k*bs)
			}
		}
	}
}

// check verifies every byte of blocks on every rank; blocks[k] holds the
// request's block skip+k. It returns the bytes checked.
func (in *instance) check(t testing.TB, key uint64, blocks []uint32, skip int) uint64 {
	t.Helper()
	bs := int(in.opts.geom.GetBlockSize())
	var n uint64
	for r, p := range in.pools {
		s := in.shape(t, r)
		for _, reg := range p.Regions() {
			for k, b := range blocks {
				buf, err := p.HostBytes(reg.Index, reg.BlockOffset(int(b)), reg.BlockLen)
				require.NoError(t, err)
				bad, first := kvgen.CheckBlock(buf, s, key, reg.Index, (skip+k)*bs)
				require.Zero(t, bad, "rank %d region %d block %d: %d bytes differ, first at %d", r, reg.Index, b, bad, first)
				n += uint64(len(buf))
			}
		}
	}
	return n
}

// finish calls RequestFinished on every prefill rank and returns the
// ranks' params merged, after a JSON round trip, as the proxy passes them.
func (in *instance) finish(t testing.TB, id string, blocks []uint32) *v1.KVTransferParams {
	t.Helper()
	var parts []*v1.KVTransferParams
	for _, r := range in.ranks {
		p, err := r.RequestFinished(t.Context(), id, blocks, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.NoError(t, err)
		require.NotNil(t, p)
		parts = append(parts, p)
	}
	merged, err := connector.MergeExports(parts...)
	require.NoError(t, err)
	b, err := connector.MarshalKVTransferParams(merged)
	require.NoError(t, err)
	out, err := connector.UnmarshalKVTransferParams(b)
	require.NoError(t, err)
	return out
}

// startLoad calls StartLoad on every decode rank.
func (in *instance) startLoad(t testing.TB, id string, local []uint32, p *v1.KVTransferParams) {
	t.Helper()
	for _, r := range in.ranks {
		require.NoError(t, r.StartLoad(t.Context(), &v1.ReqMeta{RequestId: id, LocalBlockIds: local, Params: p,
			RemoteHitBlocks: new(uint32(len(p.GetRemoteBlockIds()) - len(local)))}))
	}
}

// wait collects what every rank reports until each reported id in either
// list; it returns the failures by rank.
func (in *instance) wait(t testing.TB, id string) []*connector.FailedLoad {
	t.Helper()
	out := make([]*connector.FailedLoad, len(in.ranks))
	for r, rank := range in.ranks {
		_, out[r] = waitLoad(t, rank, id)
	}
	return out
}

// waitLoad collects what rank reports until it reported id, done or
// failed, and returns which.
func waitLoad(t testing.TB, rank *connector.Rank, id string) (done bool, failed *connector.FailedLoad) {
	t.Helper()
	// wallclock: on real UDP (without o.sim) a generous scaled bound, so a lost report fails the test instead of hanging it; virtual under synctest.
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(30*time.Second))
	defer cancel()
	for !done && failed == nil {
		f, err := rank.WaitFinished(ctx)
		require.NoError(t, err, "waiting for %q", id)
		for _, d := range f.DoneRecving {
			done = done || d == id
		}
		for i := range f.Failed {
			if f.Failed[i].RequestID == id {
				failed = &f.Failed[i]
			}
		}
	}
	return done, failed
}

// waitSent collects what rank r reports until id is in done_sending and
// returns every done_sending id seen meanwhile, in order: a decode reports
// its load done before its notification reaches the prefill.
func (in *instance) waitSent(t testing.TB, r int, id string) []string {
	t.Helper()
	// wallclock: on real UDP (without o.sim) a generous scaled bound, so a lost notification fails the test instead of hanging it; virtual under synctest.
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(30*time.Second))
	defer cancel()
	var sent []string
	for !slices.Contains(sent, id) {
		f, err := in.ranks[r].WaitFinished(ctx)
		require.NoError(t, err, "rank %d waiting for %q in done_sending", r, id)
		sent = append(sent, f.DoneSending...)
	}
	return sent
}

func requireAllDone(t testing.TB, fails []*connector.FailedLoad) {
	t.Helper()
	for r, f := range fails {
		require.Nil(t, f, "rank %d failed: %v", r, func() error {
			if f == nil {
				return nil
			}
			return f.Err
		}())
	}
}

func name(p, d int) string { return fmt.Sprintf("P%d_D%d", p, d) }
