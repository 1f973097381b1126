package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzParseLimit parses arbitrary `ctl limit` / --memory-limit values:
// never a panic; an accepted value is exactly one of none, a percent in
// (0, 100] or at least one byte, and resolves against a reservation to at
// most the reservation (a percent) or to itself (bytes within it).
func FuzzParseLimit(f *testing.F) {
	for _, s := range []string{"8GiB", "512 MiB", "1.5GB", "1073741824", "50%", "none", "0%", "101%", "-1", "1e3kB", "NaN%", ".5 k"} {
		f.Add(s)
	}
	const reserved = 1 << 40
	f.Fuzz(func(t *testing.T, s string) {
		l, err := parseLimit(s)
		if err != nil {
			require.NotEmpty(t, err.Error())
			return
		}
		require.True(t, l.set)
		kinds := 0
		for _, b := range []bool{l.none, l.percent > 0, l.abs > 0} {
			if b {
				kinds++
			}
		}
		require.Equal(t, 1, kinds, "%q parsed to %+v", s, l)
		got, err := l.bytes(reserved)
		switch {
		case l.none:
			require.NoError(t, err)
			require.Zero(t, got)
		case l.percent > 0:
			require.LessOrEqual(t, l.percent, 100.0)
			require.NoError(t, err)
			require.LessOrEqual(t, got, uint64(reserved))
			require.NotZero(t, got)
		case l.abs <= reserved:
			require.NoError(t, err)
			require.Equal(t, l.abs, got)
		default:
			require.Error(t, err)
		}
	})
}
