package main

import (
	"flag"
	"math"
	"strings"
	"time"

	"github.com/kvsidecar/kvsidecar/connector"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// Flag ranges of demo and bench that the library does not bound itself:
// they keep a typo from reserving or allocating far more than a laptop has.
const (
	maxConcurrency  = 1024    // demo --concurrency
	maxCacheEntries = 1 << 16 // demo --cache-entries: 32 Mi tokens of prefix
	maxTrials       = 1000    // bench handshake --trials
	maxBulkRounds   = 1000    // bench transfer --bulk-rounds
	minRTT          = time.Millisecond
	maxRTT          = 10 * time.Second // bench handshake --rtt
	maxCellTime     = time.Hour        // bench transfer --cell-time
	maxMaxBytes     = 1 << 30          // bench transfer --max-bytes: two buffers of it are allocated
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
	geom, err := vmm.Model(model)
	if err != nil {
		return nil, usageErrorf("--model %q: unknown; want one of %s", model, strings.Join(vmm.ModelNames(), ", "))
	}
	for _, f := range []struct {
		name string
		tp   int
	}{{"prefill-tp", prefillTP}, {"decode-tp", decodeTP}} {
		if err := checkInt(f.name, f.tp, 1, connector.MaxTPSize); err != nil {
			return nil, err
		}
		if _, err := vmm.LayoutFor(geom, 0, f.tp); err != nil {
			return nil, usageErrorf("--%s %d: model %s: %s", f.name, f.tp, model,
				strings.TrimPrefix(err.Error(), "vmm: invalid configuration: "))
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
