package connector_test

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// killAndRestart starts a prefill and a decode of tp ranks each on one
// simulated network (call it inside a synctest bubble), moves request "a"
// between them, then kills the prefill without a word and starts another
// on its addresses with the same stateless-reset key: the decode still
// holds its connections to the dead process.
func killAndRestart(t *testing.T, tp int) (pre, pre2, dec *instance) {
	t.Helper()
	key := &quic.StatelessResetKey{4, 5, 6}
	o := simOpts(t, time.Millisecond)
	o.engine, o.tp, o.geom, o.resetKey = "prefill", tp, gqa8, key
	pre = newInstance(t, o)
	o.engine, o.resetKey = "decode", nil
	dec = newInstance(t, o)
	blocks := pre.alloc(t, 2)
	pre.fill(t, 1, blocks)
	dec.startLoad(t, "a", dec.alloc(t, 2), pre.finish(t, "a", blocks))
	requireAllDone(t, dec.wait(t, "a"))
	pre.kill()
	o.engine, o.addrs, o.resetKey = "prefill", pre.addrs, key
	return pre, newInstance(t, o), dec
}

// loadB moves request "b" from pre2 to dec and checks every byte.
func loadB(t *testing.T, pre2, dec *instance) {
	t.Helper()
	blocks := pre2.alloc(t, 2)
	pre2.fill(t, 2, blocks)
	local := dec.alloc(t, 2)
	dec.startLoad(t, "b", local, pre2.finish(t, "b", blocks))
	requireAllDone(t, dec.wait(t, "b"))
	dec.check(t, 2, local, 0)
}

// TestPrefillKilledAndRestarted: the decode's next request right after the
// restart meets the dead connections: the handshake with rank 0 and the
// READ from rank 1 (whose incarnation the params do not carry, so its
// metadata comes from the cache) draw stateless resets, redial, and the
// READ is planned again from the new process's metadata (its regions lie
// elsewhere; the old addresses are refused with CODE_OUT_OF_RANGE).
func TestPrefillKilledAndRestarted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		pre, pre2, dec := killAndRestart(t, 2)
		start := time.Now()
		loadB(t, pre2, dec)
		require.Less(t, time.Since(start), transfer.DefaultKeepAlivePeriod, "the calls' own packets drew the resets, no probe was needed")
		for r, rank := range dec.ranks {
			require.Equal(t, 2, rank.Handshakes().Exchanges(pre.addrs[r]), "decode rank %d handshaked again", r)
			require.Equal(t, 2, rank.Agent().DialCount(pre.addrs[r]), "decode rank %d redialed once", r)
		}
	})
}

// TestIdleDecodeNoticesRestartedPrefill: a decode that sends nothing
// notices the restart within two keep-alive periods, from the reset its
// keep-alive probe draws, and drops the connection and the cached
// metadata; the next request handshakes with the new process.
func TestIdleDecodeNoticesRestartedPrefill(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		pre, pre2, dec := killAndRestart(t, 1)
		addr, agent := pre.addrs[0], dec.ranks[0].Agent()
		restarted := time.Now()
		for agent.Alive(addr) {
			require.Less(t, time.Since(restarted), transfer.DefaultMaxIdleTimeout, "never noticed")
			time.Sleep(10 * time.Millisecond) // virtual time: the bubble's clock
		}
		noticed := time.Since(restarted)
		t.Logf("the idle decode noticed the restart after %v", noticed)
		require.LessOrEqual(t, noticed, 2*transfer.DefaultKeepAlivePeriod)
		require.Equal(t, 1, agent.DialCount(addr), "it only dropped the connection")

		loadB(t, pre2, dec)
		require.Equal(t, 2, agent.DialCount(addr))
		require.Equal(t, 2, dec.ranks[0].Handshakes().Exchanges(addr), "the cached metadata was dropped")
	})
}

// TestRefusedPeerDialedOncePerRequest: a prefill whose certificates come
// from a CA the decode does not share refuses the TLS handshake; each
// request dials it once and fails with CODE_UNAVAILABLE, never redials.
func TestRefusedPeerDialedOncePerRequest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		o := simOpts(t, time.Millisecond)
		o.engine, o.tp, o.geom = "prefill", 1, gqa8
		pre := newInstance(t, o)
		other, err := devtls.NewCA()
		require.NoError(t, err)
		o.engine, o.ca = "decode", other
		dec := newInstance(t, o)
		blocks := pre.alloc(t, 2)
		for i, id := range []string{"a", "b", "c"} {
			local := dec.alloc(t, 2)
			dec.startLoad(t, id, local, pre.finish(t, id, blocks))
			f := dec.wait(t, id)[0]
			require.NotNil(t, f, "request %q", id)
			require.Equal(t, v1.Code_CODE_UNAVAILABLE, codes.Of(f.Err), "request %q: %v", id, f.Err)
			require.Equal(t, i+1, dec.ranks[0].Agent().DialCount(pre.addrs[0]), "request %q dialed once", id)
			ids := make([]int, len(local))
			for k, b := range local {
				ids[k] = int(b)
			}
			require.NoError(t, dec.pools[0].Free(t.Context(), ids))
		}
	})
}
