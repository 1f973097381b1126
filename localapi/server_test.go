package localapi_test

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// localSidecar is one in-process sidecar: a Server whose Open builds a
// host pool and a Rank on loopback, the way `kvsidecar serve` does.
type localSidecar struct {
	srv    *localapi.Server
	engine string
}

func newLocalSidecar(t testing.TB, engine string, reg prometheus.Registerer) *localSidecar {
	t.Helper()
	return newLocalSidecarGeom(t, engine, reg, nil)
}

// newLocalSidecarGeom is newLocalSidecar started with a geometry (serve's
// --model), used for a create call that carries none.
func newLocalSidecarGeom(t testing.TB, engine string, reg prometheus.Registerer, g *v1.ModelGeometry) *localSidecar {
	t.Helper()
	return newLocalSidecarWith(t, engine, reg, g, nil)
}

// newLocalSidecarWith is newLocalSidecarGeom with the pool's pages from
// newBackend (nil: the host backend); a backend from it is device memory
// and closed with the pool.
func newLocalSidecarWith(t testing.TB, engine string, reg prometheus.Registerer, g *v1.ModelGeometry, newBackend func() (vmm.Backend, error)) *localSidecar {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvs")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	path, err := localapi.SocketPath(dir, engine, 0)
	require.NoError(t, err)
	srvTLS, err := testCA.ServerConfig()
	require.NoError(t, err)
	cliTLS, err := testCA.ClientConfig()
	require.NoError(t, err)
	open := func(ctx context.Context, req *v1.CreateKVCache) (*localapi.Cache, error) {
		layout, err := vmm.LayoutFor(req.GetGeometry(), int(req.GetTpRank()), int(req.GetTpSize()))
		if err != nil {
			return nil, err
		}
		tr := localapi.NewPageTracker(nil)
		var be vmm.Backend
		if newBackend != nil {
			if be, err = newBackend(); err != nil {
				return nil, err
			}
		}
		closeBackend := func() error {
			if be == nil {
				return nil
			}
			return be.Close()
		}
		pool, err := vmm.NewPool(ctx, &vmm.Config{Backend: be, Layout: layout, NumBlocks: int(req.GetNumBlocks()), PageHook: tr, Registerer: reg})
		if err != nil {
			_ = closeBackend()
			return nil, err
		}
		closeAll := func() error { return errors.Join(pool.Close(), closeBackend()) }
		rank, err := connector.NewRank(ctx, &connector.Config{EngineID: engine, TPRank: int(req.GetTpRank()), TPSize: int(req.GetTpSize()),
			Geometry: req.GetGeometry(), Pool: pool, Registerer: reg,
			// wallclock: the local API tests run on real unix sockets, outside synctest; 5 s scaled is far above a loaded machine's stalls.
			Transfer: &transfer.Config{ListenAddr: "127.0.0.1:0", ServerTLS: srvTLS, ClientTLS: cliTLS, ProgressTimeout: testutil.Scaled(5 * time.Second)}})
		if err != nil {
			_ = closeAll()
			return nil, err
		}
		return &localapi.Cache{Pool: pool, Rank: rank, Tracker: tr, Create: req, EngineID: engine, Close: closeAll,
			DeviceMemory: newBackend != nil}, nil
	}
	srv, err := localapi.NewServer(t.Context(), &localapi.ServerConfig{Path: path, Open: open, Geometry: g, Registerer: reg})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	return &localSidecar{srv: srv, engine: engine}
}

