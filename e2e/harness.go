package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
)

// Timeouts of the harness; each is multiplied by KVSIDECAR_TIME_SCALE
// (testutil.Scaled) when used.
const (
	// StartTimeout bounds a process start up to its first log line.
	StartTimeout = 20 * time.Second
	// ExitTimeout bounds waiting for a signalled process to exit.
	ExitTimeout = 30 * time.Second
)

var build struct {
	once sync.Once
	dir  string
	path string
	err  error
}

// Binary builds ./cmd/kvsidecar once per test binary and returns its path.
// KVSIDECAR_E2E_RACE=1 builds it with the race detector. Call Cleanup from
// TestMain to remove it.
func Binary(t testing.TB) string {
	t.Helper()
	build.once.Do(func() {
		build.dir, build.err = os.MkdirTemp("", "kvsidecar-e2e-bin")
		if build.err != nil {
			return
		}
		build.path = filepath.Join(build.dir, "kvsidecar")
		goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
		if _, err := os.Stat(goBin); err != nil {
			goBin = "go"
		}
		args := []string{"build", "-o", build.path}
		if os.Getenv("KVSIDECAR_E2E_RACE") == "1" {
			args = append(args, "-race")
		}
		cmd := exec.Command(goBin, append(args, "../cmd/kvsidecar")...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			build.err = fmt.Errorf("go build: %w\n%s", err, out)
		}
	})
	require.NoError(t, build.err)
	return build.path
}

// Cleanup removes the built binary; TestMain calls it after the run.
func Cleanup() {
	if build.dir != "" {
		_ = os.RemoveAll(build.dir)
	}
}

// Env is one test's world: a short temp dir (unix socket paths are
// limited to 107 bytes), a dev CA with per-process certificates, a
// capability secret and a socket dir.
type Env struct {
	Dir       string
	SocketDir string
	CapKey    string // file holding a shared capability secret
	ca        *devtls.CA

	mu  sync.Mutex
	tls map[string]devtls.Files // by process name
}

// NewEnv makes a temp dir removed at the end of the test.
func NewEnv(t testing.TB) *Env {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvse2e")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	ca, err := devtls.NewCA()
	require.NoError(t, err)
	e := &Env{Dir: dir, SocketDir: filepath.Join(dir, "sock"), CapKey: filepath.Join(dir, "cap.key"), ca: ca}
	require.NoError(t, os.Mkdir(e.SocketDir, 0o700))
	require.NoError(t, os.WriteFile(e.CapKey, []byte("e2e-capability-secret-0123456789"), 0o600))
	return e
}

// TLS writes certificate files for one process, valid for loopback and
// the extra hosts, and returns them; a process of the same name started
// again (a restart) gets the same files, as an operator's restart would.
func (e *Env) TLS(t testing.TB, name string, hosts ...string) devtls.Files {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	if f, ok := e.tls[name]; ok {
		return f
	}
	f, err := e.ca.WriteFiles(filepath.Join(e.Dir, "tls"), name, hosts...)
	require.NoError(t, err)
	if e.tls == nil {
		e.tls = map[string]devtls.Files{}
	}
	e.tls[name] = f
	return f
}

// Proc is one running process of the binary. Its stderr is parsed as
// JSON log lines (kept, and searchable with WaitLog); other lines are kept
// as {"raw": line}.
type Proc struct {
	Name string
	Cmd  *exec.Cmd

	mu      sync.Mutex
	logs    []map[string]any
	changed chan struct{}
	done    chan struct{}
	waitErr error
}

// Start runs the binary with args; the process is killed at the end of the
// test if still running.
func Start(t testing.TB, name string, args ...string) *Proc {
	t.Helper()
	return startCmd(t, name, binaryCmd(t, "", args))
}

// StartInNetns runs the binary with args inside the network namespace ns
// (`ip netns exec ns`, which execs the binary itself, so signals reach it
// directly); it is killed at the end of the test if still running.
func StartInNetns(t testing.TB, ns, name string, args ...string) *Proc {
	t.Helper()
	return startCmd(t, name, binaryCmd(t, ns, args))
}

// binaryCmd runs the binary with args, inside network namespace ns unless
// ns is empty.
func binaryCmd(t testing.TB, ns string, args []string) *exec.Cmd {
	t.Helper()
	if ns == "" {
		return exec.Command(Binary(t), args...)
	}
	return exec.Command("ip", append([]string{"netns", "exec", ns, Binary(t)}, args...)...)
}

