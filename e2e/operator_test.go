package e2e

import (
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestAllowPeersNoDatagram is issue 13 acceptance 4: kv_transfer_params
// edited to name a plain UDP listener on loopback outside the decode's
// --allow-peers make the load fail at once, naming the address and the
// flag; the listener receives no datagram (it got ten 1280-byte QUIC
// Initials and the load failed after the 5 s handshake timeout before).
// The same decode still loads from the allowed prefill.
func TestAllowPeersNoDatagram(t *testing.T) {
	env := NewEnv(t)
	pre := env.StartSidecar(t, SidecarOpts{Engine: "prefill-ap", Role: "prefill", Args: geomFlags})
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-ap", Role: "decode",
		Args: append([]string{"--allow-peers", "127.0.0.1/32"}, geomFlags...)})
	pe, de := attach(t, pre, 256), attach(t, dec, 256)
	trap, err := net.ListenPacket("udp", "127.0.0.3:0") // loopback, outside 127.0.0.1/32
	require.NoError(t, err)
	defer trap.Close()
	dst, err := de.Alloc(t.Context(), 2)
	require.NoError(t, err)

	_, p := prefillRequest(t, pe, "req-trap", 5, 2)
	_, port, err := net.SplitHostPort(trap.LocalAddr().String())
	require.NoError(t, err)
	n, err := strconv.Atoi(port)
	require.NoError(t, err)
	p.RemoteRankAddrs, p.RemoteHost, p.RemotePort = nil, "127.0.0.3", uint32(n)
	start := time.Now()
	failed := de.load(t, "req-trap", dst, p)
	took := time.Since(start)
	require.NotNil(t, failed, "the load must fail")
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, failed.GetError().GetCode(), failed.GetError().GetMessage())
	require.Contains(t, failed.GetError().GetMessage(), "peer "+trap.LocalAddr().String()+" is outside --allow-peers=127.0.0.1/32")
	require.Less(t, took, 5*time.Second, "at once, not after the QUIC handshake timeout")
	require.NoError(t, trap.SetReadDeadline(time.Now()))
	_, _, err = trap.ReadFrom(make([]byte, 2048))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "the listener outside --allow-peers received no datagram")
	require.Zero(t, metricWith(t, dec, "kvsidecar_transfer_dials_total"), "no QUIC dial was started")

	_, p = prefillRequest(t, pe, "req-ok", 6, 2)
	require.Nil(t, de.load(t, "req-ok", dst, p), "an allowed prefill is read")
	de.check(t, 6, dst)
}
