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
	"os/signal"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/quic-go/quic-go"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
	"github.com/kvsidecar/kvsidecar/vmm/tpgroup"
)

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

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("serve", "Run the sidecar beside one GPU (one tp_rank) of an inference engine.\n"+
		"Every flag can also be set as KVSIDECAR_<FLAG> (e.g. KVSIDECAR_ENGINE_ID).", stdout)
	var f serveFlags
	f.register(fs.FlagSet)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := applyEnv(fs.FlagSet, os.Getenv); err != nil {
		return err
	}
	f.given = map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { f.given[fl.Name] = true })
	stray := unknownEnv(fs.FlagSet, os.Environ())
	cfg, err := f.validate()
	if err != nil {
		if len(stray) > 0 {
			return fmt.Errorf("%w (ignored, matching no flag: %s)", err, strings.Join(stray, ", "))
		}
		return err
	}
	// With SIGPIPE notified, a log write to a closed stderr pipe fails with
	// EPIPE instead of killing the process (os/signal, "SIGPIPE"), so serve
	// still drains and removes its sockets when its log reader is gone.
	sigpipe := make(chan os.Signal, 1)
	signal.Notify(sigpipe, syscall.SIGPIPE)
	defer signal.Stop(sigpipe)
	log := slog.New(newLogHandler(stderr, cfg.level))
	for _, v := range stray {
		log.Warn("ignoring environment variable that matches no flag", "var", v)
	}
	return serve(ctx, cfg, log)
}

// newLogHandler is serve's JSON log handler at level; durations are written
// as Go duration strings ("30s") rather than integer nanoseconds.
func newLogHandler(w io.Writer, level slog.Level) slog.Handler {
	return slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level, ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Value.Kind() == slog.KindDuration {
			a.Value = slog.StringValue(a.Value.Duration().String())
		}
		return a
	}})
}

