package main

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/demo"
	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// Flag ranges of demo and bench that the library does not bound itself:
// they keep a typo from reserving or allocating far more than a laptop has.
const (
	maxConcurrency    = 1024      // demo --concurrency
	maxCacheEntries   = 1 << 16   // demo --cache-entries: 32 Mi tokens of prefix
	maxTrials         = 1000      // bench handshake --trials
	maxBulkRounds     = 1000      // bench transfer --bulk-rounds
	maxLatencySamples = 1_000_000 // bench transfer --latency-samples
	minRTT            = time.Millisecond
	maxCellTime       = time.Hour // bench transfer --cell-time
	maxMaxBytes       = 1 << 30   // bench transfer --max-bytes: two buffers of it are allocated
)

// checkInt is a usage error naming the flag unless lo <= v <= hi.
func checkInt(flag string, v, lo, hi int) error {
	if v < lo || v > hi {
		return usageErrorf("--%s %d: want %d..%d", flag, v, lo, hi)
	}
	return nil
}

// checkDuration is a usage error naming the flag unless lo <= d <= hi.
func checkDuration(flag string, d, lo, hi time.Duration) error {
	if d < lo || d > hi {
		return usageErrorf("--%s %v: want %v..%v", flag, d, lo, hi)
	}
	return nil
}

// checkSpeedup accepts (0, +Inf]; inf sends every request at once.
func checkSpeedup(v float64) error {
	if math.IsNaN(v) || v <= 0 {
		return usageErrorf("--speedup %v: want a factor > 0 (inf: every request at once)", v)
	}
	return nil
}

// checkModelTP resolves --model and checks --prefill-tp and --decode-tp
// against it and against each other, as the connector will.
func checkModelTP(model string, prefillTP, decodeTP int) (*v1.ModelGeometry, error) {
	geom, err := kvgeom.Model(model)
	if err != nil {
		return nil, usageErrorf("--model %q: unknown; want one of %s", model, strings.Join(kvgeom.ModelNames(), ", "))
	}
	for _, f := range []struct {
		name string
		tp   int
	}{{"prefill-tp", prefillTP}, {"decode-tp", decodeTP}} {
		if err := checkInt(f.name, f.tp, 1, connector.MaxTPSize); err != nil {
			return nil, err
		}
		if _, err := vmm.LayoutFor(geom, 0, f.tp); err != nil {
			var ge *vmm.GeometryError
			if errors.As(err, &ge) {
				return nil, usageErrorf("--%s %d: model %s: %s", f.name, f.tp, model, ge.Rule)
			}
			return nil, usageErrorf("--%s %d: model %s: %v", f.name, f.tp, model, err)
		}
	}
	if prefillTP%decodeTP != 0 && decodeTP%prefillTP != 0 {
		return nil, usageErrorf("--prefill-tp %d and --decode-tp %d: one must divide the other", prefillTP, decodeTP)
	}
	shape, err := connector.ShapeOf(geom)
	if err != nil {
		return nil, usageErrorf("--model %s: %v", model, err)
	}
	for d := range decodeTP {
		if _, err := connector.PlanRank(shape, prefillTP, decodeTP, d); err != nil {
			return nil, usageErrorf("--prefill-tp %d and --decode-tp %d: model %s: %v", prefillTP, decodeTP, model, err)
		}
	}
	return geom, nil
}

// flagSet reports whether the flag name was given on the command line.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// defaultMemoryBudget is demo's --memory-budget when not given: half of
// MemAvailable in /proc/meminfo, or fallbackMemoryBudget when that cannot
// be read. The second result says where it came from, for messages.
func defaultMemoryBudget(meminfo string) (uint64, string) {
	b, err := os.ReadFile(meminfo)
	if err == nil {
		for line := range strings.Lines(string(b)) {
			// "MemAvailable:   22252636 kB"
			f := strings.Fields(line)
			if len(f) == 3 && f[0] == "MemAvailable:" && f[2] == "kB" {
				if kb, perr := strconv.ParseUint(f[1], 10, 64); perr == nil && kb > 0 && kb < math.MaxUint64/1024 {
					return kb * 1024 / 2, "half of MemAvailable"
				}
			}
		}
	}
	return fallbackMemoryBudget, meminfo + " unreadable"
}

// fallbackMemoryBudget: 8 GiB.
const fallbackMemoryBudget = 8 << 30

// byteSize is a flag.Value of a byte count with an optional unit: 1024,
// 512K or 512KiB (2^10), 8M/8MiB, 8G/8GiB, 1T/1TiB; KB, MB, GB and TB are
// powers of 10. It must be positive.
type byteSize uint64

func (b *byteSize) String() string {
	if b == nil || *b == 0 {
		return "0"
	}
	return strings.ReplaceAll(demo.FormatBytes(uint64(*b)), " ", "")
}

func (b *byteSize) Set(s string) error {
	units := []struct {
		suffix string
		mult   uint64
	}{
		{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
		{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
		{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40}, {"B", 1},
	}
	num, mult := strings.TrimSpace(s), uint64(1)
	for _, u := range units {
		if strings.HasSuffix(num, u.suffix) {
			num, mult = strings.TrimSpace(strings.TrimSuffix(num, u.suffix)), u.mult
			break
		}
	}
	n, err := strconv.ParseUint(num, 10, 64)
	switch {
	case err != nil || n == 0:
		return fmt.Errorf("%q: want a positive size like 8GiB, 512MiB or 1073741824 (bytes)", s)
	case n > math.MaxUint64/mult:
		return fmt.Errorf("%q overflows 64 bits", s)
	}
	*b = byteSize(n * mult)
	return nil
}
