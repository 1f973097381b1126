package demo

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestNearestRank(t *testing.T) {
	ms := func(xs ...int) []time.Duration {
		var out []time.Duration
		for _, x := range xs {
			out = append(out, time.Duration(x)*time.Millisecond)
		}
		return out
	}
	hundred := make([]time.Duration, 200)
	for i := range hundred {
		hundred[i] = time.Duration(i+1) * time.Millisecond
	}
	tests := []struct {
		name   string
		sorted []time.Duration
		q      float64
		want   time.Duration
	}{
		{"none", nil, 0.99, 0},
		{"one", ms(7), 0.5, 7 * time.Millisecond},
		{"p50 of 4", ms(1, 2, 3, 4), 0.5, 2 * time.Millisecond},
		{"p99 of 3 is the max", ms(1, 2, 90), 0.99, 90 * time.Millisecond},
		{"p99 of 99 is the max", hundred[:P99MaxSamples], 0.99, 99 * time.Millisecond},
		{"p99 of 100 is the 99th", hundred[:100], 0.99, 99 * time.Millisecond},
		{"p99 of 101", hundred[:101], 0.99, 100 * time.Millisecond},
		{"p99 of 200", hundred, 0.99, 198 * time.Millisecond},
		{"p100", hundred, 1, 200 * time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, nearestRank(tc.sorted, tc.q))
		})
	}
}

func TestUnionLength(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(from, to int) interval {
		return interval{t0.Add(time.Duration(from) * time.Millisecond), t0.Add(time.Duration(to) * time.Millisecond)}
	}
	tests := []struct {
		name string
		ivs  []interval
		want time.Duration
	}{
		{"none", nil, 0},
		{"one", []interval{at(0, 5)}, 5 * time.Millisecond},
		{"disjoint", []interval{at(10, 12), at(0, 5)}, 7 * time.Millisecond},
		{"overlapping", []interval{at(0, 5), at(3, 8)}, 8 * time.Millisecond},
		{"nested", []interval{at(0, 10), at(2, 3), at(4, 6)}, 10 * time.Millisecond},
		{"touching", []interval{at(0, 5), at(5, 9), at(20, 21)}, 10 * time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, unionLength(tc.ivs))
		})
	}
}
