package transfer

import (
	"bytes"
	"context"
	"fmt"
	"hash/crc32"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/fdpass"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"google.golang.org/protobuf/proto"
)

// localServer is the serving half's same-host listener: the unix socket of
// Config.LocalSocket and the connections accepted on it. Its state is under
// its own lock; its goroutines are in the server's group.
type localServer struct {
	ln    *net.UnixListener
	token []byte

	mu     sync.Mutex
	closed bool
	conns  map[*fdpass.Conn]struct{}
}

// listenLocal starts the same-host listener at Config.LocalSocket (the
// caller checked it is set) and its accept loop, in the server's group.
func (srv *server) listenLocal(ctx context.Context, token []byte) error {
	ln, err := unixsock.Listen(ctx, srv.cfg.LocalSocket)
	if err != nil {
		return fmt.Errorf("transfer: Config.LocalSocket: %w", err)
	}
	l := &localServer{ln: ln, token: token, conns: make(map[*fdpass.Conn]struct{})}
	srv.mu.Lock()
	if srv.closed {
		srv.mu.Unlock()
		_ = ln.Close()
		return errClosed()
	}
	srv.local = l
	srv.wg.Add(1)
	srv.mu.Unlock()
	go srv.acceptLocal(l)
	return nil
}

// shut closes the same-host listener and every connection on it.
func (l *localServer) shut() {
	l.mu.Lock()
	l.closed = true
	conns := make([]*fdpass.Conn, 0, len(l.conns))
	for c := range l.conns {
		conns = append(conns, c)
	}
	l.mu.Unlock()
	_ = l.ln.Close()
	for _, c := range conns {
		_ = c.Unix().Close()
	}
}

func (srv *server) acceptLocal(l *localServer) {
	defer srv.wg.Done()
	for {
		uc, err := l.ln.AcceptUnix()
		if err != nil {
			return
		}
		c := fdpass.New(uc)
		l.mu.Lock()
		if l.closed {
			l.mu.Unlock()
			_ = c.Close()
			return
		}
		l.conns[c] = struct{}{}
		srv.wg.Add(1)
		l.mu.Unlock()
		go func() {
			defer srv.wg.Done()
			srv.serveLocalConn(l, c)
			l.mu.Lock()
			delete(l.conns, c)
			l.mu.Unlock()
			_ = c.Close()
		}()
	}
}

// serveLocalConn checks who dialed (its uid must be this process's), runs
// the hello, then serves the connection's READs one after another.
func (srv *server) serveLocalConn(l *localServer, c *fdpass.Conn) {
	r := wire.NewReader(c, 0)
	w := &localWriter{c: c}
	uid, pid, err := peerUID(c.Unix())
	peer := "unix:pid=" + strconv.Itoa(pid)
	if err == nil && uid != os.Getuid() {
		err = errorf(v1.Code_CODE_CAPABILITY_DENIED, "a process of uid %d asked for this agent's pages; only its own uid %d may map them", uid, os.Getuid())
	}
	_ = c.Unix().SetDeadline(time.Now().Add(srv.cfg.HandshakeTimeout))
	var hello v1.LocalHello
	if err == nil {
		if rerr := r.ReadMsg(&hello); rerr != nil {
			return // not a same-host dialer, or gone
		}
		switch {
		case hello.GetWireVersion() != v1.WireVersion_WIRE_VERSION_1:
			err = errorf(v1.Code_CODE_INCOMPATIBLE_MODEL, "wire version %v, this agent speaks %v", hello.GetWireVersion(), v1.WireVersion_WIRE_VERSION_1)
		case !bytes.Equal(hello.GetToken(), l.token):
			err = errorf(v1.Code_CODE_NOT_FOUND, "the dialer expects another agent's token: this socket serves another agent (a restarted sidecar?)")
		case !slices.Contains(hello.GetPageKinds(), srv.cfg.ShareKind):
			err = errorf(v1.Code_CODE_INCOMPATIBLE_MODEL, "this agent passes %v pages, the dialer maps only %v", srv.cfg.ShareKind, hello.GetPageKinds())
		}
	}
	resp := &v1.LocalHello{WireVersion: v1.WireVersion_WIRE_VERSION_1, Token: l.token,
		PageKinds: []v1.PageKind{srv.cfg.ShareKind}, Error: codes.ToProto(err)}
	if werr := w.write(resp, nil); werr != nil || err != nil {
		if err != nil {
			srv.logRefusal(peer, "transfer: refused a same-host connection", err, "socket", srv.cfg.LocalSocket)
		}
		return
	}
	_ = c.Unix().SetDeadline(time.Time{})
	budget := newBudget(srv.cfg.MaxInflightPerPeer)
	for {
		var req v1.PeerRequest
		if err := r.ReadMsg(&req); err != nil {
			return
		}
		if !srv.serveLocalRead(peer, c, r, w, &req, budget) {
			return
		}
	}
}

