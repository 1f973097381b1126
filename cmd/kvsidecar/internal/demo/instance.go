package demo

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/internal/netem"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/tpgroup"
)

// BackendFunc returns the vmm backend of one rank's pool; side is
// "prefill" or "decode". The demo closes the backend after the pool
// (connector.BuildRank owns it).
type BackendFunc func(side string, rank int) (vmm.Backend, error)

// instanceOpts describes one simulated engine instance.
type instanceOpts struct {
	engine    string
	side      string
	geom      *v1.ModelGeometry
	tp        int
	numBlocks int
	ownership v1.Ownership
	mode      handshake.Mode
	noCRC     bool          // connector.Config.DisableChecksums
	sameHost  bool          // connector.Config.SameHostSocket, in a directory of the instance's own
	lanes     int           // transfer.Config.ReadLanes
	delay     time.Duration // one-way delay on every datagram the instance sends
	sim       packetNet     // tests: listen on this simulated network (its own delay) instead of UDP
	srvTLS    *tls.Config
	cliTLS    *tls.Config
	backend   BackendFunc
	logger    *slog.Logger
	reg       prometheus.Registerer
}

// packetNet is a network to listen on instead of loopback UDP: tests pass
// an in-memory one (internal/testutil.SimNet).
type packetNet interface {
	ListenPacket(addr string) (*netem.PacketConn, error)
}

// instance is one engine instance: tp ranks, each with its own pool,
// backend and connector.Rank on 127.0.0.1. Block ids are kept equal on
// every rank by allocating and freeing all pools together under mu.
type instance struct {
	o        instanceOpts
	pools    []*vmm.Pool
	built    []*connector.Built // by rank
	ranks    []*connector.Rank
	pcs      []net.PacketConn
	addrs    []string
	heads    int // KV heads as kvgen sees them (1 for MLA)
	baseline int // physPages right after start: the null blocks' pages
	// groupDir holds the TP group's sockets under coordinated ownership,
	// and the ranks' same-host sockets.
	groupDir string

	mu sync.Mutex // lockstep Alloc/Free over the pools of owners
}

// loopbackPeers is the only address set a demo rank dials: every rank of
// the demo listens on 127.0.0.1, so params naming anything else are
// refused before a packet is sent, as `serve --allow-peers` does.
var loopbackPeers = must(transfer.ParseAllowedPeers("the demo's allowed peers", "127.0.0.1/32"))

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// newInstance starts o.tp ranks. On error everything started is closed.
func newInstance(ctx context.Context, o instanceOpts) (in *instance, err error) {
	in = &instance{o: o, heads: int(o.geom.GetNumKvHeads())}
	if o.geom.GetAttention() == v1.Attention_ATTENTION_MLA {
		in.heads = 1
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, in.close())
		}
	}()
	// Listen first so every rank knows every rank's address.
	for range o.tp {
		if o.sim != nil {
			pc, lerr := o.sim.ListenPacket("127.0.0.1:0")
			if lerr != nil {
				return in, lerr
			}
			in.pcs = append(in.pcs, pc)
			in.addrs = append(in.addrs, pc.LocalAddr().String())
			continue
		}
		udp, lerr := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if lerr != nil {
			return in, fmt.Errorf("demo: %s: listen: %w", o.side, lerr)
		}
		var pc net.PacketConn = udp
		if o.delay > 0 {
			// Delays every datagram in order, keeping quic-go's batch I/O
			// and GSO.
			pc = netem.NewUDP(udp, o.delay)
		}
		in.pcs = append(in.pcs, pc)
		in.addrs = append(in.addrs, udp.LocalAddr().String())
	}
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	in.built = make([]*connector.Built, o.tp)
	in.pools = make([]*vmm.Pool, o.tp)
	in.ranks = make([]*connector.Rank, o.tp)
	order := make([]int, o.tp)
	for r := range order {
		order[r] = r
	}
	var group *tpgroup.Config
	if in.coordinated() || o.sameHost && o.sim == nil {
		// The TP group's and the same-host sockets live in a directory
		// of their own (MkdirTemp makes it 0700).
		if in.groupDir, err = os.MkdirTemp("", "kvsidecar-demo-tp-*"); err != nil {
			return in, fmt.Errorf("demo: %s: socket directory: %w", o.side, err)
		}
	}
	if in.coordinated() {
		// The followers are built first, so rank 0 maps pages on every
		// rank from its first one on.
		group = &tpgroup.Config{Dir: in.groupDir, Logger: o.logger}
		slices.Reverse(order)
	}
	for _, r := range order {
		var be vmm.Backend
		if o.backend != nil {
			if be, err = o.backend(o.side, r); err != nil {
				return in, fmt.Errorf("demo: %s rank %d: backend: %w", o.side, r, err)
			}
		}
		sameHost := ""
		if o.sameHost && o.sim == nil {
			if sameHost, err = connector.SameHostSocketPath(in.groupDir, o.engine, r); err != nil {
				return in, fmt.Errorf("demo: %s rank %d: %w", o.side, r, err)
			}
		}
		// No prealloc reserve: a page is mapped only while a block in it is
		// allocated, so the pages still mapped after the run show leaks.
		b, berr := connector.BuildRank(ctx, &connector.BuildConfig{NumBlocks: o.numBlocks, Backend: be, PreallocPages: -1, Group: group,
			Rank: connector.Config{EngineID: o.engine, TPRank: r, TPSize: o.tp, Geometry: o.geom,
				Transfer: &transfer.Config{PacketConn: in.pcs[r], ServerTLS: o.srvTLS, ClientTLS: o.cliTLS,
					AllowedPeers: loopbackPeers, ReadLanes: o.lanes, Logger: o.logger, Registerer: o.reg},
				RankAddrs: in.addrs, CapabilitySecret: secret, Ownership: o.ownership,
				HandshakeMode: o.mode, DisableChecksums: o.noCRC, SameHostSocket: sameHost, Logger: o.logger, Registerer: o.reg}})
		if berr != nil {
			return in, fmt.Errorf("demo: %s rank %d: %w", o.side, r, berr)
		}
		in.pcs[r] = nil // the rank's agent owns and closes it now
		in.built[r], in.pools[r], in.ranks[r] = b, b.Pool, b.Rank
	}
	in.baseline = in.physPages()
	return in, nil
}

