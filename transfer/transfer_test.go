package transfer

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// layout returns n descriptor lengths of mixed sizes, 4 KiB to 2 MiB.
func layout(n int) []uint64 {
	sizes := make([]uint64, n)
	for i := range sizes {
		sizes[i] = 4 << 10 << (i % 4) // 4, 8, 16, 32 KiB
		if i%512 == 0 {
			sizes[i] = 2 << 20
		}
	}
	return sizes
}

// descsAt lays descriptors of the given sizes contiguously from base, or in
// reverse order when rev is set (so local and remote layouts differ).
func descsAt(r Region, sizes []uint64, rev bool) []Desc {
	out := make([]Desc, len(sizes))
	off := uint64(0)
	for k := range sizes {
		i := k
		if rev {
			i = len(sizes) - 1 - k
		}
		out[i] = Desc{Addr: r.Base + off, Len: sizes[i], DevID: r.DevID}
		off += sizes[i]
	}
	return out
}

func sum(s []uint64) (t uint64) {
	for _, v := range s {
		t += v
	}
	return t
}

// bytesOf gathers the bytes of descs from mem (registered as r).
func bytesOf(r Region, mem []byte, descs []Desc) []byte {
	var out []byte
	for _, d := range descs {
		out = append(out, mem[d.Addr-r.Base:d.Addr-r.Base+d.Len]...)
	}
	return out
}

func TestTransferByteExact(t *testing.T) {
	tests := []struct {
		name     string
		n        int
		op       Op
		indexed  bool
		checksum bool
		sizes    []uint64 // instead of layout(n)
		staged   bool     // the serving memory cannot be mapped (CopyOut)
	}{
		{"read 1", 1, OpRead, false, false, nil, false},
		{"write 1", 1, OpWrite, false, true, nil, false},
		{"read 16 indexed", 16, OpRead, true, true, nil, false},
		{"write 16", 16, OpWrite, false, false, nil, false},
		{"read 4096", 4096, OpRead, false, true, nil, false},
		{"write 4096 indexed", 4096, OpWrite, true, false, nil, false},
		// READs under gatherMax bytes leave the server in one write; a
		// slice of gatherMax goes out straight from memory.
		{"read small", 0, OpRead, false, true, []uint64{4 << 10, 100, 12 << 10}, false},
		{"read small indexed staged", 0, OpRead, true, true, []uint64{1, 4 << 10, 7}, true},
		{"read gatherMax", 0, OpRead, false, true, []uint64{gatherMax - 4096, 4096}, false},
		{"read gatherMax+1 staged", 0, OpRead, false, true, []uint64{gatherMax, 1}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sizes := tt.sizes
			if sizes == nil {
				sizes = layout(tt.n)
			}
			total := sum(sizes)
			srvMem, cliMem := mmapRegion(t, int(total)), mmapRegion(t, int(total))
			srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
			if tt.staged {
				srvReg.Mem = unmappedMemory{srvMem}
			}
			fill(srvMem, 1)
			fill(cliMem, 2)
			srv := startAgent(t, Config{Regions: []Region{srvReg}, Authorize: allowAll})
			cli := startAgent(t, Config{Regions: []Region{cliReg}})
			remote, local := descsAt(srvReg, sizes, false), descsAt(cliReg, sizes, true)
			x := &Xfer{Op: tt.op, Peer: srv.Addr().String(), RequestID: "r1", Local: local, Checksum: tt.checksum}
			if tt.indexed {
				l, err := cli.Prepare(t.Context(), x.Peer, remote)
				require.NoError(t, err)
				x.RemoteList = l
				for i := range remote {
					x.Indices = append(x.Indices, uint32(i))
				}
			} else {
				x.Remote = remote
			}
			wantSrc := bytesOf(srvReg, srvMem, remote)
			if tt.op == OpWrite {
				wantSrc = bytesOf(cliReg, cliMem, local)
			}
			res, err := cli.Transfer(t.Context(), x)
			require.NoError(t, err)
			require.Equal(t, total, res.Bytes)
			if tt.op == OpRead {
				require.True(t, bytes.Equal(wantSrc, bytesOf(cliReg, cliMem, local)), "local bytes differ from the remote source")
			} else {
				require.True(t, bytes.Equal(wantSrc, bytesOf(srvReg, srvMem, remote)), "remote bytes differ from the local source")
			}
		})
	}
}

