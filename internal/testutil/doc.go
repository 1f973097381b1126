// Package testutil holds helpers shared by tests: PacketConn, a UDP socket
// that delays every datagram and can go dark as a dead host would
// (ListenUDP); SimNet, an in-memory network for tests under
// testing/synctest (quic-go's testutils/simnet); and Scaled, which stretches
// the real-network timeouts of e2e tests by KVSIDECAR_TIME_SCALE.
package testutil
