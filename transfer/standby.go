package transfer

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"sync"

	"github.com/quic-go/quic-go"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Standby answers on an agent's UDP socket while no agent serves it: a
// sidecar between its start and its engine's attach, or between two engine
// sessions. Without it the socket is bound but unread, and a peer that
// still holds a connection to the previous process (or dials anew) sends
// into silence until its own deadline. With it a packet of a connection the
// standby does not know draws a stateless reset (Config.StatelessResetKey,
// so a held connection ends at once and the redial rule dials again), and
// every new connection is closed after its handshake with the standby's
// code and reason, which the dialer's call returns as a refusal (no second
// redial).
type Standby struct {
	tr   *quic.Transport
	ln   *quic.Listener
	wg   sync.WaitGroup
	once sync.Once
	err  error
}

// NewStandby starts answering on cfg.PacketConn, which must be set (the
// standby never closes it) with cfg.ServerTLS (a certificate and ClientCAs,
// as for New), cfg.StatelessResetKey and cfg's QUIC settings. code (not
// CODE_OK) and reason are what a new connection is closed with, e.g.
// CODE_UNAVAILABLE and "no engine attached to tp_rank 0"; a dialer's call
// fails with ErrUnavailable quoting reason. Errors: an invalid cfg, or
// quic-go's listen error.
func NewStandby(cfg *Config, code v1.Code, reason string) (*Standby, error) {
	c := cfg.withDefaults()
	switch {
	case c.PacketConn == nil:
		return nil, errors.New("transfer: standby: Config.PacketConn must be set")
	case c.ServerTLS == nil:
		return nil, errors.New("transfer: standby: Config.ServerTLS must be set")
	case code == v1.Code_CODE_OK:
		return nil, errors.New("transfer: standby: the code must not be CODE_OK (a close with code 0 is a peer going away, which dialers redial)")
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	s := &Standby{tr: &quic.Transport{Conn: c.PacketConn, StatelessResetKey: c.StatelessResetKey}}
	ln, err := s.tr.Listen(servingBase(c.ServerTLS), QUICConfig(c))
	if err != nil {
		_ = s.tr.Close()
		return nil, fmt.Errorf("transfer: standby: listen: %w", err)
	}
	s.ln = ln
	s.wg.Go(func() {
		for {
			conn, err := ln.Accept(context.Background())
			if err != nil {
				return
			}
			_ = conn.CloseWithError(quic.ApplicationErrorCode(code), reason)
		}
	})
	return s, nil
}

// Close stops answering and returns once the socket is no longer read, so
// New may adopt it; it leaves the socket open. Idempotent.
func (s *Standby) Close() error {
	s.once.Do(func() {
		s.err = errors.Join(s.ln.Close(), s.tr.Close())
		s.wg.Wait()
	})
	return s.err
}

// servingBase is the TLS config every served connection starts from: a
// copy of st with TLS 1.3, ALPN kvsidecar/1 and mutual TLS forced.
func servingBase(st *tls.Config) *tls.Config {
	st = st.Clone()
	st.MinVersion = tls.VersionTLS13
	st.NextProtos = []string{ALPN}
	st.ClientAuth = tls.RequireAndVerifyClientCert
	return st
}
