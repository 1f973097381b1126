package testutil

import (
	"net"
	"testing"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/netem"
)

// ListenUDP opens a wrapped UDP socket on 127.0.0.1:0 with the given one-way
// delay and closes it when the test ends.
func ListenUDP(t testing.TB, delay time.Duration) *netem.PacketConn {
	t.Helper()
	udp, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatalf("testutil: listen udp: %v", err)
	}
	pc := netem.New(udp, delay)
	t.Cleanup(func() { _ = pc.Close() })
	return pc
}
