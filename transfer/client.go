package transfer

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Xfer describes one READ or WRITE between local descriptors and the peer's.
// Local[i] pairs with the i-th remote descriptor and both have the same Len.
type Xfer struct {
	// Op is OpRead (peer → local) or OpWrite (local → peer).
	Op Op
	// Peer is the remote agent's host:port.
	Peer string
	// RequestID, ExportID and Capability are the peer's request id, its
	// export of that request and the capability it issued for the export
	// (kv_transfer_params rank_exports).
	RequestID  string
	ExportID   uint64
	Capability []byte
	// Local descriptors name this agent's registered memory.
	Local []Desc
	// Remote names the peer's memory explicitly, or
	Remote []Desc
	// RemoteList with Indices names entries of a prepared list
	// (index = region × num_blocks + block_id), or
	RemoteList *DescList
	Indices    []uint32
	// RemoteBlocks names the peer's memory by region and block (READ
	// only): the peer resolves it against its own layout, so the dialer
	// needs none of its addresses. Local descriptors then need only total
	// its bytes (BlockDescs.Bytes), bytes landing in Local's order; with
	// Checksum they must pair one to one with its entries.
	RemoteBlocks *BlockDescs
	// Expect, when set, is checked by the peer (its Config.CheckExpect)
	// before it serves a byte: the compatibility facts a handshake would
	// have checked, for a READ that does not wait for one.
	Expect *v1.PeerExpect
	// Checksum asks the sender of the bytes for a CRC-32C per descriptor,
	// checked by the receiver (ErrDataLoss on mismatch).
	Checksum bool
	// OnRedial, when set, is called when the connection the transfer ran on
	// died under it and a new connection to Peer is up, before the transfer
	// is sent again (the redial rule of the package doc), and when the
	// same-host socket SameHost names is gone or serves another agent,
	// before the READ goes over QUIC instead. The peer may now
	// be another process whose memory lies elsewhere: a non-nil error stops
	// the transfer, which then fails with that error. Default nil: the
	// transfer is sent again as it is.
	OnRedial func(ctx context.Context) error
	// ConsumerEngineID and ConsumerTPRank name who the READ is for (a
	// decode rank: the identity its notification carries), so a serving
	// agent's owner knows which consumers read (a draining prefill waits
	// only for their notifications). Default empty: not said.
	ConsumerEngineID string
	ConsumerTPRank   uint32
	// OnFirstByte, when set on a READ, is called once, on the transfer's
	// goroutine (for a READ striped over lanes, the goroutine of the lane
	// that landed it), as soon as the first payload byte is in local memory
	// (the time to first KV byte); it must not block. Default nil.
	OnFirstByte func()

	// OnLanded, when set on a READ, is called with every run of bytes as
	// it lands in local memory, while it is still in cache, on the
	// goroutine that landed it (a READ lane's, a same-host copier's): at is
	// the run's offset in the READ's local byte stream (Local's
	// descriptors back to back) and b the run (host memory: the local
	// memory itself, or the staging buffer device memory is filled from).
	// The runs of one local descriptor land in order; of a READ by region
	// and block (RemoteBlocks), each block's runs land in region order on
	// one goroutine. Runs of different blocks, or of a READ of explicit
	// descriptors striped over lanes, may land concurrently. It must not
	// block or keep
	// b. It is not called for bytes that never pass through host memory (a
	// same-host READ of device pages). When the READ fails, some runs may
	// have been reported. Default nil.
	OnLanded func(at uint64, b []byte)
	// SameHost, when set on a READ naming Remote or RemoteBlocks, sends it
	// to the peer's same-host socket (samehost.go) instead of a QUIC
	// stream: the bytes are copied from the peer's pages, mapped
	// read-only while the READ runs. When that path cannot be had (the
	// socket is unreachable or another agent's, another uid, pages this
	// agent cannot map) the READ goes over QUIC, logged once per socket.
	// Default nil: QUIC.
	SameHost *SameHostPeer

	// lane is set by transferLanes on the copy each READ lane runs: the
	// READ's post time is lane 0's, so lanes 1..K-1 do not observe it.
	lane int
}

