//go:build linux

package vmm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

const testPage = 64 << 10

// testLayout: 2 layers × K/V = 4 regions, 2 KiB blocks, 32 blocks a page.
var testLayout = Layout{Layers: 2, BlockSize: 16, HeadsPerRank: 1, HeadDim: 64, DTypeBytes: 2}

// failing wraps a real host backend: it fails the k-th Map (counting from
// 1; 0 = never) and counts what is mapped and created so tests can check
// nothing leaks.
type failing struct {
	*HostBackend
	failAt    atomic.Int64
	maps      atomic.Int64
	mapped    atomic.Int64 // slots mapped now
	live      atomic.Int64 // handles created and not released
	doubleMap atomic.Int64
	// gate, when set before a Map, holds that Map until it is closed.
	gate atomic.Pointer[chan struct{}]
	// failUnmap, when not 0, is an address whose Unmap fails.
	failUnmap atomic.Uint64
}

var errInjected = errors.New("injected map failure")

func newFailing(t testing.TB) *failing {
	t.Helper()
	hb, err := NewHostBackend(&HostConfig{PageSize: testPage})
	require.NoError(t, err)
	t.Cleanup(func() { _ = hb.Close() })
	return &failing{HostBackend: hb}
}

func (f *failing) Create() (Handle, error) {
	h, err := f.HostBackend.Create()
	if err == nil {
		f.live.Add(1)
	}
	return h, err
}

func (f *failing) Release(h Handle) error {
	err := f.HostBackend.Release(h)
	if err == nil {
		f.live.Add(-1)
	}
	return err
}

func (f *failing) Map(addr uint64, h Handle) error {
	if g := f.gate.Load(); g != nil {
		<-*g
	}
	if n := f.maps.Add(1); n == f.failAt.Load() {
		return &BackendError{Op: "mmap", Err: errInjected}
	}
	err := f.HostBackend.Map(addr, h)
	if errors.Is(err, ErrAlreadyMapped) {
		f.doubleMap.Add(1)
	}
	if err == nil {
		f.mapped.Add(1)
	}
	return err
}

var errInjectedUnmap = errors.New("injected unmap failure")

func (f *failing) Unmap(addr uint64) error {
	if addr == f.failUnmap.Load() {
		return &BackendError{Op: "munmap", Err: errInjectedUnmap}
	}
	err := f.HostBackend.Unmap(addr)
	if err == nil {
		f.mapped.Add(-1)
	}
	return err
}

func newTestPool(t testing.TB, cfg Config) *Pool {
	t.Helper()
	if cfg.Layout.Layers == 0 {
		cfg.Layout = testLayout
	}
	if cfg.NumBlocks == 0 {
		cfg.NumBlocks = 32 * 8
	}
	if cfg.Backend == nil {
		cfg.Backend = newFailing(t)
	}
	p, err := NewPool(context.Background(), &cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := p.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			t.Errorf("close pool: %v", err)
		}
	})
	return p
}

// checkInvariants recomputes the pool's counters from its pages.
func checkInvariants(t testing.TB, p *Pool) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	free, used, mapped, committed, unmCap := 0, 0, 0, 0, 0
	for pg, ps := range p.pages {
		switch ps.status {
		case pageMapped:
			mapped++
			committed++
		case pageBusy, pageBroken:
			committed++
		case pageUnmapped:
			unmCap += p.capOf(pg)
			require.Zero(t, ps.used, "unmapped page %d has used blocks", pg)
		}
		if ps.status == pageMapped && !ps.ext {
			free += len(ps.free)
			require.Equal(t, p.capOf(pg), int(ps.used)+len(ps.free), "page %d: used + free != capacity", pg)
		}
		used += int(ps.used)
	}
	require.Equal(t, p.freeMapped, free, "freeMapped")
	require.Equal(t, p.used+1, used, "used (+1 null block)")
	require.Equal(t, p.mappedCnt, mapped, "mappedCnt")
	require.Equal(t, p.committed, committed, "committed")
	require.Equal(t, p.unmappedCap, unmCap, "unmappedCap")
	require.GreaterOrEqual(t, p.availableLocked(), 0)
	n := 0
	for _, u := range p.blockUsed {
		if u {
			n++
		}
	}
	require.Equal(t, p.used+1, n, "blockUsed count")
}

func TestNewPoolRejects(t *testing.T) {
	good := Config{Layout: testLayout, NumBlocks: 64}
	tests := []struct {
		name  string
		cfg   *Config
		field string
	}{
		{"nil config", nil, "Config"},
		{"no blocks", &Config{Layout: testLayout}, "Config.NumBlocks"},
		{"one block", &Config{Layout: testLayout, NumBlocks: 1}, "Config.NumBlocks"},
		{"zero layers", &Config{NumBlocks: 64, Layout: Layout{BlockSize: 16, HeadsPerRank: 1, HeadDim: 64, DTypeBytes: 2}}, "Layout.Layers"},
		{"bad dtype", &Config{NumBlocks: 64, Layout: Layout{Layers: 1, BlockSize: 16, HeadsPerRank: 1, HeadDim: 64, DTypeBytes: 3}}, "Layout.DTypeBytes"},
		{"block over page", &Config{NumBlocks: 64, Layout: Layout{Layers: 1, BlockSize: 4096, HeadsPerRank: 8, HeadDim: 128, DTypeBytes: 2}}, "page size"},
		{"limit below page 0", func() *Config { c := good; c.MemoryLimit = 1; return &c }(), "Config.MemoryLimit"},
		{"negative hook timeout", func() *Config { c := good; c.UnmapHookTimeout = -time.Second; return &c }(), "Config.UnmapHookTimeout"},
		{"hook timeout over max", func() *Config { c := good; c.UnmapHookTimeout = MaxUnmapHookTimeout + 1; return &c }(), "Config.UnmapHookTimeout"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewPool(context.Background(), tc.cfg)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.Contains(t, err.Error(), tc.field)
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err))
		})
	}
}

