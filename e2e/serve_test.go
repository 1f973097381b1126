package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// geom is the engines' model: 2 layers, 8 KV heads of 64 bf16 elements,
// 16-token blocks (32 KiB per block per region, 64 blocks per 2 MiB page).
var geom = &v1.ModelGeometry{Model: "custom", NumLayers: 2, NumKvHeads: 8, HeadDim: 64, Dtype: v1.DType_DTYPE_BFLOAT16,
	BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}

// geomFlags describe geom on the serve command line.
var geomFlags = []string{"--layers", "2", "--kv-heads", "8", "--head-dim", "64", "--dtype", "bfloat16", "--block-size", "16"}

var shape = kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 0, Heads: 8}

// engine is a Go-client "engine" beside one sidecar.
type engine struct {
	*localapi.Client
	info *v1.KVCacheInfo
}

func attach(t testing.TB, s *Sidecar, blocks uint32) *engine {
	t.Helper()
	c, err := localapi.Dial(t.Context(), s.Socket, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	info, err := c.Attach(t.Context(), &v1.CreateKVCache{Geometry: geom, TpRank: uint32(s.Opts.TPRank), TpSize: uint32(s.Opts.TPSize), NumBlocks: blocks})
	require.NoError(t, err)
	return &engine{Client: c, info: info}
}

// fill writes request key's KV into blocks through the engine's mapping.
func (e *engine) fill(t testing.TB, key uint64, blocks []uint32) {
	t.Helper()
	for r := range int(e.info.GetNumRegions()) {
		for k, id := range blocks {
			b, err := e.Block(r, int(id))
			require.NoError(t, err)
			kvgen.FillBlock(b, shape, key, r, k*16)
		}
	}
}

// check verifies every byte through the engine's mapping.
func (e *engine) check(t testing.TB, key uint64, blocks []uint32) {
	t.Helper()
	for r := range int(e.info.GetNumRegions()) {
		for k, id := range blocks {
			b, err := e.Block(r, int(id))
			require.NoError(t, err)
			bad, first := kvgen.CheckBlock(b, shape, key, r, k*16)
			require.Zero(t, bad, "region %d block %d: %d bytes differ, first at %d", r, id, bad, first)
		}
	}
}

// waitFinished polls GetFinished (as an engine's scheduler loop does)
// until done accepts what arrived.
func (e *engine) waitFinished(t testing.TB, timeout time.Duration, done func(*v1.GetFinishedReply) bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(timeout))
	defer cancel()
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for {
		f, err := e.GetFinished(ctx)
		require.NoError(t, err)
		if done(f) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("GetFinished: %v", context.Cause(ctx))
		case <-tick.C:
		}
	}
}

// TestServeTransfer: two serve processes, a Go engine on each; prefill KV
// written through the prefill engine's mapping arrives byte-exact in the
// decode engine's mapping; /readyz flips when the cache exists; /metrics
// counts the bytes and the handshake.
//
// fault-matrix: serve-end-to-end
// fault-matrix: same-host-nothing-left-mapped
func TestServeTransfer(t *testing.T) {
	env := NewEnv(t)
	pre := env.StartSidecar(t, SidecarOpts{Engine: "prefill-a", Role: "prefill", Args: geomFlags})
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-a", Role: "decode", Args: geomFlags})

	code, _ := pre.Get(t, "/healthz")
	require.Equal(t, http.StatusOK, code)
	code, _ = pre.Get(t, "/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code, "no KV cache yet")

	pe, de := attach(t, pre, 1024), attach(t, dec, 1024)
	for _, s := range []*Sidecar{pre, dec} {
		code, _ = s.Get(t, "/readyz")
		require.Equal(t, http.StatusOK, code, "%s has its cache and QUIC listener", s.Name)
	}

	const key = 7
	src, err := pe.Alloc(t.Context(), 100)
	require.NoError(t, err)
	pe.fill(t, key, src)
	params, err := pe.RequestFinished(t.Context(), "req-1", src, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	require.Equal(t, uint32(1), params.GetTpSize())
	// The proxy carries the params as JSON.
	js, err := connector.MarshalKVTransferParams(params)
	require.NoError(t, err)
	params, err = connector.UnmarshalKVTransferParams(js)
	require.NoError(t, err)

	dst, err := de.Alloc(t.Context(), 100)
	require.NoError(t, err)
	require.NoError(t, de.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "req-1", LocalBlockIds: dst, Params: params, RemoteHitBlocks: new(uint32(0))}))
	de.waitFinished(t, 30*time.Second, func(f *v1.GetFinishedReply) bool {
		require.Empty(t, f.GetFailed())
		return len(f.GetDoneRecving()) == 1
	})
	de.check(t, key, dst)
	pe.waitFinished(t, 30*time.Second, func(f *v1.GetFinishedReply) bool { return len(f.GetDoneSending()) == 1 })

	wantBytes := float64(100 * pe.info.GetBlockLen() * uint64(pe.info.GetNumRegions()))
	require.GreaterOrEqual(t, dec.Metric(t, "kvsidecar_transfer_bytes_total"), wantBytes, "decode counted the READ's bytes")
	require.Greater(t, dec.Metric(t, "kvsidecar_handshake_seconds_count"), 0.0, "decode ran a handshake")
	require.Greater(t, pre.Metric(t, "go_goroutines"), 0.0, "Go collector registered")
	require.Greater(t, pre.Metric(t, "process_open_fds"), 0.0, "process collector registered")
	require.Greater(t, pre.Metric(t, "kvsidecar_local_calls_total"), 0.0)
	RequirePath(t, dec)
	// The READ is over: no page of the prefill stays mapped in the decode
	// sidecar, and no file of it stays open there.
	inodes := MemfdInodes(t, pre.Cmd.Process.Pid)
	require.NotEmpty(t, inodes, "the prefill holds its pages in a memfd")
	for _, ino := range inodes {
		maps, fds := HoldsInode(t, dec.Cmd.Process.Pid, ino)
		require.Zero(t, maps, "decode maps none of the prefill's pages after the READ")
		require.Zero(t, fds, "decode holds no file of the prefill after the READ")
	}
}

