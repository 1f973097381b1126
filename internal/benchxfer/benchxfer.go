package benchxfer

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/quic-go/quic-go"
)

// alpn is the protocol both baselines negotiate.
const alpn = "kvsidecar-bench"

// RawQUIC moves total bytes over one quic-go stream on 127.0.0.1, written in
// chunks of chunk bytes by the server (a pull, like a sidecar READ) and read
// straight into a buffer by the client. It returns the time from opening
// the stream to the last byte read; connection setup is not counted. qconf
// may be nil (quic-go defaults).
func RawQUIC(ctx context.Context, total, chunk int, srvTLS, cliTLS *tls.Config, qconf *quic.Config) (time.Duration, error) {
	if total <= 0 || chunk <= 0 {
		return 0, fmt.Errorf("benchxfer: total %d and chunk %d must be > 0", total, chunk)
	}
	st, ct := srvTLS.Clone(), cliTLS.Clone()
	st.NextProtos, ct.NextProtos = []string{alpn}, []string{alpn}
	ln, err := quic.ListenAddr("127.0.0.1:0", st, qconf)
	if err != nil {
		return 0, fmt.Errorf("benchxfer: listen: %w", err)
	}
	defer ln.Close()
	src := make([]byte, chunk)
	srvErr := make(chan error, 1)
	go func() {
		conn, err := ln.Accept(ctx)
		if err != nil {
			srvErr <- err
			return
		}
		defer conn.CloseWithError(0, "")
		str, err := conn.AcceptStream(ctx)
		if err != nil {
			srvErr <- err
			return
		}
		if _, err := io.ReadFull(str, make([]byte, 1)); err != nil {
			srvErr <- err
			return
		}
		for left := total; left > 0; left -= chunk {
			if _, err := str.Write(src[:min(chunk, left)]); err != nil {
				srvErr <- err
				return
			}
		}
		_ = str.Close()
		// Keep the connection until the client has read everything.
		_, _ = io.Copy(io.Discard, str)
		srvErr <- nil
	}()
	conn, err := quic.DialAddr(ctx, ln.Addr().String(), ct, qconf)
	if err != nil {
		return 0, fmt.Errorf("benchxfer: dial: %w", err)
	}
	defer conn.CloseWithError(0, "")
	start := time.Now()
	str, err := conn.OpenStreamSync(ctx)
	if err != nil {
		return 0, err
	}
	if _, err := str.Write([]byte{1}); err != nil {
		return 0, err
	}
	if err := drain(str, total, chunk); err != nil {
		return 0, err
	}
	d := time.Since(start)
	_ = str.Close()
	return d, <-srvErr
}

// TLSTCP moves total bytes over one TLS 1.3 connection on 127.0.0.1 TCP,
// like RawQUIC. The TLS handshake is not counted.
func TLSTCP(ctx context.Context, total, chunk int, srvTLS, cliTLS *tls.Config) (time.Duration, error) {
	if total <= 0 || chunk <= 0 {
		return 0, fmt.Errorf("benchxfer: total %d and chunk %d must be > 0", total, chunk)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("benchxfer: listen: %w", err)
	}
	defer ln.Close()
	src := make([]byte, chunk)
	srvErr := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			srvErr <- err
			return
		}
		tc := tls.Server(c, srvTLS)
		defer tc.Close()
		if _, err := io.ReadFull(tc, make([]byte, 1)); err != nil {
			srvErr <- err
			return
		}
		for left := total; left > 0; left -= chunk {
			if _, err := tc.Write(src[:min(chunk, left)]); err != nil {
				srvErr <- err
				return
			}
		}
		_, _ = io.Copy(io.Discard, tc)
		srvErr <- nil
	}()
	var d net.Dialer
	tc, err := tls.DialWithDialer(&d, "tcp", ln.Addr().String(), cliTLS)
	if err != nil {
		return 0, fmt.Errorf("benchxfer: dial: %w", err)
	}
	if err := tc.HandshakeContext(ctx); err != nil {
		tc.Close()
		return 0, err
	}
	start := time.Now()
	if _, err := tc.Write([]byte{1}); err != nil {
		tc.Close()
		return 0, err
	}
	err = drain(tc, total, chunk)
	dur := time.Since(start)
	tc.Close()
	if serr := <-srvErr; err == nil && serr != nil && !errors.Is(serr, net.ErrClosed) {
		err = serr
	}
	return dur, err
}

func drain(r io.Reader, total, chunk int) error {
	dst := make([]byte, chunk)
	for left := total; left > 0; {
		n, err := io.ReadFull(r, dst[:min(chunk, left)])
		left -= n
		if err != nil {
			return fmt.Errorf("benchxfer: read with %d bytes left: %w", left, err)
		}
	}
	return nil
}
