package transfer

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/netem"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// simTLS returns mutual-TLS configs of a fresh dev CA. Under synctest it
// must be called inside the bubble: the certificates' validity starts at
// the bubble's clock.
func simTLS(t testing.TB) (srv, cli *tls.Config) {
	t.Helper()
	ca, err := devtls.NewCA()
	require.NoError(t, err)
	srv, err = ca.ServerConfig()
	require.NoError(t, err)
	cli, err = ca.ClientConfig()
	require.NoError(t, err)
	return srv, cli
}

// simPeer is one process serving memory at a fixed address of a SimNet.
type simPeer struct {
	a   *Agent
	pc  *netem.PacketConn
	mem []byte
	reg Region
}

const simServer = "127.0.0.1:5600"

// startSimPeer starts a serving agent at simServer that answers every call
// and serves 64 KiB of memory filled from seed.
func startSimPeer(t *testing.T, n *testutil.SimNet, srvTLS *tls.Config, key *quic.StatelessResetKey, seed byte) *simPeer {
	t.Helper()
	return startSimPeerOn(t, n.Listen(t, simServer), srvTLS, key, seed)
}

// startSimPeerOn is startSimPeer on a socket the test opened.
func startSimPeerOn(t *testing.T, pc *netem.PacketConn, srvTLS *tls.Config, key *quic.StatelessResetKey, seed byte) *simPeer {
	t.Helper()
	mem := make([]byte, 64<<10)
	fill(mem, seed)
	srvTLS = srvTLS.Clone()
	srvTLS.SetSessionTicketKeys([][32]byte{{seed}}) // a new process has new ticket keys
	p := &simPeer{pc: pc, mem: mem, reg: SliceRegion(mem, 0, 0)}
	a, err := New(&Config{PacketConn: p.pc, ServerTLS: srvTLS, StatelessResetKey: key, Regions: []Region{p.reg},
		Authorize: allowAll,
		OnHandshake: func(context.Context, *v1.HandshakeRequest) *v1.HandshakeResponse {
			return &v1.HandshakeResponse{Metadata: &v1.AgentMetadata{EngineId: fmt.Sprint(seed)}}
		},
		OnHeartbeat: func(context.Context, string, *v1.Heartbeat) *v1.HeartbeatAck { return &v1.HeartbeatAck{} },
		OnNotification: func(context.Context, string, *v1.Notification) error {
			return nil
		}})
	require.NoError(t, err)
	p.a = a
	t.Cleanup(func() { _ = a.Close() })
	return p
}

// kill ends the process without a word: its socket goes dark first, so
// the CONNECTION_CLOSE of Close never leaves.
func (p *simPeer) kill(t *testing.T) {
	t.Helper()
	p.pc.Kill()
	require.NoError(t, p.a.Close())
}

// restartedPeer starts a peer on a SimNet and a dialer (serving mem) that
// handshakes with it, then kills the peer and starts another process on its
// address with the same stateless-reset key, which it returns: the dialer
// still holds its connection to the dead one.
func restartedPeer(t *testing.T, mem []byte, onGone func(string, error)) (*Agent, *simPeer) {
	t.Helper()
	key := &quic.StatelessResetKey{7}
	n := testutil.NewSimNet(time.Millisecond)
	srvTLS, cliTLS := simTLS(t)
	first := startSimPeer(t, n, srvTLS, key, 1)
	cli, err := New(&Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ClientTLS: cliTLS, Regions: []Region{SliceRegion(mem, 0, 0)},
		OnPeerGone: onGone})
	require.NoError(t, err)
	t.Cleanup(func() { _ = cli.Close() })
	// Until a connection is in 0-RTT: the dialer then holds a session
	// ticket, so its redial tries 0-RTT, which the new process rejects.
	// Each heartbeat waits for the handshake on both sides, so the kill
	// comes after the handshake is confirmed, as on a connection in use.
	for {
		_, err = cli.Handshake(t.Context(), simServer, &v1.HandshakeRequest{})
		require.NoError(t, err)
		_, err = cli.Heartbeat(t.Context(), simServer, &v1.Heartbeat{})
		require.NoError(t, err)
		info, err := cli.PeerInfo(t.Context(), simServer)
		require.NoError(t, err)
		if info.Used0RTT {
			break
		}
		require.Less(t, info.Dials, 5, "no 0-RTT connection")
		cli.Disconnect(simServer)
	}
	first.kill(t)
	return cli, startSimPeer(t, n, srvTLS, key, 2)
}

