// Package wire frames kvsidecar protocol messages on byte streams: QUIC
// streams between agents, unix sockets between group members and between an
// engine and its sidecar. A frame is a protobuf message preceded by its size
// as a varint (google.golang.org/protobuf/encoding/protodelim). Raw payload
// bytes may follow a frame on the same stream; Reader hands them out through
// its Read method so nothing buffered is lost.
package wire