// startCmd starts cmd with its Env (nil: this process's environment) and
// QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING.
func startCmd(t testing.TB, name string, cmd *exec.Cmd) *Proc {
	t.Helper()
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, "QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING=true")
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	cmd.Stdout = io.Discard
	p := &Proc{Name: name, Cmd: cmd, changed: make(chan struct{}), done: make(chan struct{})}
	require.NoError(t, cmd.Start())
	go p.readLogs(stderr)
	t.Cleanup(func() {
		if !p.Exited() {
			_ = cmd.Process.Kill()
			<-p.done
		}
		// A binary built with KVSIDECAR_E2E_RACE=1 reports races on stderr.
		for _, l := range p.Logs() {
			if raw, _ := l["raw"].(string); strings.Contains(raw, "WARNING: DATA RACE") {
				t.Errorf("%s: the race detector reported a data race (its report is in the logs below)", name)
				break
			}
		}
		if t.Failed() {
			for _, l := range p.Logs() {
				b, _ := json.Marshal(l)
				t.Logf("%s: %s", name, b)
			}
		}
	})
	return p
}

func (p *Proc) readLogs(r io.Reader) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) != nil {
			m = map[string]any{"raw": sc.Text()}
		}
		p.mu.Lock()
		p.logs = append(p.logs, m)
		close(p.changed)
		p.changed = make(chan struct{})
		p.mu.Unlock()
	}
	err := p.Cmd.Wait()
	p.mu.Lock()
	p.waitErr = err
	close(p.changed)
	p.changed = make(chan struct{})
	p.mu.Unlock()
	close(p.done)
}

// Logs returns the log lines so far.
func (p *Proc) Logs() []map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]map[string]any(nil), p.logs...)
}

// WaitLog waits for a log line whose "msg" is msg and returns it; it fails
// the test when the process exits first or after timeout (scaled).
func (p *Proc) WaitLog(t testing.TB, msg string, timeout time.Duration) map[string]any {
	t.Helper()
	return p.WaitLogN(t, msg, 1, timeout)
}

// WaitLogN is WaitLog for the n-th line (from 1) whose "msg" is msg; it
// also returns a line the process logged before it exited.
func (p *Proc) WaitLogN(t testing.TB, msg string, n int, timeout time.Duration) map[string]any {
	t.Helper()
	deadline := time.NewTimer(testutil.Scaled(timeout))
	defer deadline.Stop()
	seen, found := 0, 0
	for {
		exited := p.Exited() // before the snapshot: every line is read before the process counts as exited
		p.mu.Lock()
		logs, ch := p.logs[seen:], p.changed
		seen = len(p.logs)
		p.mu.Unlock()
		for _, l := range logs {
			if l["msg"] == msg {
				if found++; found == n {
					return l
				}
			}
		}
		if exited {
			t.Fatalf("%s exited (%v) before logging %q", p.Name, p.waitErr, msg)
		}
		select {
		case <-ch:
		case <-p.done:
		case <-deadline.C:
			t.Fatalf("%s did not log %q within %v", p.Name, msg, testutil.Scaled(timeout))
		}
	}
}

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Signal sends sig (SIGTERM, SIGINT, SIGSTOP, SIGCONT, SIGKILL).
func (p *Proc) Signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, p.Cmd.Process.Signal(sig))
}

// Kill sends SIGKILL (the process gets no chance to clean up: its sockets
// and socket files stay behind, as after a crash) and waits until it is
// gone.
func (p *Proc) Kill(t testing.TB) {
	t.Helper()
	p.Signal(t, syscall.SIGKILL)
	require.Equal(t, -1, p.Wait(t, ExitTimeout), "%s was killed by the signal", p.Name)
}

// Wait waits for the process to exit within timeout (scaled) and returns
// its exit code (-1 when killed by a signal).
func (p *Proc) Wait(t testing.TB, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(testutil.Scaled(timeout)):
		t.Fatalf("%s did not exit within %v", p.Name, testutil.Scaled(timeout))
	}
	var ee *exec.ExitError
	if errors.As(p.waitErr, &ee) {
		return ee.ExitCode()
	}
	require.NoError(t, p.waitErr)
	return 0
}

