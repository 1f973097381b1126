package transfer

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/quic-go/quic-go"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// syncBuffer is a bytes.Buffer safe for the agent's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestServedTLSRefusalSeen: a handshake the serving agent refuses is
// counted by reason and logged with the peer's address on the serving side
// (it logged and counted nothing before), at most one line per reason per
// refusalLogEvery with the number left out; the dialer is refused with a
// TLS alert, once per call. A good client is still served.
//
// fault-matrix: foreign-ca-peer
func TestServedTLSRefusalSeen(t *testing.T) {
	tests := []struct {
		name   string
		reason string
		// client changes the client's certificate.
		client func(t *testing.T, ca *devtls.CA, cli *tls.Config)
	}{
		{"certificate of another CA", tlsUnknownAuthority, func(t *testing.T, _ *devtls.CA, cli *tls.Config) {
			other, err := devtls.NewCA()
			require.NoError(t, err)
			c, err := other.Leaf("intruder")
			require.NoError(t, err)
			cli.Certificates = []tls.Certificate{c}
		}},
		{"no certificate", tlsNoCertificate, func(_ *testing.T, _ *devtls.CA, cli *tls.Config) { cli.Certificates = nil }},
		{"server-only certificate", tlsKeyUsage, func(t *testing.T, ca *devtls.CA, cli *tls.Config) {
			c, err := ca.LeafWith("server-only", func(c *x509.Certificate) { c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth} })
			require.NoError(t, err)
			cli.Certificates = []tls.Certificate{c}
		}},
		{"expired certificate", tlsExpired, func(t *testing.T, ca *devtls.CA, cli *tls.Config) {
			c, err := ca.LeafWith("expired", func(c *x509.Certificate) {
				c.NotBefore, c.NotAfter = time.Now().Add(-2*time.Hour), time.Now().Add(-time.Hour)
			})
			require.NoError(t, err)
			cli.Certificates = []tls.Certificate{c}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				n := testutil.NewSimNet(time.Millisecond)
				ca, err := devtls.NewCA()
				require.NoError(t, err)
				srvTLS, err := ca.ServerConfig()
				require.NoError(t, err)
				goodTLS, err := ca.ClientConfig()
				require.NoError(t, err)
				badTLS := goodTLS.Clone()
				tc.client(t, ca, badTLS)
				var logs syncBuffer
				srv, err := New(&Config{PacketConn: n.Listen(t, simServer), ServerTLS: srvTLS,
					Logger:      slog.New(slog.NewTextHandler(&logs, nil)),
					OnHandshake: func(context.Context, *v1.HandshakeRequest) *v1.HandshakeResponse { return &v1.HandshakeResponse{} }})
				require.NoError(t, err)
				t.Cleanup(func() { _ = srv.Close() })
				bad, err := New(&Config{PacketConn: n.Listen(t, "127.0.0.2:1"), ClientTLS: badTLS})
				require.NoError(t, err)
				t.Cleanup(func() { _ = bad.Close() })

				refuse := func() {
					t.Helper()
					_, err := bad.Handshake(t.Context(), simServer, &v1.HandshakeRequest{})
					var te *quic.TransportError
					require.ErrorAs(t, err, &te, "a TLS alert: %v", err)
					require.True(t, te.ErrorCode.IsCryptoError(), "a TLS alert: %v", err)
					require.ErrorContains(t, err, simServer+" refused this agent's TLS handshake")
					require.ErrorContains(t, err, "tls: bad certificate")
				}
				refuse()
				synctest.Wait()
				require.InDelta(t, 1, promtest.ToFloat64(srv.m.tlsRefused.WithLabelValues(tc.reason)), 0)
				require.Equal(t, 1, strings.Count(logs.String(), "refused a peer's TLS handshake"), logs.String())
				require.Contains(t, logs.String(), "peer=127.0.0.2:1 reason="+tc.reason)

				refuse() // within refusalLogEvery: counted, not logged
				synctest.Wait()
				require.InDelta(t, 2, promtest.ToFloat64(srv.m.tlsRefused.WithLabelValues(tc.reason)), 0)
				require.Equal(t, 1, strings.Count(logs.String(), "refused a peer's TLS handshake"))
				time.Sleep(refusalLogEvery)
				refuse()
				synctest.Wait()
				require.Equal(t, 2, strings.Count(logs.String(), "refused a peer's TLS handshake"))
				require.Contains(t, logs.String(), "suppressed_since_last=1")
				require.Equal(t, 3, bad.DialCount(simServer), "one dial per call: a refusal is not redialed")

				good, err := New(&Config{PacketConn: n.Listen(t, "127.0.0.3:1"), ClientTLS: goodTLS})
				require.NoError(t, err)
				t.Cleanup(func() { _ = good.Close() })
				_, err = good.Handshake(t.Context(), simServer, &v1.HandshakeRequest{})
				require.NoError(t, err, "a certificate of the CA is served")
				var total float64
				for _, r := range tlsRefusalReasons {
					total += promtest.ToFloat64(srv.m.tlsRefused.WithLabelValues(r))
				}
				require.InDelta(t, 3, total, 0, "only the refused handshakes count")
			})
		})
	}
}
