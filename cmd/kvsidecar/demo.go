package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/demo"
	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace"
	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	// main's context ends on these signals; this channel tells which one,
	// so the exit status can say it (130 for SIGINT, 143 for SIGTERM).
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, shutdownSignals...)
	defer signal.Stop(sigs)
	fs := newFlagSet("demo", "Run a prefill and a decode instance on the host backend and replay a real trace through them.", stdout)
	model := fs.String("model", demo.DefaultModel, "model geometry: "+strings.Join(kvgeom.ModelNames(), ", "))
	prefillTP := fs.Int("prefill-tp", demo.DefaultPrefillTP, fmt.Sprintf("TP size of the prefill instance, 1..%d, dividing or divided by the model's KV heads", connector.MaxTPSize))
	decodeTP := fs.Int("decode-tp", demo.DefaultDecodeTP, fmt.Sprintf("TP size of the decode instance, 1..%d; one of the TP sizes must divide the other", connector.MaxTPSize))
	requests := fs.Int("requests", demo.DefaultRequests, "replay the first N requests of the trace, 1..its length (not given: all of a shorter trace)")
	speedup := fs.Float64("speedup", demo.DefaultSpeedup, "divide the trace's arrival times by this factor, > 0 (inf: every request at once)")
	tracePath := fs.String("trace", "", "Mooncake JSONL trace file (default: the Mooncake conversation trace embedded in the binary)")
	backend := fs.String("backend", "host", "page backend: host (memfd) or cuda (one GPU, device 0)")
	cudaLibrary := fs.String("cuda-library", cuda.DefaultLibrary, "CUDA driver library to dlopen, a name the dynamic loader finds or a path (cuda backend only)")
	concurrency := fs.Int("concurrency", demo.DefaultConcurrency, fmt.Sprintf("requests in flight at most, 1..%d", maxConcurrency))
	cacheEntries := fs.Int("cache-entries", demo.DefaultCacheEntries, fmt.Sprintf("decode prefix cache size in 512-token hash blocks, 0..%d (0: no cache)", maxCacheEntries))
	hsMode := fs.String("handshake-mode", "piggyback", "decode handshake mode: piggyback or legacy")
	checksums := fs.Bool("checksums", true, "record and verify end-to-end CRC-32C checksums of the KV (serve --checksums)")
	readLanes := fs.Int("read-lanes", transfer.DefaultReadLanes(runtime.NumCPU()), fmt.Sprintf("QUIC connections, or same-host copiers, one READ runs on, in [1, %d] (serve --read-lanes; default: one per CPU, at most 4)", transfer.MaxReadLanes))
	sameHost := onOff(true)
	fs.Var(&sameHost, "same-host", "on or off: decode ranks read from the prefill ranks' mapped pages (serve --same-host); off: over QUIC")
	asJSON := fs.Bool("json", false, "print the summary as one JSON object on the last line of stdout (the table goes to stderr)")
	verbose := fs.Bool("v", false, "log the ranks' warnings to stderr")
	var budget byteSize
	fs.Var(&budget, "memory-budget", "refuse to start when the KV pages the run maps at its peak would exceed this `size`, like 8GiB or 512MiB (default: half of MemAvailable in /proc/meminfo, 8GiB if unreadable)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	mode, err := handshake.ParseMode(*hsMode)
	if err != nil {
		return usageErrorf("--handshake-mode %q: want piggyback or legacy", *hsMode)
	}
	if _, err := checkModelTP(*model, *prefillTP, *decodeTP); err != nil {
		return err
	}
	if err := errors.Join(checkSpeedup(*speedup), checkInt("concurrency", *concurrency, 1, maxConcurrency), checkInt("read-lanes", *readLanes, 1, transfer.MaxReadLanes),
		checkInt("cache-entries", *cacheEntries, 0, maxCacheEntries)); err != nil {
		return firstUsage(err)
	}
	tr, err := demo.LoadTrace(*tracePath)
	var le *trace.LineError
	switch {
	case errors.As(err, &le):
		return err // a malformed line: "trace: file:line: ..."
	case err != nil:
		return usageErrorf("--trace %s: %v", *tracePath, strings.TrimPrefix(err.Error(), "trace: "))
	case len(tr.Requests) == 0:
		return usageErrorf("--trace %s: the trace has no requests", tr.Name)
	}
	n := *requests
	if flagSet(fs.FlagSet, "requests") {
		if n < 1 || n > len(tr.Requests) {
			return usageErrorf("--requests %d: want 1..%d (the requests in %s)", n, len(tr.Requests), tr.Name)
		}
	} else if n > len(tr.Requests) {
		fmt.Fprintf(stderr, "kvsidecar demo: %s has %d requests, fewer than the default %d: replaying all of them\n",
			tr.Name, len(tr.Requests), n)
		n = len(tr.Requests)
	}
	cache := *cacheEntries
	if cache == 0 {
		cache = -1 // the library's "off"
	}
	cfg := &demo.Config{Model: *model, PrefillTP: *prefillTP, DecodeTP: *decodeTP, Requests: n,
		Speedup: *speedup, Trace: tr, Concurrency: *concurrency, CacheEntries: cache, HandshakeMode: mode,
		NoChecksums: !*checksums, NoSameHost: !bool(sameHost), ReadLanes: *readLanes}
	switch *backend {
	case "host":
		if flagSet(fs.FlagSet, "cuda-library") {
			return usageErrorf("--cuda-library %q: only the cuda backend loads a driver", *cudaLibrary)
		}
	case "cuda":
		cfg.Backend = func(string, int) (vmm.Backend, error) {
			return cuda.New(&cuda.Config{Device: 0, Library: *cudaLibrary})
		}
	default:
		return usageErrorf("--backend %q: want host or cuda", *backend)
	}
	budgetFrom := "given"
	if budget == 0 {
		b, from := defaultMemoryBudget("/proc/meminfo")
		budget, budgetFrom = byteSize(b), "default: "+from
	}
	cfg.MemoryBudget = uint64(budget)
	if _, err := demo.CheckMemory(cfg); err != nil {
		var me *demo.MemoryError
		if errors.As(err, &me) {
			return usageErrorf("--memory-budget %s (%s): the request on line %d of %s (%d tokens) maps %s of KV pages on the prefill and decode ranks; with up to %d in flight and the prefix cache the peak is %s, over the budget; replay fewer requests (--requests), fewer at once (--concurrency) or a smaller --model, or raise --memory-budget",
				demo.FormatBytes(me.Budget), budgetFrom, me.Line, me.Trace, me.Tokens, demo.FormatBytes(me.RequestBytes),
				me.Concurrency, demo.FormatBytes(me.PeakBytes))
		}
		return libError{err}
	}
	if *verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	// The ranks' sockets are plain UDP here, but quic-go warns on small
	// kernel buffers; the demo is loopback-only.
	os.Setenv("QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING", "true")
	prog := newProgress(stderr)
	cfg.Progress, cfg.ProgressInterval = prog.report, prog.interval()
	pace := fmt.Sprintf("speed-up %gx", *speedup)
	if math.IsInf(*speedup, 1) {
		pace = "all at once"
	}
	fmt.Fprintf(stderr, "kvsidecar demo: %s, prefill TP %d -> decode TP %d, the first %d of %d requests of %s, %s, %d in flight\n",
		*model, *prefillTP, *decodeTP, n, len(tr.Requests), tr.Name, pace, *concurrency)
	s, err := demo.Run(ctx, cfg)
	if err != nil && ctx.Err() != nil {
		select {
		case sig := <-sigs:
			if n, ok := sig.(syscall.Signal); ok {
				return &signalExit{sig: n, err: libError{err}}
			}
		default:
		}
	}
	if err != nil && !errors.Is(err, demo.ErrVerification) {
		return libError{err}
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
	if err != nil {
		return libError{err}
	}
	return nil
}

// libError prints an error of package demo without its "demo: " prefix,
// which the command's own "kvsidecar demo: " already says; errors.Is and
// errors.As see the original.
type libError struct{ err error }

func (e libError) Error() string { return strings.TrimPrefix(e.err.Error(), "demo: ") }
func (e libError) Unwrap() error { return e.err }

// signalExit: the command stopped on a signal and shut down cleanly; the
// process exits 128 + the signal number, as shells expect of a command a
// signal ended (130 for SIGINT, 143 for SIGTERM).
type signalExit struct {
	sig syscall.Signal
	err error // what the interrupted run returned
}

func (e *signalExit) Error() string {
	return fmt.Sprintf("stopped by %v (signal %d) after a clean shutdown", e.sig, int(e.sig))
}

func (e *signalExit) Unwrap() error { return e.err }

// ExitCode is 128 + the signal number.
func (e *signalExit) ExitCode() int { return 128 + int(e.sig) }

// progress draws a bar on a terminal and plain lines elsewhere; both move
// while a request is in flight (the ticks of interval), not only when one
// finishes.
type progress struct {
	w    io.Writer
	tty  bool
	last int // plain mode: last percentage printed
}

// Tick periods of the demo's progress: a bar on a terminal is redrawn every
// ttyTick; a log (a file, a pipe, CI) gets a line every plainTick, so a
// long request still shows the bytes moving without flooding it.
const (
	ttyTick   = 2 * time.Second
	plainTick = 10 * time.Second
)

// interval is the tick period for p's writer.
func (p *progress) interval() time.Duration {
	if p.tty {
		return ttyTick
	}
	return plainTick
}

func newProgress(w io.Writer) *progress {
	p := &progress{w: w, last: -10} // the first finish prints (-1/10 would be 0)
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
		fmt.Fprintf(p.w, "\r[%s%s] %d/%d requests  %d in flight  %.2f GiB  %.1fs  failed %d",
			strings.Repeat("#", n), strings.Repeat(".", width-n), pr.Done, pr.Total, pr.InFlight, gib, pr.Elapsed.Seconds(), pr.Failed)
		if pr.Done == pr.Total {
			fmt.Fprintln(p.w)
		}
		return
	}
	// A line per tick, and at most one per 10 % of requests finished.
	if !pr.Tick && pct/10 == p.last/10 && pr.Done != pr.Total {
		return
	}
	if !pr.Tick {
		p.last = pct
	}
	fmt.Fprintf(p.w, "progress: %d/%d requests, %d in flight, %.2f GiB moved so far, %.1fs, %d failed\n",
		pr.Done, pr.Total, pr.InFlight, gib, pr.Elapsed.Seconds(), pr.Failed)
}

