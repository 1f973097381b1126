package wire

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"google.golang.org/protobuf/encoding/protodelim"
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
	buf bytes.Buffer
}

// NewReader returns a Reader of r with a frame limit of maxFrame bytes
// (DefaultMaxFrame when maxFrame <= 0).
func NewReader(r io.Reader, maxFrame int) *Reader {
	if maxFrame <= 0 {
		maxFrame = DefaultMaxFrame
	}
	return &Reader{br: bufio.NewReaderSize(r, 64<<10), max: maxFrame}
}

// Reset makes r read from src, dropping whatever it buffered, so a Reader
// (and its 64 KiB buffer) can serve one stream after another.
func (r *Reader) Reset(src io.Reader) {
	r.br.Reset(src)
	r.buf.Reset()
}

// ReadMsg reads one frame into m, in protodelim's format. It returns io.EOF when the stream ends
// cleanly before a frame, ErrTruncated when it ends inside one, and a
// *SizeError when the declared size exceeds the limit. A frame that does
// not decode as m is an error naming the first field that does not
// ("wire: bad frame: field meta.params.tp_size: ..."). Memory grows with the
// bytes that actually arrive, never with the declared size, so a peer that
// claims a large frame and sends nothing costs nothing.
func (r *Reader) ReadMsg(m proto.Message) error {
	br := byteReader{br: r.br}
	size, err := binary.ReadUvarint(&br)
	switch {
	case errors.Is(err, io.EOF):
		return io.EOF
	case errors.Is(err, io.ErrUnexpectedEOF):
		return ErrTruncated
	case err != nil && br.err != nil:
		// The stream failed (timeout, reset, closed connection): not a
		// malformed length.
		return fmt.Errorf("wire: read frame: %w", err)
	case err != nil:
		return fmt.Errorf("wire: bad frame length: %w", err)
	case size > uint64(r.max):
		return &SizeError{Size: size, Max: r.max}
	}
	if size <= uint64(r.br.Size()) {
		// The frame fits the read buffer: decode it in place.
		b, err := r.br.Peek(int(size))
		if err != nil {
			if errors.Is(err, io.EOF) {
				return ErrTruncated
			}
			return fmt.Errorf("wire: read frame: %w", err)
		}
		err = proto.Unmarshal(b, m) // copies what it keeps
		if err != nil {
			err = fmt.Errorf("wire: bad frame: %w", fieldErr(undecodableField(m.ProtoReflect().Descriptor(), b), err))
		}
		_, _ = r.br.Discard(int(size))
		return err
	}
	r.buf.Reset()
	if n, err := io.CopyN(&r.buf, r.br, int64(size)); err != nil {
		if errors.Is(err, io.EOF) && n < int64(size) {
			return ErrTruncated
		}
		return fmt.Errorf("wire: read frame: %w", err)
	}
	if err := proto.Unmarshal(r.buf.Bytes(), m); err != nil {
		return fmt.Errorf("wire: bad frame: %w", fieldErr(undecodableField(m.ProtoReflect().Descriptor(), r.buf.Bytes()), err))
	}
	if r.buf.Cap() > retainBuf {
		r.buf = bytes.Buffer{}
	}
	return nil
}

// byteReader remembers whether the stream itself failed while a length was
// read, to tell I/O errors from a malformed varint.
type byteReader struct {
	br  *bufio.Reader
	err error
}

func (b *byteReader) ReadByte() (byte, error) {
	c, err := b.br.ReadByte()
	if err != nil {
		b.err = err
	}
	return c, err
}

// retainBuf is the largest frame buffer a Reader keeps between frames.
const retainBuf = 64 << 10

// Read reads raw bytes that follow a frame. Large reads into an empty buffer
// go straight into p without an intermediate copy.
func (r *Reader) Read(p []byte) (int, error) { return r.br.Read(p) }

// Buffered is the number of bytes read from the stream but not yet consumed.
func (r *Reader) Buffered() int { return r.br.Buffered() }

// AppendFrame appends the frame of m to b. It returns a *SizeError when the
// message is larger than maxFrame (DefaultMaxFrame when maxFrame <= 0), and
// an error naming the first field that does not encode (a string that is
// not UTF-8) when m does not.
func AppendFrame(b []byte, m proto.Message, maxFrame int) ([]byte, error) {
	if maxFrame <= 0 {
		maxFrame = DefaultMaxFrame
	}
	size := proto.Size(m)
	if size > maxFrame {
		return b, &SizeError{Size: uint64(size), Max: maxFrame}
	}
	buf := bytes.NewBuffer(b)
	if _, err := protodelim.MarshalTo(buf, m); err != nil {
		return b, fmt.Errorf("wire: encode frame: %w", fieldErr(unencodableField(m.ProtoReflect()), err))
	}
	return buf.Bytes(), nil
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