// localWriter writes frames to a same-host connection from the goroutine
// serving a READ and from an abort, one at a time.
type localWriter struct {
	mu sync.Mutex
	c  *fdpass.Conn
}

func (w *localWriter) write(m proto.Message, files []*os.File) error {
	b, err := wire.AppendFrame(nil, m, 0)
	if err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.c.WriteWithFiles(b, files)
}

// serveLocalRead serves one READ of a same-host connection: the checks of
// any READ (admit), then the pages instead of the bytes, then the
// reader's progress until it says every byte landed. It returns whether
// the connection can serve the next READ.
func (srv *server) serveLocalRead(peer string, c *fdpass.Conn, r *wire.Reader, w *localWriter, req *v1.PeerRequest, b *budget) bool {
	x := req.GetXfer()
	refuse := func(err error) bool {
		if x != nil {
			srv.refused(peer, x, err)
		}
		return w.write(&v1.PeerResponse{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{Error: codes.ToProto(err)}}}, nil) == nil
	}
	switch {
	case req.GetWireVersion() != v1.WireVersion_WIRE_VERSION_1:
		return refuse(errorf(v1.Code_CODE_INCOMPATIBLE_MODEL, "wire version %v, this agent speaks %v", req.GetWireVersion(), v1.WireVersion_WIRE_VERSION_1))
	case x == nil:
		return refuse(errorf(v1.Code_CODE_INVALID_ARGUMENT, "a same-host connection carries READs only, not %T", req.GetBody()))
	case Op(x.GetOp()) != OpRead:
		return refuse(errorf(v1.Code_CODE_INVALID_ARGUMENT, "a same-host connection carries READs only, not a %v", Op(x.GetOp())))
	case x.GetIndexed() != nil:
		return refuse(errorf(v1.Code_CODE_INVALID_ARGUMENT, "a prepared descriptor list lives on the QUIC connection it was prepared on; a same-host READ names descriptors or blocks"))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// An abort (the memory's owner through Access.Abort, or the progress
	// deadline) answers the final status at once, or instead of the pages
	// when they were not sent yet, and stops reading the reader's
	// progress; the reader fails the READ on it, whatever it copied.
	var (
		abortMu  sync.Mutex
		aborted  error
		sent     bool // the pages went out: an abort answers now
		answered bool // the final status went out: an abort does nothing
	)
	abort := func(code v1.Code) {
		abortMu.Lock()
		defer abortMu.Unlock()
		if aborted != nil || answered {
			return
		}
		aborted = errorf(code, "the serving agent stopped the same-host READ")
		if sent {
			_ = w.write(&v1.PeerResponse{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{Error: codes.ToProto(aborted)}}}, nil)
			_ = c.Unix().SetReadDeadline(time.Now())
		}
	}
	adm, err := srv.admit(ctx, peer, x, func(m []int) ([]span, uint64, error) { return srv.localSpans(x, m) }, b,
		func() bool { return false }, abort)
	if err != nil {
		return refuse(err)
	}
	defer adm.end()
	sh, err := srv.share(adm.spans)
	if err != nil {
		adm.acc.Err = err
		srv.served(peer, x, 0, err)
		return refuse(err)
	}
	wd := startWatchdog(srv.cfg.ProgressTimeout, func() { abort(v1.Code_CODE_TIMEOUT) })
	defer wd.stop()
	wd.count = srv.meter(OpRead, roleServer)
	abortMu.Lock()
	if aborted == nil {
		sent = true
		err = w.write(sh.frame, sh.files)
	}
	early := aborted
	answered = early != nil // the refusal below answers
	abortMu.Unlock()
	sh.close()
	if early != nil {
		adm.acc.Err = early
		srv.served(peer, x, 0, early)
		return refuse(early)
	}
	var landed uint64
	for err == nil {
		var p v1.LocalProgress
		if rerr := r.ReadMsg(&p); rerr != nil {
			err = fmt.Errorf("%w: transfer: the same-host reader went away after %d of %d bytes: %w", ErrUnavailable, landed, adm.total, rerr)
			break
		}
		if p.GetBytes() < landed || p.GetBytes() > adm.total {
			err = errorf(v1.Code_CODE_INVALID_ARGUMENT, "the reader reports %d bytes landed after %d, of %d", p.GetBytes(), landed, adm.total)
			break
		}
		wd.progress(int(p.GetBytes() - landed))
		landed = p.GetBytes()
		if perr := codes.FromProto(peer, p.GetError()); perr != nil {
			err = perr
			break
		}
		if p.GetDone() {
			if landed != adm.total {
				err = errorf(v1.Code_CODE_DATA_LOSS, "the reader reports done after %d of %d bytes", landed, adm.total)
			}
			break
		}
	}
	abortMu.Lock()
	if aborted != nil {
		err = aborted
	}
	answered = true
	abortMu.Unlock()
	adm.acc.Err = err
	srv.m.sameHostBytes[roleServer].Add(float64(landed))
	srv.served(peer, x, landed, err)
	if aborted != nil {
		return false // the reader is told; what it still sends is not read
	}
	fin := &v1.XferStatus{Bytes: landed, Error: codes.ToProto(err)}
	if err == nil && x.GetChecksum() {
		fin.Checksums = srv.spanChecksums(adm.spans)
	}
	return w.write(&v1.PeerResponse{Body: &v1.PeerResponse_Xfer{Xfer: fin}}, nil) == nil && err == nil
}

