package transfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/fdpass"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// localDialer is the dialing half's same-host state: idle connections per
// peer socket (and token), and the sockets it gave up on, with why.
type localDialer struct {
	mu     sync.Mutex
	closed bool
	idle   map[string][]*localConn
	failed map[string]error
	noted  map[string]bool // fallbacks logged (noteFallback)
}

// localConn is one same-host connection to a serving agent.
type localConn struct {
	key string
	c   *fdpass.Conn
	r   *wire.Reader
	w   localWriter
}

func localKey(p *SameHostPeer) string { return p.Socket + "\x00" + string(p.Token) }

// shutLocal closes the idle same-host connections; none is kept from now
// on.
func (d *dialer) shutLocal() {
	l := &d.local
	l.mu.Lock()
	l.closed = true
	idle := l.idle
	l.idle = nil
	l.mu.Unlock()
	for _, cs := range idle {
		for _, lc := range cs {
			_ = lc.c.Close()
		}
	}
}

// putLocal keeps lc for the next READ to its peer (or closes it, the agent
// closing).
func (d *dialer) putLocal(lc *localConn) {
	l := &d.local
	l.mu.Lock()
	if !l.closed {
		if l.idle == nil {
			l.idle = map[string][]*localConn{}
		}
		l.idle[lc.key] = append(l.idle[lc.key], lc)
		l.mu.Unlock()
		return
	}
	l.mu.Unlock()
	_ = lc.c.Close()
}

// localConnFor returns an idle connection to p's socket, or dials one and
// runs the hello. An error wraps errNotLocal (a *localFallback): the
// socket is unreachable, serves another agent or another uid, or passes
// pages this agent cannot map; it is remembered, so later READs to the
// same socket and token go over QUIC at once. pooled reports whether the
// connection was idle (it may have been closed by the peer since).
func (d *dialer) localConnFor(ctx context.Context, p *SameHostPeer, kinds []v1.PageKind) (lc *localConn, pooled bool, err error) {
	key := localKey(p)
	l := &d.local
	l.mu.Lock()
	if err := l.failed[key]; err != nil {
		l.mu.Unlock()
		return nil, false, err
	}
	if cs := l.idle[key]; len(cs) > 0 {
		lc = cs[len(cs)-1]
		l.idle[key] = cs[:len(cs)-1]
		l.mu.Unlock()
		return lc, true, nil
	}
	l.mu.Unlock()
	lc, err = d.dialLocal(ctx, p, kinds)
	if err != nil {
		if ctx.Err() != nil {
			return nil, false, context.Cause(ctx)
		}
		fb := d.noteFallback(p, err)
		l.mu.Lock()
		if l.failed == nil {
			l.failed = map[string]error{}
		}
		l.failed[key] = fb
		l.mu.Unlock()
		return nil, false, fb
	}
	return lc, false, nil
}

// noteFallback logs and counts, once per peer socket, token and reason,
// that READs to p go over QUIC because of why, and returns the error that
// says so.
func (d *dialer) noteFallback(p *SameHostPeer, why error) *localFallback {
	fb := &localFallback{socket: p.Socket, why: why}
	key := localKey(p) + "\x00" + why.Error()
	l := &d.local
	l.mu.Lock()
	if l.noted == nil {
		l.noted = map[string]bool{}
	}
	seen := l.noted[key]
	l.noted[key] = true
	l.mu.Unlock()
	if !seen {
		d.m.sameHostFallbacks.Inc()
		d.log.Info("transfer: same-host path unavailable; READs to this peer go over QUIC", "socket", p.Socket, "why", why)
	}
	return fb
}

