package main

import (
	"context"
	"crypto/hkdf"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/quic-go/quic-go"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
	"github.com/kvsidecar/kvsidecar/vmm/tpgroup"
)

// serveFlags are the flags of `kvsidecar serve`; each can also be set by
// the environment variable KVSIDECAR_<FLAG> (upper case, '-' as '_'); a flag
// on the command line wins.
type serveFlags struct {
	engineID, role, ownership, backend, model, dtype, attention string
	tpRank, tpSize, device, layers, kvHeads, headDim, blockSize int
	numBlocks                                                   int
	memoryLimit, listen, advertise, rankAddrs                   string
	tlsCert, tlsKey, tlsCA, capKeyFile, socketDir, metricsAddr  string
	qlogDir, logLevel, handshakeMode                            string
	leaseTTL, drainTimeout, loadTimeout, progressTimeout        time.Duration
}

func (f *serveFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.engineID, "engine-id", "", "engine instance id, shared by its ranks (required)")
	fs.StringVar(&f.role, "role", "both", "prefill, decode or both (informational: every sidecar can export and import)")
	fs.IntVar(&f.tpRank, "tp-rank", 0, "this sidecar's tensor-parallel rank, in [0, tp-size)")
	fs.IntVar(&f.tpSize, "tp-size", 0, "the engine's tensor-parallel size (required, never defaulted)")
	fs.StringVar(&f.ownership, "ownership", "local", "who frees blocks: local (each rank drives its pool, SGLang) or coordinated (rank 0 for all, vLLM)")
	fs.StringVar(&f.backend, "backend", "host", "page backend: host (memfd) or cuda")
	fs.IntVar(&f.device, "device", 0, "CUDA device ordinal (cuda backend only)")
	fs.StringVar(&f.model, "model", "", "model geometry by name ("+strings.Join(vmm.ModelNames(), ", ")+"); or set --layers, --kv-heads, --head-dim, --dtype; or neither to take the engine's")
	fs.IntVar(&f.layers, "layers", 0, "explicit geometry: num_hidden_layers")
	fs.IntVar(&f.kvHeads, "kv-heads", 0, "explicit geometry: num_key_value_heads (before the TP split)")
	fs.IntVar(&f.headDim, "head-dim", 0, "explicit geometry: head_dim")
	fs.StringVar(&f.dtype, "dtype", "bfloat16", "explicit geometry: float16, bfloat16, float32, fp8_e4m3 or fp8_e5m2")
	fs.StringVar(&f.attention, "attention", "gqa", "explicit geometry: gqa or mla")
	fs.IntVar(&f.blockSize, "block-size", vmm.DefaultBlockSize, "tokens per KV block")
	fs.IntVar(&f.numBlocks, "num-blocks", 0, "blocks per region (0: the engine's create request decides)")
	fs.StringVar(&f.memoryLimit, "memory-limit", "", "limit on mapped bytes: bytes with a unit (8GiB, 512MiB) or a percent of the reservation (50%); empty: none")
	fs.StringVar(&f.listen, "listen", "127.0.0.1:0", "QUIC listen address host:port")
	fs.StringVar(&f.advertise, "advertise", "", "address peers reach this rank at (default: the listen address)")
	fs.StringVar(&f.rankAddrs, "rank-addrs", "", "comma-separated advertised address of every rank, index tp_rank (default: rank r at port - tp-rank + r)")
	fs.StringVar(&f.tlsCert, "tls-cert", "", "PEM certificate of this sidecar (required)")
	fs.StringVar(&f.tlsKey, "tls-key", "", "PEM private key of --tls-cert (required)")
	fs.StringVar(&f.tlsCA, "tls-ca", "", "PEM CA that signs every peer (required)")
	fs.StringVar(&f.capKeyFile, "capability-key-file", "", "file with the secret (>= 16 bytes) shared by the engine's ranks; required when --tp-size > 1")
	fs.StringVar(&f.socketDir, "socket-dir", defaultSocketDir(), "directory of the local API and TP group sockets")
	fs.StringVar(&f.metricsAddr, "metrics-addr", "", "HTTP address for /metrics, /healthz, /readyz (empty: off)")
	fs.StringVar(&f.qlogDir, "qlog-dir", "", "write one qlog file per QUIC connection here")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.DurationVar(&f.leaseTTL, "lease-ttl", connector.DefaultLeaseTTL, "how long prefill holds blocks for decode without a heartbeat")
	fs.DurationVar(&f.loadTimeout, "load-timeout", connector.DefaultLoadTimeout, "bound on one decode load")
	fs.DurationVar(&f.progressTimeout, "progress-timeout", transfer.DefaultProgressTimeout, "how long one transfer (served or read) may go without a byte moving before it fails with CODE_TIMEOUT")
	fs.StringVar(&f.handshakeMode, "handshake-mode", "piggyback", "piggyback or legacy")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM/SIGINT, how long in-flight transfers may take before they are aborted")
}

