package localapi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/fdpass"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// Defaults of ServerConfig and ClientConfig.
const (
	// DefaultMaxRequestBytes bounds one local API request frame (1 MiB:
	// 200,000 block ids).
	DefaultMaxRequestBytes = 1 << 20
	// DefaultMaxReplyBytes bounds one reply frame (64 MiB: about three
	// million page mappings).
	DefaultMaxReplyBytes = 64 << 20
	// DefaultCallTimeout bounds the work of one call on the server.
	DefaultCallTimeout = 30 * time.Second
	// DefaultWriteTimeout bounds writing one reply to a client.
	DefaultWriteTimeout = 10 * time.Second
)

// Cache is the KV cache a Server serves, built by
// ServerConfig.Open for the first CreateKVCache.
type Cache struct {
	// Pool holds the rank's pages. Required.
	Pool *vmm.Pool
	// Rank is the rank's connector over Pool. Required.
	Rank *connector.Rank
	// Tracker sees every map and unmap of Pool (its PageHook, or the
	// TP-group follower wrapper). Required.
	Tracker *PageTracker
	// Create is the request the cache was built for, as resolved: its
	// num_blocks and ownership are the cache's own even when the engine
	// left them 0 and UNSPECIFIED (KVCacheInfo reports them, and the
	// handlers branch on the ownership). A later attach must match its
	// geometry, tp rank and size, and any num_blocks and ownership it names.
	Create *v1.CreateKVCache
	// EngineID is advertised in KVCacheInfo.
	EngineID string
	// DeviceMemory: the pages are CUDA memory (fds per page) rather than
	// ranges of a host memfd.
	DeviceMemory bool
	// Close releases what Open built besides Rank (the pool, the TP group,
	// the backend); called by Server after the rank drained. Optional.
	Close func() error
}

// ServerConfig configures NewServer. Path and Open are required.
type ServerConfig struct {
	// Path is the socket path (see SocketPath). Required. A stale
	// socket there is replaced; a live one is ErrSocketInUse.
	Path string
	// Open builds the KV cache for the first CreateKVCache (validated:
	// geometry present, tp_rank < tp_size). Its error is returned to the
	// engine with its code. Required.
	Open func(ctx context.Context, req *v1.CreateKVCache) (*Cache, error)
	// Geometry, when set, is used for a CreateKVCache that carries none (the
	// sidecar was started with the model's geometry). Default nil: the
	// engine must send one.
	Geometry *v1.ModelGeometry
	// MaxRequestBytes bounds a request frame. Default DefaultMaxRequestBytes.
	MaxRequestBytes int
	// MaxReplyBytes bounds a reply frame. Default DefaultMaxReplyBytes.
	MaxReplyBytes int
	// CallTimeout bounds one call's work. Default DefaultCallTimeout.
	CallTimeout time.Duration
	// WriteTimeout bounds writing one reply. Default DefaultWriteTimeout.
	WriteTimeout time.Duration
	// Logger: default discards.
	Logger *slog.Logger
	// Registerer receives kvsidecar_local_* metrics. Default none.
	Registerer prometheus.Registerer
}

