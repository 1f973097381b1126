//go:build linux

package transfer

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvsidecar/kvsidecar/internal/fdpass"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// memfdRegion is registered memory backed by a memfd the way a vmm host
// pool backs a region: page k of the region is mapped from a slot of the
// file chosen by a permutation, so a same-host reader must follow the page
// table Share returns.
type memfdRegion struct {
	Region
	mem  []byte
	fd   int
	ps   uint64
	slot []uint64 // page k lives at file offset slot[k]*ps
}

func newMemfdRegion(t testing.TB, pages int, ps uint64, blockLen uint64) *memfdRegion {
	t.Helper()
	fd, err := unix.MemfdCreate("transfer-test", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, int64(uint64(pages)*ps)))
	size := int(uint64(pages) * ps)
	res, err := unix.Mmap(-1, 0, size, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	m := &memfdRegion{mem: res, fd: fd, ps: ps, slot: make([]uint64, pages)}
	for k := range pages {
		m.slot[k] = uint64((k*7 + 3) % pages) // a permutation when pages is not a multiple of 7
		_, err := unix.MmapPtr(fd, int64(m.slot[k]*ps), unsafe.Pointer(&res[uint64(k)*ps]), uintptr(ps),
			unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED)
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		_ = unix.Munmap(res)
		_ = unix.Close(fd)
	})
	m.Region = SliceRegion(res, blockLen, 0)
	return m
}

// share is Config.Share over the region: one read-write duplicate of the
// memfd, one page per ps-page the ranges touch.
func (m *memfdRegion) share(ranges []Desc) (*SharedPages, error) {
	nfd, err := unix.FcntlInt(uintptr(m.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	sp := &SharedPages{Kind: v1.PageKind_PAGE_KIND_MEMFD, Files: []*os.File{os.NewFile(uintptr(nfd), "memfd")}}
	seen := map[uint64]bool{}
	for _, r := range ranges {
		for k := (r.Addr - m.Base) / m.ps; k*m.ps < r.Addr-m.Base+r.Len; k++ {
			if !seen[k] {
				seen[k] = true
				sp.Pages = append(sp.Pages, SharedPage{Addr: m.Base + k*m.ps, Len: m.ps, FileOffset: m.slot[k] * m.ps})
			}
		}
	}
	return sp, nil
}

// inode is the memfd's inode number, as /proc/self/maps prints it.
func (m *memfdRegion) inode(t testing.TB) uint64 {
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(m.fd, &st))
	return st.Ino
}

// mappingsOf counts this process's mappings of inode (/proc/self/maps).
func mappingsOf(t testing.TB, inode uint64) int {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	require.NoError(t, err)
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fs := strings.Fields(sc.Text()); len(fs) >= 5 && fs[4] == fmt.Sprint(inode) {
			n++
		}
	}
	require.NoError(t, sc.Err())
	return n
}

// openFDs counts this process's open file descriptors.
func openFDs(t testing.TB) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(es)
}

// sameHostPair starts a serving agent over a memfd region with a same-host
// socket, and a reader over another memfd region.
type sameHostPair struct {
	srv, cli       *Agent
	src, dst       *memfdRegion
	srvReg, cliReg *prometheus.Registry
}

func newSameHostPair(t testing.TB, srvCfg, cliCfg Config, pages int) *sameHostPair {
	t.Helper()
	const ps = 64 << 10
	p := &sameHostPair{src: newMemfdRegion(t, pages, ps, 4<<10), dst: newMemfdRegion(t, pages, ps, 4<<10),
		srvReg: prometheus.NewRegistry(), cliReg: prometheus.NewRegistry()}
	fill(p.src.mem, 7)
	dir, err := os.MkdirTemp("", "kvs-sh")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o700))
	srvCfg.Regions = append(srvCfg.Regions, p.src.Region)
	srvCfg.LocalSocket = filepath.Join(dir, "peer.sock")
	if srvCfg.Share == nil {
		srvCfg.Share = p.src.share
	}
	if srvCfg.Authorize == nil {
		srvCfg.Authorize = allowAll
	}
	srvCfg.Registerer = p.srvReg
	cliCfg.Regions = append(cliCfg.Regions, p.dst.Region)
	cliCfg.Registerer = p.cliReg
	p.srv = startAgent(t, srvCfg)
	p.cli = startAgent(t, cliCfg)
	return p
}

