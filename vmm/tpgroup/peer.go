package tpgroup

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// peer is the client side of the connection to one other rank. One request
// is in flight per peer at a time: sem is a context-aware mutex over conn,
// r and synced. pending and mapped have their own mutex, mu, because an
// UNMAP that could not even take the slot must still record its pages.
type peer struct {
	rank int
	sem  chan struct{}
	conn net.Conn
	r    *wire.Reader
	// synced: the peer answered a KIND_SYNC on conn, so it holds exactly
	// mapped. Every connection rank 0 dials starts unsynced.
	synced bool

	mu sync.Mutex
	// pending holds pages whose state on the peer is unknown or wrong: a MAP
	// whose answer never came, an UNMAP that failed or was never sent. They
	// are unmapped on the peer (tolerating "not mapped") before any other
	// request is sent to it, so a later MAP of the same page can never be
	// overtaken by a stale one. Guarded by mu.
	pending map[int]struct{}
	// mapped holds the pages rank 0 has mapped on the peer: added once the
	// peer answered a MAP, removed when rank 0 asks it to unmap them
	// (rank 0 unmapped them itself already). A KIND_SYNC sends it. Guarded
	// by mu; changed only by the holder of the slot, except the removals.
	mapped map[int]struct{}
}

func newPeer(rank int) *peer {
	return &peer{rank: rank, sem: make(chan struct{}, 1), pending: map[int]struct{}{}, mapped: map[int]struct{}{}}
}

// markPending records pages as pending on p; it needs no slot.
func (p *peer) markPending(pages []int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pg := range pages {
		p.pending[pg] = struct{}{}
	}
}

// pendingPages returns p's pending pages in ascending order.
func (p *peer) pendingPages() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Sorted(maps.Keys(p.pending))
}

// clearPending forgets pages that are known to be unmapped on the peer.
func (p *peer) clearPending(pages []int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pg := range pages {
		delete(p.pending, pg)
	}
}

// remember records pages as mapped on the peer.
func (p *peer) remember(pages []int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pg := range pages {
		p.mapped[pg] = struct{}{}
	}
}

// forget records that rank 0 wants pages unmapped on the peer.
func (p *peer) forget(pages []int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pg := range pages {
		delete(p.mapped, pg)
	}
}

// mappedPages returns the pages rank 0 has mapped on p, ascending.
func (p *peer) mappedPages() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Sorted(maps.Keys(p.mapped))
}

// synchronized records that the peer holds exactly p.mapped: nothing is
// pending any more.
func (p *peer) synchronized() {
	p.mu.Lock()
	clear(p.pending)
	p.mu.Unlock()
	p.synced = true
}

// acquire takes the peer's slot or returns the ctx's cause.
func (p *peer) acquire(ctx context.Context) error {
	select {
	case p.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

func (p *peer) release() { <-p.sem }

// drop closes the connection; the next request redials (and, from rank 0,
// syncs the peer first).
func (p *peer) drop() {
	if p.conn != nil {
		p.conn.Close()
		p.conn, p.r = nil, nil
	}
	p.synced = false
}

// aLongTimeAgo is a deadline in the past: setting it unblocks pending I/O.
var aLongTimeAgo = time.Unix(1, 0)

// exchange sends req to p and reads the answer; the caller holds p's slot.
// sent reports whether the request may have reached the peer (its write
// started). When ctx ends first the connection is dropped and the ctx's
// cause returned; an I/O failure drops it too (ErrPeerUnavailable). A reply
// from another rank or with another tp_size is an error.
func (g *Group) exchange(ctx context.Context, p *peer, req *v1.GroupRequest) (resp *v1.GroupResponse, sent bool, err error) {
	if err := context.Cause(ctx); err != nil {
		return nil, false, err
	}
	if p.conn == nil {
		c, err := g.dial(ctx, p.rank)
		if err != nil {
			if cerr := context.Cause(ctx); cerr != nil {
				return nil, false, cerr
			}
			return nil, false, fmt.Errorf("%w: dial rank %d: %w", ErrPeerUnavailable, p.rank, err)
		}
		p.conn, p.r = c, wire.NewReader(c, g.cfg.MaxFrame)
	}
	if size := proto.Size(req); size > g.cfg.MaxFrame {
		return nil, false, fmt.Errorf("%w: request of %d bytes exceeds MaxFrame=%d", ErrInvalidArgument, size, g.cfg.MaxFrame)
	}
	c := p.conn
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(aLongTimeAgo) })
	g.sent[p.rank].Add(1)
	g.met.sent.WithLabelValues(rankLabel(p.rank)).Inc()
	err = wire.WriteMsg(c, req, g.cfg.MaxFrame)
	if err == nil {
		resp = new(v1.GroupResponse)
		err = p.r.ReadMsg(resp)
	}
	if !stop() {
		p.drop()
		return nil, true, context.Cause(ctx)
	}
	if err != nil {
		p.drop()
		return nil, true, fmt.Errorf("%w: %w", ErrPeerUnavailable, err)
	}
	switch {
	case int64(resp.GetTpSize()) != int64(g.m.TPSize):
		return nil, true, fmt.Errorf("%w: rank %d answered with tp_size=%d; this group was started with tp_size=%d",
			ErrTPMismatch, p.rank, resp.GetTpSize(), g.m.TPSize)
	case int64(resp.GetTpRank()) != int64(p.rank):
		p.drop()
		return nil, true, fmt.Errorf("%w: the socket of rank %d answered as rank %d", ErrPeerUnavailable, p.rank, resp.GetTpRank())
	}
	if e := resp.GetError(); e.GetCode() != v1.Code_CODE_OK {
		return resp, true, &RemoteError{Code: e.GetCode(), Message: e.GetMessage()}
	}
	return resp, true, nil
}

