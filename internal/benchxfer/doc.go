// Package benchxfer holds the throughput baselines the transfer benchmark
// compares the sidecar against: one quic-go stream and Go's TLS 1.3 over
// TCP, both on loopback, both moving a fixed number of bytes from one
// in-memory buffer to another with large writes. `go test -bench` in
// transfer and `kvsidecar bench transfer` share them.
//
//	d, err := benchxfer.RawQUIC(ctx, 128<<20, 2<<20, srvTLS, cliTLS, transfer.QUICConfig(nil))
package benchxfer
