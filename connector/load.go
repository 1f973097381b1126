package connector

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// load is one StartLoad in flight on the worker side.
type load struct {
	id string
	// blocks are every local block of the request, reported for recompute
	// when the load fails; dst are those written (blocks without the
	// surplus), dst[i] receiving remote block hit+i.
	blocks []int
	dst    []int
	hit    int
	params *v1.KVTransferParams
	plan   Plan
	addrs  []string // address of every source of plan, same order
	// exports[i] is source i's export (nil when the params carry none).
	exports []*v1.RankExport
	session uint64
	// reached[i]: source i is to be notified (its handshake did not
	// refuse, see refusedHandshake).
	reached []bool
	cancel  context.CancelCauseFunc
	// unpin releases the pool's pin of blocks (Pool.Pin), once no READ
	// writes into them.
	unpin func()
	done  chan struct{}
	// verifiers[i] folds source i's checksums as its bytes land (nil: its
	// export carries none, or they are not verified on its path).
	verifiers []*landVerifier
	// start is when StartLoad accepted the load; firstByte observes the
	// time to its first KV byte once.
	start     time.Time
	firstByte sync.Once
}

// StartLoad starts importing a request's KV into local blocks (vLLM
// start_load_kv for one request). The alignment of meta.local_block_ids to
// remote_block_ids is explicit (see AlignBlocks): remote block
// remote_hit_blocks+i lands in local_block_ids[i]; the last
// local_surplus_blocks local blocks are never written; with nothing to read
// (a full prefix hit) the prefill ranks are only notified. Each source rank
// is read through its own entry of params.rank_exports (its export id,
// capability and block ids). The result is reported by GetFinished: in
// DoneRecving once every byte is in local pages and every source was
// notified, or in Failed with every local block id to recompute (also when
// the params carry no export of a source rank). Synchronous errors (bad
// params, blocks that cannot be aligned, token digests that differ from
// the decode's prompt, TP sizes that do not map, a request already
// loading) name the field and start nothing.
func (r *Rank) StartLoad(ctx context.Context, meta *v1.ReqMeta) error {
	if err := r.refuseIfDraining(); err != nil {
		return err
	}
	id := meta.GetRequestId()
	if id == "" {
		return fmt.Errorf("%w: request_id is empty", ErrInvalidArgument)
	}
	p := meta.GetParams()
	if err := ValidateRemotePrefill(p); err != nil {
		return err
	}
	// Blocks of another size do not map one to one: say so before the
	// block counts disagree for that reason.
	if bs, lbs := p.GetBlockSize(), r.cfg.Geometry.GetBlockSize(); bs != 0 && bs != lbs {
		return codes.New(v1.Code_CODE_INCOMPATIBLE_MODEL,
			"connector: kv_transfer_params block_size=%d (prefill engine %q) differs from this rank's block_size=%d: the prefill's block ids do not map to this rank's blocks; run both with one --block-size",
			bs, p.GetRemoteEngineId(), lbs)
	}
	local, err := r.checkBlocks("local_block_ids", meta.GetLocalBlockIds())
	if err != nil {
		return err
	}
	// A READ must write only into allocated blocks: a free block may sit in
	// a reserve page that a lower memory limit unmaps mid-READ. Under
	// coordinated ownership only rank 0 knows which blocks are allocated.
	if r.cfg.Ownership == v1.Ownership_OWNERSHIP_LOCAL {
		if err := r.pool.CheckAllocated(local); err != nil {
			return fmt.Errorf("%w: local_block_ids: %w", ErrInvalidArgument, err)
		}
	}
	hit, dst, err := AlignBlocks(meta)
	if err != nil {
		return err
	}
	// KV of other tokens than the decode's prompt is never read.
	if err := checkTokenDigests(meta, hit, dst); err != nil {
		return err
	}
	plan, err := PlanRank(r.shape, int(p.GetTpSize()), r.cfg.TPSize, r.cfg.TPRank)
	if err != nil {
		return err
	}
	if bl := r.regions[0].BlockLen; plan.LocalBlockLen != bl {
		return fmt.Errorf("%w: local block_len=%d, the TP mapping of prefill tp_size=%d to decode tp_size=%d needs %d",
			ErrTPMapping, bl, p.GetTpSize(), r.cfg.TPSize, plan.LocalBlockLen)
	}
	l := &load{id: id, blocks: local, dst: local[:dst], hit: hit, params: p, plan: plan, session: sessionOf(ctx), done: make(chan struct{}), start: time.Now()}
	for _, s := range plan.Sources {
		a, err := RankAddr(p, s.PrefillRank)
		if err != nil {
			return err
		}
		l.addrs = append(l.addrs, a)
		e := ExportOf(p, s.PrefillRank)
		l.exports = append(l.exports, e)
		if k := slices.Index(p.GetRankExports(), e); k >= 0 {
			if err := checkChecksumParams(p, k, e); err != nil {
				return err
			}
		}
	}
	lctx, cancel := context.WithCancelCause(r.ctx)
	lctx, cancelTimeout := context.WithTimeoutCause(lctx, r.cfg.LoadTimeout,
		fmt.Errorf("connector: load of %q exceeded LoadTimeout %v", id, r.cfg.LoadTimeout))
	l.cancel = func(err error) { cancel(err); cancelTimeout() }
	// The destination pages stay mapped until the load ends, on this rank
	// and, under coordinated ownership, on rank 0, whose free of a block
	// waits for this pin (and aborts the load at its deadline).
	l.unpin, err = r.pool.Pin(local, func() {
		l.cancel(fmt.Errorf("%w: rank 0 frees local blocks of request %q while rank %d loads into them", ErrAborted, id, r.cfg.TPRank))
	})
	if err != nil {
		l.cancel(nil)
		return fmt.Errorf("%w: local_block_ids: %w", ErrInvalidArgument, err)
	}
	fail := func(err error) error {
		l.unpin()
		l.cancel(nil)
		return err
	}
	r.mu.Lock()
	if r.closed || r.draining {
		r.mu.Unlock()
		return fail(r.refuseIfDraining())
	}
	if _, busy := r.loads[id]; busy {
		r.mu.Unlock()
		return fail(fmt.Errorf("%w: request %q is already loading", ErrBusy, id))
	}
	if err := r.busyLocked("local_block_ids", local, false); err != nil {
		r.mu.Unlock()
		return fail(err)
	}
	for _, b := range local {
		r.busy[b] = blockUse{useLoading, id}
	}
	r.loads[id] = l
	r.mu.Unlock()
	r.m.loadsInFlight.Inc()
	r.wg.Go(func() { r.runLoad(lctx, l) })
	return nil
}

