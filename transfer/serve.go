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
	ln *quic.EarlyListener // set by Agent.Start under Agent.mu; nil: the agent does not serve

	mu     sync.Mutex
	closed bool // the agent is closing: no connection is added
	conns  map[*quic.Conn]struct{}

	wg sync.WaitGroup
}

// add records conn as served and adds its goroutine to wg, unless the
// server is closed.
func (s *server) add(conn *quic.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns[conn] = struct{}{}
	s.wg.Add(1)
	return true
}

func (s *server) remove(conn *quic.Conn) {
	s.mu.Lock()
	delete(s.conns, conn)
	s.mu.Unlock()
}

// shut marks the server closed, so no connection is added from now on, and
// returns the connections to close.
func (s *server) shut() []*quic.Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	conns := make([]*quic.Conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	return conns
}

func (a *Agent) acceptLoop() {
	defer a.server.wg.Done()
	for {
		conn, err := a.server.ln.Accept(a.ctx)
		if err != nil {
			return
		}
		if !a.server.add(conn) {
			_ = conn.CloseWithError(0, "agent closing")
			return
		}
		sc := &servedConn{conn: conn, peer: conn.RemoteAddr().String(),
			budget: newBudget(a.cfg.MaxInflightPerPeer), dlists: make(map[uint64][]span), turn: make(chan struct{})}
		go a.serveConn(sc)
	}
}

func (a *Agent) serveConn(sc *servedConn) {
	defer a.server.wg.Done()
	var wg sync.WaitGroup
	defer func() {
		wg.Wait()
		a.server.remove(sc.conn)
	}()
	// Datagrams carry only the dialer's keep-alive probes: discard them.
	wg.Go(func() {
		for {
			if _, err := sc.conn.ReceiveDatagram(sc.conn.Context()); err != nil {
				return
			}
		}
	})
	a.acceptStreams(sc, &wg)
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
func (a *Agent) acceptStreams(sc *servedConn, wg *sync.WaitGroup) {
	ctx := sc.conn.Context()
	for {
		str, err := sc.conn.AcceptStream(ctx)
		if err != nil {
			return
		}
		select {
		case sc.turn <- struct{}{}:
		default:
			wg.Go(func() { a.acceptStreams(sc, wg) })
		}
		a.serveStream(sc, str)
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

func (a *Agent) serveStream(sc *servedConn, str *quic.Stream) {
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
		a.m.failures.WithLabelValues(codes.Of(err).String()).Inc()
		str.CancelRead(quic.StreamErrorCode(codes.Of(err)))
		reply(str, errorResponse(&req, err))
		return
	}
	switch body := req.GetBody().(type) {
	case *v1.PeerRequest_Handshake:
		var resp *v1.HandshakeResponse
		if a.cfg.OnHandshake != nil {
			resp = a.cfg.OnHandshake(ctx, body.Handshake)
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
		if a.cfg.OnHeartbeat != nil {
			resp = a.cfg.OnHeartbeat(ctx, sc.peer, body.Heartbeat)
		} else {
			resp = &v1.HeartbeatAck{LeaseExpiresUnixMs: make([]int64, len(body.Heartbeat.GetRequestIds()))}
		}
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Heartbeat{Heartbeat: resp}})
	case *v1.PeerRequest_Prep:
		// Prepared lists are state a replayed 0-RTT request could pile up.
		if waitHandshake(sc) != nil {
			return
		}
		err := a.prepare(sc, body.Prep)
		if err != nil {
			a.logRefusal(sc.peer, "transfer: refused a descriptor list", err, "dlist", body.Prep.GetDlistId())
		}
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Prep{Prep: codes.ToProto(err)}})
	case *v1.PeerRequest_Unprep:
		if waitHandshake(sc) != nil {
			return
		}
		err := a.unprepare(sc, body.Unprep)
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Unprep{Unprep: codes.ToProto(err)}})
	case *v1.PeerRequest_Notification:
		if waitHandshake(sc) != nil {
			return
		}
		err := a.notify(ctx, sc, body.Notification)
		a.m.notifs.WithLabelValues(codes.Of(err).String()).Inc()
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Notification{Notification: &v1.NotificationAck{Error: codes.ToProto(err)}}})
	case *v1.PeerRequest_Xfer:
		// A READ is served in 0-RTT: its bytes go only to the holder of
		// the session's keys, and Access.Early keeps it from changing
		// lasting state. A WRITE changes memory: never from 0-RTT.
		if Op(body.Xfer.GetOp()) != OpRead && waitHandshake(sc) != nil {
			return
		}
		a.serveXfer(ctx, sc, str, r, body.Xfer)
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

func (a *Agent) notify(ctx context.Context, sc *servedConn, n *v1.Notification) error {
	sc.notifMu.Lock()
	defer sc.notifMu.Unlock()
	if n.GetRequestId() == "" {
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "notification has an empty request id")
	}
	if a.cfg.OnNotification == nil {
		return errorf(v1.Code_CODE_NOT_FOUND, "request %q is unknown to this agent", n.GetRequestId())
	}
	return a.cfg.OnNotification(ctx, sc.peer, n)
}

