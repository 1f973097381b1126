package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzParseLimit parses arbitrary `ctl limit` / --memory-limit values:
// never a panic; an accepted value is exactly one of none, a percent in
// (0, 100] or at least one byte, and resolves against a cache to none, or to
// a value inside its one accepted range [page of every region,
// reservation], or to an error naming that range.
func FuzzParseLimit(f *testing.F) {
	for _, s := range []string{"8GiB", "512 MiB", "1.5GB", "1073741824", "50%", "none", "0%", "101%", "-1", "1e3kB", "NaN%", ".5 k"} {
		f.Add(s)
	}
	const reserved, page = 1 << 40, 64 << 20
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
		got, err := l.bytes(page, reserved)
		switch {
		case l.none:
			require.NoError(t, err)
			require.Zero(t, got)
		case err != nil:
			require.ErrorContains(t, err, "outside the accepted range [67108864, 1099511627776]")
		default:
			require.GreaterOrEqual(t, got, uint64(page))
			require.LessOrEqual(t, got, uint64(reserved))
			if l.percent == 0 {
				require.Equal(t, l.abs, got)
			}
		}
	})
}
