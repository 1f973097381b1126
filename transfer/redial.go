package transfer

import (
	"context"
	"errors"

	"github.com/quic-go/quic-go"
)

// withConn runs op on the cached connection to addr (dialing one when there
// is none) and applies the redial rule of the package doc: when op fails
// because that connection died under it, op runs once more on a new one;
// when the new one cannot be had, the original error is returned. A refusal
// is returned as it is. op learns whether it runs on a redialed connection.
//
// Every call that uses a cached connection goes through here: Handshake,
// Heartbeat, Notify, Prepare and Transfer.
//
// A refusal that ended the connection, or a dial that failed, answers the
// calls to addr already started as well: they get its error instead of
// dialing again (two requests that race to a peer that refuses them cost
// one refused dial, not two).
func (d *dialer) withConn(ctx context.Context, addr string, op func(p *peer, redialed bool) error) error {
	call := d.markedCall(ctx, d.calls.Add(1))
	p, err := d.peerFor(ctx, addr, call)
	if err != nil {
		return err
	}
	redialed, resent := false, false
	var orig error // the error that made the call redial
	for {
		err = op(p, redialed)
		if err == nil {
			return nil
		}
		if redialed && p.conn.Context().Err() != nil && !handshakeDone(p.conn) {
			// The new connection ended without completing its handshake
			// (a dial in 0-RTT returns before that): the redial failed.
			d.log.Info("transfer: redial failed", "peer", addr, "err", err)
			return orig
		}
		if ctx.Err() != nil || d.isClosed() {
			return err
		}
		switch {
		case errors.Is(err, quic.Err0RTTRejected) && !resent:
			// The server refused the early data but the handshake goes on
			// (a peer that restarted has new ticket keys): quic-go's
			// NextConnection is the connection to send on again. This is
			// part of the dial, so a redialed call may meet it too.
			if nerr := waitConn(ctx, p.conn); nerr != nil {
				return err
			}
			resent = true
		case connDied(err) && !redialed:
			// quic-go fails the streams before it cancels the connection's
			// context: wait for the latter so OnPeerGone runs, and what was
			// learned on the old connection is dropped, before a new one to
			// addr is used.
			select {
			case <-p.conn.Context().Done():
			case <-ctx.Done():
				return err
			}
			d.peerGone(p)
			d.log.Info("transfer: connection died under a call; redialing once", "peer", addr, "err", err)
			np, derr := d.peerFor(ctx, addr, call)
			if derr != nil {
				d.log.Info("transfer: redial failed", "peer", addr, "err", derr)
				return err
			}
			p, redialed, resent, orig = np, true, false, err
		default:
			if connEnded(err) {
				// The refusal closed the connection (a standby's "no
				// engine attached", a TLS alert): the next call dials
				// anew instead of meeting this close again on the cached
				// connection, whose context quic-go may not have ended
				// yet.
				d.dropFailed(p, err, false)
			}
			return err
		}
	}
}

// connEnded reports whether err ended the whole connection it happened on,
// as opposed to a refusal of one stream (a coded reply or a stream reset).
func connEnded(err error) bool {
	if _, ok := errors.AsType[*quic.ApplicationError](err); ok {
		return true
	}
	if _, ok := errors.AsType[*quic.TransportError](err); ok {
		return true
	}
	return connDied(err)
}

// connDied reports whether err says that the connection it happened on
// ended without refusing anything: a stateless reset (the peer's address
// is served by a process that does not know the connection, typically a
// restarted one), an idle timeout, or a close with application code 0 (the
// agent's "agent closing" or "disconnect": a peer going away, or this side
// dropping the connection). TLS alerts and other transport errors, stream
// resets with a code and coded replies are refusals.
func connDied(err error) bool {
	if _, ok := errors.AsType[*quic.StatelessResetError](err); ok {
		return true
	}
	if _, ok := errors.AsType[*quic.IdleTimeoutError](err); ok {
		return true
	}
	if ae, ok := errors.AsType[*quic.ApplicationError](err); ok {
		return ae.ErrorCode == 0
	}
	return false
}

// handshakeDone reports whether conn completed its handshake.
func handshakeDone(conn *quic.Conn) bool {
	select {
	case <-conn.HandshakeComplete():
		return true
	default:
		return false
	}
}