func (c *ServerConfig) withDefaults() (ServerConfig, error) {
	var out ServerConfig
	if c != nil {
		out = *c
	}
	if out.MaxRequestBytes == 0 {
		out.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if out.MaxReplyBytes == 0 {
		out.MaxReplyBytes = DefaultMaxReplyBytes
	}
	if out.CallTimeout == 0 {
		out.CallTimeout = DefaultCallTimeout
	}
	if out.WriteTimeout == 0 {
		out.WriteTimeout = DefaultWriteTimeout
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	bad := func(field, format string, a ...any) (ServerConfig, error) {
		return ServerConfig{}, fmt.Errorf("%w: ServerConfig.%s: %s", ErrInvalidArgument, field, fmt.Sprintf(format, a...))
	}
	switch {
	case out.Path == "":
		return bad("Path", "required")
	case out.Open == nil:
		return bad("Open", "required")
	case out.MaxRequestBytes < 64:
		return bad("MaxRequestBytes", "%d must be at least 64", out.MaxRequestBytes)
	case out.MaxReplyBytes < 64:
		return bad("MaxReplyBytes", "%d must be at least 64", out.MaxReplyBytes)
	case out.CallTimeout < 0 || out.WriteTimeout < 0:
		return bad("CallTimeout", "CallTimeout and WriteTimeout must be positive")
	}
	return out, nil
}

// Server serves the local API (docs/engine-integration.md) of one rank on a
// unix socket: one goroutine per connection, one call at a time per
// connection. Every reply to a connection that attached the cache carries a
// MappingDelta with the fds of pages to map. Bad input gets an error reply,
// or the connection is closed when the stream cannot be resynchronized; it
// never affects other connections.
type Server struct {
	cfg ServerConfig
	ln  *net.UnixListener
	m   *serverMetrics

	ctx    context.Context
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup

	openMu sync.Mutex // serializes Open
	// calls counts the calls being served, until their reply is written.
	calls atomic.Int64

	mu       sync.Mutex
	cache    *Cache
	conns    map[*fdpass.Conn]struct{}
	eng      *engineState
	draining bool
	closed   bool
}

// NewServer listens on cfg.Path (mode 0600; its directory must be
// owned by this user and grant nothing to group or others, or it fails with
// class CODE_INVALID_ARGUMENT) and starts accepting.
func NewServer(ctx context.Context, cfg *ServerConfig) (*Server, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m, err := newServerMetrics(c.Registerer)
	if err != nil {
		return nil, err
	}
	ln, err := unixsock.Listen(ctx, c.Path)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: c, ln: ln, m: m, conns: map[*fdpass.Conn]struct{}{}, eng: newEngineState()}
	s.ctx, s.cancel = context.WithCancelCause(context.WithoutCancel(ctx))
	s.wg.Go(s.acceptLoop)
	c.Logger.Info("local API listening", "path", c.Path)
	return s, nil
}

// Path is the socket path.
func (s *Server) Path() string { return s.cfg.Path }

// Cache returns the KV cache, nil before an engine created it.
func (s *Server) Cache() *Cache {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cache
}

// Ready reports whether an engine session is attached to the KV cache (and
// so the rank's QUIC listener is up) and the server is not draining, and
// says which condition holds: "engine session N attached (engine_id E,
// tp_rank R of tp_size T, C connections), KV cache and QUIC listener up",
// "no KV cache yet (no engine has attached with a create call)", "no engine
// attached: engine session N ended: <why>; a sidecar serves only while its
// engine is attached", "draining: shutting down, new requests are refused"
// or "stopped". A cache outlives its engine sessions, so a cache alone is
// not readiness: a sidecar whose engine left cannot export or load.
func (s *Server) Ready() (ok bool, why string) {
	s.mu.Lock()
	closed, draining, cache := s.closed, s.draining, s.cache
	s.mu.Unlock()
	session, conns, ended := s.eng.status()
	switch {
	case closed:
		return false, "stopped"
	case draining:
		return false, "draining: shutting down, new requests are refused"
	case cache == nil:
		return false, "no KV cache yet (no engine has attached with a create call)"
	case conns == 0:
		return false, fmt.Sprintf("no engine attached: engine session %d ended: %s; a sidecar serves only while its engine is attached",
			session, ended)
	}
	return true, fmt.Sprintf("engine session %d attached (engine_id %s, tp_rank %d of tp_size %d, %d connections), KV cache and QUIC listener up",
		session, cache.EngineID, cache.Create.GetTpRank(), cache.Create.GetTpSize(), conns)
}

func (s *Server) acceptLoop() {
	for {
		uc, err := s.ln.AcceptUnix()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				s.cfg.Logger.Error("local API accept failed", "err", err)
			}
			return
		}
		c := fdpass.New(uc)
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			_ = c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.mu.Unlock()
		s.m.conns.Inc()
		s.wg.Go(func() {
			s.serveConn(c)
			s.mu.Lock()
			delete(s.conns, c)
			s.mu.Unlock()
			_ = c.Close()
			s.m.conns.Dec()
		})
	}
}

// connState is what the server knows about one connection.
type connState struct {
	attached bool
	known    map[int]uint64 // pages the engine mapped -> generation
}