func dialLocal(t testing.TB, s *localSidecar) *localapi.Client {
	t.Helper()
	c, err := localapi.Dial(t.Context(), s.srv.Path(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func createReq(g *v1.ModelGeometry, blocks uint32) *v1.CreateKVCache {
	return &v1.CreateKVCache{Geometry: g, TpRank: 0, TpSize: 1, NumBlocks: blocks}
}

func codeOf(err error) v1.Code { return codes.Of(err) }

func TestLocalSharedMapping(t *testing.T) {
	s := newLocalSidecar(t, "prefill-a", nil)
	ok, why := s.srv.Ready()
	require.False(t, ok)
	require.Equal(t, "no KV cache yet (no engine has attached with a create call)", why)
	c := dialLocal(t, s)
	info, err := c.Attach(t.Context(), createReq(gqa8, 512))
	require.NoError(t, err)
	ok, why = s.srv.Ready()
	require.True(t, ok)
	require.Equal(t, "engine session 1 attached (engine_id prefill-a, tp_rank 0 of tp_size 1, 1 connections), KV cache and QUIC listener up", why)
	require.Equal(t, uint32(4), info.GetNumRegions(), "2 layers × K/V")
	pool := s.srv.Cache().Pool

	ids, err := c.Alloc(t.Context(), 300) // three pages of blocks (128 to a page; block 0 is the null block)
	require.NoError(t, err)
	// The engine writes through its own mapping; the sidecar sees it.
	for r := range int(info.GetNumRegions()) {
		for _, id := range ids {
			b, err := c.Block(r, int(id))
			require.NoError(t, err)
			binary.LittleEndian.PutUint64(b, uint64(r)<<32|uint64(id))
		}
	}
	for r := range int(info.GetNumRegions()) {
		for _, id := range ids {
			got, err := pool.HostBytes(r, pool.BlockOffset(int(id)), 8)
			require.NoError(t, err)
			require.Equal(t, uint64(r)<<32|uint64(id), binary.LittleEndian.Uint64(got), "region %d block %d", r, id)
		}
	}
	// And the other way.
	require.NoError(t, pool.CopyIn(1, pool.BlockOffset(int(ids[7])), []byte("from the sidecar")))
	b, err := c.Block(1, int(ids[7]))
	require.NoError(t, err)
	require.Equal(t, "from the sidecar", string(b[:16]))

	// Freeing everything unmaps the pages in the engine too: the pool keeps
	// the null block's page and its reserve, which its refill goroutine may
	// be topping up meanwhile (so no count from before the free is
	// compared: it failed 2 in 300 runs under load).
	require.Greater(t, pool.Stats().PagesMapped, 1+vmm.DefaultPreallocPages, "the blocks' three pages")
	require.NoError(t, c.Free(t.Context(), ids))
	require.LessOrEqual(t, pool.Stats().PagesMapped, 1+vmm.DefaultPreallocPages)
	_, err = c.Block(0, int(ids[len(ids)-1]))
	require.ErrorIs(t, err, localapi.ErrInvalidArgument, "the engine dropped its mapping of the unmapped page")

	st, err := c.Stats(t.Context())
	require.NoError(t, err)
	require.True(t, st.GetCacheReady())
	require.Zero(t, st.GetBlocksUsed())
}

// TestLocalReadinessFollowsTheEngine: Ready and Stats report the engine
// session, not only the cache: a session lasts while any attached
// connection is open, the cache outlives it, and a new attach starts the
// next session (before, /readyz said ready and stats nothing of the engine
// after it left).
func TestLocalReadinessFollowsTheEngine(t *testing.T) {
	s := newLocalSidecar(t, "ready-e", nil)
	sched, worker := dialLocal(t, s), dialLocal(t, s)
	_, err := sched.Attach(t.Context(), createReq(gqa8, 64))
	require.NoError(t, err)
	_, err = worker.Attach(t.Context(), createReq(gqa8, 64))
	require.NoError(t, err)
	ok, why := s.srv.Ready()
	require.True(t, ok)
	require.Equal(t, "engine session 1 attached (engine_id ready-e, tp_rank 0 of tp_size 1, 2 connections), KV cache and QUIC listener up", why)
	operator := dialLocal(t, s) // ctl stats: never attached, never counted
	st, err := operator.Stats(t.Context())
	require.NoError(t, err)
	require.True(t, st.GetEngineAttached())
	require.Equal(t, uint64(1), st.GetEngineSession())

	require.NoError(t, worker.Close())
	// wallclock: the server sees the close on its own goroutine; polled, never bounded tighter than the scaled timeout.
	require.Eventually(t, func() bool { _, why := s.srv.Ready(); return strings.Contains(why, "1 connections") },
		testutil.Scaled(10*time.Second), time.Millisecond, "one connection closed: the session goes on")
	require.NoError(t, sched.Close())
	require.Eventually(t, func() bool { ok, _ := s.srv.Ready(); return !ok }, testutil.Scaled(10*time.Second), time.Millisecond)
	_, why = s.srv.Ready()
	require.Equal(t, "no engine attached: engine session 1 ended: the engine closed its connection (it exited, stopped or was killed); "+
		"a sidecar serves only while its engine is attached", why)
	st, err = operator.Stats(t.Context())
	require.NoError(t, err)
	require.True(t, st.GetCacheReady(), "the cache outlives the session")
	require.False(t, st.GetEngineAttached())
	require.Zero(t, st.GetEngineSession())

	next := dialLocal(t, s)
	_, err = next.Attach(t.Context(), createReq(gqa8, 64))
	require.NoError(t, err)
	ok, why = s.srv.Ready()
	require.True(t, ok)
	require.Contains(t, why, "engine session 2 attached")
}

func TestLocalMemoryLimit(t *testing.T) {
	s := newLocalSidecar(t, "limit", nil)
	c := dialLocal(t, s)
	info, err := c.Attach(t.Context(), createReq(gqa8, 1024))
	require.NoError(t, err)
	pageBytes := info.GetPageSize() * uint64(info.GetNumRegions())
	perPage := info.GetPageSize() / info.GetBlockLen()

	ids, err := c.Alloc(t.Context(), int(perPage)) // page 0 holds the null block: this spans 2 pages
	require.NoError(t, err)
	tests := []struct {
		name   string
		bytes  uint64
		strict bool
		code   v1.Code
	}{
		{"below one page", pageBytes - 1, false, v1.Code_CODE_INVALID_ARGUMENT},
		{"above the reservation", 1 << 50, false, v1.Code_CODE_INVALID_ARGUMENT},
		{"below use, strict", pageBytes, true, v1.Code_CODE_INVALID_ARGUMENT},
		{"two pages", 2 * pageBytes, false, v1.Code_CODE_OK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := c.SetMemoryLimit(t.Context(), tc.bytes, tc.strict)
			require.Equal(t, tc.code, codeOf(err), "%v", err)
		})
	}
	_, err = c.Alloc(t.Context(), int(perPage))
	require.Equal(t, v1.Code_CODE_BUSY, codeOf(err), "a third page is over the limit: %v", err)
	require.NoError(t, c.SetMemoryLimit(t.Context(), 0, false))
	more, err := c.Alloc(t.Context(), int(perPage))
	require.NoError(t, err)
	require.NoError(t, c.Free(t.Context(), append(ids, more...)))
}

// TestLocalLostEngineIsNoBadFrame: an engine killed with a reply unread
// (its socket reset) is a lost connection, not a bad frame: a new user's
// sidecar warned "bad frame" for every engine it lost. A garbage frame
// still counts as one.
func TestLocalLostEngineIsNoBadFrame(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := newLocalSidecar(t, "lost-engine", reg)
	// The sum of metric name's samples with a label of value label ("": all).
	metric := func(name, label string) float64 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		sum := 0.0
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				match := label == ""
				for _, l := range m.GetLabel() {
					match = match || l.GetValue() == label
				}
				if mf.GetName() == name && match {
					sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
				}
			}
		}
		return sum
	}
	badFrames := func() float64 { return metric("kvsidecar_local_calls_total", "bad_frame") }
	send := func(b []byte) {
		nc, err := net.Dial("unix", s.srv.Path())
		require.NoError(t, err)
		defer nc.Close()
		_, err = nc.Write(b)
		require.NoError(t, err)
		require.NoError(t, nc.SetDeadline(time.Now().Add(testutil.Scaled(10*time.Second)))) // wallclock: a real unix socket; a server that never answers fails the test instead of hanging it
		rep := &v1.LocalReply{}
		require.NoError(t, wire.NewReader(nc, 0).ReadMsg(rep))
		require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, rep.GetError().GetCode())
	}
	send([]byte{0x05, 0xff, 0xff, 0xff, 0xff, 0xff})
	require.Equal(t, 1.0, badFrames())
	// An engine that sent a call and died before reading the answer: its
	// socket closes with the reply unread, so the server's next read fails
	// with ECONNRESET, as a killed vLLM's did.
	nc, err := net.Dial("unix", s.srv.Path())
	require.NoError(t, err)
	b, err := wire.AppendFrame(nil, &v1.LocalRequest{WireVersion: 1}, 0)
	require.NoError(t, err)
	_, err = nc.Write(b)
	require.NoError(t, err)
	raw, err := nc.(*net.UnixConn).SyscallConn()
	require.NoError(t, err)
	var peeked int
	require.NoError(t, raw.Read(func(fd uintptr) bool {
		peeked, _, err = unix.Recvfrom(int(fd), make([]byte, 1), unix.MSG_PEEK)
		return err != unix.EAGAIN
	}))
	require.NoError(t, err)
	require.Equal(t, 1, peeked, "the reply arrived, unread")
	require.NoError(t, nc.Close())
	// wallclock: the server sees the closed socket on its own goroutine.
	require.Eventually(t, func() bool { return metric("kvsidecar_local_connections", "") == 0 }, testutil.Scaled(10*time.Second), time.Millisecond)
	require.Equal(t, 1.0, badFrames(), "a lost engine is not a bad frame")
}

