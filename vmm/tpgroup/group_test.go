package tpgroup

import (
	"bufio"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestWorldSizeFixed: the TP size is fixed at start.
//
// fault-matrix: tp-size-fixed
func TestWorldSizeFixed(t *testing.T) {
	dir := sockDir(t)
	cfg := &Config{Dir: dir, Ownership: OwnershipLocal}
	g0 := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 0}, nil, cfg)
	g1 := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, cfg)
	require.NoError(t, g0.Ping(t.Context(), 1))
	require.NoError(t, g1.Ping(t.Context(), 0))

	t.Run("later source reports 1", func(t *testing.T) {
		resp := rawCall(t, g1.Info().SocketPath, pingReq("eng", 1, 0, 1))
		require.Equal(t, v1.Code_CODE_TP_MISMATCH, resp.GetError().GetCode())
		require.Contains(t, resp.GetError().GetMessage(), "tp_size=1")
		require.EqualValues(t, 2, resp.GetTpSize())
		require.Equal(t, 2, g1.TPSize())
		require.Equal(t, 2, g1.Info().TPSize)
		require.NoError(t, g0.Ping(t.Context(), 1), "the group still works with its own size")
	})

	t.Run("member claiming 4 is refused", func(t *testing.T) {
		before := g0.Counters().Refused
		rogue := startGroup(t, Member{EngineID: "eng", TPSize: 4, TPRank: 3}, nil, cfg)
		err := rogue.Ping(t.Context(), 0)
		require.ErrorIs(t, err, ErrTPMismatch)
		require.Equal(t, v1.Code_CODE_TP_MISMATCH, codes.Of(err))
		var re *RankError
		require.ErrorAs(t, err, &re)
		require.Equal(t, 0, re.Rank)
		require.Equal(t, before+1, g0.Counters().Refused)
		require.Equal(t, 2, g0.TPSize())
	})

	t.Run("peer answering with another size is refused", func(t *testing.T) {
		// Same engine and rank 1 of a 4-way group, in another directory so its
		// socket path is rank 1's path as seen from a 2-way rank 0 there.
		dir2 := sockDir(t)
		startGroup(t, Member{EngineID: "eng", TPSize: 4, TPRank: 1}, nil, &Config{Dir: dir2, Ownership: OwnershipLocal})
		g := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 0}, nil, &Config{Dir: dir2, Ownership: OwnershipLocal})
		err := g.Ping(t.Context(), 1)
		require.ErrorIs(t, err, ErrTPMismatch)
		require.Equal(t, v1.Code_CODE_TP_MISMATCH, codes.Of(err))
	})
}

func TestRequestRules(t *testing.T) {
	dir := sockDir(t)
	g := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, &Config{Dir: dir, Ownership: OwnershipLocal})
	mapOp := &v1.GroupRequest_PageOp{PageOp: &v1.PageOp{Kind: v1.PageOp_KIND_MAP, Pages: []uint32{0}}}
	tests := []struct {
		name string
		edit func(r *v1.GroupRequest)
		code v1.Code
		msg  string
	}{
		{"ok ping", func(r *v1.GroupRequest) {}, v1.Code_CODE_OK, ""},
		{"wire version", func(r *v1.GroupRequest) { r.WireVersion = 0 }, v1.Code_CODE_INCOMPATIBLE_MODEL, "wire_version"},
		{"engine id", func(r *v1.GroupRequest) { r.EngineId = "other" }, v1.Code_CODE_NOT_FOUND, `"other"`},
		{"tp size", func(r *v1.GroupRequest) { r.TpSize = 8 }, v1.Code_CODE_TP_MISMATCH, "tp_size=8"},
		{"wrong target", func(r *v1.GroupRequest) { r.ToRank = 0 }, v1.Code_CODE_INVALID_ARGUMENT, "for rank 0 reached rank 1"},
		{"from self", func(r *v1.GroupRequest) { r.FromRank = 1 }, v1.Code_CODE_INVALID_ARGUMENT, "from_rank=1"},
		{"from beyond size", func(r *v1.GroupRequest) { r.FromRank = 7 }, v1.Code_CODE_INVALID_ARGUMENT, "from_rank=7"},
		{"no body", func(r *v1.GroupRequest) { r.Body = nil }, v1.Code_CODE_INVALID_ARGUMENT, "no body"},
		{"page op in local mode", func(r *v1.GroupRequest) { r.Body = mapOp }, v1.Code_CODE_INVALID_ARGUMENT, "ownership is local"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := pingReq("eng", 2, 0, 1)
			tc.edit(req)
			resp := rawCall(t, g.Info().SocketPath, req)
			require.Equal(t, tc.code, resp.GetError().GetCode(), resp.GetError().GetMessage())
			require.Contains(t, resp.GetError().GetMessage(), tc.msg)
		})
	}
	require.Zero(t, g.Counters().MapsServed)
}

