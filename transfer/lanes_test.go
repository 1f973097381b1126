package transfer

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/quic-go/quic-go"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/netem"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

func TestStripe(t *testing.T) {
	reg := &Region{}
	spans := func(lens ...uint64) ([]span, []*v1.Descriptor) {
		var (
			ls  []span
			rs  []*v1.Descriptor
			off uint64
		)
		for _, n := range lens {
			ls = append(ls, span{reg: reg, off: off, n: n})
			rs = append(rs, &v1.Descriptor{Addr: 1<<40 + off, Len: n, DevId: 3})
			off += n + 4096 // a hole between descriptors
		}
		return ls, rs
	}
	const mib = 1 << 20
	for _, tc := range []struct {
		name   string
		lens   []uint64
		k      int
		totals []uint64 // bytes per share
		descs  []int    // descriptors per share
	}{
		{"one descriptor in two", []uint64{4 * mib}, 2, []uint64{2 * mib, 2 * mib}, []int{1, 1}},
		{"whole descriptors", []uint64{mib, mib, mib, mib}, 4, []uint64{mib, mib, mib, mib}, []int{1, 1, 1, 1}},
		{"cut inside the second", []uint64{mib, 2 * mib}, 2, []uint64{1536 << 10, 1536 << 10}, []int{2, 1}},
		{"cuts aligned to 64 KiB", []uint64{3*mib + 100}, 3, []uint64{mib, mib, mib + 100}, []int{1, 1, 1}},
		{"too small for every lane", []uint64{100 << 10}, 4, []uint64{64 << 10, 36 << 10}, []int{1, 1}},
		{"one lane", []uint64{mib, 5}, 1, []uint64{mib + 5}, []int{2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ls, rs := spans(tc.lens...)
			shares := stripe(ls, rs, tc.k)
			var totals []uint64
			var descs []int
			// Concatenated, the shares are the transfer, in order.
			var gotL []span
			var gotR []*v1.Descriptor
			for _, sh := range shares {
				totals = append(totals, sh.total)
				descs = append(descs, len(sh.local))
				require.Len(t, sh.remote, len(sh.local))
				var sum uint64
				for i, s := range sh.local {
					require.Equal(t, s.n, sh.remote[i].GetLen())
					require.Equal(t, uint32(3), sh.remote[i].GetDevId())
					sum += s.n
				}
				require.Equal(t, sh.total, sum)
				gotL, gotR = append(gotL, sh.local...), append(gotR, sh.remote...)
			}
			require.Equal(t, tc.totals, totals)
			require.Equal(t, tc.descs, descs)
			// Merging adjacent pieces gives the original descriptors back.
			var mergedL []span
			var mergedR []*v1.Descriptor
			for i, s := range gotL {
				if n := len(mergedL); n > 0 && mergedL[n-1].off+mergedL[n-1].n == s.off {
					mergedL[n-1].n += s.n
					mergedR[n-1] = &v1.Descriptor{Addr: mergedR[n-1].GetAddr(), Len: mergedR[n-1].GetLen() + s.n, DevId: 3}
					require.Equal(t, mergedR[n-1].GetAddr()+mergedR[n-1].GetLen()-s.n, gotR[i].GetAddr())
					continue
				}
				mergedL = append(mergedL, s)
				mergedR = append(mergedR, gotR[i])
			}
			require.Equal(t, ls, mergedL)
			for i := range rs {
				require.Equal(t, rs[i].GetAddr(), mergedR[i].GetAddr())
				require.Equal(t, rs[i].GetLen(), mergedR[i].GetLen())
			}
		})
	}
}

