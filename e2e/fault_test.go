package e2e

import (
	"context"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// The faults between prefill and decode of docs/fault-matrix.md
// (prefill-across-nodes is in netns_test.go). Every test runs real
// `kvsidecar serve` processes on loopback, drives them through Go engines on
// their local sockets, injects the fault with a signal, a flag, ctl or a
// peer in the test process, and ends with the "nothing lost" checks: no
// request reported done whose bytes differ, and every surviving sidecar back
// at its idle page count with no lease and no load left (processes are
// killed by t.Cleanup).

// Fault-matrix timings, all scaled by KVSIDECAR_TIME_SCALE.
const (
	// progress is --progress-timeout of every sidecar here.
	progress = time.Second
	// slack covers process scheduling on a loaded 2-core machine, added
	// to every deadline the product promises.
	slack = 5 * time.Second
	// bigBlocks make a READ of 4000 × 64 KiB = 250 MiB, long enough to
	// inject a fault while it runs.
	bigBlocks = 4000
)

// flagDur formats a scaled duration for the command line.
func flagDur(d time.Duration) string { return testutil.Scaled(d).String() }

// faultArgs are the serve flags of every sidecar of the fault matrix,
// followed by extra.
func faultArgs(extra ...string) []string {
	return append(append(slices.Clone(geomFlags), "--progress-timeout", flagDur(progress)), extra...)
}

// side is one sidecar with its engine and its idle page count.
type side struct {
	*Sidecar
	e *engine
	// idlePages is pages_mapped right after the engine attached, once the
	// reserve filled (engine.settledPages).
	idlePages uint64
	// What GetFinished reported so far (each call returns only what is
	// new): done_sending, done_recving and failed by request id.
	sent, recv map[string]time.Time
	failed     map[string]*v1.FailedRequest
}

func startSide(t testing.TB, env *Env, name string, blocks uint32, args ...string) *side {
	t.Helper()
	s := env.StartSidecar(t, SidecarOpts{Engine: name, Args: faultArgs(args...)})
	return attachSide(t, s, blocks)
}

func attachSide(t testing.TB, s *Sidecar, blocks uint32) *side {
	t.Helper()
	e := attach(t, s, blocks)
	sd := newSide(s, e)
	sd.idlePages = e.settledPages(t)
	return sd
}

// newSide is a side of an attached engine, its idle page count not set.
func newSide(s *Sidecar, e *engine) *side {
	return &side{Sidecar: s, e: e, sent: map[string]time.Time{}, recv: map[string]time.Time{}, failed: map[string]*v1.FailedRequest{}}
}

// requireIdle is the "nothing lost" check of one surviving sidecar: no
// block used, no lease, no load, pages mapped back to the idle level.
func (s *side) requireIdle(t testing.TB) {
	t.Helper()
	st := s.Stats(t)
	require.Zero(t, st["blocks_used"], "%s: blocks used", s.Name)
	require.Zero(t, st["leases_held"], "%s: leases held", s.Name)
	require.Zero(t, st["loads_in_flight"], "%s: loads in flight", s.Name)
	s.e.requirePages(t, s.idlePages, "%s: pages mapped back to the idle level", s.Name)
}

// export allocates n blocks on prefill, fills them with key's KV and
// finishes request id with do_remote_decode; it returns the params as the
// proxy forwards them (through JSON).
func (s *side) export(t testing.TB, id string, key uint64, n int) *v1.KVTransferParams {
	t.Helper()
	src, err := s.e.Alloc(t.Context(), n)
	require.NoError(t, err)
	s.e.fill(t, key, src)
	p, err := s.e.RequestFinished(t.Context(), id, src, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	js, err := connector.MarshalKVTransferParams(p)
	require.NoError(t, err)
	p, err = connector.UnmarshalKVTransferParams(js)
	require.NoError(t, err)
	return p
}

// load allocates len(remote_block_ids) blocks on decode and starts loading
// params into them.
func (s *side) load(t testing.TB, id string, params *v1.KVTransferParams) []uint32 {
	t.Helper()
	dst, err := s.e.Alloc(t.Context(), len(params.GetRemoteBlockIds()))
	require.NoError(t, err)
	require.NoError(t, s.e.StartLoad(t.Context(), &v1.ReqMeta{RequestId: id, LocalBlockIds: dst, Params: params, RemoteHitBlocks: new(uint32(0))}))
	return dst
}

// poll calls GetFinished (as an engine's scheduler loop does) until done
// accepts what has arrived so far, or fails the test after timeout
// (scaled).
func (s *side) poll(t testing.TB, timeout time.Duration, what string, done func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(timeout))
	defer cancel()
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for {
		f, err := s.e.GetFinished(ctx)
		if ctx.Err() != nil {
			t.Fatalf("%s: %s not reported within %v", s.Name, what, testutil.Scaled(timeout))
		}
		require.NoError(t, err)
		now := time.Now()
		for _, id := range f.GetDoneSending() {
			s.sent[id] = now
		}
		for _, id := range f.GetDoneRecving() {
			s.recv[id] = now
		}
		for _, fr := range f.GetFailed() {
			s.failed[fr.GetRequestId()] = fr
		}
		if done() {
			return
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
}

// outcome waits for request id on decode and returns nil when it is done
// or its failure.
func (s *side) outcome(t testing.TB, id string, timeout time.Duration) *v1.FailedRequest {
	t.Helper()
	s.poll(t, timeout, "the outcome of "+id, func() bool {
		_, done := s.recv[id]
		return done || s.failed[id] != nil
	})
	_, done := s.recv[id]
	require.False(t, done && s.failed[id] != nil, "request %s both done and failed", id)
	return s.failed[id]
}

// requireDone waits until request id is done on decode and checks every
// byte of dst against key.
func (s *side) requireDone(t testing.TB, id string, key uint64, dst []uint32) {
	t.Helper()
	f := s.outcome(t, id, 30*time.Second)
	require.Nil(t, f, "request %s failed: %v", id, f.GetError())
	s.e.check(t, key, dst)
}

// requireFailed waits for request id to fail on decode and checks that it
// carries a code and exactly the local blocks dst for recompute.
func (s *side) requireFailed(t testing.TB, id string, dst []uint32, timeout time.Duration) *v1.FailedRequest {
	t.Helper()
	f := s.outcome(t, id, timeout)
	require.NotNil(t, f, "request %s was reported done", id)
	require.NotEqual(t, v1.Code_CODE_OK, f.GetError().GetCode(), "a failure carries a code")
	require.ElementsMatch(t, dst, f.GetBlockIds(), "every local block is reported for recompute")
	return f
}

// waitSent waits until prefill reports request id in done_sending (its
// blocks are freed) and returns when it saw it.
func (s *side) waitSent(t testing.TB, id string, timeout time.Duration) time.Time {
	t.Helper()
	s.poll(t, timeout, id+" in done_sending", func() bool { _, ok := s.sent[id]; return ok })
	return s.sent[id]
}

// served is how many transfers s has finished serving (every op and
// result): sample it before a load starts and pass it to waitServing.
func served(t testing.TB, s *Sidecar) float64 {
	t.Helper()
	return s.Metric(t, "kvsidecar_transfer_xfers_total", `role="server"`)
}

// waitServing waits until s serves a READ and reports true once its
// in-flight transfer bytes are non-zero; it reports false when s finished
// serving more transfers than before (served, sampled before the load
// started) first: the whole READ ran between two looks, as a fast path on
// a loaded machine can. No event says so, so /metrics is polled with a
// deadline.
func waitServing(t testing.TB, s *Sidecar, before float64) bool {
	t.Helper()
	deadline := time.After(testutil.Scaled(30 * time.Second))
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for s.Metric(t, "kvsidecar_transfer_inflight_bytes") == 0 {
		if served(t, s) > before {
			return false
		}
		select {
		case <-deadline:
			t.Fatalf("%s never served a READ", s.Name)
		case <-tick.C:
		}
	}
	return true
}

// requireServing is waitServing for a test that injects a fault into the
// running READ: one that ended before it was seen fails at once, naming
// why, instead of at the deadline.
func requireServing(t testing.TB, s *Sidecar, before float64) {
	t.Helper()
	require.True(t, waitServing(t, s, before), "%s served the whole READ before it was seen running", s.Name)
}

// free frees blocks on an engine.
func (s *side) free(t testing.TB, ids []uint32) {
	t.Helper()
	require.NoError(t, s.e.Free(t.Context(), ids))
}

// warm runs one small request so that the decode→prefill connection and
// handshake are cached and the next load starts its READ at once.
func warm(t testing.TB, pre, dec *side) {
	t.Helper()
	p := pre.export(t, "warm", 1, 2)
	dst := dec.load(t, "warm", p)
	dec.requireDone(t, "warm", 1, dst)
	dec.free(t, dst)
	pre.waitSent(t, "warm", 30*time.Second)
}

// TestFaultPrefillKilledMidRead: prefill SIGKILLed while decode READs from
// it → decode reports the request failed with its local block ids within the
// progress deadline.
//
// fault-matrix: prefill-killed-mid-read
// fault-matrix: same-host-read-stopped
// fault-matrix: same-host-nothing-left-mapped
func TestFaultPrefillKilledMidRead(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 8192)
	dec := startSide(t, env, "dec", 8192)
	warm(t, pre, dec)
	RequirePath(t, dec.Sidecar)
	inodes := MemfdInodes(t, pre.Cmd.Process.Pid)

	p := pre.export(t, "big", 3, bigBlocks)
	before := served(t, pre.Sidecar)
	dst := dec.load(t, "big", p)
	requireServing(t, pre.Sidecar, before)
	pre.Kill(t)
	start := time.Now()
	f := dec.requireFailed(t, "big", dst, progress+slack)
	require.Less(t, time.Since(start), testutil.Scaled(progress+slack))
	t.Logf("failed after %v with %v: %s", time.Since(start), f.GetError().GetCode(), f.GetError().GetMessage())
	// The peer is gone: none of its pages stays mapped in the decode, and
	// none of its files stays open there (its memory can go back).
	for _, ino := range inodes {
		maps, fds := HoldsInode(t, dec.Cmd.Process.Pid, ino)
		require.Zero(t, maps, "decode maps none of the dead prefill's pages")
		require.Zero(t, fds, "decode holds no file of the dead prefill")
	}

	dec.free(t, dst)
	dec.requireIdle(t)
}

// TestFaultDecodeKilledMidRead: decode SIGKILLed while it READs → prefill
// frees the blocks when the lease expires (the READ it served stops at its
// progress deadline and unpins the lease).
//
// fault-matrix: decode-killed-mid-read
func TestFaultDecodeKilledMidRead(t *testing.T) {
	const ttl = 2 * time.Second
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 8192, "--lease-ttl", flagDur(ttl))
	dec := startSide(t, env, "dec", 8192)
	warm(t, pre, dec)
	RequirePath(t, dec.Sidecar)

	start := time.Now()
	p := pre.export(t, "big", 3, bigBlocks)
	before := served(t, pre.Sidecar)
	dec.load(t, "big", p)
	requireServing(t, pre.Sidecar, before)
	dec.Kill(t)
	sent := pre.waitSent(t, "big", ttl+progress+slack)
	require.GreaterOrEqual(t, sent.Sub(start), testutil.Scaled(ttl), "not freed before the lease expired")
	require.Positive(t, pre.Metric(t, "kvsidecar_connector_leases_expired_total"), "freed by lease expiry")
	pre.requireIdle(t)
}

// TestFaultDecodeAbortMidRead: decode aborts while the READ runs → Abort
// returns only after the stream stopped, so blocks freed and allocated right
// after to another request get that request's bytes intact, and nothing of
// the aborted READ lands later.
//
// fault-matrix: decode-abort-mid-read
func TestFaultDecodeAbortMidRead(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 8192)
	dec := startSide(t, env, "dec", 8192)
	warm(t, pre, dec)
	RequirePath(t, dec.Sidecar)

	p := pre.export(t, "big", 3, bigBlocks)
	before := served(t, pre.Sidecar)
	dst := dec.load(t, "big", p)
	requireServing(t, pre.Sidecar, before)
	require.NoError(t, dec.e.Abort(t.Context(), "big"))
	if f := dec.outcome(t, "big", 30*time.Second); f != nil {
		require.Equal(t, v1.Code_CODE_ABORTED, f.GetError().GetCode(), f.GetError().GetMessage())
		require.ElementsMatch(t, dst, f.GetBlockIds())
	} else {
		t.Log("the READ finished before the abort")
	}
	// The engine reuses the blocks at once: half for its own KV, the
	// other half for the next request.
	dec.free(t, dst)
	mine, err := dec.e.Alloc(t.Context(), bigBlocks/2)
	require.NoError(t, err)
	dec.e.fill(t, 77, mine)
	p2 := pre.export(t, "next", 5, bigBlocks/2)
	dst2 := dec.load(t, "next", p2)
	freed := map[uint32]bool{}
	for _, b := range dst {
		freed[b] = true
	}
	reused := 0
	for _, b := range append(slices.Clone(mine), dst2...) {
		if freed[b] {
			reused++
		}
	}
	require.Positive(t, reused, "the freed blocks were reallocated")
	dec.requireDone(t, "next", 5, dst2)
	dec.e.check(t, 77, mine)

	pre.waitSent(t, "big", 30*time.Second)
	pre.waitSent(t, "next", 30*time.Second)
	dec.free(t, append(mine, dst2...))
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestFaultLeaseOrderWithHeartbeats: three leases; a consumer in the test
// process heartbeats A only → B and C are freed when their lease expires,
// not before and not much later; A outlives its first expiry and is still
// read intact.
//
// fault-matrix: lease-order-with-heartbeats
func TestFaultLeaseOrderWithHeartbeats(t *testing.T) {
	const ttl = 2 * time.Second
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 1024, "--lease-ttl", flagDur(ttl))
	dec := startSide(t, env, "dec", 1024)

	hb, err := transfer.New(&transfer.Config{ClientTLS: env.ClientTLS(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = hb.Close() })

	start := time.Now()
	pa := pre.export(t, "A", 11, 4)
	pre.export(t, "B", 12, 4)
	pre.export(t, "C", 13, 4)
	addr, err := connector.RankAddr(pa, 0)
	require.NoError(t, err)

	beat := func() {
		ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(ttl/4))
		defer cancel()
		ack, err := hb.Heartbeat(ctx, addr, &v1.Heartbeat{RequestIds: []string{"A", "B"}, ConsumerEngineId: "hb", ConsumerTpRank: 0,
			ExportIds:    []uint64{pa.GetRankExports()[0].GetExportId(), pa.GetRankExports()[0].GetExportId()},
			Capabilities: [][]byte{pa.GetRankExports()[0].GetCapability(), pa.GetRankExports()[0].GetCapability()}})
		require.NoError(t, err)
		require.Len(t, ack.GetLeaseExpiresUnixMs(), 2)
		require.Positive(t, ack.GetLeaseExpiresUnixMs()[0], "A's lease extended")
		require.Zero(t, ack.GetLeaseExpiresUnixMs()[1], "B is not extended by A's capability")
	}
	// Heartbeat A every ttl/4 until B and C are freed and A has lived
	// 1.5 × ttl.
	sent := map[string]time.Duration{}
	tick := time.NewTicker(testutil.Scaled(ttl / 4))
	defer tick.Stop()
	beat()
	deadline := time.After(testutil.Scaled(ttl + slack))
	for len(sent) < 2 || time.Since(start) < testutil.Scaled(ttl*3/2) {
		select {
		case <-tick.C:
			beat()
		case <-deadline:
			t.Fatalf("B and C not freed within the lease plus %v: %v", testutil.Scaled(slack), sent)
		}
		pre.poll(t, slack, "GetFinished", func() bool { return true })
		for _, id := range []string{"B", "C"} {
			if at, ok := pre.sent[id]; ok {
				sent[id] = at.Sub(start)
			}
		}
		require.NotContains(t, pre.sent, "A", "A is heartbeated")
	}
	for _, id := range []string{"B", "C"} {
		require.GreaterOrEqual(t, sent[id], testutil.Scaled(ttl), "%s freed before its lease expired", id)
	}
	t.Logf("freed after %v (lease %v)", sent, testutil.Scaled(ttl))

	dst := dec.load(t, "A", pa)
	dec.requireDone(t, "A", 11, dst)
	pre.waitSent(t, "A", 30*time.Second)
	dec.free(t, dst)
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestFaultUnknownOrExpired: a READ or a notification for a request the
// prefill does not hold (never existed, or its lease expired) is answered
// with an error, and decode reports the load failed, never done with stale
// bytes.
//
// fault-matrix: unknown-or-expired-export
func TestFaultUnknownOrExpired(t *testing.T) {
	const ttl = time.Second
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 1024, "--lease-ttl", flagDur(ttl))
	dec := startSide(t, env, "dec", 1024)

	expired := pre.export(t, "expired", 21, 4)
	pre.waitSent(t, "expired", ttl+slack)
	unknown := pre.export(t, "held", 22, 4)
	unknown.RemoteRequestId = "never-finished"

	tests := []struct {
		name   string
		params *v1.KVTransferParams
		local  bool // false: full prefix hit, notify only
		codes  []v1.Code
	}{
		{"READ of an expired lease", expired, true, []v1.Code{v1.Code_CODE_LEASE_EXPIRED, v1.Code_CODE_NOT_FOUND}},
		{"READ of an unknown request", unknown, true, []v1.Code{v1.Code_CODE_NOT_FOUND, v1.Code_CODE_CAPABILITY_DENIED}},
		{"notify of an expired lease", expired, false, []v1.Code{v1.Code_CODE_LEASE_EXPIRED, v1.Code_CODE_NOT_FOUND}},
		{"notify of an unknown request", unknown, false, []v1.Code{v1.Code_CODE_NOT_FOUND, v1.Code_CODE_CAPABILITY_DENIED}},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			id := "r" + strconv.Itoa(i)
			var dst []uint32
			if tc.local {
				var err error
				dst, err = dec.e.Alloc(t.Context(), len(tc.params.GetRemoteBlockIds()))
				require.NoError(t, err)
				dec.e.fill(t, 99, dst)
			}
			require.NoError(t, dec.e.StartLoad(t.Context(), &v1.ReqMeta{RequestId: id, LocalBlockIds: dst, Params: tc.params, RemoteHitBlocks: new(uint32(0))}))
			f := dec.requireFailed(t, id, dst, 30*time.Second)
			require.Contains(t, tc.codes, f.GetError().GetCode(), f.GetError().GetMessage())
			if tc.local {
				dec.e.check(t, 99, dst) // nothing was written into the blocks
				dec.free(t, dst)
			}
		})
	}
	pre.waitSent(t, "held", ttl+slack)
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestFaultFullPrefixHit: decode holds every block already → notify only;
// the request finishes on decode and prefill frees its blocks without a byte
// read.
//
// fault-matrix: prefix-hit
func TestFaultFullPrefixHit(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 1024)
	dec := startSide(t, env, "dec", 1024)
	p := pre.export(t, "hit", 31, 8)
	require.NoError(t, dec.e.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "hit", Params: p}))
	require.Nil(t, dec.outcome(t, "hit", 30*time.Second))
	pre.waitSent(t, "hit", 30*time.Second)
	require.Zero(t, dec.Metric(t, "kvsidecar_connector_read_bytes_total"), "nothing read")
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestFaultPrefillRestart: prefill SIGKILLed and started again on the same
// address (new incarnation) → decode's next request handshakes again and
// succeeds.
//
// fault-matrix: prefill-restart-same-port
func TestFaultPrefillRestart(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 1024)
	dec := startSide(t, env, "dec", 1024)
	p1 := pre.export(t, "a", 41, 4)
	dst := dec.load(t, "a", p1)
	dec.requireDone(t, "a", 41, dst)
	dec.free(t, dst)
	hs := dec.Metric(t, "kvsidecar_handshake_seconds_count")

	pre.Kill(t)
	pre2 := attachSide(t, env.Restart(t, pre.Sidecar), 1024)
	require.Equal(t, pre.QUICAddr(t), pre2.QUICAddr(t), "same address")
	p2 := pre2.export(t, "b", 42, 4)
	require.NotEqual(t, p1.GetRemoteIncarnation(), p2.GetRemoteIncarnation(), "a new incarnation")
	dst = dec.load(t, "b", p2)
	dec.requireDone(t, "b", 42, dst)
	require.Equal(t, hs+1, dec.Metric(t, "kvsidecar_handshake_seconds_count"), "decode handshaked again")
	pre2.waitSent(t, "b", 30*time.Second)
	dec.free(t, dst)
	pre2.requireIdle(t)
	dec.requireIdle(t)
}

