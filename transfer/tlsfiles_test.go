package transfer

import (
	"crypto/tls"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/devtls"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestLoadTLSFiles: files a CA wrote load into a server config that
// requires client certificates and a client config, and two agents with
// them serve each other; a CA file without a certificate, or a missing
// key, is an error naming the file.
func TestLoadTLSFiles(t *testing.T) {
	ca, err := devtls.NewCA()
	require.NoError(t, err)
	f, err := ca.WriteFiles(t.TempDir(), "node")
	require.NoError(t, err)
	srv, cli, err := LoadTLSFiles(f.CA, f.Cert, f.Key)
	require.NoError(t, err)
	require.Equal(t, tls.RequireAndVerifyClientCert, srv.ClientAuth)
	require.Equal(t, uint16(tls.VersionTLS13), cli.MinVersion)
	a, err := New(&Config{ServerTLS: srv})
	require.NoError(t, err)
	defer a.Close()
	b, err := New(&Config{ClientTLS: cli})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.Heartbeat(t.Context(), a.Addr().String(), &v1.Heartbeat{})
	require.NoError(t, err, "mutual TLS with the loaded files")

	empty := filepath.Join(t.TempDir(), "empty.pem")
	require.NoError(t, os.WriteFile(empty, []byte("not a certificate\n"), 0o600))
	_, _, err = LoadTLSFiles(empty, f.Cert, f.Key)
	require.ErrorContains(t, err, "CA file "+empty+" holds no PEM certificate")
	_, _, err = LoadTLSFiles(f.CA, f.Cert, f.Key+".missing")
	require.ErrorContains(t, err, f.Key+".missing")
}
