package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// limitValue is a memory limit as given on a command line: bytes, a percent
// of the reservation, or none.
type limitValue struct {
	set     bool
	none    bool    // "none": no limit
	percent float64 // > 0 when given in percent
	abs     uint64
}

// byteUnits are the accepted units: decimal (kB, MB, GB, TB) and binary
// (KiB, MiB, GiB, TiB; K, M, G, T are binary too), case-insensitive.
var byteUnits = map[string]float64{
	"": 1, "b": 1,
	"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
	"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
	"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}

// parseLimit parses "8GiB", "512MiB", "1.5GB", "1073741824", "50%" or
// "none". Zero and negative values, 0 % and over 100 % are refused with the
// accepted range.
func parseLimit(s string) (limitValue, error) {
	s = strings.TrimSpace(s)
	if strings.HasPrefix(s, "-") {
		return limitValue{}, fmt.Errorf("%s: the limit must be positive (e.g. 8GiB, 512MiB, 50%%; none removes the limit)", s)
	}
	if strings.EqualFold(s, "none") {
		return limitValue{set: true, none: true}, nil
	}
	if p, ok := strings.CutSuffix(s, "%"); ok {
		v, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil || math.IsNaN(v) {
			return limitValue{}, fmt.Errorf("%q is not a percent", s)
		}
		if v <= 0 || v > 100 {
			return limitValue{}, fmt.Errorf("%s is outside the accepted range (0 %%, 100 %%] of the reservation", s)
		}
		return limitValue{set: true, percent: v}, nil
	}
	i := strings.IndexFunc(s, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	num, unit := s, ""
	if i >= 0 {
		num, unit = s[:i], strings.TrimSpace(s[i:])
	}
	mult, ok := byteUnits[strings.ToLower(unit)]
	if !ok {
		return limitValue{}, fmt.Errorf("%q: unknown unit %q (want B, kB, MB, GB, TB, KiB, MiB, GiB, TiB, or a percent)", s, unit)
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return limitValue{}, fmt.Errorf("%q is not a size (e.g. 8GiB, 512MiB, 50%%)", s)
	}
	b := v * mult
	if b < 1 || b >= math.MaxUint64/2 {
		return limitValue{}, fmt.Errorf("%s is outside the accepted range: more than 0 bytes (use \"none\" to remove the limit)", s)
	}
	return limitValue{set: true, abs: uint64(b)}, nil
}

// bytes resolves the limit against a cache whose page of every region is
// pageBytes and whose reservation is reserved: a percent becomes bytes; 0 is
// "none"; a value outside [pageBytes, reserved] is refused with that one
// range, whichever side it falls on.
func (l limitValue) bytes(pageBytes, reserved uint64) (uint64, error) {
	b := l.abs
	switch {
	case l.none:
		return 0, nil
	case l.percent > 0:
		b = uint64(math.Ceil(float64(reserved) * l.percent / 100))
	}
	if b < pageBytes || b > reserved {
		return 0, fmt.Errorf("%d bytes is outside the accepted range [%d, %d] (one page of every region up to the reservation; none removes the limit)",
			b, pageBytes, reserved)
	}
	return b, nil
}

func runCtl(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("ctl", "Show stats and set the memory limit of a running sidecar.\n\n"+
		"  kvsidecar ctl --socket PATH stats\n"+
		"  kvsidecar ctl --socket PATH limit VALUE [--strict]   VALUE: 8GiB, 512MiB, 1.5GB, 50%, none", stdout)
	socket := fs.String("socket", "", "the sidecar's local API socket (required)")
	strict := fs.Bool("strict", false, "limit: refuse a value below what is in use instead of shrinking as blocks are freed")
	timeout := fs.Duration("timeout", 10*time.Second, "bound on the whole command")
	asJSON := fs.Bool("json", false, "stats: print one JSON object (the same keys as the text, numbers as numbers)")
	if err := fs.parse(args); err != nil {
		return err
	}
	// Flags may also follow the subcommand and its value. A value of limit
	// that looks like a negative number is its value, not a flag, so that
	// it is refused as a limit rather than as an unknown flag.
	var pos []string
	for rest := fs.Args(); len(rest) > 0; rest = fs.Args() {
		pos = append(pos, rest[0])
		rest = rest[1:]
		if len(pos) == 1 && pos[0] == "limit" && len(rest) > 0 && negativeNumber(rest[0]) {
			pos, rest = append(pos, rest[0]), rest[1:]
		}
		if err := fs.parse(rest); err != nil {
			return err
		}
	}
	if len(pos) == 0 {
		return usageErrorf("missing subcommand: stats or limit VALUE")
	}
	var lv limitValue
	switch {
	case pos[0] == "stats" && len(pos) == 1:
	case pos[0] == "limit" && len(pos) == 1:
		return usageErrorf("limit: missing VALUE (e.g. 8GiB, 512MiB, 1.5GB, 50%%, none)")
	case pos[0] == "limit" && len(pos) == 2:
		var err error
		if lv, err = parseLimit(pos[1]); err != nil {
			return usageErrorf("limit: %v", err)
		}
	case pos[0] == "stats" || pos[0] == "limit":
		return usageErrorf("unexpected arguments %q (want: stats, or limit VALUE)", pos)
	default:
		return usageErrorf("unexpected argument %q (want the subcommand stats or limit VALUE)", pos[0])
	}
	if *socket == "" {
		return usageErrorf("--socket: required")
	}
	if *timeout <= 0 {
		return usageErrorf("--timeout: %v: must be positive", *timeout)
	}
	ctx, cancel := context.WithTimeoutCause(ctx, *timeout, fmt.Errorf("no reply from %s within %v (--timeout)", *socket, *timeout))
	defer cancel()
	// timedOut names what timed out instead of "context deadline exceeded"
	// or the socket's "i/o timeout".
	timedOut := func(err error) error {
		if ctx.Err() != nil && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded)) {
			return context.Cause(ctx)
		}
		return err
	}
	c, err := localapi.Dial(ctx, *socket, nil)
	if err != nil {
		return timedOut(err)
	}
	defer c.Close()
	st, err := c.Stats(ctx)
	if err != nil {
		return timedOut(err)
	}
	if pos[0] == "stats" {
		return printStats(stdout, st, *asJSON)
	}
	if !st.GetCacheReady() {
		return fmt.Errorf("limit: the sidecar has no KV cache yet (no engine attached)")
	}
	// The range depends on the sidecar's cache: a value outside it is the
	// sidecar's refusal (exit 1), not a command-line error.
	b, err := lv.bytes(st.GetPageSize()*st.GetNumRegions(), st.GetReservationBytes())
	if err != nil {
		return fmt.Errorf("limit: %w", err)
	}
	if err := c.SetMemoryLimit(ctx, b, *strict); err != nil {
		return timedOut(err)
	}
	if b == 0 {
		fmt.Fprintln(stdout, "memory limit: none")
	} else {
		fmt.Fprintf(stdout, "memory limit: %d bytes (%.1f%% of the %d-byte reservation)\n", b, 100*float64(b)/float64(st.GetReservationBytes()), st.GetReservationBytes())
	}
	return nil
}

