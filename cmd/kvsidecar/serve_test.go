package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestServeFlagErrors(t *testing.T) {
	dir := t.TempDir()
	key := filepath.Join(dir, "cap.key")
	require.NoError(t, os.WriteFile(key, []byte("0123456789abcdef0123"), 0o600))
	short := filepath.Join(dir, "short.key")
	require.NoError(t, os.WriteFile(short, []byte("short"), 0o600))
	base := []string{"--engine-id", "e", "--tp-size", "1", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"}
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"no engine", []string{"--tp-size", "1"}, "--engine-id: required"},
		{"no tp size", []string{"--engine-id", "e"}, "--tp-size: 0: required"},
		{"rank outside", append(base, "--tp-rank", "1"), "--tp-rank: 1: must be in [0, --tp-size=1)"},
		{"role", append(base, "--role", "router"), "--role"},
		{"ownership", append(base, "--ownership", "shared"), "--ownership"},
		{"backend", append(base, "--backend", "tpu"), "--backend"},
		{"device on host", append(base, "--device", "1"), "--device: 1: only the cuda backend"},
		{"unknown model", append(base, "--model", "gpt-9"), "--model"},
		{"model and explicit", append(base, "--model", "llama-3.1-8b", "--layers", "2"), `--model: "llama-3.1-8b" fixes the geometry; drop --layers`},
		{"explicit incomplete", append(base, "--layers", "2"), "all three are required"},
		{"dtype", append(base, "--layers", "2", "--kv-heads", "8", "--head-dim", "64", "--dtype", "int4"), "--dtype"},
		{"tp does not divide heads", []string{"--engine-id", "e", "--tp-size", "3", "--tp-rank", "0", "--capability-key-file", key,
			"--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a", "--model", "llama-3.1-8b"}, "--tp-size"},
		{"kv layout", append(base, "--model", "llama-3.1-8b", "--kv-layout", "NHD"), `--kv-layout: "NHD": want HND, H2ND or HN2D`},
		{"kv layout without geometry", append(base, "--kv-layout", "H2ND"), `--kv-layout: "H2ND" needs a geometry`},
		{"num blocks", append(base, "--num-blocks", "1"), "--num-blocks"},
		{"reserve pages", append(base, "--reserve-pages", "-1"), "--reserve-pages: -1: must be 0 (no reserve) or more"},
		{"memory limit 0%", append(base, "--memory-limit", "0%"), "--memory-limit: 0% is outside the accepted range (0 %, 100 %]"},
		{"memory limit 150%", append(base, "--memory-limit", "150%"), "(0 %, 100 %]"},
		{"listen", append(base, "--listen", "nowhere"), "--listen"},
		{"rank addrs count", append(base, "--rank-addrs", "a:1,b:2"), "--rank-addrs: 2 addresses, want --tp-size=1"},
		{"tls", []string{"--engine-id", "e", "--tp-size", "1"}, "--tls-cert: required"},
		{"cap key needed", []string{"--engine-id", "e", "--tp-size", "2", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"}, "--capability-key-file: required when --tp-size=2"},
		{"cap key short", append(base, "--capability-key-file", short), "--capability-key-file: 5 bytes"},
		{"socket dir", append(base, "--socket-dir", "rel"), "--socket-dir"},
		{"log level", append(base, "--log-level", "loud"), "--log-level"},
		{"lease", append(base, "--lease-ttl", "-1s"), "--lease-ttl"},
		{"progress", append(base, "--progress-timeout", "0s"), "--progress-timeout: 0s: must be positive"},
		{"handshake mode", append(base, "--handshake-mode", "telepathy"), "--handshake-mode"},
		{"read lanes 0", append(base, "--read-lanes", "0"), "--read-lanes: 0: must be in [1, 16]"},
		{"read lanes 17", append(base, "--read-lanes", "17"), "--read-lanes: 17: must be in [1, 16]"},
		{"allow peers entry", append(base, "--allow-peers", "10.0.0.0/8,prefill-0"), `--allow-peers: entry "prefill-0": want a CIDR prefix (10.0.0.0/8), an IP address or host:port`},
		{"allow peers port", append(base, "--allow-peers", "10.0.0.1:99999"), `--allow-peers: entry "10.0.0.1:99999": port "99999" is not in [1, 65535]`},
		{"missing tls files", base, "--tls-ca/--tls-cert/--tls-key"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(t.Context(), append([]string{"serve"}, tc.args...), &out, &errb)
			require.Equal(t, 2, code, errb.String())
			require.Contains(t, errb.String(), tc.want)
		})
	}
}

func TestServeEnv(t *testing.T) {
	t.Setenv("KVSIDECAR_ENGINE_ID", "from-env")
	t.Setenv("KVSIDECAR_TP_SIZE", "2")
	var errb bytes.Buffer
	code := run(t.Context(), []string{"serve", "--tp-size", "1", "--tp-rank", "3"}, &bytes.Buffer{}, &errb)
	require.Equal(t, 2, code)
	require.Contains(t, errb.String(), "--tp-rank: 3: must be in [0, --tp-size=1)", "the command line wins over the environment")

	t.Setenv("KVSIDECAR_ALLOW_PEERS", "10.0.0.0/33")
	errb.Reset()
	code = run(t.Context(), []string{"serve", "--tp-size", "1", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"}, &bytes.Buffer{}, &errb)
	require.Equal(t, 2, code)
	require.Contains(t, errb.String(), `--allow-peers: entry "10.0.0.0/33"`, "--allow-peers is settable per environment like every flag")

	t.Setenv("KVSIDECAR_TP_SIZE", "many")
	errb.Reset()
	code = run(t.Context(), []string{"serve"}, &bytes.Buffer{}, &errb)
	require.Equal(t, 2, code)
	require.Contains(t, errb.String(), `KVSIDECAR_TP_SIZE="many" (for --tp-size)`)
}