func (p *sameHostPair) read(ctx context.Context, sh *SameHostPeer, local, remote []Desc, checksum bool) (Result, error) {
	return p.cli.Transfer(ctx, &Xfer{Op: OpRead, Peer: p.srv.Addr().String(), RequestID: "r", Local: local, Remote: remote,
		SameHost: sh, Checksum: checksum})
}

func sameHostBytes(reg *prometheus.Registry, role string) float64 {
	m, _ := reg.Gather()
	for _, f := range m {
		if f.GetName() == "kvsidecar_transfer_same_host_bytes_total" {
			for _, s := range f.GetMetric() {
				if s.GetLabel()[0].GetValue() == role {
					return s.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

// TestSameHostReadByteExact reads descriptors of mixed sizes, in another
// order than they lie, on the same-host path, with one and with three
// lanes and with checksums, and checks every byte, that the path carried
// them, and that no page of the peer and no passed file stays in the
// reader afterwards.
//
// fault-matrix: same-host-nothing-left-mapped
func TestSameHostReadByteExact(t *testing.T) {
	tests := []struct {
		name     string
		lanes    int
		checksum bool
	}{
		{"one lane", 1, false},
		{"three lanes", 3, false},
		{"checksums", 1, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := newSameHostPair(t, Config{}, Config{ReadLanes: tc.lanes, ReadLaneMinBytes: 64 << 10}, 128)
			sizes := layout(300)
			remote := descsAt(p.src.Region, sizes, false)
			local := descsAt(p.dst.Region, sizes, true)
			inode := p.src.inode(t)
			mapsBefore, fdsBefore := mappingsOf(t, inode), openFDs(t)
			res, err := p.read(t.Context(), p.srv.SameHost(), local, remote, tc.checksum)
			require.NoError(t, err)
			require.Equal(t, sum(sizes), res.Bytes)
			require.Equal(t, bytesOf(p.src.Region, p.src.mem, remote), bytesOf(p.dst.Region, p.dst.mem, local))
			require.Equal(t, float64(sum(sizes)), sameHostBytes(p.cliReg, "client"), "every byte moved on the same-host path")
			require.Equal(t, float64(sum(sizes)), sameHostBytes(p.srvReg, "server"))
			require.Zero(t, promtest.ToFloat64(p.cli.m.sameHostFallbacks))
			require.Equal(t, mapsBefore, mappingsOf(t, inode), "no page of the peer stays mapped after the READ")
			require.Equal(t, fdsBefore+2, openFDs(t), "the idle connection's two ends (reader and server share this process) are the only descriptors left: no passed file")
		})
	}
}

// TestSameHostReadByBlocks reads by region and block, the way a connector
// does, with expectations the peer checks.
func TestSameHostReadByBlocks(t *testing.T) {
	readBlocks(t, []uint32{3, 250, 4, 5, 6, 100})
}

// readBlocks reads blocks ids of 4 KiB (16 a page) from a same-host peer
// into local blocks 0..len(ids)-1 and checks every byte, and that all of
// them took the same-host path.
func readBlocks(t *testing.T, ids []uint32) {
	t.Helper()
	p := newSameHostPair(t, Config{}, Config{}, 16)
	const blockLen = 4 << 10
	var local []Desc
	for i := range ids {
		local = append(local, Desc{Addr: p.dst.Base + uint64(i)*blockLen, Len: blockLen})
	}
	_, err := p.cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: p.srv.Addr().String(), RequestID: "r", Local: local,
		RemoteBlocks: &BlockDescs{NumRegions: 1, Len: blockLen, BlockIDs: ids}, SameHost: p.srv.SameHost()})
	require.NoError(t, err)
	for i, id := range ids {
		require.Equal(t, p.src.mem[uint64(id)*blockLen:uint64(id+1)*blockLen], p.dst.mem[uint64(i)*blockLen:uint64(i+1)*blockLen], "block %d", id)
	}
	require.Equal(t, float64(len(ids)*blockLen), sameHostBytes(p.cliReg, "client"), "every byte over the same-host path")
}

// TestSameHostReadRevisitingPages: blocks that go back and forth between
// pages (vLLM hands out block ids in any order) arrive byte-exact. The
// copier took a map-ahead token at every change of page and the mapper
// gave one per page, so a READ that changed page more often than it had
// pages waited forever for a token (a decode's load in the chaos soak of
// issue 35 hung so, and its abort with it).
func TestSameHostReadRevisitingPages(t *testing.T) {
	// Pages 0 and 15 (16 blocks a page), six changes of page over two pages.
	readBlocks(t, []uint32{0, 250, 1, 251, 2, 252, 3})
}

// TestSameHostFallsBackToQUIC: a socket that does not answer, or answers
// with another agent's token, sends the READ over QUIC, counted once per
// socket, after Xfer.OnRedial (the peer restarted: its metadata is
// stale); the bytes still arrive.
//
// fault-matrix: same-host-unusable
func TestSameHostFallsBackToQUIC(t *testing.T) {
	for _, tc := range []struct {
		name string
		peer func(p *sameHostPair) *SameHostPeer
	}{
		{"another agent's token", func(p *sameHostPair) *SameHostPeer {
			sh := p.srv.SameHost()
			sh.Token = []byte("not-the-token")
			return sh
		}},
		{"no socket", func(p *sameHostPair) *SameHostPeer {
			sh := p.srv.SameHost()
			sh.Socket += ".missing"
			return sh
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newSameHostPair(t, Config{}, Config{}, 8)
			remote := []Desc{{Addr: p.src.Base, Len: 100 << 10}}
			local := []Desc{{Addr: p.dst.Base + 4096, Len: 100 << 10}}
			redials := 0
			for range 2 {
				_, err := p.cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: p.srv.Addr().String(), RequestID: "r", Local: local, Remote: remote,
					SameHost: tc.peer(p), OnRedial: func(context.Context) error { redials++; return nil }})
				require.NoError(t, err)
			}
			require.Equal(t, 2, redials, "the socket is not the metadata's peer: the caller learns the peer anew before each READ goes over QUIC")
			require.Equal(t, p.src.mem[:100<<10], p.dst.mem[4096:4096+100<<10])
			require.Zero(t, sameHostBytes(p.cliReg, "client"), "the bytes went over QUIC")
			require.Equal(t, 1.0, promtest.ToFloat64(p.cli.m.sameHostFallbacks), "counted once per socket")
		})
	}
}