// serve checks the environment (TLS files, the capability key file's mode,
// CUDA, the qlog directory, the QUIC socket, the certificate against the CA
// and the advertised address, the local socket), logs "serving", runs until ctx ends
// (SIGTERM/SIGINT/SIGHUP), then drains and returns nil. Problems of the
// flags are usage errors (exit 2); problems of the host are plain errors
// (exit 1); both name the flag.
func serve(ctx context.Context, cfg *serveConfig, log *slog.Logger) error {
	f := &cfg.f
	srvTLS, cliTLS, err := transfer.LoadTLSFiles(f.tlsCA, f.tlsCert, f.tlsKey)
	if err != nil {
		return usageErrorf("--tls-ca/--tls-cert/--tls-key: %v", err)
	}
	if err := checkCA(f.tlsCA); err != nil {
		return usageErrorf("--tls-ca %s: %v", f.tlsCA, err)
	}
	if cfg.resetKey, err = statelessResetKey(f.tlsKey); err != nil {
		return usageErrorf("--tls-key: %v", err)
	}
	if f.capKeyFile != "" {
		if err := checkKeyFileMode("capability-key-file", f.capKeyFile); err != nil {
			return err
		}
	}
	if f.backend == "cuda" {
		// Probe now rather than when the engine creates its KV cache: a
		// device that cannot serve pages fails the start (cuda.New checks).
		be, err := cuda.New(f.cudaConfig())
		if err != nil {
			return fmt.Errorf("--backend cuda --device %d: %w", f.device, err)
		}
		log.Info("cuda driver", "library", be.LibraryPath(), "driver_version", be.DriverVersion(), "device", f.device,
			"granularity_bytes", be.Granularity())
		if err := be.Close(); err != nil {
			return fmt.Errorf("--backend cuda --device %d: %w", f.device, err)
		}
	}
	if f.qlogDir != "" {
		if err := checkWritableDir(f.qlogDir); err != nil {
			return fmt.Errorf("--qlog-dir %s: %w", f.qlogDir, err)
		}
	}
	udp, err := listenQUIC(f.listen, log)
	if err != nil {
		return err
	}
	defer udp.shutdown()
	cfg.udp = udp
	standbyReason := fmt.Sprintf("kvsidecar: engine %q tp_rank %d at %s has no KV cache: no engine is attached to this sidecar (it started or restarted, or its engine's session ended); what it exported before is gone",
		f.engineID, f.tpRank, udp.LocalAddr())
	udp.newStandby = func(pc net.PacketConn) (*transfer.Standby, error) {
		return transfer.NewStandby(&transfer.Config{PacketConn: pc, ServerTLS: srvTLS, StatelessResetKey: cfg.resetKey},
			v1.Code_CODE_UNAVAILABLE, standbyReason)
	}
	_ = udp.Close() // start the standby
	if cfg.advertise, err = advertisedAddr(f, cfg.rankAddrs, udp.LocalAddr()); err != nil {
		return err
	}
	if err := checkCertificate(f.tlsCert, f.tlsCA, hostOf(cfg.advertise), advertisedFrom(f, cfg.rankAddrs), time.Now()); err != nil {
		return err
	}
	if err := os.MkdirAll(f.socketDir, 0o700); err != nil {
		return fmt.Errorf("--socket-dir %s: %w", f.socketDir, err)
	}
	path, err := localapi.SocketPath(f.socketDir, f.engineID, f.tpRank)
	if err != nil {
		return usageErrorf("--socket-dir/--engine-id: %v", err)
	}
	reg := prometheus.NewRegistry()
	bi, _ := debug.ReadBuildInfo()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildInfoGauge(bi))
	// Every family a rank will have, at 0, before an engine attaches, so
	// dashboards show 0 instead of "no data".
	if err := connector.RegisterMetrics(reg); err != nil {
		return err
	}
	if cfg.ownership == v1.Ownership_OWNERSHIP_COORDINATED && f.tpSize > 1 {
		if err := tpgroup.RegisterMetrics(reg, f.tpSize); err != nil {
			return err
		}
	}

	open := func(octx context.Context, req *v1.CreateKVCache) (*localapi.Cache, error) {
		return openCache(octx, cfg, req, srvTLS, cliTLS, log, reg)
	}
	srv, err := localapi.NewServer(ctx, &localapi.ServerConfig{Path: path, Open: open, Geometry: cfg.geometry, Logger: log, Registerer: reg})
	if err != nil {
		return fmt.Errorf("--socket-dir %s: %w", f.socketDir, err)
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
			ok, why := srv.Ready()
			if !ok {
				http.Error(w, "not ready: "+why, http.StatusServiceUnavailable)
				return
			}
			io.WriteString(w, "ready: "+why+"\n")
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
	if cfg.allowed == nil {
		log.Warn("--allow-peers is not set: a load dials any address its kv_transfer_params name, and those can come from a client's request; list the prefill ranks' networks or addresses")
	}
	// The fingerprint of the capability key, never the key: operators
	// compare it across the ranks of an engine.
	keyID := "random per start (no --capability-key-file)"
	if cfg.secret != nil {
		keyID = transfer.NewCapabilityKeyFromSecret(cfg.secret).ID()
	}
	log.Info("serving", "engine_id", f.engineID, "tp_rank", f.tpRank, "tp_size", f.tpSize, "role", f.role,
		"backend", f.backend, "socket", path, "quic_addr", udp.LocalAddr().String(), "advertise", cfg.advertise,
		"capability_key_id", keyID)

	<-ctx.Done()
	log.Info("shutting down: refusing new requests, draining", "drain_timeout", f.drainTimeout)
	udp.stopStandby() // the rank's agent refuses while it drains; then the process exits
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

// sharedUDP is the QUIC socket serve binds at start and lends to the rank's
// transfer agent (transfer.Config.PacketConn). While no agent serves it (no
// engine attached yet, or between engine sessions) a transfer.Standby
// answers on it, so peers that held connections to this address's previous
// process get a stateless reset at once and new dials are refused with a
// reason, instead of sending into an unread socket until their deadlines.
// lend stops the standby; the agent closes what it is given when it stops
// (also when a rank fails to start), and that Close starts the standby
// again. shutdown closes the socket when serve exits. Embedding
// *net.UDPConn keeps the methods quic-go uses for buffer sizes, GSO and ECN.
type sharedUDP struct {
	*net.UDPConn
	// newStandby starts a standby on the socket; nil: none (tests).
	newStandby func(pc net.PacketConn) (*transfer.Standby, error)
	log        *slog.Logger

	mu      sync.Mutex
	standby *transfer.Standby
	closing bool
}

// lend stops the standby and returns the socket for a transfer agent.
func (u *sharedUDP) lend() net.PacketConn {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.standby != nil {
		if err := u.standby.Close(); err != nil {
			u.log.Warn("QUIC standby: close", "err", err)
		}
		u.standby = nil
	}
	return u
}

// Close gives the socket back: the standby answers on it again. It never
// closes the socket (shutdown does), so an engine's retried create gets the
// same one. It returns nil; a standby that cannot start is logged.
func (u *sharedUDP) Close() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.closing || u.standby != nil || u.newStandby == nil {
		return nil
	}
	sb, err := u.newStandby(u)
	if err != nil {
		u.log.Warn("QUIC standby: peers of this address get no answer until an engine attaches", "err", err)
		return nil
	}
	u.standby = sb
	return nil
}

// stopStandby keeps the standby from starting again (serve is draining)
// and stops it.
func (u *sharedUDP) stopStandby() {
	u.mu.Lock()
	u.closing = true
	u.mu.Unlock()
	_ = u.lend()
}

// shutdown stops the standby and closes the socket.
func (u *sharedUDP) shutdown() error {
	u.stopStandby()
	return u.UDPConn.Close()
}

// listenQUIC binds the UDP socket of --listen; log receives the standby's
// problems.
func listenQUIC(addr string, log *slog.Logger) (*sharedUDP, error) {
	pc, err := net.ListenPacket("udp", addr)
	if err != nil {
		var oe *net.OpError
		if errors.As(err, &oe) {
			err = oe.Err // "bind: address already in use", without repeating the address
		}
		return nil, fmt.Errorf("--listen %s: %w", addr, err)
	}
	return &sharedUDP{UDPConn: pc.(*net.UDPConn), log: log}, nil
}

