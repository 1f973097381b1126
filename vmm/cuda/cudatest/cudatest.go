package cudatest

import (
	"bufio"
	"embed"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvsidecar/kvsidecar/vmm/cuda/internal/cudaabi"
)

//go:embed testdata/fakecuda.c testdata/rules.c
var sources embed.FS

// Environment variables the fake reads (see testdata/fakecuda.c). The first
// five are read at each cuInit, so set them before the code under test
// creates its backend; EnvFail and EnvTrace are picked up at the next call
// after they change.
const (
	EnvDevices      = "FAKECUDA_DEVICES"        // number of devices, default 1
	EnvGranularity  = "FAKECUDA_GRANULARITY"    // bytes, default 2 MiB
	EnvDeviceMemory = "FAKECUDA_DEVICE_MEMORY"  // bytes per device, default 16 GiB
	EnvNoPOSIXFD    = "FAKECUDA_NO_POSIX_FD"    // "1": no POSIX-fd export
	EnvNoPeerAccess = "FAKECUDA_NO_PEER_ACCESS" // "1": no device reaches another's memory
	EnvFail         = "FAKECUDA_FAIL"           // name:k:result[,...]
	EnvTrace        = "FAKECUDA_TRACE"          // trace file path
	EnvVerbose      = "FAKECUDA_VERBOSE"        // "1": refusals to stderr
)

// RequireEnv, set to 1, turns a fake that cannot be built into a test
// failure instead of a skip. .ci/run sets it.
const RequireEnv = "KVSIDECAR_REQUIRE_FAKECUDA"

var build struct {
	mu  sync.Mutex
	dir string            // the temporary directory of every output
	out map[string]string // output name -> path
	err map[string]error  // output name -> why it did not build
}

// Library returns the path of the fake libcuda.so.1, built with gcc (or
// $CC) once per process into a temporary directory that Cleanup removes.
// Its soname is libfakecuda.so.1, not libcuda.so.1: the dynamic loader
// matches dlopen("libcuda.so.1") against the sonames of loaded libraries,
// so with the driver's soname a process that loaded the fake by path would
// get the fake for every later dlopen of the real driver. When it cannot be
// built the test is skipped, or fails when KVSIDECAR_REQUIRE_FAKECUDA=1.
func Library(t testing.TB) string {
	t.Helper()
	return compile(t, "libcuda.so.1", "fakecuda.c", "-shared", "-fPIC", "-fvisibility=hidden",
		"-Wl,-soname,libfakecuda.so.1", "-lpthread")
}

// rulesProgram returns the path of the rules program (testdata/rules.c).
func rulesProgram(t testing.TB) string {
	t.Helper()
	return compile(t, "rules", "rules.c", "-ldl")
}

// compile builds testdata/src into out once per process.
func compile(t testing.TB, out, src string, flags ...string) string {
	t.Helper()
	build.mu.Lock()
	defer build.mu.Unlock()
	if p, ok := build.out[out]; ok {
		return p
	}
	err, tried := build.err[out]
	if !tried {
		var p string
		if p, err = gcc(out, src, flags); err == nil {
			if build.out == nil {
				build.out = map[string]string{}
			}
			build.out[out] = p
			return p
		}
		if build.err == nil {
			build.err = map[string]error{}
		}
		build.err[out] = err
	}
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("%s=1 but the fake CUDA driver's %s did not build: %v", RequireEnv, out, err)
	}
	t.Skipf("fake CUDA driver's %s not built (set %s=1 to fail instead): %v", out, RequireEnv, err)
	return ""
}

func gcc(out, src string, flags []string) (string, error) {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		return "", fmt.Errorf("C compiler %q: %w", cc, err)
	}
	if build.dir == "" {
		dir, err := os.MkdirTemp("", "kvsidecar-fakecuda-")
		if err != nil {
			return "", err
		}
		if err := writeSources(dir); err != nil {
			_ = os.RemoveAll(dir)
			return "", err
		}
		build.dir = dir
	}
	p := filepath.Join(build.dir, out)
	args := append([]string{"-O2", "-Wall", "-Wextra", "-o", p, filepath.Join(build.dir, src)}, flags...)
	if b, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		return "", fmt.Errorf("%s %s: %w\n%s", cc, strings.Join(args, " "), err, b)
	}
	return p, nil
}