// TestServeCtlLimit: ctl stats and limit against a running sidecar; values
// out of range are refused (exit 2 for syntax, 1 for the sidecar's range), a
// limit below use stops growth until it is raised.
//
// fault-matrix: memory-limit-lowered
func TestServeCtlLimit(t *testing.T) {
	env := NewEnv(t)
	s := env.StartSidecar(t, SidecarOpts{Engine: "limits"})
	e := attach(t, s, 4096)
	perPage := int(e.info.GetPageSize() / e.info.GetBlockLen())
	pageBytes := e.info.GetPageSize() * uint64(e.info.GetNumRegions())

	ids, err := e.Alloc(t.Context(), 3*perPage) // 4 pages with the null block
	require.NoError(t, err)
	// One accepted range for this cache, whichever side a value misses.
	accepted := fmt.Sprintf("accepted range [%d, %d]", pageBytes, s.Stats(t)["reservation_bytes"])

	tests := []struct {
		name     string
		args     []string
		wantCode int
		wantOut  string
	}{
		{"stats", []string{"stats"}, 0, "blocks_used: " + strconv.Itoa(3*perPage)},
		{"zero percent", []string{"limit", "0%"}, 2, "(0 %, 100 %]"},
		{"over 100 percent", []string{"limit", "101%"}, 2, "(0 %, 100 %]"},
		// The range depends on the sidecar: its refusals exit 1, not 2.
		{"above the reservation", []string{"limit", "1TiB"}, 1, accepted},
		{"below one page of every region", []string{"limit", "1KiB"}, 1, accepted},
		{"stats as JSON", []string{"stats", "--json"}, 0, `"blocks_used":` + strconv.Itoa(3*perPage) + `,`},
		{"negative", []string{"limit", "-5GiB"}, 2, "limit: -5GiB: the limit must be positive"},
		{"missing value", []string{"limit"}, 2, "limit: missing VALUE"},
		{"below use, strict", []string{"limit", "8MiB", "--strict"}, 1, "below the"},
		{"lower", []string{"limit", "10MiB"}, 0, "memory limit: 10485760 bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := s.Ctl(t, tc.args...)
			require.Equal(t, tc.wantCode, code, "stdout %q stderr %q", out, errOut)
			require.Contains(t, out+errOut, tc.wantOut)
			if tc.wantCode == 1 {
				require.NotContains(t, errOut, "usage", "a refusal is not a command-line error")
			}
		})
	}
	// 4 page indices hold the blocks; 10 MiB allows one page index (of 4
	// regions × 2 MiB), so the limit is below use and nothing can grow.
	require.Less(t, uint64(10<<20), 4*pageBytes)
	_, err = e.Alloc(t.Context(), 3*perPage)
	require.Equal(t, v1.Code_CODE_BUSY, codes.Of(err), "an alloc beyond the lowered limit fails over limit: %v", err)

	code, out, errOut := s.Ctl(t, "limit", "100%")
	require.Zero(t, code, errOut)
	require.Contains(t, out, "100.0% of the")
	more, err := e.Alloc(t.Context(), 3*perPage)
	require.NoError(t, err, "raising the limit lets allocation grow again")
	require.NoError(t, e.Free(t.Context(), append(ids, more...)))
}

