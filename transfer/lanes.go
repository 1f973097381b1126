package transfer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/quic-go/quic-go"
	"google.golang.org/protobuf/proto"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// READ lanes: a READ of at least Config.ReadLaneMinBytes is striped over
// Config.ReadLanes QUIC connections to the peer, lane 0 being the cached
// connection (peer.conn) and lanes 1..K-1 extra connections, each dialed
// from its own UDP socket (its own quic.Transport), so that quic-go's
// per-connection packet path runs on K cores on each side. The extra lanes
// carry READ bytes only; everything else stays on lane 0.

const (
	// MaxReadLanes bounds Config.ReadLanes.
	MaxReadLanes = 16
	// DefaultReadLaneMinBytes is the default Config.ReadLaneMinBytes: a
	// READ under 1 MiB stays on lane 0, where it costs one stream and
	// nothing more.
	DefaultReadLaneMinBytes = 1 << 20
	// laneAlign aligns the byte offsets at which a READ is cut into lane
	// shares, so each lane reads whole pages in large sequential runs.
	laneAlign = 64 << 10
)

// DefaultReadLanes is the READ lanes (Config.ReadLanes) a host with ncpu
// CPUs is best served with, `serve --read-lanes`' default and the demo's:
// min(4, ncpu), a lane per core up to 4. A lane is a QUIC connection whose
// packet path keeps about one core busy (quic-go v0.65.0 handles one packet
// of at most 1452 bytes at a time on each connection's run loop: see
// QUICConfig), so a READ gains a lane while a core is free and no
// more. Measured with `kvsidecar bench transfer` (128 MiB READs, both
// agents on the host): on 2 cores K = 1 / 2 / 3 / 4 ran 0.48–0.52 /
// 0.59–0.62 / 0.61–0.62 / 0.52–0.60 GB/s; on one core (taskset) 0.33 /
// 0.33 / – / 0.30–0.32; on 16 cores 0.41 / 0.71 / – / 0.81, and 0.80 at
// K = 16. A lane costs no more CPU per byte (on 2 cores 0.25–0.29 GB per
// CPU-second at K = 1, 0.27–0.30 at K = 2 and 4; 0.11 at every K on 16
// cores), so where the engine and the other sidecars keep the cores busy
// it only takes cores that would idle; it does cost a connection per peer
// (a handshake and keep-alives), hence the cap at 4, where the 16-core
// host stopped gaining. The former rule, a quarter of the CPUs, gave 1
// lane on 2 cores. On the same-host path the lanes are the copiers of
// one READ, which gain a core each the same way.
func DefaultReadLanes(ncpu int) int { return min(4, max(1, ncpu)) }

// errLaneFailed is the cause with which the other lanes of a READ are
// aborted when one lane failed.
var errLaneFailed = errors.New("transfer: another READ lane failed")

// laneShare is one lane's contiguous part of a READ: local spans and the
// matching remote descriptors, in transfer order.
type laneShare struct {
	local  []span
	remote []*v1.Descriptor
	total  uint64
}

// stripeBlocks cuts a READ of b (region-major: every block of BlockIDs in
// each region, Len bytes each) landing in local into at most k shares:
// share j reads a contiguous chunk of BlockIDs, as equal in count as can
// be, in every region, and lands in the pieces of local that those bytes
// have in the whole READ. Empty shares are left out.
func stripeBlocks(local []span, b *v1.BlockDescs, k int) []blockShare {
	nb := uint64(len(b.GetBlockIds()))
	shares := make([]blockShare, 0, k)
	for j := range uint64(k) {
		from, to := nb*j/uint64(k), nb*(j+1)/uint64(k)
		if from == to {
			continue
		}
		sh := blockShare{blocks: &v1.BlockDescs{FirstRegion: b.GetFirstRegion(), NumRegions: b.GetNumRegions(),
			Offset: b.GetOffset(), Len: b.GetLen(), BlockIds: b.GetBlockIds()[from:to]}}
		for r := range uint64(b.GetNumRegions()) {
			sh.local = appendSpans(sh.local, local, (r*nb+from)*b.GetLen(), (r*nb+to)*b.GetLen())
		}
		sh.total = uint64(b.GetNumRegions()) * (to - from) * b.GetLen()
		shares = append(shares, sh)
	}
	return shares
}

