package devtls

import (
	"crypto/tls"
	"io"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// handshake runs one TLS handshake over a loopback TCP pair and returns the
// client's and server's errors.
func handshake(t testing.TB, srv, cli *tls.Config) (clientErr, serverErr error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		tc := tls.Server(c, srv)
		err = tc.Handshake()
		if err == nil {
			_, err = io.WriteString(tc, "x")
		}
		done <- err
	}()
	c, err := tls.Dial("tcp", ln.Addr().String(), cli)
	if err == nil {
		_, err = io.ReadFull(c, make([]byte, 1))
		c.Close()
	}
	return err, <-done
}

func TestMutualTLS(t *testing.T) {
	ca, err := NewCA()
	require.NoError(t, err)
	other, err := NewCA()
	require.NoError(t, err)
	srv, err := ca.ServerConfig()
	require.NoError(t, err)
	cli, err := ca.ClientConfig()
	require.NoError(t, err)
	foreign, err := other.ClientConfig()
	require.NoError(t, err)
	foreign.RootCAs = ca.Pool() // trusts the server, but its own cert is foreign

	tests := []struct {
		name    string
		cli     *tls.Config
		wantErr bool
	}{
		{"same CA", cli, false},
		{"client cert from another CA", foreign, true},
		{"no client cert", &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: ca.Pool()}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cerr, serr := handshake(t, srv, tt.cli)
			if tt.wantErr {
				require.Error(t, serr)
				return
			}
			require.NoError(t, cerr)
			require.NoError(t, serr)
		})
	}
}

func TestWriteAndLoadFiles(t *testing.T) {
	ca, err := NewCA()
	require.NoError(t, err)
	f, err := ca.WriteFiles(t.TempDir(), "node")
	require.NoError(t, err)
	srv, cli, err := LoadConfigs(f.CA, f.Cert, f.Key)
	require.NoError(t, err)
	require.Equal(t, tls.RequireAndVerifyClientCert, srv.ClientAuth)
	cerr, serr := handshake(t, srv, cli)
	require.NoError(t, cerr)
	require.NoError(t, serr)

	_, err = ca.WriteFiles(t.TempDir(), "../escape")
	require.ErrorContains(t, err, "plain non-empty name")
}
