package main

import (
	"bytes"
	"context"
	"io"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDemoMemoryBudget: a run whose estimated peak exceeds --memory-budget
// is a usage error naming the request's line, its tokens, the bytes and
// the budget, and nothing runs.
func TestDemoMemoryBudget(t *testing.T) {
	// Line 2 is blank: the 700-token request is on line 3.
	path := writeFile(t, "t.jsonl", strings.Replace(tinyTrace, "\n", "\n\n", 1))
	tests := []struct {
		name   string
		budget string
		want   []string
	}{
		// qwen2.5-0.5b at TP 1 -> 2: 48 regions (24 layers, K and V) of
		// 2 MiB pages on each of three ranks; a request of up to 700 tokens
		// takes one page a region per rank (288 MiB), the null blocks as
		// much, and the second request's whole hash block one decode page a
		// region in the cache (192 MiB).
		{"first request", "100MiB", []string{"--memory-budget 100.0 MiB (given)", "line 1 of " + path + " (300 tokens) maps 288.0 MiB",
			"the peak is 576.0 MiB", "--requests", "--concurrency", "--model"}},
		{"second request", "1GB", []string{"--memory-budget 953.7 MiB (given)", "line 3 of " + path + " (700 tokens) maps 288.0 MiB",
			"with up to 2 in flight and the prefix cache the peak is 1.0 GiB"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(t.Context(), []string{"demo", "--model", "qwen2.5-0.5b", "--prefill-tp", "1", "--decode-tp", "2",
				"--trace", path, "--memory-budget", tc.budget}, &out, &errb)
			require.Equal(t, 2, code, errb.String())
			for _, w := range tc.want {
				require.Contains(t, errb.String(), w)
			}
			require.NotContains(t, errb.String(), "prefill TP 1 -> decode TP 2", "refused before the run starts")
			require.Empty(t, out.String())
		})
	}
}

func TestByteSizeFlag(t *testing.T) {
	tests := []struct {
		in   string
		want uint64
		err  string
	}{
		{in: "1024", want: 1024},
		{in: "8GiB", want: 8 << 30},
		{in: "8G", want: 8 << 30},
		{in: "8GB", want: 8e9},
		{in: "512 MiB", want: 512 << 20},
		{in: "3K", want: 3 << 10},
		{in: "2TiB", want: 2 << 40},
		{in: "7B", want: 7},
		{in: "0", err: `"0": want a positive size`},
		{in: "-1G", err: `"-1G": want a positive size`},
		{in: "lots", err: `"lots": want a positive size`},
		{in: "99999999999TiB", err: `"99999999999TiB" overflows`},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			var b byteSize
			err := b.Set(tc.in)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, uint64(b))
		})
	}
}

func TestDefaultMemoryBudget(t *testing.T) {
	tests := []struct {
		name, meminfo string
		want          uint64
		from          string
	}{
		{"half of available", "MemTotal:       24684084 kB\nMemFree:  100 kB\nMemAvailable:   2000000 kB\n", 1000000 * 1024, "half of MemAvailable"},
		{"no MemAvailable", "MemTotal:       24684084 kB\n", 8 << 30, "unreadable"},
		{"garbage", "MemAvailable: lots kB\n", 8 << 30, "unreadable"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, from := defaultMemoryBudget(writeFile(t, "meminfo", tc.meminfo))
			require.Equal(t, tc.want, got)
			require.Contains(t, from, tc.from)
		})
	}
	got, from := defaultMemoryBudget(filepath.Join(t.TempDir(), "missing"))
	require.Equal(t, uint64(8<<30), got)
	require.Contains(t, from, "unreadable")
}

// TestDemoBackendErrorOnePrefix: a library error is printed with the
// command's prefix only, not "kvsidecar demo: demo: ...".
func TestDemoBackendErrorOnePrefix(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(t.Context(), []string{"demo", "--model", "qwen2.5-0.5b", "--prefill-tp", "1", "--decode-tp", "1",
		"--trace", writeFile(t, "t.jsonl", tinyTrace), "--backend", "cuda"}, &out, &errb)
	if code == 0 {
		t.Skip("a GPU is present: the cuda backend started")
	}
	require.Equal(t, 1, code, errb.String())
	require.Contains(t, errb.String(), "kvsidecar demo: prefill rank 0: backend: ")
	require.NotContains(t, errb.String(), "demo: demo:")
}

// syncWriter passes writes to w and closes seen once want was written.
type syncWriter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	want string
	seen chan struct{}
}

func (w *syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n, _ := w.buf.Write(p)
	if w.seen != nil && strings.Contains(w.buf.String(), w.want) {
		close(w.seen)
		w.seen = nil
	}
	return n, nil
}

var _ io.Writer = (*syncWriter)(nil)

// TestDemoSignalExitStatus: SIGINT and SIGTERM stop the demo after a clean
// shutdown with 128 + the signal, as a shell expects.
func TestDemoSignalExitStatus(t *testing.T) {
	// The second request arrives 1000 s after the first: the demo waits.
	path := writeFile(t, "gap.jsonl", `{"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": [1]}
{"timestamp": 1000000, "input_length": 300, "output_length": 1, "hash_ids": [1]}
`)
	for _, tc := range []struct {
		sig  syscall.Signal
		want int
	}{{syscall.SIGINT, 130}, {syscall.SIGTERM, 143}} {
		t.Run(tc.sig.String(), func(t *testing.T) {
			// As main does: the signal ends the command's context.
			ctx, stop := signal.NotifyContext(context.Background(), shutdownSignals...)
			defer stop()
			errb := &syncWriter{want: "progress: 1/2", seen: make(chan struct{})}
			seen := errb.seen
			codes := make(chan int, 1)
			go func() {
				codes <- run(ctx, []string{"demo", "--model", "qwen2.5-0.5b", "--prefill-tp", "1", "--decode-tp", "1",
					"--trace", path, "--speedup", "1", "--cache-entries", "0"}, io.Discard, errb)
			}()
			<-seen // the first request finished; the demo waits for the second
			require.NoError(t, syscall.Kill(syscall.Getpid(), tc.sig))
			code := <-codes
			errb.mu.Lock()
			defer errb.mu.Unlock()
			require.Equal(t, tc.want, code, errb.buf.String())
			require.Contains(t, errb.buf.String(), "after a clean shutdown")
		})
	}
}
