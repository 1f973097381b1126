package transfer

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"sync"
	"sync/atomic"

	"github.com/quic-go/quic-go"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// maxListsPerConn bounds the descriptor lists one connection may prepare.
const maxListsPerConn = 4096

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// servedConn is the serving side's state of one accepted connection.
type servedConn struct {
	conn    *quic.Conn
	peer    string
	budget  *budget
	notifMu sync.Mutex
	// turn passes the accepting of streams to an idle goroutine
	// (acceptStreams); idle counts those waiting for it.
	turn chan struct{}
	idle atomic.Int32

	mu       sync.Mutex
	dlists   map[uint64][]span
	prepared int // descriptors of all lists in dlists
}

// server is the serving half of an Agent: the listener and every
// connection being served, each with its own byte budget and prepared
// lists (servedConn). What it serves is checked against the Agent's
// registered regions and authorized through its Config. Its lock is its
// own (the dialing half never takes it); its goroutines, the accept loop,
// one per served connection and those serving its streams, are in wg.
type server struct {
	*core
	ln *quic.EarlyListener // set by Agent.Start under Agent.mu; nil: the agent does not serve

	mu     sync.Mutex
	closed bool // the agent is closing: no connection is added
	conns  map[*quic.Conn]struct{}
	local  *localServer // the same-host listener; nil: none
	token  []byte       // the same-host socket's token (Agent.SameHost)

	wg sync.WaitGroup
}

// add records conn as served and adds its goroutine to wg, unless the
// server is closed.
func (srv *server) add(conn *quic.Conn) bool {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if srv.closed {
		return false
	}
	srv.conns[conn] = struct{}{}
	srv.wg.Add(1)
	return true
}

func (srv *server) remove(conn *quic.Conn) {
	srv.mu.Lock()
	delete(srv.conns, conn)
	srv.mu.Unlock()
}

// shut marks the server closed, so no connection is added from now on,
// closes the same-host listener and its connections, and returns the QUIC
// connections to close.
func (srv *server) shut() []*quic.Conn {
	srv.mu.Lock()
	srv.closed = true
	conns := make([]*quic.Conn, 0, len(srv.conns))
	for c := range srv.conns {
		conns = append(conns, c)
	}
	local := srv.local
	srv.mu.Unlock()
	if local != nil {
		local.shut()
	}
	return conns
}

func (srv *server) acceptLoop() {
	defer srv.wg.Done()
	for {
		conn, err := srv.ln.Accept(srv.ctx)
		if err != nil {
			return
		}
		if !srv.add(conn) {
			_ = conn.CloseWithError(0, "agent closing")
			return
		}
		sc := &servedConn{conn: conn, peer: conn.RemoteAddr().String(),
			budget: newBudget(srv.cfg.MaxInflightPerPeer), dlists: make(map[uint64][]span), turn: make(chan struct{})}
		go srv.serveConn(sc)
	}
}

func (srv *server) serveConn(sc *servedConn) {
	defer srv.wg.Done()
	var wg sync.WaitGroup
	defer func() {
		wg.Wait()
		srv.remove(sc.conn)
	}()
	// Datagrams carry only the dialer's keep-alive probes: discard them.
	wg.Go(func() {
		for {
			if _, err := sc.conn.ReceiveDatagram(sc.conn.Context()); err != nil {
				return
			}
		}
	})
	srv.acceptStreams(sc, &wg)
}

// idleServers bounds the goroutines a connection keeps waiting to accept
// its next stream after serving one.
const idleServers = 4

// acceptStreams serves sc's streams; one goroutine at a time accepts. The
// goroutine that accepted a stream passes the accepting on (to an idle
// goroutine of sc, else a new one, in wg) and serves its stream itself: a
// request is served by the goroutine that received it, without a hand-off
// on its path, streams are served concurrently, and a goroutine that has
// served one (its stack grown to what serving takes) serves the next rather
// than a fresh one. It returns when the connection ends.
func (srv *server) acceptStreams(sc *servedConn, wg *sync.WaitGroup) {
	ctx := sc.conn.Context()
	for {
		str, err := sc.conn.AcceptStream(ctx)
		if err != nil {
			return
		}
		select {
		case sc.turn <- struct{}{}:
		default:
			wg.Go(func() { srv.acceptStreams(sc, wg) })
		}
		srv.serveStream(sc, str)
		if sc.idle.Add(1) > idleServers {
			sc.idle.Add(-1)
			return
		}
		select {
		case <-sc.turn:
			sc.idle.Add(-1)
		case <-ctx.Done():
			sc.idle.Add(-1)
			return
		}
	}
}

