//go:build linux && cgo

package e2e

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

var _ localapi.DeviceImporter = (*cuda.Backend)(nil)

// cudaDriver returns the driver library the CUDA e2e tests use: the real
// one (cuda.DefaultLibrary) under KVSIDECAR_REQUIRE_GPU=1, which make
// gpu-check sets, else the fake driver (fake true).
func cudaDriver(t *testing.T) (lib string, fake bool) {
	t.Helper()
	if os.Getenv("KVSIDECAR_REQUIRE_GPU") == "1" {
		return cuda.DefaultLibrary, false
	}
	return cudatest.Library(t), true
}

// attachDevice attaches an engine whose client imports the sidecar's
// device pages through imp.
func attachDevice(t testing.TB, s *Sidecar, blocks uint32, imp localapi.DeviceImporter) *engine {
	t.Helper()
	c, err := localapi.Dial(t.Context(), s.Socket, &localapi.ClientConfig{DeviceImporter: imp})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	info, err := c.Attach(t.Context(), &v1.CreateKVCache{Geometry: geom, TpRank: uint32(s.Opts.TPRank), TpSize: uint32(s.Opts.TPSize), NumBlocks: blocks})
	require.NoError(t, err)
	require.True(t, info.GetDeviceMemory(), "%s serves device memory", s.Name)
	return &engine{Client: c, info: info}
}

// writeDevice writes request key's KV heads of shape into blocks through
// the engine's imported device mapping (cuMemcpyHtoD in this process).
func (e *engine) writeDevice(t testing.TB, sh kvgen.Shape, key uint64, blocks []uint32) {
	t.Helper()
	buf := make([]byte, e.info.GetBlockLen())
	for r := range int(e.info.GetNumRegions()) {
		for k, id := range blocks {
			kvgen.FillBlock(buf, sh, key, r, k*16)
			require.NoError(t, e.WriteBlock(r, int(id), buf))
		}
	}
}

// checkDevice reads every byte back through the engine's imported device
// mapping (cuMemcpyDtoH in this process) and checks it.
func (e *engine) checkDevice(t testing.TB, sh kvgen.Shape, key uint64, blocks []uint32) {
	t.Helper()
	buf := make([]byte, e.info.GetBlockLen())
	for r := range int(e.info.GetNumRegions()) {
		for k, id := range blocks {
			require.NoError(t, e.ReadBlock(r, int(id), buf))
			bad, first := kvgen.CheckBlock(buf, sh, key, r, k*16)
			require.Zero(t, bad, "region %d block %d: %d bytes differ, first at %d", r, id, bad, first)
		}
	}
}

