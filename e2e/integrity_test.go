package e2e

import (
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Data integrity at the engine boundary (the rows of docs/fault-matrix.md
// under "The engine boundary"). Every READ, notification and heartbeat names
// one export of one rank; these tests drive real `kvsidecar serve` processes
// through Go engines on their local sockets with the small inputs that used
// to report wrong KV as done.

// heads is the kvgen shape of rank r of a TP group of size tp (8 KV heads).
func heads(r, tp int) kvgen.Shape {
	n := 8 / tp
	return kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: r * n, Heads: n}
}

// checkAt verifies that blocks[k] holds token block first+k of key's KV
// (shape s).
func (e *engine) checkAt(t testing.TB, s kvgen.Shape, key uint64, blocks []uint32, first int) {
	t.Helper()
	for r := range int(e.info.GetNumRegions()) {
		for k, id := range blocks {
			b, err := e.Block(r, int(id))
			require.NoError(t, err)
			bad, at := kvgen.CheckBlock(b, s, key, r, (first+k)*16)
			require.Zero(t, bad, "region %d block %d (token block %d): %d bytes differ, first at %d", r, id, first+k, bad, at)
		}
	}
}

// exportGroup allocates n blocks on every prefill rank, lets order put
// rank r's ids in token order, fills each rank's heads of key's KV, calls
// RequestFinished on every rank with its own ids and returns the ranks'
// params merged and passed through JSON, with every rank's ids.
func exportGroup(t testing.TB, pre []*side, id string, key uint64, n int, order func(r int, ids []uint32)) (*v1.KVTransferParams, [][]uint32) {
	t.Helper()
	ids := make([][]uint32, len(pre))
	var parts []*v1.KVTransferParams
	for r, s := range pre {
		got, err := s.e.Alloc(t.Context(), n)
		require.NoError(t, err)
		if order != nil {
			order(r, got)
		}
		ids[r] = got
		s.e.fillShape(t, heads(r, len(pre)), key, got)
	}
	for r, s := range pre {
		p, err := s.e.RequestFinished(t.Context(), id, ids[r], v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.NoError(t, err)
		parts = append(parts, p)
	}
	merged, err := connector.MergeExports(parts...)
	require.NoError(t, err)
	js, err := connector.MarshalKVTransferParams(merged)
	require.NoError(t, err)
	out, err := connector.UnmarshalKVTransferParams(js)
	require.NoError(t, err)
	return out, ids
}

// loadGroup starts the load of params on every decode rank (no prefix hit)
// and returns each rank's local blocks.
func loadGroup(t testing.TB, dec []*side, id string, params *v1.KVTransferParams) [][]uint32 {
	t.Helper()
	dst := make([][]uint32, len(dec))
	for d, s := range dec {
		dst[d] = s.load(t, id, params)
	}
	return dst
}

// requireGroupDone waits for every decode rank to report id done and
// checks every byte of its heads; then the blocks are freed.
func requireGroupDone(t testing.TB, dec []*side, id string, key uint64, dst [][]uint32) {
	t.Helper()
	for d, s := range dec {
		f := s.outcome(t, id, 60*time.Second)
		require.Nil(t, f, "decode rank %d of %d: %s failed: %v", d, len(dec), id, f.GetError())
		s.e.checkAt(t, heads(d, len(dec)), key, dst[d], 0)
		s.free(t, dst[d])
	}
}

// TestIntegrityRanksDisagreeOnBlockIDs: a prefill of TP 2 whose ranks hold a
// request in different block ids (the same ids in another order; rank 1
// restarted with a fresh pool while rank 0's free list is in LIFO order, as
// reported: rank 0 holds the request in 2000 blocks of its own order,
// rank 1 in 1..2000) is read by a decode of TP 2 and one of TP 1, every
// request done and every byte right.
//
// fault-matrix: ranks-disagree-on-block-ids
func TestIntegrityRanksDisagreeOnBlockIDs(t *testing.T) {
	env := NewEnv(t)
	preS := env.StartGroup(t, SidecarOpts{Engine: "pre", Role: "prefill", TPSize: 2, Args: faultArgs()})
	pre := []*side{attachSide(t, preS[0], 4096), attachSide(t, preS[1], 4096)}
	decS := env.StartGroup(t, SidecarOpts{Engine: "dec2", Role: "decode", TPSize: 2, Args: faultArgs()})
	dec2 := []*side{attachSide(t, decS[0], 4096), attachSide(t, decS[1], 4096)}
	dec1 := []*side{startSide(t, env, "dec1", 4096, "--role", "decode")}
	decodes := map[string][]*side{"tp2": dec2, "tp1": dec1}

	run := func(t *testing.T, name string, key uint64, n int, order func(int, []uint32), differ bool) {
		for dn, dec := range decodes {
			id := name + "-" + dn
			params, ids := exportGroup(t, pre, id, key, n, order)
			if differ {
				require.NotEqual(t, ids[0], ids[1], "the ranks hold the request in different ids")
				require.Equal(t, ids[1], connector.ExportOf(params, 1).GetBlockIds(), "rank 1's ids travel in the params")
			} else {
				require.Empty(t, connector.ExportOf(params, 1).GetBlockIds(), "equal ids are not repeated")
			}
			dst := loadGroup(t, dec, id, params)
			requireGroupDone(t, dec, id, key, dst)
			for _, s := range pre {
				s.waitSent(t, id, 30*time.Second)
			}
		}
	}
	t.Run("same ids", func(t *testing.T) { run(t, "same", 1, 64, nil, false) })
	t.Run("same ids in another order", func(t *testing.T) {
		run(t, "reordered", 2, 300, func(r int, ids []uint32) {
			if r == 1 {
				slices.Reverse(ids)
			}
		}, true)
	})
	outer := t // the restarted process lives as long as the test, not the subtest
	t.Run("rank 1 restarted", func(t *testing.T) {
		// Rank 0's free list: 2300 blocks allocated and freed in 3 chunks,
		// so the next allocation comes out in LIFO chunk order.
		var held [][]uint32
		for _, n := range []int{255, 1790, 255} {
			ids, err := pre[0].e.Alloc(t.Context(), n)
			require.NoError(t, err)
			held = append(held, ids)
		}
		for _, ids := range held {
			pre[0].free(t, ids)
		}
		pre[1].Signal(t, syscall.SIGTERM)
		require.Zero(t, pre[1].Wait(t, ExitTimeout))
		pre[1] = attachSide(outer, env.Restart(outer, pre[1].Sidecar), 4096)
		run(t, "restarted", 3, 2000, nil, true)
	})
	for _, s := range append(append(slices.Clone(pre), dec2...), dec1...) {
		s.requireIdle(t)
	}
}

// TestIntegrityStaleReusedRequestID: request "R" is exported, loaded and
// released; the prefill hands the same block out again, writes new bytes and
// exports a new request also named "R". The decode's load with the first
// params fails (nothing written into its block) and releases nothing: the
// new export's own load is byte-exact.
//
// fault-matrix: stale-reused-request-id
func TestIntegrityStaleReusedRequestID(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 256)
	dec := startSide(t, env, "dec", 256)

	old := pre.export(t, "R", 1, 1)
	dst := dec.load(t, "first", old)
	dec.requireDone(t, "first", 1, dst)
	pre.waitSent(t, "R", 30*time.Second)

	fresh := pre.export(t, "R", 2, 1)
	require.Equal(t, old.GetRemoteBlockIds(), fresh.GetRemoteBlockIds(), "the same block holds the new request")
	require.NotEqual(t, connector.ExportOf(old, 0).GetExportId(), connector.ExportOf(fresh, 0).GetExportId())

	stale, err := dec.e.Alloc(t.Context(), 1)
	require.NoError(t, err)
	dec.e.fill(t, 99, stale)
	require.NoError(t, dec.e.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "stale", LocalBlockIds: stale, Params: old, RemoteHitBlocks: new(uint32(0))}))
	f := dec.requireFailed(t, "stale", stale, 30*time.Second)
	require.Equal(t, v1.Code_CODE_LEASE_EXPIRED, f.GetError().GetCode(), f.GetError().GetMessage())
	require.Contains(t, f.GetError().GetMessage(), `request "R" export`)
	dec.e.check(t, 99, stale) // no byte written

	dec.free(t, dst)
	dst = dec.load(t, "new", fresh)
	dec.requireDone(t, "new", 2, dst)
	pre.waitSent(t, "R", 30*time.Second)
	dec.free(t, dst)
	dec.free(t, stale)
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestIntegrityDrain: SIGTERM to prefill rank 1 of TP 2 while decode rank 1
// of TP 2 READs 2000 blocks from it. With --drain-timeout 60s the READ
// finishes and its notification is accepted: decode done, every byte right,
// and the prefill logs one drain summary. With the decode rank paused
// (SIGSTOP) so the READ cannot finish before a short --drain-timeout, the
// prefill aborts the READ with CODE_UNAVAILABLE and the decode fails with
// that drain error, reporting nothing done. No decode ever sees "refused the
// notification". A trial counts only when the SIGTERM did find the READ
// running (the drain summary says so); one whose READ had ended first is run
// again, at most maxAttempts times.
//
// fault-matrix: drain-mid-read
func TestIntegrityDrain(t *testing.T) {
	const trials, maxAttempts, n = 5, 3, 2000
	env := NewEnv(t)
	// A served READ of a paused decode must not hit the progress deadline
	// before the drain deadline: the progress deadline is long here.
	long := []string{"--progress-timeout", flagDur(60 * time.Second)}
	preS := env.StartGroup(t, SidecarOpts{Engine: "pre", Role: "prefill", TPSize: 2, Args: faultArgs(append(long, "--drain-timeout", "60s")...)})
	pre := []*side{attachSide(t, preS[0], 8192), attachSide(t, preS[1], 8192)}
	decS := env.StartGroup(t, SidecarOpts{Engine: "dec", Role: "decode", TPSize: 2, Args: faultArgs(long...)})
	dec := []*side{attachSide(t, decS[0], 8192), attachSide(t, decS[1], 8192)}
	addr1 := pre[1].QUICAddr(t)
	// restart starts prefill rank 1 again on its address with extra flags.
	restart := func(extra ...string) {
		o := pre[1].Opts
		o.Listen = addr1
		o.Args = append(slices.Clone(o.Args), extra...)
		pre[1] = attachSide(t, env.StartSidecar(t, o), 8192)
	}
	notRefused := func(t *testing.T, f *v1.FailedRequest) {
		if f != nil {
			require.NotContains(t, f.GetError().GetMessage(), "refused the notification", "bytes arrived, then the notification was refused")
		}
	}
	drainLine := func(t *testing.T) map[string]any {
		var line map[string]any
		for _, l := range pre[1].Logs() {
			if l["msg"] == "drain finished" {
				require.Nil(t, line, "one drain summary")
				line = l
			}
		}
		require.NotNil(t, line, "the prefill logs a drain summary")
		return line
	}
	// rank0Done checks decode rank 0, which reads from prefill rank 0.
	rank0Done := func(t *testing.T, id string, key uint64, dst []uint32) {
		f := dec[0].outcome(t, id, 60*time.Second)
		require.Nil(t, f, "decode rank 0: %v", f.GetError())
		dec[0].e.checkAt(t, heads(0, 2), key, dst, 0)
		dec[0].free(t, dst)
		pre[0].waitSent(t, id, 30*time.Second)
	}

	// finishes runs one trial of the 60 s drain; it reports whether the
	// SIGTERM found the READ running.
	finishes := func(t *testing.T, id string, key uint64) bool {
		params, _ := exportGroup(t, pre, id, key, n, nil)
		before := served(t, pre[1].Sidecar)
		dst := loadGroup(t, dec, id, params)
		// A READ that ended before it was seen running is told apart by
		// the drain summary below, as one that ended before the signal.
		_ = waitServing(t, pre[1].Sidecar, before)
		pre[1].Signal(t, syscall.SIGTERM)
		require.Zero(t, pre[1].Wait(t, ExitTimeout), "prefill rank 1 exits 0")
		f := dec[1].outcome(t, id, 60*time.Second)
		notRefused(t, f)
		require.Nil(t, f, "decode rank 1: %v", f.GetError())
		dec[1].e.checkAt(t, heads(1, 2), key, dst[1], 0)
		dec[1].free(t, dst[1])
		rank0Done(t, id, key, dst[0])
		line := drainLine(t)
		t.Logf("drain summary: %v", line)
		require.Equal(t, float64(0), line["reads_aborted"], "%v", line)
		require.Equal(t, float64(0), line["leases_dropped"], "%v", line)
		caught := line["reads_served"].(float64) >= 1
		if caught {
			require.GreaterOrEqual(t, line["leases_notified"], float64(1), "the READ's notification was accepted: %v", line)
		}
		return caught
	}
	for i := range trials {
		t.Run("finishes within 60s/"+strconv.Itoa(i), func(t *testing.T) {
			for a := range maxAttempts {
				caught := finishes(t, "long-"+strconv.Itoa(i)+"-"+strconv.Itoa(a), uint64(10+i))
				restart()
				if caught {
					return
				}
				t.Logf("attempt %d: the READ ended before the SIGTERM; again", a)
			}
			t.Fatalf("the SIGTERM never found the READ running in %d attempts", maxAttempts)
		})
	}

	// From here on rank 1 drains within 4 s: it aborts READs still running
	// when 1 s of that is left.
	pre[1].Signal(t, syscall.SIGTERM)
	require.Zero(t, pre[1].Wait(t, ExitTimeout))
	restart("--drain-timeout", "4s")
	const aborted = "drain: aborted the READs still running; waiting for notifications until the deadline"
	// heldBack runs one trial of the short drain with decode rank 1
	// paused; it reports whether the READ was still running at the
	// deadline (else it ended before the pause and the load is done).
	heldBack := func(t *testing.T, id string, key uint64) bool {
		params, _ := exportGroup(t, pre, id, key, n, nil)
		before := served(t, pre[1].Sidecar)
		dst := loadGroup(t, dec, id, params)
		// A READ that ended before it was seen running is told apart by
		// the drain summary below, as one that ended before the signal.
		_ = waitServing(t, pre[1].Sidecar, before)
		dec[1].Signal(t, syscall.SIGSTOP)
		pre[1].Signal(t, syscall.SIGTERM)
		// The abort comes a second before the deadline; the process exits
		// at it when nothing was left to abort.
		deadline := time.After(testutil.Scaled(30 * time.Second))
		for !pre[1].Exited() && !slices.ContainsFunc(pre[1].Logs(), func(l map[string]any) bool { return l["msg"] == aborted }) {
			select {
			case <-deadline:
				t.Fatal("prefill rank 1 neither aborted the READ nor exited")
			case <-time.After(10 * time.Millisecond):
			}
		}
		dec[1].Signal(t, syscall.SIGCONT)
		require.Zero(t, pre[1].Wait(t, ExitTimeout), "prefill rank 1 exits 0")
		f := dec[1].outcome(t, id, 60*time.Second)
		notRefused(t, f)
		line := drainLine(t)
		t.Logf("drain summary: %v", line)
		if line["reads_aborted"].(float64) == 0 {
			require.Nil(t, f, "a READ that ended before the pause is done: %v", f.GetError())
			dec[1].e.checkAt(t, heads(1, 2), key, dst[1], 0)
			dec[1].free(t, dst[1])
			rank0Done(t, id, key, dst[0])
			return false
		}
		require.NotNil(t, f, "decode rank 1 reported %s done", id)
		require.Equal(t, v1.Code_CODE_UNAVAILABLE, f.GetError().GetCode(), f.GetError().GetMessage())
		require.Contains(t, f.GetError().GetMessage(), "prefill rank 1")
		require.Regexp(t, `(stopped serving|did not serve) the READ`, f.GetError().GetMessage())
		require.ElementsMatch(t, dst[1], f.GetBlockIds(), "every local block is reported for recompute")
		t.Logf("decode rank 1 failed: %s", f.GetError().GetMessage())
		dec[1].free(t, dst[1])
		rank0Done(t, id, key, dst[0])
		return true
	}
	for i := range trials {
		t.Run("held back past 4s/"+strconv.Itoa(i), func(t *testing.T) {
			for a := range maxAttempts {
				caught := heldBack(t, "short-"+strconv.Itoa(i)+"-"+strconv.Itoa(a), uint64(20+i))
				restart("--drain-timeout", "4s")
				if caught {
					return
				}
				t.Logf("attempt %d: the READ ended before the decode was paused; again", a)
			}
			t.Fatalf("the READ never ran into the drain deadline in %d attempts", maxAttempts)
		})
	}
	for _, s := range append(slices.Clone(pre), dec...) {
		s.requireIdle(t)
	}
}