func defaultSocketDir() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" && filepath.IsAbs(d) {
		return filepath.Join(d, "kvsidecar")
	}
	return filepath.Join(os.TempDir(), "kvsidecar-"+strconv.Itoa(os.Getuid()))
}

// applyEnv sets every flag not given on the command line from
// KVSIDECAR_<FLAG>.
func applyEnv(fs *flag.FlagSet, getenv func(string) string) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] || err != nil {
			return
		}
		env := "KVSIDECAR_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(env); v != "" {
			if serr := fs.Set(f.Name, v); serr != nil {
				err = usageErrorf("%s=%q (for --%s): %v", env, v, f.Name, serr)
			}
		}
	})
	return err
}

// serveConfig is the validated result of the flags.
type serveConfig struct {
	f         serveFlags
	geometry  *v1.ModelGeometry // nil: the engine's
	ownership v1.Ownership
	mode      handshake.Mode
	level     slog.Level
	rankAddrs []string
	secret    []byte
	limit     limitValue
	// resetKey is derived from --tls-key (statelessResetKey).
	resetKey *quic.StatelessResetKey
}

// statelessResetKey derives the QUIC stateless reset key from the TLS
// private key file: a sidecar restarted with the same key resets the
// connections its predecessor left open at its peers, so they redial at
// once instead of waiting for the idle timeout (transfer.Config). HKDF keeps
// the private key from being recoverable from the reset key.
func statelessResetKey(keyFile string) (*quic.StatelessResetKey, error) {
	pem, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, err
	}
	b, err := hkdf.Key(sha256.New, pem, nil, "kvsidecar/1 QUIC stateless reset key", 32)
	if err != nil {
		return nil, err
	}
	var k quic.StatelessResetKey
	copy(k[:], b)
	return &k, nil
}