// laneRig is a serving agent and a dialer with READ lanes on a SimNet.
type laneRig struct {
	n          *testutil.SimNet
	srvTLS     *tls.Config
	srvPC      *netem.PacketConn
	srv, cli   *Agent
	cliMetrics *prometheus.Registry // the dialer's metrics
	srvMem     []byte
	srvReg     Region    // the first half of srvMem
	srvRegs    [2]Region // its two halves
	cliMem     []byte
	cliReg     Region
	lanePCs    map[int]*netem.PacketConn // the dialer's lane sockets by lane
	mu         sync.Mutex
	accesses   []Access // what the server was asked to authorize, in order
	allowed    int      // accesses it allowed
	released   []*Access
	cliEvents  map[uint64]int // "released" test hooks per transfer id
	denyBlocks map[uint32]bool
}

const (
	laneMemBytes = 8 << 20
	laneBlockLen = 64 << 10
)

// startLaneRig starts a server serving laneMemBytes as two regions in
// blocks of laneBlockLen and a dialer with k READ lanes, on a SimNet with
// 1 ms one way. It must run in a synctest bubble.
func startLaneRig(t *testing.T, k int) *laneRig {
	t.Helper()
	n := testutil.NewSimNet(time.Millisecond)
	srvTLS, cliTLS := simTLS(t)
	r := &laneRig{n: n, srvTLS: srvTLS, srvMem: make([]byte, laneMemBytes), cliMem: make([]byte, laneMemBytes),
		lanePCs: map[int]*netem.PacketConn{}, cliEvents: map[uint64]int{}, denyBlocks: map[uint32]bool{}}
	half := laneMemBytes / 2
	r.srvRegs = [2]Region{SliceRegion(r.srvMem[:half:half], laneBlockLen, 0), SliceRegion(r.srvMem[half:], laneBlockLen, 0)}
	r.srvReg, r.cliReg = r.srvRegs[0], SliceRegion(r.cliMem, 0, 0)
	r.startServer(t, 5)
	cfg := &Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ClientTLS: cliTLS, Regions: []Region{r.cliReg},
		ReadLanes: k, ProgressTimeout: time.Second, HandshakeTimeout: 2 * time.Second,
		LanePacketConn: func(lane int) (net.PacketConn, error) {
			pc, err := n.ListenPacket("127.0.0.2:0")
			if err == nil {
				r.mu.Lock()
				r.lanePCs[lane] = pc
				r.mu.Unlock()
			}
			return pc, err
		}}
	cfg.testHook = func(event string, id uint64) {
		if event == "released" {
			r.mu.Lock()
			r.cliEvents[id]++
			r.mu.Unlock()
		}
	}
	r.cliMetrics = prometheus.NewRegistry()
	cfg.Registerer = r.cliMetrics
	var err error
	r.cli, err = New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.cli.Close() })
	return r
}

// laneResetKey is the servers' stateless-reset key: a server restarted
// on simServer resets the connections of its predecessor.
var laneResetKey = &quic.StatelessResetKey{9}

// startServer starts a server process on simServer serving srvMem filled
// from seed, with ticket keys of its own.
func (r *laneRig) startServer(t *testing.T, seed byte) {
	t.Helper()
	fill(r.srvMem, seed)
	srvTLS := r.srvTLS.Clone()
	srvTLS.SetSessionTicketKeys([][32]byte{{seed}})
	r.srvPC = r.n.Listen(t, simServer)
	var err error
	r.srv, err = New(&Config{PacketConn: r.srvPC, ServerTLS: srvTLS, Regions: r.srvRegs[:], StatelessResetKey: laneResetKey,
		ProgressTimeout: time.Second,
		Authorize: func(_ context.Context, acc *Access) error {
			r.mu.Lock()
			defer r.mu.Unlock()
			r.accesses = append(r.accesses, *acc)
			for _, b := range acc.BlockIDs {
				if r.denyBlocks[b] {
					return fmt.Errorf("%w: block %d is not exported to %s", ErrCapabilityDenied, b, acc.Peer)
				}
			}
			r.allowed++
			return nil
		},
		Release: func(acc *Access) {
			r.mu.Lock()
			defer r.mu.Unlock()
			r.released = append(r.released, acc)
		}})
	require.NoError(t, err)
	srv := r.srv
	t.Cleanup(func() { _ = srv.Close() })
}

