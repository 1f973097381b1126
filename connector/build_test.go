package connector_test

import (
	"context"
	"errors"
	"os"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/tpgroup"
)

// closeCounter is a host backend that counts its Close calls.
type closeCounter struct {
	vmm.Backend
	closed atomic.Int32
}

func (c *closeCounter) Close() error {
	c.closed.Add(1)
	return c.Backend.Close()
}

func hostBackend(t *testing.T) *closeCounter {
	t.Helper()
	be, err := vmm.NewHostBackend(nil)
	require.NoError(t, err)
	return &closeCounter{Backend: be}
}

func buildConfig(t *testing.T, rank, tp int, own v1.Ownership, dir string) *connector.BuildConfig {
	t.Helper()
	srv, err := testCA.ServerConfig()
	require.NoError(t, err)
	cli, err := testCA.ClientConfig()
	require.NoError(t, err)
	return &connector.BuildConfig{NumBlocks: 1024, Group: &tpgroup.Config{Dir: dir},
		Rank: connector.Config{EngineID: "build", TPRank: rank, TPSize: tp, Geometry: gqa8, Ownership: own,
			Transfer: &transfer.Config{ServerTLS: srv, ClientTLS: cli}, CapabilitySecret: []byte("0123456789abcdef-build")}}
}

// TestBuildRankCoordinated: under coordinated ownership BuildRank joins
// the ranks in a TP group: blocks rank 0 allocates are backed by pages
// mapped on the follower too, and freeing them unmaps them there; the
// tracker Track installs sees every page rank 0 maps.
func TestBuildRankCoordinated(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o700))
	follower, err := connector.BuildRank(t.Context(), buildConfig(t, 1, 2, v1.Ownership_OWNERSHIP_COORDINATED, dir))
	require.NoError(t, err)
	defer func() { require.NoError(t, follower.Close()) }()
	require.NotNil(t, follower.Group)
	var tracked atomic.Int32
	c0 := buildConfig(t, 0, 2, v1.Ownership_OWNERSHIP_COORDINATED, dir)
	c0.PreallocPages = -1
	c0.Track = func(next vmm.PageHook) vmm.PageHook {
		require.NotNil(t, next, "rank 0 maps through the group")
		return trackHook{next, &tracked}
	}
	lead, err := connector.BuildRank(t.Context(), c0)
	require.NoError(t, err)
	defer func() { require.NoError(t, lead.Close()) }()

	before := follower.Pool.Stats().PagesMapped
	perPage := lead.Pool.Stats().BlocksPerPage
	ids, err := lead.Pool.Alloc(t.Context(), 2*perPage)
	require.NoError(t, err)
	require.Equal(t, before+2, follower.Pool.Stats().PagesMapped, "the follower mapped rank 0's new pages")
	require.Equal(t, int32(2), tracked.Load(), "the tracker saw both pages")
	require.NoError(t, lead.Pool.Free(t.Context(), ids))
	require.Equal(t, before, follower.Pool.Stats().PagesMapped, "and unmapped them")
}

// trackHook counts the pages mapped through it.
type trackHook struct {
	vmm.PageHook
	n *atomic.Int32
}

func (h trackHook) MapPages(ctx context.Context, pages []int) error {
	h.n.Add(int32(len(pages)))
	return h.PageHook.MapPages(ctx, pages)
}

// TestBuildRankFailureClosesAll: a build that fails closes what it made,
// the backend it was given included; a Rank.Pool set by the caller is
// refused, naming the rule.
func TestBuildRankFailureClosesAll(t *testing.T) {
	be := hostBackend(t)
	c := buildConfig(t, 0, 1, v1.Ownership_OWNERSHIP_LOCAL, t.TempDir())
	c.Backend = be
	c.BeforeRank = func(*vmm.Pool) error { return errors.New("limit refused") }
	_, err := connector.BuildRank(t.Context(), c)
	require.EqualError(t, err, "limit refused")
	require.Equal(t, int32(1), be.closed.Load(), "the backend is closed")

	be = hostBackend(t)
	c = buildConfig(t, 0, 1, v1.Ownership_OWNERSHIP_LOCAL, t.TempDir())
	c.Backend = be
	c.Rank.Geometry = &v1.ModelGeometry{Model: "bad"}
	_, err = connector.BuildRank(t.Context(), c)
	require.ErrorIs(t, err, connector.ErrInvalidArgument)
	require.Equal(t, int32(1), be.closed.Load())

	c = buildConfig(t, 0, 1, v1.Ownership_OWNERSHIP_LOCAL, t.TempDir())
	ok, err := connector.BuildRank(t.Context(), c)
	require.NoError(t, err)
	defer func() { require.NoError(t, ok.Close()) }()
	c.Rank.Pool = ok.Pool
	_, err = connector.BuildRank(t.Context(), c)
	require.ErrorContains(t, err, "BuildConfig.Rank.Pool must be nil")
}