// TestServeSIGTERM: SIGTERM to the prefill sidecar while decode reads from
// it; the read completes or fails with a code on decode, prefill exits 0
// within the drain deadline and removes its socket.
//
// fault-matrix: drain-mid-read
func TestServeSIGTERM(t *testing.T) {
	env := NewEnv(t)
	pre := env.StartSidecar(t, SidecarOpts{Engine: "prefill-t", Args: []string{"--drain-timeout", "5s"}})
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-t"})
	pe, de := attach(t, pre, 8192), attach(t, dec, 8192)

	const n = 4000 // 4000 × 16 KiB × 4 regions = 250 MiB
	src, err := pe.Alloc(t.Context(), n)
	require.NoError(t, err)
	pe.fill(t, 9, src)
	params, err := pe.RequestFinished(t.Context(), "big", src, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	dst, err := de.Alloc(t.Context(), n)
	require.NoError(t, err)
	require.NoError(t, de.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "big", LocalBlockIds: dst, Params: params, RemoteHitBlocks: new(uint32(0))}))
	start := time.Now()
	pre.Signal(t, syscall.SIGTERM)

	require.Zero(t, pre.Wait(t, ExitTimeout), "prefill exits 0")
	require.Less(t, time.Since(start), testutil.Scaled(5*time.Second+10*time.Second), "within the drain deadline plus start-up slack")
	_, err = os.Stat(pre.Socket)
	require.ErrorIs(t, err, os.ErrNotExist, "the socket file is gone")
	pre.WaitLog(t, "stopped", time.Second)

	var done bool
	var failed *v1.FailedRequest
	de.waitFinished(t, 60*time.Second, func(f *v1.GetFinishedReply) bool {
		done = done || len(f.GetDoneRecving()) > 0
		if len(f.GetFailed()) > 0 {
			failed = f.GetFailed()[0]
		}
		return done || failed != nil
	})
	if done {
		de.check(t, 9, dst)
		return
	}
	require.NotEqual(t, v1.Code_CODE_OK, failed.GetError().GetCode(), "a failed load carries a code")
	require.Len(t, failed.GetBlockIds(), n, "every local block is reported for recompute")
	t.Logf("load failed on decode with %v: %s", failed.GetError().GetCode(), failed.GetError().GetMessage())
}