func TestPoolAllocFreeMapsAndUnmaps(t *testing.T) {
	be := newFailing(t)
	reg := prometheus.NewRegistry()
	p := newTestPool(t, Config{Backend: be, PreallocPages: -1, Registerer: reg})
	ctx := context.Background()
	nr := int64(testLayout.NumRegions())
	st := p.Stats()
	require.Equal(t, 1, st.PagesMapped, "page 0 for the null block")
	require.Equal(t, 32, st.BlocksPerPage)
	require.Equal(t, 255, st.BlocksTotal)
	require.Equal(t, 255, st.Available)
	require.Equal(t, nr, be.mapped.Load())

	ids, err := p.Alloc(ctx, 40) // 31 from page 0, 9 from page 1
	require.NoError(t, err)
	require.Len(t, ids, 40)
	require.NotContains(t, ids, 0, "null block handed out")
	require.Equal(t, 2, p.Stats().PagesMapped)
	require.Equal(t, 2*nr, be.mapped.Load())
	require.Equal(t, 40, p.Stats().BlocksUsed)
	require.NoError(t, promtest.GatherAndCompare(reg, strings.NewReader(`
# HELP kvsidecar_vmm_pages_mapped Page indices mapped in every region (reserve included).
# TYPE kvsidecar_vmm_pages_mapped gauge
kvsidecar_vmm_pages_mapped 2
`), "kvsidecar_vmm_pages_mapped"))
	checkInvariants(t, p)

	// Data written to a block reads back, through HostBytes too.
	off := p.BlockOffset(ids[39])
	require.NoError(t, p.CopyIn(3, off, []byte("kv!")))
	got, err := p.HostBytes(3, off, 3)
	require.NoError(t, err)
	require.Equal(t, "kv!", string(got))

	// Freeing the blocks of page 1 unmaps it (no reserve).
	var page1 []int
	for _, b := range ids {
		if b >= 32 {
			page1 = append(page1, b)
		}
	}
	require.Len(t, page1, 9)
	require.NoError(t, p.Free(ctx, page1))
	require.Equal(t, 1, p.Stats().PagesMapped)
	require.Equal(t, nr, be.mapped.Load())
	_, err = p.HostBytes(3, off, 3)
	require.ErrorIs(t, err, ErrNotMapped, "slice over an unmapped page")
	var pe *PageError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, 1, pe.Page)
	checkInvariants(t, p)
}

func TestPoolFreeErrors(t *testing.T) {
	p := newTestPool(t, Config{NumBlocks: 64})
	ctx := context.Background()
	ids, err := p.Alloc(ctx, 3)
	require.NoError(t, err)
	tests := []struct {
		name string
		ids  []int
		want error
		code v1.Code
		msg  string
	}{
		{"out of range", []int{ids[0], 64}, ErrBlockOutOfRange, v1.Code_CODE_OUT_OF_RANGE, "block 64 out of range [1, 64)"},
		{"negative", []int{-1}, ErrBlockOutOfRange, v1.Code_CODE_OUT_OF_RANGE, "block -1"},
		{"null block", []int{0}, ErrNullBlock, v1.Code_CODE_INVALID_ARGUMENT, "block 0"},
		{"never allocated", []int{ids[0], 50}, ErrDoubleFree, v1.Code_CODE_INVALID_ARGUMENT, "block 50"},
		{"named twice", []int{ids[1], ids[1]}, ErrDoubleFree, v1.Code_CODE_INVALID_ARGUMENT, fmt.Sprintf("block %d", ids[1])},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := p.Free(ctx, tc.ids)
			require.ErrorIs(t, err, tc.want)
			require.Equal(t, tc.code, codes.Of(err))
			require.Contains(t, err.Error(), tc.msg)
			require.Equal(t, 3, p.Stats().BlocksUsed, "a rejected Free freed something")
			checkInvariants(t, p)
		})
	}
	require.NoError(t, p.Free(ctx, ids))
	require.ErrorIs(t, p.Free(ctx, ids[:1]), ErrDoubleFree)
}