// BlockDescs names, region-major, bytes [Offset, Offset+Len) of every block
// of BlockIDs in every region of [FirstRegion, FirstRegion+NumRegions) of
// the peer (regions in the order the peer registered them: for a rank, its
// AgentMetadata order). Wire form: v1.BlockDescs.
type BlockDescs struct {
	FirstRegion, NumRegions uint32
	// Offset is bytes from the start of each block; Len bytes taken from
	// each block (> 0, Offset+Len <= the region's block_len).
	Offset, Len uint64
	BlockIDs    []uint32
}

// Entries is the number of descriptors b stands for:
// NumRegions × len(BlockIDs).
func (b *BlockDescs) Entries() uint64 { return uint64(b.NumRegions) * uint64(len(b.BlockIDs)) }

func (b *BlockDescs) proto() *v1.BlockDescs {
	return &v1.BlockDescs{FirstRegion: b.FirstRegion, NumRegions: b.NumRegions, Offset: b.Offset, Len: b.Len, BlockIds: b.BlockIDs}
}

// Result reports a finished transfer.
type Result struct {
	// XferID identifies the transfer in logs on both sides.
	XferID uint64
	// Bytes moved: all of them, since partial delivery is an error.
	Bytes uint64
	// Duration from the call to completion.
	Duration time.Duration
}

// DescList is a descriptor list of a peer's memory prepared once on the
// connection to that peer (NIXL prep_xfer_dlist). It is re-prepared
// transparently after a reconnect. The peer holds it until Close or until
// the connection ends, and bounds what one connection may hold
// (Config.MaxPreparedDescsPerConn). Safe for concurrent use.
type DescList struct {
	d     *dialer
	peer  string
	id    uint64
	descs []Desc

	mu     sync.Mutex
	onConn *quic.Conn
	closed bool
}

// Len is the number of descriptors in the list.
func (l *DescList) Len() int { return len(l.descs) }

// prepare is Agent.Prepare.
func (d *dialer) prepare(ctx context.Context, addr string, descs []Desc) (*DescList, error) {
	if len(descs) == 0 || len(descs) > d.cfg.MaxDescsPerTransfer {
		return nil, errorf(v1.Code_CODE_INVALID_ARGUMENT, "descriptor list of %d entries, want 1..%d", len(descs), d.cfg.MaxDescsPerTransfer)
	}
	l := &DescList{d: d, peer: addr, id: d.nextList.Add(1), descs: append([]Desc(nil), descs...)}
	if err := d.withConn(ctx, addr, func(p *peer, _ bool) error { return d.ensurePrepared(ctx, p, l) }); err != nil {
		return nil, err
	}
	return l, nil
}

// Close releases the list on the peer (an UnprepDescList on the connection
// it was prepared on), so its descriptors stop counting against the peer's
// per-connection bound; transfers naming it afterwards fail with
// ErrInvalidArgument. When that connection is gone there is nothing to
// release and Close returns nil. A transfer still running with the list is
// unaffected once the peer resolved its indices; one starting concurrently
// may fail with ErrNotFound. Errors: the peer's class, ErrUnavailable,
// context.Cause(ctx); a second Close returns an error wrapping net.ErrClosed.
func (l *DescList) Close(ctx context.Context) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return fmt.Errorf("transfer: descriptor list %d already closed: %w", l.id, net.ErrClosed)
	}
	l.closed = true
	conn := l.onConn
	l.onConn = nil
	if conn == nil || conn.Context().Err() != nil {
		return nil
	}
	resp, err := l.d.exchange(ctx, conn, &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1,
		Body: &v1.PeerRequest_Unprep{Unprep: &v1.UnprepDescList{DlistId: l.id}}}, false)
	if err != nil {
		if conn.Context().Err() != nil && ctx.Err() == nil {
			return nil // the connection, and the list with it, ended meanwhile
		}
		return l.d.streamErr(ctx, l.peer, err)
	}
	ub, ok := resp.GetBody().(*v1.PeerResponse_Unprep)
	if !ok {
		return errorf(v1.Code_CODE_INTERNAL, "peer %s answered an unprepare with %T", l.peer, resp.GetBody())
	}
	return codes.FromProto(l.peer, ub.Unprep)
}

