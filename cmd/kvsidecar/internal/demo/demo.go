package demo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace"
	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// Defaults of Config.
const (
	// DefaultModel is a real geometry small enough per token (32 KiB of KV
	// per token over all ranks) that the default run moves a few GiB in
	// seconds on a laptop.
	DefaultModel = "llama-3.2-1b"
	// DefaultPrefillTP and DefaultDecodeTP: decode rank d reads half of
	// prefill rank d/2's heads.
	DefaultPrefillTP = 2
	DefaultDecodeTP  = 4
	// DefaultRequests is the number of trace requests replayed: the first 8
	// of the conversation trace hold 85,229 prompt tokens, 2.6 GiB of
	// llama-3.2-1b KV (about 20 s on a busy 2-core machine). A shorter
	// trace is replayed whole.
	DefaultRequests = 8
	// DefaultSpeedup compresses the trace's arrival times ten-fold.
	DefaultSpeedup = 10
	// DefaultConcurrency bounds the requests in flight.
	DefaultConcurrency = 2
	// DefaultCacheEntries bounds the decode prefix cache: 64 hash blocks of
	// 512 tokens (1 GiB of llama-3.2-1b KV over the decode ranks).
	DefaultCacheEntries = 64
)

// Errors of Run.
var (
	// ErrInvalidConfig: a Config field breaks its rule; the message names it.
	ErrInvalidConfig = errors.New("demo: invalid config")
	// ErrVerification: some request failed or some byte arrived wrong; the
	// Summary says how many.
	ErrVerification = errors.New("demo: verification failed")
)

// TraceLengthError is returned by Run when the trace holds fewer requests
// than Config.Requests asks for, or none at all (Have 0, whatever Requests
// is). It wraps ErrInvalidConfig.
type TraceLengthError struct {
	// Trace names the trace: its path or mooncake.ConversationName.
	Trace string
	// Have is the number of requests in the trace; Want is Config.Requests
	// (0: the default, DefaultRequests or the whole trace).
	Have, Want int
}

func (e *TraceLengthError) Error() string {
	if e.Have == 0 {
		return fmt.Sprintf("demo: trace %s has no requests", e.Trace)
	}
	return fmt.Sprintf("demo: trace %s has %d requests, fewer than Config.Requests=%d", e.Trace, e.Have, e.Want)
}

// Unwrap returns ErrInvalidConfig.
func (e *TraceLengthError) Unwrap() error { return ErrInvalidConfig }

// Trace is a request trace held in memory.
type Trace struct {
	// Name names the trace in errors and in the Summary: the file's path,
	// or mooncake.ConversationName for the embedded trace.
	Name string
	// Requests in arrival order.
	Requests []trace.Request
	// Lines holds the 1-based line of each request in the trace (blank
	// lines count), for messages. Nil (a Trace built by hand): request i is
	// on line i+1.
	Lines []int
}

// LoadTrace reads every request of the Mooncake JSONL trace at path; an
// empty path reads the embedded Mooncake conversation trace (12,031
// requests). Errors: the file cannot be opened ("trace: open ...",
// wrapping the *fs.PathError), or a malformed line (*trace.LineError). An
// empty trace is not an error here; Run refuses it.
func LoadTrace(path string) (*Trace, error) {
	return loadTrace(path, 0)
}