func TestPoolCheckAllocated(t *testing.T) {
	// No reserve: with one, the background refill maps a page while Alloc
	// runs, and which page the blocks land in (and which pages are mapped
	// at all) depended on who came first (the last block landed in page 2
	// in 1 of about 40 loaded runs).
	p := newTestPool(t, Config{NumBlocks: 32 * 4, PreallocPages: -1})
	ctx := context.Background()
	held, err := p.Alloc(ctx, 31+2) // page 0's 31 blocks, then 2 of page 1
	require.NoError(t, err)
	last := held[len(held)-1]
	require.Equal(t, 1, last/32, "the last block lives in page 1")
	require.Equal(t, 1, held[len(held)-2]/32, "so does the one before it")
	// Free one of page 1's two blocks: the other keeps page 1 mapped.
	require.NoError(t, p.Free(ctx, held[len(held)-1:]))
	held = held[:len(held)-1]

	tests := []struct {
		name string
		ids  []int
		want error // nil: accepted
		code v1.Code
		msg  string
	}{
		{"all allocated", held, nil, v1.Code_CODE_OK, ""},
		{"empty", nil, nil, v1.Code_CODE_OK, ""},
		{"freed block in a mapped page", []int{held[0], last}, ErrNotAllocated, v1.Code_CODE_INVALID_ARGUMENT, fmt.Sprintf("block %d", last)},
		{"never allocated, unmapped page", []int{100}, ErrNotAllocated, v1.Code_CODE_INVALID_ARGUMENT, "block 100: block not allocated"},
		{"first bad id named", []int{held[1], 90, 0}, ErrNotAllocated, v1.Code_CODE_INVALID_ARGUMENT, "block 90"},
		{"null block", []int{held[0], 0}, ErrNullBlock, v1.Code_CODE_INVALID_ARGUMENT, "block 0"},
		{"out of range", []int{128}, ErrBlockOutOfRange, v1.Code_CODE_OUT_OF_RANGE, "block 128 out of range [1, 128)"},
		{"negative", []int{-3}, ErrBlockOutOfRange, v1.Code_CODE_OUT_OF_RANGE, "block -3"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := p.CheckAllocated(tc.ids)
			require.Equal(t, tc.code, codes.Of(err))
			if tc.want == nil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, tc.want)
			var be *BlockError
			require.ErrorAs(t, err, &be)
			require.Contains(t, err.Error(), tc.msg)
		})
	}
	require.Equal(t, 32, p.Stats().BlocksUsed, "a check changes nothing")
	checkInvariants(t, p)

	// CheckMapped asks only for a mapped page: a freed block of a mapped
	// page passes, one of an unmapped page does not.
	require.NoError(t, p.CheckMapped([]int{held[0], last}))
	err = p.CheckMapped([]int{held[0], 100})
	require.ErrorIs(t, err, ErrNotMapped)
	require.Equal(t, v1.Code_CODE_NOT_FOUND, codes.Of(err))
	require.ErrorContains(t, err, "block 100: page not mapped")
	require.ErrorIs(t, p.CheckMapped([]int{0}), ErrNullBlock)
	require.ErrorIs(t, p.CheckMapped([]int{128}), ErrBlockOutOfRange)
	require.NoError(t, p.Free(ctx, held[:1]))
	require.ErrorIs(t, p.CheckAllocated(held[:2]), ErrNotAllocated, "a freed block")
	require.NoError(t, p.Close())
	require.ErrorIs(t, p.CheckAllocated(held[1:2]), net.ErrClosed)
}

func TestPoolMemoryLimit(t *testing.T) {
	be := newFailing(t)
	pageBytes := uint64(testPage * testLayout.NumRegions())
	p := newTestPool(t, Config{Backend: be, PreallocPages: -1, MemoryLimit: 2 * pageBytes})
	ctx := context.Background()
	require.Equal(t, 63, p.Available(), "two pages minus the null block")
	_, err := p.Alloc(ctx, 64)
	require.ErrorIs(t, err, ErrOverLimit)
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err))
	var le *LimitError
	require.ErrorAs(t, err, &le)
	require.Equal(t, 63, le.Available)

	a, err := p.Alloc(ctx, 40)
	require.NoError(t, err)
	// Lowering below use stops new maps at once...
	_, over := p.AvailableOverLimit()
	require.False(t, over, "two pages mapped under a limit of two")
	require.NoError(t, p.SetMemoryLimit(pageBytes))
	n, over := p.AvailableOverLimit()
	require.Equal(t, 23, n, "only free blocks of mapped pages")
	require.True(t, over, "two pages mapped under a limit of one")
	_, err = p.Alloc(ctx, 24)
	require.ErrorIs(t, err, ErrOverLimit)
	require.Equal(t, 2, p.Stats().PagesMapped)
	// ...and shrinks as blocks are freed.
	var hi []int
	for _, b := range a {
		if b >= 32 {
			hi = append(hi, b)
		}
	}
	require.NoError(t, p.Free(ctx, hi))
	require.Equal(t, 1, p.Stats().PagesMapped)
	n, over = p.AvailableOverLimit()
	require.Equal(t, 31-(40-len(hi)), n)
	require.False(t, over, "back to the limit")
	// Raising re-enables growth.
	require.NoError(t, p.SetMemoryLimit(0))
	b, err := p.Alloc(ctx, 100)
	require.NoError(t, err)
	require.Len(t, b, 100)
	require.ErrorIs(t, p.SetMemoryLimit(10), ErrInvalidConfig)
	checkInvariants(t, p)
}

func TestPoolReserve(t *testing.T) {
	be := newFailing(t)
	p := newTestPool(t, Config{Backend: be, PreallocPages: 2})
	ctx := context.Background()
	p.settle()
	st := p.Stats()
	require.Equal(t, 2, st.ReservePages)
	require.Equal(t, 3, st.PagesMapped)
	// Taking the reserve's blocks refills it in the background.
	ids, err := p.Alloc(ctx, 31+32)
	require.NoError(t, err)
	p.settle()
	st = p.Stats()
	require.Equal(t, 2, st.ReservePages)
	require.Equal(t, 4, st.PagesMapped)
	// Freeing keeps at most PreallocPages empty pages mapped.
	require.NoError(t, p.Free(ctx, ids))
	p.settle()
	st = p.Stats()
	require.Equal(t, 2, st.ReservePages)
	require.Equal(t, 3, st.PagesMapped)
	checkInvariants(t, p)
	// A lower limit trims the reserve at once.
	require.NoError(t, p.SetMemoryLimit(uint64(testPage*testLayout.NumRegions())))
	require.Equal(t, 1, p.Stats().PagesMapped)
	require.Equal(t, int64(testLayout.NumRegions()), be.mapped.Load())
}

// refillHeld returns a pool (PreallocPages 1) whose page 0 and reserve
// page are allocated (the blocks returned) and whose refill is held while
// it maps the next page; release lets that map go on. Call inside a
// synctest bubble.
func refillHeld(t *testing.T) (p *Pool, got []int, release func()) {
	be := newFailing(t)
	p = newTestPool(t, Config{Backend: be, PreallocPages: 1})
	p.settle()
	gate := make(chan struct{})
	be.gate.Store(&gate)
	got, err := p.Alloc(context.Background(), 31+32)
	require.NoError(t, err)
	synctest.Wait()
	return p, got, func() {
		be.gate.Store(nil)
		close(gate)
	}
}