// SidecarOpts are the flags of one `kvsidecar serve`.
type SidecarOpts struct {
	Engine string
	Role   string // default "both"
	TPRank int
	TPSize int // default 1
	// Args are extra flags (--model, --num-blocks, --drain-timeout, ...).
	Args []string
	// Listen is the QUIC listen address; default "127.0.0.1:0".
	Listen string
	// MetricsAddr is the metrics HTTP address; default "127.0.0.1:0".
	MetricsAddr string
	// Netns, when set, runs the sidecar inside that network namespace.
	Netns string
	// Env are extra NAME=VALUE environment variables of the process.
	Env []string
	// TLS, when set, are the sidecar's certificate files instead of ones
	// of the env's CA.
	TLS *devtls.Files
}

// Sidecar is a running `kvsidecar serve`.
type Sidecar struct {
	*Proc
	Opts SidecarOpts
	// Socket is the local API socket path.
	Socket string
	// MetricsURL is http://host:port of /metrics, /healthz, /readyz.
	MetricsURL string
}

// StartSidecar starts `kvsidecar serve` with dev TLS, the env's socket dir
// and capability key, QUIC and metrics on loopback ports the kernel picks,
// and waits until the local socket and the metrics endpoint are up.
func (e *Env) StartSidecar(t testing.TB, o SidecarOpts) *Sidecar {
	t.Helper()
	if o.TPSize == 0 {
		o.TPSize = 1
	}
	if o.Role == "" {
		o.Role = "both"
	}
	if o.Listen == "" {
		o.Listen = "127.0.0.1:0"
	}
	if o.MetricsAddr == "" {
		o.MetricsAddr = "127.0.0.1:0"
	}
	name := fmt.Sprintf("%s-tp%d", o.Engine, o.TPRank)
	host, _, err := net.SplitHostPort(o.Listen)
	require.NoError(t, err, "SidecarOpts.Listen")
	tf := e.TLS(t, name, host) // peers verify the address they dial
	if o.TLS != nil {
		tf = *o.TLS
	}
	args := []string{"serve", "--engine-id", o.Engine, "--role", o.Role, "--tp-rank", strconv.Itoa(o.TPRank),
		"--tp-size", strconv.Itoa(o.TPSize), "--tls-cert", tf.Cert, "--tls-key", tf.Key, "--tls-ca", tf.CA,
		"--capability-key-file", e.CapKey, "--socket-dir", e.SocketDir, "--listen", o.Listen,
		"--metrics-addr", o.MetricsAddr, "--log-level", "debug"}
	args = append(args, o.Args...)
	cmd := binaryCmd(t, o.Netns, args)
	cmd.Env = append(os.Environ(), o.Env...)
	p := startCmd(t, name, cmd)
	m := p.WaitLog(t, "metrics listening", StartTimeout)
	s := p.WaitLog(t, "serving", StartTimeout)
	return &Sidecar{Proc: p, Opts: o, Socket: s["socket"].(string), MetricsURL: "http://" + m["addr"].(string)}
}

// Get fetches path from the sidecar's metrics endpoint and returns the
// status code and body.
func (s *Sidecar) Get(t testing.TB, path string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testutil.Scaled(10*time.Second))
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.MetricsURL+path, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// Metric returns the sum of the samples of the metric family name in a
// /metrics scrape whose label set contains every one of labels
// (`role="server"` ...); with no labels, every sample (0 when absent).
func (s *Sidecar) Metric(t testing.TB, name string, labels ...string) float64 {
	t.Helper()
	code, body := s.Get(t, "/metrics")
	require.Equal(t, http.StatusOK, code)
	var sum float64
	for _, line := range strings.Split(body, "\n") {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		match := true
		for _, l := range labels {
			match = match && strings.Contains(rest, l)
		}
		if !match {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		require.NoError(t, err, line)
		sum += v
	}
	return sum
}

// WaitMetric polls Metric(name, labels...) until it reads want, and fails
// with the last value after 30 s (scaled). For counters the serving side
// updates after its peer already saw the result: a served READ's bytes and
// its result are counted once the last write returned, which can be after
// the reader's load finished.
func (s *Sidecar) WaitMetric(t testing.TB, name string, want float64, labels ...string) {
	t.Helper()
	waitEqual(t, 30*time.Second, want, func() float64 { return s.Metric(t, name, labels...) }, "%s: %s%v", s.Name, name, labels)
}

// waitEqual polls read until it returns want, and after timeout (scaled)
// fails the test with the last value read: the real processes e2e drives
// announce no event for what it waits on.
func waitEqual[T comparable](t testing.TB, timeout time.Duration, want T, read func() T, msgAndArgs ...any) {
	t.Helper()
	deadline := time.Now().Add(testutil.Scaled(timeout))
	for {
		got := read()
		if got == want || time.Now().After(deadline) {
			require.Equal(t, want, got, msgAndArgs...)
			return
		}
		time.Sleep(time.Millisecond) // wallclock: e2e polls the real sidecar
	}
}

// Ctl runs `kvsidecar ctl --socket <socket> args...` and returns its exit
// code, stdout and stderr.
func (s *Sidecar) Ctl(t testing.TB, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testutil.Scaled(20*time.Second))
	defer cancel()
	cmd := exec.CommandContext(ctx, Binary(t), append([]string{"ctl", "--socket", s.Socket}, args...)...)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), out.String(), errb.String()
	}
	require.NoError(t, err)
	return 0, out.String(), errb.String()
}

