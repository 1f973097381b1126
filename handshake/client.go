package handshake

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Caller performs one handshake exchange with the agent at addr, on a stream
// of the (cached) transfer connection to it. transfer.Agent implements it.
type Caller interface {
	Handshake(ctx context.Context, addr string, req *v1.HandshakeRequest) (*v1.HandshakeResponse, error)
}

// Mode selects how a dialer learns the remote TP size.
type Mode int

const (
	// ModePiggyback takes tp_size from the request's kv_transfer_params and
	// contacts only the target ranks. The default.
	ModePiggyback Mode = iota
	// ModeLegacy reproduces the behaviour before vLLM carried tp_size in
	// kv_transfer_params: ask remote rank 0 for its metadata (and so the TP
	// size) first, then handshake with the target rank. Kept for the benchmark.
	ModeLegacy
)

func (m Mode) String() string {
	switch m {
	case ModePiggyback:
		return "piggyback"
	case ModeLegacy:
		return "legacy"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// ParseMode parses "piggyback" or "legacy".
func ParseMode(s string) (Mode, error) {
	switch strings.ToLower(s) {
	case "piggyback":
		return ModePiggyback, nil
	case "legacy":
		return ModeLegacy, nil
	}
	return 0, fmt.Errorf("handshake: mode %q: want piggyback or legacy", s)
}

// Target names one remote rank to handshake with.
type Target struct {
	// Expect holds the identity and expectations (engine id, tp_rank,
	// tp_size from kv_transfer_params, model hash, geometry).
	Expect
	// Addr is the QUIC address of rank Expect.TPRank.
	Addr string
	// Rank0Addr is the QUIC address of remote rank 0; used in ModeLegacy only.
	Rank0Addr string
}

// Config configures a Client. A nil *Config is not accepted: Caller is
// required.
type Config struct {
	// Caller performs exchanges. Required.
	Caller Caller
	// Local is this agent's metadata, sent to the peer for its logs.
	// Default: none.
	Local *Metadata
	// Mode: ModePiggyback by default.
	Mode Mode
	// CacheSize is the number of remote ranks whose metadata is cached.
	// Default 1024.
	CacheSize int
	// Timeout bounds one exchange (connection set-up included). Default 10s.
	Timeout time.Duration
	// Logger: default discards.
	Logger *slog.Logger
	// Registerer for metrics; default none.
	Registerer prometheus.Registerer
}

func (c *Config) withDefaults() (Config, error) {
	if c == nil || c.Caller == nil {
		return Config{}, errors.New("handshake: Config.Caller is required")
	}
	out := *c
	if out.CacheSize == 0 {
		out.CacheSize = 1024
	}
	if out.Timeout == 0 {
		out.Timeout = 10 * time.Second
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	switch {
	case out.CacheSize < 0:
		return Config{}, fmt.Errorf("handshake: Config.CacheSize=%d must not be negative", out.CacheSize)
	case out.Timeout < 0:
		return Config{}, fmt.Errorf("handshake: Config.Timeout=%v must not be negative", out.Timeout)
	case out.Mode != ModePiggyback && out.Mode != ModeLegacy:
		return Config{}, fmt.Errorf("handshake: Config.Mode=%d is not a mode", out.Mode)
	}
	return out, nil
}

type peerKey struct {
	engine string
	rank   int
}

// callKey identifies an exchange in flight: only Gets for the same rank at
// the same address share one (a stale and a fresh address of a restarted
// rank must not share the first one's metadata).
type callKey struct {
	peer peerKey
	addr string
}

type inflight struct {
	done chan struct{}
	md   *Metadata
	err  error
}

// Client fetches, validates and caches the metadata of remote ranks.
// Concurrent Gets for one peer share one exchange in flight. It is safe for
// concurrent use.
type Client struct {
	cfg     Config
	cache   *lru.Cache[peerKey, *Metadata]
	metrics *metrics

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu        sync.Mutex
	calls     map[callKey]*inflight
	exchanges map[string]int // addr -> exchanges sent
	closed    bool
}

// NewClient returns a Client; Close stops its exchanges in flight.
func NewClient(cfg *Config) (*Client, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	cache, err := lru.New[peerKey, *Metadata](c.CacheSize)
	if err != nil {
		return nil, fmt.Errorf("handshake: cache: %w", err)
	}
	m, err := newMetrics(c.Registerer)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Client{cfg: c, cache: cache, metrics: m, ctx: ctx, cancel: cancel,
		calls: map[callKey]*inflight{}, exchanges: map[string]int{}}, nil
}

// Mode returns the client's mode.
func (c *Client) Mode() Mode { return c.cfg.Mode }

// Get returns the metadata of rank t.TPRank of engine t.EngineID, from the
// cache when it holds an entry of the expected incarnation at t.Addr, else
// by an exchange (in ModeLegacy preceded by one with remote rank 0 to learn
// the TP size, unless that is cached). The result is checked against
// t.Expect; errors wrap ErrTPMismatch, ErrIncompatible, ErrUnknownEngine,
// ErrInvalidMetadata or the peer's coded error.
func (c *Client) Get(ctx context.Context, t Target) (*Metadata, error) {
	if c.cfg.Mode == ModeLegacy {
		if t.Rank0Addr == "" {
			return nil, fmt.Errorf("handshake: legacy mode needs the address of remote rank 0")
		}
		r0 := Target{Expect: Expect{EngineID: t.EngineID, TPRank: 0, ModelHash: t.ModelHash, Geometry: t.Geometry, Incarnation: t.Incarnation}, Addr: t.Rank0Addr}
		md0, err := c.get(ctx, r0, 0)
		if err != nil {
			return nil, fmt.Errorf("handshake: legacy tp_size query to rank 0: %w", err)
		}
		if t.TPRank == 0 {
			return md0, t.Expect.Check(md0)
		}
		// The legacy path learns tp_size from rank 0 instead of the params.
		t.TPSize = md0.TPSize
		return c.get(ctx, t, md0.TPSize)
	}
	if t.TPSize == 0 {
		return nil, fmt.Errorf("%w: piggyback mode needs tp_size from kv_transfer_params", ErrTPMismatch)
	}
	return c.get(ctx, t, t.TPSize)
}

// get serves t from the cache or one shared exchange that sends
// expectTP as expected_tp_size (0 = ask).
func (c *Client) get(ctx context.Context, t Target, expectTP int) (*Metadata, error) {
	key := peerKey{t.EngineID, t.TPRank}
	if md, ok := c.cache.Get(key); ok && md.Addr == t.Addr && (t.Incarnation == 0 || md.Incarnation == t.Incarnation) {
		c.metrics.cacheHits.Inc()
		return md, t.Expect.Check(md)
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, fmt.Errorf("handshake: client closed: %w", net.ErrClosed)
	}
	ck := callKey{key, t.Addr}
	call, ok := c.calls[ck]
	if !ok {
		call = &inflight{done: make(chan struct{})}
		c.calls[ck] = call
		c.exchanges[t.Addr]++
		c.wg.Add(1)
		go c.exchange(key, ck, call, t, expectTP)
	}
	c.mu.Unlock()
	select {
	case <-call.done:
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	if call.err != nil {
		return nil, call.err
	}
	return call.md, t.Expect.Check(call.md)
}

// exchange runs one handshake detached from any single caller's context, so
// a caller that gives up does not fail the others waiting for the same peer.
func (c *Client) exchange(key peerKey, ck callKey, call *inflight, t Target, expectTP int) {
	defer c.wg.Done()
	start := time.Now()
	ctx, cancel := context.WithTimeout(c.ctx, c.cfg.Timeout)
	md, err := c.fetch(ctx, t, expectTP)
	cancel()
	result := "ok"
	if err != nil {
		result = codes.Of(err).String()
		c.cfg.Logger.Warn("handshake failed", "addr", t.Addr, "engine_id", t.EngineID, "tp_rank", t.TPRank, "err", err)
	} else {
		c.cache.Add(key, md)
		c.cfg.Logger.Debug("handshake done", "addr", t.Addr, "engine_id", md.EngineID, "tp_rank", md.TPRank,
			"tp_size", md.TPSize, "incarnation", md.Incarnation, "seconds", time.Since(start).Seconds())
	}
	c.metrics.seconds.WithLabelValues(c.cfg.Mode.String(), result).Observe(time.Since(start).Seconds())
	c.mu.Lock()
	call.md, call.err = md, err
	delete(c.calls, ck)
	c.mu.Unlock()
	close(call.done)
}

func (c *Client) fetch(ctx context.Context, t Target, expectTP int) (*Metadata, error) {
	req := &v1.HandshakeRequest{
		WireVersion:      WireVersion,
		ExpectedEngineId: t.EngineID,
		ExpectedTpRank:   uint32(t.TPRank),
		ExpectedTpSize:   uint32(expectTP),
	}
	if c.cfg.Local != nil {
		req.Dialer = c.cfg.Local.Proto()
	}
	resp, err := c.cfg.Caller.Handshake(ctx, t.Addr, req)
	if err != nil {
		if ctx.Err() != nil && context.Cause(ctx) != nil {
			return nil, fmt.Errorf("handshake: %s (engine %q tp_rank %d): %w", t.Addr, t.EngineID, t.TPRank, context.Cause(ctx))
		}
		return nil, fmt.Errorf("handshake: %s (engine %q tp_rank %d): %w", t.Addr, t.EngineID, t.TPRank, err)
	}
	if err := codes.FromProto("handshake: "+t.Addr, resp.GetError()); err != nil {
		return nil, err
	}
	md, err := FromProto(resp.GetMetadata())
	if err != nil {
		return nil, fmt.Errorf("handshake: %s: %w", t.Addr, err)
	}
	md.Addr = t.Addr // the address we reached it at is the one cached
	return md, nil
}

// GetAll fetches every target in parallel and returns their metadata in
// order, or the first error (all exchanges are still completed and cached).
func (c *Client) GetAll(ctx context.Context, ts []Target) ([]*Metadata, error) {
	out := make([]*Metadata, len(ts))
	errs := make([]error, len(ts))
	var wg sync.WaitGroup
	for i := range ts {
		wg.Go(func() { out[i], errs[i] = c.Get(ctx, ts[i]) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return out, nil
}

// Forget drops every cached entry reached at addr; call it when the
// connection to addr is lost (the peer may come back as a new incarnation).
func (c *Client) Forget(addr string) {
	for _, k := range c.cache.Keys() {
		if md, ok := c.cache.Peek(k); ok && md.Addr == addr {
			c.cache.Remove(k)
		}
	}
}

// Exchanges returns how many exchanges this client sent to addr.
func (c *Client) Exchanges(addr string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.exchanges[addr]
}

// Close cancels exchanges in flight and waits for them. A second Close
// returns an error wrapping net.ErrClosed.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return fmt.Errorf("handshake: client already closed: %w", net.ErrClosed)
	}
	c.closed = true
	c.mu.Unlock()
	c.cancel()
	c.wg.Wait()
	return nil
}