func (d *dialer) ensurePrepared(ctx context.Context, p *peer, l *DescList) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return fmt.Errorf("%w: transfer: descriptor list %d for %s was closed: %w", ErrInvalidArgument, l.id, l.peer, net.ErrClosed)
	}
	if l.onConn == p.conn {
		return nil
	}
	req := &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, Body: &v1.PeerRequest_Prep{
		Prep: &v1.PrepDescList{DlistId: l.id, Descs: descsToProto(l.descs)}}}
	resp, err := d.roundTrip(ctx, p, req, false)
	if err != nil {
		return err
	}
	pb, ok := resp.GetBody().(*v1.PeerResponse_Prep)
	if !ok {
		return errorf(v1.Code_CODE_INTERNAL, "peer %s answered a prepare with %T", p.addr, resp.GetBody())
	}
	if err := codes.FromProto(p.addr, pb.Prep); err != nil {
		return err
	}
	l.onConn = p.conn
	return nil
}

// handshake is Agent.Handshake.
func (d *dialer) handshake(ctx context.Context, addr string, req *v1.HandshakeRequest) (*v1.HandshakeResponse, error) {
	resp, err := d.call(ctx, addr, &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1,
		Body: &v1.PeerRequest_Handshake{Handshake: req}}, true)
	if err != nil {
		return nil, err
	}
	hb, ok := resp.GetBody().(*v1.PeerResponse_Handshake)
	if !ok {
		return nil, errorf(v1.Code_CODE_INTERNAL, "peer %s answered a handshake with %T", addr, resp.GetBody())
	}
	return hb.Handshake, nil
}

// heartbeat is Agent.Heartbeat.
func (d *dialer) heartbeat(ctx context.Context, addr string, hb *v1.Heartbeat) (*v1.HeartbeatAck, error) {
	resp, err := d.call(ctx, addr, &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1,
		Body: &v1.PeerRequest_Heartbeat{Heartbeat: hb}}, false)
	if err != nil {
		return nil, err
	}
	b, ok := resp.GetBody().(*v1.PeerResponse_Heartbeat)
	if !ok {
		return nil, errorf(v1.Code_CODE_INTERNAL, "peer %s answered a heartbeat with %T", addr, resp.GetBody())
	}
	return b.Heartbeat, codes.FromProto(addr, b.Heartbeat.GetError())
}

// notify is Agent.Notify.
func (d *dialer) notify(ctx context.Context, addr string, n *v1.Notification) error {
	req := &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, Body: &v1.PeerRequest_Notification{Notification: n}}
	var resp *v1.PeerResponse
	err := d.withConn(ctx, addr, func(p *peer, _ bool) error {
		p.notifMu.Lock()
		defer p.notifMu.Unlock()
		var err error
		resp, err = d.roundTrip(ctx, p, req, false)
		return err
	})
	if err != nil {
		return err
	}
	b, ok := resp.GetBody().(*v1.PeerResponse_Notification)
	if !ok {
		return errorf(v1.Code_CODE_INTERNAL, "peer %s answered a notification with %T", addr, resp.GetBody())
	}
	return codes.FromProto(addr, b.Notification.GetError())
}

// call runs one request/response exchange with addr under the redial rule;
// early requests may travel in 0-RTT.
func (d *dialer) call(ctx context.Context, addr string, req *v1.PeerRequest, early bool) (*v1.PeerResponse, error) {
	var resp *v1.PeerResponse
	err := d.withConn(ctx, addr, func(p *peer, _ bool) error {
		var err error
		resp, err = d.roundTrip(ctx, p, req, early)
		return err
	})
	return resp, err
}