// TestIntegrityEngineSessions: engine A exits with results pending (a
// done_sending entry of a request it exported, and a load the sidecar aborts
// when A goes away); engine B attaches to the same sidecar and its
// GetFinished never names A's requests or A's block ids, while it does get
// its own results.
//
// fault-matrix: engine-session-ends
func TestIntegrityEngineSessions(t *testing.T) {
	env := NewEnv(t)
	s := env.StartSidecar(t, SidecarOpts{Engine: "s", Args: faultArgs()})
	const ttl = 2 * time.Second
	peer := startSide(t, env, "peer", 8192, "--lease-ttl", flagDur(ttl))
	a := attachSide(t, s, 8192)

	// A exports a request the peer loads: A's lease is released, and its
	// done_sending waits for a GetFinished A never makes.
	pa := a.export(t, "a-export", 1, 4)
	dst := peer.load(t, "a-export", pa)
	peer.requireDone(t, "a-export", 1, dst)
	peer.free(t, dst)
	// A loads a big request from the peer and exits while it runs.
	big := peer.export(t, "p-big", 2, bigBlocks)
	aDst, err := a.e.Alloc(t.Context(), bigBlocks)
	require.NoError(t, err)
	require.NoError(t, a.e.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "a-load", LocalBlockIds: aDst, Params: big, RemoteHitBlocks: new(uint32(0))}))
	require.NoError(t, a.e.Close())
	line := s.WaitLog(t, "engine session ended", 30*time.Second)
	t.Logf("%v", line)
	require.Contains(t, line["request_ids"], "a-export")

	b := attachSide(t, s, 8192)
	pb := b.export(t, "b-export", 3, 4)
	dst = peer.load(t, "b-export", pb)
	peer.requireDone(t, "b-export", 3, dst)
	peer.free(t, dst)
	b.waitSent(t, "b-export", 30*time.Second)
	// Poll a while longer: A's lease on the peer's big request, or a late
	// result of A, must not reach B either.
	deadline := time.Now().Add(2 * time.Second)
	b.poll(t, 10*time.Second, "B's results", func() bool { return time.Now().After(deadline) })
	for id := range b.sent {
		require.NotContains(t, []string{"a-export", "a-load"}, id)
	}
	for id := range b.recv {
		require.NotContains(t, []string{"a-export", "a-load"}, id)
	}
	require.Empty(t, b.failed, "B made no load: no failure, and no block id of A's, reaches it: %v", b.failed)
	// A's aborted load may not have reached the peer: its lease expires.
	peer.waitSent(t, "p-big", ttl+slack)
	b.requireIdle(t)
}

