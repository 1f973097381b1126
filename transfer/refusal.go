package transfer

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Reasons a served TLS handshake is refused, the label values of
// kvsidecar_transfer_tls_refused_total.
const (
	tlsNoCertificate    = "no_certificate"
	tlsUnknownAuthority = "unknown_authority"
	tlsExpired          = "expired"
	tlsNotYetValid      = "not_yet_valid"
	tlsKeyUsage         = "key_usage"
	tlsInvalid          = "invalid"
)

var tlsRefusalReasons = []string{tlsNoCertificate, tlsUnknownAuthority, tlsExpired, tlsNotYetValid, tlsKeyUsage, tlsInvalid}

// servingTLS makes st (a copy, ClientAuth set by the caller) verify the
// dialer's certificate itself, so a refusal is seen where it happens: it is
// counted by reason and logged with the peer's address (rate-limited).
// crypto/tls refuses a certificate it verifies before any callback runs;
// here it only requests one, and VerifyConnection, which runs for every
// handshake (resumed ones included), requires it and verifies it against
// ClientCAs for client authentication exactly as RequireAndVerifyClientCert
// does. The dialer gets the TLS alert "bad certificate"; why is in this
// side's log. A config with its own GetConfigForClient is left to
// crypto/tls.
func (srv *server) servingTLS(st *tls.Config) *tls.Config {
	if st.GetConfigForClient != nil {
		return st
	}
	st.ClientAuth = tls.RequestClientCert
	// Every per-connection copy below must share the session ticket keys,
	// or no ticket (and no 0-RTT) would survive its connection: this
	// initializes them before the copies are made.
	_, _ = st.DecryptTicket(nil, tls.ConnectionState{})
	roots := st.ClientCAs
	outer := st.Clone()
	outer.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
		peer := "unknown"
		if hello.Conn != nil { // quic-go sets it, with the remote address
			peer = hello.Conn.RemoteAddr().String()
		}
		c := st.Clone()
		// No list of acceptable CAs in the certificate request: a dialer
		// whose certificate another CA signed presents it anyway (Go's
		// client sends none that the list does not name), so the refusal
		// says unknown_authority, not no_certificate.
		c.ClientCAs = nil
		c.VerifyConnection = func(cs tls.ConnectionState) error {
			return srv.checkPeerCert(cs, roots, x509.ExtKeyUsageClientAuth, "", peer)
		}
		return c, nil
	}
	return outer
}

// dialingTLS makes tc, one dial's copy of the client config, verify the
// served agent's certificate itself (against tc.RootCAs, for tc.ServerName
// and server authentication, as crypto/tls does), so a dialer that refuses
// a peer's certificate (signed by another CA, expired, for another name)
// counts and logs it with the peer's address like a serving agent does,
// and always presents its own first certificate, whatever CAs the peer
// says it accepts. A config with its own VerifyConnection or
// InsecureSkipVerify is left to crypto/tls.
func (d *dialer) dialingTLS(tc *tls.Config, peer string) {
	if tc.InsecureSkipVerify || tc.VerifyConnection != nil {
		return
	}
	roots, name := tc.RootCAs, tc.ServerName
	tc.InsecureSkipVerify = true // the chain is verified below, for every handshake (resumed ones included)
	tc.VerifyConnection = func(cs tls.ConnectionState) error {
		return d.checkPeerCert(cs, roots, x509.ExtKeyUsageServerAuth, name, peer)
	}
	if tc.GetClientCertificate == nil && len(tc.Certificates) > 0 {
		cert := &tc.Certificates[0]
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
	}
}

// checkPeerCert verifies the peer's certificate of cs (peerCert) and, when
// it is refused, counts it by reason and logs it with the peer's address
// (rate-limited): the refusing side shows why, dialer or server.
func (c *core) checkPeerCert(cs tls.ConnectionState, roots *x509.CertPool, usage x509.ExtKeyUsage, name, peer string) error {
	reason, err := peerCert(cs, roots, usage, name, time.Now())
	if err != nil {
		c.m.tlsRefused.WithLabelValues(reason).Inc()
		c.refusals.log(c.log, "tls "+reason, "transfer: refused a peer's TLS handshake", "peer", peer, "reason", reason, "err", err)
	}
	return err
}