// TestServeBadInput: bad input on the socket gets an error reply or a closed
// connection; the sidecar keeps serving.
//
// fault-matrix: local-api-bad-input
func TestServeBadInput(t *testing.T) {
	env := NewEnv(t)
	s := env.StartSidecar(t, SidecarOpts{Engine: "bad", Args: geomFlags})
	good := attach(t, s, 512)

	send := func(t *testing.T, b []byte) *v1.LocalReply {
		t.Helper()
		nc, err := net.Dial("unix", s.Socket)
		require.NoError(t, err)
		defer nc.Close()
		require.NoError(t, nc.SetDeadline(time.Now().Add(testutil.Scaled(10*time.Second))))
		_, err = nc.Write(b)
		require.NoError(t, err)
		// The engine gives up on the frame: the sidecar sees the stream
		// end inside it.
		require.NoError(t, nc.(*net.UnixConn).CloseWrite())
		rep := &v1.LocalReply{}
		if err := wire.NewReader(nc, 0).ReadMsg(rep); err != nil {
			return nil // closed without a reply
		}
		return rep
	}
	frame := func(req *v1.LocalRequest) []byte {
		b, err := wire.AppendFrame(nil, req, 0)
		require.NoError(t, err)
		return b
	}
	other := &v1.ModelGeometry{Model: "custom", NumLayers: 4, NumKvHeads: 8, HeadDim: 64, Dtype: v1.DType_DTYPE_BFLOAT16,
		BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}
	tests := []struct {
		name string
		b    []byte
		code v1.Code
	}{
		{"garbage", []byte("GET / HTTP/1.1\r\n\r\n"), v1.Code_CODE_INVALID_ARGUMENT},
		{"oversized frame", append([]byte{0x80, 0x80, 0x80, 0x80, 0x04}, 1, 2, 3), v1.Code_CODE_INVALID_ARGUMENT},
		{"unknown call", frame(&v1.LocalRequest{WireVersion: 1}), v1.Code_CODE_INVALID_ARGUMENT},
		{"other geometry", frame(&v1.LocalRequest{WireVersion: 1, Call: &v1.LocalRequest_Create{Create: &v1.CreateKVCache{Geometry: other, TpSize: 1}}}), v1.Code_CODE_ALREADY_EXISTS},
		{"tp mismatch", frame(&v1.LocalRequest{WireVersion: 1, Call: &v1.LocalRequest_Create{Create: &v1.CreateKVCache{Geometry: geom, TpSize: 2, TpRank: 1}}}), v1.Code_CODE_ALREADY_EXISTS},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rep := send(t, tc.b)
			require.NotNil(t, rep, "an error reply before closing")
			require.Equal(t, tc.code, rep.GetError().GetCode(), rep.GetError().GetMessage())
		})
	}
	t.Run("block ids out of range", func(t *testing.T) {
		e := attach(t, s, 512)
		require.Equal(t, v1.Code_CODE_OUT_OF_RANGE, codes.Of(e.Free(t.Context(), []uint32{100000})))
		_, err := e.RequestFinished(t.Context(), "x", []uint32{512}, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err))
	})
	require.False(t, s.Exited())
	ids, err := good.Alloc(t.Context(), 4)
	require.NoError(t, err, "the first engine is still served")
	good.fill(t, 1, ids)
	good.check(t, 1, ids)
}

// TestServeEngineGone: an engine that exits without freeing leaves no blocks
// behind; the next engine can allocate the whole pool (a decode engine's
// exit used to leave blocks_used at 2000 and the next Alloc failed with
// CODE_BUSY).
func TestServeEngineGone(t *testing.T) {
	env := NewEnv(t)
	s := env.StartSidecar(t, SidecarOpts{Engine: "gone"})
	e := attach(t, s, 4096)
	_, err := e.Alloc(t.Context(), 2000)
	require.NoError(t, err)
	code, out, errOut := s.Ctl(t, "stats")
	require.Zero(t, code, errOut)
	require.Contains(t, out, "blocks_used: 2000\n")
	require.NoError(t, e.Close())

	line := s.WaitLog(t, "engine session ended", StartTimeout)
	require.EqualValues(t, 2000, line["blocks_freed"])
	code, out, errOut = s.Ctl(t, "stats")
	require.Zero(t, code, errOut)
	require.Contains(t, out, "blocks_used: 0\n")

	next := attach(t, s, 4096)
	ids, err := next.Alloc(t.Context(), 4095)
	require.NoError(t, err, "the next engine gets every block")
	require.Len(t, ids, 4095)
}

// TestServeCoordinatedEngineNamesNoOwnership: an engine that attaches to a
// coordinated TP group without naming the ownership (vLLM's connector does
// not) gets the group's ownership in KVCacheInfo and is treated as a
// coordinated engine: rank 1 takes RequestFinished for the blocks rank 0
// allocated (before, rank 1 took the engine for a local one and refused
// them as "not allocated in this session", and reported ownership
// UNSPECIFIED).
func TestServeCoordinatedEngineNamesNoOwnership(t *testing.T) {
	env := NewEnv(t)
	ranks := env.StartGroup(t, SidecarOpts{Engine: "coord-noown", TPSize: 2, Args: append(slices.Clone(geomFlags), "--ownership", "coordinated")})
	es := []*engine{attach(t, ranks[1], 64), attach(t, ranks[0], 64)}
	for _, e := range es {
		require.Equal(t, v1.Ownership_OWNERSHIP_COORDINATED, e.info.GetOwnership())
		require.Equal(t, uint32(64), e.info.GetNumBlocks())
	}
	ids, err := es[1].Alloc(t.Context(), 3)
	require.NoError(t, err)
	for r, e := range []*engine{es[1], es[0]} {
		p, err := e.RequestFinished(t.Context(), "req", ids, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.NoError(t, err, "rank %d", r)
		require.Equal(t, ids, p.GetRemoteBlockIds(), "rank %d", r)
		require.Equal(t, uint64(1), ranks[r].Stats(t)["leases_held"], "rank %d", r)
	}
}
