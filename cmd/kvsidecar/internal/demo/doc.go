// Package demo holds the logic behind `kvsidecar demo` and `kvsidecar bench
// handshake|transfer`, so the command only parses flags and prints.
//
// Run replays a Mooncake trace through a prefill and a decode instance in
// one process (each rank a connector.Rank with its own vmm.Pool and QUIC
// agent on 127.0.0.1, certificates from a throwaway devtls CA): prefill
// writes deterministic KV (internal/kvgen, keyed by the trace's 512-token
// hash ids so shared prefixes have equal KV), the kv_transfer_params travel
// as JSON, decode imports only what its prefix cache lacks, and every byte
// that arrives is checked.
//
//	s, err := demo.Run(ctx, nil) // defaults: llama-3.2-1b, TP 2 -> 4, 8 requests
//	fmt.Println(s.BytesVerified, s.Mismatches)
//
// RunHandshakeBench and RunTransferBench are the two benchmarks.
package demo