// localSpans resolves a same-host READ's descriptors (explicit or by
// region and block) as a QUIC READ's are.
func (srv *server) localSpans(x *v1.XferRequest, regionMap []int) ([]span, uint64, error) {
	return srv.servedSpans(nil, x, regionMap)
}

// spanChecksums is the CRC-32C of every span, as a QUIC READ's final
// status carries them.
func (srv *server) spanChecksums(spans []span) []uint32 {
	sums := make([]uint32, len(spans))
	_ = srv.eachRun(spans, false, func(i int, _ uint64, b []byte) error {
		sums[i] = crc32.Update(sums[i], castagnoli, b)
		return nil
	})
	return sums
}

// sharedFrame is a SharedPages frame ready to send with its files.
type sharedFrame struct {
	frame *v1.PeerResponse
	files []*os.File
	close func()
}

// share asks Config.Share for the pages of spans and builds the frame the
// reader maps them from: the files reopened read-only where they are
// memfds, and the spans themselves (the READ's bytes in order), so the
// reader pairs them with its own descriptors.
func (srv *server) share(spans []span) (*sharedFrame, error) {
	ranges := make([]Desc, len(spans))
	for i, s := range spans {
		ranges[i] = Desc{Addr: s.reg.Base + s.off, Len: s.n, DevID: s.reg.DevID}
	}
	ranges = mergeDescs(ranges)
	sp, err := srv.cfg.Share(ranges)
	if err != nil {
		return nil, fmt.Errorf("%w: transfer: share the READ's pages: %w", ErrInternal, err)
	}
	files := slices.Clone(sp.Files)
	var reopened []*os.File
	closeAll := func() {
		for _, f := range reopened {
			_ = f.Close()
		}
		_ = sp.Close()
	}
	if sp.Kind != srv.cfg.ShareKind {
		closeAll()
		return nil, errorf(v1.Code_CODE_INTERNAL, "Config.Share returned %v pages, Config.ShareKind says %v", sp.Kind, srv.cfg.ShareKind)
	}
	if sp.Kind == v1.PageKind_PAGE_KIND_MEMFD {
		// A memfd goes read-only: the reader can map it PROT_READ only.
		for i, f := range files {
			ro, err := reopenReadOnly(f)
			if err != nil {
				closeAll()
				return nil, fmt.Errorf("%w: %w", ErrInternal, err)
			}
			reopened = append(reopened, ro)
			files[i] = ro
		}
	}
	pages := make([]*v1.SharedPage, len(sp.Pages))
	for i, p := range sp.Pages {
		if p.File < 0 || p.File >= len(files) {
			closeAll()
			return nil, errorf(v1.Code_CODE_INTERNAL, "Config.Share: page %d names file %d of %d", i, p.File, len(files))
		}
		pages[i] = &v1.SharedPage{Addr: p.Addr, Len: p.Len, File: uint32(p.File), FileOffset: p.FileOffset}
	}
	slices.SortFunc(pages, func(a, b *v1.SharedPage) int { return cmpUint64(a.GetAddr(), b.GetAddr()) })
	if err := checkCovered(ranges, pages); err != nil {
		closeAll()
		return nil, fmt.Errorf("%w: transfer: Config.Share: %w", ErrInternal, err)
	}
	descs := make([]*v1.Descriptor, len(spans))
	for i, s := range spans {
		descs[i] = &v1.Descriptor{Addr: s.reg.Base + s.off, Len: s.n, DevId: s.reg.DevID}
	}
	frame := &v1.PeerResponse{Body: &v1.PeerResponse_Shared{Shared: &v1.SharedPages{Kind: sp.Kind, Pages: pages,
		NumFiles: uint32(len(files)), Spans: &v1.DescriptorList{Descs: descs}}}}
	return &sharedFrame{frame: frame, files: files, close: closeAll}, nil
}

