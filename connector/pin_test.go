package connector_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/tpgroup"
)

// gateMemory is a reader's memory that is not host-addressable, so the
// agent copies every chunk in through CopyIn, and whose first CopyIn
// waits for open: the READ stalls there, its stream's window fills, and
// the serving rank stays in the middle of it.
type gateMemory struct {
	buf     []byte
	entered chan struct{} // closed by the first CopyIn
	open    chan struct{} // CopyIn waits for it
	once    sync.Once
}

func (m *gateMemory) HostBytes(uint64, uint64) ([]byte, error) {
	return nil, errors.New("gateMemory: not host memory")
}
func (m *gateMemory) CopyOut(off uint64, dst []byte) error { copy(dst, m.buf[off:]); return nil }
func (m *gateMemory) CopyIn(off uint64, src []byte) error {
	m.once.Do(func() { close(m.entered) })
	<-m.open
	copy(m.buf[off:], src)
	return nil
}

// unmapLog records the pages a follower's group unmapped, and whether the
// follower still served a READ when the unmap returned.
type unmapLog struct {
	tpgroup.PagePool
	serving func() int
	mu      sync.Mutex
	early   []int // pages unmapped while a READ was served
	late    []int
}

func (u *unmapLog) UnmapPages(ctx context.Context, pages []int) error {
	err := u.PagePool.UnmapPages(ctx, pages)
	u.mu.Lock()
	if u.serving() == 0 {
		u.late = append(u.late, pages...)
	} else {
		u.early = append(u.early, pages...)
	}
	u.mu.Unlock()
	return err
}

// coordinatedPair builds rank 0 and rank 1 of a coordinated TP group of 2,
// closed when the test ends. The group's deadline is far beyond the test,
// so a free waits for the transfers, not for a timer; rank 0 keeps no
// reserve, so a freed page unmaps at once. track wraps rank 1's page hook
// (what its group maps and unmaps); pc, when set, is rank 1's QUIC socket.
func coordinatedPair(t *testing.T, track func(vmm.PageHook) vmm.PageHook, pc net.PacketConn) (lead, follower *connector.Built) {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o700))
	c1 := buildConfig(t, 1, 2, v1.Ownership_OWNERSHIP_COORDINATED, dir)
	c1.Group.PeerTimeout = tpgroup.MaxPeerTimeout
	c1.Rank.Transfer.PacketConn = pc
	c1.Track = track
	follower, err := connector.BuildRank(t.Context(), c1)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, follower.Close()) })
	c0 := buildConfig(t, 0, 2, v1.Ownership_OWNERSHIP_COORDINATED, dir)
	c0.PreallocPages = -1
	c0.Group.PeerTimeout = tpgroup.MaxPeerTimeout
	lead, err = connector.BuildRank(t.Context(), c0)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, lead.Close()) })
	return lead, follower
}

// freeHeardByFollower starts rank 0's free of blocks in the background and
// returns once follower heard of it (it ended its export of them, the
// only one it holds), requiring that the free has not returned: the
// follower still uses blocks among them. The free's result comes on the
// channel.
func freeHeardByFollower(t testing.TB, lead, follower *connector.Built, blocks []int) <-chan error {
	t.Helper()
	require.Equal(t, 1, follower.Rank.Stats().LeasesHeld, "the follower's export")
	freed := make(chan error, 1)
	go func() { freed <- lead.Pool.Free(context.Background(), blocks) }()
	// wallclock: a real unix socket between the ranks; a generous scaled bound so a lost message fails instead of hanging.
	deadline := time.Now().Add(testutil.Scaled(30 * time.Second))
	for follower.Rank.Stats().LeasesHeld != 0 {
		require.True(t, time.Now().Before(deadline), "rank 1 never heard of rank 0's free")
		time.Sleep(time.Millisecond) // wallclock: polling the follower's state, see above
	}
	select {
	case err := <-freed:
		t.Fatalf("rank 0 freed the blocks while rank 1 used them: %v", err)
	default:
	}
	return freed
}

