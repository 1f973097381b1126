//go:build !race

// Race builds open no stream before the handshake completes
// (quic-go/quic-go#4303), so no READ travels in 0-RTT there: this test
// runs in make's non-race step (test-0rtt).

package connector_test

import (
	"bytes"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/handshake"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// capturePC records the datagrams its owner sends to one address while on.
type capturePC struct {
	net.PacketConn
	to string

	mu  sync.Mutex
	on  bool
	got [][]byte
}

func (c *capturePC) WriteTo(p []byte, addr net.Addr) (int, error) {
	c.mu.Lock()
	if c.on && addr.String() == c.to {
		c.got = append(c.got, bytes.Clone(p))
	}
	c.mu.Unlock()
	return c.PacketConn.WriteTo(p, addr)
}

func (c *capturePC) record(on bool) [][]byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.on = on
	return c.got
}

// tinyKV has 1 KiB blocks per region on one rank (half of that per
// decode rank at TP 2): a READ small enough for the prefill to send whole
// in its answer to a replayed first flight.
var tinyKV = &v1.ModelGeometry{Model: "tiny-kv", NumLayers: 1, NumKvHeads: 2, HeadDim: 16,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}

// TestReplayedZeroRTTReadChangesNothing captures a decode rank's first
// flight of a resumed connection (its Initial and the 0-RTT packets that
// hold the load's READ) and replays it at the prefill from another
// address after the original connection is gone. The prefill serves the
// replayed READ (TLS 1.3 0-RTT has no replay protection), but: no byte of
// the KV reaches the replayer in the clear, the READ's pin ends with its
// stream, and the lease is not released, notified or extended (it expires
// exactly when it would have). Two sizes: a READ the prefill sends whole
// in its first answer (its bytes go out sealed, the stream ends, the pin
// with it), and one QUIC's anti-amplification limit (RFC 9000 section
// 8.1) holds back, since the replayer never validates its address: its
// pin lasts until the connection dies at the handshake timeout.
//
// fault-matrix: replayed-0rtt-read
func TestReplayedZeroRTTReadChangesNothing(t *testing.T) {
	t.Run("sent whole", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) { replayZeroRTTRead(t, tinyKV, 1024, true) })
	})
	t.Run("held by the amplification limit", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) { replayZeroRTTRead(t, gqa8, 32<<10, false) })
	})
}