// openCache builds the pool, TP group and rank for the engine's first
// create request, after checking it against the flags.
func openCache(ctx context.Context, cfg *serveConfig, req *v1.CreateKVCache, srvTLS, cliTLS *tls.Config, log *slog.Logger, reg prometheus.Registerer) (c *localapi.Cache, err error) {
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
		return nil, codes.NewReason(v1.Code_CODE_INVALID_ARGUMENT, codes.ReasonNumBlocksRequired,
			"kvsidecar serve: create: num_blocks=%d: the engine or --num-blocks must give at least 2", n)
	}
	// The layout is checked before a device is opened for it.
	if _, err := vmm.LayoutFor(req.GetGeometry(), f.tpRank, f.tpSize); err != nil {
		return nil, codes.New(v1.Code_CODE_INVALID_ARGUMENT, "kvsidecar serve: create: %v", err)
	}
	var be vmm.Backend
	if f.backend == "cuda" {
		if be, err = cuda.New(f.cudaConfig()); err != nil {
			return nil, codes.New(v1.Code_CODE_UNAVAILABLE, "kvsidecar serve: --backend cuda: %v", err)
		}
	}
	sameHost := ""
	if f.sameHost {
		if sameHost, err = connector.SameHostSocketPath(f.socketDir, f.engineID, f.tpRank); err != nil {
			return nil, codes.New(v1.Code_CODE_INVALID_ARGUMENT, "kvsidecar serve: --same-host: %v", err)
		}
	}
	var tracker *localapi.PageTracker
	// Until the rank's agent has the socket, a failure gives it back (the
	// agent closes it itself on its own failures).
	defer func() {
		if err != nil {
			_ = cfg.udp.Close()
		}
	}()
	b, err := connector.BuildRank(ctx, &connector.BuildConfig{NumBlocks: n, Backend: be, Device: f.device, PreallocPages: preallocPages(f.reservePages),
		Group: &tpgroup.Config{Dir: f.socketDir, Logger: log, Registerer: reg},
		Track: func(next vmm.PageHook) vmm.PageHook {
			tracker = localapi.NewPageTracker(next)
			return tracker
		},
		BeforeRank: cfg.applyLimit,
		Rank: connector.Config{
			EngineID: f.engineID, TPRank: f.tpRank, TPSize: f.tpSize, Geometry: req.GetGeometry(),
			Transfer: &transfer.Config{PacketConn: cfg.udp.lend(), ServerTLS: srvTLS, ClientTLS: cliTLS, AllowedPeers: cfg.allowed,
				ProgressTimeout: f.progressTimeout, StatelessResetKey: cfg.resetKey, QlogDir: f.qlogDir, ReadLanes: f.readLanes},
			AdvertiseAddr: cfg.advertise, RankAddrs: cfg.rankAddrs, CapabilitySecret: cfg.secret, Ownership: cfg.ownership,
			LeaseTTL: f.leaseTTL, LoadTimeout: f.loadTimeout, HandshakeMode: cfg.mode, DeviceID: uint32(max(f.device, 0)),
			DisableChecksums: !f.checksums, SameHostSocket: sameHost, SameHostVerifyEvery: verifyEvery(f.sameHostVerifyEvery), Logger: log, Registerer: reg,
		}})
	if err != nil {
		return nil, err
	}
	log.Info("rank listening", "addr", b.Rank.Addr(), "num_blocks", n, "regions", len(b.Pool.Regions()))
	// The cache is what the request resolved to: the block count and the
	// ownership it runs with, whether the engine named them or not (the
	// local API reports them in KVCacheInfo and branches on the ownership).
	created := proto.Clone(req).(*v1.CreateKVCache)
	created.NumBlocks, created.Ownership = uint32(n), cfg.ownership
	return &localapi.Cache{Pool: b.Pool, Rank: b.Rank, Tracker: tracker, Create: created, EngineID: f.engineID,
		DeviceMemory: be != nil, Close: b.Close}, nil
}

// preallocPages is connector.BuildConfig.PreallocPages for --reserve-pages
// n (0 there means none, -1 to vmm).
func preallocPages(n int) int {
	if n == 0 {
		return -1
	}
	return n
}

// verifyEvery is connector.Config.SameHostVerifyEvery for
// --same-host-verify-every n (0 there means none).
func verifyEvery(n int) int {
	if n == 0 {
		return -1
	}
	return n
}

// applyLimit sets --memory-limit on pool, resolved against its page size
// and reservation; a limit that cannot be resolved is CODE_INVALID_ARGUMENT.
func (cfg *serveConfig) applyLimit(pool *vmm.Pool) error {
	if !cfg.limit.set {
		return nil
	}
	var reserved uint64
	regions := pool.Regions()
	for _, r := range regions {
		reserved += r.Len
	}
	b, err := cfg.limit.bytes(regions[0].PageSize*uint64(len(regions)), reserved)
	if err != nil {
		return codes.New(v1.Code_CODE_INVALID_ARGUMENT, "kvsidecar serve: --memory-limit: %v", err)
	}
	return pool.SetMemoryLimit(b)
}