// dialLocal connects to p's socket and runs the hello: the peer must be a
// process of this uid whose token is p's, passing pages of a kind in kinds.
func (d *dialer) dialLocal(ctx context.Context, p *SameHostPeer, kinds []v1.PageKind) (*localConn, error) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.HandshakeTimeout)
	defer cancel()
	var nd net.Dialer
	nc, err := nd.DialContext(ctx, "unix", p.Socket)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("%w: connect: %w", errPeerChanged, err)
		}
		return nil, fmt.Errorf("connect: %w", err)
	}
	uc := nc.(*net.UnixConn)
	if uid, _, err := peerUID(uc); err != nil {
		_ = uc.Close()
		return nil, err
	} else if uid != os.Getuid() {
		_ = uc.Close()
		return nil, fmt.Errorf("the socket is served by uid %d, this agent runs as uid %d", uid, os.Getuid())
	}
	lc := &localConn{key: localKey(p), c: fdpass.New(uc)}
	lc.r = wire.NewReader(lc.c, 0)
	lc.w.c = lc.c
	if dl, ok := ctx.Deadline(); ok {
		_ = uc.SetDeadline(dl)
	}
	fail := func(err error) (*localConn, error) {
		_ = lc.c.Close()
		return nil, err
	}
	if err := lc.w.write(&v1.LocalHello{WireVersion: v1.WireVersion_WIRE_VERSION_1, Token: p.Token, PageKinds: kinds}, nil); err != nil {
		return fail(fmt.Errorf("hello: %w", err))
	}
	var hello v1.LocalHello
	if err := lc.r.ReadMsg(&hello); err != nil {
		return fail(fmt.Errorf("hello: %w", err))
	}
	if !bytes.Equal(hello.GetToken(), p.Token) {
		return fail(fmt.Errorf("%w: the socket is served by another agent than the metadata named (a restarted sidecar?)", errPeerChanged))
	}
	if err := codes.FromProto(p.Socket, hello.GetError()); err != nil {
		return fail(err)
	}
	switch {
	case len(hello.GetPageKinds()) != 1 || !slices.Contains(kinds, hello.GetPageKinds()[0]):
		return fail(fmt.Errorf("the peer passes %v pages, this agent maps %v", hello.GetPageKinds(), kinds))
	}
	_ = uc.SetDeadline(time.Time{})
	return lc, nil
}

// localKinds returns the page kinds a same-host READ landing in local can
// take: memfd pages when local is host memory, device pages when it is not
// and a PeerCopier is set; with the reason when it can take none.
func (d *dialer) localKinds(local []span, checksum bool) ([]v1.PageKind, error) {
	s := local[0]
	if _, err := s.reg.Mem.HostBytes(s.off, min(s.n, 1)); err == nil {
		return []v1.PageKind{v1.PageKind_PAGE_KIND_MEMFD}, nil
	}
	switch {
	case d.cfg.PeerCopier == nil:
		return nil, errors.New("this agent's memory is not host-addressable and it has no PeerCopier for device pages")
	case checksum:
		return nil, errors.New("Xfer.Checksum needs the bytes on the host; device pages are copied device to device")
	}
	return []v1.PageKind{v1.PageKind_PAGE_KIND_CUDA_POSIX_FD}, nil
}

// transferLocal runs READ x (request req, landing in local) on the
// same-host path. An error wrapping errNotLocal means nothing was sent: the
// caller sends the READ over QUIC. Any other error is the READ's, with the
// bytes landed in xe; it returns only once no copy touches local memory,
// and every page of the peer it mapped is unmapped.
func (d *dialer) transferLocal(ctx context.Context, x *Xfer, req *v1.XferRequest, local []span, xe *XferError, start time.Time) error {
	kinds, err := d.localKinds(local, x.Checksum)
	if err != nil {
		return d.noteFallback(x.SameHost, err)
	}
	for attempt := 0; ; attempt++ {
		lc, pooled, err := d.localConnFor(ctx, x.SameHost, kinds)
		if err != nil {
			return err
		}
		err = d.readLocal(ctx, lc, x, req, local, xe, start)
		var stale *staleLocalConn
		if errors.As(err, &stale) && pooled && attempt == 0 && stale.closed {
			// The idle connection was closed by the peer (its agent
			// closed or restarted): nothing was served; dial anew.
			continue
		}
		if stale != nil {
			return stale.err
		}
		return err
	}
}

// staleLocalConn is a same-host connection that ended before the peer
// answered a READ: the READ was not served.
type staleLocalConn struct {
	err    error
	closed bool // the peer closed the connection (not a deadline or an abort)
}

func (e *staleLocalConn) Error() string { return e.err.Error() }