// blockShare is one lane's part of a READ by region and block.
type blockShare struct {
	blocks *v1.BlockDescs
	local  []span
	total  uint64
}

// appendSpans appends to out the pieces of local that hold bytes
// [from, to) of the byte stream local describes, in order.
func appendSpans(out, local []span, from, to uint64) []span {
	var at uint64 // stream offset of local[i]
	for _, s := range local {
		lo, hi := max(from, at), min(to, at+s.n)
		if lo < hi {
			out = append(out, span{reg: s.reg, off: s.off + lo - at, n: hi - lo, at: lo})
		}
		at += s.n
		if at >= to {
			break
		}
	}
	return out
}

// stripe cuts a READ of local spans and the matching remote descriptors
// into at most k shares of contiguous bytes, as equal as laneAlign allows:
// share j holds bytes [cut j, cut j+1) of the transfer, splitting a
// descriptor where a cut falls inside it. Empty shares are left out.
func stripe(local []span, remote []*v1.Descriptor, k int) []laneShare {
	var total uint64
	for _, s := range local {
		total += s.n
	}
	per := total / uint64(k)
	shares := make([]laneShare, 0, k)
	var i int       // descriptor being cut
	var off uint64  // bytes of descriptor i already given out
	var done uint64 // bytes of the transfer already given out
	for j := range k {
		end := total
		if j < k-1 {
			end = per * uint64(j+1) &^ (laneAlign - 1)
		}
		if end <= done {
			continue
		}
		var sh laneShare
		for done < end {
			n := min(local[i].n-off, end-done)
			r := remote[i]
			sh.local = append(sh.local, span{reg: local[i].reg, off: local[i].off + off, n: n, at: local[i].at + off})
			sh.remote = append(sh.remote, &v1.Descriptor{Addr: r.GetAddr() + off, Len: n, DevId: r.GetDevId()})
			sh.total += n
			done += n
			off += n
			if off == local[i].n {
				i, off = i+1, 0
			}
		}
		shares = append(shares, sh)
	}
	return shares
}

