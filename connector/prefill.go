package connector

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// RequestFinished is the scheduler side's hook when a prefill request
// finishes (vLLM request_finished). When the request asked to keep its KV
// for a remote decode (in.do_remote_decode) and stopped at its length cap
// (prefill runs with max_tokens=1), the blocks are held under a lease and
// the kv_transfer_params for decode are returned: tp_size, engine id, rank
// addresses, remote request id, incarnation, capability and lease expiry.
// For any other finish the blocks are released at once and nil is returned.
// The Rank takes over blockIDs either way (freeing them itself under local
// ownership; under coordinated ownership the engine frees them once the
// request is in done_sending of every rank).
func (r *Rank) RequestFinished(ctx context.Context, requestID string, blockIDs []uint32, status v1.FinishStatus, in *v1.KVTransferParams) (*v1.KVTransferParams, error) {
	if err := r.refuseIfDraining(); err != nil {
		return nil, err
	}
	if requestID == "" {
		return nil, fmt.Errorf("%w: request_id is empty", ErrInvalidArgument)
	}
	ids, err := r.checkBlocks("block_ids", blockIDs)
	if err != nil {
		return nil, err
	}
	host, port, err := rank0Addr(r.cfg.AdvertiseAddr, r.cfg.TPRank)
	if len(r.cfg.RankAddrs) > 0 {
		host, port, err = rank0Addr(r.cfg.RankAddrs[0], 0)
	}
	if err != nil {
		return nil, err
	}
	hold := in.GetDoRemoteDecode() && status == v1.FinishStatus_FINISH_STATUS_LENGTH && len(ids) > 0
	// Take the blocks over only if no load writes into them and no free is
	// in progress. A block may be in several requests (a shared prefix):
	// each RequestFinished is one reference, and a block is freed when its
	// last reference is released.
	r.mu.Lock()
	if err := r.busyLocked("block_ids", ids, true); err != nil {
		r.mu.Unlock()
		return nil, err
	}
	for _, b := range ids {
		r.refs[b]++
	}
	r.mu.Unlock()
	if !hold {
		r.released(requestID, ids, false)
		r.m.requests.WithLabelValues("prefill", "freed_at_once").Inc()
		return nil, nil
	}
	capab := r.capKey.Issue(requestID, blockIDs...)
	expires, err := r.leases.add(requestID, ids)
	if err != nil {
		r.unref(ids) // not taken over: the blocks stay the engine's
		return nil, err
	}
	r.m.blocksHeld.Add(float64(len(ids)))
	out := &v1.KVTransferParams{
		DoRemotePrefill:    true,
		RemoteEngineId:     r.cfg.EngineID,
		RemoteRequestId:    requestID,
		RemoteBlockIds:     append([]uint32(nil), blockIDs...),
		TpSize:             new(uint32(r.cfg.TPSize)),
		RemoteRankAddrs:    append([]string(nil), r.cfg.RankAddrs...),
		RemoteIncarnation:  r.incarnation,
		Capability:         capab,
		LeaseExpiresUnixMs: expires.UnixMilli(),
	}
	out.RemoteHost, out.RemotePort = host, port
	r.cfg.Logger.Debug("request held for decode", "request_id", requestID, "blocks", len(ids), "lease_expires", expires)
	return out, nil
}

// rank0Addr derives rank 0's host and port from rank r's address by the
// remote_port + rank convention.
func rank0Addr(addr string, rank int) (string, uint32, error) {
	host, ps, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("%w: advertised address %q: %v", ErrInvalidArgument, addr, err)
	}
	port, err := strconv.Atoi(ps)
	if err != nil || port-rank < 1 {
		return "", 0, fmt.Errorf("%w: advertised address %q: port minus tp_rank %d is not a port", ErrInvalidArgument, addr, rank)
	}
	return host, uint32(port - rank), nil
}

// leaseReleased is the lease table's callback.
func (r *Rank) leaseReleased(id string, blocks []int, expired bool) {
	r.m.blocksHeld.Sub(float64(len(blocks)))
	r.released(id, blocks, expired)
}

// unref drops one reference of each block and returns the blocks whose
// last reference it was.
func (r *Rank) unref(blocks []int) []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.unrefLocked(blocks)
}

func (r *Rank) unrefLocked(blocks []int) []int {
	var last []int
	for _, b := range blocks {
		if r.refs[b]--; r.refs[b] <= 0 {
			delete(r.refs, b)
			last = append(last, b)
		}
	}
	return last
}