func TestServingSideRefuses(t *testing.T) {
	const blockLen = 64 << 10
	srvMem := mmapRegion(t, 8*blockLen) // guard pages on both sides
	srvReg := SliceRegion(srvMem, blockLen, 0)
	fill(srvMem, 3)
	before := bytes.Clone(srvMem)
	key := NewCapabilityKey()
	srv := startAgent(t, Config{Regions: []Region{srvReg}, CapabilityKey: key})
	cliMem := mmapRegion(t, 8*blockLen)
	cliReg := SliceRegion(cliMem, 0, 0)
	cli := startAgent(t, Config{Regions: []Region{cliReg}})
	peer := srv.Addr().String()
	capab := key.Issue("req", 0, 1, 2)
	pg := uint64(4096)

	tests := []struct {
		name   string
		remote Desc
		req    string
		want   error
	}{
		{"covered block is served", Desc{Addr: srvReg.Base + blockLen, Len: pg}, "req", nil},
		{"outside any region (guard page after)", Desc{Addr: srvReg.Base + srvReg.Len, Len: pg}, "req", ErrOutOfRange},
		{"outside any region (guard page before)", Desc{Addr: srvReg.Base - pg, Len: pg}, "req", ErrOutOfRange},
		{"straddles the region end", Desc{Addr: srvReg.Base + srvReg.Len - pg, Len: 2 * pg}, "req", ErrOutOfRange},
		{"addr+len overflows", Desc{Addr: math.MaxUint64 - pg + 1, Len: 2 * pg}, "req", ErrOutOfRange},
		{"zero length", Desc{Addr: srvReg.Base, Len: 0}, "req", ErrInvalidArgument},
		{"wrong device", Desc{Addr: srvReg.Base, Len: pg, DevID: 7}, "req", ErrOutOfRange},
		{"block not covered", Desc{Addr: srvReg.Base + 5*blockLen, Len: pg}, "req", ErrCapabilityDenied},
		{"other request id", Desc{Addr: srvReg.Base, Len: pg}, "other", ErrCapabilityDenied},
	}
	for _, tt := range tests {
		for _, op := range []Op{OpRead, OpWrite} {
			t.Run(op.String()+" "+tt.name, func(t *testing.T) {
				x := &Xfer{Op: op, Peer: peer, RequestID: tt.req, Capability: capab,
					Local: []Desc{{Addr: cliReg.Base, Len: max(tt.remote.Len, 1)}}, Remote: []Desc{tt.remote}}
				if tt.remote.Len == 0 {
					// The local side refuses a zero length itself; send the bad
					// descriptor through a prepared list to reach the server.
					_, err := cli.Prepare(t.Context(), peer, []Desc{tt.remote})
					require.ErrorIs(t, err, tt.want)
					return
				}
				_, err := cli.Transfer(t.Context(), x)
				if tt.want == nil {
					require.NoError(t, err)
					if op == OpWrite {
						fill(cliMem, 3) // restore what the write changed
						copy(srvMem, before)
					}
					return
				}
				require.ErrorIs(t, err, tt.want)
				var xe *XferError
				require.ErrorAs(t, err, &xe)
				require.Equal(t, codes.Of(tt.want), xe.Code())
				require.Zero(t, xe.Bytes)
				require.True(t, bytes.Equal(before, srvMem), "serving memory changed")
			})
		}
	}
	t.Run("index beyond prepared list", func(t *testing.T) {
		l, err := cli.Prepare(t.Context(), peer, []Desc{{Addr: srvReg.Base, Len: pg}})
		require.NoError(t, err)
		// Bypass the local index check to exercise the server's.
		l.descs = append(l.descs, Desc{Addr: srvReg.Base, Len: pg})
		_, err = cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer, RequestID: "req", Capability: capab,
			Local: []Desc{{Addr: cliReg.Base, Len: pg}}, RemoteList: l, Indices: []uint32{1}})
		require.ErrorIs(t, err, ErrOutOfRange)
	})
}