// TestPoolAllocWaitsForRefill is a regression test: an Alloc that needs the
// page the background refill is mapping was refused ("want 500, only 383
// available") because a page in flight counted as neither free nor
// unmapped. It must wait for the refill instead.
func TestPoolAllocWaitsForRefill(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		// Page 0's and the reserve page's blocks taken: the refill maps the
		// next page and is held there.
		p, first, release := refillHeld(t)
		rest := p.Stats().BlocksTotal - len(first)
		var got []int
		done := make(chan error, 1)
		go func() {
			var err error
			got, err = p.Alloc(ctx, rest)
			done <- err
		}()
		synctest.Wait() // the Alloc waits for the refill, it does not fail
		select {
		case err := <-done:
			t.Fatalf("Alloc returned before the refill finished: %v", err)
		default:
		}
		release()
		require.NoError(t, <-done)
		require.Len(t, got, rest)
		require.NoError(t, p.Close())
	})
}

// TestPoolAvailableCountsRefill: the reported input, from the zero-copy
// block pool on a busy machine: Available said 188 blocks where 252 were
// free (256 blocks, 64 to a page, 3 in use), one page short, while the
// refill was mapping the reserve page. A page in flight counts.
func TestPoolAvailableCountsRefill(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p, got, release := refillHeld(t)
		total := p.Stats().BlocksTotal // the null block not counted
		require.Equal(t, total-len(got), p.Available(), "the page the refill maps counts")
		require.Equal(t, total-len(got), p.Stats().Available, "in the stats too")
		release()
		p.settle()
		require.Equal(t, total-len(got), p.Available())
		require.NoError(t, p.Close())
	})
}

// TestPoolLimitLoweredDuringRefill: the reported input, from the zero-copy
// block pool on a busy machine: the limit lowered to the two pages in use
// while the refill mapped a third made the pool say "over the limit" (so
// the engine released its held blocks) until the refill ended and unmapped
// that page again. The page in flight neither counts nor keeps it over.
func TestPoolLimitLoweredDuringRefill(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p, _, release := refillHeld(t) // pages 0 and 1 allocated; the refill held on page 2
		st := p.Stats()
		go func() { _ = p.SetMemoryLimit(2 * st.PageSize * uint64(st.NumRegions)) }()
		synctest.Wait()
		n, over := p.AvailableOverLimit()
		require.Equal(t, 0, n, "pages 0 and 1 are full, and the limit leaves no third")
		require.False(t, over, "the page the refill maps goes once mapped: only two pages count")
		release()
		p.settle()
		n, over = p.AvailableOverLimit()
		require.Equal(t, 0, n)
		require.False(t, over)
		require.Equal(t, 2, p.Stats().PagesMapped, "the refill's page unmapped again")
		require.NoError(t, p.Close())
	})
}

func TestPoolPartialFailure(t *testing.T) {
	nr := testLayout.NumRegions()
	for k := 1; k <= 2*nr; k++ {
		t.Run(fmt.Sprintf("map %d of %d fails", k, 2*nr), func(t *testing.T) {
			be := newFailing(t)
			p := newTestPool(t, Config{Backend: be, PreallocPages: -1})
			ctx := context.Background()
			held, err := p.Alloc(ctx, 20) // inside page 0
			require.NoError(t, err)
			before := p.Stats()
			beforeMapped, beforeLive := be.mapped.Load(), be.live.Load()
			be.failAt.Store(be.maps.Load() + int64(k))
			// 11 blocks left on page 0, then pages 1 and 2: 2×nr maps.
			_, err = p.Alloc(ctx, 11+32+1)
			require.ErrorIs(t, err, errInjected)
			require.ErrorIs(t, err, ErrBackend)
			var pe *PageError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, (k-1)%nr, pe.Region, "region named in %v", err)
			require.Equal(t, before, p.Stats(), "pool changed by a failed Alloc")
			require.Equal(t, beforeMapped, be.mapped.Load(), "page left mapped")
			require.Equal(t, beforeLive, be.live.Load(), "page left created")
			checkInvariants(t, p)
			// The same Alloc works once the backend does.
			ids, err := p.Alloc(ctx, 11+32+1)
			require.NoError(t, err)
			require.NoError(t, p.Free(ctx, append(ids, held...)))
			require.Equal(t, 1, p.Stats().PagesMapped)
			require.Zero(t, be.doubleMap.Load())
		})
	}
}

type recHook struct {
	mu       sync.Mutex
	calls    []string
	failMaps bool
}

func (h *recHook) MapPages(_ context.Context, pages []int) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, fmt.Sprint("map", pages))
	if h.failMaps {
		return errors.New("rank 1 refused")
	}
	return nil
}

func (h *recHook) UnmapPages(_ context.Context, pages []int) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, fmt.Sprint("unmap", pages))
	return nil
}

func TestPoolPageHook(t *testing.T) {
	be := newFailing(t)
	hook := &recHook{}
	p := newTestPool(t, Config{Backend: be, PreallocPages: -1, PageHook: hook})
	ctx := context.Background()
	ids, err := p.Alloc(ctx, 40)
	require.NoError(t, err)
	require.NoError(t, p.Free(ctx, ids))
	require.Equal(t, []string{"map[1]", "unmap[1]"}, hook.calls, "page 0 is never sent")

	hook.failMaps = true
	before := p.Stats()
	_, err = p.Alloc(ctx, 40)
	var he *HookError
	require.ErrorAs(t, err, &he)
	require.Equal(t, []int{1}, he.Pages)
	require.Contains(t, err.Error(), "rank 1 refused")
	require.Equal(t, before, p.Stats(), "nothing left allocated after a hook failure")
	require.Equal(t, int64(testLayout.NumRegions()), be.mapped.Load(), "rank 0 unmapped locally")
	checkInvariants(t, p)
}

