package connector

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// Defaults of Config.
const (
	// DefaultLeaseTTL is how long prefill holds a finished request's blocks
	// for decode. vLLM's NixlConnector frees them after
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s by default (vllm/envs.py); a
	// sidecar that heartbeats can afford a shorter lease.
	DefaultLeaseTTL = 120 * time.Second
	// DefaultLoadTimeout bounds one StartLoad from handshake to notification.
	DefaultLoadTimeout = 120 * time.Second
	// DefaultSameHostVerifyEvery is Config.SameHostVerifyEvery's default:
	// one block in 16, so verifying costs about a sixteenth of a CRC-32C
	// pass over the bytes (see the README's checksum figures: a full pass
	// costs more than half of a same-host READ's time).
	DefaultSameHostVerifyEvery = 16
	// DefaultMaxDescsPerXfer bounds the descriptors of one READ; a larger
	// load is split into several READs.
	DefaultMaxDescsPerXfer = 16384
)

// Errors of the connector. Each maps to a wire code.
var (
	// ErrInvalidArgument: a bad request id, block id or params field.
	ErrInvalidArgument = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "connector: invalid argument")
	// ErrBusy: the request id is already loading.
	ErrBusy = codes.New(v1.Code_CODE_BUSY, "connector: busy")
	// ErrDraining: the rank is shutting down and refuses new requests
	// (CODE_UNAVAILABLE, reason DRAINING: move on to another instance).
	ErrDraining = codes.NewReason(v1.Code_CODE_UNAVAILABLE, codes.ReasonDraining, "connector: draining")
	// ErrAborted: the load was aborted by Abort.
	ErrAborted = codes.New(v1.Code_CODE_ABORTED, "connector: aborted")
)

// Config configures one Rank. NewRank rejects a nil *Config: EngineID,
// TPSize, Geometry, Pool and Transfer have no sensible default.
type Config struct {
	// EngineID names this engine instance (vLLM engine_id). Required.
	EngineID string
	// TPRank is this rank, in [0, TPSize).
	TPRank int
	// TPSize is the engine's TP size, fixed for the life of the Rank.
	// Required (never defaulted to 1).
	TPSize int
	// Geometry is the whole-model KV geometry; the Pool's layout must be
	// the one vmm.LayoutFor derives from it for TPRank/TPSize. Required.
	Geometry *v1.ModelGeometry
	// Pool holds this rank's KV pages. Required; not closed by the Rank.
	Pool *vmm.Pool
	// Transfer configures the rank's QUIC agent (TLS, listen address or
	// packet conn, timeouts, qlog). Its Regions, Authorize, Release,
	// OnNotification, OnHeartbeat, OnHandshake, CheckExpect and OnPeerGone
	// are set by the Rank. Required.
	Transfer *transfer.Config
	// AdvertiseAddr is the host:port peers reach this rank at. Default: the
	// agent's local address.
	AdvertiseAddr string
	// RankAddrs is every rank's advertised address, index tp_rank; it goes
	// into kv_transfer_params as remote_rank_addrs. Default (empty): rank r
	// is at AdvertiseAddr's port - TPRank + r (remote_port + r).
	RankAddrs []string
	// CapabilitySecret is shared by every rank of the engine, so a
	// capability issued by one rank is checked by all (at least 16 bytes).
	// Default: 32 random bytes, which only works when TPSize is 1.
	CapabilitySecret []byte
	// Ownership says who frees a released request's blocks. Default
	// (OWNERSHIP_UNSPECIFIED) and OWNERSHIP_LOCAL: the Rank frees them in
	// Pool (each rank drives its own pool, SGLang). OWNERSHIP_COORDINATED:
	// the engine frees them through rank 0 once every rank reported the
	// request in done_sending (vLLM's scheduler does exactly that).
	Ownership v1.Ownership
	// LeaseTTL is how long blocks are held for decode without a heartbeat.
	// Default DefaultLeaseTTL.
	LeaseTTL time.Duration
	// HeartbeatInterval is how often a decode rank extends the leases of the
	// requests it is loading. Default LeaseTTL / 4.
	HeartbeatInterval time.Duration
	// LoadTimeout bounds one load from StartLoad to its notifications.
	// Default DefaultLoadTimeout.
	LoadTimeout time.Duration
	// MaxDescsPerXfer bounds one READ's descriptors. Default
	// DefaultMaxDescsPerXfer.
	MaxDescsPerXfer int
	// DisableChecksums turns off end-to-end checksums of exports: by
	// default RequestFinished records a CRC-32C per block and KV head of
	// the export in its params (RankExport.block_checksums; a request's
	// kv_transfer_params checksums field overrides it either way), and a
	// decode rank always checks the checksums an export carries before it
	// reports the load done. Default false: checksums on.
	DisableChecksums bool
	// SameHostVerifyEvery is how many blocks a decode rank reading a
	// source on the same-host path verifies the checksums of: one in
	// SameHostVerifyEvery, which ones chosen anew per load. There the
	// copy runs near memory speed and a CRC-32C of every byte would cost
	// more than half the transfer time; over QUIC every block is verified.
	// Default (0) DefaultSameHostVerifyEvery; 1: every block; negative:
	// none. Device memory is not verified on the same-host path.
	SameHostVerifyEvery int
	// HandshakeMode: handshake.ModePiggyback (default) or ModeLegacy.
	HandshakeMode handshake.Mode
	// DeviceID is advertised in the agent metadata. Default 0.
	DeviceID uint32
	// SameHostSocket, when set, is the path of the unix socket on which
	// the rank offers its pages to ranks on the same host
	// (SameHostSocketPath; its directory the user's own, mode 0700), and
	// the rank reads from a source on this host (its metadata says so)
	// through that source's socket instead of QUIC: mapped pages and a
	// memcpy or device copies (transfer's same-host path). Default "":
	// off, every READ goes over QUIC.
	SameHostSocket string
	// Logger: default discards.
	Logger *slog.Logger
	// Registerer for metrics of the connector, handshake and transfer
	// packages. Default none.
	Registerer prometheus.Registerer
}

