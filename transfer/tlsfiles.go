package transfer

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// LoadTLSFiles reads PEM files, a CA certificate (caFile), this agent's
// certificate chain (certFile) and its private key (keyFile), into the two
// configs an Agent takes: server requires and verifies a client
// certificate, client presents the same certificate; both are TLS 1.3 and
// trust only the CA in caFile. `kvsidecar serve` loads its --tls-ca,
// --tls-cert and --tls-key with it. Errors name the file that failed.
func LoadTLSFiles(caFile, certFile, keyFile string) (server, client *tls.Config, err error) {
	pemCA, err := os.ReadFile(caFile)
	if err != nil {
		return nil, nil, fmt.Errorf("transfer: CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemCA) {
		return nil, nil, errors.New("transfer: CA file " + caFile + " holds no PEM certificate")
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("transfer: certificate %s and key %s: %w", certFile, keyFile, err)
	}
	server = &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert},
		ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert}
	client = &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}, RootCAs: pool}
	return server, client, nil
}
