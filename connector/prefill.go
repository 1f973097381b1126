package connector

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// RequestFinished is the scheduler side's hook when a prefill request
// finishes (vLLM request_finished). When the request asked to keep its KV
// for a remote decode (in.do_remote_decode) and stopped at its length cap
// (prefill runs with max_tokens=1), the blocks are held under a lease (this
// rank's export of the request) and the kv_transfer_params for decode are
// returned: tp_size, engine id, rank addresses, remote request id,
// incarnation, lease expiry and this rank's entry of rank_exports (its
// export id and capability; its block ids are remote_block_ids). An engine
// whose ranks export one request separately merges the ranks' params with
// MergeExports before handing them to the proxy. For any other finish the
// blocks are released at once and nil is returned.
//
// The engine may say what the blocks encode (in.prompt_tokens, and
// in.token_digests: TokenDigests of the prompt, one per block); both are
// carried unchanged in the params, so a decode loads them only for the
// same tokens (see checkTokenDigests). A count that does not fit blockIDs
// is a *ParamsError and takes nothing over.
//
// blockIDs must be blocks this rank holds now: allocated in its pool (under
// coordinated ownership on rank 0; on ranks 1..N-1, whose pages rank 0
// maps, their pages must be mapped). The first id that is not fails the
// call naming it, and nothing is taken over. The Rank takes over blockIDs
// either way (freeing them itself under local ownership; under coordinated
// ownership the engine frees them once the request is in done_sending of
// every rank). A finish that keeps nothing for a request id whose export
// this rank holds withdraws that export: its lease is released at once (its
// blocks freed after the READs being served end), the request is reported
// in done_sending, and later READs of it are refused with
// CODE_LEASE_EXPIRED ("withdrawn by the engine").
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
	if err := r.checkHeld("block_ids", ids); err != nil {
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
	if hold {
		// What the engine says the blocks encode: refused before they are
		// taken over when it cannot describe them.
		if pe := checkTokenDigestCount("token_digests", in.GetTokenDigests(), len(ids)); pe != nil {
			return nil, pe
		}
		if pe := checkPromptTokens(in.GetPromptTokens(), len(ids), int(r.cfg.Geometry.GetBlockSize())); pe != nil {
			return nil, pe
		}
	}
	session := sessionOf(ctx)
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
		r.released(&lease{id: requestID, blocks: ids, session: session}, false)
		r.m.requests.WithLabelValues("prefill", "freed_at_once").Inc()
		// A finish that keeps nothing withdraws the request's export, if
		// it holds one: its lease ends now (after the READs being served),
		// not at its TTL.
		if r.leases.withdraw(requestID, fmt.Sprintf("withdrawn by the engine (RequestFinished with status %v)", status)) {
			r.cfg.Logger.Info("export withdrawn", "request_id", requestID, "status", status.String())
		}
		return nil, nil
	}
	var sums []byte
	var heads uint32
	if on := !r.cfg.DisableChecksums; in.Checksums == nil && on || in.GetChecksums() {
		// Recorded once the blocks are taken over: the engine wrote them.
		if sums, heads, err = r.recordChecksums(ids); err != nil {
			r.unref(ids)
			return nil, err
		}
	}
	var export uint64
	var capab []byte
	var expires time.Time
	for {
		export = newExportID(r.cfg.TPRank)
		ref := transfer.ExportRef{RequestID: requestID, TPRank: uint32(r.cfg.TPRank), ExportID: export}
		expires, err = r.leases.add(requestID, export, ids, session, func() []byte {
			capab = r.capKey.IssueExport(ref, blockIDs)
			return capab
		})
		// A random 64-bit id is taken only by a live or recent export of
		// this rank: draw again.
		if !errors.Is(err, errExportTaken) {
			break
		}
	}
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
		LeaseExpiresUnixMs: expires.UnixMilli(),
		RankExports: []*v1.RankExport{{TpRank: uint32(r.cfg.TPRank), ExportId: export, Capability: capab,
			CapabilityKeyId: r.capKey.ID(), BlockChecksums: sums, ChecksumHeads: heads}},
		BlockSize:    r.cfg.Geometry.GetBlockSize(),
		PromptTokens: in.GetPromptTokens(),
		TokenDigests: append([]byte(nil), in.GetTokenDigests()...),
	}
	out.RemoteHost, out.RemotePort = host, port
	r.cfg.Logger.Debug("request held for decode", "request_id", requestID, "export_id", strconv.FormatUint(export, 16),
		"blocks", len(ids), "lease_expires", expires)
	return out, nil
}

// exportRankShift places the exporting rank in an export id: its top 10
// bits (MaxTPSize is 1024), so a rank that gets another rank's export (the
// params' rank_exports entries swapped) names both ranks instead of taking
// it for an export it made and lost.
const exportRankShift = 54

// newExportID returns a random non-zero export id of rank.
func newExportID(rank int) uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return uint64(rank)<<exportRankShift | binary.LittleEndian.Uint64(b[:])>>(64-exportRankShift) | 1
}

