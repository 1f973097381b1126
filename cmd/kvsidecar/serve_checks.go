package main

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"
)

// checkKeyFileMode refuses a secret file that group or others may read, as
// ssh refuses such a private key: the capability key signs every capability
// the engine issues, so whoever reads it can mint access to any block.
func checkKeyFileMode(flagName, file string) error {
	st, err := os.Stat(file)
	if err != nil {
		return fmt.Errorf("--%s %s: %w", flagName, file, err)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return fmt.Errorf("--%s %s: mode %#o lets group or others read the secret; refused (as ssh refuses such a private key): run chmod 600 %s",
			flagName, file, perm, file)
	}
	return nil
}

// checkCertificate checks --tls-cert against what peers will verify, at
// start instead of at the first request on another fleet: the certificate
// is valid now, chains to --tls-ca, is usable both to serve and to dial
// (extended key usages serverAuth and clientAuth), and its subject
// alternative names cover host, the address peers dial this rank at (from
// what: the flag that set it). Errors name the flags, the files and the
// mismatch.
func checkCertificate(certFile, caFile, host, what string, now time.Time) error {
	chain, err := readCerts(certFile)
	if err != nil {
		return fmt.Errorf("--tls-cert %s: %w", certFile, err)
	}
	leaf := chain[0]
	const layout = time.RFC3339
	switch {
	case now.Before(leaf.NotBefore):
		return fmt.Errorf("--tls-cert %s: not valid before %s (now is %s): peers would refuse it; check this host's clock or issue a certificate valid now",
			certFile, leaf.NotBefore.UTC().Format(layout), now.UTC().Format(layout))
	case now.After(leaf.NotAfter):
		return fmt.Errorf("--tls-cert %s: expired at %s (now is %s): peers would refuse it; renew it",
			certFile, leaf.NotAfter.UTC().Format(layout), now.UTC().Format(layout))
	}
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		return fmt.Errorf("--tls-ca %s: %w", caFile, err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	opts := x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}
	if _, err := leaf.Verify(opts); err != nil {
		return fmt.Errorf("--tls-cert %s (issuer %q) does not chain to --tls-ca %s: %v: peers trusting that CA would refuse it",
			certFile, leaf.Issuer.String(), caFile, err)
	}
	for _, u := range []struct {
		usage x509.ExtKeyUsage
		name  string
	}{{x509.ExtKeyUsageServerAuth, "serverAuth"}, {x509.ExtKeyUsageClientAuth, "clientAuth"}} {
		opts.KeyUsages = []x509.ExtKeyUsage{u.usage}
		if _, err := leaf.Verify(opts); err != nil {
			return fmt.Errorf("--tls-cert %s: not valid for %s (%v): a sidecar both serves and dials, so its extended key usages need serverAuth and clientAuth",
				certFile, u.name, err)
		}
	}
	if err := leaf.VerifyHostname(host); err != nil {
		return fmt.Errorf("--tls-cert %s: its subject alternative names (%s) do not cover %s, the host of %s: peers dialling it would refuse the certificate; issue one that names %s",
			certFile, sanList(leaf), host, what, host)
	}
	return nil
}

// readCerts returns the certificates of a PEM file in file order; a file
// with none is an error.
func readCerts(file string) ([]*x509.Certificate, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var out []*x509.Certificate
	for rest := b; ; {
		var blk *pem.Block
		if blk, rest = pem.Decode(rest); blk == nil {
			break
		}
		if blk.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("holds no PEM certificate")
	}
	return out, nil
}

// checkCA checks that file holds at least one CA certificate: peers are
// verified against it, and a leaf there (basic constraints CA:FALSE) makes
// every handshake fail only once an engine attaches.
func checkCA(file string) error {
	certs, err := readCerts(file)
	if err != nil {
		return err
	}
	for _, c := range certs {
		if c.IsCA {
			return nil
		}
	}
	return fmt.Errorf("holds no CA certificate: %q is a leaf (IsCA false); give the CA that signs every peer", certs[0].Subject.String())
}

// sanList describes the subject alternative names of c, e.g.
// "IP 127.0.0.1, DNS localhost", or "none".
func sanList(c *x509.Certificate) string {
	var s []string
	for _, ip := range c.IPAddresses {
		s = append(s, "IP "+ip.String())
	}
	for _, d := range c.DNSNames {
		s = append(s, "DNS "+d)
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}

// advertisedFrom names the flag the advertised address came from, for
// checkCertificate's message.
func advertisedFrom(f *serveFlags, rankAddrs []string) string {
	switch {
	case len(rankAddrs) > 0:
		return fmt.Sprintf("--rank-addrs entry %d (--tp-rank), the advertised address", f.tpRank)
	case f.advertise != "":
		return "--advertise"
	}
	return "--listen (the advertised address)"
}

// hostOf is the host of a host:port address that checkAddr accepted.
func hostOf(addr string) string {
	h, _, _ := net.SplitHostPort(addr)
	return h
}

// checkWritableDir creates dir if missing and checks that a file can be
// created in it.
func checkWritableDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	probe, err := os.CreateTemp(dir, ".kvsidecar-probe-*")
	if err != nil {
		return err
	}
	return errors.Join(probe.Close(), os.Remove(probe.Name()))
}

// advertisedAddr is the address peers reach this rank at: --advertise, or
// the entry of --rank-addrs for this rank, or the bound --listen address.
// A --rank-addrs entry must agree with --advertise or the listen address:
// the same port, and the same host unless the socket listens on every
// address (0.0.0.0, ::), when the entry names the host. A disagreement is a
// usage error naming both.
func advertisedAddr(f *serveFlags, rankAddrs []string, bound net.Addr) (string, error) {
	if len(rankAddrs) == 0 {
		if f.advertise != "" {
			return f.advertise, nil
		}
		return bound.String(), nil
	}
	entry := rankAddrs[f.tpRank]
	eh, _, _ := net.SplitHostPort(entry)
	disagree := func(what, a string) error {
		return usageErrorf("--rank-addrs entry %d (--tp-rank) is %s but %s is %s: peers would dial one while this rank announces the other",
			f.tpRank, entry, what, a)
	}
	if f.advertise != "" {
		ah, _, _ := net.SplitHostPort(f.advertise)
		if addrPort(entry) != addrPort(f.advertise) || !sameHost(eh, ah) {
			return "", disagree("--advertise", f.advertise)
		}
		return f.advertise, nil
	}
	bh, _, _ := net.SplitHostPort(bound.String())
	lh, _, _ := net.SplitHostPort(f.listen)
	ip := net.ParseIP(bh)
	if addrPort(entry) != addrPort(bound.String()) || !(ip.IsUnspecified() || sameHost(eh, bh) || sameHost(eh, lh)) {
		return "", disagree("the bound --listen address", bound.String())
	}
	return entry, nil
}

// sameHost reports whether two hosts of host:port addresses are the same:
// equal IPs, or names equal but for case.
func sameHost(a, b string) bool {
	if ia, ib := net.ParseIP(a), net.ParseIP(b); ia != nil && ib != nil {
		return ia.Equal(ib)
	}
	return strings.EqualFold(a, b)
}
