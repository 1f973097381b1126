package demo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Defaults of HandshakeConfig.
const (
	// DefaultRTT is the injected round-trip time: a cross-rack datacenter
	// figure, large against loopback's microseconds so RTTs dominate.
	DefaultRTT = 20 * time.Millisecond
	// DefaultTrials per mode; the medians are reported.
	DefaultTrials = 5
)

// HandshakeConfig configures RunHandshakeBench. The zero value (and nil)
// measures DefaultModel, prefill TP 2 → decode TP 4 at DefaultRTT.
type HandshakeConfig struct {
	// Model is a name of kvgeom.ModelNames(). Default DefaultModel.
	Model string
	// PrefillTP and DecodeTP. Defaults DefaultPrefillTP, DefaultDecodeTP.
	PrefillTP, DecodeTP int
	// RTT is injected as a one-way delay of RTT/2 on every socket of both
	// instances. Default DefaultRTT; it must be at least 1 ms.
	RTT time.Duration
	// Trials per mode. Default DefaultTrials.
	Trials int
	// Logger receives the ranks' logs. Default nil: discard.
	Logger *slog.Logger

	// sim, set by tests, runs both instances on a simulated network with
	// a one-way delay of RTT/2 (under testing/synctest the figures are
	// exact) instead of delaying loopback UDP.
	sim packetNet
}

// HandshakeModeResult holds one mode's medians, one entry per decode rank.
type HandshakeModeResult struct {
	// TargetRanks: the first prefill rank each decode rank reads from.
	TargetRanks []int `json:"target_ranks"`
	// FirstContact: a decode rank's first handshake with its targets (QUIC
	// dial and metadata exchange; in legacy mode preceded by the query to
	// prefill rank 0). Cached: the same again, served from the cache.
	// Reconnect0RTT: after the connections were closed and the cache
	// dropped, with the TLS session tickets kept (0-RTT).
	FirstContactMs   []float64 `json:"first_contact_ms"`
	CachedMs         []float64 `json:"cached_ms"`
	Reconnect0RTTMs  []float64 `json:"reconnect_0rtt_ms"`
	FirstContactRTT  []float64 `json:"first_contact_rtt"`
	CachedRTT        []float64 `json:"cached_rtt"`
	Reconnect0RTTRTT []float64 `json:"reconnect_0rtt_rtt"`
	// ZeroRTTTrials: trials whose reconnect the server accepted in 0-RTT,
	// as the dialer's connection state reports it.
	ZeroRTTTrials []int `json:"zero_rtt_trials"`
	// First KV byte of a one-block load, from StartLoad until its first
	// byte is in the decode rank's memory
	// (kvsidecar_connector_load_first_byte_seconds), on fresh instances:
	// from a prefill rank never contacted (new peer: QUIC and TLS, then
	// the READ), again on the warm connection with the metadata cached,
	// and after the connections were closed and the cache dropped, with
	// the session tickets kept (returning peer: the READ in 0-RTT).
	FirstKVByteMs        []float64 `json:"first_kv_byte_ms"`
	FirstKVByteRTT       []float64 `json:"first_kv_byte_rtt"`
	FirstKVByteCachedMs  []float64 `json:"first_kv_byte_cached_ms"`
	FirstKVByteCachedRTT []float64 `json:"first_kv_byte_cached_rtt"`
	FirstKVByte0RTTMs    []float64 `json:"first_kv_byte_0rtt_ms"`
	FirstKVByte0RTTRTT   []float64 `json:"first_kv_byte_0rtt_rtt"`
	// FirstKVByte0RTTTrials: trials whose returning-peer load the server
	// accepted in 0-RTT.
	FirstKVByte0RTTTrials      []int `json:"first_kv_byte_0rtt_trials"`
	fbFirst, fbCached, fbAgain [][]time.Duration
	trialFirst                 [][]time.Duration
	trialCached                [][]time.Duration
	trialReconnect             [][]time.Duration
}