// exportRank is the rank an export id says made it (newExportID).
func exportRank(export uint64) int { return int(export >> exportRankShift) }

// checkHeld checks that this rank holds every block of ids now: allocated
// in its pool, or, on a coordinated follower (rank 0 allocates, this rank
// only maps what rank 0 tells it), on a mapped page. The error names the
// first bad id and its position.
func (r *Rank) checkHeld(field string, ids []int) error {
	check := r.pool.CheckAllocated
	rule := "allocated on this rank"
	if r.cfg.Ownership == v1.Ownership_OWNERSHIP_COORDINATED && r.cfg.TPRank != 0 {
		check = r.pool.CheckMapped
		rule = "on a page rank 0 mapped on this rank"
	}
	err := check(ids)
	var be *vmm.BlockError
	if err == nil || !errors.As(err, &be) {
		return err
	}
	for i, b := range ids {
		if b == be.Block {
			return fmt.Errorf("%w: %s[%d]=%d is not a block %s (%v); nothing was taken over",
				ErrInvalidArgument, field, i, b, rule, be)
		}
	}
	return fmt.Errorf("%w: %s: %w", ErrInvalidArgument, field, err)
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
func (r *Rank) leaseReleased(l *lease, expired bool) {
	r.m.blocksHeld.Sub(float64(len(l.blocks)))
	r.released(l, expired)
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
// local ownership, and under coordinated ownership those whose engine
// session ended (orphans: the engine would have freed them once every rank
// reported done_sending, but it is gone; on rank 0, whose Free tells the
// followers), and reports the request in done_sending. A block the pool
// refuses to free does not keep the others: they are freed one by one and
// the refused ones are logged.
func (r *Rank) released(l *lease, expired bool) {
	// Dropping the last reference and freeing are one step under r.mu: no
	// RequestFinished can take a reference to a block about to be freed.
	r.mu.Lock()
	var free []int
	for _, b := range r.unrefLocked(l.blocks) {
		_, orphan := r.orphans[b]
		delete(r.orphans, b)
		if orphan || r.cfg.Ownership == v1.Ownership_OWNERSHIP_LOCAL {
			free = append(free, b)
		}
	}
	if len(free) > 0 {
		// Free's error means nothing was freed: one by one, the others go.
		if err := r.pool.Free(context.Background(), free); err != nil {
			var bad []int
			for _, b := range free {
				if r.pool.Free(context.Background(), []int{b}) != nil {
					bad = append(bad, b)
				}
			}
			r.cfg.Logger.Error("freeing released blocks failed", "request_id", l.id, "blocks", len(free), "refused", bad, "err", err)
		}
	}
	r.mu.Unlock()
	if expired {
		r.m.leasesExpired.Inc()
		r.m.requests.WithLabelValues("prefill", "lease_expired").Inc()
		r.cfg.Logger.Warn("lease expired", "request_id", l.id, "blocks", len(l.blocks))
	}
	r.report(finishedItem{kind: itemSent, id: l.id, session: l.session})
}

// authorize is the serving side's check of every READ before memory is
// touched: the READ names an export this rank holds live; the capability
// was issued for that export (request id, this rank, export id, its
// blocks); every block the descriptors touch is a block of that export; and
// every page they touch is mapped. A refusal names the request, the rank
// and the first bad block, and moves no byte. The lease is pinned until
// release: if it expires or is notified while the READ runs, its blocks are
// freed (and their pages unmapped) only after the READ stopped reading
// them; the blocks' pages are pinned in the pool (Pool.Pin) too. A READ
// that arrived in 0-RTT (a.Early) holds only that pin: it
// marks nothing as read until its handshake completed (release), so a
// replayed flight changes no lasting state of the lease.
func (r *Rank) authorize(_ context.Context, a *transfer.Access) error {
	if a.Op != transfer.OpRead {
		return fmt.Errorf("%w: %s into exported blocks of request %q is not allowed", ErrCapabilityDenied, a.Op, a.RequestID)
	}
	var unpin func()
	l, err := r.leases.pin(exportRef{a.RequestID, a.ExportID}, consumerOf(a), !a.Early, func(l *lease) error {
		if err := r.capKey.VerifyExport(a.Capability, r.exportRef(l), l.tokens()); err != nil {
			return fmt.Errorf("connector: READ of request %q on rank %d: %w; no byte was read", l.id, r.cfg.TPRank, err)
		}
		for _, b := range a.BlockIDs {
			if !l.has(b) {
				return fmt.Errorf("%w: block %d is not in request %q's export %016x on rank %d; no byte was read",
					ErrCapabilityDenied, b, l.id, l.export, r.cfg.TPRank)
			}
		}
		// The pages stay mapped until release, on this rank and, under
		// coordinated ownership, on rank 0, whose free of a block waits for
		// this pin (Pool.WaitUnpinned, through the TP group).
		var err error
		unpin, err = r.pool.Pin(kvgeom.Ints(a.BlockIDs), func() {
			a.Abort(fmt.Errorf("%w: rank 0 frees blocks of request %q while rank %d serves them", ErrAborted, l.id, r.cfg.TPRank))
		})
		if err != nil {
			var be *vmm.BlockError
			if errors.As(err, &be) {
				return codes.New(codes.Of(err), "connector: request %q export %016x on rank %d: block %d: its page is not mapped; no byte was read",
					l.id, l.export, r.cfg.TPRank, be.Block)
			}
			return err
		}
		return nil
	})
	if err != nil {
		r.cfg.Logger.Warn("READ refused", "peer", a.Peer, "request_id", a.RequestID, "export_id", strconv.FormatUint(a.ExportID, 16), "err", err)
		return err
	}
	r.pinned.Store(a, servedRead{l, unpin})
	return nil
}

// consumerOf is who a served READ says it is for.
func consumerOf(a *transfer.Access) consumer { return consumer{a.ConsumerEngineID, a.ConsumerTPRank} }

// servedRead is a READ being served: its lease, pinned, and its pin of the
// blocks' pages.
type servedRead struct {
	lease *lease
	unpin func()
}

// ownerFreed ends, on a follower of a coordinated group, every export that
// holds one of blocks: rank 0 is freeing them, and may hand them to another
// request, so no later READ may be served from them (a READ being served
// keeps its pin; rank 0 waits for it).
func (r *Rank) ownerFreed(blocks []int) {
	if n := r.leases.revoke(blocks); n > 0 {
		r.cfg.Logger.Warn("rank 0 freed blocks that exports of this rank held; the exports ended", "blocks", len(blocks), "exports", n)
	}
}

// exportRef names lease l for the capability key.
func (r *Rank) exportRef(l *lease) transfer.ExportRef {
	return transfer.ExportRef{RequestID: l.id, TPRank: uint32(r.cfg.TPRank), ExportID: l.export}
}

// release is the serving side's hook after an authorized READ stopped
// touching memory: the lease's blocks may be freed from now on. A READ
// whose handshake never completed (a.Early still set: a replayed 0-RTT
// flight, or a dialer gone before its handshake ended) counts for nothing.
func (r *Rank) release(a *transfer.Access) {
	if v, ok := r.pinned.LoadAndDelete(a); ok {
		sr := v.(servedRead)
		r.leases.unpin(sr.lease, consumerOf(a), a.Err == nil, !a.Early)
		sr.unpin() // last: the READ is over before its pages may unmap

	}
}

// abortServed resets every READ being served with err's code.
func (r *Rank) abortServed(err error) int {
	n := 0
	r.pinned.Range(func(k, _ any) bool {
		k.(*transfer.Access).Abort(err)
		n++
		return true
	})
	return n
}

// onNotification counts a consumer's notification of one export; the last
// expected one releases the lease. A resent notification of a consumer
// already counted is acknowledged.
func (r *Rank) onNotification(_ context.Context, peer string, n *v1.Notification) error {
	ref := exportRef{n.GetRequestId(), n.GetExportId()}
	done, err := r.leases.notify(ref, consumer{n.GetConsumerEngineId(), n.GetConsumerTpRank()}, int(n.GetConsumerCount()), n.GetCapability(),
		func(l *lease) error { return r.capKey.VerifyExport(n.GetCapability(), r.exportRef(l), l.tokens()) })
	if err != nil {
		r.cfg.Logger.Warn("notification refused", "peer", peer, "request_id", n.GetRequestId(),
			"export_id", strconv.FormatUint(n.GetExportId(), 16), "err", err)
		return err
	}
	if done {
		r.m.requests.WithLabelValues("prefill", "sent").Inc()
	}
	return nil
}

// onHeartbeat extends the leases a consumer is still reading: only those
// whose export and capability (same position in the heartbeat) verify, so a
// peer cannot keep another export's blocks held by naming its request id.
func (r *Rank) onHeartbeat(_ context.Context, peer string, hb *v1.Heartbeat) *v1.HeartbeatAck {
	caps, exports := hb.GetCapabilities(), hb.GetExportIds()
	refs := make([]exportRef, len(hb.GetRequestIds()))
	for i, id := range hb.GetRequestIds() {
		refs[i].id = id
		if i < len(exports) {
			refs[i].export = exports[i]
		}
	}
	dl := r.leases.extend(refs, func(i int, l *lease) error {
		if i >= len(caps) {
			return ErrCapabilityDenied
		}
		return r.capKey.VerifyExport(caps[i], r.exportRef(l), l.tokens())
	})
	ack := &v1.HeartbeatAck{LeaseExpiresUnixMs: make([]int64, len(dl))}
	for i, t := range dl {
		if !t.IsZero() {
			ack.LeaseExpiresUnixMs[i] = t.UnixMilli()
		} else {
			r.cfg.Logger.Debug("heartbeat for an export not held here, or without its capability, ignored", "peer", peer, "request_id", refs[i].id)
		}
	}
	return ack
}