// ctxHook records each UnmapPages call with the state of its ctx.
type ctxHook struct {
	mu       sync.Mutex
	unmapped [][]int
	errs     []error // ctx.Err() at the call
	deadline []bool  // whether the ctx had a deadline
	fail     error   // returned by UnmapPages
}

func (h *ctxHook) MapPages(context.Context, []int) error { return nil }

func (h *ctxHook) UnmapPages(ctx context.Context, pages []int) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.unmapped = append(h.unmapped, pages)
	h.errs = append(h.errs, ctx.Err())
	_, ok := ctx.Deadline()
	h.deadline = append(h.deadline, ok)
	return h.fail
}

// The hook hears about every page that was unmapped locally, even when
// another page's unmap failed or the caller's ctx is already cancelled.
// Neither failure is Free's error: the blocks were freed, and a caller that
// took the error for "nothing freed" would free them again (a double free
// of every block). Both are logged and counted instead.
//
// fault-matrix: coordinated-follower-killed
func TestPoolUnmapHookAlwaysTold(t *testing.T) {
	errHook := errors.New("rank 1 unreachable")
	tests := []struct {
		name     string
		failPage int   // page whose unmap fails in region 0; 0 = none
		hookErr  error // the hook's answer
		wantHook []int
		// failures counted: unmap, hook_unmap
		unmapFails, hookFails int
	}{
		{"unmap of page 2 fails", 2, nil, []int{1, 3}, 1, 0},
		{"hook fails too", 2, errHook, []int{1, 3}, 1, 1},
		{"hook fails", 0, errHook, []int{1, 2, 3}, 0, 1},
		{"all unmapped, caller gone", 0, nil, []int{1, 2, 3}, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			be := newFailing(t)
			hook := &ctxHook{fail: tt.hookErr}
			reg := prometheus.NewRegistry()
			p := newTestPool(t, Config{Backend: be, PreallocPages: -1, PageHook: hook, Registerer: reg})
			ids, err := p.Alloc(context.Background(), 31+3*32) // page 0's rest, pages 1..3
			require.NoError(t, err)
			t.Cleanup(func() { be.failUnmap.Store(0) }) // Close retries the broken page
			if tt.failPage != 0 {
				be.failUnmap.Store(p.Regions()[0].Base + uint64(tt.failPage)*testPage)
			}
			ctx, cancel := context.WithCancelCause(context.Background())
			cancel(errors.New("caller gave up"))

			require.NoError(t, p.Free(ctx, ids), "the blocks were freed")
			require.Len(t, hook.unmapped, 1)
			require.ElementsMatch(t, tt.wantHook, hook.unmapped[0], "the unmapped pages reach the hook")
			require.Equal(t, []error{nil}, hook.errs, "the hook runs detached from the cancelled caller")
			require.Equal(t, []bool{true}, hook.deadline, "the hook's ctx is bounded")
			require.Zero(t, p.Stats().BlocksUsed)
			require.ErrorIs(t, p.Free(context.Background(), ids[:1]), ErrDoubleFree, "freed once")
			require.NoError(t, promtest.GatherAndCompare(reg, strings.NewReader(fmt.Sprintf(`
# HELP kvsidecar_vmm_failures_total Backend or page hook failures by operation.
# TYPE kvsidecar_vmm_failures_total counter
kvsidecar_vmm_failures_total{op="hook_free"} 0
kvsidecar_vmm_failures_total{op="hook_map"} 0
kvsidecar_vmm_failures_total{op="hook_unmap"} %d
kvsidecar_vmm_failures_total{op="map"} 0
kvsidecar_vmm_failures_total{op="unmap"} %d
`, tt.hookFails, tt.unmapFails)), "kvsidecar_vmm_failures_total"))
			checkInvariants(t, p)
		})
	}
}

func TestPoolFollowerMapPages(t *testing.T) {
	be := newFailing(t)
	p := newTestPool(t, Config{Backend: be, PreallocPages: -1})
	ctx := context.Background()
	nr := int64(testLayout.NumRegions())
	require.NoError(t, p.MapPages(ctx, []int{2, 3}))
	require.Equal(t, 3*nr, be.mapped.Load())
	require.Equal(t, 3, p.Stats().PagesMapped)
	require.Equal(t, 31+5*32, p.Available(), "follower pages are not allocatable")
	// A follower's engine writes into them.
	require.NoError(t, p.CopyIn(0, 2*testPage, []byte{9}))

	tests := []struct {
		name  string
		err   error
		want  error
		pages []int
	}{
		{"map mapped", p.MapPages(ctx, []int{4, 3}), ErrAlreadyMapped, nil},
		{"map page 0", p.MapPages(ctx, []int{0}), ErrAlreadyMapped, nil},
		{"map out of range", p.MapPages(ctx, []int{8}), ErrBlockOutOfRange, nil},
		{"map twice in one call", p.MapPages(ctx, []int{5, 5}), ErrAlreadyMapped, nil},
		{"unmap unmapped", p.UnmapPages(ctx, []int{2, 4}), ErrNotMapped, nil},
		{"unmap page 0", p.UnmapPages(ctx, []int{0}), ErrNotMapped, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.ErrorIs(t, tc.err, tc.want)
			require.Equal(t, 3*nr, be.mapped.Load(), "a rejected call changed the mappings")
		})
	}
	// All-or-nothing: the third of four maps fails, nothing stays mapped.
	be.failAt.Store(be.maps.Load() + nr + 2)
	require.ErrorIs(t, p.MapPages(ctx, []int{4, 5}), errInjected)
	require.Equal(t, 3*nr, be.mapped.Load())
	require.NoError(t, p.UnmapPages(ctx, []int{2, 3}))
	require.Equal(t, nr, be.mapped.Load())
	checkInvariants(t, p)
}