// TestCoordinatedFreeWaitsForAFollowerRead: under coordinated ownership the
// engine frees, through rank 0, blocks that rank 1 is still serving a READ
// of (its export of them is live). Rank 0's free waits for the READ: rank 1
// ends its export at once (no later READ is served from the blocks) but
// keeps the pages mapped until the READ stopped, the READ completes
// byte-exact, and only then does rank 0 free the blocks and the pages
// unmap on rank 1. Rank 0 then allocates the blocks again: the old export
// is refused, naming why.
//
// fault-matrix: coordinated-free-under-read
func TestCoordinatedFreeWaitsForAFollowerRead(t *testing.T) {
	ul := &unmapLog{}
	lead, follower := coordinatedPair(t, func(next vmm.PageHook) vmm.PageHook { ul.PagePool = next; return ul }, nil)
	ul.serving = func() int { return follower.Rank.Stats().ReadsServing }

	// Rank 0 allocates two pages of blocks for everyone; the engine writes
	// rank 1's heads and finishes the request on rank 1.
	perPage := lead.Pool.Stats().BlocksPerPage
	ids, err := lead.Pool.Alloc(t.Context(), 2*perPage)
	require.NoError(t, err)
	regions := follower.Pool.Regions()
	var want []byte
	for ri, reg := range regions {
		for k, b := range ids {
			buf, err := follower.Pool.HostBytes(reg.Index, reg.BlockOffset(b), reg.BlockLen)
			require.NoError(t, err)
			for i := range buf {
				buf[i] = byte(ri*31 + k*7 + i)
			}
			want = append(want, buf...)
		}
	}
	wire := make([]uint32, len(ids))
	for i, b := range ids {
		wire[i] = uint32(b)
	}
	p, err := follower.Rank.RequestFinished(t.Context(), "req", wire, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	e := connector.ExportOf(p, 1)

	// A reader whose receive window is far below the READ's bytes stalls it.
	mem := &gateMemory{buf: make([]byte, len(want)), entered: make(chan struct{}), open: make(chan struct{})}
	cli, err := testCA.ClientConfig()
	require.NoError(t, err)
	reader, err := transfer.New(&transfer.Config{ClientTLS: cli, MaxStreamWindow: 64 << 10, MaxConnWindow: 64 << 10,
		Regions: []transfer.Region{{Base: 1 << 40, Len: uint64(len(want)), Mem: mem}}})
	require.NoError(t, err)
	defer reader.Close()
	read := func() error {
		_, err := reader.Transfer(t.Context(), &transfer.Xfer{Op: transfer.OpRead, Peer: follower.Rank.Addr(), RequestID: "req",
			ExportID: e.GetExportId(), Capability: e.GetCapability(), Local: []transfer.Desc{{Addr: 1 << 40, Len: uint64(len(want))}},
			RemoteBlocks: &transfer.BlockDescs{NumRegions: uint32(len(regions)), Len: regions[0].BlockLen, BlockIDs: wire}})
		return err
	}
	readErr := make(chan error, 1)
	go func() { readErr <- read() }()
	<-mem.entered // rank 1 is serving the READ, and its window is full

	freed := freeHeardByFollower(t, lead, follower, ids)
	require.Equal(t, 1, follower.Rank.Stats().ReadsServing, "the READ still runs")

	close(mem.open)
	require.NoError(t, <-readErr)
	require.True(t, bytes.Equal(want, mem.buf), "the READ landed byte-exact")
	require.NoError(t, <-freed)
	ul.mu.Lock()
	require.Empty(t, ul.early, "no page was unmapped on rank 1 while the READ ran")
	require.Len(t, ul.late, 2, "both pages unmapped once it ended")
	ul.mu.Unlock()

	// Rank 0 hands the blocks out again; the old export reads nothing.
	again, err := lead.Pool.Alloc(t.Context(), 2*perPage)
	require.NoError(t, err)
	require.ElementsMatch(t, ids, again, "the same blocks, reallocated")
	clear(mem.buf)
	err = read()
	require.Equal(t, v1.Code_CODE_LEASE_EXPIRED, codes.Of(err), "%v", err)
	require.ErrorContains(t, err, "rank 0 freed block")
	require.Equal(t, make([]byte, len(want)), mem.buf, "no byte of the reused blocks")
}

// pauseConn stops reading datagrams once it has read after bytes, until
// resume: a rank stalled in the middle of a transfer, which its peer sees as
// a stream whose window stays full.
type pauseConn struct {
	net.PacketConn
	after      int64
	read       atomic.Int64
	paused     chan struct{} // closed when it stops reading
	resumeCh   chan struct{}
	pauseOnce  sync.Once
	resumeOnce sync.Once
}

func newPauseConn(pc net.PacketConn, after int64) *pauseConn {
	return &pauseConn{PacketConn: pc, after: after, paused: make(chan struct{}), resumeCh: make(chan struct{})}
}

func (c *pauseConn) ReadFrom(b []byte) (int, net.Addr, error) {
	if c.read.Load() >= c.after {
		c.pauseOnce.Do(func() { close(c.paused) })
		<-c.resumeCh
	}
	n, addr, err := c.PacketConn.ReadFrom(b)
	c.read.Add(int64(n))
	return n, addr, err
}

// resume lets the conn read again; more calls do nothing.
func (c *pauseConn) resume() { c.resumeOnce.Do(func() { close(c.resumeCh) }) }

// newFollower builds, for a test under synctest on o's network, rank 1 of
// a coordinated TP group of 2 without the group itself: its pool maps only
// what it is told (pages, as rank 0 would through the group), and rank 0's
// free reaches it through connector.FollowerFree. Its transfers' progress
// deadline is far beyond the group's, so only the free aborts them.
func newFollower(t testing.TB, o instOpts, engine string, pc net.PacketConn, pages ...int) (*connector.Rank, *vmm.Pool) {
	t.Helper()
	srv, err := o.ca.ServerConfig()
	require.NoError(t, err)
	cli, err := o.ca.ClientConfig()
	require.NoError(t, err)
	layout, err := vmm.LayoutFor(gqa8, 1, 2)
	require.NoError(t, err)
	pool, err := vmm.NewPool(t.Context(), &vmm.Config{Layout: layout, NumBlocks: 1024, PreallocPages: -1})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pool.Close()) })
	require.NoError(t, pool.MapPages(t.Context(), pages))
	rank, err := connector.NewRank(t.Context(), &connector.Config{EngineID: engine, TPRank: 1, TPSize: 2, Geometry: gqa8, Pool: pool,
		Ownership: v1.Ownership_OWNERSHIP_COORDINATED,
		Transfer:  &transfer.Config{PacketConn: pc, ServerTLS: srv, ClientTLS: cli, ProgressTimeout: time.Minute},
		// Rank 0's address: nothing listens there, and nothing is sent there.
		RankAddrs:        []string{"10.99.0.1:9", pc.LocalAddr().String()},
		CapabilitySecret: []byte("0123456789abcdef-" + engine)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = rank.Close() })
	return rank, pool
}

