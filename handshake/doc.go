// Package handshake exchanges agent metadata: what a rank tells a peer about
// its memory (engine id, incarnation, tp_rank, tp_size, model hash, regions).
// The exchange runs on a stream of the transfer connection, is validated
// against what the request's kv_transfer_params said, and is cached by
// (engine id, tp_rank) until the peer's incarnation changes. The legacy
// two-step mode (ask rank 0 for tp_size first) is kept for the benchmark.
//
// handshake knows nothing about requests.
package handshake
