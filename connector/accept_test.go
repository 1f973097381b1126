package connector_test

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestConnectionsOnlyToTargets: in piggyback mode each decode rank dials
// only the prefill ranks that hold its heads; in legacy mode a rank whose
// target is not rank 0 dials rank 0 first.
//
// fault-matrix: connections-only-to-targets
func TestConnectionsOnlyToTargets(t *testing.T) {
	for _, mode := range []handshake.Mode{handshake.ModePiggyback, handshake.ModeLegacy} {
		for _, pd := range [][2]int{{2, 4}, {4, 2}} {
			p, d := pd[0], pd[1]
			t.Run(mode.String()+"_"+name(p, d), func(t *testing.T) {
				pre := newInstance(t, instOpts{engine: "prefill", tp: p, geom: gqa8})
				dec := newInstance(t, instOpts{engine: "decode", tp: d, geom: gqa8, mode: mode})
				blocks := pre.alloc(t, 2)
				pre.fill(t, 1, blocks)
				params := pre.finish(t, "r", blocks)
				dec.startLoad(t, "r", dec.alloc(t, 2), params)
				requireAllDone(t, dec.wait(t, "r"))

				for dr, rank := range dec.ranks {
					plan, err := connector.PlanRank(connector.TPShape{NumKVHeads: 8, HeadBlockBytes: 1}, p, d, dr)
					require.NoError(t, err)
					targets := map[int]bool{}
					for _, s := range plan.Sources {
						targets[s.PrefillRank] = true
					}
					for pr, addr := range pre.addrs {
						want := 0
						if targets[pr] || (mode == handshake.ModeLegacy && pr == 0) {
							want = 1
						}
						require.Equal(t, want, rank.Agent().DialCount(addr), "decode rank %d dials of prefill rank %d", dr, pr)
						require.Equal(t, want, rank.Handshakes().Exchanges(addr), "decode rank %d handshakes with prefill rank %d", dr, pr)
					}
				}
			})
		}
	}
}

// TestTPSizeChecks: a missing tp_size is refused at StartLoad; one that
// disagrees with the prefill group fails every decode rank with
// CODE_TP_MISMATCH, and nothing is read.
//
// fault-matrix: bad-params
func TestTPSizeChecks(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 4, geom: gqa8})
	reg := prometheus.NewRegistry()
	dec := newInstance(t, instOpts{engine: "decode", tp: 2, geom: gqa8, reg: reg})
	blocks := pre.alloc(t, 3)
	pre.fill(t, 2, blocks)
	params := pre.finish(t, "r", blocks)
	local := dec.alloc(t, 3)

	t.Run("missing tp_size", func(t *testing.T) {
		p := clone(params)
		p.TpSize = nil
		err := dec.ranks[0].StartLoad(t.Context(), &v1.ReqMeta{RequestId: "x", LocalBlockIds: local, Params: p, RemoteHitBlocks: new(uint32(0))})
		require.ErrorIs(t, err, connector.ErrInvalidParams)
		require.ErrorContains(t, err, "tp_size: missing")
		require.Equal(t, 0, dec.ranks[0].Stats().LoadsInFlight)
	})

	t.Run("tp_size disagrees with the prefill group", func(t *testing.T) {
		p := clone(params)
		p.TpSize = new(uint32(2))
		p.RemoteRankAddrs = p.RemoteRankAddrs[:2]
		p.RankExports = p.RankExports[:2]
		dec.startLoad(t, "y", local, p)
		for r, f := range dec.wait(t, "y") {
			require.NotNil(t, f, "rank %d must fail", r)
			require.Equal(t, v1.Code_CODE_TP_MISMATCH, codes.Of(f.Err), "rank %d: %v", r, f.Err)
			require.ErrorContains(t, f.Err, "has tp_size=4, the request said tp_size=2")
			require.Equal(t, []int{int(local[0]), int(local[1]), int(local[2])}, f.BlockIDs)
		}
		require.Zero(t, counter(t, reg, "kvsidecar_connector_read_bytes_total"), "no bytes read")
		require.Zero(t, counter(t, reg, "kvsidecar_transfer_bytes_total"), "no bytes moved")
	})
}

func clone(p *v1.KVTransferParams) *v1.KVTransferParams {
	b, err := connector.MarshalKVTransferParams(p)
	if err != nil {
		panic(err)
	}
	out, err := connector.UnmarshalKVTransferParams(b)
	if err != nil {
		panic(err)
	}
	return out
}