// pageBlocks returns n block ids of page pg of p, as wire ids.
func pageBlocks(p *vmm.Pool, pg, n int) []uint32 {
	per := p.Stats().BlocksPerPage
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(pg*per + i)
	}
	return ids
}

// The group's deadline for one free in the tests below: a transfer still
// pinning the blocks is aborted at half of it.
const groupDeadline = 4 * time.Second

// startPausedLoad starts rank's load of params into local and returns once
// pause, the socket of one side of the READ, stopped reading midway (under
// synctest, once everything else in the bubble waits too).
func startPausedLoad(t testing.TB, rank *connector.Rank, local []uint32, params *v1.KVTransferParams, pause *pauseConn, inBubble bool) {
	t.Helper()
	require.NoError(t, rank.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "req", LocalBlockIds: local, Params: params,
		RemoteHitBlocks: new(uint32(0))}))
	<-pause.paused
	if inBubble {
		synctest.Wait()
	}
}

// requireFreeEndsAtHalf runs rank 0's free of blocks on follower r, as its
// group would: the free waits while the transfer pinning them runs
// (running() stays 1), then completes at exactly half the group's
// deadline, when the transfer's abort unpinned the blocks.
func requireFreeEndsAtHalf(t testing.TB, r *connector.Rank, blocks []uint32, running func() int, what string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), groupDeadline)
	defer cancel()
	start := time.Now()
	freed := make(chan error, 1)
	go func() { freed <- connector.FollowerFree(ctx, r, kvgeom.Ints(blocks)) }()
	time.Sleep(groupDeadline/2 - time.Millisecond)
	synctest.Wait()
	require.Empty(t, freed, "the free waits for the %s", what)
	require.Equal(t, 1, running(), "the %s still runs", what)
	require.Zero(t, r.Stats().LeasesHeld, "no export holds the blocks")
	require.NoError(t, <-freed)
	require.Equal(t, groupDeadline/2, time.Since(start), "the %s was aborted at half the group's deadline, and that ended the wait", what)
}

// requireLoadAborted waits for rank's load "req" and requires it failed
// with CODE_ABORTED, every local block to recompute, never done.
func requireLoadAborted(t testing.TB, rank *connector.Rank, local []int) *connector.FailedLoad {
	t.Helper()
	done, failed := waitLoad(t, rank, "req")
	require.False(t, done, "a transfer aborted by rank 0's free was reported done")
	require.Equal(t, v1.Code_CODE_ABORTED, codes.Of(failed.Err), "%v", failed.Err)
	require.Equal(t, local, failed.BlockIDs, "every local block to recompute")
	return failed
}

