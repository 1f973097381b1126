package devtls

import (
	"crypto/tls"
	"crypto/x509"
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

func TestWriteFilesName(t *testing.T) {
	ca, err := NewCA()
	require.NoError(t, err)
	_, err = ca.WriteFiles(t.TempDir(), "../escape")
	require.ErrorContains(t, err, "plain non-empty name")
}

func TestLeafExtraHosts(t *testing.T) {
	ca, err := NewCA()
	require.NoError(t, err)
	leaf, err := ca.Leaf("node", "10.213.0.2", "node-a.example")
	require.NoError(t, err)
	opts := x509.VerifyOptions{Roots: ca.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	tests := []struct {
		host string
		ok   bool
	}{
		{"127.0.0.1", true},
		{"localhost", true},
		{"10.213.0.2", true},
		{"node-a.example", true},
		{"10.213.0.3", false},
	}
	for _, tc := range tests {
		t.Run(tc.host, func(t *testing.T) {
			o := opts
			o.DNSName = tc.host
			_, err := leaf.Leaf.Verify(o)
			if tc.ok {
				require.NoError(t, err)
			} else {
				require.ErrorContains(t, err, "not 10.213.0.3")
			}
		})
	}
}