func (c *Config) withDefaults() (Config, error) {
	if c == nil {
		return Config{}, fmt.Errorf("%w: nil Config", ErrInvalidArgument)
	}
	out := *c
	if out.LeaseTTL == 0 {
		out.LeaseTTL = DefaultLeaseTTL
	}
	if out.HeartbeatInterval == 0 {
		out.HeartbeatInterval = out.LeaseTTL / 4
	}
	if out.LoadTimeout == 0 {
		out.LoadTimeout = DefaultLoadTimeout
	}
	if out.MaxDescsPerXfer == 0 {
		out.MaxDescsPerXfer = DefaultMaxDescsPerXfer
	}
	if out.SameHostVerifyEvery == 0 {
		out.SameHostVerifyEvery = DefaultSameHostVerifyEvery
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	if out.Ownership == v1.Ownership_OWNERSHIP_UNSPECIFIED {
		out.Ownership = v1.Ownership_OWNERSHIP_LOCAL
	}
	bad := func(field, format string, a ...any) (Config, error) {
		return Config{}, fmt.Errorf("%w: Config.%s: %s", ErrInvalidArgument, field, fmt.Sprintf(format, a...))
	}
	switch {
	case out.EngineID == "":
		return bad("EngineID", "required")
	case out.TPSize < 1 || out.TPSize > MaxTPSize:
		return bad("TPSize", "%d must be in [1, %d]", out.TPSize, MaxTPSize)
	case out.TPRank < 0 || out.TPRank >= out.TPSize:
		return bad("TPRank", "%d must be in [0, TPSize=%d)", out.TPRank, out.TPSize)
	case out.Geometry == nil:
		return bad("Geometry", "required")
	case out.Pool == nil:
		return bad("Pool", "required")
	case out.Transfer == nil:
		return bad("Transfer", "required (TLS)")
	case len(out.RankAddrs) != 0 && len(out.RankAddrs) != out.TPSize:
		return bad("RankAddrs", "%d entries, want TPSize=%d", len(out.RankAddrs), out.TPSize)
	case out.CapabilitySecret == nil && out.TPSize > 1:
		return bad("CapabilitySecret", "required when TPSize=%d > 1, shared by every rank", out.TPSize)
	case out.CapabilitySecret != nil && len(out.CapabilitySecret) < 16:
		return bad("CapabilitySecret", "%d bytes, want at least 16", len(out.CapabilitySecret))
	case out.LeaseTTL < 0 || out.HeartbeatInterval <= 0 || out.LoadTimeout < 0:
		return bad("LeaseTTL", "LeaseTTL, HeartbeatInterval and LoadTimeout must be positive")
	case out.Ownership != v1.Ownership_OWNERSHIP_LOCAL && out.Ownership != v1.Ownership_OWNERSHIP_COORDINATED:
		return bad("Ownership", "%v is not an ownership mode", out.Ownership)
	}
	for i, a := range out.RankAddrs {
		if err := checkHostPort(a); err != nil {
			return bad("RankAddrs", "[%d]=%q: %v", i, a, err)
		}
	}
	if out.CapabilitySecret == nil {
		out.CapabilitySecret = make([]byte, 32)
		_, _ = rand.Read(out.CapabilitySecret)
	}
	return out, nil
}

// Rank is the KV connector of one TP rank: the scheduler side (prefill:
// RequestFinished, leases, serving READs) and the worker side (decode:
// StartLoad, GetFinished, Abort) over one transfer.Agent. Safe for
// concurrent use.
type Rank struct {
	cfg         Config
	pool        *vmm.Pool
	regions     []vmm.RegionInfo
	shape       TPShape
	modelHash   []byte
	incarnation uint64
	capKey      *transfer.CapabilityKey
	agent       *transfer.Agent
	hsServer    *handshake.Server
	hs          *handshake.Client
	leases      *leaseTable
	pinned      sync.Map // *transfer.Access -> *lease, READs being served
	m           *metrics
	local       *handshake.Metadata
	crcOrder    []int           // region indices in checksum order (checksumOrder)
	crcInOrder  bool            // the regions are in checksum order: checksums fold as bytes land
	mem         *PoolMemory     // the pool as the agent sees it
	hostID      string          // this host's identity when the same-host path is on
	crcNanos    [2]atomic.Int64 // time spent recording [0] and verifying [1] checksums
	// afterRead, set by tests, runs when a load's READs all succeeded,
	// before its checksums are verified.
	afterRead func(requestID string)

	ctx    context.Context
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup

	mu       sync.Mutex
	loads    map[string]*load
	busy     map[int]blockUse // blocks a load writes into or a free is freeing
	refs     map[int]int      // references to blocks taken over by RequestFinished
	orphans  map[int]struct{} // leased blocks of ended engine sessions: freed when their last lease ends
	items    []finishedItem   // results for GetFinished
	sessions map[uint64]bool  // live engine sessions of the local API
	changed  chan struct{}    // closed and replaced when a finished item is added
	draining bool
	closed   bool
	drained  drainStats // what the lease table saw, once closed
	// drainBlocks are the local blocks of the loads Drain waited for, which
	// WaitCollected waits for the engine to free.
	drainBlocks []int
}

// FailedLoad is a decode request whose KV did not (fully) arrive.
type FailedLoad struct {
	RequestID string
	// BlockIDs are the local block ids whose KV must be recomputed.
	BlockIDs []int
	Err      error
}

// Finished is what GetFinished reports since the previous call.
type Finished struct {
	// DoneSending: prefill request ids whose lease was released (every
	// consumer notified, or the lease expired).
	DoneSending []string
	// DoneRecving: decode request ids whose KV is fully in local pages.
	DoneRecving []string
	// Failed: decode requests whose KV must be recomputed.
	Failed []FailedLoad
}

// NewRank starts the rank's QUIC agent and its background loops.
func NewRank(ctx context.Context, cfg *Config) (*Rank, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	layout, err := vmm.LayoutFor(c.Geometry, c.TPRank, c.TPSize)
	if err != nil {
		return nil, fmt.Errorf("connector: %w", err)
	}
	if pl := c.Pool.Layout(); pl.BlockLen() != layout.BlockLen() || pl.NumRegions() != layout.NumRegions() {
		return nil, fmt.Errorf("%w: Config.Pool: layout %v does not match the geometry's %v for tp_rank %d of %d",
			ErrInvalidArgument, pl, layout, c.TPRank, c.TPSize)
	}
	shape, err := ShapeOf(c.Geometry)
	if err != nil {
		return nil, err
	}
	r := &Rank{cfg: c, pool: c.Pool, regions: c.Pool.Regions(), shape: shape, modelHash: handshake.ModelHash(c.Geometry),
		capKey: transfer.NewCapabilityKeyFromSecret(c.CapabilitySecret), loads: map[string]*load{}, busy: map[int]blockUse{}, refs: map[int]int{}, orphans: map[int]struct{}{}, sessions: map[uint64]bool{}, changed: make(chan struct{})}
	r.mem = NewPoolMemory(c.Pool)
	r.crcOrder = checksumOrder(r.regions)
	r.crcInOrder = slices.IsSorted(r.crcOrder)
	var inc [8]byte
	_, _ = rand.Read(inc[:])
	r.incarnation = binary.LittleEndian.Uint64(inc[:]) | 1
	if r.m, err = newMetrics(c.Registerer); err != nil {
		return nil, err
	}

	tc := *c.Transfer
	tc.Regions = r.mem.Regions()
	tc.Authorize = r.authorize
	tc.Release = r.release
	tc.CapabilityKey = nil
	tc.OnNotification = r.onNotification
	tc.OnHeartbeat = r.onHeartbeat
	tc.OnHandshake = r.onHandshake
	tc.CheckExpect = r.checkExpect
	// The agent dials only for calls made through r.hs, by a load or a
	// heartbeat, all after r.hs is set: a connection is lost after that.
	tc.OnPeerGone = func(addr string, err error) { r.hs.Forget(addr) }
	r.hostID = r.sameHostTransfer(&tc)
	if tc.Registerer == nil {
		tc.Registerer = c.Registerer
	}
	if tc.Logger == nil {
		tc.Logger = c.Logger
	}
	// Everything a served request reaches exists before the agent starts
	// serving: the lease table now, the handshake server and client, which
	// need the agent's address and the agent, below.
	r.leases = newLeaseTable(c.LeaseTTL, c.TPRank, r.leaseReleased)
	r.ctx, r.cancel = context.WithCancelCause(context.WithoutCancel(ctx))
	fail := func(err error) (*Rank, error) {
		r.cancel(err)
		r.leases.close()
		if r.agent != nil {
			_ = r.agent.Close()
		}
		return nil, err
	}
	if r.agent, err = transfer.NewUnstarted(&tc); err != nil {
		return fail(fmt.Errorf("connector: %w", err))
	}
	if r.cfg.AdvertiseAddr == "" {
		r.cfg.AdvertiseAddr = r.agent.Addr().String()
	}
	r.local = &handshake.Metadata{EngineID: c.EngineID, AgentName: c.EngineID + "/tp" + strconv.Itoa(c.TPRank),
		Incarnation: r.incarnation, TPRank: c.TPRank, TPSize: c.TPSize, DeviceID: c.DeviceID, ModelHash: r.modelHash,
		Geometry: c.Geometry, BlockSize: int(c.Geometry.GetBlockSize()), NumBlocks: c.Pool.NumBlocks(),
		HeadsPerRank: layout.HeadsPerRank, Addr: r.cfg.AdvertiseAddr, CapabilityKeyID: r.capKey.ID()}
	if sh := r.agent.SameHost(); sh != nil && r.hostID != "" {
		r.local.SameHost = &handshake.SameHost{HostID: r.hostID, Socket: sh.Socket, Token: sh.Token, PageKind: sh.Kind}
	}
	for _, ri := range r.regions {
		r.local.Regions = append(r.local.Regions, handshake.Region{Base: ri.Base, Len: ri.Len, BlockLen: ri.BlockLen,
			DevID: uint32(ri.DevID), Layer: uint32(ri.Layer), Kind: ri.Kind, PageSize: ri.PageSize})
	}
	if r.hsServer, err = handshake.NewServer(r.local); err != nil {
		return fail(err)
	}
	if r.hs, err = handshake.NewClient(&handshake.Config{Caller: r.agent, Local: r.local, Mode: c.HandshakeMode,
		Logger: c.Logger, Registerer: c.Registerer}); err != nil {
		return fail(err)
	}
	if err := r.agent.Start(); err != nil {
		return fail(fmt.Errorf("connector: %w", err))
	}
	r.wg.Go(r.heartbeatLoop)
	c.Logger.Info("rank started", "engine_id", c.EngineID, "tp_rank", c.TPRank, "tp_size", c.TPSize,
		"addr", r.cfg.AdvertiseAddr, "incarnation", r.incarnation, "regions", len(r.regions), "capability_key_id", r.capKey.ID())
	return r, nil
}

// Addr is the address peers reach this rank at.
func (r *Rank) Addr() string { return r.cfg.AdvertiseAddr }

// Incarnation is random per NewRank; a restarted rank has another.
func (r *Rank) Incarnation() uint64 { return r.incarnation }

// Agent is the rank's QUIC agent (for counters in tests and benchmarks).
func (r *Rank) Agent() *transfer.Agent { return r.agent }

// Handshakes is the rank's handshake client.
func (r *Rank) Handshakes() *handshake.Client { return r.hs }

// Metadata is what this rank tells peers about itself.
func (r *Rank) Metadata() *handshake.Metadata { return r.local }

func (r *Rank) onHandshake(ctx context.Context, req *v1.HandshakeRequest) *v1.HandshakeResponse {
	return r.hsServer.Handle(ctx, req)
}

// checkExpect is the serving side's check of a READ's PeerExpect (a
// decode rank that READs without waiting for the handshake): the
// handshake server's checks, on this rank's metadata; regions maps the
// reader's regions onto this rank's by layer and kind.
func (r *Rank) checkExpect(ctx context.Context, e *v1.PeerExpect) ([]int, error) {
	regions, err := r.hsServer.CheckExpect(ctx, e)
	if err != nil {
		return nil, fmt.Errorf("connector: rank %d of engine %q refused a READ: %w", r.cfg.TPRank, r.cfg.EngineID, err)
	}
	return regions, nil
}

// checkBlocks validates engine block ids against the pool: in
// [1, NumBlocks), no duplicates.
func (r *Rank) checkBlocks(field string, ids []uint32) ([]int, error) {
	out := make([]int, len(ids))
	seen := make(map[uint32]struct{}, len(ids))
	n := r.pool.NumBlocks()
	for i, id := range ids {
		if id == 0 || int(id) >= n {
			return nil, fmt.Errorf("%w: %s[%d]=%d outside [1, %d) (block 0 is the null block)", ErrInvalidArgument, field, i, id, n)
		}
		if _, dup := seen[id]; dup {
			return nil, fmt.Errorf("%w: %s[%d]=%d appears twice", ErrInvalidArgument, field, i, id)
		}
		seen[id] = struct{}{}
		out[i] = int(id)
	}
	return out, nil
}

func (r *Rank) refuseIfDraining() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return fmt.Errorf("connector: rank closed: %w", net.ErrClosed)
	}
	if r.draining {
		return fmt.Errorf("%w: rank %d of %q refuses new requests", ErrDraining, r.cfg.TPRank, r.cfg.EngineID)
	}
	return nil
}