// TestCoordinatedFollowerReadAbortedAtHalfTheFreeDeadline: under
// coordinated ownership rank 0 frees blocks that rank 1 serves a READ of,
// and the READ does not end: its reader stopped reading. Rank 1 ends its
// export at once and waits for the READ; at half the group's deadline it
// resets the READ's stream (CODE_ABORTED), which unpins the blocks, so the
// free completes at exactly that moment and not at the deadline. The
// decode reading the blocks reports the request failed with CODE_ABORTED
// and every local block to recompute, never done.
//
// fault-matrix: coordinated-free-under-read
func TestCoordinatedFollowerReadAbortedAtHalfTheFreeDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		o := simOpts(t, time.Millisecond)
		follower, fpool := newFollower(t, o, "prefill", o.sim.Listen(t, "127.0.0.1:0"), 1)
		var pause *pauseConn
		o.engine, o.tp, o.geom, o.numBlocks = "decode", 2, gqa8, 512
		o.tap = func(r int, pc net.PacketConn) net.PacketConn {
			if r != 1 {
				return pc
			}
			pause = newPauseConn(pc, 256<<10)
			return pause
		}
		dec := newInstance(t, o)
		defer pause.resume() // before the ranks close

		// The engine wrote rank 1's heads into 128 blocks (4 MiB to read) of
		// page 1, which rank 0 allocated, and finished the request.
		const n = 128
		ids := pageBlocks(fpool, 1, n)
		for _, reg := range fpool.Regions() {
			for k, b := range ids {
				buf, err := fpool.HostBytes(reg.Index, reg.BlockOffset(int(b)), reg.BlockLen)
				require.NoError(t, err)
				kvgen.FillBlock(buf, dec.shape(t, 1), 8, reg.Index, k*16)
			}
		}
		p, err := follower.RequestFinished(t.Context(), "req", ids, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.NoError(t, err)
		params := roundTrip(t, p)

		// Decode rank 1 reads from prefill rank 1, and stops reading midway.
		local, err := dec.pools[1].Alloc(t.Context(), n)
		require.NoError(t, err)
		startPausedLoad(t, dec.ranks[1], kvgeom.Wire(local), params, pause, true)
		serving := func() int { return follower.Stats().ReadsServing }
		require.Equal(t, 1, serving(), "rank 1 is in the middle of the READ")
		requireFreeEndsAtHalf(t, follower, ids, serving, "READ")
		require.Zero(t, serving())

		pause.resume()
		requireLoadAborted(t, dec.ranks[1], local)
	})
}

// TestCoordinatedFollowerLoadAbortedAtHalfTheFreeDeadline: under
// coordinated ownership rank 0 frees blocks that rank 1 is loading into,
// and the load does not end: rank 1 stopped reading its socket. At half the
// group's deadline rank 1 aborts the load, which unpins the blocks, so the
// free completes at exactly that moment; the load is reported failed with
// CODE_ABORTED naming why, every local block to recompute, never done.
//
// fault-matrix: coordinated-free-under-read
func TestCoordinatedFollowerLoadAbortedAtHalfTheFreeDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		o := simOpts(t, time.Millisecond)
		pause := newPauseConn(o.sim.Listen(t, "127.0.0.1:0"), 256<<10)
		defer pause.resume() // before the ranks close
		follower, fpool := newFollower(t, o, "decode", pause, 1)
		o.engine, o.tp, o.geom, o.numBlocks = "prefill", 2, gqa8, 512
		pre := newInstance(t, o)
		const n = 128 // 4 MiB for rank 1 to read
		blocks := pre.alloc(t, n)
		pre.fill(t, 8, blocks)
		params := pre.finish(t, "req", blocks)

		local := pageBlocks(fpool, 1, n) // allocated by rank 0
		startPausedLoad(t, follower, local, params, pause, true)
		loading := func() int { return follower.Stats().LoadsInFlight }
		require.Equal(t, 1, loading(), "rank 1 is in the middle of the load")
		requireFreeEndsAtHalf(t, follower, local, loading, "load")

		failed := requireLoadAborted(t, follower, kvgeom.Ints(local))
		require.ErrorContains(t, failed.Err, `rank 0 frees local blocks of request "req" while rank 1 loads into them`)
	})
}

// unmapSnap copies, when a follower's group is about to unmap pages, the
// bytes that blocks of interest on those pages hold: what the load had
// written into them when they went.
type unmapSnap struct {
	tpgroup.PagePool
	pool   *vmm.Pool // the follower's, set once built
	blocks []int
	mu     sync.Mutex
	pages  []int
	held   map[int][][]byte // block -> its bytes in each region at the unmap
}

