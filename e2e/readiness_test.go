package e2e

import (
	"net/http"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestServeReadinessFollowsEngine: /readyz and ctl stats follow the engine
// session, not only the cache: not ready before an engine attaches and
// after a refused attach (logged, no session started), ready naming the
// session and engine while one is attached, not ready with the reason once
// it left (the cache stays), and every "engine session started" has its
// "engine session ended" with the reason, shutdown included. Before,
// /readyz stayed ready and ctl stats said nothing of the engine after it
// left, and a session with nothing to release logged no end.
//
// fault-matrix: engine-session-readiness
func TestServeReadinessFollowsEngine(t *testing.T) {
	env := NewEnv(t)
	s := env.StartSidecar(t, SidecarOpts{Engine: "ready-e", Args: geomFlags})
	readyz := func() (int, string) { t.Helper(); return s.Get(t, "/readyz") }

	code, body := readyz()
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "not ready: no KV cache yet (no engine has attached with a create call)\n", body)
	require.Equal(t, map[string]uint64{"cache_ready": 0, "engine_attached": 0}, s.Stats(t))

	// An attach the sidecar refuses starts no session and is logged.
	bad, err := localapi.Dial(t.Context(), s.Socket, nil)
	require.NoError(t, err)
	_, err = bad.Attach(t.Context(), &v1.CreateKVCache{Geometry: geom, TpRank: 0, TpSize: 2, NumBlocks: 64})
	require.Error(t, err)
	refused := s.WaitLog(t, "engine attach refused", StartTimeout)
	require.Equal(t, v1.Code_CODE_TP_MISMATCH.String(), refused["code"])
	require.NoError(t, bad.Close())
	code, _ = readyz()
	require.Equal(t, http.StatusServiceUnavailable, code)

	e := attach(t, s, 64)
	started := s.WaitLog(t, "engine session started", StartTimeout)
	require.EqualValues(t, 1, started["session"])
	require.Equal(t, "ready-e", started["engine_id"])
	code, body = readyz()
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ready: engine session 1 attached (engine_id ready-e, tp_rank 0 of tp_size 1, 1 connections), KV cache and QUIC listener up\n", body)
	st := s.Stats(t)
	require.Equal(t, uint64(1), st["engine_attached"])
	require.Equal(t, uint64(1), st["engine_session"])

	require.NoError(t, e.Close())
	ended := s.WaitLog(t, "engine session ended", StartTimeout)
	require.EqualValues(t, 1, ended["session"])
	require.Equal(t, "the engine closed its connection (it exited, stopped or was killed)", ended["reason"])
	code, body = readyz()
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "not ready: no engine attached: engine session 1 ended: the engine closed its connection (it exited, stopped or was killed); "+
		"a sidecar serves only while its engine is attached\n", body)
	st = s.Stats(t)
	require.Equal(t, uint64(1), st["cache_ready"], "the cache outlives its engine session")
	require.Equal(t, uint64(0), st["engine_attached"])
	require.Equal(t, uint64(0), st["engine_session"])

	// The next engine starts session 2; a sidecar that shuts down under it
	// ends it with that reason.
	attach(t, s, 64)
	require.EqualValues(t, 2, s.WaitLogN(t, "engine session started", 2, StartTimeout)["session"])
	code, _ = readyz()
	require.Equal(t, http.StatusOK, code)
	s.Signal(t, syscall.SIGTERM)
	require.Equal(t, 0, s.Wait(t, ExitTimeout))
	ended = s.WaitLogN(t, "engine session ended", 2, StartTimeout)
	require.EqualValues(t, 2, ended["session"])
	require.Equal(t, "the sidecar is shutting down", ended["reason"])
	require.Len(t, logsWith(s.Proc, "engine session started"), 2, "the refused attach started none")
}
