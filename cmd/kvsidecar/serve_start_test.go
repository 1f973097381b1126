package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/x509"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
)

// serveEnv is what a serve command line needs on this host: dev TLS files
// for loopback, a capability key and a socket directory.
type serveEnv struct {
	ca        *devtls.CA
	tls       devtls.Files
	capKey    string
	socketDir string
}

func newServeEnv(t testing.TB) serveEnv {
	t.Helper()
	ca, err := devtls.NewCA()
	require.NoError(t, err)
	dir := t.TempDir()
	files, err := ca.WriteFiles(filepath.Join(dir, "tls"), "sidecar")
	require.NoError(t, err)
	key := filepath.Join(dir, "cap.key")
	require.NoError(t, os.WriteFile(key, []byte("0123456789abcdef0123"), 0o600))
	return serveEnv{ca: ca, tls: files, capKey: key, socketDir: filepath.Join(dir, "sock")}
}

// args is a working serve command line for engine "e", TP 1, followed by
// extra (a flag given twice takes the later value).
func (e serveEnv) args(extra ...string) []string {
	return append([]string{"serve", "--engine-id", "e", "--tp-size", "1", "--tls-cert", e.tls.Cert, "--tls-key", e.tls.Key,
		"--tls-ca", e.tls.CA, "--capability-key-file", e.capKey, "--socket-dir", e.socketDir}, extra...)
}

// smallGQA is an engine's geometry for create calls: 1 layer × 2 KV heads
// × 64 × bf16.
var smallGQA = &v1.ModelGeometry{Model: "custom", NumLayers: 1, NumKvHeads: 2, HeadDim: 64, Dtype: v1.DType_DTYPE_BFLOAT16,
	BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}

