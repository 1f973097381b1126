package demo

import (
	"context"
	crand "crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// The path rows of the transfer bench: the bulk's bytes read between two
// vmm pools (the serving agent's, "prefill", and the readers', "decode"),
// the way two ranks of the demo read, on each way the bytes can travel
// (the same-host path: the reader maps the peer's pages and copies; the
// QUIC path), beside the floors of the same run. On the host backend both
// pools take their pages from one memfd (one HostBackend), so the memcpy
// floor copies between two mappings of one memfd, as the same-host READ
// does; on the cuda backend each pool has its own backend, one exporting
// its pages and the other importing them, as two sidecars do.

// pathBench is the two pools, the serving agent and one reading agent per
// lane count.
type pathBench struct {
	c          TransferConfig
	src, dst   *vmm.Pool
	srcR, dstR vmm.RegionInfo
	device     bool // the pools hold device memory (no HostBytes)
	// srcOff and dstOff are the byte offsets of the READ's descriptors
	// in the two regions (blocks 1..n), each blockBytes long.
	srcOff, dstOff []uint64
	blockBytes     int
	srv            *transfer.Agent
	srcMem         *connector.PoolMemory // the serving agent's view of src
	readers        []*transfer.Agent     // by index into lanes
	lanes          []int
	closers        []func() error // run in reverse order by close
}

// total is the bytes of one READ.
func (p *pathBench) total() int { return p.blockBytes * len(p.srcOff) }

// newPathBench makes the pools (backends from c.Backend, or one host
// backend for both), fills the source, and starts the serving agent and
// the readers. A backend that does not load (no GPU, no driver) fails it
// before anything else runs. On error everything made is closed.
func newPathBench(ctx context.Context, c TransferConfig, blockBytes, n int, lanes []int, st, ct *tls.Config) (_ *pathBench, err error) {
	p := &pathBench{c: c, blockBytes: blockBytes, lanes: lanes}
	defer func() {
		if err != nil {
			err = errors.Join(err, p.close())
		}
	}()
	var srcBE, dstBE vmm.Backend
	if c.Backend == nil {
		hb, err := vmm.NewHostBackend(&vmm.HostConfig{Name: "kvsidecar-bench"})
		if err != nil {
			return p, fmt.Errorf("demo: transfer bench: host backend: %w", err)
		}
		p.closers = append(p.closers, hb.Close)
		srcBE, dstBE = hb, hb
	} else {
		for _, side := range []string{"prefill", "decode"} {
			be, err := c.Backend(side, 0)
			if err != nil {
				return p, fmt.Errorf("demo: transfer bench: %s backend: %w", side, err)
			}
			p.closers = append(p.closers, be.Close)
			if side == "prefill" {
				srcBE = be
			} else {
				dstBE = be
			}
		}
	}
	// One region of n+1 blocks of blockBytes (block 0 is the null block):
	// one layer, one head of blockBytes/2 elements of one byte, K and V
	// together.
	layout := vmm.Layout{Layers: 1, Compound: true, BlockSize: 1, HeadsPerRank: 1, HeadDim: blockBytes / 2, DTypeBytes: 1}
	pool := func(be vmm.Backend) (*vmm.Pool, []uint64, error) {
		pl, err := vmm.NewPool(ctx, &vmm.Config{Backend: be, Layout: layout, NumBlocks: n + 1, PreallocPages: -1, Logger: c.Logger})
		if err != nil {
			return nil, nil, err
		}
		p.closers = append(p.closers, pl.Close)
		ids, err := pl.Alloc(ctx, n)
		if err != nil {
			return nil, nil, err
		}
		slices.Sort(ids)
		offs := make([]uint64, n)
		for i, id := range ids {
			offs[i] = pl.BlockOffset(id)
		}
		return pl, offs, nil
	}
	if p.src, p.srcOff, err = pool(srcBE); err != nil {
		return p, fmt.Errorf("demo: transfer bench: source pool: %w", err)
	}
	if p.dst, p.dstOff, err = pool(dstBE); err != nil {
		return p, fmt.Errorf("demo: transfer bench: destination pool: %w", err)
	}
	p.srcR, p.dstR = p.src.Regions()[0], p.dst.Regions()[0]
	p.device = !p.src.HostAddressable() || !p.dst.HostAddressable()
	if err := p.fill(); err != nil {
		return p, err
	}
	dir, err := os.MkdirTemp("", "kvsidecar-bench-*") // 0700: the same-host socket's directory
	if err != nil {
		return p, fmt.Errorf("demo: transfer bench: socket directory: %w", err)
	}
	p.closers = append(p.closers, func() error { return os.RemoveAll(dir) })
	srcMem, dstMem := connector.NewPoolMemory(p.src), connector.NewPoolMemory(p.dst)
	p.closers = append(p.closers, srcMem.Close, dstMem.Close) // after the agents (closed first)
	p.srcMem = srcMem
	allow := func(context.Context, *transfer.Access) error { return nil }
	p.srv, err = transfer.New(&transfer.Config{ServerTLS: st, Regions: srcMem.Regions(), Authorize: allow,
		LocalSocket: filepath.Join(dir, "peer.sock"), Share: srcMem.Share, ShareKind: srcMem.ShareKind(), Logger: c.Logger})
	if err != nil {
		return p, err
	}
	p.closers = append(p.closers, p.srv.Close)
	pc := dstMem.PeerCopier()
	for _, k := range lanes {
		a, err := transfer.New(&transfer.Config{ClientTLS: ct, Regions: dstMem.Regions(), Logger: c.Logger,
			ReadLanes: k, ReadLaneMinBytes: 1, PeerCopier: pc})
		if err != nil {
			return p, err
		}
		p.closers = append(p.closers, a.Close)
		p.readers = append(p.readers, a)
	}
	return p, nil
}

// close closes the agents, the pools and the backends, in that order.
func (p *pathBench) close() error {
	var errs []error
	for i := len(p.closers) - 1; i >= 0; i-- {
		errs = append(errs, p.closers[i]())
	}
	p.closers = nil
	return errors.Join(errs...)
}

// fill writes random bytes into every descriptor of the source.
func (p *pathBench) fill() error {
	buf := make([]byte, p.blockBytes)
	for _, off := range p.srcOff {
		_, _ = crand.Read(buf)
		if err := p.src.CopyIn(p.srcR.Index, off, buf); err != nil {
			return fmt.Errorf("demo: transfer bench: fill the source pool: %w", err)
		}
	}
	return nil
}

// xfer is the READ of every descriptor; sameHost sends it on the
// same-host path.
func (p *pathBench) xfer(sameHost bool) *transfer.Xfer {
	x := &transfer.Xfer{Op: transfer.OpRead, Peer: p.srv.Addr().String()}
	for i := range p.srcOff {
		x.Local = append(x.Local, transfer.Desc{Addr: p.dstR.Base + p.dstOff[i], Len: uint64(p.blockBytes)})
		x.Remote = append(x.Remote, transfer.Desc{Addr: p.srcR.Base + p.srcOff[i], Len: uint64(p.blockBytes)})
	}
	if sameHost {
		x.SameHost = p.srv.SameHost()
	}
	return x
}

// read runs x on reader i. With TransferConfig.Check the destination is
// zeroed first and compared with the source after; a same-host READ must
// have moved every byte on that path (no fallback to QUIC).
func (p *pathBench) read(ctx context.Context, i int, x *transfer.Xfer) error {
	path := "QUIC"
	if x.SameHost != nil {
		path = "same-host"
	}
	a := p.readers[i]
	if p.c.Check {
		if err := p.clearDst(); err != nil {
			return err
		}
	}
	before := a.SameHostBytes()
	if _, err := a.Transfer(ctx, x); err != nil {
		return fmt.Errorf("demo: transfer bench: %s READ of %d B on %d lanes: %w", path, p.total(), p.lanes[i], err)
	}
	if moved := a.SameHostBytes() - before; x.SameHost != nil && moved != uint64(p.total()) {
		return fmt.Errorf("demo: transfer bench: same-host READ of %d B on %d lanes moved %d B on the same-host path (fell back to QUIC?)",
			p.total(), p.lanes[i], moved)
	}
	if p.c.Check {
		return p.compare(fmt.Sprintf("%s READ on %d lanes", path, p.lanes[i]))
	}
	return nil
}

// clearDst zeroes every destination descriptor.
func (p *pathBench) clearDst() error {
	zero := make([]byte, p.blockBytes)
	for _, off := range p.dstOff {
		if err := p.dst.CopyIn(p.dstR.Index, off, zero); err != nil {
			return fmt.Errorf("demo: transfer bench: clear the destination: %w", err)
		}
	}
	return nil
}

// compare checks that every destination descriptor holds its source's
// bytes.
func (p *pathBench) compare(what string) error {
	a, b := make([]byte, p.blockBytes), make([]byte, p.blockBytes)
	for i := range p.srcOff {
		if err := errors.Join(p.src.CopyOut(p.srcR.Index, p.srcOff[i], a), p.dst.CopyOut(p.dstR.Index, p.dstOff[i], b)); err != nil {
			return fmt.Errorf("demo: transfer bench: check %s: %w", what, err)
		}
		if j := firstDiff(a, b); j >= 0 {
			return fmt.Errorf("demo: transfer bench: %s: byte %d of descriptor %d differs", what, j, i)
		}
	}
	return nil
}

// hostDescs returns the host bytes of every descriptor of region ri of
// pool at offs: the slices a memcpy copies.
func hostDescs(pool *vmm.Pool, ri vmm.RegionInfo, offs []uint64, n int) ([][]byte, error) {
	out := make([][]byte, len(offs))
	for i, off := range offs {
		b, err := pool.HostBytes(ri.Index, off, uint64(n))
		if err != nil {
			return nil, err
		}
		out[i] = b
	}
	return out, nil
}