// loadTrace reads the first n requests (all when n <= 0) of the trace at
// path, or of the embedded one when path is "".
func loadTrace(path string, n int) (*Trace, error) {
	if path == "" {
		return readEmbedded(n)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	defer f.Close()
	return readTrace(f, path, n)
}

// Config configures Run. The zero value (and a nil *Config) runs the
// default demo: DefaultModel, prefill TP 2 → decode TP 4, the first
// DefaultRequests requests of the embedded Mooncake conversation trace.
type Config struct {
	// Model is a name of kvgeom.ModelNames(). Default DefaultModel. Ignored
	// when Geometry is set.
	Model string
	// Geometry overrides Model with an explicit geometry (tests use tiny
	// ones). Its block_size must divide 512. Default nil.
	Geometry *v1.ModelGeometry
	// PrefillTP and DecodeTP are the TP sizes of the two instances, in
	// [1, connector.MaxTPSize]. Defaults DefaultPrefillTP, DefaultDecodeTP.
	PrefillTP, DecodeTP int
	// Requests is how many requests of the trace are replayed, from the
	// first; more than the trace holds is a *TraceLengthError. Default:
	// DefaultRequests, or the whole trace when it is shorter.
	Requests int
	// Speedup divides the trace's arrival times. Default DefaultSpeedup;
	// math.Inf(1) sends every request at once.
	Speedup float64
	// TracePath is a Mooncake JSONL trace file. Default "": the Mooncake
	// conversation trace embedded in the binary (package mooncake).
	// Ignored when Trace is set.
	TracePath string
	// Trace, when set, is replayed instead of reading TracePath (the CLI
	// loads it first to check --requests against its length). Default nil.
	Trace *Trace
	// Concurrency bounds the requests in flight. Default DefaultConcurrency.
	Concurrency int
	// CacheEntries bounds the decode side's prefix cache in 512-token hash
	// blocks. Default DefaultCacheEntries; negative disables the cache.
	CacheEntries int
	// HandshakeMode of the decode ranks. Default handshake.ModePiggyback.
	HandshakeMode handshake.Mode
	// NoChecksums turns the end-to-end checksums of exports off
	// (connector.Config.DisableChecksums). Default false: on.
	NoChecksums bool
	// ReadLanes is every rank's transfer.Config.ReadLanes: the QUIC
	// connections, or the same-host copiers, one READ runs on. Default
	// transfer.DefaultReadLanes of this host's CPUs (serve's default).
	ReadLanes int
	// NoSameHost sends every READ over QUIC. Default false: the ranks,
	// all on this host, read from each other's mapped pages
	// (connector.Config.SameHostSocket).
	NoSameHost bool
	// Backend returns each rank's vmm backend. Default nil: the host
	// (memfd) backend.
	Backend BackendFunc
	// Progress, when set, is called after each request finishes and, when
	// ProgressInterval is positive, every ProgressInterval while the run
	// lasts (Progress.Tick), from one goroutine at a time.
	Progress func(Progress)
	// ProgressInterval is the period of Progress's ticks, which report the
	// bytes moved so far while requests are in flight. Default 0: no ticks.
	ProgressInterval time.Duration
	// Logger receives the ranks' logs. Default nil: discard.
	Logger *slog.Logger
	// Registerer receives the metrics of every rank. Default nil: none.
	Registerer prometheus.Registerer
	// MemoryBudget bounds, in bytes, the pages the run may map at its peak
	// over both instances, as CheckMemory estimates it; Run refuses a run
	// over it with a *MemoryError before starting anything. Default 0: no
	// bound (the CLI always sets one).
	MemoryBudget uint64
}

// Progress is reported after each request, and on every tick of
// Config.ProgressInterval (Tick true).
type Progress struct {
	// Done of Total requests finished, Failed of them failed; InFlight
	// were dispatched and are not finished.
	Done, Total, Failed, InFlight int
	// BytesMoved is the KV bytes the decode ranks read so far, the READs in
	// flight included (transfer.Agent.BytesMoved).
	BytesMoved uint64
	Elapsed    time.Duration
	// Tick: reported by the ticker, not by a request finishing.
	Tick bool
}

// Summary is the outcome of a run. JSON names are stable (the CLI's
// --json prints it).
type Summary struct {
	Model     string `json:"model"`
	PrefillTP int    `json:"prefill_tp"`
	DecodeTP  int    `json:"decode_tp"`
	// Trace names the trace replayed: its path, or
	// mooncake.ConversationName for the embedded one.
	Trace string `json:"trace"`
	// Requests replayed; PromptTokens their input_length summed.
	Requests     int   `json:"requests"`
	PromptTokens int64 `json:"prompt_tokens"`
	// PrefixTokensReused: prompt tokens decode already held (prefix cache)
	// and did not import; FullHits: requests that imported nothing.
	PrefixTokensReused int64 `json:"prefix_tokens_reused"`
	FullHits           int   `json:"full_hits"`
	// BytesMoved: KV bytes that landed in decode pages, all ranks;
	// BytesVerified: bytes checked against the deterministic content;
	// Mismatches: bytes that differed.
	BytesMoved uint64 `json:"bytes_moved"`
	// SameHost says the ranks offered and used the same-host path
	// (Config.NoSameHost unset); SameHostBytes is how many of BytesMoved
	// moved on it (mapped pages, no QUIC).
	SameHost      bool   `json:"same_host"`
	SameHostBytes uint64 `json:"same_host_bytes"`
	BytesVerified uint64 `json:"bytes_verified"`
	Mismatches    uint64 `json:"mismatches"`
	// FailedRequests: requests whose KV did not fully arrive.
	FailedRequests int `json:"failed_requests"`
	// P50Ms and P99Ms: transfer latency per request, from the first
	// StartLoad to the last decode rank's done_recving, in milliseconds,
	// nearest rank over LatencySamples (the requests that arrived). With
	// fewer than 100 samples P99Ms is their maximum.
	P50Ms          float64 `json:"p50_ms"`
	P99Ms          float64 `json:"p99_ms"`
	LatencySamples int     `json:"latency_samples"`
	// ThroughputGBPerS: transfer throughput, BytesMoved over TransferSeconds,
	// in GB/s (10^9 bytes per second, the unit nixlbench prints).
	// TransferSeconds is the union of the intervals during which at least
	// one load that moved bytes was in flight (first StartLoad to last
	// done_recving), so the trace's arrival gaps do not count.
	ThroughputGBPerS float64 `json:"throughput_gb_per_s"`
	TransferSeconds  float64 `json:"transfer_seconds"`
	// WallGBPerS: BytesMoved over WallSeconds, the whole replay from the
	// first request's dispatch to the last one's end, gaps included.
	WallGBPerS  float64 `json:"wall_gb_per_s"`
	WallSeconds float64 `json:"wall_seconds"`
	// End-to-end checksums (0 with Config.NoChecksums), summed over the
	// ranks: ChecksumRecordSeconds recording them at RequestFinished, before
	// the transfer; ChecksumVerifySeconds verifying them before a load is
	// done, on its path. ChecksumVerifyShare is the verify time over
	// TransferSeconds, ChecksumShare both over it (upper bounds: ranks run
	// them in parallel, and a loaded machine's wall time counts).
	ChecksumRecordSeconds float64 `json:"checksum_record_seconds"`
	ChecksumVerifySeconds float64 `json:"checksum_verify_seconds"`
	ChecksumVerifyShare   float64 `json:"checksum_verify_share_of_transfer"`
	ChecksumShare         float64 `json:"checksum_share_of_transfer"`
	// Handshakes: metadata exchanges the decode ranks sent; Dials: QUIC
	// connections they dialed; HandshakeRTTs: round trips spent on both
	// (one per 1-RTT QUIC handshake, one per exchange).
	Handshakes    int `json:"handshakes"`
	Dials         int `json:"dials"`
	HandshakeRTTs int `json:"handshake_rtts"`
	// PeakPagesPrefill and PeakPagesDecode: physical pages mapped over all
	// ranks of a side at its peak (the null block's pages included);
	// PagesMappedAfter: pages still mapped on both sides once every request
	// finished and the cache was emptied, beyond the null block's pages
	// mapped at start: 0 unless something leaked.
	PeakPagesPrefill int    `json:"peak_pages_prefill"`
	PeakPagesDecode  int    `json:"peak_pages_decode"`
	PageSize         uint64 `json:"page_size"`
	PagesMappedAfter int    `json:"pages_mapped_after"`
	// FirstError describes the first failed request, if any.
	FirstError string `json:"first_error,omitempty"`
}

// OK reports whether every request arrived and every byte matched.
func (s *Summary) OK() bool { return s.FailedRequests == 0 && s.Mismatches == 0 }

func (c *Config) withDefaults() (Config, error) {
	var out Config
	if c != nil {
		out = *c
	}
	if out.Model == "" {
		out.Model = DefaultModel
	}
	if out.PrefillTP == 0 {
		out.PrefillTP = DefaultPrefillTP
	}
	if out.DecodeTP == 0 {
		out.DecodeTP = DefaultDecodeTP
	}
	if out.Speedup == 0 {
		out.Speedup = DefaultSpeedup
	}
	if out.Concurrency == 0 {
		out.Concurrency = DefaultConcurrency
	}
	if out.ReadLanes == 0 {
		out.ReadLanes = transfer.DefaultReadLanes(runtime.NumCPU())
	}
	if out.CacheEntries == 0 {
		out.CacheEntries = DefaultCacheEntries
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	bad := func(field, format string, a ...any) (Config, error) {
		return Config{}, fmt.Errorf("%w: Config.%s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, a...))
	}
	if out.Geometry == nil {
		g, err := kvgeom.Model(out.Model)
		if err != nil {
			return bad("Model", "%v", err)
		}
		out.Geometry = g
	}
	bs := int(out.Geometry.GetBlockSize())
	switch {
	case bs < 1 || trace.HashBlockTokens%bs != 0:
		return bad("Geometry", "block_size=%d must divide %d (the trace's tokens per hash id)", bs, trace.HashBlockTokens)
	case out.PrefillTP < 1 || out.PrefillTP > connector.MaxTPSize:
		return bad("PrefillTP", "%d must be in [1, %d]", out.PrefillTP, connector.MaxTPSize)
	case out.DecodeTP < 1 || out.DecodeTP > connector.MaxTPSize:
		return bad("DecodeTP", "%d must be in [1, %d]", out.DecodeTP, connector.MaxTPSize)
	case out.Requests < 0:
		return bad("Requests", "%d must not be negative (0: the default)", out.Requests)
	case math.IsNaN(out.Speedup) || out.Speedup <= 0:
		return bad("Speedup", "%v must be > 0", out.Speedup)
	case out.Concurrency < 1:
		return bad("Concurrency", "%d must be at least 1", out.Concurrency)
	}
	for _, tp := range []int{out.PrefillTP, out.DecodeTP} {
		if _, err := vmm.LayoutFor(out.Geometry, 0, tp); err != nil {
			return bad("PrefillTP/DecodeTP", "model %s: %v", out.Geometry.GetModel(), err)
		}
	}
	return out, nil
}

// Run replays the trace through a prefill and a decode instance in this
// process and checks every byte that arrives. It returns the Summary and
// ErrVerification when a request failed or a byte differed; other errors
// (config, a malformed trace line as a *trace.LineError naming file and
// line, a *MemoryError when CheckMemory's estimated peak exceeds
// Config.MemoryBudget, ctx ended: context.Cause(ctx)) come with a zero or
// partial Summary.
// Everything it started is closed before it returns.
func Run(ctx context.Context, cfg *Config) (Summary, error) {
	c, tr, reqs, err := cfg.prepare()
	if err != nil {
		return Summary{}, err
	}
	if _, err := c.checkMemory(tr, reqs); err != nil {
		return Summary{}, err
	}
	r, err := newRun(ctx, c, reqs)
	if err != nil {
		return Summary{}, err
	}
	r.traceName = tr.Name
	s, err := r.run(ctx)
	if cerr := r.close(); err == nil && cerr != nil {
		err = fmt.Errorf("demo: shutting down: %w", cerr)
	}
	if err == nil && !s.OK() {
		err = fmt.Errorf("%w: %d failed requests, %d mismatched bytes", ErrVerification, s.FailedRequests, s.Mismatches)
	}
	return s, err
}

// prepare fills the defaults and selects the requests to replay.
func (cfg *Config) prepare() (Config, *Trace, []trace.Request, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return Config{}, nil, nil, err
	}
	tr := c.Trace
	if tr == nil {
		// A trace shorter than asked is read whole: its length is Have.
		if tr, err = loadTrace(c.TracePath, max(c.Requests, DefaultRequests)); err != nil {
			return Config{}, nil, nil, err // "trace: file:line: ..." already
		}
	}
	reqs := tr.Requests
	switch {
	case len(reqs) == 0 || c.Requests > len(reqs):
		return Config{}, nil, nil, &TraceLengthError{Trace: tr.Name, Have: len(reqs), Want: c.Requests}
	case c.Requests > 0:
		reqs = reqs[:c.Requests]
	default:
		reqs = reqs[:min(len(reqs), DefaultRequests)]
	}
	return c, tr, reqs, nil
}

// runner is one Run in progress.
type runner struct {
	cfg       Config
	traceName string
	reqs      []trace.Request
	bs        int
	pre       *instance
	dec       *instance
	cache     *prefixCache

	preRouter, decRouter *router
	collectors           sync.WaitGroup
	stopCollectors       context.CancelFunc

	peakPre, peakDec atomic.Int64

	mu        sync.Mutex
	sum       Summary
	latencies []time.Duration
	busy      []interval // loads that moved bytes
	started   int        // requests dispatched
	done      int
	start     time.Time
}

func newRun(ctx context.Context, c Config, reqs []trace.Request) (_ *runner, err error) {
	r := &runner{cfg: c, reqs: reqs, bs: int(c.Geometry.GetBlockSize()),
		preRouter: newRouter(), decRouter: newRouter()}
	maxBlocks := 0
	for _, q := range reqs {
		maxBlocks = max(maxBlocks, (q.InputLength+r.bs-1)/r.bs)
	}
	perHash := trace.HashBlockTokens / r.bs
	ca, err := devtls.NewCA()
	if err != nil {
		return nil, fmt.Errorf("demo: dev CA: %w", err)
	}
	srv, err := ca.ServerConfig()
	if err != nil {
		return nil, fmt.Errorf("demo: dev CA: %w", err)
	}
	cli, err := ca.ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("demo: dev CA: %w", err)
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, r.close())
		}
	}()
	base := instanceOpts{geom: c.Geometry, srvTLS: srv, cliTLS: cli, backend: c.Backend, logger: c.Logger, reg: c.Registerer, noCRC: c.NoChecksums,
		sameHost: !c.NoSameHost, lanes: c.ReadLanes}
	po := base
	po.engine, po.side, po.tp = "demo-prefill", "prefill", c.PrefillTP
	// Coordinated: the demo frees prefill blocks on every pool at once after
	// every rank reported done_sending, so the pools stay in lockstep.
	po.ownership = v1.Ownership_OWNERSHIP_COORDINATED
	po.numBlocks = c.Concurrency*maxBlocks + 1
	if r.pre, err = newInstance(ctx, po); err != nil {
		return r, err
	}
	do := base
	do.engine, do.side, do.tp, do.mode = "demo-decode", "decode", c.DecodeTP, c.HandshakeMode
	// In flight: tails and pinned prefixes of evicted entries; plus the cache.
	do.numBlocks = 2*c.Concurrency*maxBlocks + max(c.CacheEntries, 0)*perHash + 1
	if r.dec, err = newInstance(ctx, do); err != nil {
		return r, err
	}
	if c.CacheEntries > 0 {
		if r.cache, err = newPrefixCache(c.CacheEntries, func(ids []uint32) {
			if ferr := r.dec.free(ids); ferr != nil {
				c.Logger.Error("freeing evicted prefix blocks failed", "err", ferr)
			}
		}); err != nil {
			return r, fmt.Errorf("demo: prefix cache: %w", err)
		}
	}
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	r.stopCollectors = cancel
	for _, rk := range r.pre.ranks {
		r.collectors.Go(func() { r.collect(cctx, rk, r.preRouter, true) })
	}
	for _, rk := range r.dec.ranks {
		r.collectors.Go(func() { r.collect(cctx, rk, r.decRouter, false) })
	}
	return r, nil
}