// roundTrip opens a stream on p, sends req, reads one response; early
// requests may travel in 0-RTT (withConn sends them again when the server
// rejected 0-RTT).
func (d *dialer) roundTrip(ctx context.Context, p *peer, req *v1.PeerRequest, early bool) (*v1.PeerResponse, error) {
	resp, err := d.exchange(ctx, p.conn, req, early)
	if err != nil {
		return nil, d.streamErr(ctx, p.addr, err)
	}
	return resp, nil
}

func (d *dialer) exchange(ctx context.Context, conn *quic.Conn, req *v1.PeerRequest, early bool) (*v1.PeerResponse, error) {
	if !early || noEarlyStreams {
		if err := waitConn(ctx, conn); err != nil {
			return nil, err
		}
	}
	str, err := conn.OpenStreamSync(ctx)
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() {
		str.CancelRead(quic.StreamErrorCode(v1.Code_CODE_ABORTED))
		str.CancelWrite(quic.StreamErrorCode(v1.Code_CODE_ABORTED))
	})
	defer stop()
	if err := wire.WriteMsg(str, req, 0); err != nil {
		return nil, err
	}
	_ = str.Close()
	var resp v1.PeerResponse
	if err := wire.NewReader(str, 0).ReadMsg(&resp); err != nil {
		if errors.Is(err, quic.Err0RTTRejected) {
			return nil, err // see transferOn: the stream is gone
		}
		str.CancelRead(quic.StreamErrorCode(v1.Code_CODE_INVALID_ARGUMENT))
		return nil, err
	}
	return &resp, nil
}

// waitConn waits until conn's handshake is complete (1-RTT keys) and makes
// it usable after a rejected 0-RTT (NextConnection is idempotent): a stream
// opened between the handshake and the watcher's own NextConnection call
// failed with "0-RTT rejected" when a peer restarted with new ticket keys.
func waitConn(ctx context.Context, conn *quic.Conn) error {
	_, err := conn.NextConnection(ctx)
	return err
}

// streamErr classifies an error of a stream or connection operation.
func (d *dialer) streamErr(ctx context.Context, addr string, err error) error {
	if ctx.Err() != nil {
		cause := context.Cause(ctx)
		if errors.Is(cause, context.DeadlineExceeded) {
			return fmt.Errorf("%w: transfer: %s: %w", ErrTimeout, addr, cause)
		}
		return fmt.Errorf("%w: transfer: %s: %w", ErrAborted, addr, cause)
	}
	var se *quic.StreamError
	if errors.As(err, &se) && se.Remote {
		c := v1.Code(se.ErrorCode)
		if _, ok := v1.Code_name[int32(c)]; !ok || c == v1.Code_CODE_OK {
			c = v1.Code_CODE_ABORTED
		}
		return fmt.Errorf("transfer: %s reset the stream: %w", addr, codes.New(c, "peer code %v", c))
	}
	if d.isClosed() {
		return errClosed()
	}
	var ie *quic.IdleTimeoutError
	if errors.As(err, &ie) {
		return fmt.Errorf("%w: transfer: %s: %w", ErrTimeout, addr, err)
	}
	var c codes.Coder
	if errors.As(err, &c) {
		return err
	}
	if te, ok := errors.AsType[*quic.TransportError](err); ok && te.Remote && te.ErrorCode.IsCryptoError() {
		// TLS 1.3 lets the dialer finish before the server checks its
		// certificate: the refusal arrives on the first call.
		return fmt.Errorf("%w: transfer: %s refused this agent's TLS handshake (%w); its log says why (%s): check that its --tls-ca signs this agent's certificate",
			ErrUnavailable, addr, err, strings.Join(tlsRefusalReasons, ", "))
	}
	return fmt.Errorf("%w: transfer: %s: %w", ErrUnavailable, addr, err)
}