func (u *unmapSnap) UnmapPages(ctx context.Context, pages []int) error {
	u.mu.Lock()
	per := u.pool.Stats().BlocksPerPage
	for _, b := range u.blocks {
		if !slices.Contains(pages, b/per) {
			continue
		}
		for _, reg := range u.pool.Regions() {
			buf, err := u.pool.HostBytes(reg.Index, reg.BlockOffset(b), reg.BlockLen)
			if err == nil {
				u.held[b] = append(u.held[b], slices.Clone(buf))
			}
		}
	}
	u.pages = append(u.pages, pages...)
	u.mu.Unlock()
	return u.PagePool.UnmapPages(ctx, pages)
}

// TestCoordinatedFreeWaitsForAFollowerLoad: under coordinated ownership the
// engine frees, through rank 0, blocks that rank 1 is still loading into
// (a decode's READ, stalled midway), together with a block of an export of
// rank 1. Rank 0's free waits for the load: rank 1 ends the export at once,
// but keeps the pages mapped while the load runs; the load completes and
// is reported done, every byte of it in place when rank 1 is told to unmap
// the pages, and only then does rank 0's free return. Rank 0 allocates the
// blocks again: rank 1's pages come back fresh, nothing of the old load in
// them.
//
// fault-matrix: coordinated-free-under-read
func TestCoordinatedFreeWaitsForAFollowerLoad(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 2, geom: gqa8, numBlocks: 1024})
	udp, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	pause := newPauseConn(udp, 256<<10)
	snap := &unmapSnap{held: map[int][][]byte{}}
	lead, follower := coordinatedPair(t, func(next vmm.PageHook) vmm.PageHook { snap.PagePool = next; return snap }, pause)
	t.Cleanup(pause.resume) // before rank 1 closes its socket
	snap.pool = follower.Pool

	// Rank 0 allocates for everyone: the rest of page 0, then page 1 for
	// the load, then a block of page 2 that rank 1 exports.
	perPage := lead.Pool.Stats().BlocksPerPage
	_, err = lead.Pool.Alloc(t.Context(), perPage-1)
	require.NoError(t, err)
	ids, err := lead.Pool.Alloc(t.Context(), perPage)
	require.NoError(t, err)
	exported, err := lead.Pool.Alloc(t.Context(), 1)
	require.NoError(t, err)
	_, err = follower.Rank.RequestFinished(t.Context(), "exported", kvgeom.Wire(exported), v1.FinishStatus_FINISH_STATUS_LENGTH,
		&v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	snap.blocks = ids

	const key = 11
	blocks := pre.alloc(t, perPage)
	pre.fill(t, key, blocks)
	params := pre.finish(t, "req", blocks)
	startPausedLoad(t, follower.Rank, kvgeom.Wire(ids), params, pause, false)
	require.Equal(t, 1, follower.Rank.Stats().LoadsInFlight, "rank 1 is in the middle of the load")

	freed := freeHeardByFollower(t, lead, follower, append(slices.Clone(ids), exported...))
	require.Equal(t, 1, follower.Rank.Stats().LoadsInFlight, "the load still runs")
	snap.mu.Lock()
	require.Empty(t, snap.pages, "no page unmapped on rank 1 while the load runs")
	snap.mu.Unlock()

	pause.resume()
	done, failed := waitLoad(t, follower.Rank, "req")
	require.Nil(t, failed)
	require.True(t, done)
	require.NoError(t, <-freed)
	snap.mu.Lock()
	require.ElementsMatch(t, []int{1, 2}, snap.pages, "pages 1 and 2 unmapped on rank 1 once the load ended")
	require.Len(t, snap.held, len(ids))
	s := pre.shape(t, 1)
	for k, b := range ids {
		for ri, buf := range snap.held[b] {
			bad, first := kvgen.CheckBlock(buf, s, key, ri, k*16)
			require.Zero(t, bad, "block %d region %d at the unmap: %d bytes differ, first at %d", b, ri, bad, first)
		}
		require.Len(t, snap.held[b], len(follower.Pool.Regions()))
	}
	snap.mu.Unlock()

	// Rank 0 hands the blocks out again; rank 1's pages are new ones.
	again, err := lead.Pool.Alloc(t.Context(), perPage+1)
	require.NoError(t, err)
	require.ElementsMatch(t, append(slices.Clone(ids), exported...), again, "the same blocks, reallocated")
	for _, reg := range follower.Pool.Regions() {
		for _, b := range ids {
			buf, err := follower.Pool.HostBytes(reg.Index, reg.BlockOffset(b), reg.BlockLen)
			require.NoError(t, err)
			require.Equal(t, make([]byte, len(buf)), buf, "block %d region %d: nothing of the old load", b, reg.Index)
		}
	}
}