func TestBadFrame(t *testing.T) {
	g := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, &Config{Dir: sockDir(t), Ownership: OwnershipLocal, MaxFrame: 64})
	c, err := net.Dial("unix", g.Info().SocketPath)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write([]byte{0xff, 0x01}) // declares a 255-byte frame, over MaxFrame
	require.NoError(t, err)
	resp := rawReply(t, c)
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, resp.GetError().GetCode())
	require.Contains(t, resp.GetError().GetMessage(), "exceeds the limit of 64 bytes")
}

// TestSocketPath: rank-keyed socket paths.
//
// fault-matrix: rank-keyed-sockets
func TestSocketPath(t *testing.T) {
	tests := []struct {
		name, dir, engine string
		rank              int
		want              string
	}{
		{"plain", "/run/kvs", "prefill-a", 0, "/run/kvs/kvsidecar-prefill-a-tp0.sock"},
		{"rank 3", "/run/kvs", "prefill-a", 3, "/run/kvs/kvsidecar-prefill-a-tp3.sock"},
		{"dir cleaned", "/run//kvs/", "e.1_x", 1, "/run/kvs/kvsidecar-e.1_x-tp1.sock"},
		{"sanitized and hashed", "/run/kvs", "a/b c", 0, "/run/kvs/kvsidecar-a_b_c-" + hash12("a/b c") + "-tp0.sock"},
		{"long id shortened", "/run/kvs", strings.Repeat("x", 200), 12,
			"/run/kvs/kvsidecar-" + strings.Repeat("x", 107-len("/run/kvs/kvsidecar-")-len("-tp12.sock")-13) + "-" + hash12(strings.Repeat("x", 200)) + "-tp12.sock"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := SocketPath(tc.dir, tc.engine, tc.rank)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			require.LessOrEqual(t, len(got), 107)
		})
	}

	t.Run("distinct ids stay distinct", func(t *testing.T) {
		seen := map[string]string{}
		for _, id := range []string{"a/b", "a_b", "a b", "A_B", strings.Repeat("y", 300)[:256], strings.Repeat("y", 255) + "z"} {
			p, err := SocketPath("/run/kvs", id, 0)
			require.NoError(t, err)
			require.NotContains(t, seen, p, "ids %q and %q", id, seen[p])
			seen[p] = id
		}
	})

	errs := []struct {
		name, dir, engine string
		rank              int
		target            error
		msg               string
	}{
		{"relative dir", "run", "e", 0, unixsock.ErrInvalidPath, "absolute"},
		{"empty id", "/run", "", 0, ErrInvalidConfig, "EngineID is empty"},
		{"negative rank", "/run", "e", -1, ErrInvalidConfig, "TPRank=-1"},
		{"dir too long", "/" + strings.Repeat("d", 120), "e", 0, unixsock.ErrInvalidPath, "too long"},
	}
	for _, tc := range errs {
		t.Run(tc.name, func(t *testing.T) {
			_, err := SocketPath(tc.dir, tc.engine, tc.rank)
			require.ErrorIs(t, err, tc.target)
			require.ErrorContains(t, err, tc.msg)
		})
	}
}

// TestRankKeyedSockets: two groups on one machine, device ordinals that
// differ from tp_rank, a killed process's leftover socket.
//
// fault-matrix: rank-keyed-sockets
func TestRankKeyedSockets(t *testing.T) {
	dir := sockDir(t)
	cfg := &Config{Dir: dir, Ownership: OwnershipLocal}
	type member struct {
		engine       string
		rank, device int
	}
	members := []member{{"prefill", 0, 3}, {"prefill", 1, 2}, {"decode", 0, 1}, {"decode", 1, 0}}
	paths := map[string]bool{}
	for _, m := range members {
		g := startGroup(t, Member{EngineID: m.engine, TPSize: 2, TPRank: m.rank, Device: m.device}, nil, cfg)
		want := filepath.Join(dir, "kvsidecar-"+m.engine+"-tp"+string(rune('0'+m.rank))+".sock")
		require.Equal(t, want, g.Info().SocketPath)
		require.False(t, paths[want])
		paths[want] = true
		fi, err := os.Stat(want)
		require.NoError(t, err)
		require.Equal(t, os.ModeSocket|0o600, fi.Mode(), "socket mode")
	}
	fi, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.ModeDir|0o700, fi.Mode(), "dir mode")
}