func TestLocalBadInput(t *testing.T) {
	s := newLocalSidecar(t, "bad-input", nil)
	good := dialLocal(t, s)
	_, err := good.Attach(t.Context(), createReq(gqa8, 256))
	require.NoError(t, err)

	raw := func(t *testing.T, b []byte) (*v1.LocalReply, error) {
		t.Helper()
		nc, err := net.Dial("unix", s.srv.Path())
		require.NoError(t, err)
		defer nc.Close()
		require.NoError(t, nc.SetDeadline(time.Now().Add(testutil.Scaled(10*time.Second)))) // wallclock: a real unix socket; a server that never answers fails the test instead of hanging it
		_, err = nc.Write(b)
		require.NoError(t, err)
		rep := &v1.LocalReply{}
		return rep, wire.NewReader(nc, 0).ReadMsg(rep)
	}
	frame := func(t *testing.T, req *v1.LocalRequest) []byte {
		b, err := wire.AppendFrame(nil, req, 0)
		require.NoError(t, err)
		return b
	}
	huge := binary.AppendUvarint(nil, 1<<30)
	tests := []struct {
		name string
		b    []byte
		code v1.Code
	}{
		{"garbage", []byte{0x05, 0xff, 0xff, 0xff, 0xff, 0xff}, v1.Code_CODE_INVALID_ARGUMENT},
		{"oversized frame", append(huge, 1, 2, 3), v1.Code_CODE_INVALID_ARGUMENT},
		{"no wire version", frame(t, &v1.LocalRequest{Call: &v1.LocalRequest_Sync{Sync: true}}), v1.Code_CODE_INCOMPATIBLE_MODEL},
		{"unknown call", frame(t, &v1.LocalRequest{WireVersion: 1}), v1.Code_CODE_INVALID_ARGUMENT},
		{"alloc before attach", frame(t, &v1.LocalRequest{WireVersion: 1, Call: &v1.LocalRequest_Alloc{Alloc: &v1.AllocBlocks{Count: 1}}}), v1.Code_CODE_UNAVAILABLE},
		{"other geometry", frame(t, &v1.LocalRequest{WireVersion: 1, Call: &v1.LocalRequest_Create{Create: createReq(gqa2, 256)}}), v1.Code_CODE_ALREADY_EXISTS},
		// A create without geometry attaches to the cache that exists
		// (TestLocalCreateTakesTheSidecarsGeometry); a TP size of 0 never does.
		{"create with tp_size 0", frame(t, &v1.LocalRequest{WireVersion: 1, Call: &v1.LocalRequest_Create{Create: &v1.CreateKVCache{}}}), v1.Code_CODE_INVALID_ARGUMENT},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := raw(t, tc.b)
			require.NoError(t, err)
			require.Equal(t, tc.code, rep.GetError().GetCode(), rep.GetError().GetMessage())
		})
	}
	t.Run("block ids out of range", func(t *testing.T) {
		c := dialLocal(t, s)
		_, err := c.Attach(t.Context(), createReq(gqa8, 256))
		require.NoError(t, err)
		require.Equal(t, v1.Code_CODE_OUT_OF_RANGE, codeOf(c.Free(t.Context(), []uint32{1 << 20})))
		_, err = c.RequestFinished(t.Context(), "r", []uint32{9999}, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codeOf(err))
		_, err = c.Alloc(t.Context(), 100000)
		require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codeOf(err))
		_, err = c.Block(0, 256)
		require.ErrorIs(t, err, localapi.ErrInvalidArgument)
	})
	// The first engine is still served.
	ids, err := good.Alloc(t.Context(), 3)
	require.NoError(t, err)
	require.Len(t, ids, 3)
}

