// Package netem emulates a network path on a net.PacketConn: a fixed
// one-way delay on every datagram sent, with order and batches kept (one
// FIFO queue per socket), and going dark — every datagram dropped in both
// directions, as from a host that died without a word — on command or once
// a byte budget is spent. `kvsidecar bench handshake` and `bench transfer
// --rtt` use it to put an RTT on loopback; tests use it to delay and kill
// sockets (internal/testutil.ListenUDP, SimNet). PacketConn documents what
// still differs from a real link.
//
//	udp, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
//	pc := netem.NewUDP(udp, 10*time.Millisecond) // 20 ms RTT between two such sockets
//	defer pc.Close()
//	a, err := transfer.New(&transfer.Config{PacketConn: pc, ...})
//	pc.Kill() // the host is gone
package netem