// TestIntegrityEngineInput: the small inputs of rows
// engine-names-foreign-block and load-alignment. RequestFinished naming a
// block the engine never allocated fails naming it and holds nothing; the
// block it did allocate stays its own. A load request stating a prefix hit
// and surplus blocks lands each remote block in its own local block and
// leaves the surplus untouched; lists that cannot be aligned are refused.
//
// fault-matrix: engine-names-foreign-block
// fault-matrix: load-alignment
func TestIntegrityEngineInput(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "pre", 1024, "--lease-ttl", flagDur(time.Second))
	dec := startSide(t, env, "dec", 1024)

	t.Run("a block the engine never allocated", func(t *testing.T) {
		start := pre.Stats(t)["blocks_used"]
		ids, err := pre.e.Alloc(t.Context(), 1)
		require.NoError(t, err)
		never := uint32(500)
		require.NotContains(t, ids, never)
		_, err = pre.e.RequestFinished(t.Context(), "x", []uint32{ids[0], never}, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err), "%v", err)
		require.ErrorContains(t, err, "block_ids[1]=500")
		require.Zero(t, pre.Stats(t)["leases_held"], "no lease")
		pre.e.fill(t, 5, ids)
		pre.e.check(t, 5, ids) // still the engine's, mapped and writable
		pre.free(t, ids)
		require.Equal(t, start, pre.Stats(t)["blocks_used"])
	})

	for _, tc := range []struct {
		name                    string
		remote, hit, surplus, l int
	}{
		{"one hit, one surplus", 2, 1, 1, 2},
		{"several hit and surplus", 8, 3, 2, 7},
		{"surplus only", 3, 0, 1, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := strings.ReplaceAll(tc.name, " ", "-")
			p := pre.export(t, id, 6, tc.remote)
			local, err := dec.e.Alloc(t.Context(), tc.l)
			require.NoError(t, err)
			dec.e.fill(t, 99, local)
			meta := &v1.ReqMeta{RequestId: id, LocalBlockIds: local, Params: p, RemoteHitBlocks: new(uint32(tc.hit)), LocalSurplusBlocks: uint32(tc.surplus)}
			require.NoError(t, dec.e.StartLoad(t.Context(), meta))
			require.Nil(t, dec.outcome(t, id, 30*time.Second))
			fill := tc.l - tc.surplus
			dec.e.checkAt(t, shape, 6, local[:fill], tc.hit) // remote hit+k in local[k]
			for k, b := range local[fill:] {
				dec.e.checkAt(t, shape, 99, []uint32{b}, fill+k) // untouched
			}
			pre.waitSent(t, id, 30*time.Second)
			dec.free(t, local)
		})
	}

	t.Run("lists that cannot be aligned", func(t *testing.T) {
		p := pre.export(t, "bad", 7, 2)
		local, err := dec.e.Alloc(t.Context(), 3)
		require.NoError(t, err)
		for _, tc := range []struct {
			name string
			meta *v1.ReqMeta
			want string
		}{
			{"hit not stated", &v1.ReqMeta{LocalBlockIds: local[:2]}, "remote_hit_blocks is required"},
			{"one surplus too many", &v1.ReqMeta{LocalBlockIds: local, RemoteHitBlocks: new(uint32(0))}, "cannot be aligned"},
			{"hit and surplus that do not add up", &v1.ReqMeta{LocalBlockIds: local[:2], RemoteHitBlocks: new(uint32(1))}, "cannot be aligned"},
		} {
			tc.meta.RequestId, tc.meta.Params = "bad", p
			err := dec.e.StartLoad(t.Context(), tc.meta)
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err), "%s: %v", tc.name, err)
			require.ErrorContains(t, err, tc.want, tc.name)
		}
		require.Zero(t, dec.Stats(t)["loads_in_flight"])
		dec.free(t, local)
		pre.waitSent(t, "bad", 30*time.Second) // its lease expires
	})
	pre.requireIdle(t)
	dec.requireIdle(t)
}
