package transfer

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestRestartedPeerResetsStaleConnection: a serving agent's process dies
// without closing its connections and a new one starts on the same
// address. With the same StatelessResetKey the new one answers the
// dialer's stale connection with a stateless reset, so the dialer's next
// idempotent request redials and succeeds at once; without a key the
// request is lost in the dead connection until its deadline.
func TestRestartedPeerResetsStaleConnection(t *testing.T) {
	tests := []struct {
		name    string
		key     *quic.StatelessResetKey
		timeout time.Duration
		wantErr bool
	}{
		{"same key: reset and redial", &quic.StatelessResetKey{1, 2, 3}, 5 * time.Second, false},
		{"no key: stuck until the deadline", nil, 500 * time.Millisecond, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv, cli := testTLS(t)
			answer := func(context.Context, *v1.HandshakeRequest) *v1.HandshakeResponse { return &v1.HandshakeResponse{} }
			udp, err := net.ListenPacket("udp", "127.0.0.1:0")
			require.NoError(t, err)
			pc := testutil.NewPacketConn(udp, 0)
			first, err := New(&Config{PacketConn: pc, ServerTLS: srv, StatelessResetKey: tc.key, OnHandshake: answer})
			require.NoError(t, err)
			addr := first.Addr().String()
			dialer := startAgent(t, Config{ServerTLS: srv, ClientTLS: cli})
			_, err = dialer.Handshake(ctxT(t, 5*time.Second), addr, &v1.HandshakeRequest{})
			require.NoError(t, err)

			pc.Kill() // the process dies: its CONNECTION_CLOSE never leaves
			require.NoError(t, first.Close())
			second, err := New(&Config{ListenAddr: addr, ServerTLS: srv, StatelessResetKey: tc.key, OnHandshake: answer})
			require.NoError(t, err)
			t.Cleanup(func() { _ = second.Close() })

			_, err = dialer.Handshake(ctxT(t, tc.timeout), addr, &v1.HandshakeRequest{})
			if tc.wantErr {
				require.ErrorIs(t, err, ErrTimeout)
				require.Equal(t, 1, dialer.DialCount(addr), "still on the dead connection")
				return
			}
			require.NoError(t, err)
			require.Equal(t, 2, dialer.DialCount(addr), "redialed after the reset")
		})
	}
}