// readLocal sends x on lc and lands its bytes. lc goes back to the idle
// connections when the READ ended cleanly (served or refused), and is
// closed otherwise.
func (d *dialer) readLocal(ctx context.Context, lc *localConn, x *Xfer, req *v1.XferRequest, local []span, xe *XferError, start time.Time) (err error) {
	clean := false
	defer func() {
		if clean {
			d.putLocal(lc)
		} else {
			_ = lc.c.Close()
		}
	}()
	// The caller's context and the progress deadline end a blocking read
	// or write on the socket.
	var timedOut atomic.Bool
	wd := startWatchdog(d.cfg.ProgressTimeout, func() {
		timedOut.Store(true)
		_ = lc.c.Unix().SetDeadline(time.Now())
	})
	defer wd.stop()
	stopCtx := context.AfterFunc(ctx, func() { _ = lc.c.Unix().SetDeadline(time.Now()) })
	defer stopCtx()
	ioErr := func(err error) error {
		switch {
		case ctx.Err() != nil:
			return d.streamErr(ctx, x.Peer, err)
		case timedOut.Load():
			return errorf(v1.Code_CODE_TIMEOUT, "no progress from %s (same-host) for %v", x.SameHost.Socket, d.cfg.ProgressTimeout)
		}
		return fmt.Errorf("%w: transfer: same-host connection to %s: %w", ErrUnavailable, x.SameHost.Socket, err)
	}
	stale := func(err error) error {
		closed := ctx.Err() == nil && !timedOut.Load() && (errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE))
		return &staleLocalConn{err: ioErr(err), closed: closed}
	}
	if err := lc.w.write(&v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, Body: &v1.PeerRequest_Xfer{Xfer: req}}, nil); err != nil {
		return stale(err)
	}
	if x.lane == 0 {
		d.m.op(OpRead).postSecs.Observe(time.Since(start).Seconds())
	}
	var resp v1.PeerResponse
	if err := lc.r.ReadMsg(&resp); err != nil {
		return stale(err)
	}
	wd.progress(0)
	var sh *v1.SharedPages
	switch b := resp.GetBody().(type) {
	case *v1.PeerResponse_Xfer:
		if err := codes.FromProto(x.SameHost.Socket, b.Xfer.GetError()); err != nil {
			clean = true // refused: the connection serves the next READ
			return err
		}
		return errorf(v1.Code_CODE_INTERNAL, "peer %s answered a same-host READ with a status and no pages", x.SameHost.Socket)
	case *v1.PeerResponse_Shared:
		sh = b.Shared
	default:
		return errorf(v1.Code_CODE_INTERNAL, "peer %s answered a same-host READ with %T", x.SameHost.Socket, resp.GetBody())
	}
	files, err := lc.c.TakeFiles(int(sh.GetNumFiles()))
	if err != nil {
		return errorf(v1.Code_CODE_INTERNAL, "same-host READ from %s: %v", x.SameHost.Socket, err)
	}
	defer func() {
		for _, f := range files {
			_ = f.Close()
		}
	}()
	remote := descsFromProto(sh.GetSpans())
	if err := checkShared(sh, remote, local, len(files), x.Checksum); err != nil {
		return fmt.Errorf("transfer: same-host READ from %s: %w", x.SameHost.Socket, err)
	}
	// The final status, read in the background: the server sends it early
	// when it stops the READ (an abort, its progress deadline), and the
	// copy stops at it.
	final := make(chan finalStatus, 1)
	go func() {
		var fin v1.PeerResponse
		err := lc.r.ReadMsg(&fin)
		final <- finalStatus{&fin, err}
	}()
	lx := &localXfer{d: d, x: x, lc: lc, wd: wd, local: local, remote: remote, files: files, shared: sh,
		early: final, count: d.meter(OpRead, roleClient)}
	landed, sums, copyErr := lx.copy(ctx)
	xe.Bytes = landed
	d.m.sameHostBytes[roleClient].Add(float64(landed))
	d.localMoved.Add(landed)
	prog := &v1.LocalProgress{Bytes: landed, Done: copyErr == nil, Error: codes.ToProto(copyErr)}
	if copyErr != nil && codes.Of(copyErr) == v1.Code_CODE_OK {
		prog.Error = codes.ToProto(fmt.Errorf("%w: %w", ErrInternal, copyErr))
	}
	_ = lc.w.write(prog, nil)
	var fs finalStatus
	if lx.stopped != nil {
		fs = *lx.stopped
	} else {
		fs = <-final
	}
	if fs.err != nil {
		if copyErr != nil {
			return copyErr
		}
		return ioErr(fs.err)
	}
	st, ok := fs.resp.GetBody().(*v1.PeerResponse_Xfer)
	if !ok {
		return errorf(v1.Code_CODE_INTERNAL, "peer %s ended a same-host READ with %T", x.SameHost.Socket, fs.resp.GetBody())
	}
	if err := codes.FromProto(x.SameHost.Socket, st.Xfer.GetError()); err != nil {
		if copyErr != nil && lx.stopped == nil {
			return copyErr
		}
		return err
	}
	if copyErr != nil {
		return copyErr
	}
	clean = true
	if st.Xfer.GetBytes() != xe.Total {
		return errorf(v1.Code_CODE_DATA_LOSS, "peer reports %d bytes of a same-host READ, %d expected", st.Xfer.GetBytes(), xe.Total)
	}
	if x.Checksum {
		return compareChecksums(st.Xfer.GetChecksums(), sums)
	}
	return nil
}