// validate checks every flag and combination; errors name the flag and
// are usage errors (exit 2).
func (f *serveFlags) validate() (*serveConfig, error) {
	c := &serveConfig{f: *f}
	bad := func(flag, format string, a ...any) (*serveConfig, error) {
		return nil, usageErrorf("--%s: %s", flag, fmt.Sprintf(format, a...))
	}
	if f.engineID == "" {
		return bad("engine-id", "required")
	}
	switch f.role {
	case "prefill", "decode", "both":
	default:
		return bad("role", "%q: want prefill, decode or both", f.role)
	}
	if f.tpSize < 1 || f.tpSize > connector.MaxTPSize {
		return bad("tp-size", "%d: required, in [1, %d]", f.tpSize, connector.MaxTPSize)
	}
	if f.tpRank < 0 || f.tpRank >= f.tpSize {
		return bad("tp-rank", "%d: must be in [0, --tp-size=%d)", f.tpRank, f.tpSize)
	}
	switch f.ownership {
	case "local":
		c.ownership = v1.Ownership_OWNERSHIP_LOCAL
	case "coordinated":
		c.ownership = v1.Ownership_OWNERSHIP_COORDINATED
	default:
		return bad("ownership", "%q: want local or coordinated", f.ownership)
	}
	switch f.backend {
	case "host":
		if f.device != 0 {
			return bad("device", "%d: only the cuda backend has devices", f.device)
		}
	case "cuda":
		if f.device < 0 {
			return bad("device", "%d: must be >= 0", f.device)
		}
	default:
		return bad("backend", "%q: want host or cuda", f.backend)
	}
	explicit := f.layers != 0 || f.kvHeads != 0 || f.headDim != 0
	switch {
	case f.model != "" && explicit:
		return bad("model", "give a model name or --layers/--kv-heads/--head-dim, not both")
	case f.model != "":
		g, err := vmm.Model(f.model)
		if err != nil {
			return bad("model", "%v (known: %s)", err, strings.Join(vmm.ModelNames(), ", "))
		}
		g = proto.Clone(g).(*v1.ModelGeometry)
		g.BlockSize = uint32(f.blockSize)
		c.geometry = g
	case explicit:
		g, err := explicitGeometry(f)
		if err != nil {
			return nil, err
		}
		c.geometry = g
	}
	if f.blockSize < 1 || f.blockSize > 1<<16 {
		return bad("block-size", "%d: must be in [1, 65536]", f.blockSize)
	}
	if c.geometry != nil {
		if _, err := vmm.LayoutFor(c.geometry, f.tpRank, f.tpSize); err != nil {
			return bad("tp-size", "%v", err)
		}
	}
	if f.numBlocks < 0 || f.numBlocks == 1 {
		return bad("num-blocks", "%d: must be 0 (the engine decides) or at least 2", f.numBlocks)
	}
	if f.memoryLimit != "" {
		lv, err := parseLimit(f.memoryLimit)
		if err != nil {
			return bad("memory-limit", "%v", err)
		}
		c.limit = lv
	}
	if err := checkAddr(f.listen); err != nil {
		return bad("listen", "%v", err)
	}
	if f.advertise != "" {
		if err := checkAddr(f.advertise); err != nil {
			return bad("advertise", "%v", err)
		}
	}
	if f.rankAddrs != "" {
		c.rankAddrs = strings.Split(f.rankAddrs, ",")
		if len(c.rankAddrs) != f.tpSize {
			return bad("rank-addrs", "%d addresses, want --tp-size=%d", len(c.rankAddrs), f.tpSize)
		}
		for i, a := range c.rankAddrs {
			if err := checkAddr(a); err != nil {
				return bad("rank-addrs", "[%d]=%q: %v", i, a, err)
			}
		}
	}
	for _, p := range []struct{ name, v string }{{"tls-cert", f.tlsCert}, {"tls-key", f.tlsKey}, {"tls-ca", f.tlsCA}} {
		if p.v == "" {
			return bad(p.name, "required (mutual TLS between sidecars)")
		}
	}
	if f.capKeyFile == "" && f.tpSize > 1 {
		return bad("capability-key-file", "required when --tp-size=%d > 1: every rank of the engine verifies the others' capabilities", f.tpSize)
	}
	if f.capKeyFile != "" {
		b, err := os.ReadFile(f.capKeyFile)
		if err != nil {
			return bad("capability-key-file", "%v", err)
		}
		b = []byte(strings.TrimSpace(string(b)))
		if len(b) < 16 {
			return bad("capability-key-file", "%d bytes, want at least 16", len(b))
		}
		c.secret = b
	}
	if !filepath.IsAbs(f.socketDir) {
		return bad("socket-dir", "%q: must be an absolute path", f.socketDir)
	}
	if f.metricsAddr != "" {
		if err := checkAddr(f.metricsAddr); err != nil {
			return bad("metrics-addr", "%v", err)
		}
	}
	if err := c.level.UnmarshalText([]byte(f.logLevel)); err != nil {
		return bad("log-level", "%q: want debug, info, warn or error", f.logLevel)
	}
	if f.leaseTTL <= 0 {
		return bad("lease-ttl", "%v: must be positive", f.leaseTTL)
	}
	if f.loadTimeout <= 0 {
		return bad("load-timeout", "%v: must be positive", f.loadTimeout)
	}
	if f.progressTimeout <= 0 {
		return bad("progress-timeout", "%v: must be positive", f.progressTimeout)
	}
	if f.drainTimeout <= 0 {
		return bad("drain-timeout", "%v: must be positive", f.drainTimeout)
	}
	m, err := handshake.ParseMode(f.handshakeMode)
	if err != nil {
		return bad("handshake-mode", "%v", err)
	}
	c.mode = m
	return c, nil
}