// QUICAddr waits until the sidecar's rank listens (it starts when the
// engine creates the KV cache) and returns its QUIC address.
func (s *Sidecar) QUICAddr(t testing.TB) string {
	t.Helper()
	return s.WaitLog(t, "rank listening", StartTimeout)["addr"].(string)
}

// Restart starts the sidecar again with the same options on the QUIC
// address it listened on (the previous process must have exited), as an
// operator restarting a crashed sidecar does; the new process has a new
// incarnation.
func (e *Env) Restart(t testing.TB, s *Sidecar) *Sidecar {
	t.Helper()
	require.True(t, s.Exited(), "%s must have exited before a restart", s.Name)
	o := s.Opts
	o.Listen = s.QUICAddr(t)
	return e.StartSidecar(t, o)
}

// StartGroup starts the o.TPSize ranks of one engine instance (o.TPRank is
// ignored), each on a UDP port picked here and given to every rank with
// --rank-addrs, so kv_transfer_params carry remote_rank_addrs. Ranks start
// in order; in coordinated ownership rank 0 must come first.
func (e *Env) StartGroup(t testing.TB, o SidecarOpts) []*Sidecar {
	t.Helper()
	addrs := FreeUDPAddrs(t, "127.0.0.1", o.TPSize)
	ranks := make([]*Sidecar, o.TPSize)
	for r := range ranks {
		ro := o
		ro.TPRank, ro.Listen = r, addrs[r]
		ro.Args = append(append([]string(nil), o.Args...), "--rank-addrs", strings.Join(addrs, ","))
		ranks[r] = e.StartSidecar(t, ro)
	}
	return ranks
}

// FreeUDPAddrs returns n host:port addresses whose UDP ports were free a
// moment ago (bound and closed here, so another process could take one in
// between; the kernel hands out recently closed ports last).
func FreeUDPAddrs(t testing.TB, host string, n int) []string {
	t.Helper()
	var out []string
	var conns []net.PacketConn
	for range n {
		c, err := net.ListenPacket("udp", net.JoinHostPort(host, "0"))
		require.NoError(t, err)
		conns = append(conns, c)
		out = append(out, c.LocalAddr().String())
	}
	for _, c := range conns {
		require.NoError(t, c.Close())
	}
	return out
}

// ClientTLS returns a client TLS config with a certificate of the env's
// CA, for a test-process QUIC agent talking to the sidecars as a peer.
func (e *Env) ClientTLS(t testing.TB) *tls.Config {
	t.Helper()
	c, err := e.ca.ClientConfig()
	require.NoError(t, err)
	return c
}

// Stats runs `kvsidecar ctl stats` and returns its "key: value" lines as
// numbers (cache_ready as 1 or 0).
func (s *Sidecar) Stats(t testing.TB) map[string]uint64 {
	t.Helper()
	code, out, errOut := s.Ctl(t, "stats")
	require.Zero(t, code, "ctl stats: %s", errOut)
	m := map[string]uint64{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		k, v, ok := strings.Cut(line, ": ")
		require.True(t, ok, "ctl stats line %q", line)
		switch v {
		case "true":
			m[k] = 1
		case "false":
			m[k] = 0
		default:
			n, err := strconv.ParseUint(v, 10, 64)
			require.NoError(t, err, "ctl stats line %q", line)
			m[k] = n
		}
	}
	return m
}