func TestPoolExport(t *testing.T) {
	p := newTestPool(t, Config{PreallocPages: -1})
	ctx := context.Background()
	ids, err := p.Alloc(ctx, 33)
	require.NoError(t, err)
	require.NoError(t, p.CopyIn(1, p.BlockOffset(32), []byte("hello")))
	ex, err := p.Export(nil)
	require.NoError(t, err)
	defer ex.Close()
	require.Len(t, ex.Files, 1, "one memfd for the host backend")
	require.Len(t, ex.Mappings, 2*testLayout.NumRegions())
	var m Mapping
	for _, mm := range ex.Mappings {
		if mm.Region == 1 && mm.Page == 1 {
			m = mm
		}
	}
	require.EqualValues(t, testPage, m.RegionOffset)
	buf := make([]byte, 5)
	_, err = ex.Files[m.File].ReadAt(buf, int64(m.FileOffset+p.BlockOffset(32)-m.RegionOffset))
	require.NoError(t, err)
	require.Equal(t, "hello", string(buf))
	require.EqualValues(t, 1, m.Proto().GetRegion())

	_, err = p.Export([]int{5})
	require.ErrorIs(t, err, ErrNotMapped)
	require.NoError(t, p.Free(ctx, ids))
}

func TestPoolRegions(t *testing.T) {
	p := newTestPool(t, Config{NumBlocks: 100})
	rs := p.Regions()
	require.Len(t, rs, 4)
	for i, r := range rs {
		layer, kind := testLayout.Region(i)
		require.Equal(t, layer, r.Layer)
		require.Equal(t, kind, r.Kind)
		require.EqualValues(t, 4*testPage, r.Len, "100 blocks of 32 a page: 4 pages")
		require.EqualValues(t, 2048, r.BlockLen)
		require.Equal(t, uint64(0), r.Base%testPage)
		require.EqualValues(t, r.Base, r.Proto().GetBase())
	}
	require.EqualValues(t, 5*2048, rs[0].BlockOffset(5))
	_, err := p.HostBytes(4, 0, 1)
	require.ErrorIs(t, err, ErrBlockOutOfRange)
	_, err = p.HostBytes(0, 4*testPage-1, 2)
	require.ErrorIs(t, err, ErrBlockOutOfRange)
}

func TestPoolClose(t *testing.T) {
	be := newFailing(t)
	p, err := NewPool(context.Background(), &Config{Backend: be, Layout: testLayout, NumBlocks: 256, PreallocPages: 3})
	require.NoError(t, err)
	_, err = p.Alloc(context.Background(), 70)
	require.NoError(t, err)
	require.NoError(t, p.MapPages(context.Background(), []int{7}))
	require.NoError(t, p.Close())
	require.ErrorIs(t, p.Close(), net.ErrClosed)
	require.Zero(t, be.mapped.Load(), "mapped after Close")
	require.Zero(t, be.live.Load(), "created after Close")
	_, err = p.Alloc(context.Background(), 1)
	require.ErrorIs(t, err, net.ErrClosed)
	require.Equal(t, v1.Code_CODE_UNAVAILABLE, codes.Of(err))
	_, alloc, err := be.Stat()
	require.NoError(t, err)
	require.Zero(t, alloc, "memfd still holds memory")
}

func TestPoolOwnsDefaultBackend(t *testing.T) {
	p, err := NewPool(context.Background(), &Config{Layout: testLayout, NumBlocks: 64})
	require.NoError(t, err)
	require.EqualValues(t, DefaultHostPageSize, p.PageSize())
	hb := p.be.(*HostBackend)
	require.NoError(t, p.Close())
	require.ErrorIs(t, hb.Close(), net.ErrClosed, "Close closes the backend it created")
}

func TestPoolAllocCanceled(t *testing.T) {
	p := newTestPool(t, Config{})
	ctx, cancel := context.WithCancelCause(context.Background())
	cause := errors.New("engine gone")
	cancel(cause)
	_, err := p.Alloc(ctx, 1)
	require.ErrorIs(t, err, cause)
}

// TestPoolProperty runs random interleavings of Alloc, Free and
// SetMemoryLimit from several goroutines and checks the pool's promises.
func TestPoolProperty(t *testing.T) {
	be := newFailing(t)
	pageBytes := uint64(testPage * testLayout.NumRegions())
	const pages = 16
	p := newTestPool(t, Config{Backend: be, NumBlocks: 32 * pages, PreallocPages: 2})
	var overLimit atomic.Int64
	p.mu.Lock()
	p.onCommit = func(committed, limitPages int) {
		if committed > limitPages {
			overLimit.Add(1)
		}
	}
	p.mu.Unlock()
	ctx := context.Background()
	var wg sync.WaitGroup
	var negative, unexpected atomic.Int64
	var firstErr atomic.Value
	for g := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 42))
			var held []int
			for range 600 {
				switch op := r.IntN(10); {
				case op < 5:
					ids, err := p.Alloc(ctx, 1+r.IntN(40))
					if err != nil && !errors.Is(err, ErrOverLimit) {
						unexpected.Add(1)
						firstErr.CompareAndSwap(nil, err)
					}
					held = append(held, ids...)
				case op < 9 && len(held) > 0:
					r.Shuffle(len(held), func(i, j int) { held[i], held[j] = held[j], held[i] })
					k := 1 + r.IntN(len(held))
					if err := p.Free(ctx, held[:k]); err != nil {
						unexpected.Add(1)
						firstErr.CompareAndSwap(nil, err)
					}
					held = held[k:]
				default:
					limit := uint64(1+r.IntN(pages+2)) * pageBytes
					if r.IntN(4) == 0 {
						limit = 0
					}
					if err := p.SetMemoryLimit(limit); err != nil {
						unexpected.Add(1)
						firstErr.CompareAndSwap(nil, err)
					}
				}
				if p.Available() < 0 {
					negative.Add(1)
				}
			}
			if err := p.Free(ctx, held); err != nil {
				unexpected.Add(1)
				firstErr.CompareAndSwap(nil, err)
			}
		})
	}
	wg.Wait()
	require.Zero(t, unexpected.Load(), "first unexpected error: %v", firstErr.Load())
	require.Zero(t, negative.Load(), "Available went negative")
	require.Zero(t, overLimit.Load(), "a page was mapped beyond the limit")
	require.Zero(t, be.doubleMap.Load(), "a slot was mapped twice")
	checkInvariants(t, p)
	require.Zero(t, p.Stats().BlocksUsed)

	// Trim the reserve: only page 0 stays.
	p.settle()
	require.NoError(t, p.SetMemoryLimit(pageBytes))
	p.settle()
	st := p.Stats()
	require.Equal(t, 1, st.PagesMapped, "pages leaked: %+v", st)
	require.Equal(t, int64(testLayout.NumRegions()), be.mapped.Load())
	require.Equal(t, int64(testLayout.NumRegions()), be.live.Load())
	checkInvariants(t, p)
}

