package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/demo"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo", "Run a prefill and a decode instance on the host backend and replay a real trace through them.", stderr)
	model := fs.String("model", demo.DefaultModel, "model geometry: "+strings.Join(vmm.ModelNames(), ", "))
	prefillTP := fs.Int("prefill-tp", demo.DefaultPrefillTP, "TP size of the prefill instance")
	decodeTP := fs.Int("decode-tp", demo.DefaultDecodeTP, "TP size of the decode instance")
	requests := fs.Int("requests", demo.DefaultRequests, "replay the first N requests of the trace")
	speedup := fs.Float64("speedup", demo.DefaultSpeedup, "divide the trace's arrival times by this factor")
	tracePath := fs.String("trace", "", "Mooncake JSONL trace file (default: the Mooncake conversation trace embedded in the binary)")
	backend := fs.String("backend", "host", "page backend: host (memfd) or cuda (one GPU, device 0)")
	concurrency := fs.Int("concurrency", demo.DefaultConcurrency, "requests in flight at most")
	cacheEntries := fs.Int("cache-entries", demo.DefaultCacheEntries, "decode prefix cache size in 512-token hash blocks (negative: off)")
	hsMode := fs.String("handshake-mode", "piggyback", "decode handshake mode: piggyback or legacy")
	asJSON := fs.Bool("json", false, "print the summary as one JSON object on the last line of stdout (the table goes to stderr)")
	verbose := fs.Bool("v", false, "log the ranks' warnings to stderr")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	mode, err := handshake.ParseMode(*hsMode)
	if err != nil {
		return usageErrorf("--handshake-mode: %v", err)
	}
	cfg := &demo.Config{Model: *model, PrefillTP: *prefillTP, DecodeTP: *decodeTP, Requests: *requests,
		Speedup: *speedup, TracePath: *tracePath, Concurrency: *concurrency, CacheEntries: *cacheEntries,
		HandshakeMode: mode}
	switch *backend {
	case "host":
	case "cuda":
		cfg.Backend = func(string, int) (vmm.Backend, error) { return cuda.New(&cuda.Config{Device: 0}) }
	default:
		return usageErrorf("--backend %q: want host or cuda", *backend)
	}
	if *verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	// The ranks' sockets are plain UDP here, but quic-go warns on small
	// kernel buffers; the demo is loopback-only.
	os.Setenv("QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING", "true")
	cfg.Progress = newProgress(stderr).report
	fmt.Fprintf(stderr, "kvsidecar demo: %s, prefill TP %d -> decode TP %d, %d requests of %s, speed-up %gx\n",
		*model, *prefillTP, *decodeTP, *requests, *tracePath, *speedup)
	s, err := demo.Run(ctx, cfg)
	if err != nil && !errors.Is(err, demo.ErrVerification) {
		return err
	}
	table := stdout
	if *asJSON {
		table = stderr
	}
	printDemoSummary(table, &s)
	if *asJSON {
		b, jerr := json.Marshal(&s)
		if jerr != nil {
			return jerr
		}
		fmt.Fprintf(stdout, "%s\n", b)
	}
	return err
}

// progress draws a bar on a terminal and plain lines elsewhere.
type progress struct {
	w    io.Writer
	tty  bool
	last int // plain mode: last percentage printed
}

func newProgress(w io.Writer) *progress {
	p := &progress{w: w, last: -1}
	if f, ok := w.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			p.tty = true
		}
	}
	return p
}

func (p *progress) report(pr demo.Progress) {
	pct := 100 * pr.Done / max(pr.Total, 1)
	gib := float64(pr.BytesMoved) / (1 << 30)
	if p.tty {
		const width = 30
		n := width * pr.Done / max(pr.Total, 1)
		fmt.Fprintf(p.w, "\r[%s%s] %d/%d requests  %.2f GiB  %.1fs  failed %d",
			strings.Repeat("#", n), strings.Repeat(".", width-n), pr.Done, pr.Total, gib, pr.Elapsed.Seconds(), pr.Failed)
		if pr.Done == pr.Total {
			fmt.Fprintln(p.w)
		}
		return
	}
	// At most one line per 10 %.
	if pct/10 == p.last/10 && pr.Done != pr.Total {
		return
	}
	p.last = pct
	fmt.Fprintf(p.w, "progress: %d/%d requests, %.2f GiB moved, %.1fs, %d failed\n",
		pr.Done, pr.Total, gib, pr.Elapsed.Seconds(), pr.Failed)
}

func printDemoSummary(w io.Writer, s *demo.Summary) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	gib := func(b uint64) string { return fmt.Sprintf("%.3f GiB (%d bytes)", float64(b)/(1<<30), b) }
	pages := func(n int) string {
		return fmt.Sprintf("%d (%.1f MiB)", n, float64(uint64(n)*s.PageSize)/(1<<20))
	}
	rows := [][2]string{
		{"model", fmt.Sprintf("%s, prefill TP %d -> decode TP %d", s.Model, s.PrefillTP, s.DecodeTP)},
		{"requests", fmt.Sprint(s.Requests)},
		{"prompt tokens", fmt.Sprint(s.PromptTokens)},
		{"prefix tokens reused", fmt.Sprintf("%d (%d full hits)", s.PrefixTokensReused, s.FullHits)},
		{"bytes moved", gib(s.BytesMoved)},
		{"bytes verified", gib(s.BytesVerified)},
		{"mismatches", fmt.Sprint(s.Mismatches)},
		{"failed requests", fmt.Sprint(s.FailedRequests)},
		{"transfer latency p50 / p99", fmt.Sprintf("%.1f ms / %.1f ms", s.P50Ms, s.P99Ms)},
		{"throughput", fmt.Sprintf("%.3f GB/s over %.2fs", s.ThroughputGBps, s.WallSeconds)},
		{"handshakes", fmt.Sprintf("%d exchanges over %d QUIC connections = %d RTTs", s.Handshakes, s.Dials, s.HandshakeRTTs)},
		{"peak pages mapped, prefill", pages(s.PeakPagesPrefill)},
		{"peak pages mapped, decode", pages(s.PeakPagesDecode)},
		{"pages still mapped after", fmt.Sprint(s.PagesMappedAfter)},
	}
	if s.FirstError != "" {
		rows = append(rows, [2]string{"first error", s.FirstError})
	}
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\n", r[0], r[1])
	}
	_ = tw.Flush()
	if s.OK() {
		fmt.Fprintln(w, "OK: every byte verified")
	} else {
		fmt.Fprintln(w, "FAILED")
	}
}