func printDemoSummary(w io.Writer, s *demo.Summary) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	gib := func(b uint64) string { return fmt.Sprintf("%.3f GiB (%d bytes)", float64(b)/(1<<30), b) }
	pages := func(n int) string {
		return fmt.Sprintf("%d (%.1f MiB)", n, float64(uint64(n)*s.PageSize)/(1<<20))
	}
	latency := fmt.Sprintf("%.1f ms / %.1f ms", s.P50Ms, s.P99Ms)
	if s.LatencySamples > 0 && s.LatencySamples <= demo.P99MaxSamples {
		latency += fmt.Sprintf(" (p99 is the max of %d samples)", s.LatencySamples)
	}
	path := "QUIC (--same-host=off)"
	if s.SameHost {
		path = fmt.Sprintf("same-host: %s of the bytes through mapped pages, the rest over QUIC", gib(s.SameHostBytes))
	}
	rows := [][2]string{
		{"model", fmt.Sprintf("%s, prefill TP %d -> decode TP %d", s.Model, s.PrefillTP, s.DecodeTP)},
		{"trace", s.Trace},
		{"requests", fmt.Sprint(s.Requests)},
		{"prompt tokens", fmt.Sprint(s.PromptTokens)},
		{"prefix tokens reused", fmt.Sprintf("%d (%d full hits)", s.PrefixTokensReused, s.FullHits)},
		{"bytes moved", gib(s.BytesMoved)},
		{"bytes verified", gib(s.BytesVerified)},
		{"mismatches", fmt.Sprint(s.Mismatches)},
		{"failed requests", fmt.Sprint(s.FailedRequests)},
		{"transfer latency p50 / p99", latency},
		{"transfer throughput", fmt.Sprintf("%.3f GB/s (bytes moved over %.2fs with a load in flight)", s.ThroughputGBPerS, s.TransferSeconds)},
		{"wall throughput", fmt.Sprintf("%.3f GB/s (bytes moved over the %.2fs replay, arrival gaps included)", s.WallGBPerS, s.WallSeconds)},
		{"checksums", fmt.Sprintf("CRC-32C, all ranks: %.3fs verifying (%.1f%% of the transfer time), %.3fs recording at RequestFinished (%.1f%% with it)",
			s.ChecksumVerifySeconds, 100*s.ChecksumVerifyShare, s.ChecksumRecordSeconds, 100*s.ChecksumShare)},
		{"path", path},
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

// firstUsage returns the first of the errors joined in err, so one bad
// flag is reported at a time, in flag order.
func firstUsage(err error) error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		if errs := j.Unwrap(); len(errs) > 0 {
			return errs[0]
		}
	}
	return err
}