// TestPoolPinHoldsPages: a follower's page stays mapped while a transfer
// pins one of its blocks. UnmapPages and WaitUnpinned wait for the unpin;
// at half their deadline they ask the pinning transfer to abort, and
// when it does not stop by the deadline they fail with ErrPinned naming
// the blocks, the page still mapped. Pin itself refuses a block whose
// page is not mapped.
//
// fault-matrix: coordinated-free-under-read
func TestPoolPinHoldsPages(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		be := newFailing(t)
		p := newTestPool(t, Config{Backend: be, PreallocPages: -1})
		nr := int64(testLayout.NumRegions())
		require.NoError(t, p.MapPages(t.Context(), []int{2}))
		_, err := p.Pin([]int{2 * 32, 3 * 32}, nil)
		var be2 *BlockError
		require.ErrorAs(t, err, &be2)
		require.Equal(t, 3*32, be2.Block, "the first block whose page is not mapped")
		require.ErrorIs(t, err, ErrNotMapped)

		// Unpinned before the deadline: the unmap waits for it.
		unpin, err := p.Pin([]int{2*32 + 5}, func() { t.Error("aborted before half the deadline") })
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		done := make(chan error, 1)
		go func() { done <- p.UnmapPages(ctx, []int{2}) }()
		time.Sleep(4 * time.Second)
		synctest.Wait()
		require.Empty(t, done, "UnmapPages returned under a pin")
		require.Equal(t, 2*nr, be.mapped.Load(), "page 2 still mapped")
		unpin()
		require.NoError(t, <-done)
		require.Equal(t, nr, be.mapped.Load(), "page 2 unmapped after the unpin")
		cancel()

		// A transfer that stops when asked: aborted at 5 s of 10 s.
		require.NoError(t, p.MapPages(t.Context(), []int{2}))
		start := time.Now()
		var aborted time.Duration
		unpin, err = p.Pin([]int{2*32 + 1}, func() { aborted = time.Since(start); go unpin() })
		require.NoError(t, err)
		ctx, cancel = context.WithTimeout(t.Context(), 10*time.Second)
		require.NoError(t, p.UnmapPages(ctx, []int{2}))
		cancel()
		require.Equal(t, 5*time.Second, aborted)
		require.Equal(t, nr, be.mapped.Load())

		// One that does not stop: ErrPinned at the deadline, nothing unmapped.
		require.NoError(t, p.MapPages(t.Context(), []int{2}))
		unpin, err = p.Pin([]int{2*32 + 7}, func() {})
		require.NoError(t, err)
		ctx, cancel = context.WithTimeout(t.Context(), 10*time.Second)
		err = p.UnmapPages(ctx, []int{2})
		cancel()
		require.ErrorIs(t, err, ErrPinned)
		require.ErrorContains(t, err, "blocks [71] are still read or written by 1 transfer(s)")
		require.Equal(t, 2*nr, be.mapped.Load(), "not unmapped under the pin")
		ctx, cancel = context.WithTimeout(t.Context(), time.Second)
		require.ErrorIs(t, p.WaitUnpinned(ctx, []int{2*32 + 7}), ErrPinned)
		cancel()
		require.NoError(t, p.WaitUnpinned(t.Context(), []int{2*32 + 8}), "another block is not pinned")
		unpin()
		unpin() // a second call counts for nothing
		require.NoError(t, p.WaitUnpinned(t.Context(), []int{2*32 + 7}))
		require.NoError(t, p.UnmapPages(t.Context(), []int{2}))
		checkInvariants(t, p)
	})
}

// logLines records what a pool logs, one record per line.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, string(b))
	return len(b), nil
}

func (l *logLines) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.lines)
}