// writeSources writes the fake's C sources into dir, and beside them the
// header vmm/cuda calls the driver through: one statement of the ABI for
// the code under test and the fake.
func writeSources(dir string) error {
	if err := os.WriteFile(filepath.Join(dir, "cuda_abi.h"), []byte(cudaabi.Header), 0o600); err != nil {
		return err
	}
	for _, name := range []string{"fakecuda.c", "rules.c"} {
		b, err := sources.ReadFile("testdata/" + name)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// M wraps a test binary's m so that Run removes what was built after the
// tests: func TestMain(m *testing.M) { goleak.VerifyTestMain(cudatest.M(m)) }.
func M(m interface{ Run() int }) interface{ Run() int } { return cleanupM{m} }

type cleanupM struct{ m interface{ Run() int } }

func (c cleanupM) Run() int {
	defer Cleanup()
	return c.m.Run()
}

// Cleanup removes what was built; call it from TestMain after m.Run.
func Cleanup() {
	build.mu.Lock()
	defer build.mu.Unlock()
	if build.dir != "" {
		_ = os.RemoveAll(build.dir)
	}
	build.dir, build.out, build.err = "", nil, nil
}

// Fault makes the N-th call (from 1) of the entry point Call return Result
// without doing anything, counting from the first call after Inject.
type Fault struct {
	Call   string // an entry point name, e.g. "cuMemCreate", "cuMemcpyHtoD_v2"
	N      int
	Result int // a CUresult, e.g. 2 (CUDA_ERROR_OUT_OF_MEMORY)
}

// Inject arms faults in this process's fake for the rest of the test
// (t.Setenv of FAKECUDA_FAIL; none of the test's ancestors may be
// parallel). For a child process, put Spec(faults...) in its environment.
func Inject(t testing.TB, faults ...Fault) {
	t.Helper()
	t.Setenv(EnvFail, Spec(faults...))
}

// Spec is the FAKECUDA_FAIL value of faults.
func Spec(faults ...Fault) string {
	parts := make([]string, len(faults))
	for i, f := range faults {
		parts[i] = fmt.Sprintf("%s:%d:%d", f.Call, f.N, f.Result)
	}
	return strings.Join(parts, ",")
}

// Call is one call the fake traced.
type Call struct {
	Name     string // entry point, e.g. "cuMemMap"
	Result   int    // the CUresult it returned
	Injected bool   // the result came from FAKECUDA_FAIL
	Why      string // for a refused call: the rule it broke
	// Args are the key=value arguments the fake traces for some calls:
	// "bytes" (a copy's or a host allocation's size), "host" ("pinned" or
	// "pageable": the host side of a copy), "stream" (a handle in hex, "0"
	// for the NULL stream), "flags", "ops" (queued copies a synchronization
	// ran), "dev" and "peer". Nil when there are none.
	Args map[string]string
}

func (c Call) String() string {
	switch {
	case c.Result == 0:
		return c.Name
	case c.Injected:
		return fmt.Sprintf("%s=%d (injected)", c.Name, c.Result)
	}
	return fmt.Sprintf("%s=%d (%s)", c.Name, c.Result, c.Why)
}

// Trace is a file the fake appends every call to.
type Trace struct {
	// Path is the trace file; give it to a child process as FAKECUDA_TRACE.
	Path string
}

// NewTrace returns a trace file in the test's temporary directory without
// pointing this process's fake at it (for a child process).
func NewTrace(t testing.TB, name string) *Trace {
	t.Helper()
	return &Trace{Path: filepath.Join(t.TempDir(), name+".fakecuda-trace")}
}

// StartTrace points this process's fake at a new trace file for the rest of
// the test (t.Setenv of FAKECUDA_TRACE).
func StartTrace(t testing.TB) *Trace {
	t.Helper()
	tr := NewTrace(t, "self")
	t.Setenv(EnvTrace, tr.Path)
	return tr
}

// Calls returns the calls traced so far, in order (none when the file does
// not exist yet).
func (tr *Trace) Calls(t testing.TB) []Call {
	t.Helper()
	calls, err := ReadTrace(tr.Path)
	if err != nil {
		t.Fatalf("fakecuda trace: %v", err)
	}
	return calls
}

// ReadTrace parses a trace file.
func ReadTrace(path string) ([]Call, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var calls []Call
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		name, rest, _ := strings.Cut(sc.Text(), " ")
		res, note, _ := strings.Cut(rest, " ")
		r, err := strconv.Atoi(res)
		if err != nil || name == "" {
			return nil, fmt.Errorf("%s:%d: %q is not \"<name> <CUresult>[ key=value...][ note]\"", path, n, sc.Text())
		}
		c := Call{Name: name, Result: r}
		for note != "" && !strings.HasPrefix(note, "why: ") && note != "injected" {
			var kv string
			kv, note, _ = strings.Cut(note, " ")
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return nil, fmt.Errorf("%s:%d: %q: %q is not key=value", path, n, sc.Text(), kv)
			}
			if c.Args == nil {
				c.Args = map[string]string{}
			}
			c.Args[k] = v
		}
		c.Injected = note == "injected"
		c.Why = strings.TrimPrefix(note, "why: ")
		if c.Injected {
			c.Why = ""
		}
		calls = append(calls, c)
	}
	return calls, sc.Err()
}