// counter sums every series of the named counter in reg (0 when absent).
func counter(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// TestExpiredLeaseFailsTheLoad: a READ after the lease expired is refused
// with lease-expired, and decode reports the blocks as failed, never as
// done.
//
// fault-matrix: unknown-or-expired-export
func TestExpiredLeaseFailsTheLoad(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 2, geom: gqa8, leaseTTL: 20 * time.Millisecond})
	dec := newInstance(t, instOpts{engine: "decode", tp: 2, geom: gqa8})
	blocks := pre.alloc(t, 2)
	params := pre.finish(t, "r", blocks)
	for r, rank := range pre.ranks {
		f, err := rank.WaitFinished(t.Context())
		require.NoError(t, err)
		require.Equal(t, []string{"r"}, f.DoneSending, "rank %d lease expired", r)
		require.Zero(t, pre.pools[r].Stats().BlocksUsed, "rank %d freed the blocks", r)
	}
	local := dec.alloc(t, 2)
	dec.startLoad(t, "r", local, params)
	for r, f := range dec.wait(t, "r") {
		require.NotNil(t, f, "rank %d must fail", r)
		require.Equal(t, v1.Code_CODE_LEASE_EXPIRED, codes.Of(f.Err), "rank %d: %v", r, f.Err)
		require.Len(t, f.BlockIDs, 2)
	}
}

// TestPrefixHits: a partial prefix hit reads only the tail; a full hit (no
// local blocks) only notifies, finishes, and the prefill frees its blocks.
//
// fault-matrix: prefix-hit
func TestPrefixHits(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 2, geom: gqa8})
	dec := newInstance(t, instOpts{engine: "decode", tp: 4, geom: gqa8})
	key := kvgen.Key(9)

	blocks := pre.alloc(t, 6)
	pre.fill(t, key, blocks)
	params := pre.finish(t, "partial", blocks)
	tail := dec.alloc(t, 2)
	dec.startLoad(t, "partial", tail, params)
	requireAllDone(t, dec.wait(t, "partial"))
	dec.check(t, key, tail, 4)

	// Every rank frees "partial"'s blocks when it reports it sent; only
	// then do the ranks allocate in lockstep again (a rank that had freed
	// them would hand them out while another still held them).
	for r := range pre.ranks {
		require.Equal(t, []string{"partial"}, pre.waitSent(t, r, "partial"), "prefill rank %d", r)
	}
	blocks = pre.alloc(t, 3)
	params = pre.finish(t, "full", blocks)
	dec.startLoad(t, "full", nil, params)
	requireAllDone(t, dec.wait(t, "full"))
	for r := range pre.ranks {
		require.Equal(t, []string{"full"}, pre.waitSent(t, r, "full"), "prefill rank %d", r)
		require.Zero(t, pre.pools[r].Stats().BlocksUsed)
	}
}

// TestAbortStopsTheRead: Abort returns only once no READ runs into the
// blocks; the request is reported failed with CODE_ABORTED, and the blocks
// can be reused without a late write.
//
// fault-matrix: decode-abort-mid-read
func TestAbortStopsTheRead(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8, numBlocks: 512, delay: 5 * time.Millisecond})
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8, numBlocks: 512})
	blocks := pre.alloc(t, 500)
	pre.fill(t, 3, blocks)
	params := pre.finish(t, "r", blocks)
	local := dec.alloc(t, 500)
	dec.startLoad(t, "r", local, params)
	require.NoError(t, dec.ranks[0].Abort(t.Context(), "r"))
	require.Equal(t, 0, dec.ranks[0].Stats().LoadsInFlight)
	f := dec.ranks[0].GetFinished()
	if len(f.DoneRecving) == 0 { // the load may have finished before the abort
		require.Len(t, f.Failed, 1)
		require.Equal(t, v1.Code_CODE_ABORTED, codes.Of(f.Failed[0].Err), "%v", f.Failed[0].Err)
	}
	// The blocks are the caller's again: fill them and run another request
	// through the same connection; nothing from the aborted READ lands.
	dec.fill(t, 77, local)
	blocks2 := pre.alloc(t, 2)
	pre.fill(t, 5, blocks2)
	params2 := pre.finish(t, "r2", blocks2)
	local2 := dec.alloc(t, 2)
	dec.startLoad(t, "r2", local2, params2)
	requireAllDone(t, dec.wait(t, "r2"))
	dec.check(t, 5, local2, 0)
	dec.check(t, 77, local, 0)
}

