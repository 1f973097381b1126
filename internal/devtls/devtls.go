package devtls

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Validity is how long generated certificates stay valid (24 hours), with
// their NotBefore one hour in the past to tolerate clock skew.
const Validity = 24 * time.Hour

// CA is a development certificate authority. It is safe for concurrent use
// once created.
type CA struct {
	cert    *x509.Certificate
	certDER []byte
	key     *ecdsa.PrivateKey
	pool    *x509.CertPool
}

// NewCA generates a fresh P-256 CA valid for Validity, named "kvsidecar
// dev CA".
func NewCA() (*CA, error) { return NewNamedCA("kvsidecar dev CA") }

// NewNamedCA is NewCA with the CA's subject common name cn: a peer's TLS
// stack may choose which certificate to present by the issuer names the
// other side accepts, so two CAs of one name can hide a mistake.
func NewNamedCA(cn string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("devtls: generate CA key: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(Validity),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("devtls: self-sign CA: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("devtls: parse CA: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &CA{cert: cert, certDER: der, key: key, pool: pool}, nil
}

// Pool returns a pool holding only this CA, for RootCAs and ClientCAs.
func (ca *CA) Pool() *x509.CertPool { return ca.pool }

// Leaf issues a certificate named cn for 127.0.0.1, ::1 and localhost, plus
// every extra host (an IP address or a DNS name), usable both as a TLS
// server and as a TLS client certificate.
func (ca *CA) Leaf(cn string, hosts ...string) (tls.Certificate, error) {
	return ca.leaf(cn, nil, hosts)
}

// LeafWith is Leaf with the template passed to edit before it is signed, so
// a test can make a certificate that is expired, not yet valid, or lacks a
// key usage or a name.
func (ca *CA) LeafWith(cn string, edit func(*x509.Certificate), hosts ...string) (tls.Certificate, error) {
	return ca.leaf(cn, edit, hosts)
}

func (ca *CA) leaf(cn string, edit func(*x509.Certificate), hosts []string) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("devtls: generate key for %q: %w", cn, err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(Validity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	if edit != nil {
		edit(tmpl)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("devtls: sign %q: %w", cn, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("devtls: parse %q: %w", cn, err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// ServerConfig returns a TLS 1.3 server config with a fresh leaf that
// requires and verifies a client certificate signed by this CA.
func (ca *CA) ServerConfig() (*tls.Config, error) {
	leaf, err := ca.Leaf("kvsidecar dev server")
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{leaf},
		ClientCAs:    ca.pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
	}, nil
}

// ClientConfig returns a TLS 1.3 client config with a fresh leaf, trusting
// only this CA.
func (ca *CA) ClientConfig() (*tls.Config, error) {
	leaf, err := ca.Leaf("kvsidecar dev client")
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{leaf},
		RootCAs:      ca.pool,
	}, nil
}

// Files names the PEM files written by WriteFiles.
type Files struct {
	CA, Cert, Key string
}

// WriteFiles writes ca.pem, then <name>.pem and <name>-key.pem holding a
// fresh leaf (for loopback and the extra hosts, as Leaf), into dir (created
// with mode 0700 if missing). Keys are written with mode 0600.
func (ca *CA) WriteFiles(dir, name string, hosts ...string) (Files, error) {
	return ca.WriteFilesWith(dir, name, nil, hosts...)
}

// WriteFilesWith is WriteFiles with the leaf's template passed to edit
// before it is signed, so a test can make a certificate that is expired,
// not yet valid, or lacks a key usage or a name.
func (ca *CA) WriteFilesWith(dir, name string, edit func(*x509.Certificate), hosts ...string) (Files, error) {
	if name == "" || filepath.Base(name) != name {
		return Files{}, fmt.Errorf("devtls: file name %q must be a plain non-empty name", name)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return Files{}, fmt.Errorf("devtls: %w", err)
	}
	leaf, err := ca.leaf(name, edit, hosts)
	if err != nil {
		return Files{}, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(leaf.PrivateKey)
	if err != nil {
		return Files{}, fmt.Errorf("devtls: marshal key: %w", err)
	}
	f := Files{
		CA:   filepath.Join(dir, "ca.pem"),
		Cert: filepath.Join(dir, name+".pem"),
		Key:  filepath.Join(dir, name+"-key.pem"),
	}
	writes := []struct {
		path, typ string
		der       []byte
		mode      os.FileMode
	}{
		{f.CA, "CERTIFICATE", ca.certDER, 0o644},
		{f.Cert, "CERTIFICATE", leaf.Certificate[0], 0o644},
		{f.Key, "PRIVATE KEY", keyDER, 0o600},
	}
	for _, w := range writes {
		b := pem.EncodeToMemory(&pem.Block{Type: w.typ, Bytes: w.der})
		if err := os.WriteFile(w.path, b, w.mode); err != nil {
			return Files{}, fmt.Errorf("devtls: %w", err)
		}
	}
	return f, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		panic("devtls: crypto/rand failed: " + err.Error())
	}
	return n
}