// rawField appends field name of message md with the raw value v: the
// bytes of a length-delimited field (a message, a string, packed numbers)
// as they are, valid or not.
func rawField(b []byte, md protoreflect.MessageDescriptor, name string, v []byte) []byte {
	fd := md.Fields().ByName(protoreflect.Name(name))
	if fd == nil {
		panic("no field " + name)
	}
	b = protowire.AppendTag(b, fd.Number(), protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

// startLoadFrame is the frame of a StartLoad of request "r" whose
// kv_transfer_params are the raw bytes params.
func startLoadFrame(params []byte) []byte {
	meta := rawField(nil, (&v1.ReqMeta{}).ProtoReflect().Descriptor(), "request_id", []byte("r"))
	meta = rawField(meta, (&v1.ReqMeta{}).ProtoReflect().Descriptor(), "params", params)
	call := rawField(nil, (&v1.StartLoad{}).ProtoReflect().Descriptor(), "meta", meta)
	req, err := proto.Marshal(&v1.LocalRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, CallId: 7})
	if err != nil {
		panic(err)
	}
	req = rawField(req, (&v1.LocalRequest{}).ProtoReflect().Descriptor(), "start_load", call)
	return protowire.AppendBytes(nil, req)
}

// TestLocalUndecodableParams: an engine's StartLoad whose
// kv_transfer_params cannot be encoded or decoded is an invalid argument
// naming the field, never CODE_INTERNAL. The Go client does not send params
// it cannot encode, and its connection stays usable (it used to break
// it); the sidecar answers a frame whose params it cannot decode with
// CODE_INVALID_ARGUMENT naming the field, and keeps serving the engine.
//
// fault-matrix: params-undecodable
func TestLocalUndecodableParams(t *testing.T) {
	s := newLocalSidecar(t, "undecodable", nil)
	c := dialLocal(t, s)
	_, err := c.Attach(t.Context(), createReq(gqa8, 256))
	require.NoError(t, err)
	ids, err := c.Alloc(t.Context(), 2)
	require.NoError(t, err)

	t.Run("the Go client", func(t *testing.T) {
		err := c.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "r", LocalBlockIds: ids, RemoteHitBlocks: new(uint32(0)),
			Params: &v1.KVTransferParams{DoRemotePrefill: true, TpSize: new(uint32(1)), RemoteEngineId: "pre\xff", RemoteRequestId: "r",
				RemoteBlockIds: []uint32{1, 2}}})
		require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codeOf(err), "%v", err)
		require.ErrorIs(t, err, localapi.ErrInvalidArgument)
		require.ErrorContains(t, err, "field start_load.meta.params.remote_engine_id: string field contains invalid UTF-8")
		st, err := c.Stats(t.Context())
		require.NoError(t, err, "the connection is still usable: nothing was sent")
		require.Zero(t, st.GetLoadsInFlight())
	})

	pd := (&v1.KVTransferParams{}).ProtoReflect().Descriptor()
	export, err := proto.Marshal(&v1.RankExport{TpRank: 0, ExportId: 9, Capability: []byte("0123456789abcdef")})
	require.NoError(t, err)
	cut := rawField(nil, (&v1.RankExport{}).ProtoReflect().Descriptor(), "capability", []byte("0123456789abcdef"))
	for _, tc := range []struct {
		name, field string
		params      []byte
	}{
		{"a string that is not UTF-8", "start_load.meta.params.remote_engine_id", rawField(nil, pd, "remote_engine_id", []byte("pre\xff"))},
		{"the second export cut short", "start_load.meta.params.rank_exports[1].capability",
			rawField(rawField(nil, pd, "rank_exports", export), pd, "rank_exports", cut[:len(cut)-3])},
		{"a block id cut short", "start_load.meta.params.remote_block_ids", rawField(nil, pd, "remote_block_ids", []byte{1, 2, 0x80})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nc, err := net.Dial("unix", s.srv.Path())
			require.NoError(t, err)
			defer nc.Close()
			require.NoError(t, nc.SetDeadline(time.Now().Add(testutil.Scaled(10*time.Second)))) // wallclock: a real unix socket; a server that never answers fails the test instead of hanging it
			_, err = nc.Write(startLoadFrame(tc.params))
			require.NoError(t, err)
			rep := &v1.LocalReply{}
			require.NoError(t, wire.NewReader(nc, 0).ReadMsg(rep))
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, rep.GetError().GetCode(), rep.GetError().GetMessage())
			require.Contains(t, rep.GetError().GetMessage(), "field "+tc.field+": ")
		})
	}
	// The engine's own connection is served on.
	more, err := c.Alloc(t.Context(), 1)
	require.NoError(t, err)
	require.NoError(t, c.Free(t.Context(), append(ids, more...)))
}