// TestSameHostRefusalIsTheREADs: a READ the peer refuses on the same-host
// path fails with the peer's class and is not sent again over QUIC.
//
// fault-matrix: same-host-refusal
func TestSameHostRefusalIsTheREADs(t *testing.T) {
	var asked atomic.Int32
	p := newSameHostPair(t, Config{Authorize: func(context.Context, *Access) error {
		asked.Add(1)
		return errorf(v1.Code_CODE_CAPABILITY_DENIED, "no capability")
	}}, Config{}, 8)
	_, err := p.read(t.Context(), p.srv.SameHost(), []Desc{{Addr: p.dst.Base, Len: 4096}}, []Desc{{Addr: p.src.Base, Len: 4096}}, false)
	require.ErrorIs(t, err, ErrCapabilityDenied)
	require.Equal(t, int32(1), asked.Load(), "refused once, never retried over QUIC")
	// The connection serves the next READ after a refusal.
	_, err = p.read(t.Context(), p.srv.SameHost(), []Desc{{Addr: p.dst.Base, Len: 4096}}, []Desc{{Addr: p.src.Base, Len: 4096}}, false)
	require.ErrorIs(t, err, ErrCapabilityDenied)
	require.Zero(t, promtest.ToFloat64(p.cli.m.sameHostFallbacks))
}

