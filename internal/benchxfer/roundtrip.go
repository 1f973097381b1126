package benchxfer

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/quic-go/quic-go"
)

// RoundTripper is the small-read baseline: a raw quic-go server on
// 127.0.0.1 and one warm connection to it. Each RoundTrip opens a new
// stream, sends an 8-byte request naming a size, and reads that many bytes
// to the end of the stream, as a sidecar READ of one descriptor does
// without its framing, checks and bookkeeping. Not safe for concurrent use.
type RoundTripper struct {
	ln   *quic.Listener
	conn *quic.Conn
	done chan error
	buf  []byte
}

// NewRoundTripper listens, dials and runs one round trip of size bytes so
// the connection is warm. qconf may be nil (quic-go defaults). Close ends
// both sides.
func NewRoundTripper(ctx context.Context, srvTLS, cliTLS *tls.Config, qconf *quic.Config) (*RoundTripper, error) {
	st, ct := srvTLS.Clone(), cliTLS.Clone()
	st.NextProtos, ct.NextProtos = []string{alpn}, []string{alpn}
	ln, err := quic.ListenAddr("127.0.0.1:0", st, qconf)
	if err != nil {
		return nil, fmt.Errorf("benchxfer: listen: %w", err)
	}
	rt := &RoundTripper{ln: ln, done: make(chan error, 1)}
	go func() { rt.done <- serveRoundTrips(ln) }()
	rt.conn, err = quic.DialAddr(ctx, ln.Addr().String(), ct, qconf)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("benchxfer: dial: %w", err), rt.Close())
	}
	if _, err := rt.RoundTrip(ctx, 1); err != nil {
		return nil, errors.Join(err, rt.Close())
	}
	return rt, nil
}

// RoundTrip asks for size bytes on a new stream and returns the time from
// opening the stream to the last byte read.
func (rt *RoundTripper) RoundTrip(ctx context.Context, size int) (time.Duration, error) {
	if size <= 0 {
		return 0, fmt.Errorf("benchxfer: round trip of %d bytes, want > 0", size)
	}
	if len(rt.buf) < size {
		rt.buf = make([]byte, size)
	}
	start := time.Now()
	str, err := rt.conn.OpenStreamSync(ctx)
	if err != nil {
		return 0, fmt.Errorf("benchxfer: open stream: %w", err)
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], uint64(size))
	if _, err := str.Write(req[:]); err != nil {
		return 0, fmt.Errorf("benchxfer: request: %w", err)
	}
	_ = str.Close()
	if _, err := io.ReadFull(str, rt.buf[:size]); err != nil {
		return 0, fmt.Errorf("benchxfer: response: %w", err)
	}
	if n, _ := str.Read(rt.buf[:1]); n != 0 {
		return 0, fmt.Errorf("benchxfer: response longer than %d bytes", size)
	}
	return time.Since(start), nil
}

// Close closes the connection and the server.
func (rt *RoundTripper) Close() error {
	if rt.conn != nil {
		_ = rt.conn.CloseWithError(0, "")
	}
	err := rt.ln.Close()
	<-rt.done
	return err
}

// serveRoundTrips answers every stream of every connection on ln with the
// number of bytes its 8-byte request names, until ln closes.
func serveRoundTrips(ln *quic.Listener) error {
	ctx := context.Background()
	for {
		conn, err := ln.Accept(ctx)
		if err != nil {
			return err
		}
		go func() {
			var src []byte
			for {
				str, err := conn.AcceptStream(ctx)
				if err != nil {
					return
				}
				var req [8]byte
				if _, err := io.ReadFull(str, req[:]); err != nil {
					str.CancelWrite(1)
					continue
				}
				n := binary.BigEndian.Uint64(req[:])
				if n > 1<<30 {
					str.CancelWrite(1)
					continue
				}
				if uint64(len(src)) < n {
					src = make([]byte, n)
				}
				_, _ = str.Write(src[:n])
				_ = str.Close()
			}
		}()
	}
}
