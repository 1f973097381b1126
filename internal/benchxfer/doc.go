// Package benchxfer holds the baselines the transfer benchmark compares the
// sidecar against: for throughput, one quic-go stream and Go's TLS 1.3 over
// TCP, both on loopback, both moving a fixed number of bytes from one
// in-memory buffer to another with large writes; for small-read latency, a
// raw quic-go request/response on a new stream of a warm connection
// (RoundTripper); for the same-host path, memcpy of the same descriptors on
// one or more threads (Memcpy). `go test -bench` in transfer and `kvsidecar
// bench transfer` share them.
//
//	d, err := benchxfer.RawQUIC(ctx, 128<<20, 2<<20, srvTLS, cliTLS, transfer.QUICConfig(nil))
//
//	rt, err := benchxfer.NewRoundTripper(ctx, srvTLS, cliTLS, transfer.QUICConfig(nil))
//	defer rt.Close()
//	d, err = rt.RoundTrip(ctx, 4096)
//
//	d, err = benchxfer.Memcpy(dst, src, 2) // [][]byte each, on two threads
package benchxfer
