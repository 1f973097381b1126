package connector_test

import (
	"net"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// TestDeadSourceFailsWithinProgressDeadline: the prefill host dies without
// a word in the middle of a READ; decode reports the load failed, with its
// local block ids, once the progress deadline passed, not after the
// notification to the dead source has timed out as well (regression: the
// failure waited for notifyTimeout, 10 s).
func TestDeadSourceFailsWithinProgressDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const progress = 300 * time.Millisecond
		sim := testutil.NewSimNet(time.Millisecond)
		ca, err := devtls.NewCA() // inside the bubble: its clock starts in 2000
		require.NoError(t, err)
		srv, err := ca.ServerConfig()
		require.NoError(t, err)
		cli, err := ca.ClientConfig()
		require.NoError(t, err)
		newRank := func(engine string, pc net.PacketConn) (*connector.Rank, *vmm.Pool) {
			layout, err := vmm.LayoutFor(gqa8, 0, 1)
			require.NoError(t, err)
			pool, err := vmm.NewPool(t.Context(), &vmm.Config{Layout: layout, NumBlocks: 512})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, pool.Close()) })
			rank, err := connector.NewRank(t.Context(), &connector.Config{EngineID: engine, TPSize: 1, Geometry: gqa8, Pool: pool,
				Transfer:  &transfer.Config{PacketConn: pc, ServerTLS: srv, ClientTLS: cli, ProgressTimeout: progress},
				RankAddrs: []string{pc.LocalAddr().String()}, CapabilitySecret: []byte("0123456789abcdef-" + engine)})
			require.NoError(t, err)
			t.Cleanup(func() { _ = rank.Close() })
			return rank, pool
		}
		prePC := sim.Listen(t, "127.0.0.1:0")
		pre, prePool := newRank("prefill", prePC)
		dec, decPool := newRank("decode", sim.Listen(t, "127.0.0.1:0"))

		const n = 400 // 400 blocks × 64 KiB = 25 MiB
		ids, err := prePool.Alloc(t.Context(), n)
		require.NoError(t, err)
		remote := make([]uint32, n)
		for i, id := range ids {
			remote[i] = uint32(id)
		}
		params, err := pre.RequestFinished(t.Context(), "r", remote, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.NoError(t, err)
		local, err := decPool.Alloc(t.Context(), n)
		require.NoError(t, err)
		localIDs := make([]uint32, n)
		for i, id := range local {
			localIDs[i] = uint32(id)
		}

		prePC.KillAfter(1 << 20) // the handshake and the first MiB of the READ get through
		start := time.Now()
		require.NoError(t, dec.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "r", LocalBlockIds: localIDs, Params: params, RemoteHitBlocks: new(uint32(0))}))
		f, err := dec.WaitFinished(t.Context())
		require.NoError(t, err)
		took := time.Since(start)
		<-prePC.Dead()
		require.Empty(t, f.DoneRecving)
		require.Len(t, f.Failed, 1)
		require.Equal(t, v1.Code_CODE_TIMEOUT, codes.Of(f.Failed[0].Err), "%v", f.Failed[0].Err)
		require.Equal(t, local, f.Failed[0].BlockIDs, "every local block to recompute")
		t.Logf("reported %v after the start", took)
		require.Less(t, took, progress+time.Second, "reported at the progress deadline, not after the notification timed out (10 s)")
	})
}