// TestRedialRule: every call on a cached connection to a peer that
// restarted on its address (same stateless-reset key) meets the reset,
// redials once and succeeds on the new process; the race is deterministic
// because the reset is the new process's answer to the call's own packet
// (quic-go answers only packets over 42 bytes: each request carries what a
// real one does, metadata or a capability). The redial tries 0-RTT with
// the old process's ticket, which the new one rejects: the request is sent
// again on the completed connection.
//
// fault-matrix: dead-connection-redialed
func TestRedialRule(t *testing.T) {
	var mem []byte
	ops := []struct {
		name string
		run  func(ctx context.Context, a *Agent, srv *simPeer, onRedial func(context.Context) error) error
	}{
		{"handshake", func(ctx context.Context, a *Agent, srv *simPeer, _ func(context.Context) error) error {
			resp, err := a.Handshake(ctx, simServer, &v1.HandshakeRequest{ExpectedEngineId: "prefill-a", Dialer: &v1.AgentMetadata{EngineId: "decode-a"}})
			if err == nil && resp.GetMetadata().GetEngineId() != "2" {
				err = fmt.Errorf("answered by %q, want the new process", resp.GetMetadata().GetEngineId())
			}
			return err
		}},
		{"heartbeat", func(ctx context.Context, a *Agent, _ *simPeer, _ func(context.Context) error) error {
			_, err := a.Heartbeat(ctx, simServer, &v1.Heartbeat{RequestIds: []string{"r"}, Capabilities: [][]byte{make([]byte, 48)}})
			return err
		}},
		{"notification", func(ctx context.Context, a *Agent, _ *simPeer, _ func(context.Context) error) error {
			return a.Notify(ctx, simServer, &v1.Notification{RequestId: "r", Capability: make([]byte, 48)})
		}},
		{"prepare", func(ctx context.Context, a *Agent, srv *simPeer, _ func(context.Context) error) error {
			_, err := a.Prepare(ctx, simServer, []Desc{{Addr: srv.reg.Base, Len: 4096}, {Addr: srv.reg.Base + 4096, Len: 4096}, {Addr: srv.reg.Base + 8192, Len: 4096}})
			return err
		}},
		{"read", func(ctx context.Context, a *Agent, srv *simPeer, onRedial func(context.Context) error) error {
			clear(mem)
			_, err := a.Transfer(ctx, &Xfer{Op: OpRead, Peer: simServer, OnRedial: onRedial,
				Local: []Desc{{Addr: SliceRegion(mem, 0, 0).Base, Len: 8192}}, Remote: []Desc{{Addr: srv.reg.Base, Len: 8192}}})
			if err == nil && !bytes.Equal(mem[:8192], srv.mem[:8192]) {
				err = errors.New("READ bytes differ from the new process's memory")
			}
			return err
		}},
		{"write", func(ctx context.Context, a *Agent, srv *simPeer, onRedial func(context.Context) error) error {
			fill(mem, 9)
			_, err := a.Transfer(ctx, &Xfer{Op: OpWrite, Peer: simServer, OnRedial: onRedial,
				Local: []Desc{{Addr: SliceRegion(mem, 0, 0).Base, Len: 8192}}, Remote: []Desc{{Addr: srv.reg.Base, Len: 8192}}})
			if err == nil && !bytes.Equal(mem[:8192], srv.mem[:8192]) {
				err = errors.New("WRITE bytes did not land in the new process's memory")
			}
			return err
		}},
	}
	for _, op := range ops {
		t.Run(op.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				mem = make([]byte, 64<<10)
				var gone atomic.Int32
				cli, second := restartedPeer(t, mem, func(string, error) { gone.Add(1) })
				dialsBefore := cli.DialCount(simServer)
				var redials atomic.Int32
				onRedial := func(context.Context) error {
					redials.Add(1)
					require.Equal(t, int32(dialsBefore), gone.Load(), "OnPeerGone ran before the new connection was used")
					return nil
				}
				start := time.Now()
				require.NoError(t, op.run(t.Context(), cli, second, onRedial))
				require.Less(t, time.Since(start), 100*time.Millisecond, "the call's own packet drew the reset (50 RTTs)")
				require.Equal(t, dialsBefore+1, cli.DialCount(simServer), "one redial")
				require.Equal(t, int32(dialsBefore), gone.Load())
				if op.name == "read" || op.name == "write" {
					require.Equal(t, int32(1), redials.Load(), "Xfer.OnRedial ran before the transfer was sent again")
				}
			})
		})
	}
}