// read READs n bytes at off of the server's memory into the same place of
// the dialer's, in descriptors of descLen bytes, after zeroing that range.
func (r *laneRig) read(ctx context.Context, off, n, descLen int) (Result, error) {
	clear(r.cliMem[off : off+n])
	x := &Xfer{Op: OpRead, Peer: simServer, RequestID: "req"}
	for o := off; o < off+n; o += descLen {
		x.Local = append(x.Local, Desc{Addr: r.cliReg.Base + uint64(o), Len: uint64(descLen)})
		x.Remote = append(x.Remote, Desc{Addr: r.srvReg.Base + uint64(o), Len: uint64(descLen)})
	}
	return r.cli.Transfer(ctx, x)
}

// takeAccesses returns the accesses authorized since the last call.
func (r *laneRig) takeAccesses() []Access {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.accesses
	r.accesses = nil
	return out
}

// peers returns the distinct dialer addresses of accs, sorted.
func peers(accs []Access) []string {
	var out []string
	for _, a := range accs {
		out = append(out, a.Peer)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// posts is the dialer's count of kvsidecar_transfer_post_seconds
// observations of READs.
func (r *laneRig) posts(t *testing.T) uint64 {
	t.Helper()
	mfs, err := r.cliMetrics.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "kvsidecar_transfer_post_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "op" && l.GetValue() == "read" {
					return m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return 0
}

// warm connects the dialer with a small READ and waits until its k lanes
// are up.
func (r *laneRig) warm(t *testing.T, k int) {
	t.Helper()
	_, err := r.read(t.Context(), 0, 64<<10, 64<<10)
	require.NoError(t, err)
	require.Equal(t, k, r.lanesUp(t))
}

// lanesUp waits, in virtual time, until the dialer's K lanes to the server
// are up, and returns PeerInfo.ReadLanes.
func (r *laneRig) lanesUp(t *testing.T) int {
	t.Helper()
	time.Sleep(10 * time.Millisecond) // a handshake takes 2 ms
	info, err := r.cli.PeerInfo(t.Context(), simServer)
	require.NoError(t, err)
	return info.ReadLanes
}

// TestReadLanes: with K lanes, a large READ lands byte-exact and is served
// on K connections, each a contiguous share of the descriptors, while a
// small READ stays on lane 0; a refusal of one lane's share fails the READ
// with the server's class and message and closes no lane. A READ by region
// and block is striped by block ids, in every region.
func TestReadLanes(t *testing.T) {
	for _, k := range []int{2, 4} {
		t.Run(fmt.Sprintf("K=%d", k), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				r := startLaneRig(t, k)
				ctx := t.Context()
				// A small READ first: lane 0 only; the lanes are dialed meanwhile.
				_, err := r.read(ctx, 0, 64<<10, 64<<10)
				require.NoError(t, err)
				small := r.takeAccesses()
				require.Len(t, small, 1)
				lane0 := small[0].Peer
				require.Equal(t, k, r.lanesUp(t))

				const off, n = 0, 4 << 20
				res, err := r.read(ctx, off, n, 256<<10)
				require.NoError(t, err)
				require.Equal(t, uint64(n), res.Bytes)
				require.Equal(t, r.srvMem[off:off+n], r.cliMem[off:off+n], "READ bytes")
				require.Zero(t, r.cliMem[off+n], "no byte after the READ's range")
				accs := r.takeAccesses()
				require.Len(t, accs, k, "one served access per lane")
				require.Len(t, peers(accs), k, "K distinct connections")
				require.Contains(t, peers(accs), lane0)
				// Together the lanes' shares are the READ's blocks, each once,
				// a contiguous run per lane.
				var blocks []uint32
				for _, a := range accs {
					require.Equal(t, uint32(len(a.BlockIDs)), a.BlockIDs[len(a.BlockIDs)-1]-a.BlockIDs[0]+1, "contiguous blocks")
					blocks = append(blocks, a.BlockIDs...)
				}
				slices.Sort(blocks)
				var want []uint32
				for b := uint32(off / laneBlockLen); b < (off+n)/laneBlockLen; b++ {
					want = append(want, b)
				}
				require.Equal(t, want, blocks)
				require.Equal(t, 1, r.cli.DialCount(simServer), "lanes do not count as redials")
				require.Equal(t, uint64(2), r.posts(t), "one post time per READ, however many lanes")

				// The last block is refused: only the last lane's share
				// touches it.
				last := uint32((off+n)/laneBlockLen - 1)
				r.mu.Lock()
				r.denyBlocks[last] = true
				r.mu.Unlock()
				_, err = r.read(ctx, off, n, 256<<10)
				require.ErrorIs(t, err, ErrCapabilityDenied)
				require.Equal(t, v1.Code_CODE_CAPABILITY_DENIED, codes.Of(err))
				require.ErrorContains(t, err, fmt.Sprintf("block %d is not exported to ", last))
				var xe *XferError
				require.ErrorAs(t, err, &xe)
				require.Less(t, xe.Bytes, xe.Total)
				require.Len(t, peers(r.takeAccesses()), k)
				require.Equal(t, k, r.lanesUp(t), "a refusal closes no lane")
				r.mu.Lock()
				clear(r.denyBlocks)
				r.mu.Unlock()

				// By region and block: 48 blocks in a scattered order, 16 KiB
				// at 4 KiB into each, in both regions: 1.5 MiB.
				var ids []uint32
				for i := range uint32(48) {
					ids = append(ids, (i*37)%64)
				}
				bd := &BlockDescs{FirstRegion: 0, NumRegions: 2, Offset: 4096, Len: 16 << 10, BlockIDs: ids}
				var wantBytes []byte
				for _, reg := range r.srvRegs {
					for _, b := range ids {
						o := int(b)*laneBlockLen + 4096
						wantBytes = append(wantBytes, reg.Mem.(SliceMemory)[o:o+16<<10]...)
					}
				}
				for _, checksum := range []bool{false, true} {
					clear(r.cliMem)
					x := &Xfer{Op: OpRead, Peer: simServer, RequestID: "req", RemoteBlocks: bd, Checksum: checksum,
						Local: []Desc{{Addr: r.cliReg.Base, Len: uint64(len(wantBytes))}}}
					if checksum { // one local descriptor per entry
						x.Local = nil
						for i := range 2 * len(ids) {
							x.Local = append(x.Local, Desc{Addr: r.cliReg.Base + uint64(i)*16<<10, Len: 16 << 10})
						}
					}
					res, err := r.cli.Transfer(ctx, x)
					require.NoError(t, err, "checksum %v", checksum)
					require.Equal(t, uint64(len(wantBytes)), res.Bytes)
					require.Equal(t, wantBytes, r.cliMem[:len(wantBytes)], "checksum %v", checksum)
					accs := r.takeAccesses()
					require.Len(t, peers(accs), k, "checksum %v", checksum)
					// Each lane read a contiguous chunk of the ids.
					var got []uint32
					for i, a := range accs {
						require.NotEmpty(t, a.BlockIDs, "lane %d", i)
						got = append(got, a.BlockIDs...)
					}
					slices.Sort(got)
					sorted := slices.Clone(ids)
					slices.Sort(sorted)
					require.Equal(t, sorted, got, "every block read once, checksum %v", checksum)
				}
			})
		})
	}
}

