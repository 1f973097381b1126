package transfer

import (
	"context"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

func TestParseAllowedPeers(t *testing.T) {
	s, err := ParseAllowedPeers("--allow-peers", " 10.0.0.0/8, fd00::/8,192.0.2.7, 192.0.2.8:5600,[fd01::5]:5601, Prefill-0.internal:5600 ")
	require.NoError(t, err)
	tests := []struct {
		addr string
		to   string
		ok   bool
	}{
		{"10.1.2.3:1", "10.1.2.3:1", true},
		{"11.1.2.3:1", "11.1.2.3:1", false},
		{"[fd00::1]:5600", "[fd00::1]:5600", true},
		{"192.0.2.7:9", "192.0.2.7:9", true},
		{"192.0.2.8:5600", "192.0.2.8:5600", true},
		{"192.0.2.8:5601", "192.0.2.8:5601", false},
		{"[::ffff:192.0.2.8]:5600", "[::ffff:192.0.2.8]:5600", true},
		{"[fd01::5]:5601", "[fd01::5]:5601", true},
		{"prefill-0.internal:5600", "198.51.100.1:5600", true},
		{"PREFILL-0.internal:5600", "198.51.100.1:5600", true},
		{"prefill-0.internal:5601", "198.51.100.1:5601", false},
		{"prefill-1.internal:5600", "10.9.9.9:5600", true},
	}
	for _, tc := range tests {
		err := s.check(tc.addr, netip.MustParseAddrPort(tc.to))
		if tc.ok {
			require.NoError(t, err, tc.addr)
			continue
		}
		require.ErrorIs(t, err, ErrInvalidArgument, tc.addr)
		require.ErrorContains(t, err, "peer "+tc.addr)
		require.ErrorContains(t, err, "--allow-peers=")
	}
	require.ErrorContains(t, s.check("prefill-0.internal:5601", netip.MustParseAddrPort("198.51.100.1:5601")),
		"peer prefill-0.internal:5601 (198.51.100.1:5601) is outside --allow-peers=")

	for _, bad := range []struct{ spec, want string }{
		{"", `"" names no peer`},
		{" , ", "names no peer"},
		{"10.0.0.0/33", `entry "10.0.0.0/33"`},
		{"node:0", `port "0" is not in [1, 65535]`},
		{"node:http", `port "http"`},
		{"node", `entry "node": want a CIDR prefix`},
		{":5600", `entry ":5600"`},
	} {
		_, err := ParseAllowedPeers("--allow-peers", bad.spec)
		require.ErrorContains(t, err, bad.want, bad.spec)
		require.ErrorContains(t, err, "transfer: --allow-peers: ")
	}
}

// TestAllowedPeersNoDatagram: a peer outside AllowedPeers gets no packet:
// the transfer fails at once with ErrInvalidArgument naming the address,
// and a UDP listener there has nothing to read (loopback delivers a
// datagram into the receiver's buffer before sendto returns, so nothing
// can still be on its way). An allowed peer is reached as before.
func TestAllowedPeersNoDatagram(t *testing.T) {
	trap, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	defer trap.Close()
	srvTLS, cliTLS := testTLS(t)
	srv := startAgent(t, Config{ServerTLS: srvTLS, OnHandshake: func(context.Context, *v1.HandshakeRequest) *v1.HandshakeResponse {
		return &v1.HandshakeResponse{}
	}})
	allowed, err := ParseAllowedPeers("--allow-peers", srv.Addr().String())
	require.NoError(t, err)
	cli := startAgent(t, Config{ClientTLS: cliTLS, AllowedPeers: allowed})

	_, err = cli.Handshake(t.Context(), trap.LocalAddr().String(), &v1.HandshakeRequest{})
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err), "%v", err)
	require.ErrorContains(t, err, "peer "+trap.LocalAddr().String()+" is outside --allow-peers="+srv.Addr().String())
	require.NoError(t, trap.SetReadDeadline(time.Now())) // no wait: only what is already queued is read
	_, _, err = trap.ReadFrom(make([]byte, 2048))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "no datagram reached the address outside the set")

	_, err = cli.Handshake(t.Context(), srv.Addr().String(), &v1.HandshakeRequest{})
	require.NoError(t, err, "the allowed peer is dialled")
}
