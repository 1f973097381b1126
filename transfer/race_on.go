//go:build race

package transfer

// noEarlyStreams: with the race detector on, no stream is opened before
// the handshake completes. quic-go's client installs the server's transport
// parameters while a 0-RTT stream may read them (quic-go/quic-go#4303, open:
// "Data race assigning peerParams when 0-RTT is used"), which the detector
// reports. The connection still resumes with its session ticket.
const noEarlyStreams = true