// TestReadLaneFails: one lane's path dies in the middle of a READ. The READ
// fails as a whole with the lane's class (ErrTimeout: no byte for
// ProgressTimeout), and only after every lane stopped touching local
// memory; the server released every access. The next READ leaves out the
// lane that cannot be dialed again and lands byte-exact on the others.
//
// fault-matrix: read-lane-dies
func TestReadLaneFails(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const k = 2
		r := startLaneRig(t, k)
		ctx := t.Context()
		r.warm(t, k)
		r.takeAccesses()

		// Lane 1 goes dark after its request and a few ACKs: the server
		// has sent some of its share by then.
		r.mu.Lock()
		r.lanePCs[1].KillAfter(4 << 10)
		r.mu.Unlock()
		const n = 8 << 20
		start := time.Now()
		_, err := r.read(ctx, 0, n, 512<<10)
		require.ErrorIs(t, err, ErrTimeout)
		var xe *XferError
		require.ErrorAs(t, err, &xe)
		require.Equal(t, uint64(n), xe.Total)
		require.Less(t, xe.Bytes, xe.Total, "no partial success")
		require.Positive(t, r.lanePCs[1].SentBytes())
		r.mu.Lock()
		released := r.cliEvents[xe.XferID]
		r.mu.Unlock()
		require.Equal(t, k, released, "Transfer returned after every lane stopped")
		// The dark lane failed ProgressTimeout after its last byte.
		require.Less(t, time.Since(start), 2*time.Second)
		// Lane 1's share is the second half: part of it landed.
		landed := firstDiff(r.cliMem[n/2:n], r.srvMem[n/2:n])
		require.Positive(t, landed, "lane 1 failed in the middle of its share")
		require.Less(t, landed, n/2)
		time.Sleep(2 * time.Second) // the server's ProgressTimeout, in virtual time
		synctest.Wait()
		r.mu.Lock()
		require.Len(t, r.released, r.allowed, "the server released every access it allowed")
		r.mu.Unlock()
		require.Len(t, peers(r.takeAccesses()), k)

		// The failed lane was closed; it cannot be dialed again on its dark
		// socket, so the next READ runs on lane 0 alone.
		res, err := r.read(ctx, 0, n, 512<<10)
		require.NoError(t, err)
		require.Equal(t, uint64(n), res.Bytes)
		require.Equal(t, r.srvMem[:n], r.cliMem[:n])
		accs := r.takeAccesses()
		require.Len(t, accs, 1)
		require.Equal(t, 1, r.lanesUp(t), "lane 1 cannot be dialed on its dark socket")
		info, err := r.cli.PeerInfo(ctx, simServer)
		require.NoError(t, err)
		require.Equal(t, "127.0.0.2:1", info.LocalAddr.String(), "lane 0 is the same connection")
	})
}

