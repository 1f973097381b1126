package netem_test

import (
	"context"
	"net"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/netem"
)

// recorder is a net.PacketConn that records when each write reached it.
type recorder struct {
	net.PacketConn // nil: only WriteTo, LocalAddr and Close are used
	mu             sync.Mutex
	got            []string
	at             []time.Duration
	start          time.Time
}

func (r *recorder) WriteTo(p []byte, _ net.Addr) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, string(p))
	r.at = append(r.at, time.Since(r.start))
	return len(p), nil
}

func (r *recorder) Close() error { return nil }

// TestDelayKeepsOrderAndBatches: every datagram leaves exactly the delay
// after it was written, in the order written; datagrams written together
// leave together.
func TestDelayKeepsOrderAndBatches(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &recorder{start: time.Now()}
		const delay = 10 * time.Millisecond
		pc := netem.New(rec, delay)
		defer pc.Close()
		to := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9}
		send := func(s string) {
			_, err := pc.WriteTo([]byte(s), to)
			require.NoError(t, err)
		}
		// A burst of 100 at t=0, one at 3 ms, a burst of 2 at 7 ms.
		var want []string
		var wantAt []time.Duration
		for i := range 100 {
			s := string(rune('A'+i%26)) + string(rune('0'+i/26))
			send(s)
			want, wantAt = append(want, s), append(wantAt, delay)
		}
		time.Sleep(3 * time.Millisecond)
		send("mid")
		want, wantAt = append(want, "mid"), append(wantAt, 3*time.Millisecond+delay)
		time.Sleep(4 * time.Millisecond)
		send("late1")
		send("late2")
		want, wantAt = append(want, "late1", "late2"), append(wantAt, 7*time.Millisecond+delay, 7*time.Millisecond+delay)
		synctest.Wait()
		rec.mu.Lock()
		require.Empty(t, rec.got, "nothing leaves before the delay")
		rec.mu.Unlock()
		time.Sleep(time.Second)
		synctest.Wait()
		rec.mu.Lock()
		defer rec.mu.Unlock()
		require.Equal(t, want, rec.got)
		require.Equal(t, wantAt, rec.at)
		require.Equal(t, int64(2*100+3+5+5), pc.SentBytes())
	})
}

// TestDelayCloseDropsQueued: Close ends the release goroutine at once,
// dropping what has not left yet.
func TestDelayCloseDropsQueued(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &recorder{start: time.Now()}
		pc := netem.New(rec, time.Second)
		_, err := pc.WriteTo([]byte("never"), &net.UDPAddr{})
		require.NoError(t, err)
		require.NoError(t, pc.Close())
		time.Sleep(2 * time.Second)
		synctest.Wait()
		rec.mu.Lock()
		defer rec.mu.Unlock()
		require.Empty(t, rec.got)
	})
}

var _ quic.OOBCapablePacketConn = (*netem.UDPConn)(nil)

// TestUDPConnKeepsGSO: quic-go over a delaying UDPConn uses GSO exactly when
// it does over the bare socket, and still moves bytes.
func TestUDPConnKeepsGSO(t *testing.T) {
	t.Setenv("QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING", "true") // New's socket is not a *net.UDPConn
	ca, err := devtls.NewCA()
	require.NoError(t, err)
	srvTLS, err := ca.ServerConfig()
	require.NoError(t, err)
	cliTLS, err := ca.ClientConfig()
	require.NoError(t, err)
	srvTLS.NextProtos, cliTLS.NextProtos = []string{"netem-test"}, []string{"netem-test"}

	gso := func(wrap func(*net.UDPConn) net.PacketConn) bool {
		t.Helper()
		srv, cli := listen(t, wrap), listen(t, wrap)
		ln, err := (&quic.Transport{Conn: srv}).Listen(srvTLS, nil)
		require.NoError(t, err)
		defer ln.Close()
		done := make(chan []byte, 1)
		go func() {
			c, err := ln.Accept(context.Background())
			if err != nil {
				done <- nil
				return
			}
			str, err := c.AcceptStream(context.Background())
			if err != nil {
				done <- nil
				return
			}
			b := make([]byte, 1<<20)
			n, _ := readFull(str, b)
			done <- b[:n]
		}()
		conn, err := (&quic.Transport{Conn: cli}).Dial(t.Context(), srv.LocalAddr(), cliTLS, nil)
		require.NoError(t, err)
		defer conn.CloseWithError(0, "")
		str, err := conn.OpenStreamSync(t.Context())
		require.NoError(t, err)
		payload := make([]byte, 1<<20)
		for i := range payload {
			payload[i] = byte(i * 7)
		}
		_, err = str.Write(payload)
		require.NoError(t, err)
		require.NoError(t, str.Close())
		require.Equal(t, payload, <-done)
		return conn.ConnectionState().GSO
	}
	bare := gso(func(u *net.UDPConn) net.PacketConn { return u })
	wrapped := gso(func(u *net.UDPConn) net.PacketConn { return netem.NewUDP(u, time.Millisecond) })
	t.Logf("GSO: bare socket %v, delaying UDPConn %v", bare, wrapped)
	require.Equal(t, bare, wrapped, "GSO over the delaying socket as over the bare one")
	plain := gso(func(u *net.UDPConn) net.PacketConn { return netem.New(u, time.Millisecond) })
	require.False(t, plain, "New hides the batch interfaces")
}

func listen(t *testing.T, wrap func(*net.UDPConn) net.PacketConn) net.PacketConn {
	t.Helper()
	u, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	pc := wrap(u)
	t.Cleanup(func() { _ = pc.Close() })
	return pc
}

func readFull(str *quic.Stream, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		k, err := str.Read(b[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
