package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/demo"
	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace/mooncake"
)

// tinyTrace: two requests of one and two hash blocks.
const tinyTrace = `{"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": [1]}
{"timestamp": 1, "input_length": 700, "output_length": 1, "hash_ids": [1, 2]}
`

func writeFile(t testing.TB, name, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, []byte(text), 0o600))
	return p
}

// TestDemoBenchFlagErrors: every out-of-range value is a usage error (exit
// 2, like an unknown flag) naming the flag, the value and the range, never
// a library field, and nothing runs.
func TestDemoBenchFlagErrors(t *testing.T) {
	short := writeFile(t, "short.jsonl", tinyTrace)
	empty := writeFile(t, "empty.jsonl", "\n")
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"unknown flag", []string{"demo", "--nope"}, "flag provided but not defined: -nope"},
		{"bad int", []string{"demo", "--requests", "x"}, `invalid value "x" for flag -requests`},
		{"requests zero", []string{"demo", "--requests", "0"}, "--requests 0: want 1..12031 (the requests in " + mooncake.ConversationName + ")"},
		{"requests beyond", []string{"demo", "--trace", short, "--requests", "3"}, "--requests 3: want 1..2 (the requests in " + short + ")"},
		{"empty trace", []string{"demo", "--trace", empty}, "--trace " + empty + ": the trace has no requests"},
		{"missing trace", []string{"demo", "--trace", "/nonexistent/t.jsonl"}, "--trace /nonexistent/t.jsonl: open /nonexistent/t.jsonl: no such file or directory"},
		{"prefill tp zero", []string{"demo", "--prefill-tp", "0"}, "--prefill-tp 0: want 1..1024"},
		{"decode tp vs heads", []string{"demo", "--decode-tp", "3"}, "--decode-tp 3: model llama-3.2-1b: tp_size=3 and num_kv_heads=8: one must divide the other"},
		{"tp sizes", []string{"demo", "--model", "qwen3-8b", "--prefill-tp", "2", "--decode-tp", "8", "--prefill-tp", "4", "--decode-tp", "1"}, ""},
		{"speedup zero", []string{"demo", "--speedup", "0"}, "--speedup 0: want a factor > 0"},
		{"speedup nan", []string{"demo", "--speedup", "NaN"}, "--speedup NaN: want a factor > 0"},
		{"concurrency zero", []string{"demo", "--concurrency", "0"}, "--concurrency 0: want 1..1024"},
		{"cache negative", []string{"demo", "--cache-entries", "-1"}, "--cache-entries -1: want 0..65536"},
		{"model", []string{"demo", "--model", "gpt-9"}, `--model "gpt-9": unknown; want one of deepseek-v2-lite,`},
		{"handshake mode", []string{"demo", "--handshake-mode", "fast"}, `--handshake-mode "fast": want piggyback or legacy`},
		{"hs rtt zero", []string{"bench", "handshake", "--rtt", "0"}, "--rtt 0s: want 1ms..2s"},
		{"hs rtt above the dial timeout", []string{"bench", "handshake", "--rtt", "6s"}, "--rtt 6s: want 1ms..2s"},
		{"hs trials zero", []string{"bench", "handshake", "--trials", "0"}, "--trials 0: want 1..1000"},
		{"hs decode tp zero", []string{"bench", "handshake", "--decode-tp", "0"}, "--decode-tp 0: want 1..1024"},
		{"hs tp sizes", []string{"bench", "handshake", "--prefill-tp", "2", "--decode-tp", "1", "--model", "qwen3-8b", "--decode-tp", "3"}, "--decode-tp 3: model qwen3-8b"},
		{"hs model", []string{"bench", "handshake", "--model", "nope"}, `--model "nope": unknown`},
		{"xfer rounds zero", []string{"bench", "transfer", "--bulk-rounds", "0"}, "--bulk-rounds 0: want 1..1000"},
		{"xfer rtt", []string{"bench", "transfer", "--rtt", "3s"}, "--rtt 3s: want 1ms..2s"},
		{"xfer latency samples zero", []string{"bench", "transfer", "--latency-samples", "0"}, "--latency-samples 0: want 1..1000000"},
		{"xfer cell time zero", []string{"bench", "transfer", "--cell-time", "0s"}, "--cell-time 0s: want > 0s and <= 1h0m0s"},
		{"xfer every block too big", []string{"bench", "transfer", "--max-bytes", "1K"}, "--block-sizes 4K,64K,1M,16M,64M: every size exceeds --max-bytes 1K; want at least one <= 1K"},
		{"xfer max bytes", []string{"bench", "transfer", "--max-bytes", "2G"}, `--max-bytes "2G": want one size, 1..1G`},
		{"xfer batch", []string{"bench", "transfer", "--batch-sizes", "1,65537"}, "--batch-sizes 65537: want 1..65536 descriptors per transfer"},
		{"xfer block zero", []string{"bench", "transfer", "--block-sizes", "4K,0"}, `--block-sizes "4K,0": "0" is not a positive size`},
		{"xfer block overflow", []string{"bench", "transfer", "--block-sizes", "99999999999999G"}, `"99999999999999" overflows`},
		{"xfer lanes zero", []string{"bench", "transfer", "--lanes", "1,0"}, `--lanes "1,0": "0": want a lane count 1..16`},
		{"xfer lanes above", []string{"bench", "transfer", "--lanes", "17"}, `--lanes "17": "17": want a lane count 1..16`},
		{"xfer lanes twice", []string{"bench", "transfer", "--lanes", "2,4,2"}, `--lanes "2,4,2": 2 appears twice`},
		{"xfer backend", []string{"bench", "transfer", "--backend", "tpu"}, `--backend "tpu": want host or cuda`},
		{"xfer cuda library on host", []string{"bench", "transfer", "--cuda-library", "/x/libcuda.so.1"}, `--cuda-library "/x/libcuda.so.1": only the cuda backend loads a driver`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.want == "" {
				// qwen3-8b has 8 KV heads: prefill 4 -> decode 1 is valid,
				// so this case checks the last flag wins, then fails on
				// --concurrency instead of running.
				tc.args = append(tc.args, "--concurrency", "0")
				tc.want = "--concurrency 0"
			}
			var out, errb bytes.Buffer
			code := run(context.Background(), tc.args, &out, &errb)
			msg := errb.String()
			require.Equal(t, 2, code, msg)
			require.Contains(t, msg, tc.want)
			for _, bad := range []string{"Config.", ": demo:", "invalid config", ": :", "kvsidecar demo: llama"} {
				require.NotContains(t, msg, bad)
			}
			require.Empty(t, out.String(), "nothing ran")
		})
	}
}