// TestServeCUDADeviceFD: a prefill instance of TP 2 and a decode instance
// of TP 4, every sidecar `serve --backend cuda`, every engine a Go client
// that imports the sidecar's POSIX fds into its own device address space.
// Prefill engines write their heads through that device path, each decode
// rank reads its two heads from the prefill rank that holds them, and the
// decode engines check every byte through the same path. On the fake
// driver the sidecars and this process break none of its rules, and after
// SIGTERM nothing is left allocated or mapped. make gpu-check runs it on a
// GPU.
func TestServeCUDADeviceFD(t *testing.T) {
	lib, fake := cudaDriver(t)
	env := NewEnv(t)
	var traces []*cudatest.Trace
	if fake {
		traces = append(traces, cudatest.StartTrace(t))
	}
	imp, err := cuda.New(&cuda.Config{Library: lib})
	require.NoError(t, err, "the engines' importer")
	opts := func(engine, role string, tp int) SidecarOpts {
		o := SidecarOpts{Engine: engine, Role: role, TPSize: tp,
			Args: append(faultArgs("--backend", "cuda"), "--cuda-library", lib)}
		if fake {
			tr := cudatest.NewTrace(t, engine)
			traces = append(traces, tr)
			o.Env = []string{cudatest.EnvTrace + "=" + tr.Path}
		}
		return o
	}
	const n = 48 // blocks of one request
	const key = 2718

	pre := env.StartGroup(t, opts("pre-cuda", "prefill", 2))
	preEng := make([]*engine, len(pre))
	var src []uint32
	var parts []*v1.KVTransferParams
	for r, s := range pre {
		line := s.WaitLog(t, "cuda driver", StartTimeout)
		require.Equal(t, imp.LibraryPath(), line["library"], "%s loaded the driver this test uses", s.Name)
		e := attachDevice(t, s, 512, imp)
		preEng[r] = e
		ids, err := e.Alloc(t.Context(), n)
		require.NoError(t, err)
		if r == 0 {
			src = ids
		}
		require.Equal(t, src, ids, "lockstep allocation")
		e.writeDevice(t, kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 4 * r, Heads: 4}, key, ids)
		p, err := e.RequestFinished(t.Context(), "req", ids, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.NoError(t, err)
		parts = append(parts, p)
	}
	params, err := connector.MergeExports(parts...)
	require.NoError(t, err)
	require.Equal(t, uint32(2), params.GetTpSize())

	dec := make([]*engine, 4)
	decSide := make([]*Sidecar, 4)
	dst := make([][]uint32, 4)
	for d := range dec {
		o := opts("dec-cuda", "decode", 4)
		o.TPRank = d
		decSide[d] = env.StartSidecar(t, o)
		dec[d] = attachDevice(t, decSide[d], 512, imp)
		dst[d], err = dec[d].Alloc(t.Context(), n)
		require.NoError(t, err)
		require.NoError(t, dec[d].StartLoad(t.Context(), &v1.ReqMeta{RequestId: "req", LocalBlockIds: dst[d], Params: params, RemoteHitBlocks: new(uint32(0))}))
	}
	for d, e := range dec {
		e.waitFinished(t, 30*time.Second, func(f *v1.GetFinishedReply) bool {
			require.Empty(t, f.GetFailed(), "decode rank %d", d)
			return len(f.GetDoneRecving()) == 1
		})
		// Decode rank d holds heads 2d, 2d+1: prefill rank d/2 wrote them.
		e.checkDevice(t, kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 2 * d, Heads: 2}, key, dst[d])
		require.NoError(t, e.Free(t.Context(), dst[d]))
	}
	slice := float64(n * uint64(dec[0].info.GetNumRegions()) * dec[0].info.GetBlockLen())
	for _, s := range pre {
		s.WaitMetric(t, "kvsidecar_transfer_bytes_total", 2*slice) // each served two decode ranks' slices
	}

	// Everything stops cleanly; on the fake, nothing broke a rule and
	// nothing stays allocated or mapped.
	for _, e := range append(preEng, dec...) {
		require.NoError(t, e.Close())
	}
	for _, s := range append(pre, decSide...) {
		s.Signal(t, syscall.SIGTERM)
	}
	for _, s := range append(pre, decSide...) {
		require.Zero(t, s.Wait(t, ExitTimeout), "%s exits 0", s.Name)
	}
	require.NoError(t, imp.Close())
	if !fake {
		return
	}
	for _, tr := range traces {
		calls := tr.Calls(t)
		require.NotEmpty(t, calls, "%s traced nothing", tr.Path)
		require.Empty(t, cudatest.Refused(calls), "%s: calls that broke the driver's rules", tr.Path)
		h, m := cudatest.Held(calls)
		require.Zero(t, h, "%s: allocation handles left", tr.Path)
		require.Zero(t, m, "%s: mappings left", tr.Path)
	}
	imports := 0
	for _, c := range traces[0].Calls(t) {
		if c.Name == "cuMemImportFromShareableHandle" && c.Result == 0 {
			imports++
		}
	}
	require.Positive(t, imports, "the engines imported the sidecars' pages")
}

// count returns how many successful calls of name calls holds whose args
// include every key=value of with.
func count(calls []cudatest.Call, name string, with ...string) int {
	n := 0
	for _, c := range calls {
		if c.Name != name || c.Result != 0 {
			continue
		}
		ok := true
		for _, kv := range with {
			k, v, _ := strings.Cut(kv, "=")
			ok = ok && c.Args[k] == v
		}
		if ok {
			n++
		}
	}
	return n
}

// overlapped reports whether some synchronization in calls left copies
// queued that were started before it: the copies of the next staging
// buffer ran while the current one was used.
func overlapped(calls []cudatest.Call) bool {
	queued := 0
	for _, c := range calls {
		switch {
		case c.Result != 0:
		case strings.HasPrefix(c.Name, "cuMemcpy") && strings.Contains(c.Name, "Async"):
			queued++
		case c.Name == "cuEventSynchronize" || c.Name == "cuStreamSynchronize":
			ran, _ := strconv.Atoi(c.Args["ops"])
			queued -= ran
			if queued > 0 && ran > 0 {
				return true
			}
		}
	}
	return false
}

