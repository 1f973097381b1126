package tpgroup

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// MaxTPSize is the largest TP size a group accepts: kvgeom.MaxTPSize, the
// bound connector and handshake apply too.
const MaxTPSize = kvgeom.MaxTPSize

// MaxEngineIDLen is the longest engine id accepted, in bytes.
const MaxEngineIDLen = 256

// DefaultPeerTimeout is Config.PeerTimeout when it is zero.
const DefaultPeerTimeout = 5 * time.Second

// MaxPeerTimeout is the largest Config.PeerTimeout accepted.
const MaxPeerTimeout = 10 * time.Minute

// Ownership says who allocates blocks in a TP group.
type Ownership int

const (
	// OwnershipCoordinated (vLLM: one block-id space shared by all ranks):
	// rank 0 allocates and maps, then tells ranks 1..N-1 to map the same
	// pages. It is the zero value.
	OwnershipCoordinated Ownership = iota
	// OwnershipLocal (SGLang: every rank drives its own pool): each rank maps
	// its own pages and nothing is broadcast.
	OwnershipLocal
)

// String returns "coordinated" or "local".
func (o Ownership) String() string {
	switch o {
	case OwnershipCoordinated:
		return "coordinated"
	case OwnershipLocal:
		return "local"
	}
	return fmt.Sprintf("Ownership(%d)", int(o))
}

// Proto returns the wire enum value of o (OWNERSHIP_UNSPECIFIED when o is
// not a defined value).
func (o Ownership) Proto() v1.Ownership {
	switch o {
	case OwnershipCoordinated:
		return v1.Ownership_OWNERSHIP_COORDINATED
	case OwnershipLocal:
		return v1.Ownership_OWNERSHIP_LOCAL
	}
	return v1.Ownership_OWNERSHIP_UNSPECIFIED
}

// Member is who this sidecar is in its group. Every field is required and
// fixed for the life of the Group: in particular TPSize is never
// re-discovered later and never defaults to 1 (the kvcached bug).
type Member struct {
	// EngineID names the engine instance; every rank of the group has the
	// same one. Non-empty, at most MaxEngineIDLen bytes, no NUL.
	EngineID string
	// TPSize is the engine's tensor-parallel size, in [1, MaxTPSize].
	TPSize int
	// TPRank is this sidecar's rank, in [0, TPSize).
	TPRank int
	// Device is the device ordinal the rank runs on. It is advertised
	// metadata only; the socket path never depends on it.
	Device int
}

func (m Member) validate() error {
	switch {
	case m.EngineID == "":
		return fmt.Errorf("%w: Member.EngineID is empty", ErrInvalidConfig)
	case len(m.EngineID) > MaxEngineIDLen:
		return fmt.Errorf("%w: Member.EngineID is %d bytes; the limit is %d", ErrInvalidConfig, len(m.EngineID), MaxEngineIDLen)
	case strings.IndexByte(m.EngineID, 0) >= 0:
		return fmt.Errorf("%w: Member.EngineID %q contains a NUL byte", ErrInvalidConfig, m.EngineID)
	case m.TPSize < 1 || m.TPSize > MaxTPSize:
		return fmt.Errorf("%w: Member.TPSize=%d: must be set explicitly, in [1, %d]", ErrInvalidConfig, m.TPSize, MaxTPSize)
	case m.TPRank < 0 || m.TPRank >= m.TPSize:
		return fmt.Errorf("%w: Member.TPRank=%d: must be in [0, TPSize=%d)", ErrInvalidConfig, m.TPRank, m.TPSize)
	case m.Device < 0:
		return fmt.Errorf("%w: Member.Device=%d: must be >= 0", ErrInvalidConfig, m.Device)
	}
	return nil
}

// Config holds the optional settings of a Group. The zero value works and a
// nil *Config means the zero value.
type Config struct {
	// Dir is the directory of the group's sockets. It is created with mode
	// 0700 if missing; an existing one must be a directory owned by this
	// user that grants nothing to group or others. Default:
	// $XDG_RUNTIME_DIR/kvsidecar when XDG_RUNTIME_DIR is set, otherwise
	// <os.TempDir()>/kvsidecar-<uid>.
	Dir string
	// Ownership is who allocates blocks. Default (zero): OwnershipCoordinated.
	Ownership Ownership
	// PeerTimeout bounds one group operation: the whole parallel fan-out of a
	// map or unmap to ranks 1..N-1 (also capped by the caller's ctx), the
	// rollback after a failed map, a ping, and a follower serving one page
	// op. Default DefaultPeerTimeout (5s); at most MaxPeerTimeout.
	PeerTimeout time.Duration
	// MaxFrame is the largest group message accepted, in bytes. Default
	// wire.DefaultMaxFrame (4 MiB: about a million page indices).
	MaxFrame int
	// OnFree is called on ranks 1..N-1 of a coordinated group when rank 0
	// is about to free blocks (Group.FreeBlocks): it must return once this
	// rank no longer uses them (no export holds them, no transfer reads or
	// writes them; vmm.Pool.WaitUnpinned), within ctx, the group's
	// PeerTimeout. Its error goes back to rank 0. Default (nil): the follower
	// answers at once.
	OnFree func(ctx context.Context, blocks []int) error
	// Logger receives the group's logs. Default (nil): discarded.
	Logger *slog.Logger
	// Registerer receives the group's metrics (kvsidecar_tpgroup_*).
	// Default (nil): metrics are kept but not registered anywhere.
	Registerer prometheus.Registerer
}

// populate returns a copy of c (nil allowed) with defaults filled in, or an
// error naming the first field that breaks a rule.
func (c *Config) populate() (*Config, error) {
	var out Config
	if c != nil {
		out = *c
	}
	if out.Dir == "" {
		out.Dir = defaultDir()
	}
	if out.PeerTimeout == 0 {
		out.PeerTimeout = DefaultPeerTimeout
	}
	if out.MaxFrame == 0 {
		out.MaxFrame = wire.DefaultMaxFrame
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	switch {
	case out.Ownership != OwnershipCoordinated && out.Ownership != OwnershipLocal:
		return nil, fmt.Errorf("%w: Config.Ownership=%d: must be OwnershipCoordinated or OwnershipLocal", ErrInvalidConfig, int(out.Ownership))
	case out.PeerTimeout < 0 || out.PeerTimeout > MaxPeerTimeout:
		return nil, fmt.Errorf("%w: Config.PeerTimeout=%v: must be in (0, %v]", ErrInvalidConfig, out.PeerTimeout, MaxPeerTimeout)
	case out.MaxFrame < 0:
		return nil, fmt.Errorf("%w: Config.MaxFrame=%d: must be >= 0", ErrInvalidConfig, out.MaxFrame)
	case !filepath.IsAbs(out.Dir):
		return nil, fmt.Errorf("%w: Config.Dir=%q: must be an absolute path", ErrInvalidConfig, out.Dir)
	}
	out.Dir = filepath.Clean(out.Dir)
	return &out, nil
}

func defaultDir() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" && filepath.IsAbs(d) {
		return filepath.Join(d, "kvsidecar")
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("kvsidecar-%d", os.Getuid()))
}