// transfer is Agent.Transfer.
func (d *dialer) transfer(ctx context.Context, x *Xfer) (Result, error) {
	start := time.Now()
	id := d.nextXfer.Add(1)
	res := Result{XferID: id}
	xe := &XferError{Op: x.Op, Peer: x.Peer, XferID: id}
	fail := func(err error) (Result, error) {
		xe.Err = err
		d.m.failures.WithLabelValues(codes.Of(err).String()).Inc()
		d.m.xferDone(x.Op, roleClient, false)
		return res, xe
	}
	local, remote, total, err := d.checkXfer(x)
	xe.Total = total
	if err != nil {
		return fail(err)
	}
	b := d.budgetFor(x.Peer)
	if err := b.acquire(ctx.Done(), func() error { return context.Cause(ctx) }, total); err != nil {
		return fail(d.streamErr(ctx, x.Peer, err))
	}
	d.m.inflight.Add(float64(total))
	defer func() {
		b.release(total)
		d.m.inflight.Sub(float64(total))
	}()
	req := &v1.XferRequest{Op: v1.XferOp(x.Op), RequestId: x.RequestID, ExportId: x.ExportID, Capability: x.Capability,
		Checksum: x.Checksum, XferId: id, TotalLen: total, Expect: x.Expect,
		ConsumerEngineId: x.ConsumerEngineID, ConsumerTpRank: x.ConsumerTPRank}
	switch {
	case x.RemoteBlocks != nil:
		req.Descs = &v1.XferRequest_Blocks{Blocks: x.RemoteBlocks.proto()}
	case x.RemoteList != nil:
		req.Descs = &v1.XferRequest_Indexed{Indexed: &v1.IndexedDescs{DlistId: x.RemoteList.id, Indices: x.Indices}}
	default:
		req.Descs = &v1.XferRequest_List{List: descsToProto(remote)}
	}
	err = errNotLocal
	if x.SameHost != nil && x.Op == OpRead && x.RemoteList == nil && sameHostSupported {
		err = d.transferLocal(ctx, x, req, local, xe, start)
	}
	if errors.Is(err, errNotLocal) { // not sent on the same-host path: QUIC
		xe.Bytes = 0
		checkedRedial := false // withConn redials at most once; a READ resent after 0-RTT was rejected comes here again
		if errors.Is(err, errPeerChanged) && x.OnRedial != nil {
			// The peer the caller's metadata named restarted: learn the
			// new one before the READ goes over QUIC to its address.
			checkedRedial = true
			if err := x.OnRedial(ctx); err != nil {
				return fail(err)
			}
		}
		err = d.withConn(ctx, x.Peer, func(p *peer, redialed bool) error {
			xe.Bytes, xe.Sent = 0, 0
			if redialed && !checkedRedial {
				checkedRedial = true
				if x.OnRedial != nil {
					if err := x.OnRedial(ctx); err != nil {
						return err
					}
				}
			}
			return d.transferLanes(ctx, p, x, req, local, xe, start)
		})
	}
	if err != nil {
		return fail(err)
	}
	res.Bytes, res.Duration = total, time.Since(start)
	d.m.op(x.Op).xferSecs.Observe(res.Duration.Seconds())
	d.m.xferDone(x.Op, roleClient, true)
	return res, nil
}

