package transfer

import (
	"bytes"
	"testing"
	"testing/synctest"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestStandbyRefusesAtOnce: a peer whose process restarted on the same
// address but serves nothing yet (a sidecar whose engine has not attached)
// holds its socket with a Standby. A dialer holding a connection to the old
// process gets a stateless reset for its READ, redials once and is refused
// with the standby's reason at once, not after the progress deadline on a
// silent socket. After Close, an agent adopts the same socket and serves.
//
// fault-matrix: prefill-restart-before-attach
func TestStandbyRefusesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		key := &quic.StatelessResetKey{7}
		n := testutil.NewSimNet(time.Millisecond)
		srvTLS, cliTLS := simTLS(t)
		first := startSimPeer(t, n, srvTLS, key, 1)
		mem := make([]byte, 64<<10)
		cli, err := New(&Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ClientTLS: cliTLS, Regions: []Region{SliceRegion(mem, 0, 0)}})
		require.NoError(t, err)
		t.Cleanup(func() { _ = cli.Close() })
		_, err = cli.Heartbeat(t.Context(), simServer, &v1.Heartbeat{}) // waits for the confirmed handshake
		require.NoError(t, err)
		first.kill(t)

		pc := n.Listen(t, simServer)
		const reason = "no engine attached to tp_rank 0"
		sb, err := NewStandby(&Config{PacketConn: pc, ServerTLS: srvTLS, StatelessResetKey: key}, v1.Code_CODE_UNAVAILABLE, reason)
		require.NoError(t, err)
		read := func() error {
			_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: simServer,
				Local: []Desc{{Addr: SliceRegion(mem, 0, 0).Base, Len: 8192}}, Remote: []Desc{{Addr: first.reg.Base, Len: 8192}}})
			return err
		}
		start := time.Now()
		err = read()
		require.ErrorIs(t, err, ErrUnavailable)
		require.Equal(t, v1.Code_CODE_UNAVAILABLE, codes.Of(err))
		require.Contains(t, err.Error(), reason)
		require.Less(t, time.Since(start), 100*time.Millisecond, "refused within a few RTTs (1 ms each way)")
		require.Equal(t, 2, cli.DialCount(simServer), "one redial after the reset, none after the refusal")
		require.Equal(t, make([]byte, 64<<10), mem, "nothing was read")

		// A call on no cached connection is refused as well, with one dial.
		err = read()
		require.ErrorIs(t, err, ErrUnavailable)
		require.Equal(t, 3, cli.DialCount(simServer))

		require.NoError(t, sb.Close())
		require.NoError(t, sb.Close(), "idempotent")
		second := startSimPeerOn(t, pc, srvTLS, key, 2)
		_, err = cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: simServer,
			Local: []Desc{{Addr: SliceRegion(mem, 0, 0).Base, Len: 8192}}, Remote: []Desc{{Addr: second.reg.Base, Len: 8192}}})
		require.NoError(t, err)
		require.True(t, bytes.Equal(mem[:8192], second.mem[:8192]), "served by the agent that adopted the socket")
	})
}

func TestStandbyConfig(t *testing.T) {
	srvTLS, _ := simTLS(t)
	pc := testutil.ListenUDP(t, 0)
	for _, tc := range []struct {
		name string
		cfg  *Config
		code v1.Code
		want string
	}{
		{"no socket", &Config{ServerTLS: srvTLS}, v1.Code_CODE_UNAVAILABLE, "Config.PacketConn must be set"},
		{"no TLS", &Config{PacketConn: pc}, v1.Code_CODE_UNAVAILABLE, "Config.ServerTLS must be set"},
		{"code OK", &Config{PacketConn: pc, ServerTLS: srvTLS}, v1.Code_CODE_OK, "must not be CODE_OK"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewStandby(tc.cfg, tc.code, "r")
			require.ErrorContains(t, err, tc.want)
		})
	}
}