// GetFinished returns, and forgets, what finished since the last call.
func (r *Rank) GetFinished() Finished {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.takeLocked(nil)
}

// WaitFinished blocks until GetFinished has something to report, then
// returns it like GetFinished; or returns context.Cause(ctx).
func (r *Rank) WaitFinished(ctx context.Context) (Finished, error) {
	for {
		r.mu.Lock()
		if len(r.items) > 0 {
			f := r.takeLocked(nil)
			r.mu.Unlock()
			return f, nil
		}
		ch := r.changed
		r.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return Finished{}, context.Cause(ctx)
		}
	}
}

// signalLocked wakes WaitFinished; r.mu is held.
func (r *Rank) signalLocked() {
	close(r.changed)
	r.changed = make(chan struct{})
}

// Stats is a snapshot of the rank's connector state.
type Stats struct {
	LeasesHeld    int
	BlocksHeld    int
	LoadsInFlight int
	// ReadsServing: READs this rank is serving from leased blocks now,
	// each holding its lease's blocks pinned until its stream ends.
	ReadsServing int
	// ChecksumRecordSeconds and ChecksumVerifySeconds are the time this
	// rank spent on end-to-end checksums since it started, in seconds:
	// recording them at RequestFinished (before any transfer), and
	// verifying them before a load is reported done (on its path).
	ChecksumRecordSeconds, ChecksumVerifySeconds float64
}

