package e2e

import (
	"context"
	"crypto/tls"
	"math"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// prefillRequest allocates n blocks on the prefill engine, fills them with
// key's KV and finishes request id for remote decode; it returns the blocks
// and the kv_transfer_params the proxy would carry.
func prefillRequest(t testing.TB, pe *engine, id string, key uint64, n int) ([]uint32, *v1.KVTransferParams) {
	t.Helper()
	src, err := pe.Alloc(t.Context(), n)
	require.NoError(t, err)
	pe.fill(t, key, src)
	p, err := pe.RequestFinished(t.Context(), id, src, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	return src, p
}

// load runs StartLoad for params on the decode engine into dst and waits
// for the request to finish; it returns the failure, nil when done.
func (e *engine) load(t testing.TB, id string, dst []uint32, p *v1.KVTransferParams) *v1.FailedRequest {
	t.Helper()
	require.NoError(t, e.StartLoad(t.Context(), &v1.ReqMeta{RequestId: id, LocalBlockIds: dst, Params: p, RemoteHitBlocks: new(uint32(0))}))
	var failed *v1.FailedRequest
	done := false
	e.waitFinished(t, 30*time.Second, func(f *v1.GetFinishedReply) bool {
		for _, r := range f.GetDoneRecving() {
			done = done || r == id
		}
		for _, r := range f.GetFailed() {
			if r.GetRequestId() == id {
				failed = r
			}
		}
		return done || failed != nil
	})
	return failed
}

// stats reads the engine's sidecar stats.
func (e *engine) stats(t testing.TB) *v1.StatsReply {
	t.Helper()
	st, err := e.Stats(t.Context())
	require.NoError(t, err)
	return st
}

// settledPages is pages_mapped once the pool's background refill has
// filled its reserve (reserve_pages >= 1, vmm's default prealloc reserve):
// read earlier, the reserve page may land after the snapshot, and a later
// check against it would see one page more. Not for coordinated followers
// (they hold no reserve of their own; rank 0's refill maps their pages
// before it counts them in its reserve).
func (e *engine) settledPages(t testing.TB) uint64 {
	t.Helper()
	deadline := time.Now().Add(testutil.Scaled(30 * time.Second))
	for {
		st := e.stats(t)
		if st.GetReservePages() >= 1 {
			return st.GetPagesMapped()
		}
		if time.Now().After(deadline) {
			t.Fatalf("the reserve never filled: %v", st)
		}
		time.Sleep(time.Millisecond) // wallclock: e2e polls the real sidecar's stats
	}
}

// requirePages waits until pages_mapped is want: a refill that ran while
// blocks were in use may still be trimming back to the reserve when the
// last Free returns.
func (e *engine) requirePages(t testing.TB, want uint64, msgAndArgs ...any) {
	t.Helper()
	waitEqual(t, 30*time.Second, want, func() uint64 { return e.stats(t).GetPagesMapped() }, msgAndArgs...)
}

// waitSent polls the prefill engine until every id is in done_sending.
func (e *engine) waitSent(t testing.TB, timeout time.Duration, ids ...string) {
	t.Helper()
	want := make(map[string]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	e.waitFinished(t, timeout, func(f *v1.GetFinishedReply) bool {
		for _, id := range f.GetDoneSending() {
			delete(want, id)
		}
		return len(want) == 0
	})
}

// TestHostilePeer: a peer holding a valid certificate learns the prefill's
// regions through a real handshake and then sends descriptors outside the
// regions, overflowing, zero-length, for another request's blocks, with
// forged and tampered capabilities, and WRITEs into exported blocks. Each is
// refused with its code before any memory is touched (the served byte count
// moves only for the legitimate control READs), and the sidecar keeps
// serving: the same connection and a real decode sidecar read both requests
// byte-exact afterwards.
//
// fault-matrix: hostile-peer
func TestHostilePeer(t *testing.T) {
	env := NewEnv(t)
	pre := env.StartSidecar(t, SidecarOpts{Engine: "prefill-h", Role: "prefill", Args: geomFlags})
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-h", Role: "decode", Args: geomFlags})
	pe, de := attach(t, pre, 1024), attach(t, dec, 1024)
	preIdle, decIdle := pe.settledPages(t), de.settledPages(t)

	const keyA, keyB = 11, 12
	srcA, pa := prefillRequest(t, pe, "req-a", keyA, 4)
	srcB, pb := prefillRequest(t, pe, "req-b", keyB, 4)
	addr := rankAddr(pa)

	tlsConf := peerTLS(t, env, "hostile")
	md := peerHandshake(t, dialAgent(t, tlsConf, nil), addr, "prefill-h")
	require.Len(t, md.Regions, int(pe.info.GetNumRegions()))
	bl := md.Regions[0].BlockLen
	require.Equal(t, pe.info.GetBlockLen(), bl)
	lo, hi := uint64(math.MaxUint64), uint64(0)
	for _, r := range md.Regions {
		lo, hi = min(lo, r.Base), max(hi, r.Base+r.Len)
	}
	require.Greater(t, lo, bl, "room below the first region")

	raw := dialRaw(t, addr, tlsConf)
	a0, b0 := blockDesc(md, 0, srcA[0]), blockDesc(md, 0, srcB[0])
	ea, eb := pa.GetRankExports()[0], pb.GetRankExports()[0]
	exA, capA, exB := ea.GetExportId(), ea.GetCapability(), eb.GetExportId()
	control := func(t *testing.T) {
		t.Helper()
		rep := raw.send(t, readReq("req-a", exA, capA, a0), bl)
		require.Equal(t, v1.Code_CODE_OK, rep.Code, rep.Msg)
		require.Equal(t, bl, rep.Final.GetBytes())
		bad, first := kvgen.CheckBlock(rep.Data, shape, keyA, 0, 0)
		require.Zero(t, bad, "control READ: %d bytes differ, first at %d", bad, first)
	}
	t.Run("control before", control)

	// Prepared lists on the raw connection: list 2 holds A's block, list 3
	// B's block; both are inside the regions, so preparing them succeeds.
	prep := func(id uint64, d transfer.Desc) *v1.PeerRequest {
		return &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, Body: &v1.PeerRequest_Prep{
			Prep: &v1.PrepDescList{DlistId: id, Descs: descList(d)}}}
	}
	for id, d := range map[uint64]transfer.Desc{2: a0, 3: b0} {
		rep := raw.send(t, prep(id, d), 0)
		require.Equal(t, v1.Code_CODE_OK, rep.Code, rep.Msg)
	}
	indexed := func(list uint64, capab []byte, idx ...uint32) *v1.PeerRequest {
		return &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, Body: &v1.PeerRequest_Xfer{Xfer: &v1.XferRequest{
			Op: v1.XferOp_XFER_OP_READ, RequestId: "req-a", ExportId: exA, Capability: capab, TotalLen: bl * uint64(len(idx)),
			Descs: &v1.XferRequest_Indexed{Indexed: &v1.IndexedDescs{DlistId: list, Indices: idx}}}}}
	}
	with := func(req *v1.PeerRequest, f func(x *v1.XferRequest)) *v1.PeerRequest {
		f(req.GetXfer())
		return req
	}
	tampered := append([]byte(nil), capA...)
	tampered[len(tampered)-1] ^= 1
	forged := transfer.NewCapabilityKey().IssueExport(transfer.ExportRef{RequestID: "req-b", ExportID: exB}, srcB)
	r0 := md.Regions[0]

	tests := []struct {
		name string
		req  *v1.PeerRequest
		code v1.Code
		msg  string
	}{
		{"past the last region", readReq("req-a", exA, capA, transfer.Desc{Addr: hi, Len: bl}), v1.Code_CODE_OUT_OF_RANGE, "not inside one registered region"},
		{"below the first region", readReq("req-a", exA, capA, transfer.Desc{Addr: lo - bl, Len: bl}), v1.Code_CODE_OUT_OF_RANGE, "not inside one registered region"},
		{"across a region's end", readReq("req-a", exA, capA, transfer.Desc{Addr: r0.Base + r0.Len - bl/2, Len: bl}), v1.Code_CODE_OUT_OF_RANGE, "not inside one registered region"},
		{"other device", readReq("req-a", exA, capA, transfer.Desc{Addr: a0.Addr, Len: bl, DevID: a0.DevID + 1}), v1.Code_CODE_OUT_OF_RANGE, "on device"},
		{"addr+len overflows", readReq("req-a", exA, capA, transfer.Desc{Addr: math.MaxUint64 - 10, Len: 100}), v1.Code_CODE_OUT_OF_RANGE, "overflows"},
		{"len overflows from a valid block", readReq("req-a", exA, capA, transfer.Desc{Addr: a0.Addr, Len: math.MaxUint64 - a0.Addr + 1}), v1.Code_CODE_OUT_OF_RANGE, "overflows"},
		{"valid block then out of range", readReq("req-a", exA, capA, a0, transfer.Desc{Addr: hi, Len: bl}), v1.Code_CODE_OUT_OF_RANGE, "descriptor 1"},
		{"zero length", readReq("req-a", exA, capA, transfer.Desc{Addr: a0.Addr, Len: 0}), v1.Code_CODE_INVALID_ARGUMENT, "length must be > 0"},
		{"no descriptors", readReq("req-a", exA, capA), v1.Code_CODE_INVALID_ARGUMENT, "names 0 descriptors"},
		{"total_len lies", with(readReq("req-a", exA, capA, a0), func(x *v1.XferRequest) { x.TotalLen = 1 }), v1.Code_CODE_INVALID_ARGUMENT, "total_len 1"},
		{"op unspecified", with(readReq("req-a", exA, capA, a0), func(x *v1.XferRequest) { x.Op = 0 }), v1.Code_CODE_INVALID_ARGUMENT, "neither READ nor WRITE"},
		{"WRITE into exported blocks", with(readReq("req-a", exA, capA, a0), func(x *v1.XferRequest) { x.Op = v1.XferOp_XFER_OP_WRITE }), v1.Code_CODE_CAPABILITY_DENIED, "not allowed"},
		{"blocks of B under A's export", readReq("req-a", exA, capA, b0), v1.Code_CODE_CAPABILITY_DENIED, `is not in request "req-a"'s export`},
		{"A's block plus one of B", readReq("req-a", exA, capA, a0, b0), v1.Code_CODE_CAPABILITY_DENIED, `is not in request "req-a"'s export`},
		{"A's export named for B", readReq("req-b", exA, capA, b0), v1.Code_CODE_CAPABILITY_DENIED, "belongs to another request"},
		{"A's capability presented for B's export", readReq("req-b", exB, capA, b0), v1.Code_CODE_CAPABILITY_DENIED, "not valid for export"},
		{"forged with another key", readReq("req-b", exB, forged, b0), v1.Code_CODE_CAPABILITY_DENIED, "not valid for export"},
		{"tampered tag", readReq("req-a", exA, tampered, a0), v1.Code_CODE_CAPABILITY_DENIED, "not valid for export"},
		{"malformed capability", readReq("req-a", exA, []byte("let me in"), a0), v1.Code_CODE_INVALID_ARGUMENT, "not an export capability"},
		{"no capability", readReq("req-a", exA, nil, a0), v1.Code_CODE_INVALID_ARGUMENT, "not an export capability"},
		{"no export named", readReq("req-a", 0, capA, a0), v1.Code_CODE_CAPABILITY_DENIED, "names no export"},
		{"unknown export", readReq("req-ghost", exA^0xffff, forged, a0), v1.Code_CODE_LEASE_EXPIRED, "req-ghost"},
		{"indexed: B's block under A's export", indexed(3, capA, 0), v1.Code_CODE_CAPABILITY_DENIED, `is not in request "req-a"'s export`},
		{"indexed: beyond the list", indexed(2, capA, 0, 5), v1.Code_CODE_OUT_OF_RANGE, "beyond descriptor list"},
		{"indexed: unprepared list", indexed(9, capA, 0), v1.Code_CODE_NOT_FOUND, "not prepared"},
		{"prepare outside regions", prep(4, transfer.Desc{Addr: hi, Len: bl}), v1.Code_CODE_OUT_OF_RANGE, "not inside one registered region"},
		{"prepare overflowing", prep(5, transfer.Desc{Addr: a0.Addr, Len: math.MaxUint64}), v1.Code_CODE_OUT_OF_RANGE, "overflows"},
		{"prepare zero length", prep(6, transfer.Desc{Addr: a0.Addr}), v1.Code_CODE_INVALID_ARGUMENT, "length must be > 0"},
		{"wire version 0", &v1.PeerRequest{Body: readReq("req-a", exA, capA, a0).GetBody()}, v1.Code_CODE_INCOMPATIBLE_MODEL, "wire version"},
	}
	failuresBefore := pre.Metric(t, "kvsidecar_transfer_failures_total")
	refusedXfers := 0
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rep := raw.send(t, tc.req, 0)
			require.Equal(t, tc.code, rep.Code, rep.Msg)
			require.Contains(t, rep.Msg, tc.msg)
			require.Nil(t, rep.Data)
		})
		if tc.req.GetXfer() != nil {
			refusedXfers++
		}
	}
	t.Run("control after", control)

	// Only the two control READs were served; every hostile transfer was
	// refused and counted (every refused transfer but the wrong wire
	// version by result too). The prefill counts a served READ once its
	// last write returned, which may be after the reader has it: waited for.
	pre.WaitMetric(t, "kvsidecar_transfer_bytes_total", float64(2*bl), `role="server"`)
	pre.WaitMetric(t, "kvsidecar_transfer_xfers_total", 2, `role="server"`, `result="ok"`)
	pre.WaitMetric(t, "kvsidecar_transfer_xfers_total", float64(refusedXfers-1), `role="server"`, `result="error"`)
	pre.WaitMetric(t, "kvsidecar_transfer_failures_total", failuresBefore+float64(refusedXfers))
	require.False(t, pre.Exited())
	// The refusing side says so: the first refusal of each code
	// is logged with the peer; repeats within 10 s are counted, not logged.
	for _, want := range []struct{ msg, code string }{
		{"transfer: refused a READ", "CODE_CAPABILITY_DENIED"},
		{"transfer: refused a READ", "CODE_OUT_OF_RANGE"},
		{"transfer: refused a descriptor list", "CODE_OUT_OF_RANGE"},
	} {
		found := false
		for _, l := range pre.Logs() {
			found = found || (l["msg"] == want.msg && l["code"] == want.code && l["level"] == "WARN" && l["peer"] != nil)
		}
		require.True(t, found, "the prefill logged %q with %s", want.msg, want.code)
	}

	// A real decode sidecar still gets both requests byte-exact.
	for _, r := range []struct {
		id  string
		key uint64
		p   *v1.KVTransferParams
	}{{"req-a", keyA, pa}, {"req-b", keyB, pb}} {
		dst, err := de.Alloc(t.Context(), len(srcA))
		require.NoError(t, err)
		failed := de.load(t, r.id, dst, r.p)
		require.Nil(t, failed, "load %s: %v", r.id, failed.GetError())
		de.check(t, r.key, dst)
		require.NoError(t, de.Free(t.Context(), dst))
	}
	pe.waitSent(t, 30*time.Second, "req-a", "req-b")

	// Nothing lost: no lease, no block, no page beyond the idle level.
	st := pe.stats(t)
	require.Zero(t, st.GetLeasesHeld())
	require.Zero(t, st.GetBlocksUsed())
	pe.requirePages(t, preIdle)
	st = de.stats(t)
	require.Zero(t, st.GetLoadsInFlight())
	require.Zero(t, st.GetBlocksUsed())
	de.requirePages(t, decIdle)
}