// HandshakeResult is the outcome of RunHandshakeBench; JSON names are
// stable (the CLI's --json prints it).
type HandshakeResult struct {
	Model     string  `json:"model"`
	PrefillTP int     `json:"prefill_tp"`
	DecodeTP  int     `json:"decode_tp"`
	RTTMs     float64 `json:"rtt_ms"`
	Trials    int     `json:"trials"`
	// Modes: "piggyback" and "legacy".
	Modes map[string]*HandshakeModeResult `json:"modes"`
}

func (c *HandshakeConfig) withDefaults() (HandshakeConfig, error) {
	var out HandshakeConfig
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
	if out.RTT == 0 {
		out.RTT = DefaultRTT
	}
	if out.Trials == 0 {
		out.Trials = DefaultTrials
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	bad := func(field, format string, a ...any) (HandshakeConfig, error) {
		return HandshakeConfig{}, fmt.Errorf("%w: HandshakeConfig.%s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, a...))
	}
	switch {
	case out.RTT < time.Millisecond:
		return bad("RTT", "%v must be at least 1ms", out.RTT)
	case out.Trials < 1:
		return bad("Trials", "%d must be at least 1", out.Trials)
	case out.PrefillTP < 1 || out.PrefillTP > connector.MaxTPSize:
		return bad("PrefillTP", "%d must be in [1, %d]", out.PrefillTP, connector.MaxTPSize)
	case out.DecodeTP < 1 || out.DecodeTP > connector.MaxTPSize:
		return bad("DecodeTP", "%d must be in [1, %d]", out.DecodeTP, connector.MaxTPSize)
	}
	return out, nil
}

// RunHandshakeBench measures, in piggyback and in legacy mode, each decode
// rank's first contact with its prefill targets, a cached lookup and a
// 0-RTT reconnect, over sockets that delay every datagram by RTT/2. Each
// trial uses fresh instances, so no ticket or cache survives it.
func RunHandshakeBench(ctx context.Context, cfg *HandshakeConfig) (*HandshakeResult, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	geom, err := kvgeom.Model(c.Model)
	if err != nil {
		return nil, fmt.Errorf("%w: HandshakeConfig.Model: %w", ErrInvalidConfig, err)
	}
	shape, err := connector.ShapeOf(geom)
	if err != nil {
		return nil, err
	}
	plans := make([]connector.Plan, c.DecodeTP)
	for d := range plans {
		if plans[d], err = connector.PlanRank(shape, c.PrefillTP, c.DecodeTP, d); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
	}
	ca, err := devtls.NewCA()
	if err != nil {
		return nil, err
	}
	srv, err := ca.ServerConfig()
	if err != nil {
		return nil, err
	}
	cli, err := ca.ClientConfig()
	if err != nil {
		return nil, err
	}
	res := &HandshakeResult{Model: geom.GetModel(), PrefillTP: c.PrefillTP, DecodeTP: c.DecodeTP,
		RTTMs: float64(c.RTT) / float64(time.Millisecond), Trials: c.Trials, Modes: map[string]*HandshakeModeResult{}}
	base := instanceOpts{geom: geom, numBlocks: 2, delay: c.RTT / 2, sim: c.sim, srvTLS: srv, cliTLS: cli, logger: c.Logger}
	for _, mode := range []handshake.Mode{handshake.ModePiggyback, handshake.ModeLegacy} {
		mr := &HandshakeModeResult{}
		for d := range c.DecodeTP {
			mr.TargetRanks = append(mr.TargetRanks, plans[d].Sources[0].PrefillRank)
		}
		for range c.Trials {
			if err := hsTrial(ctx, base, mode, c, geom, plans, mr); err != nil {
				return nil, fmt.Errorf("demo: handshake bench, %s mode: %w", mode, err)
			}
			if err := fbTrial(ctx, base, mode, c, mr); err != nil {
				return nil, fmt.Errorf("demo: handshake bench, %s mode, first KV byte: %w", mode, err)
			}
		}
		mr.summarize(res.RTTMs)
		res.Modes[mode.String()] = mr
	}
	return res, nil
}

// hsTrial starts a prefill and a decode instance and measures every decode
// rank in turn (one at a time, so they do not share the CPU).
func hsTrial(ctx context.Context, base instanceOpts, mode handshake.Mode, c HandshakeConfig, geom *v1.ModelGeometry,
	plans []connector.Plan, mr *HandshakeModeResult) (err error) {
	po := base
	po.engine, po.side, po.tp = "bench-prefill", "prefill", c.PrefillTP
	pre, err := newInstance(ctx, po)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pre.close()) }()
	do := base
	do.engine, do.side, do.tp, do.mode = "bench-decode", "decode", c.DecodeTP, mode
	dec, err := newInstance(ctx, do)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, dec.close()) }()
	first, cached, again := make([]time.Duration, c.DecodeTP), make([]time.Duration, c.DecodeTP), make([]time.Duration, c.DecodeTP)
	for d, rk := range dec.ranks {
		var ts []handshake.Target
		for _, s := range plans[d].Sources {
			ts = append(ts, handshake.Target{Expect: handshake.Expect{EngineID: po.engine, TPRank: s.PrefillRank,
				TPSize: c.PrefillTP, ModelHash: handshake.ModelHash(geom), NumRegions: len(dec.pools[d].Regions()),
				BlockLen: plans[d].RemoteBlockLen}, Addr: pre.addrs[s.PrefillRank], Rank0Addr: pre.addrs[0]})
		}
		timed := func() (time.Duration, error) {
			t0 := time.Now()
			_, err := rk.Handshakes().GetAll(ctx, ts)
			return time.Since(t0), err
		}
		if first[d], err = timed(); err != nil {
			return err
		}
		if cached[d], err = timed(); err != nil {
			return err
		}
		// Close every connection this rank dialed and drop the cache; the
		// session tickets stay, so the next dial sends the exchange in 0-RTT.
		for _, a := range pre.addrs {
			rk.Agent().Disconnect(a)
			rk.Handshakes().Forget(a)
		}
		if again[d], err = timed(); err != nil {
			return err
		}
		info, err := rk.Agent().PeerInfo(ctx, ts[0].Addr)
		if err != nil {
			return err
		}
		if len(mr.ZeroRTTTrials) < c.DecodeTP {
			mr.ZeroRTTTrials = make([]int, c.DecodeTP)
		}
		if info.Used0RTT {
			mr.ZeroRTTTrials[d]++
		}
	}
	mr.trialFirst = append(mr.trialFirst, first)
	mr.trialCached = append(mr.trialCached, cached)
	mr.trialReconnect = append(mr.trialReconnect, again)
	return nil
}