// reply writes one PeerResponse and closes the send side.
func reply(str *quic.Stream, resp *v1.PeerResponse) {
	if err := wire.WriteMsg(str, resp, 0); err != nil {
		str.CancelWrite(quic.StreamErrorCode(v1.Code_CODE_INTERNAL))
		return
	}
	_ = str.Close()
}

// waitHandshake blocks non-idempotent requests until the handshake is
// complete, so 0-RTT data replayed by an attacker never reaches them.
func waitHandshake(sc *servedConn) error {
	select {
	case <-sc.conn.HandshakeComplete():
		return nil
	case <-sc.conn.Context().Done():
		return context.Cause(sc.conn.Context())
	}
}

func (srv *server) serveStream(sc *servedConn, str *quic.Stream) {
	ctx := sc.conn.Context()
	r := getReader(str)
	defer putReader(r)
	var req v1.PeerRequest
	if err := r.ReadMsg(&req); err != nil {
		str.CancelRead(quic.StreamErrorCode(v1.Code_CODE_INVALID_ARGUMENT))
		str.CancelWrite(quic.StreamErrorCode(v1.Code_CODE_INVALID_ARGUMENT))
		return
	}
	if req.GetWireVersion() != v1.WireVersion_WIRE_VERSION_1 {
		err := errorf(v1.Code_CODE_INCOMPATIBLE_MODEL, "wire version %v, this agent speaks %v", req.GetWireVersion(), v1.WireVersion_WIRE_VERSION_1)
		srv.m.failures.WithLabelValues(codes.Of(err).String()).Inc()
		str.CancelRead(quic.StreamErrorCode(codes.Of(err)))
		reply(str, errorResponse(&req, err))
		return
	}
	switch body := req.GetBody().(type) {
	case *v1.PeerRequest_Handshake:
		var resp *v1.HandshakeResponse
		if srv.cfg.OnHandshake != nil {
			resp = srv.cfg.OnHandshake(ctx, body.Handshake)
		} else {
			resp = &v1.HandshakeResponse{Error: codes.ToProto(errorf(v1.Code_CODE_UNAVAILABLE, "this agent serves no handshake"))}
		}
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Handshake{Handshake: resp}})
	case *v1.PeerRequest_Heartbeat:
		// Extending leases is not safe to replay: never served in 0-RTT.
		if waitHandshake(sc) != nil {
			return
		}
		var resp *v1.HeartbeatAck
		if srv.cfg.OnHeartbeat != nil {
			resp = srv.cfg.OnHeartbeat(ctx, sc.peer, body.Heartbeat)
		} else {
			resp = &v1.HeartbeatAck{LeaseExpiresUnixMs: make([]int64, len(body.Heartbeat.GetRequestIds()))}
		}
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Heartbeat{Heartbeat: resp}})
	case *v1.PeerRequest_Prep:
		// Prepared lists are state a replayed 0-RTT request could pile up.
		if waitHandshake(sc) != nil {
			return
		}
		err := srv.prepare(sc, body.Prep)
		if err != nil {
			srv.logRefusal(sc.peer, "transfer: refused a descriptor list", err, "dlist", body.Prep.GetDlistId())
		}
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Prep{Prep: codes.ToProto(err)}})
	case *v1.PeerRequest_Unprep:
		if waitHandshake(sc) != nil {
			return
		}
		err := srv.unprepare(sc, body.Unprep)
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Unprep{Unprep: codes.ToProto(err)}})
	case *v1.PeerRequest_Notification:
		if waitHandshake(sc) != nil {
			return
		}
		err := srv.notify(ctx, sc, body.Notification)
		srv.m.notifs.WithLabelValues(codes.Of(err).String()).Inc()
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Notification{Notification: &v1.NotificationAck{Error: codes.ToProto(err)}}})
	case *v1.PeerRequest_Xfer:
		// A READ is served in 0-RTT: its bytes go only to the holder of
		// the session's keys, and Access.Early keeps it from changing
		// lasting state. A WRITE changes memory: never from 0-RTT.
		if Op(body.Xfer.GetOp()) != OpRead && waitHandshake(sc) != nil {
			return
		}
		srv.serveXfer(ctx, sc, str, r, body.Xfer)
	default:
		err := errorf(v1.Code_CODE_INVALID_ARGUMENT, "request carries no known body")
		str.CancelRead(quic.StreamErrorCode(codes.Of(err)))
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Prep{Prep: codes.ToProto(err)}})
	}
}