// peerCert verifies the peer's certificate chain of cs against roots for
// usage (client or server authentication) and, when name is set, for that
// host name or IP address, at now, as crypto/tls does, and classifies a
// failure into one of tlsRefusalReasons.
func peerCert(cs tls.ConnectionState, roots *x509.CertPool, usage x509.ExtKeyUsage, name string, now time.Time) (string, error) {
	if len(cs.PeerCertificates) == 0 {
		return tlsNoCertificate, errors.New("transfer: the peer presented no certificate (mutual TLS requires one)")
	}
	leaf := cs.PeerCertificates[0]
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	_, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now, DNSName: name,
		KeyUsages: []x509.ExtKeyUsage{usage}})
	if err == nil {
		return "", nil
	}
	reason := tlsInvalid
	var ua x509.UnknownAuthorityError
	var ci x509.CertificateInvalidError
	switch {
	case errors.As(err, &ua):
		reason = tlsUnknownAuthority
	case errors.As(err, &ci) && ci.Reason == x509.Expired && now.Before(leaf.NotBefore):
		reason = tlsNotYetValid
	case errors.As(err, &ci) && ci.Reason == x509.Expired:
		reason = tlsExpired
	case errors.As(err, &ci) && ci.Reason == x509.IncompatibleUsage:
		reason = tlsKeyUsage
	}
	return reason, fmt.Errorf("transfer: peer certificate %q (issuer %q): %w", leaf.Subject.String(), leaf.Issuer.String(), err)
}

// logRefusal logs a request this agent refused to serve: permission and
// validity refusals (a capability that does not cover the blocks, a
// descriptor outside the registered regions, an unknown or expired request,
// a malformed or incompatible request) at Warn, rate-limited per code, so
// the refusing side shows what the refused side is told (one line per
// message and code per refusalLogEvery); back-pressure and
// shutdown refusals at Debug.
func (c *core) logRefusal(peer, msg string, err error, args ...any) {
	code := codes.Of(err)
	args = append([]any{"peer", peer, "code", code.String(), "err", err}, args...)
	switch code {
	case v1.Code_CODE_CAPABILITY_DENIED, v1.Code_CODE_OUT_OF_RANGE, v1.Code_CODE_INVALID_ARGUMENT, v1.Code_CODE_NOT_FOUND,
		v1.Code_CODE_LEASE_EXPIRED, v1.Code_CODE_INCOMPATIBLE_MODEL, v1.Code_CODE_TP_MISMATCH:
		c.refusals.log(c.log, msg+" "+code.String(), msg, args...)
	default:
		c.log.Debug(msg, args...)
	}
}

// refusalLog rate-limits the log lines of refusals: a peer that retries a
// refused handshake or READ in a loop must not flood the log. Each kind of
// refusal logs at most one line per refusalLogEvery; the next line says how
// many were left out meanwhile (counters count every one).
type refusalLog struct {
	mu    sync.Mutex
	kinds map[string]*refusalKind
}

type refusalKind struct {
	last       time.Time
	suppressed int
}

// refusalLogEvery is the least time between two log lines of one kind of
// refusal.
const refusalLogEvery = 10 * time.Second

// log writes msg with args at Warn unless a line of kind was written less
// than refusalLogEvery ago.
func (l *refusalLog) log(log *slog.Logger, kind, msg string, args ...any) {
	l.mu.Lock()
	if l.kinds == nil {
		l.kinds = map[string]*refusalKind{}
	}
	k := l.kinds[kind]
	if k == nil {
		k = &refusalKind{}
		l.kinds[kind] = k
	}
	now := time.Now()
	if !k.last.IsZero() && now.Sub(k.last) < refusalLogEvery {
		k.suppressed++
		l.mu.Unlock()
		return
	}
	suppressed := k.suppressed
	k.last, k.suppressed = now, 0
	l.mu.Unlock()
	if suppressed > 0 {
		args = append(args, "suppressed_since_last", suppressed)
	}
	log.Warn(msg, args...)
}