// replayZeroRTTRead runs the replay with geometry geom, whose one-block
// READ by decode rank 0 (of 2) moves readBytes; sentWhole says whether the
// prefill's answer to the replayed flight can carry all of them.
func replayZeroRTTRead(t *testing.T, geom *v1.ModelGeometry, readBytes float64, sentWhole bool) {
	const oneWay = time.Millisecond
	const leaseTTL = 10 * time.Minute
	o := simOpts(t, oneWay)
	preReg := prometheus.NewRegistry()
	o.engine, o.tp, o.geom, o.leaseTTL, o.reg = "prefill", 1, geom, leaseTTL, preReg
	pre := newInstance(t, o)
	preAddr := pre.addrs[0]
	capt := &capturePC{to: preAddr}
	// Decode TP 2 from prefill TP 1: both decode ranks read from the
	// one prefill rank, so its lease waits for two notifications and
	// outlives rank 0's load.
	o.engine, o.tp, o.reg = "decode", 2, nil
	o.tap = func(r int, pc net.PacketConn) net.PacketConn {
		if r != 0 {
			return pc
		}
		capt.PacketConn = pc
		return capt
	}
	dec := newInstance(t, o)
	rank := dec.ranks[0]

	// A first contact leaves decode rank 0 a session ticket.
	_, err := rank.Agent().Handshake(t.Context(), preAddr, &v1.HandshakeRequest{WireVersion: handshake.WireVersion, ExpectedEngineId: "prefill"})
	require.NoError(t, err)
	synctest.Wait()
	rank.Agent().Disconnect(preAddr)

	blocks := pre.alloc(t, 1)
	pre.fill(t, 7, blocks)
	params := pre.finish(t, "a", blocks)
	finished := time.Now()
	local := dec.alloc(t, 1)
	capt.record(true)
	require.NoError(t, rank.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "a", LocalBlockIds: local, Params: params, RemoteHitBlocks: new(uint32(0))}))
	time.Sleep(oneWay) // the first flight has left; no answer has arrived
	flight := capt.record(false)
	require.NotEmpty(t, flight)
	for done := false; !done; {
		f, err := rank.WaitFinished(t.Context())
		require.NoError(t, err)
		require.Empty(t, f.Failed)
		done = slices.Contains(f.DoneRecving, "a")
	}
	info, err := rank.Agent().PeerInfo(t.Context(), preAddr)
	require.NoError(t, err)
	require.True(t, info.Used0RTT, "the load resumed its session in 0-RTT")
	require.Equal(t, connector.Stats{LeasesHeld: 1, BlocksHeld: 1}, pre.ranks[0].Stats(), "one of two consumers notified")

	// The original connection goes away and the prefill forgets it.
	rank.Agent().Disconnect(preAddr)
	time.Sleep(time.Minute)
	servedBefore := counter(t, preReg, "kvsidecar_transfer_bytes_total")

	rep := o.sim.Listen(t, "127.0.0.1:0")
	var (
		recvMu sync.Mutex
		recv   [][]byte
		reader sync.WaitGroup
	)
	reader.Go(func() {
		buf := make([]byte, 64<<10)
		for {
			n, _, err := rep.ReadFrom(buf)
			if err != nil {
				return
			}
			recvMu.Lock()
			recv = append(recv, bytes.Clone(buf[:n]))
			recvMu.Unlock()
		}
	})
	to := net.UDPAddrFromAddrPort(netip.MustParseAddrPort(preAddr)) // the 4-byte form simnet routes by
	for _, p := range flight {
		_, err := rep.WriteTo(p, to)
		require.NoError(t, err)
	}
	time.Sleep(100 * time.Millisecond)
	sent := counter(t, preReg, "kvsidecar_transfer_bytes_total") - servedBefore
	if sentWhole {
		require.Equal(t, readBytes, sent, "the prefill sent the whole replayed READ, sealed")
		require.Zero(t, pre.ranks[0].Stats().ReadsServing, "its stream ended, and its pin with it")
	} else {
		require.Less(t, sent, readBytes, "the anti-amplification limit holds the READ's bytes back")
		require.Equal(t, 1, pre.ranks[0].Stats().ReadsServing, "the replayed READ was authorized and holds its pin while its stream lasts")
	}

	// The replayed connection never completes its handshake: it ends
	// at the handshake timeout, and the pin with its stream.
	time.Sleep(transfer.DefaultHandshakeTimeout + time.Second)
	require.Equal(t, connector.Stats{LeasesHeld: 1, BlocksHeld: 1}, pre.ranks[0].Stats(), "no pin left; the lease is neither released nor notified")
	require.NotContains(t, pre.ranks[0].GetFinished().DoneSending, "a")

	// Bytes went only to the connection that asked: the replayer got
	// the prefill's answer, sealed with keys it cannot derive.
	require.NoError(t, rep.Close())
	reader.Wait()
	require.NotEmpty(t, recv, "the prefill answered the replayed flight")
	reg := pre.pools[0].Regions()[0]
	kv, err := pre.pools[0].HostBytes(reg.Index, reg.BlockOffset(int(blocks[0])), reg.BlockLen)
	require.NoError(t, err)
	for off := 0; off+32 <= len(kv)/2; off += 64 {
		for _, d := range recv {
			require.False(t, bytes.Contains(d, kv[off:off+32]), "KV bytes [%d, +32) in the clear in a datagram to the replayer", off)
		}
	}
	dreg := dec.pools[0].Regions()[0]
	got, err := dec.pools[0].HostBytes(dreg.Index, dreg.BlockOffset(int(local[0])), dreg.BlockLen)
	require.NoError(t, err)
	require.Equal(t, kv[:len(kv)/2], got, "the genuine load got these bytes: heads 0-3, the first half of the block")

	// Not extended: the lease expires when it was always going to.
	time.Sleep(time.Until(finished.Add(leaseTTL)) - time.Second)
	require.Equal(t, 1, pre.ranks[0].Stats().LeasesHeld)
	time.Sleep(2 * time.Second)
	require.Zero(t, pre.ranks[0].Stats().LeasesHeld, "expired at its deadline: the replay extended nothing")
}