// collect routes what one rank reports to the requests waiting for it.
func (r *runner) collect(ctx context.Context, rk *connector.Rank, rt *router, prefill bool) {
	for {
		f, err := rk.WaitFinished(ctx)
		if err != nil {
			return
		}
		if prefill {
			for _, id := range f.DoneSending {
				rt.deliver(id, nil)
			}
			continue
		}
		for _, id := range f.DoneRecving {
			rt.deliver(id, nil)
		}
		for _, fl := range f.Failed {
			rt.deliver(fl.RequestID, fl.Err)
		}
	}
}

func (r *runner) close() error {
	if r.stopCollectors != nil {
		r.stopCollectors()
		r.collectors.Wait()
	}
	var errs []error
	if r.dec != nil {
		errs = append(errs, r.dec.close())
	}
	if r.pre != nil {
		errs = append(errs, r.pre.close())
	}
	return errors.Join(errs...)
}

func (r *runner) run(ctx context.Context) (Summary, error) {
	g := r.cfg.Geometry
	r.sum = Summary{Model: g.GetModel(), PrefillTP: r.cfg.PrefillTP, DecodeTP: r.cfg.DecodeTP,
		Trace: r.traceName, Requests: len(r.reqs), PageSize: r.dec.pools[0].PageSize()}
	r.start = time.Now()
	sem := make(chan struct{}, r.cfg.Concurrency)
	var wg sync.WaitGroup
	var runErr error
	if r.cfg.Progress != nil && r.cfg.ProgressInterval > 0 {
		stop := make(chan struct{})
		var ticker sync.WaitGroup
		ticker.Go(func() { r.tick(stop) })
		defer func() {
			close(stop)
			ticker.Wait()
		}()
	}
	t0 := r.reqs[0].Timestamp
dispatch:
	for i, q := range r.reqs {
		at := r.start.Add(time.Duration(float64(q.Timestamp-t0) * float64(time.Millisecond) / r.cfg.Speedup))
		if d := time.Until(at); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				runErr = context.Cause(ctx)
				break dispatch
			}
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			runErr = context.Cause(ctx)
			break dispatch
		}
		r.mu.Lock()
		r.started++
		r.mu.Unlock()
		wg.Go(func() {
			defer func() { <-sem }()
			r.finish(r.request(ctx, i, q))
		})
	}
	wg.Wait()
	wall := time.Since(r.start)
	if r.cache != nil {
		r.cache.purge()
	}
	s := r.sum
	s.WallSeconds = wall.Seconds()
	busy := unionLength(r.busy)
	s.TransferSeconds = busy.Seconds()
	if wall > 0 {
		s.WallGBPerS = float64(s.BytesMoved) / wall.Seconds() / 1e9
	}
	if busy > 0 {
		s.ThroughputGBPerS = float64(s.BytesMoved) / busy.Seconds() / 1e9
	}
	slices.Sort(r.latencies)
	s.LatencySamples = len(r.latencies)
	s.P50Ms = float64(nearestRank(r.latencies, 0.50)) / float64(time.Millisecond)
	s.P99Ms = float64(nearestRank(r.latencies, 0.99)) / float64(time.Millisecond)
	for _, rk := range r.dec.ranks {
		for _, a := range r.pre.addrs {
			s.Handshakes += rk.Handshakes().Exchanges(a)
			s.Dials += rk.Agent().DialCount(a)
		}
	}
	s.HandshakeRTTs = s.Handshakes + s.Dials
	s.SameHost = !r.cfg.NoSameHost
	for _, rk := range r.dec.ranks {
		s.SameHostBytes += rk.Agent().SameHostBytes()
	}
	for _, rk := range append(slices.Clone(r.pre.ranks), r.dec.ranks...) {
		st := rk.Stats()
		s.ChecksumRecordSeconds += st.ChecksumRecordSeconds
		s.ChecksumVerifySeconds += st.ChecksumVerifySeconds
	}
	if busy > 0 {
		s.ChecksumVerifyShare = s.ChecksumVerifySeconds / busy.Seconds()
		s.ChecksumShare = (s.ChecksumRecordSeconds + s.ChecksumVerifySeconds) / busy.Seconds()
	}
	s.PeakPagesPrefill, s.PeakPagesDecode = int(r.peakPre.Load()), int(r.peakDec.Load())
	s.PagesMappedAfter = r.pre.physPages() - r.pre.baseline + r.dec.physPages() - r.dec.baseline
	return s, runErr
}