// close closes every rank with its TP group, pool and backend, rank 0
// first (it drives the followers' pages), and the sockets of ranks that
// never started.
func (in *instance) close() error {
	var errs []error
	for _, b := range in.built {
		if b != nil {
			errs = append(errs, b.Close())
		}
	}
	for _, pc := range in.pcs {
		if pc != nil {
			errs = append(errs, pc.Close())
		}
	}
	if in.groupDir != "" {
		errs = append(errs, os.RemoveAll(in.groupDir))
	}
	in.built, in.ranks, in.pcs, in.pools, in.groupDir = nil, nil, nil, nil, ""
	return errors.Join(errs...)
}

// coordinated reports whether rank 0 owns the blocks and maps the
// followers' pages through the TP group.
func (in *instance) coordinated() bool {
	return in.o.ownership == v1.Ownership_OWNERSHIP_COORDINATED && in.o.tp > 1
}

// owners are the pools blocks are allocated and freed in: rank 0's under
// coordinated ownership (the TP group maps its pages on every rank),
// otherwise every pool, in lockstep.
func (in *instance) owners() []*vmm.Pool {
	if in.coordinated() {
		return in.pools[:1]
	}
	return in.pools
}

// alloc allocates n blocks; the ids are the same on every rank.
func (in *instance) alloc(ctx context.Context, n int) ([]uint32, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	var ids []int
	pools := in.owners()
	for r, p := range pools {
		got, err := p.Alloc(ctx, n)
		if err == nil && r > 0 && !slices.Equal(got, ids) {
			_ = p.Free(ctx, got)
			err = fmt.Errorf("demo: %s rank %d allocated other block ids than rank 0 (pools out of lockstep)", in.o.side, r)
		}
		if err != nil {
			for _, q := range pools[:r] {
				_ = q.Free(context.WithoutCancel(ctx), ids)
			}
			return nil, fmt.Errorf("demo: %s: alloc %d blocks on rank %d: %w", in.o.side, n, r, err)
		}
		ids = got
	}
	return kvgeom.Wire(ids), nil
}

// free frees ids where alloc allocated them.
func (in *instance) free(ids []uint32) error {
	if len(ids) == 0 {
		return nil
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	b := kvgeom.Ints(ids)
	var errs []error
	for r, p := range in.owners() {
		if err := p.Free(context.Background(), b); err != nil {
			errs = append(errs, fmt.Errorf("demo: %s: free on rank %d: %w", in.o.side, r, err))
		}
	}
	return errors.Join(errs...)
}

// shape is the kvgen shape of one block of one region on rank r.
func (in *instance) shape(r int) (kvgen.Shape, error) {
	hs, err := connector.RankHeads(in.heads, in.o.tp, r)
	if err != nil {
		return kvgen.Shape{}, err
	}
	db, err := kvgeom.DTypeBytes(in.o.geom.GetDtype())
	if err != nil {
		return kvgen.Shape{}, err
	}
	return kvgen.Shape{BlockSize: int(in.o.geom.GetBlockSize()), RowBytes: int(in.o.geom.GetHeadDim()) * db,
		FirstHead: hs.First, Heads: hs.Count}, nil
}

// physPages is the number of physical pages mapped on every rank together
// (each region's page of the null block, mapped for the life of a pool,
// included).
func (in *instance) physPages() int {
	n := 0
	for _, p := range in.pools {
		s := p.Stats()
		n += s.PagesMapped * s.NumRegions
	}
	return n
}