// transferOn runs one attempt of x on p's connection; xe records the bytes
// moved. It returns only after the stream was reset or drained.
func (d *dialer) transferOn(ctx context.Context, p *peer, x *Xfer, req *v1.XferRequest, local []span, xe *XferError, start time.Time) error {
	id := xe.XferID
	if x.RemoteList != nil {
		if err := d.ensurePrepared(ctx, p, x.RemoteList); err != nil {
			return err
		}
	}
	// A READ may travel in 0-RTT: the server serves it before the
	// handshake completes, sending bytes only to this connection and
	// changing no lasting state (the package doc's replay argument). A
	// WRITE changes the peer's memory, so it waits.
	if x.Op != OpRead || noEarlyStreams {
		if err := waitConn(ctx, p.conn); err != nil {
			return d.streamErr(ctx, x.Peer, err)
		}
	}
	str, err := p.conn.OpenStreamSync(ctx)
	if err != nil {
		return d.streamErr(ctx, x.Peer, err)
	}

	// Abort machinery: the watchdog and ctx reset the stream; the I/O below
	// then fails, and Transfer returns only after the reset was issued and
	// the I/O stopped touching local memory.
	var (
		abortOnce  sync.Once
		abortCause error
	)
	abort := func(code v1.Code, cause error) {
		abortOnce.Do(func() {
			abortCause = cause
			str.CancelRead(quic.StreamErrorCode(code))
			str.CancelWrite(quic.StreamErrorCode(code))
			if d.cfg.testHook != nil {
				d.cfg.testHook("reset", id)
			}
		})
	}
	wd := startWatchdog(d.cfg.ProgressTimeout, func() {
		abort(v1.Code_CODE_TIMEOUT, errorf(v1.Code_CODE_TIMEOUT, "no progress from %s for %v", x.Peer, d.cfg.ProgressTimeout))
	})
	wd.count = d.meter(x.Op, roleClient)
	if first := x.OnFirstByte; first != nil && x.Op == OpRead {
		count, called := wd.count, false
		wd.count = func(n int) {
			count(n)
			if !called {
				called = true
				first()
			}
		}
	}
	stopCtx := context.AfterFunc(ctx, func() {
		cause := context.Cause(ctx)
		if errors.Is(cause, context.DeadlineExceeded) {
			abort(v1.Code_CODE_TIMEOUT, fmt.Errorf("%w: transfer: %w", ErrTimeout, cause))
			return
		}
		abort(v1.Code_CODE_ABORTED, fmt.Errorf("%w: transfer: aborted: %w", ErrAborted, cause))
	})

	var ioErr error
	posted := func() {
		if x.lane == 0 {
			d.m.op(x.Op).postSecs.Observe(time.Since(start).Seconds())
		}
	}
	if x.Op == OpRead {
		ioErr = d.runRead(str, req, local, x.Checksum, x.OnLanded, wd, xe, posted)
	} else {
		ioErr = d.runWrite(str, req, local, x.Checksum, wd, xe, posted)
	}
	wd.stop()
	stopCtx()
	abortOnce.Do(func() {}) // waits for an abort in progress; none can start after
	if d.cfg.testHook != nil {
		d.cfg.testHook("released", id)
	}
	if ioErr == nil {
		return nil
	}
	if abortCause != nil {
		return abortCause
	}
	if errors.Is(ioErr, quic.Err0RTTRejected) {
		// The stream died with the rejected 0-RTT data; quic-go numbers
		// the streams of the connection it goes on with from 0 again, so
		// cancelling this one would reset the resent request's stream.
		return d.streamErr(ctx, x.Peer, ioErr)
	}
	str.CancelRead(quic.StreamErrorCode(codes.Of(ioErr)))
	str.CancelWrite(quic.StreamErrorCode(codes.Of(ioErr)))
	return d.streamErr(ctx, x.Peer, ioErr)
}

// checkXfer validates x locally and resolves its local descriptors.
func (d *dialer) checkXfer(x *Xfer) (local []span, remote []Desc, total uint64, err error) {
	if x.Op != OpRead && x.Op != OpWrite {
		return nil, nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "Xfer.Op %v is neither OpRead nor OpWrite", x.Op)
	}
	n := len(x.Local)
	if n == 0 || n > d.cfg.MaxDescsPerTransfer {
		return nil, nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "Xfer.Local has %d descriptors, want 1..%d", n, d.cfg.MaxDescsPerTransfer)
	}
	if x.RemoteBlocks != nil {
		return d.checkBlockXfer(x)
	}
	if x.RemoteList != nil {
		if x.Remote != nil || x.RemoteList.peer != x.Peer {
			return nil, nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "Xfer.RemoteList was prepared for %s and excludes Xfer.Remote; peer is %s", x.RemoteList.peer, x.Peer)
		}
		if len(x.Indices) != n {
			return nil, nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "Xfer.Indices has %d entries for %d local descriptors", len(x.Indices), n)
		}
		remote = make([]Desc, n)
		for i, k := range x.Indices {
			if int(k) >= len(x.RemoteList.descs) {
				return nil, nil, 0, errorf(v1.Code_CODE_OUT_OF_RANGE, "Xfer.Indices[%d] = %d is beyond the list's %d entries", i, k, len(x.RemoteList.descs))
			}
			remote[i] = x.RemoteList.descs[k]
		}
	} else {
		if len(x.Remote) != n {
			return nil, nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "Xfer.Remote has %d descriptors for %d local ones", len(x.Remote), n)
		}
		remote = x.Remote
	}
	local, total, err = d.regionSet().resolveAll(x.Local)
	if err != nil {
		return nil, nil, 0, fmt.Errorf("transfer: Xfer.Local: %w", err)
	}
	for i := range local {
		if remote[i].Len != local[i].n {
			return nil, nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "descriptor %d: local length %d differs from remote %d", i, local[i].n, remote[i].Len)
		}
	}
	if !x.Checksum {
		// Local descriptors that continue one another land as one run
		// (the remote ones the peer merges in its own regions).
		local = mergeSpans(local)
	}
	return local, remote, total, nil
}