// Refused returns the calls the fake refused because they broke a rule
// (injected faults excluded): what kvsidecar's own calls must never do.
func Refused(calls []Call) []Call {
	var out []Call
	for _, c := range calls {
		if c.Result != 0 && !c.Injected {
			out = append(out, c)
		}
	}
	return out
}

// Names returns the entry point names of calls, in order.
func Names(calls []Call) []string {
	out := make([]string, len(calls))
	for i, c := range calls {
		out[i] = c.Name
	}
	return out
}

// Held returns the allocation handles and the mappings that calls leave
// behind (Left's Handles and Mappings).
func Held(calls []Call) (handles, mappings int) {
	o := Left(calls)
	return o.Handles, o.Mappings
}

// Outstanding counts what a run of calls leaves held in the driver.
type Outstanding struct {
	Handles      int // cuMemCreate and cuMemImportFromShareableHandle minus cuMemRelease
	Mappings     int // cuMemMap minus cuMemUnmap (one mapping per unmap, as vmm/cuda unmaps page by page)
	Reservations int // cuMemAddressReserve minus cuMemAddressFree
	HostBuffers  int // cuMemHostAlloc minus cuMemFreeHost
	Streams      int // cuStreamCreate minus cuStreamDestroy_v2
	Events       int // cuEventCreate minus cuEventDestroy_v2
}

// Left returns what the successful calls among calls leave held.
func Left(calls []Call) Outstanding {
	var o Outstanding
	count := map[string]*int{
		"cuMemCreate": &o.Handles, "cuMemImportFromShareableHandle": &o.Handles, "cuMemMap": &o.Mappings,
		"cuMemAddressReserve": &o.Reservations, "cuMemHostAlloc": &o.HostBuffers, "cuStreamCreate": &o.Streams,
		"cuEventCreate": &o.Events,
	}
	undo := map[string]*int{
		"cuMemRelease": &o.Handles, "cuMemUnmap": &o.Mappings, "cuMemAddressFree": &o.Reservations,
		"cuMemFreeHost": &o.HostBuffers, "cuStreamDestroy_v2": &o.Streams, "cuEventDestroy_v2": &o.Events,
	}
	for _, c := range calls {
		if c.Result != 0 {
			continue
		}
		if p, ok := count[c.Name]; ok {
			*p++
		}
		if p, ok := undo[c.Name]; ok {
			*p--
		}
	}
	return o
}