// TestPoolFreeHookFailsFreesAnyway: when rank 0's free hook (the TP
// group's free barrier) fails, or does not answer within
// UnmapHookTimeout, Free frees the blocks anyway. While the hook runs the
// blocks stay allocated, so nobody is handed them; it runs detached from
// the caller's ctx, cancelled or not, and is cut off at exactly
// UnmapHookTimeout. Then the failure is logged with its error and counted
// (kvsidecar_vmm_failures_total{op="hook_free"}, at 0 before), the blocks
// are free, their empty page is unmapped and the page hook told, and Free
// returns no error: the engine's free happened. (A follower still using
// the blocks keeps its pages mapped through its own Pin: see
// TestPoolPinHoldsPages.)
//
// fault-matrix: coordinated-free-unanswered
func TestPoolFreeHookFailsFreesAnyway(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const hookTimeout = 10 * time.Second
		refused := errors.New("tpgroup: free on ranks [1]: blocks [33] are still read or written by 1 transfer(s)")
		var (
			mu     sync.Mutex
			calls  [][]int
			hookCh = make(chan error, 1) // the hook's error; nil: wait for its ctx
			seen   []error               // the hook ctx's error when it returned
		)
		freeHook := func(ctx context.Context, ids []int) error {
			mu.Lock()
			calls = append(calls, slices.Clone(ids))
			mu.Unlock()
			err := <-hookCh
			if err == nil {
				<-ctx.Done()
				err = ctx.Err()
			}
			mu.Lock()
			seen = append(seen, ctx.Err())
			mu.Unlock()
			return err
		}
		be := newFailing(t)
		hook := &recHook{}
		reg := prometheus.NewRegistry()
		var logs logLines
		p := newTestPool(t, Config{Backend: be, PreallocPages: -1, PageHook: hook, FreeHook: freeHook, UnmapHookTimeout: hookTimeout,
			Logger: slog.New(slog.NewTextHandler(&logs, nil)), Registerer: reg})
		nr := int64(testLayout.NumRegions())
		failures := func(hookFree int) string {
			return fmt.Sprintf(`
# HELP kvsidecar_vmm_failures_total Backend or page hook failures by operation.
# TYPE kvsidecar_vmm_failures_total counter
kvsidecar_vmm_failures_total{op="hook_free"} %d
kvsidecar_vmm_failures_total{op="hook_map"} 0
kvsidecar_vmm_failures_total{op="hook_unmap"} 0
kvsidecar_vmm_failures_total{op="map"} 0
kvsidecar_vmm_failures_total{op="unmap"} 0
`, hookFree)
		}
		require.NoError(t, promtest.GatherAndCompare(reg, strings.NewReader(failures(0)), "kvsidecar_vmm_failures_total"))
		_, err := p.Alloc(t.Context(), 31) // the rest of page 0
		require.NoError(t, err)

		// The hook refuses: the blocks are freed anyway, their page unmapped.
		ids, err := p.Alloc(t.Context(), 5)
		require.NoError(t, err)
		require.Equal(t, 2*nr, be.mapped.Load(), "page 1 mapped")
		hookCh <- refused
		require.NoError(t, p.Free(t.Context(), ids))
		require.Equal(t, [][]int{ids}, calls, "the hook was asked about exactly these blocks")
		require.Equal(t, 31, p.Stats().BlocksUsed, "the blocks are free")
		require.ErrorIs(t, p.CheckAllocated(ids[:1]), ErrNotAllocated)
		require.Equal(t, nr, be.mapped.Load(), "page 1 unmapped")
		require.Equal(t, []string{"map[1]", "unmap[1]"}, hook.calls, "the page hook was told of the unmap")
		require.NoError(t, promtest.GatherAndCompare(reg, strings.NewReader(failures(1)), "kvsidecar_vmm_failures_total"))
		warned := logs.all()
		require.Len(t, warned, 1)
		require.Contains(t, warned[0], "level=WARN")
		require.Contains(t, warned[0], `msg="vmm: free hook failed; freeing anyway" blocks=5`)
		require.Contains(t, warned[0], refused.Error())
		checkInvariants(t, p)

		// The hook never answers, and the caller already gave up: Free
		// waits exactly UnmapHookTimeout, holding the blocks, then frees.
		ids, err = p.Alloc(t.Context(), 5)
		require.NoError(t, err)
		gone, cancel := context.WithCancel(t.Context())
		cancel()
		start := time.Now()
		done := make(chan error, 1)
		go func() { done <- p.Free(gone, ids) }()
		hookCh <- nil
		time.Sleep(hookTimeout - time.Nanosecond)
		synctest.Wait()
		require.Empty(t, done, "Free returned before the hook's deadline")
		require.NoError(t, p.CheckAllocated(ids), "the blocks stay allocated while the hook runs")
		require.Equal(t, 31+5, p.Stats().BlocksUsed)
		require.NoError(t, <-done)
		require.Equal(t, hookTimeout, time.Since(start), "cut off at UnmapHookTimeout")
		require.Equal(t, []error{nil, context.DeadlineExceeded}, seen, "the hook's ctx ignores the caller's cancel and ends at its own deadline")
		require.Equal(t, 31, p.Stats().BlocksUsed, "freed anyway")
		require.Equal(t, nr, be.mapped.Load(), "page 1 unmapped again")
		require.NoError(t, promtest.GatherAndCompare(reg, strings.NewReader(failures(2)), "kvsidecar_vmm_failures_total"))
		require.Len(t, logs.all(), 2)
		require.Contains(t, logs.all()[1], "context deadline exceeded")
		checkInvariants(t, p)
	})
}

// TestPoolUnpinTrimsWhatAFreeLeftMapped: a Free whose last block of a page
// is freed while a transfer pins a block of it leaves the page mapped (the
// pin); the unpin unmaps it back to the reserve. Found by e2e's
// TestIntegrityRanksDisagreeOnBlockIDs under load: a prefill rank's lease
// ended (its blocks freed) while the READ it served still pinned them, and
// 7 empty pages stayed mapped.
func TestPoolUnpinTrimsWhatAFreeLeftMapped(t *testing.T) {
	be := newFailing(t)
	p := newTestPool(t, Config{Backend: be, PreallocPages: 1})
	p.settle()
	idle := p.Stats().PagesMapped
	ids, err := p.Alloc(context.Background(), 3*32) // page 0's free blocks and whole pages after
	require.NoError(t, err)
	p.settle()
	unpin, err := p.Pin(ids, nil)
	require.NoError(t, err)
	require.NoError(t, p.Free(context.Background(), ids))
	held := p.Stats().PagesMapped
	require.Greater(t, held, idle+1, "the pinned pages stay mapped past the reserve")
	unpin()
	require.Equal(t, idle, p.Stats().PagesMapped, "the unpin trimmed back to the reserve")
	require.Equal(t, int64(idle)*int64(testLayout.NumRegions()), be.mapped.Load())
	checkInvariants(t, p)
}