func TestLiveSocketNotStolen(t *testing.T) {
	dir := sockDir(t)
	cfg := &Config{Dir: dir, Ownership: OwnershipLocal}
	g1 := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, cfg)
	_, err := New(t.Context(), Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, cfg)
	require.ErrorIs(t, err, ErrSocketInUse)
	require.ErrorContains(t, err, g1.Info().SocketPath)
	g0 := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 0}, nil, cfg)
	require.NoError(t, g0.Ping(t.Context(), 1), "the live member still serves")
}

func TestSocketRemovedOnClose(t *testing.T) {
	g, err := New(t.Context(), Member{EngineID: "eng", TPSize: 1}, nil, &Config{Dir: sockDir(t)})
	require.NoError(t, err)
	path := g.Info().SocketPath
	_, err = os.Lstat(path)
	require.NoError(t, err)
	require.NoError(t, g.Close())
	_, err = os.Lstat(path)
	require.ErrorIs(t, err, os.ErrNotExist)
	require.ErrorIs(t, g.Close(), net.ErrClosed)
}

func TestStaleSocketOfKilledProcess(t *testing.T) {
	dir := sockDir(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "RANK=1", "ENGINE=eng", "DIR="+dir)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	defer stdin.Close()
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "ready\n", line)

	path, err := SocketPath(dir, "eng", 1)
	require.NoError(t, err)
	// While the child lives its socket is not stolen.
	_, err = New(t.Context(), Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, &Config{Dir: dir, Ownership: OwnershipLocal})
	require.ErrorIs(t, err, ErrSocketInUse)

	require.NoError(t, cmd.Process.Kill())
	require.Error(t, cmd.Wait())
	fi, err := os.Lstat(path)
	require.NoError(t, err, "a killed process leaves its socket file behind")
	require.Equal(t, os.ModeSocket, fi.Mode().Type())

	g := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, &Config{Dir: dir, Ownership: OwnershipLocal})
	require.Equal(t, path, g.Info().SocketPath)
	g0 := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 0}, nil, &Config{Dir: dir, Ownership: OwnershipLocal})
	require.NoError(t, g0.Ping(t.Context(), 1))
}

func TestUnsafePaths(t *testing.T) {
	t.Run("dir open to others", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.Chmod(dir, 0o755))
		_, err := New(t.Context(), Member{EngineID: "e", TPSize: 1}, nil, &Config{Dir: dir})
		require.ErrorIs(t, err, ErrUnsafeDir)
		require.ErrorContains(t, err, "0755")
	})
	t.Run("dir is a file", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "f")
		require.NoError(t, os.WriteFile(dir, nil, 0o600))
		_, err := New(t.Context(), Member{EngineID: "e", TPSize: 1}, nil, &Config{Dir: dir})
		require.Error(t, err)
	})
	t.Run("regular file at socket path", func(t *testing.T) {
		dir := sockDir(t)
		require.NoError(t, os.Mkdir(dir, 0o700))
		path, err := SocketPath(dir, "e", 0)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(path, []byte("keep"), 0o600))
		_, err = New(t.Context(), Member{EngineID: "e", TPSize: 1}, nil, &Config{Dir: dir})
		require.ErrorIs(t, err, unixsock.ErrInvalidPath)
		require.ErrorContains(t, err, "not a socket")
		b, err := os.ReadFile(path)
		require.NoError(t, err)
		require.Equal(t, "keep", string(b))
	})
}

func TestConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		m    Member
		pool PagePool
		cfg  *Config
		msg  string
	}{
		{"tp size unset", Member{EngineID: "e"}, nil, nil, "Member.TPSize=0"},
		{"tp size too large", Member{EngineID: "e", TPSize: 2000}, nil, nil, "Member.TPSize=2000"},
		{"rank out of range", Member{EngineID: "e", TPSize: 2, TPRank: 2}, nil, nil, "Member.TPRank=2"},
		{"negative device", Member{EngineID: "e", TPSize: 1, Device: -1}, nil, nil, "Member.Device=-1"},
		{"nul in id", Member{EngineID: "e\x00", TPSize: 1}, nil, nil, "NUL"},
		{"id too long", Member{EngineID: strings.Repeat("e", 257), TPSize: 1}, nil, nil, "257 bytes"},
		{"ownership", Member{EngineID: "e", TPSize: 1}, nil, &Config{Ownership: 7}, "Config.Ownership=7"},
		{"timeout", Member{EngineID: "e", TPSize: 1}, nil, &Config{PeerTimeout: -1}, "Config.PeerTimeout=-1ns"},
		{"frame", Member{EngineID: "e", TPSize: 1}, nil, &Config{MaxFrame: -1}, "Config.MaxFrame=-1"},
		{"relative dir", Member{EngineID: "e", TPSize: 1}, nil, &Config{Dir: "x"}, `Config.Dir="x"`},
		{"follower without pool", Member{EngineID: "e", TPSize: 2, TPRank: 1}, nil, nil, "pool is nil"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(t.Context(), tc.m, tc.pool, tc.cfg)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.ErrorContains(t, err, tc.msg)
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err))
		})
	}
}

func TestDefaultsAndMetrics(t *testing.T) {
	t.Setenv("XDG_RUNTIME_DIR", sockDir(t))
	reg := prometheus.NewRegistry()
	g0 := startGroup(t, Member{EngineID: "eng", TPSize: 2}, nil, &Config{Ownership: OwnershipLocal, Registerer: reg})
	g1 := startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, &Config{Ownership: OwnershipLocal})
	require.Equal(t, filepath.Join(os.Getenv("XDG_RUNTIME_DIR"), "kvsidecar", "kvsidecar-eng-tp0.sock"), g0.Info().SocketPath)
	require.Nil(t, g0.Hook(), "local mode sets no hook")
	require.NoError(t, g0.Ping(t.Context(), 1))
	require.NoError(t, g0.Ping(t.Context(), 1))
	require.Equal(t, []uint64{0, 2}, g0.Counters().Sent)
	require.Equal(t, uint64(2), g1.Counters().Received)
	require.InDelta(t, 2, promtest.ToFloat64(g0.met.sent.WithLabelValues("1")), 0)
	n, err := promtest.GatherAndCount(reg, "kvsidecar_tpgroup_messages_sent_total")
	require.NoError(t, err)
	require.Equal(t, 1, n)

	err = g0.Ping(t.Context(), 0)
	require.ErrorIs(t, err, ErrInvalidArgument)
	// A second group on the registry (an engine's retried create) counts
	// into the same collectors instead of failing to register.
	g2, err := New(t.Context(), Member{EngineID: "eng2", TPSize: 1}, nil, &Config{Registerer: reg})
	require.NoError(t, err)
	require.Same(t, g0.met.sent, g2.met.sent)
	require.NoError(t, g2.Close())
}

// TestRegisterMetricsBeforeGroup: the families exist, at 0, before any group
// starts, and a group started later counts into them.
func TestRegisterMetricsBeforeGroup(t *testing.T) {
	reg := prometheus.NewRegistry()
	require.NoError(t, RegisterMetrics(reg, 4))
	for name, series := range map[string]int{"kvsidecar_tpgroup_messages_sent_total": 3, "kvsidecar_tpgroup_requests_served_total": 3,
		"kvsidecar_tpgroup_rollbacks_total": 1, "kvsidecar_tpgroup_op_seconds": 3} {
		n, err := promtest.GatherAndCount(reg, name)
		require.NoError(t, err)
		require.Equal(t, series, n, name)
	}
	t.Setenv("XDG_RUNTIME_DIR", sockDir(t))
	g0 := startGroup(t, Member{EngineID: "eng", TPSize: 2}, nil, &Config{Ownership: OwnershipLocal, Registerer: reg})
	startGroup(t, Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, &Config{Ownership: OwnershipLocal})
	require.NoError(t, g0.Ping(t.Context(), 1))
	require.NoError(t, promtest.GatherAndCompare(reg, strings.NewReader(`
# HELP kvsidecar_tpgroup_messages_sent_total Group messages this member sent, by target tp_rank.
# TYPE kvsidecar_tpgroup_messages_sent_total counter
kvsidecar_tpgroup_messages_sent_total{to_rank="1"} 1
kvsidecar_tpgroup_messages_sent_total{to_rank="2"} 0
kvsidecar_tpgroup_messages_sent_total{to_rank="3"} 0
`), "kvsidecar_tpgroup_messages_sent_total"), "the group counted into the series registered before it")
}