// negativeNumber reports whether a looks like a negative number ("-5GiB",
// "-.5", "-10%") rather than a flag.
func negativeNumber(a string) bool {
	return len(a) > 1 && a[0] == '-' && (a[1] >= '0' && a[1] <= '9' || a[1] == '.')
}

// statsField is one line of ctl stats: its key and value.
type statsField struct {
	key string
	v   any // bool or uint64
}

// statsFields are the lines of ctl stats in order: only cache_ready and
// engine_attached when no engine created the cache yet. engine_attached
// follows the engine (false again once its session ended, while the cache
// stays); engine_session names the attached session, 0 for none.
func statsFields(st *v1.StatsReply) []statsField {
	if !st.GetCacheReady() {
		return []statsField{{"cache_ready", false}, {"engine_attached", st.GetEngineAttached()}}
	}
	return []statsField{{"cache_ready", true}, {"engine_attached", st.GetEngineAttached()}, {"engine_session", st.GetEngineSession()},
		{"pages_mapped", st.GetPagesMapped()}, {"bytes_mapped", st.GetBytesMapped()},
		{"reserve_pages", st.GetReservePages()}, {"blocks_used", st.GetBlocksUsed()}, {"blocks_total", st.GetBlocksTotal()},
		{"memory_limit_bytes", st.GetMemoryLimitBytes()}, {"reservation_bytes", st.GetReservationBytes()},
		{"page_size", st.GetPageSize()}, {"num_regions", st.GetNumRegions()}, {"leases_held", st.GetLeasesHeld()},
		{"loads_in_flight", st.GetLoadsInFlight()}}
}

// printStats writes st as "key: value" lines, or as one JSON object with the
// same keys.
func printStats(w io.Writer, st *v1.StatsReply, asJSON bool) error {
	fields := statsFields(st)
	if asJSON {
		m := make(map[string]any, len(fields))
		for _, f := range fields {
			m[f.key] = f.v
		}
		return json.NewEncoder(w).Encode(m)
	}
	for _, f := range fields {
		fmt.Fprintf(w, "%s: %v\n", f.key, f.v)
	}
	return nil
}