// Abort stops a load in flight and returns once no READ into its blocks
// is running any more, so the caller may free and reuse them. The request
// is reported in Failed with CODE_ABORTED. Aborting an unknown or finished
// request is not an error.
func (r *Rank) Abort(ctx context.Context, requestID string) error {
	r.mu.Lock()
	l := r.loads[requestID]
	r.mu.Unlock()
	if l == nil {
		return nil
	}
	l.cancel(fmt.Errorf("%w: request %q", ErrAborted, requestID))
	select {
	case <-l.done:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

func (r *Rank) runLoad(ctx context.Context, l *load) {
	start := time.Now()
	err := r.load(ctx, l)
	if err == nil && len(l.dst) > 0 {
		if r.afterRead != nil {
			r.afterRead(l.id)
		}
		err = r.verifyChecksums(l)
	}
	l.unpin()
	// Notify every source reached, read or not, whatever happened: prefill
	// frees its blocks now instead of at lease expiry. After a successful
	// load the notifications come first, so the prefill has released its
	// lease when the request is reported done (only a full prefix hit fails
	// on a refusal, see notifyAll). After a failure they only spare prefill
	// the wait for its lease, and a source that stopped answering (killed,
	// stopped, cut off) would hold the report back for up to notifyTimeout:
	// the failure is reported first and they are sent afterwards.
	if err == nil {
		err = r.notifyAll(l)
	} else {
		defer r.notifyAll(l) // logged; the load already failed
	}
	r.mu.Lock()
	delete(r.loads, l.id)
	for _, b := range l.blocks {
		delete(r.busy, b)
	}
	r.mu.Unlock()
	if err == nil {
		r.report(finishedItem{kind: itemRecv, id: l.id, session: l.session})
	} else {
		// Every block is recomputed, except after a checksum mismatch: the
		// blocks whose bytes differ.
		bad := l.blocks
		if ce, ok := errors.AsType[*ChecksumError](err); ok {
			bad = ce.Blocks
		}
		r.report(finishedItem{kind: itemFailed, id: l.id, session: l.session,
			failed: FailedLoad{RequestID: l.id, BlockIDs: bad, Err: err}})
	}
	r.m.loadsInFlight.Dec()
	outcome := "done"
	if err != nil {
		outcome = codes.Of(err).String()
		r.cfg.Logger.Warn("load failed", "request_id", l.id, "blocks", len(l.blocks), "err", err)
	}
	r.m.requests.WithLabelValues("decode", outcome).Inc()
	r.m.loadSeconds.Observe(time.Since(start).Seconds())
	close(l.done)
}

// targets are the handshake targets of l's sources, with what each must
// be: the params' engine, rank and TP size, this rank's geometry, and its
// layout (every region's layer and kind, each of the remote block length):
// a source that lists the same regions in another order is read by layer
// and kind, one whose regions differ otherwise is refused before any byte.
func (r *Rank) targets(l *load) []handshake.Target {
	p := l.params
	r0, _ := RankAddr(p, 0)
	layout := make([]handshake.RegionShape, len(r.regions))
	for i, lr := range r.regions {
		layout[i] = handshake.RegionShape{Layer: uint32(lr.Layer), Kind: lr.Kind, BlockLen: l.plan.RemoteBlockLen}
	}
	ts := make([]handshake.Target, len(l.plan.Sources))
	for i, s := range l.plan.Sources {
		e := handshake.Expect{EngineID: p.GetRemoteEngineId(), TPRank: s.PrefillRank, TPSize: int(p.GetTpSize()),
			ModelHash: r.modelHash, Geometry: r.cfg.Geometry, NumRegions: len(r.regions), BlockLen: l.plan.RemoteBlockLen, Layout: layout}
		if s.PrefillRank == 0 {
			// remote_incarnation is rank 0's (the params come from its scheduler).
			e.Incarnation = p.GetRemoteIncarnation()
		}
		ts[i] = handshake.Target{Expect: e, Addr: l.addrs[i], Rank0Addr: r0}
	}
	return ts
}

// load handshakes with every source and READs every reading source's
// slice of the blocks to read, each through the source's own export, all
// in parallel. It marks in l.reached the sources to notify afterwards:
// those whose handshake did not refuse (refusedHandshake).
//
// In piggyback mode a READ does not wait for its source's handshake: it
// names the source's memory by region and block (transfer.BlockDescs,
// resolved by the source) and carries what the handshake checks
// (handshake.ExpectOf: engine id, tp_rank, tp_size, geometry, block_len,
// capability key id), which the source checks before it serves a byte. So
// the first KV byte from a never-seen prefill rank arrives after the QUIC
// handshake and one round trip, and a failure still reads as the
// handshake's: its error, when it has one, is the one reported. In legacy
// mode the READs start once every handshake succeeded (tp_size is only
// known from remote rank 0).
func (r *Rank) load(ctx context.Context, l *load) error {
	l.reached = make([]bool, len(l.plan.Sources))
	var missing []error
	for i, s := range l.plan.Sources {
		if l.exports[i] == nil {
			missing = append(missing, &ParamsError{Field: "rank_exports", Value: fmt.Sprintf("ranks %v", exportRanks(l.params)),
				Rule: fmt.Sprintf("no export of prefill rank %d, which holds heads of decode rank %d (prefill tp_size=%d, decode tp_size=%d): "+
					"the params must carry every prefill rank's export (merge the ranks' RequestFinished params with MergeExports)",
					s.PrefillRank, r.cfg.TPRank, l.params.GetTpSize(), r.cfg.TPSize), Reason: codes.ReasonParamsExportMissing})
		}
	}
	if len(missing) > 0 {
		// Nothing is read, and nobody is told: params this rank refuses
		// end no export (the engine may load complete ones later).
		return fmt.Errorf("connector: load %q: %w", l.id, errors.Join(missing...))
	}
	ts := r.targets(l)
	// The metadata exchange and the READs to a source run side by side: a
	// READ that starts after the exchange met the source's refusal gets it
	// rather than dialing the refusing source again.
	ctx = r.agent.MarkCalls(ctx)
	mds := make([]*handshake.Metadata, len(ts))
	errs := make([]error, len(ts))
	hsDone := make([]chan struct{}, len(ts))
	var hsWG sync.WaitGroup
	for i := range ts {
		hsDone[i] = make(chan struct{})
		hsWG.Go(func() {
			defer close(hsDone[i])
			mds[i], errs[i] = r.hs.Get(ctx, ts[i])
			if errs[i] != nil {
				// Name the params the expectation came from: a wrong
				// remote_engine_id or tp_size shows up here.
				errs[i] = fmt.Errorf("prefill rank %d at %s (kv_transfer_params remote_engine_id=%q tp_size=%d): %w",
					ts[i].Expect.TPRank, ts[i].Addr, l.params.GetRemoteEngineId(), l.params.GetTpSize(), errs[i])
			}
		})
	}
	if r.hs.Mode() != handshake.ModePiggyback {
		hsWG.Wait()
		if errors.Join(errs...) != nil {
			for i, err := range errs {
				l.reached[i] = !refusedHandshake(err)
			}
			return fmt.Errorf("connector: load %q: %w", l.id, errors.Join(errs...))
		}
	}
	readErrs := make([]error, len(ts))
	l.verifiers = make([]*landVerifier, len(ts))
	var wg sync.WaitGroup
	for i, s := range l.plan.Sources {
		if s.NotifyOnly || len(l.dst) == 0 {
			continue
		}
		remote := sourceBlocks(l.params, l.exports[i])[l.hit : l.hit+len(l.dst)]
		wg.Go(func() {
			// A source that may be on this host is read once its
			// metadata says whether the same-host path reaches it (one
			// round trip, none when cached); any other is read at once.
			var sh *transfer.SameHostPeer
			if r.mayBeSameHost(ts[i].Addr) {
				<-hsDone[i]
				if errs[i] != nil {
					return // the handshake's error is the load's
				}
				sh = r.sameHostPeer(mds[i])
			}
			l.verifiers[i] = r.verifierFor(l, s, l.exports[i], sh)
			readErrs[i] = r.readSource(ctx, l, s, l.exports[i], ts[i], remote, sh, l.verifiers[i])
			if readErrs[i] != nil && codes.Of(readErrs[i]) == v1.Code_CODE_UNAVAILABLE && ctx.Err() == nil {
				what := "did not serve the READ (it is starting, shutting down, or gone)"
				if xe, ok := errors.AsType[*transfer.XferError](readErrs[i]); ok && xe.Bytes > 0 {
					what = "stopped serving the READ (it is shutting down, or gone)"
				}
				readErrs[i] = fmt.Errorf("prefill rank %d at %s %s: %w", s.PrefillRank, ts[i].Addr, what, readErrs[i])
			}
		})
	}
	hsWG.Wait()
	wg.Wait()
	// What the handshake found explains a refused READ best: report it first.
	for i, err := range errs {
		l.reached[i] = !refusedHandshake(err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("connector: load %q: %w", l.id, err)
	}
	// A source whose capability key is not the one its export was signed
	// with refused every READ: say so, naming both.
	for i, s := range l.plan.Sources {
		if want, got := l.exports[i].GetCapabilityKeyId(), mds[i].CapabilityKeyID; want != "" && got != "" && want != got {
			l.reached[i] = false // its notification would be refused too
			errs[i] = codes.New(v1.Code_CODE_CAPABILITY_DENIED,
				"connector: load %q: prefill rank %d (%s) of engine %q holds capability key id %s, but its export in kv_transfer_params was signed with key id %s "+
					"(the rank restarted with another --capability-key-file, or the params were edited); decode rank %d reads nothing from it",
				l.id, s.PrefillRank, ts[i].Addr, l.params.GetRemoteEngineId(), got, want, r.cfg.TPRank)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if len(l.dst) == 0 {
		return nil // nothing to read (full prefix hit): notify only
	}
	// A source whose READ was refused as not naming its export (edited
	// block ids, another export's capability) is not notified: params that
	// name no export correctly must not end it.
	for i, err := range readErrs {
		if refusesParams(err) {
			l.reached[i] = false
		}
	}
	for i, s := range l.plan.Sources {
		if s.NotifyOnly {
			continue
		}
		if err := checkRemoteBlocks(l.params, l.exports[i], mds[i]); err != nil {
			l.reached[i] = false
			return fmt.Errorf("connector: load %q: %w", l.id, err)
		}
	}
	if err := errors.Join(readErrs...); err != nil {
		return fmt.Errorf("connector: load %q: %w", l.id, err)
	}
	return nil
}

// refusesParams reports whether err is a source's refusal of what the
// params name (blocks outside its export or regions, a capability not its
// export's, a malformed request): the params are wrong, not the transfer.
func refusesParams(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrInvalidParams) {
		return true
	}
	switch codes.Of(err) {
	case v1.Code_CODE_CAPABILITY_DENIED, v1.Code_CODE_OUT_OF_RANGE, v1.Code_CODE_INVALID_ARGUMENT:
		return true
	}
	return false
}

// checkRemoteBlocks checks export e's block ids against the block count
// its rank advertised: an id outside [1, num_blocks) is a *ParamsError
// naming it (the prefill refuses such a READ as outside its regions or
// its export, so this only names the cause).
func checkRemoteBlocks(p *v1.KVTransferParams, e *v1.RankExport, md *handshake.Metadata) error {
	field := "remote_block_ids"
	if len(e.GetBlockIds()) > 0 {
		for k, x := range p.GetRankExports() {
			if x == e {
				field = fmt.Sprintf("rank_exports[%d].block_ids", k)
			}
		}
	}
	for i, id := range sourceBlocks(p, e) {
		if id == 0 || int64(id) >= int64(md.NumBlocks) {
			return &ParamsError{Field: fmt.Sprintf("%s[%d]", field, i), Value: strconv.FormatUint(uint64(id), 10),
				Rule:   fmt.Sprintf("outside [1, %d) of prefill rank %d (num_blocks; block 0 is the null block)", md.NumBlocks, md.TPRank),
				Reason: codes.ReasonParamsOutOfRange}
		}
	}
	return nil
}

// readSource READs source s's slice of every block to read (remote[k]
// into l.dst[k]) through its export e, naming the source's memory by
// region and block, in batches of at most MaxDescsPerXfer entries
// (regions × blocks); local blocks adjacent in memory travel as one local
// descriptor. Every READ carries t's expectations, checked by the source
// before it serves a byte. When a READ's connection died under it, the
// agent redials and sends it again (transfer's redial rule); first the
// source's metadata is fetched anew on the new connection (a prefill
// restarted on the same address is another incarnation), so the cache
// holds the new process and a mismatch fails the READ with the
// handshake's error. The new process resolves the blocks in its own
// memory, and holds no export of the old one, so the READ is refused
// there with CODE_LEASE_EXPIRED, never served from the wrong place. A READ
// moves bytes only into this load's own blocks, so reading again is safe.
// With sh (the source is on this host) the READs go on the same-host path,
// or over QUIC when that path cannot be had. With v, the bytes are folded
// into the source's checksums as they land.
func (r *Rank) readSource(ctx context.Context, l *load, s Source, e *v1.RankExport, t handshake.Target, remote []uint32, sh *transfer.SameHostPeer, v *landVerifier) error {
	onRedial := func(ctx context.Context) error {
		r.hs.Forget(t.Addr)
		_, err := r.hs.Get(ctx, t)
		return err
	}
	expect := handshake.ExpectOf(t.Expect, e.GetCapabilityKeyId())
	firstByte := func() { l.firstByte.Do(func() { r.m.firstByte.Observe(time.Since(l.start).Seconds()) }) }
	chunk := max(1, r.cfg.MaxDescsPerXfer/len(r.regions))
	for first := 0; first < len(remote); first += chunk {
		last := min(len(remote), first+chunk)
		var loc []transfer.Desc
		for _, lr := range r.regions {
			for _, b := range l.dst[first:last] {
				ld := transfer.Desc{Addr: lr.Base + lr.BlockOffset(b) + s.LocalOffset, Len: s.Len, DevID: uint32(lr.DevID)}
				if n := len(loc); n > 0 && loc[n-1].Addr+loc[n-1].Len == ld.Addr && loc[n-1].DevID == ld.DevID {
					loc[n-1].Len += s.Len
					continue
				}
				loc = append(loc, ld)
			}
		}
		x := &transfer.Xfer{Op: transfer.OpRead, Peer: t.Addr, RequestID: l.params.GetRemoteRequestId(),
			ExportID: e.GetExportId(), Capability: e.GetCapability(), Local: loc, Expect: expect, OnRedial: onRedial, OnFirstByte: firstByte,
			ConsumerEngineID: r.cfg.EngineID, ConsumerTPRank: uint32(r.cfg.TPRank), SameHost: sh,
			RemoteBlocks: &transfer.BlockDescs{NumRegions: uint32(len(r.regions)), Offset: s.RemoteOffset, Len: s.Len, BlockIDs: remote[first:last]}}
		if v != nil && v.every == 1 && r.crcInOrder {
			// Every block is folded as it lands; a sample (the same-host
			// path) is cheaper read again afterwards than hooked, which
			// would cut the copy into cache-sized runs.
			x.OnLanded = v.onLanded(first, last-first)
		}
		res, err := r.agent.Transfer(ctx, x)
		if err != nil {
			return err
		}
		r.m.bytesRead.Add(float64(res.Bytes))
	}
	return nil
}

// notifyAll tells every source of l this rank reached that it is done with
// the request. Failures are logged; only a load that read nothing (a full
// prefix hit) returns the first one, as the sign its params are stale. A
// source whose handshake failed is not contacted again: its lease expires
// on its own.
func (r *Rank) notifyAll(l *load) error {
	ctx, cancel := context.WithTimeout(r.ctx, notifyTimeout)
	defer cancel()
	errs := make([]error, len(l.addrs))
	var wg sync.WaitGroup
	for i, addr := range l.addrs {
		if i >= len(l.reached) || !l.reached[i] {
			continue
		}
		wg.Go(func() { errs[i] = r.agent.Notify(ctx, addr, r.notification(l, i)) })
	}
	wg.Wait()
	var failed []error
	for i, err := range errs {
		if err == nil {
			continue
		}
		r.cfg.Logger.Warn("notification failed", "request_id", l.id, "peer", l.addrs[i], "err", err)
		again := ""
		if retryableNotify(err) {
			// A prefill stopped or cut off for a while: its lease would
			// run its whole TTL. Try again in the background until it
			// would end anyway.
			r.wg.Go(func() { r.retryNotify(l, i) })
			again = " (sent again in the background until the lease would end)"
		}
		// After READs that completed, a refused or lost notification fails
		// nothing: every byte was served under the export's lease, pinned
		// from the check before the first byte to the last, so none can be
		// stale; the prefill frees its blocks at lease expiry (or is gone).
		if len(l.dst) == 0 {
			failed = append(failed, fmt.Errorf("prefill rank %d%s: %w", l.plan.Sources[i].PrefillRank, again, err))
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("connector: load %q (full prefix hit): %w", l.id, errors.Join(failed...))
	}
	return nil
}

// refusedHandshake reports whether a source's handshake error is its
// answer (wrong engine, layout, incarnation...): a source that refused the
// handshake would refuse the notification too, and is not sent one; so is
// one that refused the connection (CODE_UNAVAILABLE: a TLS alert, a closed
// port). A handshake that went unanswered instead (the load aborted first,
// CODE_ABORTED; or a timeout, the dial's or QUIC's idle one included: the
// source stopped, say) may have left the source holding the export's lease,
// so it is notified, and again while the notification is lost
// (retryNotify).
func refusedHandshake(err error) bool {
	switch codes.Of(err) {
	case v1.Code_CODE_OK, v1.Code_CODE_ABORTED, v1.Code_CODE_TIMEOUT:
		return false
	}
	var ne net.Error
	return !errors.As(err, &ne) || !ne.Timeout()
}

// notifyTimeout bounds the notifications at the end of a load.
const notifyTimeout = 10 * time.Second

// notifyRetryMax is the longest wait between two attempts of a lost
// notification; the first retry comes after a second, each wait doubles.
const notifyRetryMax = 30 * time.Second

// retryableNotify reports whether a notification's failure means it was
// lost (no answer in time, the peer unreachable or gone) rather than
// refused: a refusal is answered and never retried.
func retryableNotify(err error) bool {
	switch codes.Of(err) {
	case v1.Code_CODE_TIMEOUT, v1.Code_CODE_UNAVAILABLE:
		return true
	}
	return false
}

// notification is the one l sends source i.
func (r *Rank) notification(l *load, i int) *v1.Notification {
	e := l.exports[i]
	return &v1.Notification{RequestId: l.params.GetRemoteRequestId(), ExportId: e.GetExportId(), Capability: e.GetCapability(),
		ConsumerEngineId: r.cfg.EngineID, ConsumerTpRank: uint32(r.cfg.TPRank), ConsumerCount: uint32(l.plan.Consumers)}
}

// retryNotify sends source i's lost notification of l again, waiting 1 s,
// 2 s, ... up to notifyRetryMax between attempts, until it is delivered or
// refused, the source's lease would have ended (lease_expires_unix_ms of
// the params; LeaseTTL from now when they carry none), or the rank closes.
func (r *Rank) retryNotify(l *load, i int) {
	end := time.Now().Add(r.cfg.LeaseTTL)
	if ms := l.params.GetLeaseExpiresUnixMs(); ms > 0 {
		end = time.UnixMilli(ms)
	}
	wait := time.Second
	for attempt := 1; ; attempt++ {
		if time.Now().Add(wait).After(end) {
			r.cfg.Logger.Warn("gave up on a lost notification: the lease ends before the next attempt", "request_id", l.id, "peer", l.addrs[i], "attempts", attempt)
			return
		}
		t := time.NewTimer(wait)
		select {
		case <-r.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(r.ctx, notifyTimeout)
		err := r.agent.Notify(ctx, l.addrs[i], r.notification(l, i))
		cancel()
		switch {
		case err == nil:
			r.cfg.Logger.Info("a lost notification was delivered", "request_id", l.id, "peer", l.addrs[i], "retries", attempt)
			return
		case !retryableNotify(err) || r.ctx.Err() != nil:
			r.cfg.Logger.Warn("a lost notification was refused when sent again", "request_id", l.id, "peer", l.addrs[i], "err", err)
			return
		}
		wait = min(2*wait, notifyRetryMax)
	}
}

// heartbeatLoop extends the prefill leases of every load in flight, one
// Heartbeat per source address every HeartbeatInterval.
func (r *Rank) heartbeatLoop() {
	t := time.NewTicker(r.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-r.ctx.Done():
			return
		case <-t.C:
		}
		byAddr := map[string]*v1.Heartbeat{}
		r.mu.Lock()
		for _, l := range r.loads {
			for i, a := range l.addrs {
				e := l.exports[i]
				if e == nil {
					continue
				}
				hb := byAddr[a]
				if hb == nil {
					hb = &v1.Heartbeat{ConsumerEngineId: r.cfg.EngineID, ConsumerTpRank: uint32(r.cfg.TPRank)}
					byAddr[a] = hb
				}
				hb.RequestIds = append(hb.RequestIds, l.params.GetRemoteRequestId())
				hb.ExportIds = append(hb.ExportIds, e.GetExportId())
				hb.Capabilities = append(hb.Capabilities, e.GetCapability())
			}
		}
		r.mu.Unlock()
		var wg sync.WaitGroup
		for addr, hb := range byAddr {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(r.ctx, r.cfg.HeartbeatInterval)
				defer cancel()
				if _, err := r.agent.Heartbeat(ctx, addr, hb); err != nil {
					r.cfg.Logger.Debug("heartbeat failed", "peer", addr, "requests", len(hb.GetRequestIds()), "err", err)
				}
			})
		}
		wg.Wait()
	}
}

// blockUse says why a block in Rank.busy must not be freed or reused.
type blockUse struct {
	kind    int // useLoading
	request string
}

// useLoading: the block is the destination of a load in flight.
const useLoading = 1

// busyLocked fails when a block of ids is the destination of a load in
// flight or, unless leasedOK, held under a prefill lease; r.mu is held.
// Frees run under r.mu, so no block is seen half freed.
func (r *Rank) busyLocked(field string, ids []int, leasedOK bool) error {
	for i, b := range ids {
		u, ok := r.busy[b]
		switch {
		case ok:
			return fmt.Errorf("%w: %s[%d]=%d is being loaded by request %q; abort it first", ErrBusy, field, i, b, u.request)
		case !leasedOK && r.refs[b] > 0:
			return fmt.Errorf("%w: %s[%d]=%d is held for decode under %d lease(s) until their consumers notify or the leases expire", ErrBusy, field, i, b, r.refs[b])
		}
	}
	return nil
}

// FreeBlocks frees local blocks in the pool (the local API's free call).
// A block a load in flight is writing into, or one held under a prefill
// lease (RequestFinished took it over), is refused with ErrBusy naming the
// request: freeing it could unmap a page under a READ, or hand a leased
// block to another request while decode still reads it. Other errors are
// the pool's (double free, out of range).
func (r *Rank) FreeBlocks(ctx context.Context, ids []int) error {
	// The check and the free are one step: a block freed here cannot be
	// taken by a RequestFinished or StartLoad in between, nor be seen as
	// "being freed" after the pool handed it out again.
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.busyLocked("block_ids", ids, false); err != nil {
		return err
	}
	return r.pool.Free(ctx, ids)
}

// FreeSessionBlocks frees the blocks an engine session left allocated when
// it ended (the local API's detach), whatever the ownership: those no lease
// holds at once, all or nothing, and those held under a prefill lease when
// their last lease ends (under local ownership the Rank frees those anyway;
// under coordinated ownership the engine would have freed them after
// done_sending, but it is gone, so rank 0 frees them and tells the
// followers). It returns the blocks freed now and those left to their
// leases. Errors, with nothing freed now (the leased blocks are still
// taken over): a block a load still writes into (ErrBusy), the pool's
// (double free, out of range).
func (r *Rank) FreeSessionBlocks(ctx context.Context, ids []int) (freed, leased []int, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var now []int
	for _, b := range ids {
		if r.refs[b] > 0 {
			r.orphans[b] = struct{}{}
			leased = append(leased, b)
			continue
		}
		now = append(now, b)
	}
	if len(now) == 0 {
		return nil, leased, nil
	}
	if err := r.busyLocked("block_ids", now, false); err != nil {
		return nil, leased, err
	}
	if err := r.pool.Free(ctx, now); err != nil {
		return nil, leased, err
	}
	return now, leased, nil
}
