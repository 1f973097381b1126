// Package netem emulates a network path on a net.PacketConn: a fixed
// one-way delay on every datagram sent, and going dark — every datagram
// dropped in both directions, as from a host that died without a word — on
// command or once a byte budget is spent. `kvsidecar bench handshake` uses
// it to put an RTT on loopback; tests use it to delay and kill sockets
// (internal/testutil.ListenUDP, SimNet).
//
//	udp, err := net.ListenPacket("udp", "127.0.0.1:0")
//	pc := netem.New(udp, 10*time.Millisecond) // 20 ms RTT between two such sockets
//	defer pc.Close()
//	a, err := transfer.New(&transfer.Config{PacketConn: pc, ...})
//	pc.Kill() // the host is gone
package netem
