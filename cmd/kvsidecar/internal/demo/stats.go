package demo

import (
	"math"
	"slices"
	"time"
)

// nearestRank returns the q-quantile (0 < q <= 1) of sorted by the
// nearest-rank method: the smallest sample with at least q·n samples at or
// below it, sorted[ceil(q·n)-1]. It returns 0 for no samples. For q = 0.99
// and n < 100 that is the maximum.
func nearestRank(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	// The epsilon keeps 0.99·100 = 99.000…01 from rounding up to 100.
	i := int(math.Ceil(q*float64(len(sorted))-1e-9)) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// P99MaxSamples: with at most this many samples, a nearest-rank p99 is the
// maximum sample (ceil(0.99·n) = n for every n < 100).
const P99MaxSamples = 99

// interval is a span of wall time [from, to).
type interval struct{ from, to time.Time }

// unionLength returns the total length of the union of ivs (overlaps
// counted once). It sorts ivs in place.
func unionLength(ivs []interval) time.Duration {
	slices.SortFunc(ivs, func(a, b interval) int { return a.from.Compare(b.from) })
	var total time.Duration
	var cur interval
	for i, iv := range ivs {
		switch {
		case i == 0:
			cur = iv
		case !iv.from.After(cur.to):
			if iv.to.After(cur.to) {
				cur.to = iv.to
			}
		default:
			total += cur.to.Sub(cur.from)
			cur = iv
		}
	}
	if len(ivs) > 0 {
		total += cur.to.Sub(cur.from)
	}
	return total
}