func TestLocalSocketPath(t *testing.T) {
	tests := []struct {
		name, dir, engine string
		rank              int
		want              string
		wantErr           error
	}{
		{"plain", "/run/kvs", "prefill-a", 3, "/run/kvs/kvsidecar-prefill-a-tp3-api.sock", nil},
		{"sanitized", "/run/kvs", "a/b", 0, "/run/kvs/kvsidecar-a_b-", nil},
		{"relative dir", "run", "a", 0, "", unixsock.ErrInvalidPath},
		{"empty engine", "/run", "", 0, "", unixsock.ErrInvalidPath},
		{"bad rank", "/run", "a", -1, "", localapi.ErrInvalidArgument},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := localapi.SocketPath(tc.dir, tc.engine, tc.rank)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Contains(t, got, tc.want)
			require.Equal(t, "-tp"+string(rune('0'+tc.rank))+"-api.sock", got[len(got)-len("-tpN-api.sock"):])
		})
	}
}

func TestLocalStaleSocket(t *testing.T) {
	s := newLocalSidecar(t, "stale", nil)
	// A live socket is not stolen.
	_, err := localapi.NewServer(t.Context(), &localapi.ServerConfig{Path: s.srv.Path(),
		Open: func(context.Context, *v1.CreateKVCache) (*localapi.Cache, error) { return nil, nil }})
	require.ErrorIs(t, err, localapi.ErrSocketInUse)
	// A stale one is replaced.
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o700), "a socket directory grants nothing to others")
	path := filepath.Join(dir, "s.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	ln.SetUnlinkOnClose(false)
	require.NoError(t, ln.Close())
	srv, err := localapi.NewServer(t.Context(), &localapi.ServerConfig{Path: path,
		Open: func(context.Context, *v1.CreateKVCache) (*localapi.Cache, error) { return nil, nil }})
	require.NoError(t, err)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	require.NoError(t, srv.Close())
	require.ErrorIs(t, srv.Close(), net.ErrClosed)
	_, err = os.Stat(path)
	require.ErrorIs(t, err, os.ErrNotExist, "the socket is removed on close")
}