// TestFaultPrefillStopped: prefill SIGSTOPped for longer than the progress
// deadline → decode fails the READ; after SIGCONT, nothing of the stale
// stream lands in reused blocks and later requests are intact.
//
// fault-matrix: prefill-stopped
func TestFaultPrefillStopped(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 8192)
	dec := startSide(t, env, "dec", 8192)
	warm(t, pre, dec)
	RequirePath(t, dec.Sidecar)

	p := pre.export(t, "big", 3, bigBlocks)
	before := served(t, pre.Sidecar)
	dst := dec.load(t, "big", p)
	requireServing(t, pre.Sidecar, before)
	pre.Signal(t, syscall.SIGSTOP)
	start := time.Now()
	f := dec.requireFailed(t, "big", dst, progress+slack)
	require.Less(t, time.Since(start), testutil.Scaled(progress+slack))
	require.Equal(t, v1.Code_CODE_TIMEOUT, f.GetError().GetCode(), f.GetError().GetMessage())
	// Resume the prefill at once: the decode's notification for the failed
	// load is sent right after the failure and gives up after its own
	// deadline; filling 4000 blocks first took longer than that on a loaded
	// machine, the notification was lost and "big" stayed leased for the
	// whole lease TTL. The engine then reuses the blocks while a late byte
	// of the old READ could still arrive.
	pre.Signal(t, syscall.SIGCONT)
	dec.e.fill(t, 88, dst) // the engine reuses the blocks

	p2 := pre.export(t, "after", 6, 64)
	dst2 := dec.load(t, "after", p2)
	dec.requireDone(t, "after", 6, dst2)
	dec.e.check(t, 88, dst)
	pre.waitSent(t, "big", 30*time.Second)
	pre.waitSent(t, "after", 30*time.Second)
	dec.free(t, append(dst, dst2...))
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestFaultMemoryLimitUnderLoad: decode's memory limit lowered with ctl
// while a READ fills its blocks → a further allocation fails cleanly
// (CODE_BUSY), the READ in flight completes intact, and raising the limit
// lets requests through again.
//
// fault-matrix: memory-limit-under-load
func TestFaultMemoryLimitUnderLoad(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 8192)
	dec := startSide(t, env, "dec", 8192)
	warm(t, pre, dec)
	RequirePath(t, dec.Sidecar)

	p := pre.export(t, "big", 3, bigBlocks)
	before := served(t, pre.Sidecar)
	dst := dec.load(t, "big", p)
	requireServing(t, pre.Sidecar, before)
	code, out, errOut := dec.Ctl(t, "limit", "8MiB")
	require.Zero(t, code, "stdout %q stderr %q", out, errOut)
	_, err := dec.e.Alloc(t.Context(), 1024)
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err), "an allocation beyond the limit fails over limit: %v", err)
	dec.requireDone(t, "big", 3, dst)

	code, out, errOut = dec.Ctl(t, "limit", "100%")
	require.Zero(t, code, "stdout %q stderr %q", out, errOut)
	p2 := pre.export(t, "after", 4, 1024)
	dst2 := dec.load(t, "after", p2)
	dec.requireDone(t, "after", 4, dst2)
	pre.waitSent(t, "big", 30*time.Second)
	pre.waitSent(t, "after", 30*time.Second)
	dec.free(t, append(dst, dst2...))
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestFaultCoordinatedMapRollback: a TP group of four ranks in coordinated
// ownership; rank 2's memory limit is lowered with ctl so it cannot map
// another page → an allocation on rank 0 fails and every rank is back at the
// pages it had; raising the limit lets it succeed on all.
//
// fault-matrix: coordinated-map-rollback
func TestFaultCoordinatedMapRollback(t *testing.T) {
	env := NewEnv(t)
	ranks := env.StartGroup(t, SidecarOpts{Engine: "coord", TPSize: 4, Args: faultArgs("--ownership", "coordinated")})
	// Followers first: rank 0 maps on every follower from its first page.
	sides := make([]*side, len(ranks))
	for r := len(ranks) - 1; r >= 0; r-- {
		sides[r] = newSide(ranks[r], attach(t, ranks[r], 4096))
	}
	// Once rank 0's reserve filled, its pages are mapped on every rank.
	sides[0].e.settledPages(t)
	for _, s := range sides {
		s.idlePages = s.Stats(t)["pages_mapped"]
	}
	info := sides[0].e.info
	perPage := int(info.GetPageSize() / info.GetBlockLen())
	held, err := sides[0].e.Alloc(t.Context(), perPage) // one page of blocks on every rank
	require.NoError(t, err)
	sides[0].e.settledPages(t) // the refill replaced the reserve page the blocks took
	before := make([]uint64, len(ranks))
	for r, s := range sides {
		before[r] = s.Stats(t)["pages_mapped"]
	}
	require.Equal(t, before[0], before[2], "followers map what rank 0 maps")

	bytes := sides[2].Stats(t)["bytes_mapped"]
	code, out, errOut := ranks[2].Ctl(t, "limit", strconv.FormatUint(bytes, 10))
	require.Zero(t, code, "stdout %q stderr %q", out, errOut)
	_, err = sides[0].e.Alloc(t.Context(), 2*perPage)
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err), "rank 2 cannot map the pages: over its limit, as the engine's own limit would be: %v", err)
	require.ErrorContains(t, err, "rank 2")
	for r, s := range sides {
		require.Equal(t, before[r], s.Stats(t)["pages_mapped"], "rank %d rolled back", r)
	}

	code, out, errOut = ranks[2].Ctl(t, "limit", "100%")
	require.Zero(t, code, "stdout %q stderr %q", out, errOut)
	more, err := sides[0].e.Alloc(t.Context(), 2*perPage)
	require.NoError(t, err, "with the limit raised every rank maps")
	for r, s := range sides {
		require.Greater(t, s.Stats(t)["pages_mapped"], before[r], "rank %d mapped the new pages", r)
	}
	sides[0].free(t, append(held, more...))
	for _, s := range sides {
		s.e.requirePages(t, s.idlePages, "%s: pages back to idle", s.Name)
	}
	sides[0].requireIdle(t)
}