func TestDemoTinyTrace(t *testing.T) {
	path := writeFile(t, "tiny.jsonl", tinyTrace)
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"demo", "--model", "qwen2.5-0.5b", "--prefill-tp", "1", "--decode-tp", "2",
		"--trace", path, "--speedup", "inf", "--cache-entries", "0", "--json"}, &out, &errb)
	require.Equal(t, 0, code, errb.String())
	// The default of 8 requests is more than the trace holds: all of it,
	// said so.
	require.Contains(t, errb.String(), path+" has 2 requests, fewer than the default 8: replaying all of them")
	require.Contains(t, errb.String(), "the first 2 of 2 requests of "+path+", all at once, 2 in flight")
	require.Contains(t, errb.String(), "transfer throughput")
	require.Contains(t, errb.String(), "wall throughput")
	require.Contains(t, errb.String(), "(p99 is the max of 2 samples)")
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	var s struct {
		Trace            string  `json:"trace"`
		Requests         int     `json:"requests"`
		PrefixReused     int64   `json:"prefix_tokens_reused"`
		ThroughputGBPerS float64 `json:"throughput_gb_per_s"`
		WallGBPerS       float64 `json:"wall_gb_per_s"`
		TransferSeconds  float64 `json:"transfer_seconds"`
		WallSeconds      float64 `json:"wall_seconds"`
	}
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &s))
	require.NotContains(t, out.String(), "gbps", "throughput names carry their unit: gb_per_s")
	require.Equal(t, path, s.Trace)
	require.Equal(t, 2, s.Requests)
	require.Zero(t, s.PrefixReused, "--cache-entries 0 turns the cache off")
	require.Positive(t, s.WallGBPerS)
	require.GreaterOrEqual(t, s.ThroughputGBPerS, s.WallGBPerS)
	require.LessOrEqual(t, s.TransferSeconds, s.WallSeconds)
}