// TestLocalTransfer runs prefill→decode through two local servers: each
// engine writes and reads KV only through its own mapping.
func TestLocalTransfer(t *testing.T) {
	pre := newLocalSidecar(t, "prefill-l", nil)
	dec := newLocalSidecar(t, "decode-l", nil)
	pc, dc := dialLocal(t, pre), dialLocal(t, dec)
	pinfo, err := pc.Attach(t.Context(), createReq(gqa8, 256))
	require.NoError(t, err)
	_, err = dc.Attach(t.Context(), createReq(gqa8, 256))
	require.NoError(t, err)

	shape := kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 0, Heads: 8}
	const key = 42
	src, err := pc.Alloc(t.Context(), 20)
	require.NoError(t, err)
	for r := range int(pinfo.GetNumRegions()) {
		for k, id := range src {
			b, err := pc.Block(r, int(id))
			require.NoError(t, err)
			kvgen.FillBlock(b, shape, key, r, k*16)
		}
	}
	params, err := pc.RequestFinished(t.Context(), "req-1", src, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	require.NotNil(t, params)
	dst, err := dc.Alloc(t.Context(), 20)
	require.NoError(t, err)
	require.NoError(t, dc.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "req-1", LocalBlockIds: dst, Params: params, RemoteHitBlocks: new(uint32(0))}))

	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(30*time.Second)) // wallclock: real unix sockets and UDP; a generous scaled bound on the transfer
	defer cancel()
	waitFinished(ctx, t, dc, func(f *v1.GetFinishedReply) bool {
		require.Empty(t, f.GetFailed())
		return len(f.GetDoneRecving()) > 0
	})
	for r := range int(pinfo.GetNumRegions()) {
		for k, id := range dst {
			b, err := dc.Block(r, int(id))
			require.NoError(t, err)
			bad, first := kvgen.CheckBlock(b, shape, key, r, k*16)
			require.Zero(t, bad, "region %d block %d: first bad byte %d", r, id, first)
		}
	}
	waitFinished(ctx, t, pc, func(f *v1.GetFinishedReply) bool {
		return proto.Equal(f, &v1.GetFinishedReply{DoneSending: []string{"req-1"}})
	})
}

// waitFinished polls GetFinished until done says so; polling is how an
// engine's scheduler loop asks, so this is not a timing assumption.
func waitFinished(ctx context.Context, t testing.TB, c *localapi.Client, done func(*v1.GetFinishedReply) bool) {
	t.Helper()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		f, err := c.GetFinished(ctx)
		require.NoError(t, err)
		if done(f) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for GetFinished: %v", context.Cause(ctx))
		case <-tick.C:
		}
	}
}