// TestPrefillRestart: a prefill restarted on the same address (new
// incarnation) is handshaked again, and the request succeeds.
//
// fault-matrix: prefill-restart-same-port
func TestPrefillRestart(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 2, geom: gqa8})
	dec := newInstance(t, instOpts{engine: "decode", tp: 2, geom: gqa8})
	blocks := pre.alloc(t, 2)
	pre.fill(t, 1, blocks)
	dec.startLoad(t, "a", dec.alloc(t, 2), pre.finish(t, "a", blocks))
	requireAllDone(t, dec.wait(t, "a"))
	oldInc := pre.ranks[0].Incarnation()
	addrs := pre.addrs
	pre.close()

	pre2 := newInstance(t, instOpts{engine: "prefill", tp: 2, geom: gqa8, addrs: addrs})
	require.NotEqual(t, oldInc, pre2.ranks[0].Incarnation())
	blocks = pre2.alloc(t, 2)
	pre2.fill(t, 2, blocks)
	params := pre2.finish(t, "b", blocks)
	local := dec.alloc(t, 2)
	dec.startLoad(t, "b", local, params)
	requireAllDone(t, dec.wait(t, "b"))
	dec.check(t, 2, local, 0)
	for r, rank := range dec.ranks {
		require.Equal(t, 2, rank.Handshakes().Exchanges(addrs[r]), "decode rank %d handshaked again", r)
	}
}

// TestHandshakeRTTs: the handshake's round trips at an RTT of 20 ms on an
// in-memory network under synctest: virtual time moves only with the
// network's delays, so the CPU cost of TLS and QUIC (on a loaded machine,
// under the race detector) is no round trip, and the figures are exact.
//
// fault-matrix: handshake-round-trips
func TestHandshakeRTTs(t *testing.T) {
	const rtt = 20 * time.Millisecond
	// rtts returns the round trips of the first contact and of the cached
	// lookup of decode rank dr with its targets.
	rtts := func(t *testing.T, p, d int, mode handshake.Mode, dr int) (first, cached float64, targets []int) {
		o := simOpts(t, rtt/2)
		o.engine, o.tp, o.geom = "prefill", p, gqa8
		pre := newInstance(t, o)
		o.engine, o.tp, o.mode = "decode", d, mode
		dec := newInstance(t, o)
		plan, err := connector.PlanRank(connector.TPShape{NumKVHeads: 8, HeadBlockBytes: 64 * 16 * 2}, p, d, dr)
		require.NoError(t, err)
		var ts []handshake.Target
		for _, s := range plan.Sources {
			targets = append(targets, s.PrefillRank)
			ts = append(ts, handshake.Target{Expect: handshake.Expect{EngineID: "prefill", TPRank: s.PrefillRank, TPSize: p},
				Addr: pre.addrs[s.PrefillRank], Rank0Addr: pre.addrs[0]})
		}
		hs := dec.ranks[dr].Handshakes()
		start := time.Now()
		_, err = hs.GetAll(t.Context(), ts)
		require.NoError(t, err)
		first = float64(time.Since(start)) / float64(rtt)
		start = time.Now()
		_, err = hs.GetAll(t.Context(), ts)
		require.NoError(t, err)
		cached = float64(time.Since(start)) / float64(rtt)
		t.Logf("decode rank %d of %s %s, targets %v: first contact %.2f RTT, cached %.2f RTT", dr, name(p, d), mode, targets, first, cached)
		return first, cached, targets
	}
	t.Run("piggyback first contact and cached", func(t *testing.T) {
		for dr := range 4 {
			synctest.Test(t, func(t *testing.T) {
				first, cached, _ := rtts(t, 2, 4, handshake.ModePiggyback, dr)
				require.LessOrEqual(t, first, 2.5, "QUIC and TLS in one round trip, the metadata exchange in another")
				require.Zero(t, cached, "a cached peer costs no round trip")
			})
		}
	})
	t.Run("legacy asks rank 0 first", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			first, _, targets := rtts(t, 2, 4, handshake.ModeLegacy, 3)
			require.Equal(t, []int{1}, targets)
			require.GreaterOrEqual(t, first, 3.5)
		})
	})
	t.Run("P>D sources in parallel", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			first, _, targets := rtts(t, 4, 1, handshake.ModePiggyback, 0)
			require.Equal(t, []int{0, 1, 2, 3}, targets)
			require.LessOrEqual(t, first, 2.5, "four handshakes in parallel, not serial (8 RTT)")
		})
	})
}