func explicitGeometry(f *serveFlags) (*v1.ModelGeometry, error) {
	if f.layers < 1 || f.kvHeads < 1 || f.headDim < 1 {
		return nil, usageErrorf("--layers, --kv-heads, --head-dim: all three are required and positive (got %d, %d, %d)", f.layers, f.kvHeads, f.headDim)
	}
	dt, ok := map[string]v1.DType{"float16": v1.DType_DTYPE_FLOAT16, "bfloat16": v1.DType_DTYPE_BFLOAT16, "float32": v1.DType_DTYPE_FLOAT32,
		"fp8_e4m3": v1.DType_DTYPE_FP8_E4M3, "fp8_e5m2": v1.DType_DTYPE_FP8_E5M2}[f.dtype]
	if !ok {
		return nil, usageErrorf("--dtype: %q: want float16, bfloat16, float32, fp8_e4m3 or fp8_e5m2", f.dtype)
	}
	att, ok := map[string]v1.Attention{"gqa": v1.Attention_ATTENTION_GQA, "mla": v1.Attention_ATTENTION_MLA}[f.attention]
	if !ok {
		return nil, usageErrorf("--attention: %q: want gqa or mla", f.attention)
	}
	return &v1.ModelGeometry{Model: "custom", NumLayers: uint32(f.layers), NumKvHeads: uint32(f.kvHeads), HeadDim: uint32(f.headDim),
		Dtype: dt, BlockSize: uint32(f.blockSize), Layout: v1.Layout_LAYOUT_HND, Attention: att}, nil
}

func checkAddr(a string) error {
	_, p, err := net.SplitHostPort(a)
	if err != nil {
		return err
	}
	if n, err := strconv.Atoi(p); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("port %q is not in [0, 65535]", p)
	}
	return nil
}

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("serve", "Run the sidecar beside one GPU (one tp_rank) of an inference engine.\n"+
		"Every flag can also be set as KVSIDECAR_<FLAG> (e.g. KVSIDECAR_ENGINE_ID).", stderr)
	var f serveFlags
	f.register(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := applyEnv(fs, os.Getenv); err != nil {
		return err
	}
	cfg, err := f.validate()
	if err != nil {
		return err
	}
	log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: cfg.level}))
	return serve(ctx, cfg, log)
}