// TestBlockBoundBeforeAuthorize sends descriptors naming more blocks than
// MaxBlocksPerTransfer, or block ids beyond uint32, and checks the server
// refuses them without calling Authorize or touching memory.
func TestBlockBoundBeforeAuthorize(t *testing.T) {
	const size = 2 << 20
	// A region of 2^40 one-byte blocks; only its first bytes are backed,
	// which is safe because nothing past the refusal reads it.
	backing := make([]byte, 4096)
	srvReg := Region{Base: 1 << 44, Len: 1 << 40, BlockLen: 1, Mem: SliceMemory(backing)}
	var authorized atomic.Int32
	srv := startAgent(t, Config{Regions: []Region{srvReg}, Authorize: func(context.Context, *Access) error {
		authorized.Add(1)
		return nil
	}})
	cliMem := mmapRegion(t, size)
	cliReg := SliceRegion(cliMem, 0, 0)
	cli := startAgent(t, Config{Regions: []Region{cliReg}})
	tests := []struct {
		name    string
		remote  Desc
		want    error
		wantMsg string
	}{
		{"2 MiB of one-byte blocks", Desc{Addr: srvReg.Base, Len: size}, ErrInvalidArgument, "touch 2097152 blocks, more than the limit of 1048576"},
		{"block id beyond uint32", Desc{Addr: srvReg.Base + 1<<32, Len: 4096}, ErrOutOfRange, "beyond the uint32 block ids"},
	}
	for _, tt := range tests {
		for _, op := range []Op{OpRead, OpWrite} {
			t.Run(op.String()+" "+tt.name, func(t *testing.T) {
				_, err := cli.Transfer(t.Context(), &Xfer{Op: op, Peer: srv.Addr().String(), RequestID: "r",
					Local: []Desc{{Addr: cliReg.Base, Len: tt.remote.Len}}, Remote: []Desc{tt.remote}})
				require.ErrorIs(t, err, tt.want)
				require.ErrorContains(t, err, tt.wantMsg)
				require.Zero(t, authorized.Load(), "Authorize ran for a refused transfer")
				require.Equal(t, make([]byte, len(backing)), backing, "serving memory changed")
			})
		}
	}
}

func TestWriteFailsWithoutAck(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := testutil.NewSimNet(time.Millisecond)
		srvTLS, cliTLS := simTLS(t)
		pc := n.Listen(t, simServer)
		const size = 4 << 20
		srvMem, cliMem := mmapRegion(t, size), mmapRegion(t, size)
		fill(cliMem, 9)
		srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
		srv := startAgent(t, Config{PacketConn: pc, ServerTLS: srvTLS, Regions: []Region{srvReg}, Authorize: allowAll,
			testHook: func(ev string, _ uint64) {
				if ev == "before-ack" {
					pc.Kill() // every byte landed; the receiver dies before acking
				}
			}})
		cli := startAgent(t, Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ServerTLS: srvTLS, ClientTLS: cliTLS,
			Regions: []Region{cliReg}, ProgressTimeout: 300 * time.Millisecond})
		_, err := cli.Transfer(t.Context(), &Xfer{Op: OpWrite, Peer: srv.Addr().String(),
			Local: []Desc{{Addr: cliReg.Base, Len: size}}, Remote: []Desc{{Addr: srvReg.Base, Len: size}}})
		require.ErrorIs(t, err, ErrTimeout)
		var xe *XferError
		require.ErrorAs(t, err, &xe)
		require.Zero(t, xe.Bytes, "no bytes may count as landed without an ack")
		require.Equal(t, uint64(size), xe.Sent)
		require.True(t, bytes.Equal(cliMem, srvMem), "the receiver did read every byte before dying")
	})
}