type finalStatus struct {
	resp *v1.PeerResponse
	err  error
}

// checkShared checks a SharedPages answer against the READ: the spans
// total the READ's bytes (one per local descriptor with checksums), every
// page names a file that came with the frame.
func checkShared(sh *v1.SharedPages, remote []Desc, local []span, nfiles int, checksum bool) error {
	var rt, lt uint64
	for _, r := range remote {
		rt += r.Len
	}
	for _, s := range local {
		lt += s.n
	}
	switch {
	case rt != lt:
		return errorf(v1.Code_CODE_INTERNAL, "the peer's spans total %d bytes, the READ lands %d", rt, lt)
	case checksum && len(remote) != len(local):
		return errorf(v1.Code_CODE_INTERNAL, "the peer resolved %d spans for %d local descriptors (checksums pair them)", len(remote), len(local))
	}
	for i, p := range sh.GetPages() {
		if int(p.GetFile()) >= nfiles {
			return errorf(v1.Code_CODE_INTERNAL, "page %d names file %d of %d passed", i, p.GetFile(), nfiles)
		}
		if i > 0 && p.GetAddr() < sh.GetPages()[i-1].GetAddr()+sh.GetPages()[i-1].GetLen() {
			return errorf(v1.Code_CODE_INTERNAL, "pages %d and %d overlap or are out of order", i-1, i)
		}
	}
	return nil
}

// localXfer is one same-host READ being copied.
type localXfer struct {
	d      *dialer
	x      *Xfer
	lc     *localConn
	wd     *watchdog
	local  []span
	remote []Desc
	files  []*os.File
	shared *v1.SharedPages
	early  chan finalStatus
	count  func(int)

	landed     atomic.Uint64
	reported   atomic.Uint64 // bytes last sent in a progress frame
	progressMu sync.Mutex    // orders the progress frames

	layoutOnce sync.Once
	offsets    []uint64 // pageAt
	window     uint64   // windowLen
	first      sync.Once
	stopMu     sync.Mutex
	stopped    *finalStatus // the server's status that stopped the copy
}

// pageAt returns where each shared page lies in a share's window
// (computed once per READ).
func (lx *localXfer) pageAt() []uint64 {
	lx.layoutOnce.Do(func() {
		pages := lx.shared.GetPages()
		lx.offsets = make([]uint64, len(pages))
		var at uint64
		for i, p := range pages {
			lx.offsets[i] = at
			at += p.GetLen()
		}
		lx.window = at
	})
	return lx.offsets
}

// windowLen is the address space a share's window spans: every page's.
func (lx *localXfer) windowLen() uint64 {
	lx.pageAt()
	return lx.window
}

// stop reports whether the server ended the READ (its status arrived).
func (lx *localXfer) stop() error {
	lx.stopMu.Lock()
	defer lx.stopMu.Unlock()
	if lx.stopped != nil {
		return errStopped
	}
	select {
	case fs := <-lx.early:
		lx.stopped = &fs
		return errStopped
	default:
		return nil
	}
}