// serve runs until ctx ends (SIGTERM/SIGINT), then drains and returns nil.
func serve(ctx context.Context, cfg *serveConfig, log *slog.Logger) error {
	f := &cfg.f
	srvTLS, cliTLS, err := devtls.LoadConfigs(f.tlsCA, f.tlsCert, f.tlsKey)
	if err != nil {
		return usageErrorf("--tls-ca/--tls-cert/--tls-key: %v", err)
	}
	if cfg.resetKey, err = statelessResetKey(f.tlsKey); err != nil {
		return usageErrorf("--tls-key: %v", err)
	}
	if err := os.MkdirAll(f.socketDir, 0o700); err != nil {
		return fmt.Errorf("--socket-dir: %w", err)
	}
	path, err := connector.LocalSocketPath(f.socketDir, f.engineID, f.tpRank)
	if err != nil {
		return usageErrorf("--socket-dir/--engine-id: %v", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	open := func(octx context.Context, req *v1.CreateKVCache) (*connector.LocalCache, error) {
		return openCache(octx, cfg, req, srvTLS, cliTLS, log, reg)
	}
	srv, err := connector.NewLocalServer(ctx, &connector.LocalServerConfig{Path: path, Open: open, Logger: log, Registerer: reg})
	if err != nil {
		return err
	}
	var httpSrv *http.Server
	httpDone := make(chan struct{})
	if f.metricsAddr != "" {
		ln, err := net.Listen("tcp", f.metricsAddr)
		if err != nil {
			_ = srv.Close()
			return fmt.Errorf("--metrics-addr: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok\n") })
		mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
			if !srv.Ready() {
				http.Error(w, "not ready: no KV cache yet, or draining", http.StatusServiceUnavailable)
				return
			}
			io.WriteString(w, "ready\n")
		})
		httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			defer close(httpDone)
			if err := httpSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("metrics server failed", "err", err)
			}
		}()
		log.Info("metrics listening", "addr", ln.Addr().String())
	} else {
		close(httpDone)
	}
	log.Info("serving", "engine_id", f.engineID, "tp_rank", f.tpRank, "tp_size", f.tpSize, "role", f.role,
		"backend", f.backend, "socket", path)

	<-ctx.Done()
	log.Info("shutting down: refusing new requests, draining", "drain_timeout", f.drainTimeout)
	dctx, cancel := context.WithTimeout(context.Background(), f.drainTimeout)
	defer cancel()
	if err := srv.Shutdown(dctx); err != nil {
		log.Warn("drain ended with errors", "err", err)
	}
	if httpSrv != nil {
		_ = httpSrv.Shutdown(dctx)
	}
	<-httpDone
	log.Info("stopped")
	return nil
}

