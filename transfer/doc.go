// Package transfer is the data plane: QUIC agents (quic-go, TLS 1.3 with
// mutual authentication, ALPN kvsidecar/1) that move KV bytes between
// registered memory of two ranks with NIXL-style descriptor lists, READ and
// WRITE, completion acks, notifications, abort, progress deadlines, bounds and
// capability checks, and per-peer back-pressure.
//
// transfer knows nothing about model geometry.
package transfer