func errorResponse(req *v1.PeerRequest, err error) *v1.PeerResponse {
	pe := codes.ToProto(err)
	switch req.GetBody().(type) {
	case *v1.PeerRequest_Handshake:
		return &v1.PeerResponse{Body: &v1.PeerResponse_Handshake{Handshake: &v1.HandshakeResponse{Error: pe}}}
	case *v1.PeerRequest_Heartbeat:
		return &v1.PeerResponse{Body: &v1.PeerResponse_Heartbeat{Heartbeat: &v1.HeartbeatAck{Error: pe}}}
	case *v1.PeerRequest_Notification:
		return &v1.PeerResponse{Body: &v1.PeerResponse_Notification{Notification: &v1.NotificationAck{Error: pe}}}
	case *v1.PeerRequest_Xfer:
		return &v1.PeerResponse{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{Error: pe}}}
	case *v1.PeerRequest_Unprep:
		return &v1.PeerResponse{Body: &v1.PeerResponse_Unprep{Unprep: pe}}
	}
	return &v1.PeerResponse{Body: &v1.PeerResponse_Prep{Prep: pe}}
}

func (srv *server) notify(ctx context.Context, sc *servedConn, n *v1.Notification) error {
	sc.notifMu.Lock()
	defer sc.notifMu.Unlock()
	if n.GetRequestId() == "" {
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "notification has an empty request id")
	}
	if srv.cfg.OnNotification == nil {
		return errorf(v1.Code_CODE_NOT_FOUND, "request %q is unknown to this agent", n.GetRequestId())
	}
	return srv.cfg.OnNotification(ctx, sc.peer, n)
}

// prepare validates and stores a descriptor list for this connection.
func (srv *server) prepare(sc *servedConn, p *v1.PrepDescList) error {
	descs := p.GetDescs().GetDescs()
	if len(descs) == 0 || len(descs) > srv.cfg.MaxDescsPerTransfer {
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "descriptor list %d has %d descriptors, want 1..%d", p.GetDlistId(), len(descs), srv.cfg.MaxDescsPerTransfer)
	}
	spans, _, err := srv.regionSet().resolveAll(descsFromProto(p.GetDescs()))
	if err != nil {
		return fmt.Errorf("transfer: descriptor list %d: %w", p.GetDlistId(), err)
	}
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if _, ok := sc.dlists[p.GetDlistId()]; ok {
		return errorf(v1.Code_CODE_ALREADY_EXISTS, "descriptor list %d already prepared on this connection", p.GetDlistId())
	}
	if len(sc.dlists) >= maxListsPerConn {
		return errorf(v1.Code_CODE_BUSY, "connection already holds %d descriptor lists", maxListsPerConn)
	}
	if limit := srv.cfg.MaxPreparedDescsPerConn; len(spans) > limit-sc.prepared {
		return errorf(v1.Code_CODE_BUSY, "descriptor list %d: %d descriptors on top of the %d prepared on this connection exceed its limit of %d",
			p.GetDlistId(), len(spans), sc.prepared, limit)
	}
	sc.dlists[p.GetDlistId()] = spans
	sc.prepared += len(spans)
	return nil
}

// unprepare releases a descriptor list of this connection.
func (srv *server) unprepare(sc *servedConn, u *v1.UnprepDescList) error {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	spans, ok := sc.dlists[u.GetDlistId()]
	if !ok {
		return errorf(v1.Code_CODE_NOT_FOUND, "descriptor list %d is not prepared on this connection", u.GetDlistId())
	}
	delete(sc.dlists, u.GetDlistId())
	sc.prepared -= len(spans)
	return nil
}