// TestUntrustedClient: a client whose certificate the configured CA did not
// sign, or with no certificate at all, cannot complete the QUIC handshake;
// nothing is served to it even with a valid capability in hand. A client
// certified by the CA, on the same sidecar, is answered (the control).
//
// fault-matrix: untrusted-client
func TestUntrustedClient(t *testing.T) {
	env := NewEnv(t)
	pre := env.StartSidecar(t, SidecarOpts{Engine: "prefill-u", Role: "prefill", Args: geomFlags})
	pe := attach(t, pre, 256)
	idle := pe.settledPages(t)
	src, p := prefillRequest(t, pe, "req-u", 3, 2)
	addr, e := rankAddr(p), p.GetRankExports()[0]
	good := peerTLS(t, env, "trusted")

	other, err := devtls.NewCA()
	require.NoError(t, err)
	otherCli, err := other.ClientConfig()
	require.NoError(t, err)
	foreign := good.Clone() // trusts the sidecar's CA, presents another CA's cert
	foreign.Certificates = otherCli.Certificates
	anonymous := good.Clone()
	anonymous.Certificates = nil

	// A plausible READ of the request's first block as a stolen-params
	// attacker would build it (local buffer of one block).
	local := make([]byte, pe.info.GetBlockLen())
	tests := []struct {
		name string
		tls  *tls.Config
	}{
		{"certificate from another CA", foreign},
		{"no certificate", anonymous},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := dialAgent(t, tc.tls, local)
			ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(20*time.Second))
			defer cancel()
			resp, err := a.Handshake(ctx, addr, &v1.HandshakeRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, ExpectedEngineId: "prefill-u", ExpectedTpSize: 1})
			require.Error(t, err)
			require.Nil(t, resp)
			require.NoError(t, ctx.Err(), "refused, not timed out")
			require.ErrorContains(t, err, "certificate", "the TLS alert says why")
			require.Equal(t, v1.Code_CODE_UNAVAILABLE, codes.Of(err), "%v", err)
			_, err = a.Transfer(ctx, &transfer.Xfer{Op: transfer.OpRead, Peer: addr, RequestID: "req-u", ExportID: e.GetExportId(), Capability: e.GetCapability(),
				Local: []transfer.Desc{{Addr: uint64(uintptr(unsafe.Pointer(&local[0]))), Len: uint64(len(local))}}, Remote: []transfer.Desc{{Addr: 1 << 40, Len: uint64(len(local))}}})
			require.Error(t, err)
			require.NoError(t, ctx.Err(), "refused, not timed out")
			require.Equal(t, make([]byte, len(local)), local, "no byte arrived")
		})
	}
	require.Zero(t, pre.Metric(t, "kvsidecar_transfer_xfers_total"), "nothing was served or even refused at the transfer layer")
	require.Zero(t, pre.Metric(t, "kvsidecar_transfer_bytes_total"))

	// The control: a certified client is served by the same sidecar, reads
	// the block byte-exact and releases the request with its notification.
	ca := dialAgent(t, good, local)
	md := peerHandshake(t, ca, addr, "prefill-u")
	require.Equal(t, "prefill-u", md.EngineID)
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(20*time.Second))
	defer cancel()
	_, err = ca.Transfer(ctx, &transfer.Xfer{Op: transfer.OpRead, Peer: addr, RequestID: "req-u", ExportID: e.GetExportId(), Capability: e.GetCapability(),
		Local: []transfer.Desc{{Addr: uint64(uintptr(unsafe.Pointer(&local[0]))), Len: uint64(len(local))}}, Remote: []transfer.Desc{blockDesc(md, 0, src[0])}})
	require.NoError(t, err)
	bad, first := kvgen.CheckBlock(local, shape, 3, 0, 0)
	require.Zero(t, bad, "%d bytes differ, first at %d", bad, first)
	require.NoError(t, ca.Notify(ctx, addr, &v1.Notification{RequestId: "req-u", ExportId: e.GetExportId(), Capability: e.GetCapability(),
		ConsumerEngineId: "trusted", ConsumerCount: 1}))
	pe.waitSent(t, 30*time.Second, "req-u")
	st := pe.stats(t)
	require.Zero(t, st.GetLeasesHeld())
	require.Zero(t, st.GetBlocksUsed())
	pe.requirePages(t, idle)
}