// checkBlockXfer validates a READ whose remote side is x.RemoteBlocks (its
// local descriptor count was checked by checkXfer) and resolves its local
// descriptors, which must total the blocks' bytes (and
// pair one to one with their entries when x.Checksum is set).
func (d *dialer) checkBlockXfer(x *Xfer) (local []span, remote []Desc, total uint64, err error) {
	b := x.RemoteBlocks
	bad := func(code v1.Code, format string, args ...any) ([]span, []Desc, uint64, error) {
		return nil, nil, 0, errorf(code, "Xfer.RemoteBlocks: "+format, args...)
	}
	switch {
	case x.Op != OpRead:
		return bad(v1.Code_CODE_INVALID_ARGUMENT, "names the peer's blocks for a %v; only a READ may", x.Op)
	case x.Remote != nil || x.RemoteList != nil:
		return bad(v1.Code_CODE_INVALID_ARGUMENT, "excludes Xfer.Remote and Xfer.RemoteList")
	case b.NumRegions == 0 || len(b.BlockIDs) == 0 || b.Len == 0:
		return bad(v1.Code_CODE_INVALID_ARGUMENT, "%d regions × %d blocks × %d bytes names no byte; each must be > 0", b.NumRegions, len(b.BlockIDs), b.Len)
	case b.Entries() > uint64(d.cfg.MaxDescsPerTransfer):
		return bad(v1.Code_CODE_INVALID_ARGUMENT, "%d regions × %d blocks = %d entries, want at most %d (Config.MaxDescsPerTransfer)",
			b.NumRegions, len(b.BlockIDs), b.Entries(), d.cfg.MaxDescsPerTransfer)
	case b.Len > math.MaxUint64/b.Entries():
		return bad(v1.Code_CODE_OUT_OF_RANGE, "%d entries of %d bytes overflow 64 bits", b.Entries(), b.Len)
	}
	local, total, err = d.regionSet().resolveAll(x.Local)
	if err != nil {
		return nil, nil, 0, fmt.Errorf("transfer: Xfer.Local: %w", err)
	}
	if want := b.Entries() * b.Len; total != want {
		return nil, nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "Xfer.Local totals %d bytes, Xfer.RemoteBlocks names %d (%d regions × %d blocks × %d bytes)",
			total, want, b.NumRegions, len(b.BlockIDs), b.Len)
	}
	if n := len(x.Local); x.Checksum && uint64(n) != b.Entries() {
		return nil, nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "Xfer.Checksum needs one local descriptor per entry of Xfer.RemoteBlocks: %d for %d", n, b.Entries())
	}
	return local, nil, total, nil
}