func (g *Group) request(to int) *v1.GroupRequest {
	return &v1.GroupRequest{
		WireVersion: v1.WireVersion_WIRE_VERSION_1,
		EngineId:    g.m.EngineID,
		TpSize:      uint32(g.m.TPSize),
		FromRank:    uint32(g.m.TPRank),
		ToRank:      uint32(to),
	}
}

// pageOpRequest sets req's body to a page op of kind on ids: page indices,
// or block ids for KIND_FREE.
func pageOpRequest(req *v1.GroupRequest, kind v1.PageOp_Kind, ids []int) *v1.GroupRequest {
	u := make([]uint32, len(ids))
	for i, pg := range ids {
		u[i] = uint32(pg)
	}
	op := &v1.PageOp{Kind: kind, Pages: u}
	if kind == v1.PageOp_KIND_FREE {
		op.Pages, op.Blocks = nil, u
	}
	req.Body = &v1.GroupRequest_PageOp{PageOp: op}
	return req
}

// pageOp sends one MAP, UNMAP or FREE of pages (block ids for FREE) to
// rank, after bringing the peer in sync on a connection rank 0 dialed anew
// (syncPeer) and repairing its pending pages. When a connection rank 0 held
// from before turns out broken (the follower died, or restarted), it dials
// once more and runs the op again: the sync on the new connection puts the
// follower in a known state first, so the op cannot apply twice. A MAP
// whose outcome is unknown and any failed UNMAP (including one that could
// not take the peer's slot or whose sync or repair step failed, so it was
// never sent) leave the pages pending on that peer: the pages are unmapped
// locally already, and a page left mapped on the peer would make every
// later MAP of it fail with "already mapped".
func (g *Group) pageOp(ctx context.Context, rank int, kind v1.PageOp_Kind, pages []int) *RankError {
	op := opName(kind)
	unmap := kind == v1.PageOp_KIND_UNMAP
	p := g.peers[rank]
	if unmap {
		p.forget(pages) // rank 0 unmapped them: a sync from now on leaves them out
	}
	if err := p.acquire(ctx); err != nil {
		if unmap {
			p.markPending(pages)
		}
		return &RankError{Rank: rank, Op: op, Err: err}
	}
	defer p.release()
	for retried := false; ; retried = true {
		reused := p.conn != nil
		stage, sent, err := g.pageOpOnce(ctx, p, kind, pages)
		if err == nil {
			return nil
		}
		if !retried && reused && errors.Is(err, ErrPeerUnavailable) && ctx.Err() == nil {
			g.log.Info("tpgroup connection to a peer broke; dialing it again", "peer", rank, "op", op, "err", err)
			continue
		}
		var re *RemoteError
		definite := !sent || errors.As(err, &re) || errors.Is(err, ErrTPMismatch)
		if unmap || !definite && kind == v1.PageOp_KIND_MAP {
			p.markPending(pages)
		}
		if stage == "" {
			stage = op
		}
		return &RankError{Rank: rank, Op: stage, Err: err}
	}
}