// gateMemory is host memory whose HostBytes waits for a gate the first
// time it is asked for more than a byte, so a test can act while a same-host READ is between
// its pages and its copy.
type gateMemory struct {
	SliceMemory
	asked chan struct{}
	gate  chan struct{}
	once  sync.Once
}

func (g *gateMemory) HostBytes(off, n uint64) ([]byte, error) {
	if n <= 1 {
		return g.SliceMemory.HostBytes(off, n) // the reader's check that it maps host memory
	}
	g.once.Do(func() {
		close(g.asked)
		<-g.gate
	})
	return g.SliceMemory.HostBytes(off, n)
}

// TestSameHostServerEndsTheREAD: the serving side stops a same-host READ
// in flight (its owner aborts it; its progress deadline passes; its agent
// closes): the READ fails with the serving side's class, never as a
// success, and the serving side releases the access once.
//
// fault-matrix: same-host-read-stopped
func TestSameHostServerEndsTheREAD(t *testing.T) {
	for _, tc := range []struct {
		name     string
		progress bool // a short progress deadline on the serving side ends it
		closeSrv bool
		want     error
	}{
		{"owner aborts", false, false, ErrLeaseExpired},
		{"progress deadline", true, false, ErrTimeout},
		{"serving agent closes", false, true, ErrUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var acc atomic.Pointer[Access]
			released := make(chan error, 1)
			srvCfg := Config{
				Authorize: func(_ context.Context, a *Access) error { acc.Store(a); return nil },
				Release:   func(a *Access) { released <- a.Err },
			}
			if tc.progress {
				srvCfg.ProgressTimeout = 1 // any wait ends it; the reader waits for the release
			}
			p := newSameHostPair(t, srvCfg, Config{}, 8)
			gm := &gateMemory{SliceMemory: SliceMemory(p.dst.mem), asked: make(chan struct{}), gate: make(chan struct{})}
			reg := p.dst.Region
			reg.Mem = gm
			cli := startAgent(t, Config{Regions: []Region{reg}})
			done := make(chan error, 1)
			go func() {
				_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: p.srv.Addr().String(), RequestID: "r",
					Local: []Desc{{Addr: reg.Base, Len: 256 << 10}}, Remote: []Desc{{Addr: p.src.Base, Len: 256 << 10}}, SameHost: p.srv.SameHost()})
				done <- err
			}()
			var relErr error
			if tc.progress {
				// The deadline may pass before the pages went out (the
				// READ is refused then) or while the reader copies.
				relErr = <-released
			} else {
				<-gm.asked
				if tc.closeSrv {
					require.NoError(t, p.srv.Close())
				} else {
					acc.Load().Abort(ErrLeaseExpired)
				}
				relErr = <-released
			}
			require.Error(t, relErr, "the serving side released the access as failed")
			close(gm.gate)
			err := <-done
			require.ErrorIs(t, err, tc.want)
		})
	}
}

// TestSameHostDeviceMemoryWithoutCopierFallsBack: a reader whose memory is
// not host-addressable and that has no PeerCopier sends the READ over
// QUIC (staged), logged and counted once.
//
// fault-matrix: same-host-unusable
func TestSameHostDeviceMemoryWithoutCopierFallsBack(t *testing.T) {
	p := newSameHostPair(t, Config{}, Config{}, 8)
	dev := make(stagedMemory, 1<<20)
	cli := startAgent(t, Config{Regions: []Region{{Base: 1 << 40, Len: 1 << 20, Mem: dev}}})
	_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: p.srv.Addr().String(), RequestID: "r",
		Local: []Desc{{Addr: 1 << 40, Len: 64 << 10}}, Remote: []Desc{{Addr: p.src.Base, Len: 64 << 10}}, SameHost: p.srv.SameHost()})
	require.NoError(t, err)
	require.Equal(t, p.src.mem[:64<<10], []byte(dev[:64<<10]))
	require.Equal(t, 1.0, promtest.ToFloat64(cli.m.sameHostFallbacks))
}

