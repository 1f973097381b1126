package connector_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
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
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o700))
	ul := &unmapLog{}
	c1 := buildConfig(t, 1, 2, v1.Ownership_OWNERSHIP_COORDINATED, dir)
	// A long group deadline: the free waits for the READ, not for a timer.
	c1.Group.PeerTimeout = tpgroup.MaxPeerTimeout
	c1.Track = func(next vmm.PageHook) vmm.PageHook { ul.PagePool = next; return ul }
	follower, err := connector.BuildRank(t.Context(), c1)
	require.NoError(t, err)
	defer func() { require.NoError(t, follower.Close()) }()
	ul.serving = func() int { return follower.Rank.Stats().ReadsServing }
	c0 := buildConfig(t, 0, 2, v1.Ownership_OWNERSHIP_COORDINATED, dir)
	c0.PreallocPages = -1 // a freed page unmaps at once
	c0.Group.PeerTimeout = tpgroup.MaxPeerTimeout
	lead, err := connector.BuildRank(t.Context(), c0)
	require.NoError(t, err)
	defer func() { require.NoError(t, lead.Close()) }()

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

	freed := make(chan error, 1)
	go func() { freed <- lead.Pool.Free(context.Background(), ids) }()
	// Rank 1 has ended its export: the free reached it.
	// wallclock: a real unix socket between the ranks; a generous scaled bound so a lost message fails instead of hanging.
	deadline := time.Now().Add(testutil.Scaled(30 * time.Second))
	for follower.Rank.Stats().LeasesHeld != 0 {
		require.True(t, time.Now().Before(deadline), "rank 1 never heard of rank 0's free")
		time.Sleep(time.Millisecond) // wallclock: polling the follower's state, see above
	}
	select {
	case err := <-freed:
		t.Fatalf("rank 0 freed the blocks while rank 1 served them: %v", err)
	default:
	}
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