// firstDiff is the index of the first byte where a and b differ, or len(a).
func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

// TestReadLanesRedial: the server restarts on its address (same
// stateless-reset key) while the dialer holds lane 0 and a READ lane to
// the old process. The next READ meets the resets on its lanes; whichever
// lane learns first, the READ is sent again as a whole, once, on a new
// connection, after Xfer.OnRedial, and lands the new process's bytes.
//
// fault-matrix: dead-connection-redialed
func TestReadLanesRedial(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const k = 2
		r := startLaneRig(t, k)
		ctx := t.Context()
		r.warm(t, k)

		r.srvPC.Kill()
		require.NoError(t, r.srv.Close())
		r.startServer(t, 6)

		const n = 4 << 20
		clear(r.cliMem[:n])
		x := &Xfer{Op: OpRead, Peer: simServer, RequestID: "req",
			Local: []Desc{{Addr: r.cliReg.Base, Len: n}}, Remote: []Desc{{Addr: r.srvReg.Base, Len: n}}}
		redials := 0
		x.OnRedial = func(context.Context) error { redials++; return nil }
		res, err := r.cli.Transfer(ctx, x)
		require.NoError(t, err)
		require.Equal(t, uint64(n), res.Bytes)
		require.Equal(t, 1, redials)
		require.Equal(t, 2, r.cli.DialCount(simServer))
		require.Equal(t, r.srvMem[:n], r.cliMem[:n], "the new process's bytes")
	})
}