// fbTrial starts a prefill and a decode instance and measures, for every
// decode rank in turn, the first KV byte of a one-block load from a new
// peer, from the same peer again (cached), and after a reconnect in 0-RTT.
func fbTrial(ctx context.Context, base instanceOpts, mode handshake.Mode, c HandshakeConfig, mr *HandshakeModeResult) (err error) {
	po := base
	po.engine, po.side, po.tp, po.numBlocks = "bench-prefill", "prefill", c.PrefillTP, 4*c.DecodeTP
	pre, err := newInstance(ctx, po)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pre.close()) }()
	reg := prometheus.NewRegistry()
	do := base
	do.engine, do.side, do.tp, do.mode, do.numBlocks, do.reg = "bench-decode", "decode", c.DecodeTP, mode, 4*c.DecodeTP, reg
	dec, err := newInstance(ctx, do)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, dec.close()) }()
	first, cached, again := make([]time.Duration, c.DecodeTP), make([]time.Duration, c.DecodeTP), make([]time.Duration, c.DecodeTP)
	if len(mr.FirstKVByte0RTTTrials) < c.DecodeTP {
		mr.FirstKVByte0RTTTrials = make([]int, c.DecodeTP)
	}
	for d, rk := range dec.ranks {
		load := func(id string) (time.Duration, error) {
			return firstByteLoad(ctx, pre, dec, d, reg, id)
		}
		if first[d], err = load(fmt.Sprintf("new-%d", d)); err != nil {
			return err
		}
		if cached[d], err = load(fmt.Sprintf("cached-%d", d)); err != nil {
			return err
		}
		for _, a := range pre.addrs {
			rk.Agent().Disconnect(a)
			rk.Handshakes().Forget(a)
		}
		if again[d], err = load(fmt.Sprintf("again-%d", d)); err != nil {
			return err
		}
		for _, a := range pre.addrs {
			if info, err := rk.Agent().PeerInfo(ctx, a); err == nil && info.Used0RTT {
				mr.FirstKVByte0RTTTrials[d]++
				break
			}
		}
	}
	mr.fbFirst = append(mr.fbFirst, first)
	mr.fbCached = append(mr.fbCached, cached)
	mr.fbAgain = append(mr.fbAgain, again)
	return nil
}