// servedSpans checks an XferRequest's descriptors: explicit ones against the
// registered regions, indexed ones against a prepared list, block ones
// against the regions the request's region i names (regionMap[i], or
// region i when regionMap is nil).
func (srv *server) servedSpans(sc *servedConn, x *v1.XferRequest, regionMap []int) ([]span, uint64, error) {
	switch d := x.GetDescs().(type) {
	case *v1.XferRequest_List:
		n := len(d.List.GetDescs())
		if n == 0 || n > srv.cfg.MaxDescsPerTransfer {
			return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "transfer names %d descriptors, want 1..%d", n, srv.cfg.MaxDescsPerTransfer)
		}
		spans, total, err := srv.regionSet().resolveAll(descsFromProto(d.List))
		if err == nil && !x.GetChecksum() {
			spans = mergeSpans(spans) // checksums pair with the descriptors as named
		}
		return spans, total, err
	case *v1.XferRequest_Indexed:
		idx := d.Indexed.GetIndices()
		if len(idx) == 0 || len(idx) > srv.cfg.MaxDescsPerTransfer {
			return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "transfer names %d indices, want 1..%d", len(idx), srv.cfg.MaxDescsPerTransfer)
		}
		sc.mu.Lock()
		list, ok := sc.dlists[d.Indexed.GetDlistId()]
		sc.mu.Unlock()
		if !ok {
			return nil, 0, errorf(v1.Code_CODE_NOT_FOUND, "descriptor list %d is not prepared on this connection", d.Indexed.GetDlistId())
		}
		out := make([]span, len(idx))
		var total uint64
		for i, k := range idx {
			if int(k) >= len(list) {
				return nil, 0, errorf(v1.Code_CODE_OUT_OF_RANGE, "index %d (position %d) is beyond descriptor list %d of %d entries", k, i, d.Indexed.GetDlistId(), len(list))
			}
			out[i] = list[k]
			total += list[k].n
		}
		return out, total, nil
	case *v1.XferRequest_Blocks:
		if Op(x.GetOp()) != OpRead {
			return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "block descriptors name memory to READ; a %v names addresses", Op(x.GetOp()))
		}
		return srv.regionSet().resolveBlocks(d.Blocks, regionMap, srv.cfg.MaxDescsPerTransfer, !x.GetChecksum())
	}
	return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "transfer names no descriptors")
}

func (srv *server) authorize(ctx context.Context, acc *Access) error {
	switch {
	case srv.cfg.Authorize != nil:
		return srv.cfg.Authorize(ctx, acc)
	case srv.cfg.CapabilityKey != nil:
		return srv.cfg.CapabilityKey.Verify(acc.Capability, acc.RequestID, acc.BlockIDs)
	}
	return errorf(v1.Code_CODE_CAPABILITY_DENIED, "this agent authorizes no transfers (no Authorize or CapabilityKey)")
}

// admission is a READ or WRITE the server admitted: every descriptor
// checked, the access authorized (Config.Authorize or the capability key)
// and its bytes counted against the connection's budget. The caller moves
// the bytes, sets acc.Err to the outcome and calls end once.
type admission struct {
	op    Op
	spans []span
	total uint64
	acc   *Access
	end   func()
}

// admit runs every check of a served READ or WRITE before memory is
// touched, whichever way its bytes then travel (a QUIC stream, or the
// same-host path): the op, the expectations (Config.CheckExpect), the
// descriptors (resolve, given the region map the expectations named),
// total_len, the block ids, the authorization, then the budget b. early
// reports whether the request came before its connection's handshake
// completed (asked again before Config.Release); abort resets what serves
// the transfer with the code (Access.Abort). On error nothing is held:
// Release ran if Authorize had allowed the access.
func (srv *server) admit(ctx context.Context, peer string, x *v1.XferRequest, resolve func(regionMap []int) ([]span, uint64, error),
	b *budget, early func() bool, abort func(v1.Code)) (*admission, error) {
	op := Op(x.GetOp())
	if op != OpRead && op != OpWrite {
		return nil, errorf(v1.Code_CODE_INVALID_ARGUMENT, "transfer op %v is neither READ nor WRITE", x.GetOp())
	}
	var regionMap []int
	if e := x.GetExpect(); e != nil {
		err := errorf(v1.Code_CODE_UNAVAILABLE, "this agent has no metadata to check the request's expectations against")
		if srv.cfg.CheckExpect != nil {
			regionMap, err = srv.cfg.CheckExpect(ctx, e)
		}
		if err != nil {
			return nil, err
		}
	}
	spans, total, err := resolve(regionMap)
	if err != nil {
		return nil, err
	}
	if total != x.GetTotalLen() {
		return nil, errorf(v1.Code_CODE_INVALID_ARGUMENT, "total_len %d differs from the descriptors' %d bytes", x.GetTotalLen(), total)
	}
	ids, err := blockIDs(spans)
	if err != nil {
		return nil, err
	}
	acc := &Access{Peer: peer, Op: op, RequestID: x.GetRequestId(), ExportID: x.GetExportId(), Capability: x.GetCapability(),
		ConsumerEngineID: x.GetConsumerEngineId(), ConsumerTPRank: x.GetConsumerTpRank(),
		BlockIDs: ids, Abort: func(err error) { abort(codes.Of(err)) }, Early: early()}
	acc.Descs = make([]Desc, len(spans))
	for i, s := range spans {
		acc.Descs[i] = Desc{Addr: s.reg.Base + s.off, Len: s.n, DevID: s.reg.DevID}
	}
	if err := srv.authorize(ctx, acc); err != nil {
		return nil, err
	}
	release := func() {
		if srv.cfg.Release != nil {
			acc.Early = acc.Early && early()
			srv.cfg.Release(acc)
		}
	}
	if err := b.acquire(ctx.Done(), func() error { return context.Cause(ctx) }, total); err != nil {
		acc.Err = fmt.Errorf("%w: transfer: %w", ErrUnavailable, err)
		release()
		return nil, acc.Err
	}
	srv.m.inflight.Add(float64(total))
	return &admission{op: op, spans: spans, total: total, acc: acc, end: func() {
		b.release(total)
		srv.m.inflight.Sub(float64(total))
		release()
	}}, nil
}