// TestFreeRefusedWhileLoading: an engine that frees (or loads again into)
// blocks a load is writing into is refused with CODE_BUSY naming the
// request, instead of unmapping a page under the READ (which faulted the
// demo when it freed blocks on SIGTERM before aborting).
func TestFreeRefusedWhileLoading(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8, numBlocks: 256, delay: 5 * time.Millisecond})
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8, numBlocks: 256})
	blocks := pre.alloc(t, 200)
	params := pre.finish(t, "r", blocks)
	local := dec.alloc(t, 200)
	rank := dec.ranks[0]
	dec.startLoad(t, "r", local, params)

	ids := []int{int(local[0]), int(local[1])}
	err := rank.FreeBlocks(t.Context(), ids)
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err), "%v", err)
	require.ErrorContains(t, err, `is being loaded by request "r"; abort it first`)
	err = rank.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "r2", LocalBlockIds: local[5:6], Params: params, RemoteHitBlocks: new(uint32(199))})
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err), "%v", err)

	// RequestFinished's free-at-once is the other path to those blocks.
	p, err := rank.RequestFinished(t.Context(), "x", local[:2], v1.FinishStatus_FINISH_STATUS_STOP, nil)
	require.Nil(t, p)
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err), "%v", err)

	require.NoError(t, rank.Abort(t.Context(), "r"))
	require.NoError(t, rank.FreeBlocks(t.Context(), ids), "free after the abort")
	err = rank.FreeBlocks(t.Context(), ids)
	require.Error(t, err, "a double free is still the pool's error")
}

// TestLeasedBlocksAreGuarded is a regression test of a review finding:
// blocks RequestFinished took over could be freed by the engine while
// decode still read them (the next Alloc handed them to another request,
// whose KV decode then read under the first capability). A block shared by
// two requests (a prefix) is freed when its last lease is released.
func TestLeasedBlocksAreGuarded(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8})
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8})
	rank, pool := pre.ranks[0], pre.pools[0]
	blocks := pre.alloc(t, 3)
	pre.fill(t, 4, blocks)
	pa := pre.finish(t, "a", blocks)

	err := rank.FreeBlocks(t.Context(), []int{int(blocks[0])})
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err), "%v", err)
	require.ErrorContains(t, err, "is held for decode under 1 lease(s)")

	// A second request over the shared prefix takes another reference.
	pb := pre.finish(t, "b", blocks[:2])
	used := pool.Stats().BlocksUsed

	local := dec.alloc(t, 3)
	dec.startLoad(t, "a", local, pa)
	requireAllDone(t, dec.wait(t, "a"))
	dec.check(t, 4, local, 0)
	require.Equal(t, []string{"a"}, pre.waitSent(t, 0, "a"), "the decode's notification released a's lease")
	require.Equal(t, used-1, pool.Stats().BlocksUsed, "only the block b does not hold is freed")
	err = rank.FreeBlocks(t.Context(), []int{int(blocks[0])})
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err), "b still holds the shared block: %v", err)

	local2 := dec.alloc(t, 2)
	dec.startLoad(t, "b", local2, pb)
	requireAllDone(t, dec.wait(t, "b"))
	dec.check(t, 4, local2, 0)
	require.Equal(t, []string{"b"}, pre.waitSent(t, 0, "b"))
	require.Equal(t, used-3, pool.Stats().BlocksUsed, "the last lease frees the shared blocks")
}

// TestStartLoadIntoFreeBlocksRefused: a READ may write only into allocated
// blocks (a free block can sit in a reserve page that a lower limit unmaps
// mid-READ).
func TestStartLoadIntoFreeBlocksRefused(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8})
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8})
	params := pre.finish(t, "r", pre.alloc(t, 2))
	local := dec.alloc(t, 1)
	err := dec.ranks[0].StartLoad(t.Context(), &v1.ReqMeta{RequestId: "r", LocalBlockIds: []uint32{local[0], local[0] + 1}, Params: params})
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err), "%v", err)
	require.ErrorContains(t, err, "local_block_ids")
	require.Equal(t, 0, dec.ranks[0].Stats().LoadsInFlight)
}