// pageOpOnce is one attempt of pageOp: sync, repair, the op. It returns the
// step that failed ("sync", "repair", or "" for the op itself) and whether
// the op may have reached the peer. The caller holds p's slot.
func (g *Group) pageOpOnce(ctx context.Context, p *peer, kind v1.PageOp_Kind, pages []int) (stage string, sent bool, err error) {
	if err := g.syncPeer(ctx, p); err != nil {
		return "sync", false, err
	}
	if err := g.repair(ctx, p); err != nil {
		return "repair", false, err
	}
	_, sent, err = g.exchange(ctx, p, pageOpRequest(g.request(p.rank), kind, pages))
	if err == nil && kind == v1.PageOp_KIND_MAP {
		p.remember(pages)
	}
	return "", sent, err
}

// syncPeer sends p a KIND_SYNC with every page rank 0 has mapped on it
// unless p answered one on its connection already: on a connection rank 0
// dials anew (the first, after a drop, after the follower asked for it),
// so that a follower that restarted holds rank 0's pages again and one
// that kept stale pages (rank 0 restarted, a MAP whose answer was lost)
// drops them, before any other op. The caller holds p's slot. When it
// fails p stays unsynced and the next op tries again.
func (g *Group) syncPeer(ctx context.Context, p *peer) error {
	if p.conn != nil && p.synced {
		return nil
	}
	pages := p.mappedPages()
	if _, _, err := g.exchange(ctx, p, pageOpRequest(g.request(p.rank), v1.PageOp_KIND_SYNC, pages)); err != nil {
		return err
	}
	p.synchronized()
	g.log.Debug("tpgroup peer synced", "peer", p.rank, "pages", len(pages))
	return nil
}

// repair unmaps p's pending pages on the peer; "not mapped" counts as done.
// It first tries them in one message and, when the peer says some page is
// not mapped, one page at a time. The caller holds p's slot.
func (g *Group) repair(ctx context.Context, p *peer) error {
	pages := p.pendingPages()
	if len(pages) == 0 {
		return nil
	}
	g.log.Info("tpgroup repairing peer", "peer", p.rank, "pages", len(pages))
	batch := [][]int{pages}
	for len(batch) > 0 {
		pg := batch[0]
		batch = batch[1:]
		_, _, err := g.exchange(ctx, p, pageOpRequest(g.request(p.rank), v1.PageOp_KIND_UNMAP, pg))
		var re *RemoteError
		switch {
		case err == nil:
		case errors.As(err, &re) && re.Code == notMappedCode && len(pg) > 1:
			for _, one := range pg {
				batch = append(batch, []int{one})
			}
			continue
		case errors.As(err, &re) && re.Code == notMappedCode:
		default:
			return err
		}
		p.clearPending(pg)
	}
	return nil
}

// Ping asks rank whether it is alive and agrees on the engine id and the TP
// size. It fails with a *RankError wrapping ErrTPMismatch when either side
// was started with another tp_size, ErrPeerUnavailable when the rank cannot
// be reached, or the ctx's (or PeerTimeout's) cause.
func (g *Group) Ping(ctx context.Context, rank int) error {
	if rank < 0 || rank >= g.m.TPSize || rank == g.m.TPRank {
		return fmt.Errorf("%w: ping rank %d: must be another rank in [0, %d)", ErrInvalidArgument, rank, g.m.TPSize)
	}
	if err := g.begin(); err != nil {
		return err
	}
	defer g.wg.Done()
	ctx, cancel := g.opContext(ctx)
	defer cancel()
	p := g.peers[rank]
	if err := p.acquire(ctx); err != nil {
		return &RankError{Rank: rank, Op: "ping", Err: err}
	}
	defer p.release()
	req := g.request(rank)
	req.Body = &v1.GroupRequest_Ping{Ping: true}
	if _, _, err := g.exchange(ctx, p, req); err != nil {
		return &RankError{Rank: rank, Op: "ping", Err: err}
	}
	return nil
}