// refused counts and logs a transfer the server refused.
func (srv *server) refused(peer string, x *v1.XferRequest, err error) {
	op := Op(x.GetOp())
	srv.m.failures.WithLabelValues(codes.Of(err).String()).Inc()
	srv.m.xferDone(op, roleServer, false)
	srv.logRefusal(peer, "transfer: refused a "+op.String(), err, "request_id", x.GetRequestId(), "xfer", x.GetXferId())
}

// served counts and logs the end of a transfer the server admitted; n is
// the bytes moved.
func (srv *server) served(peer string, x *v1.XferRequest, n uint64, err error) {
	op := Op(x.GetOp())
	if err != nil {
		srv.m.failures.WithLabelValues(codes.Of(err).String()).Inc()
		srv.log.Debug("transfer: served transfer failed", "peer", peer, "xfer", x.GetXferId(), "op", op, "bytes", n, "err", err)
	}
	srv.m.xferDone(op, roleServer, err == nil)
}

// serveXfer serves one READ or WRITE on a QUIC stream. Every descriptor is
// checked and the access authorized (admit) before any memory is touched.
func (srv *server) serveXfer(ctx context.Context, sc *servedConn, str *quic.Stream, r *wire.Reader, x *v1.XferRequest) {
	// One reset per stream, whoever asks first: the watchdog (no progress)
	// or the memory's owner through Access.Abort.
	var resetOnce sync.Once
	reset := func(code v1.Code) {
		resetOnce.Do(func() {
			str.CancelRead(quic.StreamErrorCode(code))
			str.CancelWrite(quic.StreamErrorCode(code))
		})
	}
	adm, err := srv.admit(ctx, sc.peer, x, func(m []int) ([]span, uint64, error) { return srv.servedSpans(sc, x, m) },
		sc.budget, func() bool { return !handshakeDone(sc.conn) }, reset)
	if err != nil {
		srv.refused(sc.peer, x, err)
		str.CancelRead(quic.StreamErrorCode(codes.Of(err)))
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{Error: codes.ToProto(err)}}})
		return
	}
	defer adm.end()
	wd := startWatchdog(srv.cfg.ProgressTimeout, func() { reset(v1.Code_CODE_TIMEOUT) })
	defer wd.stop()
	wd.count = srv.meter(adm.op, roleServer)
	var n uint64
	if adm.op == OpRead {
		n, err = srv.serveRead(str, adm.spans, x.GetChecksum(), wd)
	} else {
		n, err = srv.serveWrite(str, r, adm.spans, x.GetChecksum(), wd, x.GetXferId())
	}
	adm.acc.Err = err
	srv.served(sc.peer, x, n, err)
}