// stagedMemory is memory that cannot be mapped (device memory's rule):
// only CopyIn and CopyOut reach it.
type stagedMemory []byte

func (m stagedMemory) HostBytes(uint64, uint64) ([]byte, error) {
	return nil, errors.New("not host-addressable")
}
func (m stagedMemory) CopyOut(off uint64, dst []byte) error { return SliceMemory(m).CopyOut(off, dst) }
func (m stagedMemory) CopyIn(off uint64, src []byte) error  { return SliceMemory(m).CopyIn(off, src) }

// TestOnLandedSeesEveryByteOnce: on both paths and over lanes, OnLanded
// is handed every byte of a READ by region and block once, at its offset
// in the local stream, each block's runs in region order, with the bytes
// that landed there.
func TestOnLandedSeesEveryByteOnce(t *testing.T) {
	for _, tc := range []struct {
		name     string
		sameHost bool
		lanes    int
	}{
		{"quic", false, 1},
		{"quic lanes", false, 3},
		{"same-host", true, 1},
		{"same-host lanes", true, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const blockLen, regions = 4 << 10, 2
			// The peer's two regions, each a memfd region of its own.
			r2 := newMemfdRegion(t, 16, 64<<10, blockLen)
			fill(r2.mem, 9)
			var p *sameHostPair
			share := func(ranges []Desc) (*SharedPages, error) {
				var in1, in2 []Desc
				for _, d := range ranges {
					if d.Addr >= r2.Base && d.Addr < r2.Base+r2.Len {
						in2 = append(in2, d)
					} else {
						in1 = append(in1, d)
					}
				}
				a, err := p.src.share(in1)
				if err != nil {
					return nil, err
				}
				b, err := r2.share(in2)
				if err != nil {
					return nil, err
				}
				for _, pg := range b.Pages {
					pg.File = 1
					a.Pages = append(a.Pages, pg)
				}
				a.Files = append(a.Files, b.Files...)
				return a, nil
			}
			p = newSameHostPair(t, Config{Regions: []Region{}, Share: share}, Config{ReadLanes: tc.lanes, ReadLaneMinBytes: 64 << 10}, 16)
			require.NoError(t, p.srv.Register(r2.Region))
			ids := make([]uint32, 100)
			for i := range ids {
				ids[i] = uint32(3 + 2*i)
			}
			local := []Desc{{Addr: p.dst.Base, Len: uint64(regions*len(ids)) * blockLen}}
			total := local[0].Len
			seen := make([]byte, total)
			var mu sync.Mutex
			lastRegion := map[uint64]uint64{} // block index → last region landed
			var sh *SameHostPeer
			if tc.sameHost {
				sh = p.srv.SameHost()
			}
			_, err := p.cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: p.srv.Addr().String(), RequestID: "r", Local: local,
				RemoteBlocks: &BlockDescs{NumRegions: regions, Len: blockLen, BlockIDs: ids},
				SameHost:     sh, OnLanded: func(at uint64, b []byte) {
					mu.Lock()
					defer mu.Unlock()
					for i := range uint64(len(b)) {
						seen[at+i]++
					}
					require.Equal(t, p.dst.mem[at:at+uint64(len(b))], b, "the run is the bytes that landed at its offset")
					region, block := at/(uint64(len(ids))*blockLen), at/blockLen%uint64(len(ids))
					require.GreaterOrEqual(t, region, lastRegion[block], "block %d: regions in order", block)
					lastRegion[block] = region
				}})
			require.NoError(t, err)
			for i, n := range seen {
				require.Equal(t, byte(1), n, "byte %d handed to OnLanded once", i)
			}
			for r, mem := range [][]byte{p.src.mem, r2.mem} {
				for i, id := range ids {
					at := (uint64(r*len(ids)) + uint64(i)) * blockLen
					require.Equal(t, mem[uint64(id)*blockLen:uint64(id+1)*blockLen], p.dst.mem[at:at+blockLen], "region %d block %d", r, id)
				}
			}
			if tc.sameHost {
				require.Equal(t, float64(total), sameHostBytes(p.cliReg, "client"))
			}
		})
	}
}