// outcome is what one request contributes to the Summary.
type outcome struct {
	tokens, reused  int64
	fullHit         bool
	moved, verified uint64
	mismatches      uint64
	latency         time.Duration
	loadStart       time.Time // when the load began; latency is its length
	err             error
}

func (r *runner) finish(o outcome) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sum.PromptTokens += o.tokens
	r.sum.PrefixTokensReused += o.reused
	r.sum.BytesMoved += o.moved
	r.sum.BytesVerified += o.verified
	r.sum.Mismatches += o.mismatches
	if o.fullHit {
		r.sum.FullHits++
	}
	if o.err != nil {
		r.sum.FailedRequests++
		if r.sum.FirstError == "" {
			r.sum.FirstError = o.err.Error()
		}
		r.cfg.Logger.Warn("request failed", "err", o.err)
	} else {
		r.latencies = append(r.latencies, o.latency)
		if o.moved > 0 {
			r.busy = append(r.busy, interval{o.loadStart, o.loadStart.Add(o.latency)})
		}
	}
	r.done++
	if r.cfg.Progress != nil {
		r.cfg.Progress(r.progressLocked(false))
	}
}

// progressLocked is the Progress now; r.mu is held.
func (r *runner) progressLocked(tick bool) Progress {
	var moved uint64
	for _, rk := range r.dec.ranks {
		moved += rk.Agent().BytesMoved()
	}
	return Progress{Done: r.done, Total: len(r.reqs), Failed: r.sum.FailedRequests, InFlight: r.started - r.done,
		BytesMoved: moved, Elapsed: time.Since(r.start), Tick: tick}
}

