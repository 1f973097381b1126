// Package kvsidecarv1 holds the kvsidecar wire protocol: the .proto files and
// the Go code protoc-gen-go generates from them (`make generate`). It contains
// no logic. Generated types stop at package edges: every package that reads
// them converts and validates them into its own types.
//
// Channels and their envelopes:
//
//   - agent ↔ agent over QUIC (ALPN kvsidecar/1): PeerRequest / PeerResponse,
//     carrying the handshake (AgentMetadata), prepared descriptor lists,
//     READ/WRITE (XferRequest, XferStatus), Notification and Heartbeat;
//   - TP group members over unix sockets: GroupRequest / GroupResponse;
//   - engine ↔ sidecar over a unix socket: LocalRequest / LocalReply.
//
// Every reply carries an Error whose Code is the one shared error-code enum.
// Frames are size-delimited (protodelim); see internal/wire.
package kvsidecarv1