// BenchmarkSameHostRead reads 128 MiB in 1 MiB descriptors on the
// same-host path (mapped memfd pages of 2 MiB, one lane).
func BenchmarkSameHostRead(b *testing.B) {
	const desc, total = 1 << 20, 128 << 20
	p := newSameHostPair(b, Config{}, Config{}, total/(64<<10))
	var remote, local []Desc
	for off := uint64(0); off < total; off += desc {
		remote = append(remote, Desc{Addr: p.src.Base + off, Len: desc})
		local = append(local, Desc{Addr: p.dst.Base + off, Len: desc})
	}
	sh := p.srv.SameHost()
	b.SetBytes(total)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := p.read(b.Context(), sh, local, remote, false); err != nil {
			b.Fatal(err)
		}
	}
}

// TestSameHostProgressOverLanes: a same-host READ copied by several lanes
// reports its progress in frames that never go backwards (the serving
// side refuses one that does), however the lanes interleave.
//
// fault-matrix: same-host-progress-order
func TestSameHostProgressOverLanes(t *testing.T) {
	const total = 96 << 20
	p := newSameHostPair(t, Config{}, Config{ReadLanes: 4, ReadLaneMinBytes: 1}, total/(64<<10))
	remote := []Desc{{Addr: p.src.Base, Len: total}}
	local := []Desc{{Addr: p.dst.Base, Len: total}}
	for range 3 {
		clear(p.dst.mem)
		_, err := p.read(t.Context(), p.srv.SameHost(), local, remote, false)
		require.NoError(t, err)
		require.Equal(t, p.src.mem, p.dst.mem)
	}
	require.Equal(t, float64(3*total), sameHostBytes(p.cliReg, "client"))
}

// TestSameHostProgressFramesInOrder: copiers reporting landed bytes at
// once (as a READ's lanes do) send progress frames whose counts never go
// backwards.
//
// fault-matrix: same-host-progress-order
func TestSameHostProgressFramesInOrder(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	require.NoError(t, err)
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "pair")
		defer f.Close()
		c, err := net.FileConn(f)
		require.NoError(t, err)
		return c.(*net.UnixConn)
	}
	a, b := fdpass.New(conn(fds[0])), conn(fds[1])
	defer b.Close()
	wd := startWatchdog(0, func() {})
	defer wd.stop()
	lx := &localXfer{x: &Xfer{}, lc: &localConn{c: a, w: localWriter{c: a}}, wd: wd, count: func(int) {}}
	const copiers, reports = 8, 200
	done := make(chan []uint64)
	go func() {
		r := wire.NewReader(b, 0)
		var got []uint64
		for {
			var p v1.LocalProgress
			if r.ReadMsg(&p) != nil {
				break // the copiers are done and closed their end
			}
			got = append(got, p.GetBytes())
		}
		done <- got
	}()
	var wg sync.WaitGroup
	for range copiers {
		wg.Go(func() {
			for range reports {
				lx.landedBytes(localProgressBytes)
			}
		})
	}
	wg.Wait()
	require.NoError(t, a.Close())
	got := <-done
	require.NotEmpty(t, got)
	require.True(t, slices.IsSorted(got), "progress frames never go backwards")
	require.Equal(t, uint64(copiers*reports*localProgressBytes), got[len(got)-1])
}