var errStopped = errors.New("transfer: the serving agent ended the same-host READ")

// landedBytes counts n bytes landed: progress for the watchdog and the
// meter, a progress frame every localProgressBytes, OnFirstByte once.
func (lx *localXfer) landedBytes(n int) {
	if n == 0 {
		return
	}
	lx.wd.progress(n)
	lx.count(n)
	if f := lx.x.OnFirstByte; f != nil {
		lx.first.Do(f)
	}
	if now := lx.landed.Add(uint64(n)); now-lx.reported.Load() >= localProgressBytes {
		// The count is read again under the lock: copiers on other lanes
		// report too, and the frames must never go backwards.
		lx.progressMu.Lock()
		if now := lx.landed.Load(); now-lx.reported.Load() >= localProgressBytes {
			lx.reported.Store(now)
			_ = lx.lc.w.write(&v1.LocalProgress{Bytes: now}, nil)
		}
		lx.progressMu.Unlock()
	}
}

// copy lands every byte: device pages through the PeerCopier, memfd pages
// with memcpy, striped over the READ lanes for a large READ. It returns
// the bytes landed and, with Xfer.Checksum, the CRC-32C of each local
// descriptor.
func (lx *localXfer) copy(ctx context.Context) (uint64, []uint32, error) {
	var err error
	var sums []uint32
	if lx.shared.GetKind() == v1.PageKind_PAGE_KIND_CUDA_POSIX_FD {
		err = lx.copyDevice()
	} else {
		sums, err = lx.copyHost(ctx)
	}
	if errors.Is(err, errStopped) {
		err = nil // the server's status says why
	}
	if err == nil && ctx.Err() != nil {
		err = lx.d.streamErr(ctx, lx.x.Peer, ctx.Err())
	}
	return lx.landed.Load(), sums, err
}

// piece is a run of bytes that lies in one local span and one remote page.
type piece struct {
	local int    // index into local
	off   uint64 // offset inside local[local]
	src   uint64 // address in the peer's memory
	page  int    // index into the shared pages
	n     uint64
}

// pieces walks the READ's bytes [from, to), in order, as runs inside one
// local span and one remote page, calling fn for each; fn's error stops
// the walk.
func (lx *localXfer) pieces(from, to uint64, fn func(piece) error) error {
	pages := lx.shared.GetPages()
	// Find the local span holding from.
	li, lat := 0, uint64(0)
	for li < len(lx.local) && lat+lx.local[li].n <= from {
		lat += lx.local[li].n
		li++
	}
	loff := from - lat
	pi := -1      // the page of the previous piece: the next one mostly lies in it too
	var at uint64 // stream offset of remote[ri]
	for ri := 0; ri < len(lx.remote) && at < to; ri++ {
		r := lx.remote[ri]
		if at+r.Len <= from {
			at += r.Len
			continue
		}
		roff := uint64(0)
		if from > at {
			roff = from - at
		}
		for roff < r.Len && at+roff < to {
			addr := r.Addr + roff
			if pi < 0 || addr < pages[pi].GetAddr() || addr >= pages[pi].GetAddr()+pages[pi].GetLen() {
				var ok bool
				pi, ok = slices.BinarySearchFunc(pages, addr, func(p *v1.SharedPage, a uint64) int {
					switch {
					case p.GetAddr()+p.GetLen() <= a:
						return -1
					case p.GetAddr() > a:
						return 1
					}
					return 0
				})
				if !ok {
					return errorf(v1.Code_CODE_INTERNAL, "no shared page holds byte %#x of the peer's memory", addr)
				}
			}
			p := pages[pi]
			n := min(r.Len-roff, p.GetAddr()+p.GetLen()-addr, to-(at+roff), lx.local[li].n-loff)
			if err := fn(piece{local: li, off: loff, src: addr, page: pi, n: n}); err != nil {
				return err
			}
			roff += n
			loff += n
			if loff == lx.local[li].n {
				li, loff = li+1, 0
			}
		}
		at += r.Len
	}
	return nil
}