// firstByteLoad exports one block under request id from every prefill rank,
// loads it on decode rank d alone and returns its time to first KV byte:
// what the load added to kvsidecar_connector_load_first_byte_seconds in
// reg (only one load runs at a time).
func firstByteLoad(ctx context.Context, pre, dec *instance, d int, reg *prometheus.Registry, id string) (time.Duration, error) {
	pids, err := pre.alloc(ctx, 1)
	if err != nil {
		return 0, err
	}
	var parts []*v1.KVTransferParams
	for r, rk := range pre.ranks {
		p, err := rk.RequestFinished(ctx, id, pids, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		if err != nil {
			return 0, fmt.Errorf("prefill rank %d RequestFinished: %w", r, err)
		}
		parts = append(parts, p)
	}
	params, err := connector.MergeExports(parts...)
	if err != nil {
		return 0, err
	}
	dids, err := dec.alloc(ctx, 1)
	if err != nil {
		return 0, err
	}
	before, err := firstByteSum(reg)
	if err != nil {
		return 0, err
	}
	rk := dec.ranks[d]
	if err := rk.StartLoad(ctx, &v1.ReqMeta{RequestId: id, LocalBlockIds: dids, Params: params, RemoteHitBlocks: new(uint32(0))}); err != nil {
		return 0, fmt.Errorf("decode rank %d StartLoad: %w", d, err)
	}
	for done := false; !done; {
		f, err := rk.WaitFinished(ctx)
		if err != nil {
			return 0, err
		}
		done = slices.Contains(f.DoneRecving, id)
		for _, fl := range f.Failed {
			if fl.RequestID == id {
				return 0, fmt.Errorf("decode rank %d load %q: %w", d, id, fl.Err)
			}
		}
	}
	after, err := firstByteSum(reg)
	return time.Duration((after - before) * float64(time.Second)), err
}

// firstByteSum is the sample sum of kvsidecar_connector_load_first_byte_seconds in reg.
func firstByteSum(reg *prometheus.Registry) (float64, error) {
	mfs, err := reg.Gather()
	if err != nil {
		return 0, err
	}
	for _, mf := range mfs {
		if mf.GetName() == "kvsidecar_connector_load_first_byte_seconds" {
			return mf.GetMetric()[0].GetHistogram().GetSampleSum(), nil
		}
	}
	return 0, errors.New("demo: kvsidecar_connector_load_first_byte_seconds is not registered")
}

// summarize fills the per-rank medians from the trials.
func (mr *HandshakeModeResult) summarize(rttMs float64) {
	med := func(trials [][]time.Duration) (ms, rtt []float64) {
		for d := range trials[0] {
			var xs []time.Duration
			for _, t := range trials {
				xs = append(xs, t[d])
			}
			slices.Sort(xs)
			m := float64(xs[(len(xs)-1)/2]) / float64(time.Millisecond)
			ms, rtt = append(ms, round(m, 3)), append(rtt, round(m/rttMs, 2))
		}
		return ms, rtt
	}
	mr.FirstContactMs, mr.FirstContactRTT = med(mr.trialFirst)
	mr.CachedMs, mr.CachedRTT = med(mr.trialCached)
	mr.Reconnect0RTTMs, mr.Reconnect0RTTRTT = med(mr.trialReconnect)
	mr.FirstKVByteMs, mr.FirstKVByteRTT = med(mr.fbFirst)
	mr.FirstKVByteCachedMs, mr.FirstKVByteCachedRTT = med(mr.fbCached)
	mr.FirstKVByte0RTTMs, mr.FirstKVByte0RTTRTT = med(mr.fbAgain)
}

func round(x float64, digits int) float64 {
	p := 1.0
	for range digits {
		p *= 10
	}
	return float64(int64(x*p+0.5)) / p
}