// dialServe connects to a serve's local API socket as its engine; the
// connection closes at the end of the test.
func dialServe(t testing.TB, sock string) *localapi.Client {
	t.Helper()
	c, err := localapi.Dial(t.Context(), sock, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// serveProc is `kvsidecar serve` run in-process by run().
type serveProc struct {
	logs chan map[string]any // every stderr line; a line that is not JSON as {"msg": line}
	code chan int            // run's exit status
}

// startServe runs args in-process under ctx; the test ends it by ending ctx
// (t.Cleanup waits for the exit).
func startServe(t testing.TB, ctx context.Context, args []string) *serveProc {
	t.Helper()
	pr, pw := io.Pipe()
	p := &serveProc{logs: make(chan map[string]any, 1024), code: make(chan int, 1)}
	go func() {
		code := run(ctx, args, io.Discard, pw)
		_ = pw.Close()
		p.code <- code
	}()
	go func() {
		defer close(p.logs)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			m := map[string]any{}
			if json.Unmarshal(sc.Bytes(), &m) != nil {
				m = map[string]any{"msg": sc.Text()}
			}
			p.logs <- m
		}
	}()
	return p
}

// waitLog returns the first log line with message msg; it fails the test
// when serve exits first or after a (scaled) 20 s.
func (p *serveProc) waitLog(t testing.TB, msg string) map[string]any {
	t.Helper()
	timeout := time.NewTimer(testutil.Scaled(20 * time.Second)) // wallclock: serve runs on real sockets and signals; a generous scaled bound on start-up
	defer timeout.Stop()
	for {
		select {
		case m, ok := <-p.logs:
			require.True(t, ok, "serve exited before logging %q", msg)
			if m["msg"] == msg {
				return m
			}
		case <-timeout.C:
			require.FailNow(t, "no log line "+msg)
		}
	}
}

// wait returns serve's exit status.
func (p *serveProc) wait(t testing.TB) int {
	t.Helper()
	select {
	case c := <-p.code:
		return c
	case <-time.After(testutil.Scaled(40 * time.Second)): // wallclock: a generous scaled bound on serve's shutdown (real sockets, signals)
		require.FailNow(t, "serve did not exit")
		return -1
	}
}

// TestServeFailsAtStart: settings that cannot work fail before "serving",
// with exit 1 for the host and 2 for the flags, naming the flag.
func TestServeFailsAtStart(t *testing.T) {
	env := newServeEnv(t)
	held, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = held.Close() })
	file := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	tests := []startCase{
		{"listen port in use", []string{"--listen", held.LocalAddr().String()}, 1,
			[]string{"--listen " + held.LocalAddr().String() + ": bind: address already in use"}},
		{"listen address not on this host", []string{"--listen", "192.0.2.1:0"}, 1,
			[]string{"--listen 192.0.2.1:0: bind: cannot assign requested address"}},
		{"qlog dir under a file", []string{"--qlog-dir", filepath.Join(file, "qlog")}, 1,
			[]string{"--qlog-dir " + filepath.Join(file, "qlog") + ":", "not a directory"}},
		{"socket dir under a file", []string{"--socket-dir", filepath.Join(file, "sock")}, 1,
			[]string{"--socket-dir " + filepath.Join(file, "sock") + ":", "not a directory"}},
		{"tp 2 on port 0", []string{"--tp-size", "2"}, 2,
			[]string{"--rank-addrs: required when --tp-size=2 > 1 and --listen=127.0.0.1:0 has port 0"}},
		{"advertise port 0", []string{"--advertise", "10.0.0.1:0"}, 2, []string{`--advertise: "10.0.0.1:0": port 0 cannot be dialed`}},
		{"rank addrs entry is another host", []string{"--tp-size", "2", "--listen", "127.0.0.1:0", "--rank-addrs", "10.0.0.1:5600,10.0.0.2:5600",
			"--advertise", "10.0.0.3:5600"}, 2,
			[]string{"--rank-addrs entry 0 (--tp-rank) is 10.0.0.1:5600 but --advertise is 10.0.0.3:5600"}},
		{"rank addrs entry is another port than bound", []string{"--tp-size", "2", "--tp-rank", "1", "--listen", "127.0.0.1:0",
			"--rank-addrs", "127.0.0.1:5600,127.0.0.1:5601"}, 2,
			[]string{"--rank-addrs entry 1 (--tp-rank) is 127.0.0.1:5601 but the bound --listen address is 127.0.0.1:"}},
		{"wildcard listen without advertise", []string{"--listen", "0.0.0.0:5700"}, 2,
			[]string{"--advertise: required when --listen=0.0.0.0:5700 has a wildcard host", "--advertise 10.0.0.5:5700"}},
		{"ipv6 wildcard listen without advertise", []string{"--listen", "[::]:0"}, 2, []string{"--advertise: required when --listen=[::]:0"}},
		{"empty listen host without advertise", []string{"--listen", ":5700"}, 2, []string{"--advertise: required when --listen=:5700"}},
		{"wildcard advertise", []string{"--listen", "0.0.0.0:5700", "--advertise", "0.0.0.0:5700"}, 2,
			[]string{`--advertise: "0.0.0.0:5700": a wildcard host cannot be dialed`}},
		{"wildcard rank addrs entry", []string{"--tp-size", "2", "--listen", "0.0.0.0:5700", "--rank-addrs", "10.0.0.1:5700,[::]:5701"}, 2,
			[]string{`--rank-addrs: [1]="[::]:5701": a wildcard host cannot be dialed`}},
		{"duplicate rank addrs", []string{"--tp-size", "3", "--listen", "127.0.0.1:5700", "--rank-addrs", "node0:5700,node1:5700,NODE0:5700"}, 2,
			[]string{`--rank-addrs: [0]="node0:5700" and [2]="NODE0:5700" are the same address`}},
		{"tls ca is a leaf", []string{"--tls-ca", env.tls.Cert}, 2, []string{"--tls-ca " + env.tls.Cert + ": holds no CA certificate", "IsCA false"}},
		{"model and dtype", []string{"--model", "llama-3.1-8b", "--dtype", "float32"}, 2,
			[]string{`--model: "llama-3.1-8b" fixes the geometry; drop --dtype`}},
		{"model and attention and head dim", []string{"--model", "llama-3.1-8b", "--attention", "gqa", "--head-dim", "128"}, 2,
			[]string{"drop --head-dim, --attention"}},
		{"dtype alone", []string{"--dtype", "float32"}, 2, []string{"--layers, --kv-heads, --head-dim: all three are required"}},
	}
	tests = append(tests, hostCheckCases(t, env)...)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var errb bytes.Buffer
			code := run(t.Context(), env.args(tc.extra...), io.Discard, &errb)
			require.Equal(t, tc.code, code, errb.String())
			for _, w := range tc.want {
				require.Contains(t, errb.String(), w)
			}
			require.NotContains(t, errb.String(), `"msg":"serving"`)
		})
	}
}