func TestBenchTransferSkipsWithNote(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"bench", "transfer", "--block-sizes", "4K,2M", "--batch-sizes", "1,4",
		"--max-bytes", "1M", "--cell-time", "1ms", "--bulk-rounds", "1", "--latency-samples", "20"}, &out, &errb)
	require.Equal(t, 0, code, errb.String())
	table := out.String()
	require.Contains(t, table, "note: skipped block 2M × batch 1 = 2M, over --max-bytes 1M")
	require.Contains(t, table, "note: skipped block 2M × batch 4 = 8M, over --max-bytes 1M")
	require.Contains(t, table, "p99 is their maximum")
	require.Contains(t, table, "bulk, 1M in 4K descriptors")
	require.Contains(t, table, "warm small reads, loopback, 20 samples each")
	require.Contains(t, table, "same-host and QUIC READs of 1M in 1M descriptors between two pools (host backend, memfd pages), loopback, best of 1:")
	require.Contains(t, table, "memcpy, one thread")
	require.Contains(t, table, "mmap (MAP_POPULATE) + munmap of the READ's 1M of source pages")
	require.Regexp(t, `(?m)^\s+K\s+memcpy GB/s\s+/memcpy\s+same-host GB/s\s+GB/CPU-s\s+crc share\s+QUIC GB/s\s+/raw quic-go\s+/TLS-TCP\s+GB/CPU-s\s+crc share\s+same-host/QUIC$`, table)
	require.Regexp(t, `(?m)^\s+1\s+[0-9.]+\s+[0-9.]+\s+`, table, "the one-lane row")
	require.Regexp(t, `(?m)^\s+4\s+[0-9.]+\s+[0-9.]+\s+`, table, "the four-lane row")
	require.Contains(t, table, "1 lane: same-host READ ")
}

// TestBenchTransferCUDANoDriver: --backend cuda without a driver that
// loads fails with exit 1 and says so, naming the library, before it
// prints a row.
func TestBenchTransferCUDANoDriver(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"bench", "transfer", "--backend", "cuda", "--cuda-library", "/nonexistent/libcuda.so.1",
		"--block-sizes", "1M", "--max-bytes", "1M"}, &out, &errb)
	require.Equal(t, 1, code, errb.String())
	require.Contains(t, errb.String(), "--backend cuda: no GPU this process can use (/nonexistent/libcuda.so.1)")
	require.Empty(t, out.String(), "no row was measured")
}

// TestDemoProgressLines: the demo's progress moves while a request is in
// flight: every tick prints a line with the bytes moved so far (a line per
// 10 s in a log, the bar redrawn every 2 s on a terminal), besides the line
// per 10 % of requests finished.
func TestDemoProgressLines(t *testing.T) {
	var b bytes.Buffer
	p := newProgress(&b)
	require.False(t, p.tty, "a buffer is not a terminal")
	require.Equal(t, 10*time.Second, p.interval())
	require.Equal(t, 2*time.Second, (&progress{tty: true}).interval())

	p.report(demo.Progress{Done: 1, Total: 100, InFlight: 1, BytesMoved: 1 << 30, Elapsed: time.Second})
	p.report(demo.Progress{Done: 1, Total: 100, InFlight: 1, BytesMoved: 3 << 29, Elapsed: 11 * time.Second, Tick: true})
	p.report(demo.Progress{Done: 1, Total: 100, InFlight: 1, BytesMoved: 2 << 30, Elapsed: 21 * time.Second, Tick: true})
	p.report(demo.Progress{Done: 2, Total: 100, InFlight: 0, BytesMoved: 2 << 30, Elapsed: 22 * time.Second})
	require.Equal(t, "progress: 1/100 requests, 1 in flight, 1.00 GiB moved so far, 1.0s, 0 failed\n"+
		"progress: 1/100 requests, 1 in flight, 1.50 GiB moved so far, 11.0s, 0 failed\n"+
		"progress: 1/100 requests, 1 in flight, 2.00 GiB moved so far, 21.0s, 0 failed\n", b.String(),
		"a line per tick while the request is in flight; none for the second finish (same 10 %)")

	var tty bytes.Buffer
	p = &progress{w: &tty, tty: true, last: -10}
	p.report(demo.Progress{Done: 0, Total: 4, InFlight: 2, BytesMoved: 1 << 29, Elapsed: 2 * time.Second, Tick: true})
	require.Equal(t, "\r[..............................] 0/4 requests  2 in flight  0.50 GiB  2.0s  failed 0", tty.String())
}

// TestMakeDemoSaysBuildingFirst: `make demo` says that it is building
// before the build, which on a cold cache prints nothing for minutes.
func TestMakeDemoSaysBuildingFirst(t *testing.T) {
	out, err := exec.Command("make", "-n", "-C", "../..", "demo").CombinedOutput()
	require.NoError(t, err, "%s", out)
	var lines []string
	for _, l := range strings.Split(string(out), "\n") {
		if l != "" && !strings.HasPrefix(l, "make") {
			lines = append(lines, l)
		}
	}
	require.GreaterOrEqual(t, len(lines), 3, "%s", out)
	require.Contains(t, lines[0], "echo")
	require.Contains(t, lines[0], "building bin/kvsidecar first")
	require.Regexp(t, `build -buildvcs=(auto|false) -o bin/kvsidecar ./cmd/kvsidecar$`, lines[1])
	require.Equal(t, "./bin/kvsidecar demo", lines[2])
}
