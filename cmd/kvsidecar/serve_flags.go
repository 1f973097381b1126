package main

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
)

// serveFlags are the flags of `kvsidecar serve`; each can also be set by
// the environment variable KVSIDECAR_<FLAG> (upper case, '-' as '_'); a flag
// on the command line wins.
type serveFlags struct {
	engineID, role, ownership, backend, model, dtype, attention string
	cudaLibrary, kvLayout                                       string
	tpRank, tpSize, device, layers, kvHeads, headDim, blockSize int
	numBlocks, readLanes, sameHostVerifyEvery, reservePages     int
	memoryLimit, listen, advertise, rankAddrs, allowPeers       string
	tlsCert, tlsKey, tlsCA, capKeyFile, socketDir, metricsAddr  string
	qlogDir, logLevel, handshakeMode                            string
	leaseTTL, drainTimeout, loadTimeout, progressTimeout        time.Duration
	checksums                                                   bool
	sameHost                                                    onOff

	// given holds the names of the flags set explicitly, on the command
	// line or through KVSIDECAR_<FLAG> (flag.FlagSet.Visit after applyEnv).
	given map[string]bool
}

// geometryFlags are the flags of an explicit geometry; --model fixes all of
// them, so none may be given with it.
var geometryFlags = []string{"layers", "kv-heads", "head-dim", "dtype", "attention"}

func (f *serveFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.engineID, "engine-id", "", "engine instance id, shared by its ranks (required)")
	fs.StringVar(&f.role, "role", "both", "prefill, decode or both (informational: every sidecar can export and import)")
	fs.IntVar(&f.tpRank, "tp-rank", 0, "this sidecar's tensor-parallel rank, in [0, tp-size)")
	fs.IntVar(&f.tpSize, "tp-size", 0, "the engine's tensor-parallel size (required, never defaulted)")
	fs.StringVar(&f.ownership, "ownership", "local", "who allocates and frees blocks: local (each rank drives its pool: SGLang, vLLM staging) or coordinated (rank 0 for the group, as vLLM's ranks share block ids: vLLM zero copy)")
	fs.StringVar(&f.backend, "backend", "host", "page backend: host (memfd) or cuda")
	fs.IntVar(&f.device, "device", 0, "CUDA device ordinal (cuda backend only)")
	fs.StringVar(&f.cudaLibrary, "cuda-library", cuda.DefaultLibrary, "CUDA driver library to dlopen, a name the dynamic loader finds or a path (cuda backend only)")
	fs.StringVar(&f.model, "model", "", "model geometry by name ("+strings.Join(kvgeom.ModelNames(), ", ")+"); or set --layers, --kv-heads, --head-dim, --dtype; or neither to take the engine's")
	fs.IntVar(&f.layers, "layers", 0, "explicit geometry: num_hidden_layers")
	fs.IntVar(&f.kvHeads, "kv-heads", 0, "explicit geometry: num_key_value_heads (before the TP split)")
	fs.IntVar(&f.headDim, "head-dim", 0, "explicit geometry: head_dim")
	fs.StringVar(&f.dtype, "dtype", "bfloat16", "explicit geometry: float16, bfloat16, float32, fp8_e4m3 or fp8_e5m2")
	fs.StringVar(&f.attention, "attention", "gqa", "explicit geometry: gqa or mla")
	fs.StringVar(&f.kvLayout, "kv-layout", "HND", "layout of a block, with --model or the explicit geometry: HND (a K and a V region per layer), H2ND (one region per layer, each head's K then V: vLLM's CPU backend, for zero copy) or HN2D (one region per layer, each token's K then V: vLLM's FlashAttention with LBHNC)")
	fs.IntVar(&f.blockSize, "block-size", kvgeom.DefaultBlockSize, "tokens per KV block")
	fs.IntVar(&f.numBlocks, "num-blocks", 0, "blocks per region (0: the engine's create request decides)")
	fs.IntVar(&f.reservePages, "reserve-pages", vmm.DefaultPreallocPages, "page indices (one page of every region each) kept mapped with no block allocated, refilled in the background, so an allocation that needs new pages takes them without waiting for the backend to map them (zero copy: vLLM's scheduler allocates on the request's path); they count toward --memory-limit; 0: none (ranks 1..N-1 under coordinated ownership keep none: rank 0 maps their pages)")
	fs.StringVar(&f.memoryLimit, "memory-limit", "", "limit on mapped bytes: bytes with a unit (8GiB, 512MiB) or a percent of the reservation (50%); empty: none")
	fs.StringVar(&f.listen, "listen", "127.0.0.1:0", "QUIC listen address host:port")
	fs.StringVar(&f.advertise, "advertise", "", "address peers reach this rank at (default: the listen address)")
	fs.StringVar(&f.rankAddrs, "rank-addrs", "", "comma-separated advertised address of every rank, index tp_rank; entry --tp-rank must be this rank's advertised address (default: rank r at port - tp-rank + r, which needs a fixed --listen port when --tp-size > 1)")
	fs.StringVar(&f.allowPeers, "allow-peers", "", "comma-separated CIDR prefixes (10.0.0.0/8), IP addresses and host:port entries this sidecar may dial; an address from kv_transfer_params outside them gets no packet (empty: any address, with a warning at start)")
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
	fs.IntVar(&f.readLanes, "read-lanes", transfer.DefaultReadLanes(runtime.NumCPU()), fmt.Sprintf("QUIC connections, each from its own UDP socket, that one READ of 1 MiB or more is striped over, in [1, %d] (default: one per CPU, at most 4)", transfer.MaxReadLanes))
	fs.DurationVar(&f.drainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM/SIGINT/SIGHUP, how long in-flight transfers may take before they are aborted")
	f.sameHost = true
	fs.Var(&f.sameHost, "same-host", "on or off: offer this rank's pages to sidecars on the same host on a unix socket in --socket-dir, and read from a prefill rank on this host (its metadata says so) through its socket, mapping its pages, instead of over QUIC; off: every READ goes over QUIC")
	fs.IntVar(&f.sameHostVerifyEvery, "same-host-verify-every", connector.DefaultSameHostVerifyEvery, "a decode rank reading through the same-host path verifies the checksums of one block in N (which ones chosen anew per load; a mismatch recomputes the whole load), 1 for every block, 0 for none; over QUIC every block is verified")
	fs.BoolVar(&f.checksums, "checksums", true, "record a CRC-32C per exported block and KV head when a request finishes, carried in its kv_transfer_params for the decode to check (a request's kv_transfer_params \"checksums\" overrides it); a decode always checks the checksums an export carries")
}