// TestLocalRemap checks that an engine never keeps a stale mapping: a page
// the sidecar unmapped and mapped again (possibly at another memfd offset)
// is remapped in every attached engine by its next call, so both engines
// see the same bytes.
func TestLocalRemap(t *testing.T) {
	s := newLocalSidecar(t, "remap", nil)
	a, b := dialLocal(t, s), dialLocal(t, s)
	info, err := a.Attach(t.Context(), createReq(gqa8, 2048))
	require.NoError(t, err)
	_, err = b.Attach(t.Context(), createReq(gqa8, 2048))
	require.NoError(t, err)
	perPage := int(info.GetPageSize() / info.GetBlockLen())

	// Fill pages 0 and 1 and the reserve, then free: pages are unmapped and
	// the memfd holes punched.
	ids, err := a.Alloc(t.Context(), 4*perPage)
	require.NoError(t, err)
	require.NoError(t, a.Free(t.Context(), ids))
	// b maps fresh pages; the memfd slots are reused in another order.
	ids, err = b.Alloc(t.Context(), 4*perPage)
	require.NoError(t, err)
	for _, id := range ids {
		blk, err := b.Block(0, int(id))
		require.NoError(t, err)
		binary.LittleEndian.PutUint32(blk, id)
	}
	require.NoError(t, a.Sync(t.Context()))
	for _, id := range ids {
		blk, err := a.Block(0, int(id))
		require.NoError(t, err, "block %d mapped in a after sync", id)
		require.Equal(t, id, binary.LittleEndian.Uint32(blk), "a and b see the same page for block %d", id)
	}
	// Now a holds current mappings. b frees and allocates again: the pages
	// are unmapped, their memfd ranges punched, and mapped anew while a
	// is idle; a's next call must replace its stale mappings.
	require.NoError(t, b.Free(t.Context(), ids))
	ids, err = b.Alloc(t.Context(), 4*perPage)
	require.NoError(t, err)
	for _, id := range ids {
		blk, err := b.Block(0, int(id))
		require.NoError(t, err)
		binary.LittleEndian.PutUint32(blk, id+1000)
	}
	require.NoError(t, a.Sync(t.Context()))
	for _, id := range ids {
		blk, err := a.Block(0, int(id))
		require.NoError(t, err)
		require.Equal(t, id+1000, binary.LittleEndian.Uint32(blk), "a's mapping of block %d follows the new page", id)
	}
	require.NoError(t, b.Free(t.Context(), ids))
	require.NoError(t, a.Sync(t.Context()))
	_, err = a.Block(0, int(ids[len(ids)-1]))
	require.ErrorIs(t, err, localapi.ErrInvalidArgument, "the unmapped page is dropped in a too")
}

// BenchmarkLocalAllocFree measures one alloc of 16 blocks and its free
// through the local API (two round trips on a unix socket, pages kept
// mapped by the reserve).
func BenchmarkLocalAllocFree(b *testing.B) {
	s := newLocalSidecar(b, "bench", nil)
	c := dialLocal(b, s)
	_, err := c.Attach(b.Context(), createReq(gqa8, 4096))
	require.NoError(b, err)
	b.ReportAllocs()
	for b.Loop() {
		ids, err := c.Alloc(b.Context(), 16)
		if err != nil {
			b.Fatal(err)
		}
		if err := c.Free(b.Context(), ids); err != nil {
			b.Fatal(err)
		}
	}
}