// mergeDescs merges descriptors adjacent in memory (sorted by address
// first), so Config.Share sees each run once.
func mergeDescs(ds []Desc) []Desc {
	ds = slices.Clone(ds)
	slices.SortFunc(ds, func(a, b Desc) int { return cmpUint64(a.Addr, b.Addr) })
	out := ds[:0]
	for _, d := range ds {
		if n := len(out); n > 0 && out[n-1].DevID == d.DevID && out[n-1].Addr+out[n-1].Len >= d.Addr {
			out[n-1].Len = max(out[n-1].Addr+out[n-1].Len, d.Addr+d.Len) - out[n-1].Addr
			continue
		}
		out = append(out, d)
	}
	return out
}

func cmpUint64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// checkCovered checks that pages (sorted by addr) cover every byte of
// ranges (sorted, merged).
func checkCovered(ranges []Desc, pages []*v1.SharedPage) error {
	for _, rg := range ranges {
		at := rg.Addr
		i, _ := slices.BinarySearchFunc(pages, at, func(p *v1.SharedPage, a uint64) int {
			if p.GetAddr()+p.GetLen() <= a {
				return -1
			}
			if p.GetAddr() > a {
				return 1
			}
			return 0
		})
		for at < rg.Addr+rg.Len {
			if i >= len(pages) || pages[i].GetAddr() > at || pages[i].GetAddr()+pages[i].GetLen() <= at {
				return fmt.Errorf("no page covers byte %#x of range %v", at, rg)
			}
			at = pages[i].GetAddr() + pages[i].GetLen()
			i++
		}
	}
	return nil
}