// runRead sends the request and reads the bytes straight into local memory.
func (d *dialer) runRead(str *quic.Stream, req *v1.XferRequest, local []span, checksum bool, landed func(uint64, []byte), wd *watchdog, xe *XferError, posted func()) error {
	if err := wire.WriteMsg(str, &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, Body: &v1.PeerRequest_Xfer{Xfer: req}}, 0); err != nil {
		return err
	}
	_ = str.Close()
	posted()
	r := getReader(str)
	defer putReader(r)
	var hdr v1.PeerResponse
	if err := r.ReadMsg(&hdr); err != nil {
		return err
	}
	wd.progress(0)
	st, ok := hdr.GetBody().(*v1.PeerResponse_Xfer)
	if !ok {
		return errorf(v1.Code_CODE_INTERNAL, "peer answered a READ with %T", hdr.GetBody())
	}
	if err := codes.FromProto(xe.Peer, st.Xfer.GetError()); err != nil {
		return err
	}
	sums := make([]uint32, len(local))
	err := d.eachRun(local, true, func(i int, off uint64, b []byte) error {
		// In runs of at most landChunk, so OnLanded and the checksum read
		// bytes still in cache.
		for len(b) > 0 {
			run := b[:min(len(b), landChunk)]
			if err := readFull(r, run, &xe.Bytes, wd); err != nil {
				return err
			}
			if checksum {
				sums[i] = crc32.Update(sums[i], castagnoli, run)
			}
			if landed != nil {
				landed(local[i].at+off, run)
			}
			off += uint64(len(run))
			b = b[len(run):]
		}
		return nil
	})
	if err != nil {
		return err
	}
	var fin v1.PeerResponse
	if err := r.ReadMsg(&fin); err != nil {
		return err
	}
	fs, ok := fin.GetBody().(*v1.PeerResponse_Xfer)
	if !ok {
		return errorf(v1.Code_CODE_INTERNAL, "peer ended a READ with %T", fin.GetBody())
	}
	if err := codes.FromProto(xe.Peer, fs.Xfer.GetError()); err != nil {
		return err
	}
	if fs.Xfer.GetBytes() != xe.Total {
		return errorf(v1.Code_CODE_DATA_LOSS, "peer reports %d bytes sent, %d expected", fs.Xfer.GetBytes(), xe.Total)
	}
	if checksum {
		return compareChecksums(fs.Xfer.GetChecksums(), sums)
	}
	return nil
}

// runWrite sends the request and the bytes straight from local memory, then
// waits for the receiver's ack.
func (d *dialer) runWrite(str *quic.Stream, req *v1.XferRequest, local []span, checksum bool, wd *watchdog, xe *XferError, posted func()) error {
	r := getReader(str)
	defer putReader(r)
	// A refusal arrives as a reset of our send side (seen by a Write, or by
	// the Close that follows a Write that got through first); the reply
	// says why. Reading it is bounded by the watchdog and the connection.
	refusal := func(err error) error {
		var resp v1.PeerResponse
		if rerr := r.ReadMsg(&resp); rerr == nil {
			if perr := codes.FromProto(xe.Peer, resp.GetXfer().GetError()); perr != nil {
				return perr
			}
		}
		return err
	}
	if err := wire.WriteMsg(str, &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, Body: &v1.PeerRequest_Xfer{Xfer: req}}, 0); err != nil {
		return refusal(err)
	}
	posted()
	sums := make([]uint32, len(local))
	err := d.eachRun(local, false, func(i int, _ uint64, b []byte) error {
		if checksum {
			sums[i] = crc32.Update(sums[i], castagnoli, b)
		}
		return writeChunks(str, b, &xe.Sent, wd)
	})
	if err != nil {
		return refusal(err)
	}
	if checksum {
		if err := wire.WriteMsg(str, &v1.XferStatus{Checksums: sums}, 0); err != nil {
			return refusal(err)
		}
	}
	if err := str.Close(); err != nil {
		return refusal(err)
	}
	var ack v1.PeerResponse
	if err := r.ReadMsg(&ack); err != nil {
		return err
	}
	st, ok := ack.GetBody().(*v1.PeerResponse_Xfer)
	if !ok {
		return errorf(v1.Code_CODE_INTERNAL, "peer acked a WRITE with %T", ack.GetBody())
	}
	xe.Bytes = st.Xfer.GetBytes()
	if err := codes.FromProto(xe.Peer, st.Xfer.GetError()); err != nil {
		return err
	}
	if xe.Bytes != xe.Total {
		return errorf(v1.Code_CODE_DATA_LOSS, "peer acknowledged %d of %d bytes", xe.Bytes, xe.Total)
	}
	return nil
}