// copyHost copies memfd pages into host memory. A READ of at least
// Config.ReadLaneMinBytes is cut into as many shares as the agent has READ
// lanes, each copied by its own goroutine, which maps the pages it reads
// (read-only) and unmaps them when it is done: by region and block, each
// share a chunk of the blocks in every region (so a block's bytes land in
// region order on one goroutine, as Xfer.OnLanded promises), otherwise
// contiguous byte ranges.
func (lx *localXfer) copyHost(ctx context.Context) ([]uint32, error) {
	var total uint64
	for _, s := range lx.local {
		total += s.n
	}
	k := 1
	if total >= lx.d.cfg.ReadLaneMinBytes {
		k = lx.d.cfg.ReadLanes
	}
	var sums []uint32
	if lx.x.Checksum {
		sums = make([]uint32, len(lx.local))
		k = 1 // one CRC per descriptor, in order
	}
	shares := lx.shares(total, k)
	errs := make([]error, len(shares))
	var wg sync.WaitGroup
	for j, sh := range shares {
		wg.Go(func() { errs[j] = lx.copyHostShare(ctx, sh, sums) })
	}
	wg.Wait()
	return sums, errors.Join(errs...)
}

// streamRange is bytes [from, to) of a READ's local byte stream.
type streamRange struct{ from, to uint64 }

// shares cuts a READ of total bytes into at most k non-empty shares.
func (lx *localXfer) shares(total uint64, k int) [][]streamRange {
	var out [][]streamRange
	if b := lx.x.RemoteBlocks; b != nil && k > 1 {
		nb := uint64(len(b.BlockIDs))
		for j := range uint64(k) {
			from, to := nb*j/uint64(k), nb*(j+1)/uint64(k)
			if from == to {
				continue
			}
			var rs []streamRange
			for r := range uint64(b.NumRegions) {
				rs = append(rs, streamRange{(r*nb + from) * b.Len, (r*nb + to) * b.Len})
			}
			out = append(out, rs)
		}
		return out
	}
	for j := range k {
		from, to := total*uint64(j)/uint64(k)&^(laneAlign-1), total*uint64(j+1)/uint64(k)&^(laneAlign-1)
		if j == k-1 {
			to = total
		}
		if from < to {
			out = append(out, []streamRange{{from, to}})
		}
	}
	return out
}

// mapAhead is how many pages a share's mapper may map before its copier
// copies from them: the mapper runs ahead while the copier copies.
const mapAhead = 8