// released is called once per lease (or for blocks freed at once): drops
// the request's references, frees the blocks no other request holds under
// local ownership (under coordinated ownership the engine frees them once
// every rank reported done_sending), and reports the request in
// done_sending.
func (r *Rank) released(id string, blocks []int, expired bool) {
	// Dropping the last reference and freeing are one step under r.mu: no
	// RequestFinished can take a reference to a block about to be freed.
	r.mu.Lock()
	last := r.unrefLocked(blocks)
	if len(last) > 0 && r.cfg.Ownership == v1.Ownership_OWNERSHIP_LOCAL {
		if err := r.pool.Free(context.Background(), last); err != nil {
			r.cfg.Logger.Error("freeing released blocks failed", "request_id", id, "blocks", len(last), "err", err)
		}
	}
	r.mu.Unlock()
	if expired {
		r.m.leasesExpired.Inc()
		r.m.requests.WithLabelValues("prefill", "lease_expired").Inc()
		r.cfg.Logger.Warn("lease expired", "request_id", id, "blocks", len(blocks))
	}
	r.mu.Lock()
	r.sending = append(r.sending, id)
	r.signalLocked()
	r.mu.Unlock()
}

// authorize is the serving side's check of every READ before memory is
// touched: the request holds a live lease here and the capability it
// carries was issued for it and covers every block the descriptors touch.
// The lease is pinned until release: if it expires or is notified while
// the READ runs, its blocks are freed (and their pages unmapped) only after
// the READ stopped reading them.
func (r *Rank) authorize(_ context.Context, a *transfer.Access) error {
	if a.Op != transfer.OpRead {
		return codes.New(v1.Code_CODE_CAPABILITY_DENIED, "connector: %s into exported blocks of request %q is not allowed", a.Op, a.RequestID)
	}
	l, err := r.leases.pin(a.RequestID)
	if err != nil {
		return err
	}
	if err := r.capKey.Verify(a.Capability, a.RequestID, a.BlockIDs); err != nil {
		r.leases.unpin(l)
		return err
	}
	r.pinned.Store(a, l)
	return nil
}

// release is the serving side's hook after an authorized READ stopped
// touching memory: the lease's blocks may be freed from now on.
func (r *Rank) release(a *transfer.Access) {
	if l, ok := r.pinned.LoadAndDelete(a); ok {
		r.leases.unpin(l.(*lease))
	}
}

// onNotification counts a consumer's notification; the last expected one
// releases the lease.
func (r *Rank) onNotification(_ context.Context, peer string, n *v1.Notification) error {
	done, err := r.leases.notify(n.GetRequestId(), consumer{n.GetConsumerEngineId(), n.GetConsumerTpRank()}, int(n.GetConsumerCount()),
		func() error { return r.capKey.Verify(n.GetCapability(), n.GetRequestId(), nil) })
	if err != nil {
		r.cfg.Logger.Warn("notification refused", "peer", peer, "request_id", n.GetRequestId(), "err", err)
		return err
	}
	if done {
		r.m.requests.WithLabelValues("prefill", "sent").Inc()
	}
	return nil
}

// onHeartbeat extends the leases a consumer is still reading: only those
// whose capability (same position in the heartbeat) verifies, so a peer
// cannot keep another request's blocks held by naming its id.
func (r *Rank) onHeartbeat(_ context.Context, peer string, hb *v1.Heartbeat) *v1.HeartbeatAck {
	caps := hb.GetCapabilities()
	ids := make([]string, 0, len(hb.GetRequestIds()))
	pos := make([]int, 0, len(hb.GetRequestIds()))
	for i, id := range hb.GetRequestIds() {
		if i >= len(caps) || r.capKey.Verify(caps[i], id, nil) != nil {
			r.cfg.Logger.Debug("heartbeat without a valid capability ignored", "peer", peer, "request_id", id)
			continue
		}
		ids, pos = append(ids, id), append(pos, i)
	}
	ext := r.leases.extend(ids)
	dl := make([]time.Time, len(hb.GetRequestIds()))
	for k, i := range pos {
		dl[i] = ext[k]
	}
	ack := &v1.HeartbeatAck{LeaseExpiresUnixMs: make([]int64, len(dl))}
	for i, t := range dl {
		if !t.IsZero() {
			ack.LeaseExpiresUnixMs[i] = t.UnixMilli()
		}
	}
	return ack
}