// transferLanes runs one attempt of x: a READ of at least
// Config.ReadLaneMinBytes with explicit remote descriptors or by region and
// block is striped over p's READ lanes that are up, anything else runs on
// p's connection alone (transferOn). READs naming a prepared list stay on
// lane 0, where the list is prepared. A laned READ succeeds only when
// every lane landed its bytes; when one lane fails the others are aborted,
// and transferLanes returns that lane's error only after every lane
// stopped touching local memory. A lane whose connection died takes lane 0
// down with it, so the redial rule (withConn) sends the whole READ again
// on new connections.
func (d *dialer) transferLanes(ctx context.Context, p *peer, x *Xfer, req *v1.XferRequest, local []span, xe *XferError, start time.Time) error {
	if x.Op != OpRead || d.cfg.ReadLanes < 2 {
		return d.transferOn(ctx, p, x, req, local, xe, start)
	}
	if req.GetTotalLen() < d.cfg.ReadLaneMinBytes || (req.GetList() == nil && req.GetBlocks() == nil) {
		err := d.transferOn(ctx, p, x, req, local, xe, start)
		if err == nil {
			d.startLanes(p) // the peer serves this agent: its lanes may be dialed
		}
		return err
	}
	conns := append([]*peer{p}, p.lanes.up()...)
	type share struct {
		local []span
		req   *v1.XferRequest // the lane's request: req with the lane's descriptors
	}
	var shares []share
	laneReq := func(total uint64, set func(*v1.XferRequest)) *v1.XferRequest {
		r := proto.CloneOf(req)
		r.TotalLen = total
		set(r)
		return r
	}
	if bl := req.GetBlocks(); bl != nil {
		for _, sh := range stripeBlocks(local, bl, len(conns)) {
			shares = append(shares, share{sh.local, laneReq(sh.total, func(r *v1.XferRequest) {
				r.Descs = &v1.XferRequest_Blocks{Blocks: sh.blocks}
			})})
		}
	} else {
		for _, sh := range stripe(local, req.GetList().GetDescs(), len(conns)) {
			shares = append(shares, share{sh.local, laneReq(sh.total, func(r *v1.XferRequest) {
				r.Descs = &v1.XferRequest_List{List: &v1.DescriptorList{Descs: sh.remote}}
			})})
		}
	}
	if len(shares) < 2 {
		err := d.transferOn(ctx, p, x, req, local, xe, start)
		if err == nil {
			d.startLanes(p)
		}
		return err
	}
	lx := *x // the lanes' Xfer: OnFirstByte called once, by the first lane with a byte
	if first := x.OnFirstByte; first != nil {
		var once sync.Once
		lx.OnFirstByte = func() { once.Do(first) }
	}
	lctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		failed = -1
		errs   = make([]error, len(shares))
		subs   = make([]XferError, len(shares))
	)
	for i, sh := range shares {
		subs[i] = XferError{Op: x.Op, Peer: x.Peer, XferID: xe.XferID, Total: sh.req.GetTotalLen()}
		lx := lx
		lx.lane = i
		wg.Go(func() {
			err := d.transferOn(lctx, conns[i], &lx, sh.req, sh.local, &subs[i], start)
			if err == nil {
				return
			}
			mu.Lock()
			errs[i] = err
			if failed < 0 {
				failed = i
				cancel(errLaneFailed)
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	xe.Bytes = 0
	for i := range subs {
		xe.Bytes += subs[i].Bytes
	}
	if failed < 0 {
		d.startLanes(p) // redials a lane that died meanwhile
		return nil
	}
	err := errs[failed]
	if failed > 0 {
		d.laneFailed(p, conns[failed], err)
	}
	return err
}

// laneFailed closes a lane whose READ share failed for another reason than
// a refusal (the path stalled or its connection ended), so that the next
// READ dials it anew. When its connection died (the redial rule's
// condition), lane 0 is closed too: the peer may have restarted, and the
// redial rule sends the whole READ again on new connections.
func (d *dialer) laneFailed(p, lane *peer, err error) {
	if !errors.Is(err, ErrTimeout) && !connEnded(err) {
		return
	}
	d.log.Info("transfer: READ lane failed; closing it", "peer", p.addr, "lane", lane.lane, "err", err)
	_ = lane.conn.CloseWithError(0, "read lane failed")
	if connDied(err) {
		_ = p.conn.CloseWithError(0, fmt.Sprintf("read lane %d died", lane.lane))
	}
}

// laneGroup is the READ lanes 1..K-1 of one lane-0 connection. They live
// and die with it.
type laneGroup struct {
	mu     sync.Mutex
	lanes  []*peer // index i-1 holds lane i; nil until dialed
	closed bool    // lane 0 is gone: dial nothing more, close what finishes
}

// snapshot returns the group's lanes (nil entries: never dialed).
func (g *laneGroup) snapshot() []*peer {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]*peer(nil), g.lanes...)
}

// startLanes dials p's missing READ lanes in the background: every lane
// never dialed, or whose connection ended since. It is called after a READ
// on p succeeded, so a peer that refuses this agent, or that it never
// READs from, gets no lane. A lane whose dial failed is not dialed again
// for this lane-0 connection, so an unreachable lane costs one
// Config.HandshakeTimeout, not one per READ.
func (d *dialer) startLanes(p *peer) {
	if d.cfg.ReadLanes < 2 {
		return
	}
	g := &p.lanes
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return
	}
	if g.lanes == nil {
		g.lanes = make([]*peer, d.cfg.ReadLanes-1)
	}
	for i, l := range g.lanes {
		if l != nil {
			select {
			case <-l.ready:
				if l.err != nil || l.conn.Context().Err() == nil {
					continue // failed to dial, or up
				}
			default:
				continue // dialing
			}
		}
		tr, err := d.laneTransport(i + 1)
		if err != nil {
			l = &peer{addr: p.addr, lane: i + 1, ready: make(chan struct{}), err: err}
			close(l.ready)
			d.log.Warn("transfer: cannot open a READ lane's socket; READs use fewer lanes", "peer", p.addr, "lane", i+1, "err", err)
			g.lanes[i] = l
			continue
		}
		l = &peer{addr: p.addr, lane: i + 1, ready: make(chan struct{})}
		g.lanes[i] = l
		go func() { // d.dial calls d.wg.Done (laneTransport added it)
			d.dial(l, tr)
			if l.err != nil {
				d.log.Warn("transfer: READ lane dial failed; READs to this peer use fewer lanes until it is redialed", "peer", p.addr, "lane", l.lane, "err", l.err)
				return
			}
			g.mu.Lock()
			closed := g.closed
			g.mu.Unlock()
			if closed {
				_ = l.conn.CloseWithError(0, "lane 0 gone")
			}
		}()
	}
}