// copyHostShare copies the byte ranges of one share. A mapper goroutine
// maps the pages the share reads, in the order it reads them (read-only,
// into one window, page i at lx.pageAt()[i]), up to mapAhead pages ahead of
// the copier, so mapping a page (its page tables: about as long as copying
// it) overlaps copying the one before; the window is unmapped once both
// are done. The copier reports the bytes landed, and looks for the
// caller's abort and the server's early status, every landChunk, not per
// piece: a READ of small block slices has hundreds of thousands of pieces.
func (lx *localXfer) copyHostShare(ctx context.Context, ranges []streamRange, sums []uint32) error {
	pages := lx.shared.GetPages()
	landed := lx.x.OnLanded
	// The pages in the order the share first reads them.
	var order []int
	seen := map[int]bool{}
	for _, r := range ranges {
		_ = lx.pieces(r.from, r.to, func(pc piece) error {
			if !seen[pc.page] {
				seen[pc.page] = true
				order = append(order, pc.page)
			}
			return nil
		})
	}
	if len(order) == 0 {
		return nil
	}
	window, err := reserveWindow(lx.windowLen())
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInternal, err)
	}
	maps := make([][]byte, len(pages)) // by page; written by the mapper before it closes ready[page]
	ready := make(map[int]chan struct{}, len(order))
	for _, pg := range order {
		ready[pg] = make(chan struct{})
	}
	var mapErr error                      // set by the mapper before it closes the ready of the page it failed on
	room := make(chan struct{}, mapAhead) // a token per page mapped and not yet reached by the copier
	reached := make(map[int]bool, len(order))
	quit := make(chan struct{})
	var mapper sync.WaitGroup
	mapper.Go(func() {
		for _, pg := range order {
			select {
			case room <- struct{}{}:
			case <-quit:
				return
			}
			p := pages[pg]
			m, err := mapInto(window, lx.pageAt()[pg], lx.files[p.GetFile()], p.GetFileOffset(), p.GetLen())
			if err != nil {
				mapErr = fmt.Errorf("%w: %w", ErrInternal, err)
				close(ready[pg])
				return
			}
			maps[pg] = m
			close(ready[pg])
		}
	})
	defer func() {
		close(quit)
		mapper.Wait()
		_ = unmap(window) // every page of the share at once
	}()
	var dst []byte
	dstIdx, cur := -1, -1 // the local span dst is; the page the copier is in
	var src []byte
	pending := 0 // bytes landed and not yet reported
	flush := func() error {
		lx.landedBytes(pending)
		pending = 0
		if err := ctx.Err(); err != nil {
			return err
		}
		return lx.stop()
	}
	copyPiece := func(pc piece) error {
		if pc.page != cur {
			select {
			case <-ready[pc.page]:
			case <-ctx.Done():
				return ctx.Err()
			}
			m := maps[pc.page]
			if m == nil {
				return mapErr
			}
			// The first reach of a page after the first frees a token: the
			// mapper may map one more. Pieces may go back to a page they
			// left (block ids in any order); only new pages count, or the
			// copier would take more tokens than the mapper gives.
			if cur >= 0 && !reached[pc.page] {
				select {
				case <-room:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			reached[pc.page] = true
			cur, src = pc.page, m
		}
		s := lx.local[pc.local]
		if pc.local != dstIdx {
			b, err := s.reg.Mem.HostBytes(s.off, s.n)
			if err != nil {
				return fmt.Errorf("%w: transfer: same-host READ into region %#x: %w", ErrInternal, s.reg.Base, err)
			}
			dst, dstIdx = b, pc.local
		}
		from := src[pc.src-pages[pc.page].GetAddr():]
		step := pc.n // one copy: large ones take memmove's faster path
		if sums != nil || landed != nil {
			step = landChunk // runs the CRC and OnLanded read while cached
		}
		for done := uint64(0); done < pc.n; {
			n := min(pc.n-done, step)
			out := dst[pc.off+done : pc.off+done+n]
			copy(out, from[done:done+n])
			if sums != nil {
				sums[pc.local] = crc32.Update(sums[pc.local], castagnoli, out)
			}
			if landed != nil {
				landed(s.at+pc.off+done, out)
			}
			done += n
			if pending += int(n); pending >= landChunk {
				if err := flush(); err != nil {
					return err
				}
			}
		}
		return nil
	}
	for _, r := range ranges {
		if err := lx.pieces(r.from, r.to, copyPiece); err != nil {
			return err
		}
	}
	return flush()
}

// copyDevice imports the peer's device pages and copies device to device
// through the PeerCopier, every copy in one batch.
func (lx *localXfer) copyDevice() error {
	pc := lx.d.cfg.PeerCopier
	pages := lx.shared.GetPages()
	files := make([]*os.File, len(pages))
	sizes := make([]uint64, len(pages))
	for i, p := range pages {
		if p.GetFileOffset() != 0 {
			return errorf(v1.Code_CODE_INTERNAL, "device page %d starts at offset %d of its file; a device page is a file of its own", i, p.GetFileOffset())
		}
		files[i], sizes[i] = lx.files[p.GetFile()], p.GetLen()
	}
	addrs, release, err := pc.ImportPeerPages(files, sizes)
	if err != nil {
		return fmt.Errorf("%w: transfer: map the peer's device pages: %w", ErrInternal, err)
	}
	var dst, src, n []uint64
	var total uint64
	err = lx.pieces(0, ^uint64(0), func(p piece) error {
		s := lx.local[p.local]
		dst = append(dst, s.reg.Base+s.off+p.off)
		src = append(src, addrs[p.page]+p.src-pages[p.page].GetAddr())
		n = append(n, p.n)
		total += p.n
		return nil
	})
	if err == nil {
		if err = pc.CopyDeviceToDevice(dst, src, n); err != nil {
			err = fmt.Errorf("%w: transfer: device copies from the peer's pages: %w", ErrInternal, err)
		}
	}
	if rerr := release(); rerr != nil && err == nil {
		err = fmt.Errorf("%w: transfer: release the peer's device pages: %w", ErrInternal, rerr)
	}
	if err == nil {
		lx.landedBytes(int(total))
	}
	return err
}
