package e2e

import (
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// The leftovers of the engine boundary (issue 26): each test is the small
// input that used to end wrong, on real `kvsidecar serve` processes.

// TestBoundarySwappedRankExports: params whose rank_exports entries are
// swapped (rank 1's export under tp_rank 0 and rank 0's under tp_rank 1)
// fail the load with CODE_CAPABILITY_DENIED naming both ranks, not
// CODE_LEASE_EXPIRED with a message about a restart; no byte is read and
// neither lease is released, so the params as issued still load
// byte-exact.
//
// fault-matrix: swapped-rank-exports
func TestBoundarySwappedRankExports(t *testing.T) {
	env := NewEnv(t)
	preS := env.StartGroup(t, SidecarOpts{Engine: "pre-sw", Role: "prefill", TPSize: 2, Args: faultArgs()})
	pre := []*side{attachSide(t, preS[0], 1024), attachSide(t, preS[1], 1024)}
	dec := []*side{startSide(t, env, "dec-sw", 256, "--role", "decode")}
	const key = 21
	params, _ := exportGroup(t, pre, "req-sw", key, 3, nil)
	swapped := proto.Clone(params).(*v1.KVTransferParams)
	for _, e := range swapped.GetRankExports() {
		e.TpRank = 1 - e.GetTpRank()
	}
	dst, err := dec[0].e.Alloc(t.Context(), 3)
	require.NoError(t, err)
	dec[0].e.fill(t, 99, dst)
	f := dec[0].e.load(t, "swapped", dst, swapped)
	require.NotNil(t, f, "a load of swapped exports was reported done")
	require.Equal(t, v1.Code_CODE_CAPABILITY_DENIED, f.GetError().GetCode(), f.GetError().GetMessage())
	msg := f.GetError().GetMessage()
	require.Contains(t, msg, "was made by prefill rank 1, not by this rank 0")
	require.Contains(t, msg, "was made by prefill rank 0, not by this rank 1")
	require.NotContains(t, msg, "earlier process")
	dec[0].e.check(t, 99, dst)
	require.Zero(t, pre[0].Sidecar.Metric(t, "kvsidecar_transfer_bytes_total", `role="server"`), "nothing was served")
	require.NoError(t, dec[0].e.Free(t.Context(), dst))

	dst2 := loadGroup(t, dec, "as-issued", params)
	requireGroupDone(t, dec, "as-issued", key, dst2)
	for _, s := range pre {
		s.waitSent(t, "req-sw", 30*time.Second)
		s.requireIdle(t)
	}
	dec[0].requireIdle(t)
}

// TestBoundaryExportWithdrawn: a second RequestFinished of an exported
// request with an error status withdraws the export at once: the prefill
// reports the request in done_sending and holds no lease (it held it for
// its whole TTL before), and a decode loading the params fails with
// CODE_LEASE_EXPIRED saying it was withdrawn, no byte read.
//
// fault-matrix: export-withdrawn
func TestBoundaryExportWithdrawn(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre-wd", 256, "--role", "prefill", "--lease-ttl", "10m")
	dec := startSide(t, env, "dec-wd", 256, "--role", "decode")
	p := pre.export(t, "req-wd", 3, 2)
	require.Equal(t, uint64(1), pre.Stats(t)["leases_held"])
	out, err := pre.e.RequestFinished(t.Context(), "req-wd", p.GetRemoteBlockIds(), v1.FinishStatus_FINISH_STATUS_ERROR, &v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	require.Nil(t, out, "an error finish keeps nothing")
	pre.waitSent(t, "req-wd", 30*time.Second)
	require.Zero(t, pre.Stats(t)["leases_held"], "the lease ended now, not at its 10m TTL")
	l := pre.WaitLog(t, "export withdrawn", 10*time.Second)
	require.Equal(t, "FINISH_STATUS_ERROR", l["status"])

	dst, err := dec.e.Alloc(t.Context(), 2)
	require.NoError(t, err)
	dec.e.fill(t, 9, dst)
	f := dec.e.load(t, "dec-wd", dst, p)
	require.NotNil(t, f)
	require.Equal(t, v1.Code_CODE_LEASE_EXPIRED, f.GetError().GetCode(), f.GetError().GetMessage())
	require.Contains(t, f.GetError().GetMessage(), "withdrawn by the engine (RequestFinished with status FINISH_STATUS_ERROR)")
	dec.e.check(t, 9, dst)
	require.NoError(t, dec.e.Free(t.Context(), dst))
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestBoundaryEditedBlockIDsNotifyNothing: params whose block ids were
// edited fail the load with one code each: a block of the prefill that the
// export does not hold is refused by the prefill before any byte
// (CODE_CAPABILITY_DENIED naming the block), one beyond its regions is
// found by the decode against the prefill's num_blocks
// (CODE_INVALID_ARGUMENT naming the field). The prefill serves 0 bytes, the
// decode blocks keep their bytes, and the decode does not notify the
// prefill: the export's lease is still held, so the params as issued load
// byte-exact afterwards (the edited load used to end the lease).
//
// fault-matrix: edited-block-ids
func TestBoundaryEditedBlockIDsNotifyNothing(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre-ed", 256, "--role", "prefill")
	dec := startSide(t, env, "dec-ed", 256, "--role", "decode")
	const key = 12
	p := pre.export(t, "req-ed", key, 2)
	other, err := pre.e.Alloc(t.Context(), 1)
	require.NoError(t, err)
	for _, tc := range []struct {
		name   string
		id     uint32
		code   v1.Code
		reason string
		msg    string
	}{
		{"a block the export does not hold", other[0], v1.Code_CODE_CAPABILITY_DENIED, "",
			"block " + strconv.Itoa(int(other[0])) + ` is not in request "req-ed"'s export`},
		{"a block beyond the regions", 5000, v1.Code_CODE_INVALID_ARGUMENT, string(codes.ReasonParamsOutOfRange),
			"kv_transfer_params: remote_block_ids[1]=5000: outside [1, 256) of prefill rank 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			edited := proto.Clone(p).(*v1.KVTransferParams)
			edited.RemoteBlockIds[1] = tc.id
			dst, err := dec.e.Alloc(t.Context(), 2)
			require.NoError(t, err)
			dec.e.fill(t, 9, dst)
			f := dec.e.load(t, "edited", dst, edited)
			require.NotNil(t, f, "a load of edited block ids was reported done")
			require.Equal(t, tc.code, f.GetError().GetCode(), f.GetError().GetMessage())
			require.Equal(t, tc.reason, f.GetError().GetReason(), f.GetError().GetMessage())
			require.Contains(t, f.GetError().GetMessage(), tc.msg)
			require.ElementsMatch(t, dst, f.GetBlockIds(), "every local block is reported for recompute")
			dec.e.check(t, 9, dst)
			require.NoError(t, dec.e.Free(t.Context(), dst))
			require.Equal(t, uint64(1), pre.Stats(t)["leases_held"], "the edited params ended no lease")
			require.Zero(t, pre.Sidecar.Metric(t, "kvsidecar_transfer_bytes_total", `role="server"`), "the prefill served 0 bytes")
			require.Zero(t, dec.Sidecar.Metric(t, "kvsidecar_transfer_bytes_total"), "the decode read 0 bytes")
		})
	}
	require.Zero(t, pre.Sidecar.Metric(t, "kvsidecar_transfer_notifications_total"), "no notification reached the prefill")
	dst := dec.load(t, "as-issued", p)
	dec.requireDone(t, "as-issued", key, dst)
	pre.waitSent(t, "req-ed", 30*time.Second)
	dec.free(t, dst)
	pre.free(t, other)
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestBoundaryForeignCADecodeRefusesFirst: a decode whose certificate and
// --tls-ca come from another CA refuses the prefill's certificate before
// it sends its own. The refusing side, the decode, logs it ("transfer:
// refused a peer's TLS handshake" with the prefill's address and the
// reason unknown_authority) and counts it by reason (it logged nothing);
// the prefill, refused, counts no wrong reason (no_certificate); the load
// fails naming the refusal, one dial per request. (The refusal the prefill
// makes when the decode trusts it: TestForeignCAPeerRefusedOnce.)
//
// fault-matrix: foreign-ca-both-sides
func TestBoundaryForeignCADecodeRefusesFirst(t *testing.T) {
	env := NewEnv(t)
	pre := env.StartSidecar(t, SidecarOpts{Engine: "prefill-fc", Role: "prefill", Args: geomFlags})
	foreign := foreignTLS(t, env, "decode-fc-tp0")
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-fc", Role: "decode", Args: geomFlags, TLS: &foreign})
	pe, de := attach(t, pre, 256), attach(t, dec, 256)
	dst, err := de.Alloc(t.Context(), 2)
	require.NoError(t, err)
	for req := 1; req <= 2; req++ {
		id := "req-fc-" + strconv.Itoa(req)
		_, p := prefillRequest(t, pe, id, uint64(req), 2)
		failed := de.load(t, id, dst, p)
		require.NotNil(t, failed, "the load must fail")
		require.Equal(t, v1.Code_CODE_UNAVAILABLE, failed.GetError().GetCode(), failed.GetError().GetMessage())
		require.Contains(t, failed.GetError().GetMessage(), "certificate signed by unknown authority")
		require.InDelta(t, float64(req), dec.Metric(t, "kvsidecar_transfer_tls_refused_total", `reason="unknown_authority"`), 0,
			"the refusing decode counts each refusal by reason")
		require.InDelta(t, float64(req), dec.Metric(t, "kvsidecar_transfer_dials_total"), 0, "one attempt per request")
	}
	refused := dec.WaitLog(t, "transfer: refused a peer's TLS handshake", StartTimeout)
	require.Equal(t, "unknown_authority", refused["reason"])
	require.Equal(t, "WARN", refused["level"])
	require.Equal(t, pre.QUICAddr(t), refused["peer"], "the prefill's address")
	require.Zero(t, pre.Metric(t, "kvsidecar_transfer_tls_refused_total", `reason="no_certificate"`), "the prefill names no wrong reason")
	require.Zero(t, pre.Metric(t, "kvsidecar_transfer_bytes_total"), "nothing was served")
}

// TestBoundaryDecodeDrainKeepsResults: a decode sidecar SIGTERMed while it
// loads finishes the load, then keeps its local socket and pages until the
// engine collected the result and freed the blocks: the engine, calling
// GetFinished only after the drain finished, gets the request done and
// every byte right, and the sidecar exits 0 once it freed them (it closed
// the socket before the engine could read done_recving).
//
// fault-matrix: decode-drain-results
func TestBoundaryDecodeDrainKeepsResults(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre-dd", 8192, "--role", "prefill")
	dec := startSide(t, env, "dec-dd", 8192, "--role", "decode", "--drain-timeout", flagDur(60*time.Second))
	warm(t, pre, dec)
	const key = 17
	p := pre.export(t, "req-dd", key, bigBlocks)
	before := served(t, pre.Sidecar)
	dst := dec.load(t, "dec-dd", p)
	requireServing(t, pre.Sidecar, before)
	dec.Signal(t, syscall.SIGTERM)
	drained := dec.WaitLog(t, "drain finished", 60*time.Second)
	require.Equal(t, float64(1), drained["loads_finished"], "the drain let the load finish")
	f := dec.outcome(t, "dec-dd", 30*time.Second)
	require.Nil(t, f, "the load finished: %v", f.GetError())
	dec.e.check(t, key, dst)
	require.False(t, dec.Exited(), "the sidecar waits for the engine to free the loaded blocks")
	dec.free(t, dst)
	require.Zero(t, dec.Wait(t, ExitTimeout), "the decode exits 0 once the engine collected its results")
	pre.waitSent(t, "req-dd", 30*time.Second)
	pre.requireIdle(t)
}