// TestBadParams: kv_transfer_params with a missing or mismatched tp_size,
// block ids out of range or an unknown engine id make the decode request
// fail with an error naming the field, and nothing is read: the prefill's
// served byte count does not move and the decode blocks keep what they held.
// Each case gets its own prefill request (a failed load still notifies the
// sources it reached, which frees theirs); leases nobody notifies expire
// after --lease-ttl.
//
// fault-matrix: bad-params
func TestBadParams(t *testing.T) {
	env := NewEnv(t)
	const ttl = 3 * time.Second
	pre := env.StartSidecar(t, SidecarOpts{Engine: "prefill-p", Role: "prefill",
		Args: append([]string{"--lease-ttl", testutil.Scaled(ttl).String()}, geomFlags...)})
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-p", Role: "decode", Args: geomFlags})
	pe, de := attach(t, pre, 1024), attach(t, dec, 1024)
	preIdle, decIdle := pe.settledPages(t), de.settledPages(t)
	const n, sentinel = 4, 99
	dst, err := de.Alloc(t.Context(), n)
	require.NoError(t, err)
	de.fill(t, sentinel, dst)

	tests := []struct {
		name string
		edit func(p *v1.KVTransferParams)
		// sync: StartLoad itself refuses; otherwise the load fails.
		sync  bool
		code  v1.Code
		field string
	}{
		{"tp_size missing", func(p *v1.KVTransferParams) { p.TpSize = nil }, true, v1.Code_CODE_INVALID_ARGUMENT, "tp_size"},
		{"tp_size zero", func(p *v1.KVTransferParams) { p.TpSize = new(uint32) }, true, v1.Code_CODE_INVALID_ARGUMENT, "tp_size=0"},
		{"tp_size mismatched", func(p *v1.KVTransferParams) {
			tp := uint32(2)
			p.TpSize = &tp
			p.RemoteRankAddrs = []string{rankAddr(p), rankAddr(p)}
			e := p.GetRankExports()[0]
			p.RankExports = append(p.RankExports, &v1.RankExport{TpRank: 1, ExportId: e.GetExportId(), Capability: e.GetCapability()})
		}, false, v1.Code_CODE_TP_MISMATCH, "tp_size=2"},
		{"remote_rank_addrs short", func(p *v1.KVTransferParams) {
			tp := uint32(2)
			p.TpSize = &tp
			p.RemoteRankAddrs = []string{rankAddr(p)}
		}, true, v1.Code_CODE_INVALID_ARGUMENT, "remote_rank_addrs"},
		{"remote block id beyond num_blocks", func(p *v1.KVTransferParams) { p.RemoteBlockIds[n-1] = 5000 }, false, v1.Code_CODE_INVALID_ARGUMENT, "remote_block_ids[3]=5000"},
		{"remote block id beyond the regions", func(p *v1.KVTransferParams) { p.RemoteBlockIds[0] = math.MaxUint32 }, false, v1.Code_CODE_INVALID_ARGUMENT, "remote_block_ids[0]=4294967295"},
		{"remote block id of no request", func(p *v1.KVTransferParams) { p.RemoteBlockIds[1] = 1000 }, false, v1.Code_CODE_CAPABILITY_DENIED, "is not in request"},
		{"remote_engine_id unknown", func(p *v1.KVTransferParams) { p.RemoteEngineId = "prefill-nope" }, false, v1.Code_CODE_NOT_FOUND, `remote_engine_id="prefill-nope"`},
		{"remote_engine_id missing", func(p *v1.KVTransferParams) { p.RemoteEngineId = "" }, true, v1.Code_CODE_INVALID_ARGUMENT, "remote_engine_id"},
		{"remote_request_id unknown", func(p *v1.KVTransferParams) { p.RemoteRequestId = "ghost" }, false, v1.Code_CODE_CAPABILITY_DENIED, "ghost"},
	}
	var ids []string
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			id := "bad-" + strconv.Itoa(i)
			ids = append(ids, id)
			_, p := prefillRequest(t, pe, id, uint64(100+i), n)
			tc.edit(p)
			served := pre.Metric(t, "kvsidecar_transfer_bytes_total", `role="server"`)
			meta := &v1.ReqMeta{RequestId: id, LocalBlockIds: dst, Params: p, RemoteHitBlocks: new(uint32(0))}
			if tc.sync {
				err := de.StartLoad(t.Context(), meta)
				require.Equal(t, tc.code, codes.Of(err), "%v", err)
				require.ErrorContains(t, err, tc.field)
			} else {
				failed := de.load(t, id, dst, p)
				require.NotNil(t, failed, "the load must fail")
				require.Equal(t, tc.code, failed.GetError().GetCode(), failed.GetError().GetMessage())
				require.Contains(t, failed.GetError().GetMessage(), tc.field)
				require.ElementsMatch(t, dst, failed.GetBlockIds(), "every local block is reported for recompute")
			}
			require.Equal(t, served, pre.Metric(t, "kvsidecar_transfer_bytes_total", `role="server"`), "nothing was read")
			de.check(t, sentinel, dst)
		})
	}
	require.Zero(t, dec.Metric(t, "kvsidecar_transfer_bytes_total"), "decode read nothing at all")

	// The same sidecars serve good params afterwards.
	_, p := prefillRequest(t, pe, "good", 7, n)
	require.Nil(t, de.load(t, "good", dst, p))
	de.check(t, 7, dst)
	require.NoError(t, de.Free(t.Context(), dst))

	// Nothing lost: every prefill request is released (notified or its
	// lease expired), and no block, page or load is left.
	pe.waitSent(t, ttl+30*time.Second, append(ids, "good")...)
	st := pe.stats(t)
	require.Zero(t, st.GetLeasesHeld())
	require.Zero(t, st.GetBlocksUsed())
	pe.requirePages(t, preIdle)
	st = de.stats(t)
	require.Zero(t, st.GetLoadsInFlight())
	require.Zero(t, st.GetBlocksUsed())
	de.requirePages(t, decIdle)
}