// tick calls Progress every ProgressInterval until stop is closed.
func (r *runner) tick(stop <-chan struct{}) {
	t := time.NewTicker(r.cfg.ProgressInterval)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			r.mu.Lock()
			r.cfg.Progress(r.progressLocked(true))
			r.mu.Unlock()
		}
	}
}

func storeMax(a *atomic.Int64, v int) {
	for {
		old := a.Load()
		if int64(v) <= old || a.CompareAndSwap(old, int64(v)) {
			return
		}
	}
}

// request runs one trace request through prefill, the proxy and decode.
// abortTimeout bounds aborting a load when a request is given up.
const abortTimeout = 30 * time.Second

func (r *runner) request(ctx context.Context, i int, q trace.Request) (o outcome) {
	o.tokens = int64(q.InputLength)
	nBlocks := (q.InputLength + r.bs - 1) / r.bs
	perHash := trace.HashBlockTokens / r.bs
	preID, decID := fmt.Sprintf("req-%d", i), fmt.Sprintf("dec-%d", i)

	// Prefill: compute (write deterministic KV), finish, hold for decode.
	pids, err := r.pre.alloc(ctx, nBlocks)
	if err != nil {
		o.err = err
		return o
	}
	storeMax(&r.peakPre, r.pre.physPages())
	if err := r.fill(q, pids); err != nil {
		o.err = errors.Join(err, r.pre.free(pids))
		return o
	}
	released := r.preRouter.register(preID, r.cfg.PrefillTP)
	parts := make([]*v1.KVTransferParams, 0, len(r.pre.ranks))
	for rank, rk := range r.pre.ranks {
		p, err := rk.RequestFinished(ctx, preID, pids, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		if err == nil && p == nil {
			err = fmt.Errorf("demo: prefill rank %d returned no kv_transfer_params", rank)
		}
		if err != nil {
			// Ranks that took the blocks keep them until their lease ends;
			// the pools are closed with them at the end of the run.
			o.err = fmt.Errorf("demo: %s: prefill rank %d RequestFinished: %w", preID, rank, err)
			return o
		}
		parts = append(parts, p)
	}
	// Every rank exported its own copy of the request: the params carry
	// each rank's export, as a scheduler gathering its ranks' answers does.
	params, err := connector.MergeExports(parts...)
	if err != nil {
		o.err = fmt.Errorf("demo: %s: %w", preID, err)
		return o
	}
	defer func() {
		// Prefill frees once every rank released the lease (every decode
		// rank notified, or the lease expired).
		if err := released.wait(ctx); err != nil {
			o.err = errors.Join(o.err, fmt.Errorf("demo: %s: waiting for prefill to release: %w", preID, err))
			return
		}
		if err := r.pre.free(pids); err != nil {
			o.err = errors.Join(o.err, err)
		}
	}()

	// The proxy: kv_transfer_params travel as JSON, unchanged.
	js, err := connector.MarshalKVTransferParams(params)
	if err != nil {
		o.err = err
		return o
	}
	dparams, err := connector.UnmarshalKVTransferParams(js)
	if err != nil {
		o.err = err
		return o
	}

	// Decode: reuse the cached prefix, import the tail, check every byte.
	fullHashes := q.InputLength / trace.HashBlockTokens
	var hit []*cacheEntry
	if r.cache != nil {
		hit = r.cache.lookup(q.HashIDs, fullHashes)
		defer r.cache.release(hit)
	}
	prefix := len(hit) * perHash
	o.reused = int64(prefix * r.bs)
	o.fullHit = prefix == nBlocks
	dids, err := r.dec.alloc(ctx, nBlocks-prefix)
	if err != nil {
		o.err = err
		return o
	}
	storeMax(&r.peakDec, r.dec.physPages())
	loaded := r.decRouter.register(decID, r.cfg.DecodeTP)
	start := time.Now()
	o.loadStart = start
	for rank, rk := range r.dec.ranks {
		if err := rk.StartLoad(ctx, &v1.ReqMeta{RequestId: decID, LocalBlockIds: dids, Params: dparams, RemoteHitBlocks: new(uint32(prefix))}); err != nil {
			r.decRouter.deliver(decID, fmt.Errorf("demo: decode rank %d StartLoad: %w", rank, err))
		}
	}
	err = loaded.wait(ctx)
	o.latency = time.Since(start)
	if err != nil {
		o.err = fmt.Errorf("demo: %s: %w", decID, err)
		// The blocks are ours again only once no READ writes into them:
		// abort the load on every rank (Abort returns after the READ
		// stopped), then free. Freeing first unmapped pages under a
		// running READ when the demo was interrupted.
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), abortTimeout)
		for rank, rk := range r.dec.ranks {
			if aerr := rk.Abort(actx, decID); aerr != nil {
				cancel()
				// Leave the blocks allocated: the pools are closed after the
				// ranks, whose Close waits for every load.
				o.err = errors.Join(o.err, fmt.Errorf("demo: %s: abort on decode rank %d: %w", decID, rank, aerr))
				return o
			}
		}
		cancel()
		if ferr := r.dec.free(dids); ferr != nil {
			o.err = errors.Join(o.err, ferr)
		}
		return o
	}
	o.moved, o.verified, o.mismatches, err = r.check(q, prefix, dids)
	if err == nil && o.mismatches > 0 {
		err = fmt.Errorf("demo: %s: %d of %d bytes differ", decID, o.mismatches, o.verified)
	}
	if err != nil || r.cache == nil {
		o.err = err
		if ferr := r.dec.free(dids); ferr != nil {
			o.err = errors.Join(o.err, ferr)
		}
		return o
	}
	// Cache the tail's whole hash blocks; free what the cache did not take.
	var rest []uint32
	for j := len(hit); j < fullHashes; j++ {
		grp := dids[(j-len(hit))*perHash : (j-len(hit)+1)*perHash]
		if !r.cache.insert(q.HashIDs[j], grp) {
			rest = append(rest, grp...)
		}
	}
	rest = append(rest, dids[(fullHashes-len(hit))*perHash:]...)
	o.err = r.dec.free(rest)
	return o
}