// TestRedialStoppedByOnRedial: a transfer whose OnRedial refuses the new
// connection fails with that error and is not sent.
//
// fault-matrix: dead-connection-redialed
func TestRedialStoppedByOnRedial(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := make([]byte, 8192)
		cli, second := restartedPeer(t, mem, nil)
		dialsBefore := cli.DialCount(simServer)
		errMoved := errors.New("the peer is another process now")
		_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: simServer,
			OnRedial: func(context.Context) error { return errMoved },
			Local:    []Desc{{Addr: SliceRegion(mem, 0, 0).Base, Len: 8192}}, Remote: []Desc{{Addr: second.reg.Base, Len: 8192}}})
		require.ErrorIs(t, err, errMoved)
		require.Equal(t, make([]byte, 8192), mem, "nothing was read")
		require.Equal(t, dialsBefore+1, cli.DialCount(simServer))
	})
}

// TestRedialFailsWithTheOriginalCause: a peer that died and did not come
// back leaves the call on a silent connection until the idle timeout; the
// one redial finds nobody either, and the call fails with the idle
// timeout, not the redial's error.
//
// fault-matrix: dead-connection-redialed
func TestRedialFailsWithTheOriginalCause(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := testutil.NewSimNet(time.Millisecond)
		srvTLS, cliTLS := simTLS(t)
		first := startSimPeer(t, n, srvTLS, nil, 1)
		cli, err := New(&Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ClientTLS: cliTLS})
		require.NoError(t, err)
		t.Cleanup(func() { _ = cli.Close() })
		_, err = cli.Heartbeat(t.Context(), simServer, &v1.Heartbeat{}) // waits for the confirmed handshake
		require.NoError(t, err)
		first.kill(t)
		start := time.Now()
		_, err = cli.Handshake(t.Context(), simServer, &v1.HandshakeRequest{})
		require.ErrorIs(t, err, ErrTimeout)
		_, idle := errors.AsType[*quic.IdleTimeoutError](err)
		require.True(t, idle, "the original cause: %v", err)
		require.Equal(t, 2, cli.DialCount(simServer), "one redial")
		elapsed := time.Since(start)
		require.GreaterOrEqual(t, elapsed, DefaultMaxIdleTimeout, "the call waited for the idle timeout")
		require.LessOrEqual(t, elapsed, DefaultMaxIdleTimeout+2*DefaultHandshakeTimeout, "then one dial bounded by HandshakeTimeout")
	})
}