// TestDeviceREADPaths: a decode READ of 400 contiguous blocks between two
// `serve --backend cuda` sidecars on one host. On the same-host path the
// decode maps the prefill's device pages and copies device to device: one
// copy per region (not per block), no host copy at all in its driver
// trace, and every imported page released. Over QUIC (KVSIDECAR_SAME_HOST
// off) both sides stage through page-locked buffers with asynchronous
// copies, many blocks per buffer, the next buffer's copies running while
// one is sent or received, and no synchronous pageable copy on the path.
// The decode engine reads every byte back through its own device mapping.
//
// fault-matrix: device-staging
func TestDeviceREADPaths(t *testing.T) {
	lib, fake := cudaDriver(t)
	env := NewEnv(t)
	imp, err := cuda.New(&cuda.Config{Library: lib})
	require.NoError(t, err, "the engines' importer")
	t.Cleanup(func() { _ = imp.Close() })
	traces := map[string]*cudatest.Trace{}
	start := func(engine string) (*Sidecar, *engine) {
		o := SidecarOpts{Engine: engine, Args: append(faultArgs("--backend", "cuda"), "--cuda-library", lib)}
		if fake {
			traces[engine] = cudatest.NewTrace(t, engine)
			o.Env = []string{cudatest.EnvTrace + "=" + traces[engine].Path}
		}
		s := env.StartSidecar(t, o)
		return s, attachDevice(t, s, 1024, imp)
	}
	const n, key = 400, 31
	pre, pe := start("pre-dev")
	dec, de := start("dec-dev")
	sh := kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 0, Heads: 8}
	src, err := pe.Alloc(t.Context(), n)
	require.NoError(t, err)
	pe.writeDevice(t, sh, key, src)
	params, err := pe.RequestFinished(t.Context(), "req", src, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
	require.NoError(t, err)
	var before []cudatest.Call
	if fake {
		before = traces["dec-dev"].Calls(t)
	}
	dst, err := de.Alloc(t.Context(), n)
	require.NoError(t, err)
	require.NoError(t, de.StartLoad(t.Context(), &v1.ReqMeta{RequestId: "req", LocalBlockIds: dst, Params: params, RemoteHitBlocks: new(uint32(0))}))
	de.waitFinished(t, 30*time.Second, func(f *v1.GetFinishedReply) bool {
		require.Empty(t, f.GetFailed())
		return len(f.GetDoneRecving()) == 1
	})
	de.checkDevice(t, sh, key, dst)
	RequirePath(t, dec)
	if !fake {
		return
	}
	regions := int(de.info.GetNumRegions())
	load := traces["dec-dev"].Calls(t)[len(before):] // the decode sidecar's calls for the load
	serve := traces["pre-dev"].Calls(t)
	hostCopies := []string{"cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2"}
	if SameHostOn() {
		require.Positive(t, count(load, "cuMemImportFromShareableHandle"), "the decode imported the prefill's pages")
		require.Equal(t, regions, count(load, "cuMemcpyDtoDAsync_v2"), "one device copy per region for %d contiguous blocks", n)
		for _, name := range hostCopies {
			require.Zero(t, count(load, name), "no %s on the same-host device path", name)
		}
		require.Zero(t, count(serve, "cuMemcpyDtoHAsync_v2"), "the prefill copied nothing to the host for the READ")
	} else {
		require.Positive(t, count(load, "cuMemcpyHtoDAsync_v2", "host=pinned"), "the decode stages into device memory asynchronously from page-locked buffers")
		require.Zero(t, count(load, "cuMemcpyHtoD_v2"), "no synchronous copy on the decode's path")
		require.Zero(t, count(load, "cuMemcpyHtoDAsync_v2", "host=pageable"))
		require.Positive(t, count(serve, "cuMemcpyDtoHAsync_v2", "host=pinned"), "the prefill stages out of device memory asynchronously")
		require.Zero(t, count(serve, "cuMemcpyDtoHAsync_v2", "host=pageable"))
		require.True(t, overlapped(serve), "the prefill's next buffer copied while one was sent")
		require.True(t, overlapped(load), "the decode's copies into device memory ran while the next buffer arrived")
		require.Less(t, count(load, "cuEventSynchronize"), n, "one wait per buffer, not per block")
	}
	require.NoError(t, de.Free(t.Context(), dst))
	for _, s := range []*Sidecar{pre, dec} {
		s.Signal(t, syscall.SIGTERM)
		require.Zero(t, s.Wait(t, ExitTimeout), "%s exits 0", s.Name)
	}
	for name, tr := range traces {
		calls := tr.Calls(t)
		require.Empty(t, cudatest.Refused(calls), "%s: calls that broke the driver's rules", name)
		left := cudatest.Left(calls)
		require.Zero(t, left.Handles, "%s: handles (pages and imports) left", name)
		require.Zero(t, left.Mappings, "%s: mappings left", name)
		require.Zero(t, left.HostBuffers, "%s: page-locked buffers left", name)
	}
}