func TestKillServerMidRead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := testutil.NewSimNet(time.Millisecond)
		srvTLS, cliTLS := simTLS(t)
		pc := n.Listen(t, simServer)
		const size = 16 << 20
		srvMem, cliMem := mmapRegion(t, size), mmapRegion(t, size)
		srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
		const progress = 300 * time.Millisecond
		srv := startAgent(t, Config{PacketConn: pc, ServerTLS: srvTLS, Regions: []Region{srvReg}, Authorize: allowAll, ProgressTimeout: progress})
		var released atomic.Bool
		cli := startAgent(t, Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ServerTLS: srvTLS, ClientTLS: cliTLS,
			Regions: []Region{cliReg}, ProgressTimeout: progress,
			testHook: func(ev string, _ uint64) {
				if ev == "released" {
					released.Store(true)
				}
			}})
		peer := srv.Addr().String()
		_, err := cli.Handshake(t.Context(), peer, &v1.HandshakeRequest{})
		require.NoError(t, err)
		pc.KillAfter(size / 4)
		start := time.Now()
		_, err = cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer,
			Local: []Desc{{Addr: cliReg.Base, Len: size}}, Remote: []Desc{{Addr: srvReg.Base, Len: size}}})
		require.ErrorIs(t, err, ErrTimeout)
		var xe *XferError
		require.ErrorAs(t, err, &xe)
		require.Greater(t, xe.Bytes, uint64(0))
		require.Less(t, xe.Bytes, uint64(size))
		// Either side's watchdog may fire first (the client's "no progress", or
		// the server's reset with CODE_TIMEOUT): both are the promised class.
		require.Equal(t, v1.Code_CODE_TIMEOUT, xe.Code())
		require.LessOrEqual(t, time.Since(start), progress+100*time.Millisecond, "reported within the progress deadline")
		require.True(t, released.Load(), "local pages handed back")
		select {
		case <-pc.Dead():
		default:
			t.Fatal("the serving socket never went dark")
		}
	})
}

// unmappedMemory is host memory that cannot be mapped, so the agent
// stages copies.
type unmappedMemory struct{ SliceMemory }

func (unmappedMemory) HostBytes(off, n uint64) ([]byte, error) {
	return nil, errors.New("device memory")
}

// stallMemory is host memory that cannot be mapped, so the agent stages
// copies; CopyOut blocks after the first chunk until unblock is closed.
type stallMemory struct {
	unmappedMemory
	calls   atomic.Int32
	started chan struct{}
	unblock chan struct{}
}

func (m *stallMemory) CopyOut(off uint64, dst []byte) error {
	if m.calls.Add(1) == 2 {
		close(m.started)
		<-m.unblock
	}
	return m.SliceMemory.CopyOut(off, dst)
}

func TestAbortReleasesAfterReset(t *testing.T) {
	const size = 8 << 20
	srvMem, cliMem := mmapRegion(t, size), mmapRegion(t, size)
	sm := &stallMemory{unmappedMemory: unmappedMemory{srvMem}, started: make(chan struct{}), unblock: make(chan struct{})}
	srvReg := SliceRegion(srvMem, 0, 0)
	srvReg.Mem = sm
	cliReg := SliceRegion(cliMem, 0, 0)
	srv := startAgent(t, Config{Regions: []Region{srvReg}, Authorize: allowAll})
	t.Cleanup(func() { close(sm.unblock) })
	var mu sync.Mutex
	var events []string
	cli := startAgent(t, Config{Regions: []Region{cliReg}, testHook: func(ev string, _ uint64) {
		mu.Lock()
		events = append(events, ev)
		mu.Unlock()
	}})
	ctx, cancel := context.WithCancelCause(t.Context())
	errUser := errors.New("user abort")
	go func() {
		<-sm.started
		cancel(errUser)
	}()
	_, err := cli.Transfer(ctx, &Xfer{Op: OpRead, Peer: srv.Addr().String(),
		Local: []Desc{{Addr: cliReg.Base, Len: size}}, Remote: []Desc{{Addr: srvReg.Base, Len: size}}})
	require.ErrorIs(t, err, ErrAborted)
	require.ErrorIs(t, err, errUser)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"reset", "released"}, events)
}

