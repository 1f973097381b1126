// Package wire frames kvsidecar protocol messages on byte streams: QUIC
// streams between agents, unix sockets between group members and between an
// engine and its sidecar. A frame is a protobuf message preceded by its size
// as a varint (google.golang.org/protobuf/encoding/protodelim). Raw payload
// bytes may follow a frame on the same stream; Reader hands them out through
// its Read method so nothing buffered is lost.
package wire

import (
	"bufio"
	"errors"
	"fmt"
	"io"

	"google.golang.org/protobuf/encoding/protodelim"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// DefaultMaxFrame is the default limit on one frame's encoded size in bytes
// (4 MiB). A descriptor list of 65,536 descriptors fits with room to spare.
const DefaultMaxFrame = 4 << 20

// ErrFrameTooLarge is returned (wrapped in a *SizeError) when a frame's
// declared or actual size exceeds the limit.
var ErrFrameTooLarge = errors.New("wire: frame too large")

// ErrTruncated is returned when a stream ends inside a frame. It wraps
// io.ErrUnexpectedEOF.
var ErrTruncated = fmt.Errorf("wire: truncated frame: %w", io.ErrUnexpectedEOF)

// SizeError reports a frame over the limit; errors.Is(err, ErrFrameTooLarge).
type SizeError struct {
	// Size is the declared (read) or encoded (write) size in bytes.
	Size uint64
	// Max is the limit in bytes.
	Max int
}

func (e *SizeError) Error() string {
	return fmt.Sprintf("wire: frame of %d bytes exceeds the limit of %d bytes", e.Size, e.Max)
}

// Unwrap returns ErrFrameTooLarge.
func (e *SizeError) Unwrap() error { return ErrFrameTooLarge }

// Reader reads frames and the raw bytes that follow them from one stream.
// It is not safe for concurrent use.
type Reader struct {
	br  *bufio.Reader
	max int
}

// NewReader returns a Reader of r with a frame limit of maxFrame bytes
// (DefaultMaxFrame when maxFrame <= 0).
func NewReader(r io.Reader, maxFrame int) *Reader {
	if maxFrame <= 0 {
		maxFrame = DefaultMaxFrame
	}
	return &Reader{br: bufio.NewReaderSize(r, 64<<10), max: maxFrame}
}

// ReadMsg reads one frame into m. It returns io.EOF when the stream ends
// cleanly before a frame, ErrTruncated when it ends inside one, and a
// *SizeError when the declared size exceeds the limit; in that case nothing
// of the declared size is allocated.
func (r *Reader) ReadMsg(m proto.Message) error {
	err := protodelim.UnmarshalOptions{MaxSize: int64(r.max)}.UnmarshalFrom(r.br, m)
	if err == nil {
		return nil
	}
	var sz *protodelim.SizeTooLargeError
	switch {
	case errors.As(err, &sz):
		return &SizeError{Size: sz.Size, Max: r.max}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return ErrTruncated
	case errors.Is(err, io.EOF):
		return io.EOF
	}
	return fmt.Errorf("wire: bad frame: %w", err)
}

// Read reads raw bytes that follow a frame. Large reads into an empty buffer
// go straight into p without an intermediate copy.
func (r *Reader) Read(p []byte) (int, error) { return r.br.Read(p) }

// Buffered is the number of bytes read from the stream but not yet consumed.
func (r *Reader) Buffered() int { return r.br.Buffered() }

// AppendFrame appends the frame of m to b. It returns a *SizeError when the
// message is larger than maxFrame (DefaultMaxFrame when maxFrame <= 0).
func AppendFrame(b []byte, m proto.Message, maxFrame int) ([]byte, error) {
	if maxFrame <= 0 {
		maxFrame = DefaultMaxFrame
	}
	size := proto.Size(m)
	if size > maxFrame {
		return b, &SizeError{Size: uint64(size), Max: maxFrame}
	}
	b = protowire.AppendVarint(b, uint64(size))
	return proto.MarshalOptions{}.MarshalAppend(b, m)
}

// WriteMsg writes the frame of m to w in one Write call.
func WriteMsg(w io.Writer, m proto.Message, maxFrame int) error {
	b, err := AppendFrame(nil, m, maxFrame)
	if err != nil {
		return err
	}
	if _, err := w.Write(b); err != nil {
		return fmt.Errorf("wire: write frame: %w", err)
	}
	return nil
}