// TestFaultHandshakeNothingListening: params that point at an address where
// nothing listens → the load fails within the handshake deadline with an
// error naming the address.
//
// fault-matrix: handshake-nothing-listening
func TestFaultHandshakeNothingListening(t *testing.T) {
	env := NewEnv(t)
	dec := startSide(t, env, "dec", 1024)
	addr := FreeUDPAddrs(t, "127.0.0.1", 1)[0]
	p := &v1.KVTransferParams{DoRemotePrefill: true, RemoteEngineId: "ghost", RemoteRequestId: "r", RemoteBlockIds: []uint32{1, 2},
		TpSize: new(uint32(1)), RemoteRankAddrs: []string{addr}, RankExports: []*v1.RankExport{{ExportId: 1, Capability: []byte("x")}}}
	dst, err := dec.e.Alloc(t.Context(), 2)
	require.NoError(t, err)
	start := time.Now()
	require.NoError(t, dec.e.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "r", LocalBlockIds: dst, Params: p, RemoteHitBlocks: new(uint32(0))}))
	f := dec.requireFailed(t, "r", dst, transfer.DefaultHandshakeTimeout+slack)
	took := time.Since(start)
	require.Less(t, took, testutil.Scaled(transfer.DefaultHandshakeTimeout+slack))
	require.Contains(t, f.GetError().GetMessage(), addr, "the error names the address")
	t.Logf("failed after %v with %v: %s", took, f.GetError().GetCode(), f.GetError().GetMessage())
	dec.free(t, dst)
	dec.requireIdle(t)
}