// Stats returns a snapshot.
func (r *Rank) Stats() Stats {
	l, b, p := r.leases.held()
	r.mu.Lock()
	defer r.mu.Unlock()
	return Stats{LeasesHeld: l, BlocksHeld: b, LoadsInFlight: len(r.loads), ReadsServing: p,
		ChecksumRecordSeconds: time.Duration(r.crcNanos[0].Load()).Seconds(), ChecksumVerifySeconds: time.Duration(r.crcNanos[1].Load()).Seconds()}
}

// Drain refuses new requests and lets what is in flight finish before the
// rank closes, within ctx's deadline:
//
//   - loads of this rank (decode side) finish, or are aborted when ctx ends;
//   - READs this rank serves (prefill side) run to their end, and every
//     lease a consumer started reading waits for the consumer's
//     notification, so a decode whose READ completed has its notification
//     accepted instead of refused by a closed agent;
//   - READs still running when only drainNotifyGrace of the deadline is
//     left are reset with CODE_UNAVAILABLE: their decode fails with a drain
//     error before it reported anything done, and the rest of the deadline
//     is left for the notifications of READs that completed.
//
// It then releases every lease, closes the rank (its agent tells peers it
// is draining) and logs one summary: READs served to the end and aborted,
// leases released by their consumers, and leases dropped with their request
// ids.
func (r *Rank) Drain(ctx context.Context) error {
	start := time.Now()
	r.mu.Lock()
	r.draining = true
	loads := make([]*load, 0, len(r.loads))
	for _, l := range r.loads {
		loads = append(loads, l)
		r.drainBlocks = append(r.drainBlocks, l.blocks...)
	}
	r.mu.Unlock()
	r.leases.resetStats()
	for _, l := range loads {
		select {
		case <-l.done:
		case <-ctx.Done():
			l.cancel(fmt.Errorf("%w: rank shutting down: %w", ErrDraining, context.Cause(ctx)))
			<-l.done
		}
	}
	readCtx, cancel := ctx, context.CancelFunc(func() {})
	if dl, ok := ctx.Deadline(); ok {
		grace := min(time.Until(dl)/4, drainNotifyGrace)
		readCtx, cancel = context.WithDeadline(ctx, dl.Add(-grace))
	}
	err := r.leases.waitDrained(readCtx)
	cancel()
	aborted := 0
	if err != nil && ctx.Err() == nil {
		// READs still running get a clear error now; the notifications of
		// those that completed may still arrive.
		aborted = r.abortServed(fmt.Errorf("%w: prefill rank %d of %q is shutting down and its drain deadline leaves no time to finish this READ",
			ErrDraining, r.cfg.TPRank, r.cfg.EngineID))
		if aborted > 0 {
			r.cfg.Logger.Warn("drain: aborted the READs still running; waiting for notifications until the deadline", "reads", aborted)
		}
		err = r.leases.waitDrained(ctx)
	}
	if err != nil {
		r.cfg.Logger.Warn("drain deadline passed with READs being served or read leases not yet notified; closing", "err", err)
	}
	cerr := r.close(v1.Code_CODE_UNAVAILABLE, fmt.Sprintf("kvsidecar: rank %d of %q is shutting down (drained)", r.cfg.TPRank, r.cfg.EngineID))
	r.mu.Lock()
	st := r.drained
	r.mu.Unlock()
	r.cfg.Logger.Info("drain finished", "seconds", time.Since(start).Seconds(), "loads_finished", len(loads),
		"reads_served", st.readsServed, "reads_aborted", aborted, "leases_notified", st.notified,
		"leases_dropped", len(st.dropped), "dropped_request_ids", st.dropped, "deadline_passed", err != nil)
	return cerr
}

// drainNotifyGrace is the most of a drain deadline kept for notifications
// after the READs still running were aborted (a quarter of it when that is
// less).
const drainNotifyGrace = 2 * time.Second

// Close aborts loads in flight, releases every lease (freeing its blocks
// under local ownership), and closes the agent. A second Close returns an
// error wrapping net.ErrClosed.
func (r *Rank) Close() error { return r.close(v1.Code_CODE_OK, "agent closing") }

// close is Close, telling peers code and reason as the QUIC close reason.
func (r *Rank) close(code v1.Code, reason string) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return fmt.Errorf("connector: rank already closed: %w", net.ErrClosed)
	}
	r.closed = true
	r.mu.Unlock()
	r.cancel(fmt.Errorf("%w: rank closed", ErrDraining))
	r.wg.Wait()
	st := r.leases.close()
	r.mu.Lock()
	r.drained = st
	r.mu.Unlock()
	err := errors.Join(r.hs.Close(), r.agent.CloseWithReason(code, reason))
	return errors.Join(err, r.mem.Close())
}