// TestLocalEngineGone checks that an engine that disconnects without
// freeing leaves nothing behind: its loads in flight are aborted and the
// blocks it allocated are freed, except those held under a prefill lease,
// so the next engine can allocate the whole pool.
func TestLocalEngineGone(t *testing.T) {
	const blocks = 256
	// A prefill that never answers: the decode's load stays in flight
	// until it is aborted.
	silent, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = silent.Close() })
	pre := newLocalSidecar(t, "prefill-gone", nil)
	pc := dialLocal(t, pre)
	_, err = pc.Attach(t.Context(), createReq(gqa8, blocks))
	require.NoError(t, err)
	src, err := pc.Alloc(t.Context(), 20)
	require.NoError(t, err)
	params, err := pc.RequestFinished(t.Context(), "req-gone", src, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	params.RemotePort = uint32(silent.LocalAddr().(*net.UDPAddr).Port)

	tests := []struct {
		name string
		// engine runs the engine's calls on its attached connection.
		engine     func(t *testing.T, c *localapi.Client)
		wantLeased uint64 // blocks left in use after the engine is gone
	}{
		{name: "decode_with_load_in_flight", engine: func(t *testing.T, c *localapi.Client) {
			dst, err := c.Alloc(t.Context(), 20)
			require.NoError(t, err)
			_, err = c.Alloc(t.Context(), 100)
			require.NoError(t, err)
			require.NoError(t, c.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "req-gone", LocalBlockIds: dst, Params: params, RemoteHitBlocks: new(uint32(0))}))
			st, err := c.Stats(t.Context())
			require.NoError(t, err)
			require.Equal(t, uint64(1), st.GetLoadsInFlight())
		}},
		{name: "prefill_with_leased_blocks", wantLeased: 30, engine: func(t *testing.T, c *localapi.Client) {
			ids, err := c.Alloc(t.Context(), 130)
			require.NoError(t, err)
			p, err := c.RequestFinished(t.Context(), "held", ids[:30], v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
			require.NoError(t, err)
			require.NotNil(t, p, "30 blocks held for decode")
			require.NoError(t, c.Free(t.Context(), ids[30:40]))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newLocalSidecar(t, "gone-"+tt.name, nil)
			ctl := dialLocal(t, s) // never attaches: does not keep the engine alive
			// Two connections of one engine: the state goes with the last.
			a, err := localapi.Dial(t.Context(), s.srv.Path(), nil)
			require.NoError(t, err)
			_, err = a.Attach(t.Context(), createReq(gqa8, blocks))
			require.NoError(t, err)
			b, err := localapi.Dial(t.Context(), s.srv.Path(), nil)
			require.NoError(t, err)
			_, err = b.Attach(t.Context(), createReq(gqa8, blocks))
			require.NoError(t, err)
			tt.engine(t, a)
			require.NoError(t, a.Close())
			require.NoError(t, b.Sync(t.Context()), "the engine's other connection keeps it attached")
			st, err := ctl.Stats(t.Context())
			require.NoError(t, err)
			require.Greater(t, st.GetBlocksUsed(), tt.wantLeased, "nothing released while a connection is attached")
			require.NoError(t, b.Close())

			ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(30*time.Second)) // wallclock: real unix sockets; a generous scaled bound on the release
			defer cancel()
			tick := time.NewTicker(time.Millisecond)
			defer tick.Stop()
			for {
				st, err = ctl.Stats(ctx)
				require.NoError(t, err)
				if st.GetBlocksUsed() == tt.wantLeased && st.GetLoadsInFlight() == 0 {
					break
				}
				select {
				case <-ctx.Done():
					t.Fatalf("engine state not released: %v", st)
				case <-tick.C:
				}
			}
			require.Equal(t, tt.wantLeased, st.GetLeasesHeld()*30, "the lease is kept")

			// The next engine gets every block not leased.
			next := dialLocal(t, s)
			_, err = next.Attach(t.Context(), createReq(gqa8, blocks))
			require.NoError(t, err)
			ids, err := next.Alloc(t.Context(), blocks-1-int(tt.wantLeased))
			require.NoError(t, err)
			require.Len(t, ids, blocks-1-int(tt.wantLeased))
		})
	}
}

// TestLocalCreateTakesTheSidecarsGeometry: a sidecar started with a model's
// geometry (serve --model) serves a create call that carries none; one
// started without refuses it with reason GEOMETRY_REQUIRED, which the
// client's error matches as the sentinel, until an engine created the cache:
// then such a create attaches to it in the creator's geometry (a zero-copy
// vLLM scheduler attaching after its worker created H2ND).
func TestLocalCreateTakesTheSidecarsGeometry(t *testing.T) {
	s := newLocalSidecarGeom(t, "with-model", nil, gqa8)
	info, err := dialLocal(t, s).Attach(t.Context(), &v1.CreateKVCache{TpSize: 1, NumBlocks: 64})
	require.NoError(t, err)
	require.True(t, proto.Equal(gqa8, info.GetGeometry()), "%v", info.GetGeometry())

	bare := newLocalSidecar(t, "without-model", nil)
	_, err = dialLocal(t, bare).Attach(t.Context(), &v1.CreateKVCache{TpSize: 1, NumBlocks: 64})
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codeOf(err))
	require.Equal(t, codes.ReasonGeometryRequired, codes.ReasonOf(err), "%v", err)
	require.ErrorIs(t, err, localapi.ErrGeometryRequired)
	require.NotErrorIs(t, err, localapi.ErrNotAttached)

	compound := proto.Clone(gqa8).(*v1.ModelGeometry)
	compound.Layout = v1.Layout_LAYOUT_H2ND
	_, err = dialLocal(t, bare).Attach(t.Context(), createReq(compound, 64))
	require.NoError(t, err)
	info, err = dialLocal(t, bare).Attach(t.Context(), &v1.CreateKVCache{TpSize: 1})
	require.NoError(t, err)
	require.True(t, proto.Equal(compound, info.GetGeometry()), "%v", info.GetGeometry())
	require.Equal(t, uint32(64), info.GetNumBlocks())
	_, err = dialLocal(t, bare).Attach(t.Context(), createReq(gqa8, 64))
	require.Equal(t, v1.Code_CODE_ALREADY_EXISTS, codeOf(err), "a geometry given must still be the cache's: %v", err)
}