// serveRead streams the spans' bytes from memory, then the status. The
// status header, slices under gatherMax and the final status are gathered
// into few stream writes (a READ under gatherMax leaves in one, so its
// reader wakes once); larger slices go out straight from memory.
func (srv *server) serveRead(str *quic.Stream, spans []span, checksum bool, wd *watchdog) (uint64, error) {
	var sent uint64
	g := newGatherWriter(str, &sent, wd)
	defer g.release()
	fail := func(err error) (uint64, error) {
		var se *quic.StreamError
		if !errors.As(err, &se) {
			str.CancelWrite(quic.StreamErrorCode(codes.Of(err)))
		}
		return sent, err
	}
	if err := g.frame(&v1.PeerResponse{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{}}}); err != nil {
		return fail(err)
	}
	var sums []uint32
	if checksum {
		sums = make([]uint32, len(spans))
	}
	err := srv.eachRun(spans, false, func(i int, _ uint64, b []byte) error {
		if checksum {
			sums[i] = crc32.Update(sums[i], castagnoli, b)
		}
		return g.write(b)
	})
	if err != nil {
		return fail(err)
	}
	fin := &v1.PeerResponse{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{Bytes: spansLen(spans), Checksums: sums}}}
	if err := g.frame(fin); err != nil {
		return fail(err)
	}
	if err := g.flush(); err != nil {
		return fail(err)
	}
	return sent, str.Close()
}

// spansLen is the spans' total length in bytes.
func spansLen(spans []span) uint64 {
	var n uint64
	for _, s := range spans {
		n += s.n
	}
	return n
}

// serveWrite reads the bytes straight into memory and acks what landed.
func (srv *server) serveWrite(str *quic.Stream, r *wire.Reader, spans []span, checksum bool, wd *watchdog, xferID uint64) (uint64, error) {
	sums := make([]uint32, len(spans))
	var got uint64
	err := srv.eachRun(spans, true, func(i int, _ uint64, b []byte) error {
		if err := readFull(r, b, &got, wd); err != nil {
			return err
		}
		if checksum {
			sums[i] = crc32.Update(sums[i], castagnoli, b)
		}
		return nil
	})
	if err != nil {
		str.CancelRead(quic.StreamErrorCode(codes.Of(err)))
		str.CancelWrite(quic.StreamErrorCode(codes.Of(err)))
		return got, err
	}
	var status error
	if checksum {
		var want v1.XferStatus
		if err := r.ReadMsg(&want); err != nil {
			status = errorf(v1.Code_CODE_INVALID_ARGUMENT, "checksum frame: %v", err)
		} else {
			status = compareChecksums(want.GetChecksums(), sums)
		}
	}
	if srv.cfg.testHook != nil {
		srv.cfg.testHook("before-ack", xferID)
	}
	reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{Error: codes.ToProto(status), Bytes: got}}})
	return got, status
}

// writeChunk is the largest single stream write, so progress is reported at
// least every 1 MiB.
const writeChunk = 1 << 20

// writeChunks writes b to w in writes of at most writeChunk bytes, adding
// each write to *sent and reporting it to wd. It returns the first write
// error as is (a *quic.StreamError when the peer reset the stream).
func writeChunks(w io.Writer, b []byte, sent *uint64, wd *watchdog) error {
	for len(b) > 0 {
		k := min(len(b), writeChunk)
		if _, err := w.Write(b[:k]); err != nil {
			return err
		}
		b = b[k:]
		*sent += uint64(k)
		wd.progress(k)
	}
	return nil
}

// readFull fills b from r, adding what arrives to *got and reporting it to
// wd. A stream that ends (FIN) before b is full is ErrDataLoss on both sides,
// READ and WRITE receivers alike: the sender promised total_len bytes and
// delivered fewer, so bytes the receiver was owed are lost. Other read
// errors (a reset, a closed connection) are returned as is.
func readFull(r io.Reader, b []byte, got *uint64, wd *watchdog) error {
	for off := 0; off < len(b); {
		k, err := r.Read(b[off:])
		off += k
		*got += uint64(k)
		if k > 0 {
			wd.progress(k)
		}
		if err != nil && off < len(b) {
			if errors.Is(err, io.EOF) {
				return errorf(v1.Code_CODE_DATA_LOSS, "stream ended after %d bytes, %d bytes short", *got, len(b)-off)
			}
			return err
		}
	}
	return nil
}

func compareChecksums(want, got []uint32) error {
	if len(want) != len(got) {
		return errorf(v1.Code_CODE_DATA_LOSS, "%d checksums for %d descriptors", len(want), len(got))
	}
	for i := range want {
		if want[i] != got[i] {
			return errorf(v1.Code_CODE_DATA_LOSS, "descriptor %d: CRC-32C %08x, sender said %08x", i, got[i], want[i])
		}
	}
	return nil
}