// prepare validates and stores a descriptor list for this connection.
func (a *Agent) prepare(sc *servedConn, p *v1.PrepDescList) error {
	descs := p.GetDescs().GetDescs()
	if len(descs) == 0 || len(descs) > a.cfg.MaxDescsPerTransfer {
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "descriptor list %d has %d descriptors, want 1..%d", p.GetDlistId(), len(descs), a.cfg.MaxDescsPerTransfer)
	}
	spans, _, err := a.regionSet().resolveAll(descsFromProto(p.GetDescs()))
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
	if limit := a.cfg.MaxPreparedDescsPerConn; len(spans) > limit-sc.prepared {
		return errorf(v1.Code_CODE_BUSY, "descriptor list %d: %d descriptors on top of the %d prepared on this connection exceed its limit of %d",
			p.GetDlistId(), len(spans), sc.prepared, limit)
	}
	sc.dlists[p.GetDlistId()] = spans
	sc.prepared += len(spans)
	return nil
}

// unprepare releases a descriptor list of this connection.
func (a *Agent) unprepare(sc *servedConn, u *v1.UnprepDescList) error {
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
func (a *Agent) servedSpans(sc *servedConn, x *v1.XferRequest, regionMap []int) ([]span, uint64, error) {
	switch d := x.GetDescs().(type) {
	case *v1.XferRequest_List:
		n := len(d.List.GetDescs())
		if n == 0 || n > a.cfg.MaxDescsPerTransfer {
			return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "transfer names %d descriptors, want 1..%d", n, a.cfg.MaxDescsPerTransfer)
		}
		return a.regionSet().resolveAll(descsFromProto(d.List))
	case *v1.XferRequest_Indexed:
		idx := d.Indexed.GetIndices()
		if len(idx) == 0 || len(idx) > a.cfg.MaxDescsPerTransfer {
			return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "transfer names %d indices, want 1..%d", len(idx), a.cfg.MaxDescsPerTransfer)
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
		return a.regionSet().resolveBlocks(d.Blocks, regionMap, a.cfg.MaxDescsPerTransfer, !x.GetChecksum())
	}
	return nil, 0, errorf(v1.Code_CODE_INVALID_ARGUMENT, "transfer names no descriptors")
}

func (a *Agent) authorize(ctx context.Context, acc *Access) error {
	switch {
	case a.cfg.Authorize != nil:
		return a.cfg.Authorize(ctx, acc)
	case a.cfg.CapabilityKey != nil:
		return a.cfg.CapabilityKey.Verify(acc.Capability, acc.RequestID, acc.BlockIDs)
	}
	return errorf(v1.Code_CODE_CAPABILITY_DENIED, "this agent authorizes no transfers (no Authorize or CapabilityKey)")
}