// TestServeCUDAProbedAtStart: --backend cuda on a host without a usable GPU
// fails before "serving" with the backend's error.
func TestServeCUDAProbedAtStart(t *testing.T) {
	if be, err := cuda.New(&cuda.Config{}); err == nil {
		_ = be.Close()
		t.Skip("this host has a GPU: the probe passes")
	}
	env := newServeEnv(t)
	var errb bytes.Buffer
	code := run(t.Context(), env.args("--backend", "cuda"), io.Discard, &errb)
	require.Equal(t, 1, code, errb.String())
	require.Contains(t, errb.String(), "kvsidecar serve: --backend cuda --device 0: cuda:")
	_, err := os.Stat(env.socketDir)
	require.ErrorIs(t, err, os.ErrNotExist, "nothing created before the probe")
}

func TestServeUnknownModelListedOnce(t *testing.T) {
	env := newServeEnv(t)
	var errb bytes.Buffer
	require.Equal(t, 2, run(t.Context(), env.args("--model", "nope"), io.Discard, &errb))
	require.Contains(t, errb.String(), `--model: unknown "nope"; known: `)
	require.Equal(t, 1, strings.Count(errb.String(), "llama-3.1-8b"), errb.String())
}

// TestServeStartsAndStopsOnSIGHUP: the QUIC socket is bound before
// "serving" (which names it and the advertised address), a misspelled
// KVSIDECAR_ variable is warned about, the engine's rank serves on that
// socket, and SIGHUP drains like SIGTERM: exit 0, socket removed.
func TestServeStartsAndStopsOnSIGHUP(t *testing.T) {
	env := newServeEnv(t)
	t.Setenv("KVSIDECAR_TPSIZE", "2")
	ctx, stop := signal.NotifyContext(t.Context(), shutdownSignals...)
	defer stop()
	p := startServe(t, ctx, env.args("--num-blocks", "4"))

	warn := p.waitLog(t, "ignoring environment variable that matches no flag")
	require.Equal(t, "WARN", warn["level"])
	require.Equal(t, "KVSIDECAR_TPSIZE (did you mean KVSIDECAR_TP_SIZE?)", warn["var"])

	open := p.waitLog(t, "--allow-peers is not set: a load dials any address its kv_transfer_params name, and those can come from a client's request; list the prefill ranks' networks or addresses")
	require.Equal(t, "WARN", open["level"])
	line := p.waitLog(t, "serving")
	quicAddr, _ := line["quic_addr"].(string)
	host, port, err := net.SplitHostPort(quicAddr)
	require.NoError(t, err, "quic_addr %v", line["quic_addr"])
	require.Equal(t, "127.0.0.1", host)
	require.NotEqual(t, "0", port)
	require.Equal(t, quicAddr, line["advertise"])
	require.Equal(t, transfer.NewCapabilityKeyFromSecret([]byte("0123456789abcdef0123")).ID(), line["capability_key_id"],
		"the serving line names the key's fingerprint, never the key")
	_, err = net.ListenPacket("udp", quicAddr)
	require.ErrorIs(t, err, syscall.EADDRINUSE, "serve holds the QUIC socket before an engine attaches")
	sock := line["socket"].(string)

	c := dialServe(t, sock)
	geom := smallGQA
	_, err = c.Attach(t.Context(), &v1.CreateKVCache{Geometry: geom, TpRank: 0, TpSize: 2, NumBlocks: 4})
	require.ErrorContains(t, err, "tp_size=2, but this sidecar was started with 1")
	_, err = c.Attach(t.Context(), &v1.CreateKVCache{Geometry: geom, TpRank: 0, TpSize: 1, NumBlocks: 4})
	require.NoError(t, err, "a create after a refused one")
	require.Equal(t, quicAddr, p.waitLog(t, "rank listening")["addr"], "the rank serves on the socket bound at start")

	require.NoError(t, syscall.Kill(os.Getpid(), syscall.SIGHUP))
	require.Equal(t, "30s", p.waitLog(t, "shutting down: refusing new requests, draining")["drain_timeout"])
	require.Equal(t, 0, p.wait(t))
	_, err = os.Stat(sock)
	require.ErrorIs(t, err, os.ErrNotExist, "the local socket is removed")
	pc, err := net.ListenPacket("udp", quicAddr)
	require.NoError(t, err, "the QUIC socket is released")
	require.NoError(t, pc.Close())
}

