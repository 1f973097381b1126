package transfer

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestUnstartedAgentServesFromStart: an agent from NewUnstarted has its
// address and dials, but answers no peer, so no serving callback runs,
// until Start; a dialer's handshake waiting meanwhile completes once it
// starts.
func TestUnstartedAgentServesFromStart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := testutil.NewSimNet(time.Millisecond)
		srvTLS, cliTLS := simTLS(t)
		var started atomic.Bool
		var served atomic.Int32
		srv, err := NewUnstarted(&Config{PacketConn: n.Listen(t, simServer), ServerTLS: srvTLS, ClientTLS: cliTLS,
			OnHandshake: func(context.Context, *v1.HandshakeRequest) *v1.HandshakeResponse {
				served.Add(1)
				if !started.Load() {
					return &v1.HandshakeResponse{Error: &v1.Error{Code: v1.Code_CODE_INTERNAL, Message: "served before Start"}}
				}
				return &v1.HandshakeResponse{}
			}})
		require.NoError(t, err)
		t.Cleanup(func() { _ = srv.Close() })
		require.Equal(t, simServer, srv.Addr().String(), "the socket is open before Start")

		cli, err := New(&Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ClientTLS: cliTLS})
		require.NoError(t, err)
		t.Cleanup(func() { _ = cli.Close() })
		done := make(chan error, 1)
		go func() {
			resp, err := cli.Handshake(t.Context(), simServer, &v1.HandshakeRequest{})
			if err == nil && resp.GetError() != nil {
				err = errorf(resp.GetError().GetCode(), "%s", resp.GetError().GetMessage())
			}
			done <- err
		}()
		time.Sleep(time.Second) // the dialer retransmits its first flight meanwhile
		synctest.Wait()
		require.Zero(t, served.Load(), "nothing is served before Start")
		select {
		case err := <-done:
			t.Fatalf("the handshake ended before Start: %v", err)
		default:
		}

		started.Store(true)
		require.NoError(t, srv.Start())
		require.NoError(t, <-done, "the waiting dialer is served once the agent starts")
		require.Equal(t, int32(1), served.Load())
		require.ErrorContains(t, srv.Start(), "already started")
	})
}

func TestStartAfterClose(t *testing.T) {
	a, err := NewUnstarted(nil)
	require.NoError(t, err)
	require.NoError(t, a.Close(), "an agent that never started closes")
	err = a.Start()
	require.ErrorIs(t, err, net.ErrClosed)
	require.ErrorIs(t, err, ErrUnavailable)
}
