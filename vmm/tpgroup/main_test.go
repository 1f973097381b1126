package tpgroup

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// childEnv makes the test binary run childMain instead of the tests: a group
// member in its own process, for the killed-process test.
const childEnv = "KVSIDECAR_TPGROUP_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(childMain())
	}
	goleak.VerifyTestMain(m)
}

// childMain starts rank $RANK of engine $ENGINE in $DIR, prints "ready" and
// serves until stdin closes (or the process is killed).
func childMain() int {
	rank, _ := strconv.Atoi(os.Getenv("RANK"))
	g, err := New(context.Background(), Member{EngineID: os.Getenv("ENGINE"), TPSize: 2, TPRank: rank},
		nil, &Config{Dir: os.Getenv("DIR"), Ownership: OwnershipLocal})
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Println("ready")
	bufio.NewReader(os.Stdin).ReadString('\n')
	g.Close()
	return 0
}

// sockDir returns a fresh socket directory (not yet created) that is short
// enough for sun_path.
func sockDir(t testing.TB) string {
	t.Helper()
	return filepath.Join(t.TempDir(), "s")
}

// startGroup starts a member and closes it at the end of the test.
func startGroup(t testing.TB, m Member, pool PagePool, cfg *Config) *Group {
	t.Helper()
	g, err := New(t.Context(), m, pool, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, g.Close()) })
	return g
}

// rawCall sends one request over a fresh connection to path and returns the
// answer.
func rawCall(t testing.TB, path string, req *v1.GroupRequest) *v1.GroupResponse {
	t.Helper()
	c, err := net.Dial("unix", path)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, wire.WriteMsg(c, req, 0))
	var resp v1.GroupResponse
	require.NoError(t, wire.NewReader(c, 0).ReadMsg(&resp))
	return &resp
}

func pingReq(engine string, tpSize, from, to uint32) *v1.GroupRequest {
	return &v1.GroupRequest{
		WireVersion: v1.WireVersion_WIRE_VERSION_1, EngineId: engine, TpSize: tpSize,
		FromRank: from, ToRank: to, Body: &v1.GroupRequest_Ping{Ping: true},
	}
}

// rawReply reads one answer from c.
func rawReply(t testing.TB, c net.Conn) *v1.GroupResponse {
	t.Helper()
	var resp v1.GroupResponse
	require.NoError(t, wire.NewReader(c, 0).ReadMsg(&resp))
	return &resp
}

// hash12 is the engine-id tag SocketPath appends to a sanitized id.
func hash12(id string) string {
	s := sha256.Sum256([]byte(id))
	return hex.EncodeToString(s[:])[:12]
}