// serveXfer serves one READ or WRITE. Every descriptor is checked and the
// access authorized before any memory is touched.
func (a *Agent) serveXfer(ctx context.Context, sc *servedConn, str *quic.Stream, r *wire.Reader, x *v1.XferRequest) {
	op := Op(x.GetOp())
	refuse := func(err error) {
		a.m.failures.WithLabelValues(codes.Of(err).String()).Inc()
		a.m.xferDone(op, roleServer, false)
		a.logRefusal(sc.peer, "transfer: refused a "+op.String(), err, "request_id", x.GetRequestId(), "xfer", x.GetXferId())
		str.CancelRead(quic.StreamErrorCode(codes.Of(err)))
		reply(str, &v1.PeerResponse{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{Error: codes.ToProto(err)}}})
	}
	if op != OpRead && op != OpWrite {
		refuse(errorf(v1.Code_CODE_INVALID_ARGUMENT, "transfer op %v is neither READ nor WRITE", x.GetOp()))
		return
	}
	var regionMap []int
	if e := x.GetExpect(); e != nil {
		err := errorf(v1.Code_CODE_UNAVAILABLE, "this agent has no metadata to check the request's expectations against")
		if a.cfg.CheckExpect != nil {
			regionMap, err = a.cfg.CheckExpect(ctx, e)
		}
		if err != nil {
			refuse(err)
			return
		}
	}
	spans, total, err := a.servedSpans(sc, x, regionMap)
	if err != nil {
		refuse(err)
		return
	}
	if total != x.GetTotalLen() {
		refuse(errorf(v1.Code_CODE_INVALID_ARGUMENT, "total_len %d differs from the descriptors' %d bytes", x.GetTotalLen(), total))
		return
	}
	ids, err := blockIDs(spans)
	if err != nil {
		refuse(err)
		return
	}
	// One reset per stream, whoever asks first: the watchdog (no progress)
	// or the memory's owner through Access.Abort.
	var resetOnce sync.Once
	reset := func(code v1.Code) {
		resetOnce.Do(func() {
			str.CancelRead(quic.StreamErrorCode(code))
			str.CancelWrite(quic.StreamErrorCode(code))
		})
	}
	acc := &Access{Peer: sc.peer, Op: op, RequestID: x.GetRequestId(), ExportID: x.GetExportId(), Capability: x.GetCapability(),
		ConsumerEngineID: x.GetConsumerEngineId(), ConsumerTPRank: x.GetConsumerTpRank(),
		BlockIDs: ids, Abort: func(err error) { reset(codes.Of(err)) }, Early: !handshakeDone(sc.conn)}
	acc.Descs = make([]Desc, len(spans))
	for i, s := range spans {
		acc.Descs[i] = Desc{Addr: s.reg.Base + s.off, Len: s.n, DevID: s.reg.DevID}
	}
	if err := a.authorize(ctx, acc); err != nil {
		refuse(err)
		return
	}
	if a.cfg.Release != nil {
		defer func() {
			acc.Early = acc.Early && !handshakeDone(sc.conn)
			a.cfg.Release(acc)
		}()
	}
	if err := sc.budget.acquire(ctx.Done(), func() error { return context.Cause(ctx) }, total); err != nil {
		acc.Err = fmt.Errorf("%w: transfer: %w", ErrUnavailable, err)
		refuse(acc.Err)
		return
	}
	a.m.inflight.Add(float64(total))
	defer func() {
		sc.budget.release(total)
		a.m.inflight.Sub(float64(total))
	}()

	wd := startWatchdog(a.cfg.ProgressTimeout, func() { reset(v1.Code_CODE_TIMEOUT) })
	defer wd.stop()
	wd.count = a.meter(op, roleServer)
	var n uint64
	if op == OpRead {
		n, err = a.serveRead(str, spans, x.GetChecksum(), wd)
	} else {
		n, err = a.serveWrite(str, r, spans, x.GetChecksum(), wd, x.GetXferId())
	}
	acc.Err = err
	if err != nil {
		a.m.failures.WithLabelValues(codes.Of(err).String()).Inc()
		a.log.Debug("transfer: served transfer failed", "peer", sc.peer, "xfer", x.GetXferId(), "op", op, "bytes", n, "err", err)
	}
	a.m.xferDone(op, roleServer, err == nil)
}

// serveRead streams the spans' bytes from memory, then the status. The
// status header, slices under gatherMax and the final status are gathered
// into few stream writes (a READ under gatherMax leaves in one, so its
// reader wakes once); larger slices go out straight from memory.
func (a *Agent) serveRead(str *quic.Stream, spans []span, checksum bool, wd *watchdog) (uint64, error) {
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
	var staging []byte
	for _, s := range spans {
		var crc uint32
		err := a.eachChunk(s, &staging, false, func(b []byte) error {
			if checksum {
				crc = crc32.Update(crc, castagnoli, b)
			}
			return g.write(b)
		})
		if err != nil {
			return fail(err)
		}
		sums = append(sums, crc)
	}
	if !checksum {
		sums = nil
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
func (a *Agent) serveWrite(str *quic.Stream, r *wire.Reader, spans []span, checksum bool, wd *watchdog, xferID uint64) (uint64, error) {
	var sums []uint32
	var staging []byte
	var got uint64
	for _, s := range spans {
		var crc uint32
		err := a.eachChunk(s, &staging, true, func(b []byte) error {
			if err := readFull(r, b, &got, wd); err != nil {
				return err
			}
			if checksum {
				crc = crc32.Update(crc, castagnoli, b)
			}
			return nil
		})
		if err != nil {
			str.CancelRead(quic.StreamErrorCode(codes.Of(err)))
			str.CancelWrite(quic.StreamErrorCode(codes.Of(err)))
			return got, err
		}
		sums = append(sums, crc)
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
	if a.cfg.testHook != nil {
		a.cfg.testHook("before-ack", xferID)
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

// eachChunk hands fn the span's bytes: the mapped memory itself when the
// backend allows, else a staging buffer (filled before fn when !in, copied
// into memory after fn when in).
func (a *Agent) eachChunk(s span, staging *[]byte, in bool, fn func([]byte) error) error {
	if b, err := s.reg.Mem.HostBytes(s.off, s.n); err == nil {
		return fn(b)
	}
	if *staging == nil {
		*staging = make([]byte, a.cfg.StagingBytes)
	}
	for done := uint64(0); done < s.n; {
		b := (*staging)[:min(uint64(len(*staging)), s.n-done)]
		if !in {
			if err := s.reg.Mem.CopyOut(s.off+done, b); err != nil {
				return fmt.Errorf("%w: transfer: copy out of region %#x: %w", ErrInternal, s.reg.Base, err)
			}
		}
		if err := fn(b); err != nil {
			return err
		}
		if in {
			if err := s.reg.Mem.CopyIn(s.off+done, b); err != nil {
				return fmt.Errorf("%w: transfer: copy into region %#x: %w", ErrInternal, s.reg.Base, err)
			}
		}
		done += uint64(len(b))
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