// TestRefusalNotRedialed: a peer that refuses the TLS handshake, on either
// side, is dialed once per call, never twice.
//
// fault-matrix: refusal-not-redialed
func TestRefusalNotRedialed(t *testing.T) {
	tests := []struct {
		name string
		// cfgs returns the server's and the client's TLS configs.
		cfgs func(t *testing.T) (srv, cli *tls.Config)
	}{
		{"server certificate from an unknown CA", func(t *testing.T) (*tls.Config, *tls.Config) {
			srv, _ := simTLS(t)
			_, cli := simTLS(t)
			return srv, cli
		}},
		{"client certificate from an unknown CA", func(t *testing.T) (*tls.Config, *tls.Config) {
			srv, cli := simTLS(t)
			_, other := simTLS(t)
			cli.Certificates = other.Certificates
			return srv, cli
		}},
		{"no client certificate", func(t *testing.T) (*tls.Config, *tls.Config) {
			srv, cli := simTLS(t)
			cli.Certificates = nil
			return srv, cli
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				n := testutil.NewSimNet(time.Millisecond)
				srvTLS, cliTLS := tc.cfgs(t)
				startSimPeer(t, n, srvTLS, &quic.StatelessResetKey{7}, 1)
				cli, err := New(&Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ClientTLS: cliTLS})
				require.NoError(t, err)
				t.Cleanup(func() { _ = cli.Close() })
				for call := 1; call <= 2; call++ {
					// A call that started before the refusal (as a
					// connector's READ racing its metadata exchange does)
					// and asks for the connection only after it was
					// refused and dropped gets the refusal, not a dial.
					early := cli.dialer.calls.Add(1)
					// So does a call whose goroutine starts only after
					// the refusal, on a context marked before it (a
					// connector marks each load's).
					marked := cli.MarkCalls(t.Context())
					_, err = cli.Handshake(t.Context(), simServer, &v1.HandshakeRequest{})
					require.Error(t, err)
					var te *quic.TransportError
					require.ErrorAs(t, err, &te, "a TLS alert")
					require.True(t, te.ErrorCode.IsCryptoError(), "a TLS alert: %v", err)
					require.Equal(t, call, cli.DialCount(simServer), "dialed once per call")
					synctest.Wait()
					_, lateErr := cli.dialer.peerFor(t.Context(), simServer, early)
					require.Equal(t, err.Error(), lateErr.Error(), "the call that raced it meets the same refusal")
					_, markedErr := cli.Handshake(marked, simServer, &v1.HandshakeRequest{})
					require.Error(t, markedErr)
					require.Equal(t, err.Error(), markedErr.Error(), "a call marked before the refusal meets it too")
					require.Equal(t, call, cli.DialCount(simServer), "without a dial of its own")
					// Let the refused connection finish closing: quic-go fails
					// its streams before it ends it, and a call in between
					// would meet the same refusal on it without a dial.
					synctest.Wait()
				}
			})
		})
	}
}

// TestIdleDialerNoticesRestart: a dialer that sends nothing learns that its
// peer restarted on the same address (same stateless-reset key) within two
// keep-alive periods, from the reset its keep-alive probe draws; with
// quic-go's PINGs alone (too small for a reset) it took until the idle
// timeout.
//
// fault-matrix: idle-peer-restart-noticed
func TestIdleDialerNoticesRestart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		gone := make(chan time.Time, 8)
		cli, _ := restartedPeer(t, make([]byte, 4096), func(string, error) { gone <- time.Now() })
		restarted, dials := time.Now(), cli.DialCount(simServer)
		for range dials - 1 {
			<-gone // the connections restartedPeer closed itself
		}
		synctest.Wait()
		require.True(t, cli.Alive(simServer), "nothing noticed the restart yet")
		at := <-gone
		t.Logf("noticed %v after the restart", at.Sub(restarted))
		require.LessOrEqual(t, at.Sub(restarted), 2*DefaultKeepAlivePeriod, "noticed %v after the restart", at.Sub(restarted))
		require.False(t, cli.Alive(simServer))
		require.Equal(t, dials, cli.DialCount(simServer), "dropped the connection, dialed nothing")
	})
}

// TestCodedRefusalNotRedialed: a peer that refuses a READ with a code
// (capability, lease, incompatibility, a draining peer's unavailable) is
// answered on a live connection: the call fails with that class and
// nothing is dialed again.
//
// fault-matrix: refusal-not-redialed
func TestCodedRefusalNotRedialed(t *testing.T) {
	for _, refusal := range []error{ErrCapabilityDenied, ErrLeaseExpired, ErrIncompatible, ErrUnavailable} {
		t.Run(codes.Of(refusal).String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				n := testutil.NewSimNet(time.Millisecond)
				srvTLS, cliTLS := simTLS(t)
				srvMem, cliMem := make([]byte, 8192), make([]byte, 8192)
				srv := startAgent(t, Config{PacketConn: n.Listen(t, simServer), ServerTLS: srvTLS, Regions: []Region{SliceRegion(srvMem, 0, 0)},
					Authorize: func(context.Context, *Access) error { return fmt.Errorf("%w: refused", refusal) }})
				cli := startAgent(t, Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ServerTLS: srvTLS, ClientTLS: cliTLS,
					Regions: []Region{SliceRegion(cliMem, 0, 0)}})
				_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: simServer,
					Local: []Desc{{Addr: SliceRegion(cliMem, 0, 0).Base, Len: 8192}}, Remote: []Desc{{Addr: SliceRegion(srvMem, 0, 0).Base, Len: 8192}}})
				require.ErrorIs(t, err, refusal)
				require.Equal(t, 1, cli.DialCount(srv.Addr().String()), "a refusal is not redialed")
			})
		})
	}
}