// up returns the group's READ lanes that are up. A READ never waits for a
// lane: one on a new connection (perhaps in 0-RTT) keeps its latency and
// runs on the lanes up when it starts; lanes still dialing join a later
// one.
func (g *laneGroup) up() []*peer {
	var up []*peer
	for _, l := range g.snapshot() {
		if l == nil {
			continue
		}
		select {
		case <-l.ready:
		default:
			continue
		}
		if l.err == nil && handshakeDone(l.conn) && l.conn.Context().Err() == nil {
			up = append(up, l)
		}
	}
	return up
}

// closeLanes closes p's READ lanes, now or when their dial finishes: lane 0
// is gone.
func (d *dialer) closeLanes(p *peer) {
	g := &p.lanes
	g.mu.Lock()
	g.closed = true
	lanes := g.lanes
	g.mu.Unlock()
	for _, l := range lanes {
		select {
		case <-l.ready:
			if l.conn != nil {
				_ = l.conn.CloseWithError(0, "lane 0 gone")
			}
		default: // the dialer closes it (startLanes)
		}
	}
}

// laneConns returns the connections of p's READ lanes that finished dialing.
func (p *peer) laneConns() []*quic.Conn {
	g := &p.lanes
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []*quic.Conn
	for _, l := range g.lanes {
		if l == nil {
			continue
		}
		select {
		case <-l.ready:
			if l.conn != nil {
				out = append(out, l.conn)
			}
		default:
		}
	}
	return out
}

// laneTransport returns the quic.Transport that dials READ lane i (one
// UDP socket per lane index, shared by every peer), opening it on first
// use with Config.LanePacketConn, or on the IP of the agent's own socket.
// On success it adds the dial about to start to the dialer's goroutines
// (a.dial calls a.dialer.wg.Done), so that Close waits for it.
func (d *dialer) laneTransport(i int) (*quic.Transport, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, errClosed()
	}
	if d.laneTrs == nil {
		d.laneTrs = make([]*quic.Transport, d.cfg.ReadLanes-1)
	}
	if tr := d.laneTrs[i-1]; tr != nil {
		d.wg.Add(1)
		return tr, nil
	}
	var (
		pc  net.PacketConn
		err error
	)
	if d.cfg.LanePacketConn != nil {
		pc, err = d.cfg.LanePacketConn(i)
	} else {
		host := "127.0.0.1"
		if h, _, serr := net.SplitHostPort(d.tr.Conn.LocalAddr().String()); serr == nil {
			host = h
		}
		pc, err = net.ListenPacket("udp", net.JoinHostPort(host, "0"))
	}
	if err != nil {
		return nil, fmt.Errorf("transfer: READ lane %d: open its UDP socket: %w", i, err)
	}
	tr := &quic.Transport{Conn: pc}
	d.laneTrs[i-1] = tr
	d.wg.Add(1)
	return tr, nil
}

// closeLaneTransports closes the READ lanes' transports and sockets; the
// agent is closed, so none is opened after.
func (d *dialer) closeLaneTransports() error {
	d.mu.Lock()
	trs := d.laneTrs
	d.mu.Unlock()
	var errs []error
	for _, tr := range trs {
		if tr == nil {
			continue
		}
		errs = append(errs, tr.Close())
		if err := tr.Conn.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