func TestZeroRTT(t *testing.T) {
	srvTLS, _ := testTLS(t)
	var forget atomic.Bool
	// A fixed ticket key, so the agent's copy of srvTLS and DecryptTicket
	// below agree.
	srvTLS.SetSessionTicketKeys([][32]byte{{1, 2, 3}})
	srvTLS.UnwrapSession = func(identity []byte, cs tls.ConnectionState) (*tls.SessionState, error) {
		if forget.Load() {
			return nil, nil
		}
		return srvTLS.DecryptTicket(identity, cs)
	}
	var handshakes atomic.Int32
	srv := startAgent(t, Config{ServerTLS: srvTLS, OnHandshake: func(_ context.Context, req *v1.HandshakeRequest) *v1.HandshakeResponse {
		handshakes.Add(1)
		return &v1.HandshakeResponse{Metadata: &v1.AgentMetadata{EngineId: req.GetExpectedEngineId()}}
	}})
	var gone atomic.Int32
	cli := startAgent(t, Config{OnPeerGone: func(string, error) { gone.Add(1) }})
	peer := srv.Addr().String()
	call := func(t *testing.T) PeerInfo {
		t.Helper()
		resp, err := cli.Handshake(t.Context(), peer, &v1.HandshakeRequest{ExpectedEngineId: "e1"})
		require.NoError(t, err)
		require.Equal(t, "e1", resp.GetMetadata().GetEngineId())
		info, err := cli.PeerInfo(t.Context(), peer)
		require.NoError(t, err)
		return info
	}
	first := call(t)
	require.False(t, first.Used0RTT)
	require.Equal(t, 1, first.Dials)
	require.Equal(t, first, call(t), "the connection is reused")

	cli.Disconnect(peer)
	second := call(t)
	require.True(t, second.Used0RTT, "a returning peer uses 0-RTT")
	require.Equal(t, 2, second.Dials)

	forget.Store(true)
	cli.Disconnect(peer)
	n := handshakes.Load()
	third := call(t)
	require.False(t, third.Used0RTT, "the server forgot its tickets")
	require.Equal(t, 3, third.Dials)
	require.Equal(t, n+1, handshakes.Load(), "the rejected request was resent and served once")
	require.Equal(t, int32(2), gone.Load())
}

func TestNotifications(t *testing.T) {
	var mu sync.Mutex
	var got []string
	srv := startAgent(t, Config{OnNotification: func(_ context.Context, _ string, n *v1.Notification) error {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, string(n.GetPayload()))
		switch n.GetRequestId() {
		case "known":
			return nil
		case "expired":
			return codes.New(v1.Code_CODE_LEASE_EXPIRED, "lease of %q expired", n.GetRequestId())
		}
		return codes.New(v1.Code_CODE_NOT_FOUND, "request %q unknown", n.GetRequestId())
	}})
	cli := startAgent(t, Config{})
	peer := srv.Addr().String()
	tests := []struct {
		req  string
		want error
	}{{"known", nil}, {"expired", ErrLeaseExpired}, {"unknown", ErrNotFound}}
	for _, tt := range tests {
		t.Run(tt.req, func(t *testing.T) {
			err := cli.Notify(t.Context(), peer, &v1.Notification{RequestId: tt.req, Payload: []byte(tt.req)})
			if tt.want == nil {
				require.NoError(t, err)
			} else {
				require.ErrorIs(t, err, tt.want)
			}
		})
	}
	t.Run("in order", func(t *testing.T) {
		mu.Lock()
		got = nil
		mu.Unlock()
		var want []string
		for i := range 50 {
			p := string(rune('A' + i%26))
			want = append(want, p)
			require.NoError(t, cli.Notify(t.Context(), peer, &v1.Notification{RequestId: "known", Payload: []byte(p)}))
		}
		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, want, got)
	})
}