func (s *Server) serveConn(c *fdpass.Conn) {
	r := wire.NewReader(c, s.cfg.MaxRequestBytes)
	st := &connState{known: map[int]uint64{}}
	why := endClosed
	defer func() { s.detach(st, why) }()
	for {
		req := &v1.LocalRequest{}
		err := r.ReadMsg(req)
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
				return
			}
			why = endBadFrame
			var opErr *net.OpError
			if errors.As(err, &opErr) {
				// The engine's end went away (killed with a reply
				// unread, say): the socket failed, no frame was bad. A
				// frame cut short by the end of the stream is a bad one:
				// its sender may still wait for the answer.
				s.cfg.Logger.Info("local API: engine connection lost", "err", err)
				why = endLost
				return
			}
			// The stream cannot be resynchronized after a bad frame: say
			// why, then close.
			s.m.calls.WithLabelValues("bad_frame", v1.Code_CODE_INVALID_ARGUMENT.String()).Inc()
			s.cfg.Logger.Warn("local API: bad frame, closing connection", "err", err)
			s.write(c, &v1.LocalReply{Error: &v1.Error{Code: v1.Code_CODE_INVALID_ARGUMENT,
				Message: fmt.Sprintf("localapi: unreadable request frame (limit %d bytes): %v", s.cfg.MaxRequestBytes, err)}}, nil)
			return
		}
		s.calls.Add(1)
		var rep *v1.LocalReply
		if n := c.DiscardFiles(); n > 0 {
			rep = errorReply(fmt.Errorf("%w: request carried %d file descriptors; requests carry none", ErrInvalidArgument, n))
		} else {
			rep = s.handle(st, req)
		}
		rep.CallId = req.GetCallId()
		var ex *vmm.Export
		if st.attached {
			rep.Mappings, ex = s.delta(st)
		}
		var files []*os.File
		if ex != nil {
			files = ex.Files
		}
		err = s.write(c, rep, files)
		s.calls.Add(-1)
		if ex != nil {
			_ = ex.Close()
		}
		if err != nil {
			s.cfg.Logger.Warn("local API: write failed, closing connection", "err", err)
			why = endWrite
			return
		}
	}
}

func (s *Server) write(c *fdpass.Conn, rep *v1.LocalReply, files []*os.File) error {
	b, err := wire.AppendFrame(nil, rep, s.cfg.MaxReplyBytes)
	if err != nil {
		return err
	}
	_ = c.Unix().SetWriteDeadline(time.Now().Add(s.cfg.WriteTimeout))
	return c.WriteWithFiles(b, files)
}

// Shutdown refuses new requests (create, alloc, RequestFinished and
// StartLoad get CODE_UNAVAILABLE; frees, GetFinished and stats keep
// working), drains the rank (loads in flight finish or are aborted when ctx
// ends; leases are released), waits until the engine took the results of
// those loads with GetFinished (connector.Rank.WaitCollected, also bounded
// by ctx), then closes: listener, connections, cache. The socket file is
// removed.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.draining = true
	cache := s.cache
	s.mu.Unlock()
	var err error
	if cache != nil {
		if derr := cache.Rank.Drain(ctx); derr != nil && !errors.Is(derr, net.ErrClosed) {
			err = derr
		}
		// The engine collects the loads the drain let finish before the
		// socket closes, within the drain's deadline.
		if werr := cache.Rank.WaitCollected(ctx); werr != nil {
			s.cfg.Logger.Warn("drain: closing with load results the engine did not collect", "err", werr)
		}
	}
	// The calls being served (the free that ended the wait) get their
	// replies before the connections close.
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for s.calls.Load() > 0 && ctx.Err() == nil {
		select {
		case <-tick.C:
		case <-ctx.Done():
		}
	}
	return errors.Join(err, s.Close())
}

// Close stops accepting, closes every connection, waits for their
// goroutines, closes the rank and the cache and removes the socket. A second
// Close returns an error wrapping net.ErrClosed.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return fmt.Errorf("localapi: server: %w", net.ErrClosed)
	}
	s.closed = true
	conns := make([]*fdpass.Conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	cache := s.cache
	s.mu.Unlock()
	s.cancel(fmt.Errorf("%w: local server closed", connector.ErrDraining))
	err := s.ln.Close()
	for _, c := range conns {
		_ = c.Unix().Close()
	}
	s.wg.Wait()
	if cache != nil {
		if rerr := cache.Rank.Close(); rerr != nil && !errors.Is(rerr, net.ErrClosed) {
			err = errors.Join(err, rerr)
		}
		err = errors.Join(err, closeCache(cache))
	}
	s.cfg.Logger.Info("local API closed", "path", s.cfg.Path)
	return err
}

func closeCache(c *Cache) error {
	if c.Close == nil {
		return nil
	}
	return c.Close()
}