// onOff is a boolean flag that also takes "on" and "off" (--same-host=off);
// given bare it is on.
type onOff bool

func (o *onOff) String() string {
	if o != nil && bool(*o) {
		return "on"
	}
	return "off"
}

func (o *onOff) Set(v string) error {
	switch strings.ToLower(v) {
	case "on", "true", "1":
		*o = true
	case "off", "false", "0":
		*o = false
	default:
		return fmt.Errorf("%q: want on or off", v)
	}
	return nil
}

// IsBoolFlag lets the flag be given bare (--same-host).
func (o *onOff) IsBoolFlag() bool { return true }

// cudaConfig is the cuda backend's configuration from the flags.
func (f *serveFlags) cudaConfig() *cuda.Config {
	return &cuda.Config{Device: f.device, Library: f.cudaLibrary}
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
		env := envName(f.Name)
		if v := getenv(env); v != "" {
			if serr := fs.Set(f.Name, v); serr != nil {
				err = usageErrorf("%s=%q (for --%s): %v", env, v, f.Name, serr)
			}
		}
	})
	return err
}

// envName is the environment variable of flag name: KVSIDECAR_<NAME>, upper
// case, '-' as '_'.
func envName(name string) string {
	return "KVSIDECAR_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// otherEnv are KVSIDECAR_* variables read by the tests and tools rather than
// by serve's flags; unknownEnv does not report them.
var otherEnv = map[string]bool{
	"KVSIDECAR_TIME_SCALE": true, "KVSIDECAR_E2E_RACE": true, "KVSIDECAR_REQUIRE_GPU": true, "KVSIDECAR_TPGROUP_CHILD": true,
	"KVSIDECAR_REQUIRE_PYTHON": true, "KVSIDECAR_BIN": true, // make test-python
	"KVSIDECAR_REQUIRE_FAKECUDA": true, // vmm/cuda/cudatest
}

// unknownEnv returns, sorted, a description of every KVSIDECAR_* variable in
// environ ("NAME=VALUE" entries, as os.Environ) that matches no flag of fs,
// with the flag variable it most likely meant: the one whose name, compared
// in upper case without underscores, is nearest within maxEnvDistance edits
// (KVSIDECAR_TPSIZE: did you mean KVSIDECAR_TP_SIZE?; KVSIDECAR_LEASE_TTLL:
// did you mean KVSIDECAR_LEASE_TTL?).
func unknownEnv(fs *flag.FlagSet, environ []string) []string {
	var known []string
	fs.VisitAll(func(f *flag.Flag) { known = append(known, envName(f.Name)) })
	squash := func(s string) string { return strings.ReplaceAll(strings.ToUpper(s), "_", "") }
	var out []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, "KVSIDECAR_") || otherEnv[name] || slices.Contains(known, name) {
			continue
		}
		best, bestD := "", maxEnvDistance+1
		for _, e := range known {
			if d := editDistance(squash(name), squash(e)); d < bestD {
				best, bestD = e, d
			}
		}
		if best != "" {
			out = append(out, fmt.Sprintf("%s (did you mean %s?)", name, best))
		} else {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// maxEnvDistance is the most edits (insertions, deletions, substitutions)
// between a stray KVSIDECAR_* name and a flag's variable for unknownEnv to
// suggest the flag: two catches a doubled, dropped, swapped or wrong letter.
const maxEnvDistance = 2

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			sub := prev[j-1]
			if a[i-1] != b[j-1] {
				sub++
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, sub)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
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
	// allowed is --allow-peers; nil: any address.
	allowed *transfer.AllowedPeers
	// resetKey is derived from --tls-key (statelessResetKey).
	resetKey *quic.StatelessResetKey
	// udp is the QUIC socket bound at start; advertise is the address peers
	// reach it at (advertisedAddr). Set by serve.
	udp       *sharedUDP
	advertise string
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
		if f.given["cuda-library"] {
			return bad("cuda-library", "%q: only the cuda backend loads a driver", f.cudaLibrary)
		}
	case "cuda":
		if f.device < 0 {
			return bad("device", "%d: must be >= 0", f.device)
		}
	default:
		return bad("backend", "%q: want host or cuda", f.backend)
	}
	var explicit []string
	for _, name := range geometryFlags {
		if f.given[name] {
			explicit = append(explicit, "--"+name)
		}
	}
	switch {
	case f.model != "" && len(explicit) > 0:
		return bad("model", "%q fixes the geometry; drop %s (or drop --model and give --layers, --kv-heads, --head-dim)",
			f.model, strings.Join(explicit, ", "))
	case f.model != "":
		g, err := kvgeom.Model(f.model)
		if err != nil {
			return bad("model", "unknown %q; known: %s", f.model, strings.Join(kvgeom.ModelNames(), ", "))
		}
		g.BlockSize = uint32(f.blockSize)
		c.geometry = g
	case len(explicit) > 0 || f.layers != 0 || f.kvHeads != 0 || f.headDim != 0:
		g, err := explicitGeometry(f)
		if err != nil {
			return nil, err
		}
		c.geometry = g
	}
	layout, ok := map[string]v1.Layout{"HND": v1.Layout_LAYOUT_HND, "H2ND": v1.Layout_LAYOUT_H2ND, "HN2D": v1.Layout_LAYOUT_HN2D}[f.kvLayout]
	switch {
	case !ok:
		return bad("kv-layout", "%q: want HND, H2ND or HN2D", f.kvLayout)
	case c.geometry != nil:
		c.geometry.Layout = layout
	case f.given["kv-layout"]:
		return bad("kv-layout", "%q needs a geometry: give --model or --layers, --kv-heads, --head-dim (without one the engine's create call names the layout)", f.kvLayout)
	}
	if f.blockSize < 1 || f.blockSize > vmm.MaxBlockSize {
		return bad("block-size", "%d: must be in [1, %d]", f.blockSize, vmm.MaxBlockSize)
	}
	if c.geometry != nil {
		if err := checkGeometryFlags(f, c.geometry); err != nil {
			return nil, err
		}
	}
	if f.numBlocks < 0 || f.numBlocks == 1 {
		return bad("num-blocks", "%d: must be 0 (the engine decides) or at least 2", f.numBlocks)
	}
	if f.reservePages < 0 {
		return bad("reserve-pages", "%d: must be 0 (no reserve) or more", f.reservePages)
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
		if addrPort(f.advertise) == 0 {
			return bad("advertise", "%q: port 0 cannot be dialed; give the port peers reach --listen at", f.advertise)
		}
		if wildcardHost(f.advertise) {
			return bad("advertise", "%q: a wildcard host cannot be dialed; give the host peers reach this rank at", f.advertise)
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
			if wildcardHost(a) {
				return bad("rank-addrs", "[%d]=%q: a wildcard host cannot be dialed; give the host peers reach rank %d at", i, a, i)
			}
			for j, b := range c.rankAddrs[:i] {
				if sameAddr(a, b) {
					return bad("rank-addrs", "[%d]=%q and [%d]=%q are the same address; every rank needs its own", j, b, i, a)
				}
			}
		}
	}
	if f.advertise == "" && len(c.rankAddrs) == 0 && wildcardHost(f.listen) {
		return bad("advertise", "required when --listen=%s has a wildcard host: peers cannot dial it; give the address they reach this rank at "+
			"(e.g. --advertise 10.0.0.5:%d), or every rank's with --rank-addrs", f.listen, addrPort(f.listen))
	}
	if f.allowPeers != "" {
		ap, err := transfer.ParseAllowedPeers("--allow-peers", f.allowPeers)
		if err != nil {
			return bad("allow-peers", "%s", strings.TrimPrefix(err.Error(), "transfer: --allow-peers: "))
		}
		c.allowed = ap
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
	if f.tpSize > 1 && len(c.rankAddrs) == 0 && f.role != "decode" {
		name, a := "listen", f.listen
		if f.advertise != "" {
			name, a = "advertise", f.advertise
		}
		if addrPort(a) == 0 {
			return bad("rank-addrs", "required when --tp-size=%d > 1 and --%s=%s has port 0: without it rank r is found at "+
				"port - tp-rank + r, which a port the kernel picks cannot give; list every rank's address or listen on a fixed port "+
				"(a --role decode sidecar, which peers never look up, may use port 0)", f.tpSize, name, a)
		}
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
	if f.sameHostVerifyEvery < 0 {
		return bad("same-host-verify-every", "%d: must be >= 0 (0: none)", f.sameHostVerifyEvery)
	}
	if f.readLanes < 1 || f.readLanes > transfer.MaxReadLanes {
		return bad("read-lanes", "%d: must be in [1, %d]", f.readLanes, transfer.MaxReadLanes)
	}
	m, err := handshake.ParseMode(f.handshakeMode)
	if err != nil {
		return bad("handshake-mode", "%v", err)
	}
	c.mode = m
	return c, nil
}

// geometryFlag is the serve flag of each ModelGeometry field (and of the
// TP fields) that vmm.GeometryError names.
var geometryFlag = map[string]string{
	"num_layers": "--layers", "num_kv_heads": "--kv-heads", "head_dim": "--head-dim", "dtype": "--dtype",
	"attention": "--attention", "block_size": "--block-size", "tp_size": "--tp-size", "tp_rank": "--tp-rank",
	"layout": "--kv-layout",
}

// checkGeometryFlags applies the rules of vmm.LayoutFor (the same ones an
// engine's create call meets) to the geometry of the flags, and checks that
// one block fits in a page of the host backend. A broken rule is a usage
// error naming the flags: the geometry flags themselves, or --model when the
// field comes from the model table.
func checkGeometryFlags(f *serveFlags, g *v1.ModelGeometry) error {
	l, err := vmm.LayoutFor(g, f.tpRank, f.tpSize)
	var ge *vmm.GeometryError
	if errors.As(err, &ge) {
		var names []string
		for _, field := range ge.Fields {
			name := geometryFlag[field]
			if f.model != "" && field != "block_size" && field != "tp_size" && field != "tp_rank" && field != "layout" {
				name = "--model " + f.model
			}
			if name != "" && !slices.Contains(names, name) {
				names = append(names, name)
			}
		}
		return usageErrorf("%s: %s", strings.Join(names, ", "), ge.Rule)
	}
	if err != nil {
		return usageErrorf("geometry: %v", err)
	}
	if f.backend == "host" && l.BlockLen() > vmm.DefaultHostPageSize {
		return usageErrorf("--block-size %d: one block of this rank is %d bytes (%s), more than the host backend's page of %d bytes; blocks never straddle a page, so lower --block-size",
			f.blockSize, l.BlockLen(), l, vmm.DefaultHostPageSize)
	}
	return nil
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

// wildcardHost reports whether the host of a host:port that checkAddr
// accepted listens on every address (empty, 0.0.0.0, ::), so it cannot be
// advertised.
func wildcardHost(a string) bool {
	h, _, _ := net.SplitHostPort(a)
	return h == "" || net.ParseIP(h).IsUnspecified()
}

// sameAddr reports whether two host:port addresses are the same: equal
// ports and hosts (sameHost).
func sameAddr(a, b string) bool {
	ah, _, _ := net.SplitHostPort(a)
	bh, _, _ := net.SplitHostPort(b)
	return addrPort(a) == addrPort(b) && sameHost(ah, bh)
}

// addrPort is the port of a host:port that checkAddr accepted.
func addrPort(a string) int {
	_, p, _ := net.SplitHostPort(a)
	n, _ := strconv.Atoi(p)
	return n
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