// fill writes the deterministic KV of q into blocks on every prefill rank:
// block k holds tokens [k·bs, (k+1)·bs), content key of their hash block.
func (r *runner) fill(q trace.Request, blocks []uint32) error {
	var staging []byte
	for rank, p := range r.pre.pools {
		s, err := r.pre.shape(rank)
		if err != nil {
			return err
		}
		for _, reg := range p.Regions() {
			for k, b := range blocks {
				tok := k * r.bs
				key := kvgen.Key(q.HashIDs[tok/trace.HashBlockTokens])
				off := reg.BlockOffset(int(b))
				if buf, err := p.HostBytes(reg.Index, off, reg.BlockLen); err == nil {
					kvgen.FillBlock(buf, s, key, reg.Index, tok)
					continue
				}
				if len(staging) == 0 {
					staging = make([]byte, reg.BlockLen)
				}
				kvgen.FillBlock(staging, s, key, reg.Index, tok)
				if err := p.CopyIn(reg.Index, off, staging); err != nil {
					return fmt.Errorf("demo: prefill rank %d: %w", rank, err)
				}
			}
		}
	}
	return nil
}

// check verifies the tail blocks on every decode rank; blocks[k] holds
// request block prefix+k. It returns bytes moved, checked and differing.
func (r *runner) check(q trace.Request, prefix int, blocks []uint32) (moved, checked, bad uint64, err error) {
	var staging []byte
	for rank, p := range r.dec.pools {
		s, err := r.dec.shape(rank)
		if err != nil {
			return moved, checked, bad, err
		}
		for _, reg := range p.Regions() {
			for k, b := range blocks {
				tok := (prefix + k) * r.bs
				key := kvgen.Key(q.HashIDs[tok/trace.HashBlockTokens])
				off := reg.BlockOffset(int(b))
				buf, herr := p.HostBytes(reg.Index, off, reg.BlockLen)
				if herr != nil {
					if len(staging) == 0 {
						staging = make([]byte, reg.BlockLen)
					}
					if err := p.CopyOut(reg.Index, off, staging); err != nil {
						return moved, checked, bad, fmt.Errorf("demo: decode rank %d: %w", rank, err)
					}
					buf = staging
				}
				n, _ := kvgen.CheckBlock(buf, s, key, reg.Index, tok)
				moved += reg.BlockLen
				checked += reg.BlockLen
				bad += uint64(n)
			}
		}
	}
	return moved, checked, bad, nil
}

// router hands the events of a request id, reported by several ranks, to
// the one goroutine waiting for all of them.
type router struct {
	mu      sync.Mutex
	waiters map[string]*waiter
}

type waiter struct {
	need int
	errs []error
	done chan struct{}
}

func newRouter() *router { return &router{waiters: map[string]*waiter{}} }

// register expects need events for id; register before anything can
// report id.
func (rt *router) register(id string, need int) *waiter {
	w := &waiter{need: need, done: make(chan struct{})}
	rt.mu.Lock()
	rt.waiters[id] = w
	rt.mu.Unlock()
	return w
}

// deliver records one event (err nil: success) for id.
func (rt *router) deliver(id string, err error) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	w := rt.waiters[id]
	if w == nil {
		return
	}
	if err != nil {
		w.errs = append(w.errs, err)
	}
	if w.need--; w.need == 0 {
		delete(rt.waiters, id)
		close(w.done)
	}
}

// wait returns once every event arrived, with their errors joined, or
// context.Cause(ctx).
func (w *waiter) wait(ctx context.Context) error {
	select {
	case <-w.done:
		return errors.Join(w.errs...)
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