// TestSharedUDPOutlivesAgents: the socket lent to a transfer agent stays
// open when the agent closes, so a second agent (an engine's retried
// create) serves on the same address; between agents the standby answers
// on it: a dial is refused with its reason, not left unanswered.
//
// fault-matrix: prefill-restart-before-attach
func TestSharedUDPOutlivesAgents(t *testing.T) {
	udp, err := listenQUIC("127.0.0.1:0", slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	defer udp.shutdown()
	ca, err := devtls.NewCA()
	require.NoError(t, err)
	srvTLS, err := ca.ServerConfig()
	require.NoError(t, err)
	cliTLS, err := ca.ClientConfig()
	require.NoError(t, err)
	udp.newStandby = func(pc net.PacketConn) (*transfer.Standby, error) {
		return transfer.NewStandby(&transfer.Config{PacketConn: pc, ServerTLS: srvTLS}, v1.Code_CODE_UNAVAILABLE, "no engine attached")
	}
	require.NoError(t, udp.Close(), "starts the standby")
	dialer, err := transfer.New(&transfer.Config{ClientTLS: cliTLS})
	require.NoError(t, err)
	defer dialer.Close()
	for i := range 2 {
		_, err = dialer.Heartbeat(t.Context(), udp.LocalAddr().String(), &v1.Heartbeat{})
		require.ErrorIs(t, err, transfer.ErrUnavailable, "standby before agent %d", i)
		require.ErrorContains(t, err, "no engine attached")
		a, err := transfer.New(&transfer.Config{PacketConn: udp.lend(), ServerTLS: srvTLS, ClientTLS: cliTLS})
		require.NoError(t, err, "agent %d", i)
		require.Equal(t, udp.LocalAddr().String(), a.Addr().String())
		_, err = dialer.Heartbeat(t.Context(), udp.LocalAddr().String(), &v1.Heartbeat{})
		require.NoError(t, err, "agent %d serves", i)
		require.NoError(t, a.Close())
	}
	require.NoError(t, udp.SetReadDeadline(time.Time{}), "still open")
}

func TestAdvertisedAddr(t *testing.T) {
	bound := func(s string) net.Addr {
		a, err := net.ResolveUDPAddr("udp", s)
		require.NoError(t, err)
		return a
	}
	tests := []struct {
		name              string
		listen, advertise string
		rankAddrs         []string
		rank              int
		bound             string
		want, wantErr     string
	}{
		{"bound", "127.0.0.1:0", "", nil, 0, "127.0.0.1:41000", "127.0.0.1:41000", ""},
		{"advertise", "0.0.0.0:5600", "node1:5600", nil, 0, "0.0.0.0:5600", "node1:5600", ""},
		{"entry agrees with advertise", "0.0.0.0:5600", "node1:5600", []string{"node0:5600", "NODE1:5600"}, 1, "0.0.0.0:5600", "node1:5600", ""},
		{"entry names the host of a wildcard listen", "0.0.0.0:5601", "", []string{"10.0.0.1:5600", "10.0.0.1:5601"}, 1, "0.0.0.0:5601", "10.0.0.1:5601", ""},
		{"entry names the listen host", "localhost:5600", "", []string{"localhost:5600"}, 0, "127.0.0.1:5600", "localhost:5600", ""},
		{"entry is the bound ip", "[::1]:5600", "", []string{"[0:0::1]:5600"}, 0, "[::1]:5600", "[0:0::1]:5600", ""},
		{"entry port differs from wildcard listen", "0.0.0.0:5600", "", []string{"10.0.0.1:5601"}, 0, "0.0.0.0:5600", "",
			"--rank-addrs entry 0 (--tp-rank) is 10.0.0.1:5601 but the bound --listen address is 0.0.0.0:5600"},
		{"entry host differs from advertise", "0.0.0.0:5600", "10.0.0.2:5600", []string{"10.0.0.1:5600"}, 0, "0.0.0.0:5600", "",
			"--rank-addrs entry 0 (--tp-rank) is 10.0.0.1:5600 but --advertise is 10.0.0.2:5600"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := &serveFlags{listen: tc.listen, advertise: tc.advertise, tpRank: tc.rank}
			got, err := advertisedAddr(f, tc.rankAddrs, bound(tc.bound))
			if tc.wantErr != "" {
				require.ErrorIs(t, err, errUsage)
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestUnknownEnv(t *testing.T) {
	var f serveFlags
	fs := newFlagSet("serve", "", io.Discard).FlagSet
	f.register(fs)
	got := unknownEnv(fs, []string{
		"KVSIDECAR_TP_SIZE=2", "KVSIDECAR_TPSIZE=2", "KVSIDECAR_ENGINEID=x", "KVSIDECAR_FROB=1",
		"KVSIDECAR_TIME_SCALE=3", "PATH=/bin", "KVSIDECAR_kv_heads=8",
		// Real misspellings: a doubled letter, a dropped one, a swapped pair.
		"KVSIDECAR_LEASE_TTLL=1m", "KVSIDECAR_TLS_CRT=x", "KVSIDECAR_ENIGNE_ID=e",
		// Too far from every flag for a guess.
		"KVSIDECAR_LEASE=1m",
	})
	require.Equal(t, []string{
		"KVSIDECAR_ENGINEID (did you mean KVSIDECAR_ENGINE_ID?)",
		"KVSIDECAR_ENIGNE_ID (did you mean KVSIDECAR_ENGINE_ID?)",
		"KVSIDECAR_FROB",
		"KVSIDECAR_LEASE",
		"KVSIDECAR_LEASE_TTLL (did you mean KVSIDECAR_LEASE_TTL?)",
		"KVSIDECAR_TLS_CRT (did you mean KVSIDECAR_TLS_CERT?)",
		"KVSIDECAR_TPSIZE (did you mean KVSIDECAR_TP_SIZE?)",
		"KVSIDECAR_kv_heads (did you mean KVSIDECAR_KV_HEADS?)",
	}, got)
}

func TestEditDistance(t *testing.T) {
	tests := []struct {
		a, b string
		want int
	}{
		{"", "", 0}, {"", "abc", 3}, {"abc", "", 3}, {"LEASETTL", "LEASETTLL", 1},
		{"ENIGNEID", "ENGINEID", 2}, {"kitten", "sitting", 3}, {"same", "same", 0},
	}
	for _, tc := range tests {
		require.Equal(t, tc.want, editDistance(tc.a, tc.b), "%q %q", tc.a, tc.b)
		require.Equal(t, tc.want, editDistance(tc.b, tc.a), "symmetric: %q %q", tc.b, tc.a)
	}
}

// TestServeUsageErrorNamesStrayEnv: a usage error caused by a misspelled
// variable says which variables were ignored.
func TestServeUsageErrorNamesStrayEnv(t *testing.T) {
	t.Setenv("KVSIDECAR_ENGINE_ID", "e")
	t.Setenv("KVSIDECAR_TPSIZE", "1")
	var errb bytes.Buffer
	require.Equal(t, 2, run(t.Context(), []string{"serve"}, io.Discard, &errb))
	require.Contains(t, errb.String(), "--tp-size: 0: required")
	require.Contains(t, errb.String(), "(ignored, matching no flag: KVSIDECAR_TPSIZE (did you mean KVSIDECAR_TP_SIZE?))")
}

// TestServeGeometryRules: a geometry the sidecar cannot serve is refused at
// start as a usage error (exit 2) naming the flags and the rule, before
// "serving"; the reported MLA case made blocks 16 times too large and failed
// every load with CODE_INTERNAL instead.
func TestServeGeometryRules(t *testing.T) {
	env := newServeEnv(t)
	explicit := func(layers, heads, dim string, more ...string) []string {
		return append([]string{"--layers", layers, "--kv-heads", heads, "--head-dim", dim}, more...)
	}
	tests := []struct {
		name  string
		extra []string
		want  []string
	}{
		{"mla needs one latent head", explicit("2", "16", "576", "--attention", "mla"),
			[]string{"--attention, --kv-heads: num_kv_heads=16 with attention MLA", "must be 1"}},
		{"mla in a compound layout", explicit("2", "1", "576", "--attention", "mla", "--kv-layout", "H2ND"),
			[]string{"--attention, --kv-layout: layout LAYOUT_H2ND with attention MLA"}},
		{"compound block beyond a page", []string{"--model", "llama-3.1-8b", "--kv-layout", "HN2D", "--block-size", "1024"},
			[]string{"--block-size 1024: one block of this rank is 4194304 bytes", "regions=32"}},
		{"gqa heads do not divide tp", explicit("2", "6", "64", "--tp-size", "4"),
			[]string{"--kv-heads, --tp-size: tp_size=4 and num_kv_heads=6: one must divide the other"}},
		{"tp does not divide the model's heads", []string{"--model", "llama-3.1-8b", "--tp-size", "3"},
			[]string{"--model llama-3.1-8b, --tp-size: tp_size=3 and num_kv_heads=8"}},
		{"replicated heads must divide tp", explicit("2", "8", "64", "--tp-size", "12"),
			[]string{"--kv-heads, --tp-size: tp_size=12 and num_kv_heads=8"}},
		{"too many layers", explicit("5000", "8", "64"), []string{"--layers: num_layers=5000 must be in [1, 4096]"}},
		{"head dim too large", explicit("2", "8", "70000"), []string{"--head-dim: head_dim=70000 must be in [1, 65536]"}},
		{"kv heads too many", explicit("2", "5000", "64"), []string{"--kv-heads: num_kv_heads=5000 must be in [1, 4096]"}},
		{"negative heads", explicit("2", "-1", "64"), []string{"--layers, --kv-heads, --head-dim: all three are required and positive"}},
		{"block size zero", []string{"--model", "llama-3.1-8b", "--block-size", "0"}, []string{"--block-size: 0: must be in [1, 65536]"}},
		{"block size too large", []string{"--block-size", "70000"}, []string{"--block-size: 70000: must be in [1, 65536]"}},
		{"block beyond a page", explicit("2", "8", "128", "--dtype", "float32", "--block-size", "1024"),
			[]string{"--block-size 1024: one block of this rank is 4194304 bytes", "more than the host backend's page of 2097152 bytes"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var errb bytes.Buffer
			code := run(t.Context(), env.args(tc.extra...), io.Discard, &errb)
			require.Equal(t, 2, code, errb.String())
			for _, w := range tc.want {
				require.Contains(t, errb.String(), w)
			}
			require.NotContains(t, errb.String(), `"msg":"serving"`)
		})
	}
}

// TestServeCreateRefusesGeometry: the engine's create call meets the rules
// serve's flags meet, and a refusal carries CODE_INVALID_ARGUMENT naming the
// field, never CODE_INTERNAL; a valid create afterwards succeeds.
func TestServeCreateRefusesGeometry(t *testing.T) {
	env := newServeEnv(t)
	ctx, cancel := context.WithCancel(t.Context())
	p := startServe(t, ctx, env.args("--tp-size", "2", "--role", "decode", "--num-blocks", "4"))
	t.Cleanup(func() {
		cancel()
		require.Equal(t, 0, p.wait(t))
	})
	sock := p.waitLog(t, "serving")["socket"].(string)
	c := dialServe(t, sock)
	geom := func(f func(g *v1.ModelGeometry)) *v1.ModelGeometry {
		g := proto.Clone(smallGQA).(*v1.ModelGeometry)
		g.NumLayers, g.NumKvHeads = 2, 8
		f(g)
		return g
	}
	tests := []struct {
		name string
		g    *v1.ModelGeometry
		want string
	}{
		{"mla with 16 heads", geom(func(g *v1.ModelGeometry) { g.Attention, g.NumKvHeads, g.HeadDim = v1.Attention_ATTENTION_MLA, 16, 576 }),
			"num_kv_heads=16 with attention MLA"},
		{"gqa 3 heads on tp 2", geom(func(g *v1.ModelGeometry) { g.NumKvHeads = 3 }), "tp_size=2 and num_kv_heads=3: one must divide the other"},
		{"head dim 0", geom(func(g *v1.ModelGeometry) { g.HeadDim = 0 }), "head_dim=0 must be in [1, 65536]"},
		{"layers beyond the limit", geom(func(g *v1.ModelGeometry) { g.NumLayers = 5000 }), "num_layers=5000 must be in [1, 4096]"},
		{"block size beyond the limit", geom(func(g *v1.ModelGeometry) { g.BlockSize = 70000 }), "block_size=70000 must be in [1, 65536]"},
		{"block beyond a page", geom(func(g *v1.ModelGeometry) { g.BlockSize, g.Dtype = 4096, v1.DType_DTYPE_FLOAT32 }), "exceeds the page size"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Attach(t.Context(), &v1.CreateKVCache{Geometry: tc.g, TpRank: 0, TpSize: 2, NumBlocks: 4})
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err), "%v", err)
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, err := c.Attach(t.Context(), &v1.CreateKVCache{Geometry: geom(func(*v1.ModelGeometry) {}), TpRank: 0, TpSize: 2, NumBlocks: 4})
	require.NoError(t, err, "a valid create after the refused ones")
}

// startCase is a serve command line (env.args plus extra) that must fail at
// start with code, its message containing every want, and no "serving".
type startCase struct {
	name  string
	extra []string
	code  int
	want  []string
}

// hostCheckCases are the start-up checks of files and certificates: each
// exits 1 naming the flag, the file and the mismatch.
func hostCheckCases(t *testing.T, env serveEnv) []startCase {
	dir := t.TempDir()
	otherCA, err := devtls.NewCA()
	require.NoError(t, err)
	other, err := otherCA.WriteFiles(filepath.Join(dir, "other"), "other")
	require.NoError(t, err)
	ca := env.ca
	expired, err := ca.WriteFilesWith(filepath.Join(dir, "expired"), "expired", func(c *x509.Certificate) {
		c.NotBefore, c.NotAfter = time.Now().Add(-48*time.Hour), time.Now().Add(-24*time.Hour)
	})
	require.NoError(t, err)
	future, err := ca.WriteFilesWith(filepath.Join(dir, "future"), "future", func(c *x509.Certificate) {
		c.NotBefore, c.NotAfter = time.Now().Add(24*time.Hour), time.Now().Add(48*time.Hour)
	})
	require.NoError(t, err)
	serverOnly, err := ca.WriteFilesWith(filepath.Join(dir, "server"), "server", func(c *x509.Certificate) {
		c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	})
	require.NoError(t, err)
	open := filepath.Join(dir, "open.key")
	require.NoError(t, os.WriteFile(open, []byte("0123456789abcdef0123"), 0o600))
	require.NoError(t, os.Chmod(open, 0o644)) // the umask may have dropped bits at create
	group := filepath.Join(dir, "group.key")
	require.NoError(t, os.WriteFile(group, []byte("0123456789abcdef0123"), 0o600))
	require.NoError(t, os.Chmod(group, 0o640))
	certOf := func(f devtls.Files) []string { return []string{"--tls-cert", f.Cert, "--tls-key", f.Key} }
	return []startCase{
		{"certificate of another CA", certOf(other), 1, []string{"--tls-cert " + other.Cert + ` (issuer "CN=kvsidecar dev CA") does not chain to --tls-ca ` +
			env.tls.CA, "certificate signed by unknown authority"}},
		{"expired certificate", certOf(expired), 1, []string{"--tls-cert " + expired.Cert + ": expired at "}},
		{"certificate not yet valid", certOf(future), 1, []string{"--tls-cert " + future.Cert + ": not valid before "}},
		{"certificate without clientAuth", certOf(serverOnly), 1, []string{"--tls-cert " + serverOnly.Cert + ": not valid for clientAuth"}},
		// The reported input: the certificate names 127.0.0.1, the rank is
		// advertised at 127.0.0.2; peers got "certificate is valid for
		// 127.0.0.1, not 127.0.0.2" at the first request.
		{"sans miss the advertised host", []string{"--listen", "127.0.0.2:0"}, 1, []string{"--tls-cert " + env.tls.Cert +
			": its subject alternative names (IP 127.0.0.1, IP ::1, DNS localhost) do not cover 127.0.0.2, the host of --listen (the advertised address)"}},
		{"sans miss the rank addrs entry", []string{"--tp-size", "2", "--tp-rank", "1",
			"--advertise", "127.0.0.3:5601", "--rank-addrs", "127.0.0.1:5600,127.0.0.3:5601"}, 1,
			[]string{"do not cover 127.0.0.3, the host of --rank-addrs entry 1 (--tp-rank)"}},
		{"capability key readable by others", []string{"--capability-key-file", open}, 1,
			[]string{"--capability-key-file " + open + ": mode 0644 lets group or others read the secret", "chmod 600 " + open}},
		{"capability key readable by the group", []string{"--capability-key-file", group}, 1, []string{"mode 0640"}},
	}
}

// TestServeReadinessAndMetricFamilies: /readyz says which condition holds;
// every kvsidecar_* family a scrape shows once an engine attached is there,
// at 0, before it attached (dashboards show 0, not "no data"); and
// kvsidecar_build_info names the Go version.
func TestServeReadinessAndMetricFamilies(t *testing.T) {
	env := newServeEnv(t)
	ctx, cancel := context.WithCancel(t.Context())
	p := startServe(t, ctx, env.args("--num-blocks", "4", "--metrics-addr", "127.0.0.1:0"))
	t.Cleanup(func() {
		cancel()
		require.Equal(t, 0, p.wait(t))
	})
	base := "http://" + p.waitLog(t, "metrics listening")["addr"].(string)
	sock := p.waitLog(t, "serving")["socket"].(string)
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	families := func(body string) map[string]bool {
		out := map[string]bool{}
		for _, line := range strings.Split(body, "\n") {
			if f := strings.Fields(line); len(f) >= 3 && f[0] == "#" && f[1] == "TYPE" && strings.HasPrefix(f[2], "kvsidecar_") {
				out[f[2]] = true
			}
		}
		return out
	}

	ctlJSON := func() map[string]any {
		var out, errb bytes.Buffer
		require.Equal(t, 0, run(t.Context(), []string{"ctl", "--socket", sock, "stats", "--json"}, &out, &errb), errb.String())
		var m map[string]any
		require.NoError(t, json.Unmarshal(out.Bytes(), &m), out.String())
		return m
	}
	require.Equal(t, map[string]any{"cache_ready": false, "engine_attached": false}, ctlJSON())

	code, body := get("/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "not ready: no KV cache yet (no engine has attached with a create call)\n", body)
	code, before := get("/metrics")
	require.Equal(t, http.StatusOK, code)
	for _, want := range []string{
		`kvsidecar_transfer_failures_total{code="CODE_CAPABILITY_DENIED"} 0`,
		`kvsidecar_transfer_bytes_total{op="read",role="server"} 0`,
		`kvsidecar_connector_requests_total{outcome="done",side="decode"} 0`,
		"kvsidecar_vmm_pages_mapped 0",
		`kvsidecar_local_calls_total{call="create",code="CODE_OK"} 0`,
		`kvsidecar_handshake_seconds_count{mode="piggyback",result="ok"} 0`,
		`go_version="` + runtime.Version() + `"`,
	} {
		require.Contains(t, before, want)
	}
	require.Regexp(t, `(?m)^kvsidecar_build_info\{go_version="[^"]+",revision="[0-9a-f]*",version="[^"]+"\} 1$`, before)

	c := dialServe(t, sock)
	_, err := c.Attach(t.Context(), &v1.CreateKVCache{Geometry: smallGQA, TpRank: 0, TpSize: 1, NumBlocks: 4})
	require.NoError(t, err)
	st := ctlJSON()
	require.Equal(t, true, st["cache_ready"])
	require.InDelta(t, 3, st["blocks_total"], 0, "numbers are JSON numbers (4 blocks less the null block): %v", st)
	require.Equal(t, true, st["engine_attached"])
	require.InDelta(t, 1, st["engine_session"], 0, "the first engine session")
	require.Len(t, st, 14, "the keys of the text output")
	code, body = get("/readyz")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ready: engine session 1 attached (engine_id e, tp_rank 0 of tp_size 1, 1 connections), KV cache and QUIC listener up\n", body)
	_, after := get("/metrics")
	fb, fa := families(before), families(after)
	require.Greater(t, len(fa), 25, "the families of transfer, handshake, connector, vmm and the local API")
	for f := range fa {
		require.True(t, fb[f], "%s appears only after an engine attached", f)
	}
}

// TestServeReservePages: --reserve-pages is the pool's reserve of mapped
// page indices with no block allocated: it fills to the flag's count after
// the engine attached and again after a free trims the pages its blocks
// used back to it; 0 keeps none.
func TestServeReservePages(t *testing.T) {
	for _, n := range []int{0, 3} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			env := newServeEnv(t)
			ctx, cancel := context.WithCancel(t.Context())
			p := startServe(t, ctx, env.args("--num-blocks", "4096", "--reserve-pages", strconv.Itoa(n)))
			t.Cleanup(func() {
				cancel()
				require.Equal(t, 0, p.wait(t))
			})
			c := dialServe(t, p.waitLog(t, "serving")["socket"].(string))
			_, err := c.Attach(t.Context(), &v1.CreateKVCache{Geometry: smallGQA, TpRank: 0, TpSize: 1})
			require.NoError(t, err)
			// smallGQA's blocks are 4 KiB per region: 512 to a 2 MiB page.
			settled := func(what string) {
				t.Helper()
				// wallclock: the refill maps pages on a goroutine of the real
				// serve; a generous scaled bound on a few memfd maps.
				deadline := time.Now().Add(testutil.Scaled(20 * time.Second))
				for {
					st, err := c.Stats(t.Context())
					require.NoError(t, err)
					if st.GetReservePages() == uint64(n) && st.GetPagesMapped() == uint64(1+n) {
						return
					}
					require.True(t, time.Now().Before(deadline), "%s: reserve %d pages, %d mapped; want %d and %d",
						what, st.GetReservePages(), st.GetPagesMapped(), n, 1+n)
					time.Sleep(10 * time.Millisecond)
				}
			}
			settled("after attach")
			ids, err := c.Alloc(t.Context(), 1500)
			require.NoError(t, err)
			st, err := c.Stats(t.Context())
			require.NoError(t, err)
			require.GreaterOrEqual(t, st.GetPagesMapped(), uint64(3), "1500 blocks span 3 pages")
			require.NoError(t, c.Free(t.Context(), ids))
			settled("after the free")
		})
	}
}