func TestMetricsAndHeartbeat(t *testing.T) {
	const size = 1 << 20
	srvMem, cliMem := mmapRegion(t, size), mmapRegion(t, size)
	srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
	reg := prometheus.NewRegistry()
	srv := startAgent(t, Config{Regions: []Region{srvReg}, Authorize: allowAll})
	cli := startAgent(t, Config{Regions: []Region{cliReg}, Registerer: reg})
	peer := srv.Addr().String()
	_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer,
		Local: []Desc{{Addr: cliReg.Base, Len: size}}, Remote: []Desc{{Addr: srvReg.Base, Len: size}}})
	require.NoError(t, err)
	_, err = cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer,
		Local: []Desc{{Addr: cliReg.Base, Len: size}}, Remote: []Desc{{Addr: srvReg.Base + size, Len: size}}})
	require.ErrorIs(t, err, ErrOutOfRange)
	require.Equal(t, float64(size), promtest.ToFloat64(cli.m.bytes.WithLabelValues("read", "client")))
	require.Equal(t, 1.0, promtest.ToFloat64(cli.m.xfers.WithLabelValues("read", "client", "ok")))
	require.Equal(t, 1.0, promtest.ToFloat64(cli.m.failures.WithLabelValues("CODE_OUT_OF_RANGE")))
	require.Equal(t, 0.0, promtest.ToFloat64(cli.m.inflight))
	require.Equal(t, 1.0, promtest.ToFloat64(cli.m.dials))
	n, err := promtest.GatherAndCount(reg, "kvsidecar_transfer_xfer_seconds")
	require.NoError(t, err)
	require.Equal(t, 2, n, "read and write, both present from the start")
	require.Equal(t, uint64(size), cli.BytesMoved(), "the payload, counted as it landed")

	ack, err := cli.Heartbeat(t.Context(), peer, &v1.Heartbeat{RequestIds: []string{"a", "b"}})
	require.NoError(t, err)
	require.Equal(t, []int64{0, 0}, ack.GetLeaseExpiresUnixMs())
}

func TestCloseTwice(t *testing.T) {
	a, err := New(nil)
	require.NoError(t, err)
	require.NoError(t, a.Close())
	require.ErrorIs(t, a.Close(), net.ErrClosed)
	_, err = a.Transfer(context.Background(), &Xfer{Op: OpRead})
	require.Error(t, err)
}

// TestReleaseAfterServedTransfer: Release is called once for every access
// Authorize allowed, after the serving stopped touching memory, and never
// for a refused one (the connector pins a lease's blocks in between).
func TestReleaseAfterServedTransfer(t *testing.T) {
	const size = 1 << 20
	srvMem, cliMem := mmapRegion(t, size), mmapRegion(t, size)
	srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
	released := make(chan *Access, 4)
	var authorized atomic.Int32
	srv := startAgent(t, Config{Regions: []Region{srvReg},
		Authorize: func(_ context.Context, a *Access) error {
			if a.RequestID == "denied" {
				return errorf(v1.Code_CODE_CAPABILITY_DENIED, "no")
			}
			authorized.Add(1)
			return nil
		},
		Release: func(a *Access) { released <- a }})
	cli := startAgent(t, Config{Regions: []Region{cliReg}})
	x := &Xfer{Op: OpRead, Peer: srv.Addr().String(), RequestID: "ok",
		Local: []Desc{{Addr: cliReg.Base, Len: size}}, Remote: []Desc{{Addr: srvReg.Base, Len: size}}}
	_, err := cli.Transfer(t.Context(), x)
	require.NoError(t, err)
	a := <-released // Release was called after the READ (a hang ends at go test's -timeout)
	require.Equal(t, "ok", a.RequestID)
	require.Equal(t, uint64(srvReg.Base), a.Descs[0].Addr)
	x.RequestID = "denied"
	_, err = cli.Transfer(t.Context(), x)
	require.ErrorIs(t, err, ErrCapabilityDenied)
	require.Equal(t, int32(1), authorized.Load())
	require.NoError(t, srv.Close())
	require.Empty(t, released, "no Release for a refused access")
}

