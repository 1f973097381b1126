// Command kvsidecar is the KV-cache transfer sidecar of one GPU (one
// tensor-parallel rank) of an inference engine.
//
//	kvsidecar serve            run the sidecar beside one rank
//	kvsidecar demo             prefill→decode on the embedded host backend, replaying a real trace
//	kvsidecar bench handshake  handshake latency, piggyback vs legacy
//	kvsidecar bench transfer   transfer throughput against raw QUIC and TLS/TCP baselines
//	kvsidecar ctl              stats and memory limit of a running sidecar
//	kvsidecar version          module version, VCS revision and Go version (also --version)
package main