// openCache builds the pool, TP group and rank for the engine's first
// create request, after checking it against the flags.
func openCache(ctx context.Context, cfg *serveConfig, req *v1.CreateKVCache, srvTLS, cliTLS *tls.Config, log *slog.Logger, reg prometheus.Registerer) (c *connector.LocalCache, err error) {
	f := &cfg.f
	mismatch := func(code v1.Code, field string, flagv, got any) error {
		return codes.New(code, "kvsidecar serve: create: %s=%v, but this sidecar was started with %v", field, got, flagv)
	}
	switch {
	case int(req.GetTpSize()) != f.tpSize:
		return nil, mismatch(v1.Code_CODE_TP_MISMATCH, "tp_size", f.tpSize, req.GetTpSize())
	case int(req.GetTpRank()) != f.tpRank:
		return nil, mismatch(v1.Code_CODE_TP_MISMATCH, "tp_rank", f.tpRank, req.GetTpRank())
	case cfg.geometry != nil && !proto.Equal(cfg.geometry, req.GetGeometry()):
		return nil, mismatch(v1.Code_CODE_INCOMPATIBLE_MODEL, "geometry", cfg.geometry, req.GetGeometry())
	case req.GetOwnership() != v1.Ownership_OWNERSHIP_UNSPECIFIED && req.GetOwnership() != cfg.ownership:
		return nil, mismatch(v1.Code_CODE_INVALID_ARGUMENT, "ownership", cfg.ownership, req.GetOwnership())
	case f.numBlocks != 0 && req.GetNumBlocks() != 0 && int(req.GetNumBlocks()) != f.numBlocks:
		return nil, mismatch(v1.Code_CODE_INVALID_ARGUMENT, "num_blocks", f.numBlocks, req.GetNumBlocks())
	}
	n := int(req.GetNumBlocks())
	if n == 0 {
		n = f.numBlocks
	}
	if n < 2 {
		return nil, codes.New(v1.Code_CODE_INVALID_ARGUMENT, "kvsidecar serve: create: num_blocks=%d: the engine or --num-blocks must give at least 2", n)
	}
	layout, err := vmm.LayoutFor(req.GetGeometry(), f.tpRank, f.tpSize)
	if err != nil {
		return nil, codes.New(v1.Code_CODE_INVALID_ARGUMENT, "kvsidecar serve: create: %v", err)
	}
	var closers []func() error
	defer func() {
		if err != nil {
			for i := len(closers) - 1; i >= 0; i-- {
				_ = closers[i]()
			}
		}
	}()
	vc := &vmm.Config{Layout: layout, NumBlocks: n, Logger: log, Registerer: reg}
	deviceMemory := false
	if f.backend == "cuda" {
		be, err := cuda.New(&cuda.Config{Device: f.device})
		if err != nil {
			return nil, codes.New(v1.Code_CODE_UNAVAILABLE, "kvsidecar serve: --backend cuda: %v", err)
		}
		closers = append(closers, be.Close)
		vc.Backend, deviceMemory = be, true
	}
	coordinated := cfg.ownership == v1.Ownership_OWNERSHIP_COORDINATED && f.tpSize > 1
	member := tpgroup.Member{EngineID: f.engineID, TPSize: f.tpSize, TPRank: f.tpRank, Device: f.device}
	gcfg := &tpgroup.Config{Dir: f.socketDir, Ownership: tpgroup.OwnershipCoordinated, Logger: log, Registerer: reg}
	var tracker *connector.PageTracker
	var pool *vmm.Pool
	switch {
	case coordinated && f.tpRank == 0:
		g, err := tpgroup.New(ctx, member, nil, gcfg)
		if err != nil {
			return nil, err
		}
		closers = append(closers, g.Close)
		tracker = connector.NewPageTracker(g.Hook())
		vc.PageHook = tracker
		if pool, err = vmm.NewPool(ctx, vc); err != nil {
			return nil, err
		}
		closers = append(closers, pool.Close)
	case coordinated:
		vc.PreallocPages = -1
		if pool, err = vmm.NewPool(ctx, vc); err != nil {
			return nil, err
		}
		closers = append(closers, pool.Close)
		tracker = connector.NewPageTracker(pool)
		g, err := tpgroup.New(ctx, member, tracker, gcfg)
		if err != nil {
			return nil, err
		}
		closers = append(closers, g.Close)
	default:
		tracker = connector.NewPageTracker(nil)
		vc.PageHook = tracker
		if pool, err = vmm.NewPool(ctx, vc); err != nil {
			return nil, err
		}
		closers = append(closers, pool.Close)
	}
	if cfg.limit.set {
		var reserved uint64
		for _, r := range pool.Regions() {
			reserved += r.Len
		}
		b, err := cfg.limit.bytes(reserved)
		if err != nil {
			return nil, codes.New(v1.Code_CODE_INVALID_ARGUMENT, "kvsidecar serve: --memory-limit: %v", err)
		}
		if err := pool.SetMemoryLimit(b); err != nil {
			return nil, err
		}
	}
	rank, err := connector.NewRank(ctx, &connector.Config{
		EngineID: f.engineID, TPRank: f.tpRank, TPSize: f.tpSize, Geometry: req.GetGeometry(), Pool: pool,
		Transfer: &transfer.Config{ListenAddr: f.listen, ServerTLS: srvTLS, ClientTLS: cliTLS,
			ProgressTimeout: f.progressTimeout, StatelessResetKey: cfg.resetKey, QlogDir: f.qlogDir},
		AdvertiseAddr: f.advertise, RankAddrs: cfg.rankAddrs, CapabilitySecret: cfg.secret, Ownership: cfg.ownership,
		LeaseTTL: f.leaseTTL, LoadTimeout: f.loadTimeout, HandshakeMode: cfg.mode, DeviceID: uint32(max(f.device, 0)),
		Logger: log, Registerer: reg,
	})
	if err != nil {
		return nil, err
	}
	log.Info("rank listening", "addr", rank.Addr(), "num_blocks", n, "regions", len(pool.Regions()))
	return &connector.LocalCache{Pool: pool, Rank: rank, Tracker: tracker, Create: req, EngineID: f.engineID,
		DeviceMemory: deviceMemory, Close: func() error {
			var errs []error
			for i := len(closers) - 1; i >= 0; i-- {
				errs = append(errs, closers[i]())
			}
			return errors.Join(errs...)
		}}, nil
}