// TestSharedDialOutlivesFirstCaller: the caller whose call started a dial
// gives up at once; a second caller waiting on the same peer still gets the
// connection, and only one dial was made.
func TestSharedDialOutlivesFirstCaller(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := testutil.NewSimNet(20 * time.Millisecond) // the dial takes a few round trips of 40 ms
		srvTLS, cliTLS := simTLS(t)
		var handshakes atomic.Int32
		srv := startAgent(t, Config{PacketConn: n.Listen(t, simServer), ServerTLS: srvTLS,
			OnHandshake: func(context.Context, *v1.HandshakeRequest) *v1.HandshakeResponse {
				handshakes.Add(1)
				return &v1.HandshakeResponse{}
			}})
		cli := startAgent(t, Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ServerTLS: srvTLS, ClientTLS: cliTLS})
		peer := srv.Addr().String()

		gone := errors.New("first caller gave up")
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(gone)
		_, err := cli.Handshake(ctx, peer, &v1.HandshakeRequest{})
		require.ErrorIs(t, err, gone, "the aborted caller returns its own cause")
		require.Equal(t, 1, cli.DialCount(peer), "the aborted call started the dial")

		_, err = cli.Handshake(t.Context(), peer, &v1.HandshakeRequest{})
		require.NoError(t, err, "the dial kept going for the second caller")
		require.Equal(t, 1, cli.DialCount(peer), "the second caller shared the first dial")
		require.Equal(t, int32(1), handshakes.Load())
	})
}

// TestDialBoundedByHandshakeTimeout dials a socket that never answers: the
// dial ends after Config.HandshakeTimeout, not at the caller's deadline.
func TestDialBoundedByHandshakeTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := testutil.NewSimNet(time.Millisecond)
		_, cliTLS := simTLS(t)
		silent := n.Listen(t, simServer)
		cli := startAgent(t, Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ClientTLS: cliTLS, HandshakeTimeout: 300 * time.Millisecond})
		start := time.Now()
		_, err := cli.Handshake(t.Context(), silent.LocalAddr().String(), &v1.HandshakeRequest{})
		require.ErrorIs(t, err, ErrUnavailable)
		require.Equal(t, 300*time.Millisecond, time.Since(start), "the dial ended at Config.HandshakeTimeout")
	})
}

// TestPreparedListsBoundedAndReleased: a connection may hold at most
// Config.MaxPreparedDescsPerConn prepared descriptors; DescList.Close
// releases a list on the peer, making room again.
func TestPreparedListsBoundedAndReleased(t *testing.T) {
	const pg = 4096
	srvMem, cliMem := mmapRegion(t, 4*pg), mmapRegion(t, 4*pg)
	fill(srvMem, 5)
	srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
	srv := startAgent(t, Config{Regions: []Region{srvReg}, Authorize: allowAll, MaxPreparedDescsPerConn: 3})
	cli := startAgent(t, Config{Regions: []Region{cliReg}})
	peer := srv.Addr().String()
	two := []Desc{{Addr: srvReg.Base, Len: pg}, {Addr: srvReg.Base + pg, Len: pg}}

	first, err := cli.Prepare(t.Context(), peer, two)
	require.NoError(t, err)
	_, err = cli.Prepare(t.Context(), peer, two)
	require.ErrorIs(t, err, ErrBusy)
	require.ErrorContains(t, err, "2 descriptors on top of the 2 prepared on this connection exceed its limit of 3")

	require.NoError(t, first.Close(t.Context()))
	require.ErrorIs(t, first.Close(t.Context()), net.ErrClosed)
	_, err = cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer,
		Local: []Desc{{Addr: cliReg.Base, Len: pg}}, RemoteList: first, Indices: []uint32{0}})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, err, net.ErrClosed)

	second, err := cli.Prepare(t.Context(), peer, two)
	require.NoError(t, err, "the closed list's descriptors were released on the peer")
	_, err = cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: peer,
		Local: []Desc{{Addr: cliReg.Base, Len: pg}}, RemoteList: second, Indices: []uint32{1}})
	require.NoError(t, err)
	require.Equal(t, srvMem[pg:2*pg], cliMem[:pg])

	t.Run("close after the connection ended", func(t *testing.T) {
		cli.Disconnect(peer)
		require.NoError(t, second.Close(t.Context()), "nothing is left to release")
		third, err := cli.Prepare(t.Context(), peer, two)
		require.NoError(t, err, "a new connection starts with an empty bound")
		require.NoError(t, third.Close(t.Context()))
	})
}
