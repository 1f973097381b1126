package main

import (
	"bytes"
	"net"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseLimit(t *testing.T) {
	const reserved, page = 100 << 30, 64 << 20
	tests := []struct {
		in      string
		want    uint64
		wantErr string
	}{
		{"8GiB", 8 << 30, ""},
		{"512 MiB", 512 << 20, ""},
		{"1.5GB", 1_500_000_000, ""},
		{"1073741824", 1 << 30, ""},
		{"2g", 2 << 30, ""},
		{"50%", 50 << 30, ""},
		{"100%", reserved, ""},
		{"none", 0, ""},
		{"0%", 0, "(0 %, 100 %]"},
		{"100.5%", 0, "(0 %, 100 %]"},
		{"0", 0, "more than 0 bytes"},
		{"-1GiB", 0, "-1GiB: the limit must be positive"},
		{"3 parsecs", 0, "unknown unit"},
		// One accepted range whichever side a value falls on (it said
		// (0, R] above the reservation and [P, P] below a page).
		{"101GiB", 0, "accepted range [67108864, 107374182400]"},
		{"1MiB", 0, "accepted range [67108864, 107374182400]"},
		{"0.01%", 0, "accepted range [67108864, 107374182400]"},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			lv, err := parseLimit(tc.in)
			if err == nil {
				var b uint64
				b, err = lv.bytes(page, reserved)
				if err == nil {
					require.Empty(t, tc.wantErr)
					require.Equal(t, tc.want, b)
					return
				}
			}
			require.NotEmpty(t, tc.wantErr, "unexpected error %v", err)
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

func TestCtlUsage(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"no subcommand", []string{"--socket", "/x"}, "missing subcommand"},
		{"no socket", []string{"stats"}, "--socket: required"},
		{"limit without value", []string{"--socket", "/x", "limit"}, "limit: missing VALUE"},
		{"negative limit", []string{"--socket", "/x", "limit", "-5GiB"}, "limit: -5GiB: the limit must be positive"},
		{"negative limit then a flag", []string{"limit", "-.5", "--socket", "/x"}, "limit: -.5: the limit must be positive"},
		{"limit with two values", []string{"--socket", "/x", "limit", "1GiB", "2GiB"}, "unexpected arguments"},
		{"limit out of range", []string{"--socket", "/x", "limit", "0%", "--strict"}, "(0 %, 100 %]"},
		{"timeout zero", []string{"--socket", "/x", "--timeout", "0s", "stats"}, "--timeout: 0s: must be positive"},
		{"timeout negative", []string{"--socket", "/x", "stats", "--timeout", "-1s"}, "--timeout: -1s: must be positive"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var errb bytes.Buffer
			require.Equal(t, 2, run(t.Context(), append([]string{"ctl"}, tc.args...), &bytes.Buffer{}, &errb))
			require.Contains(t, errb.String(), tc.want)
		})
	}
}

// TestCtlHungSocket checks that a sidecar that accepts but never replies
// makes ctl fail (exit 1) naming the socket and the timeout, not with a bare
// "context deadline exceeded".
func TestCtlHungSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "hung.sock")
	ln, err := net.Listen("unix", path) // never accepts: the kernel queues the connection
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	for _, sub := range [][]string{{"stats"}, {"limit", "1GiB"}} {
		t.Run(sub[0], func(t *testing.T) {
			var errb bytes.Buffer
			code := run(t.Context(), append([]string{"ctl", "--socket", path, "--timeout", "50ms"}, sub...), &bytes.Buffer{}, &errb)
			require.Equal(t, 1, code, errb.String())
			require.Contains(t, errb.String(), "no reply from "+path+" within 50ms (--timeout)")
			require.NotContains(t, errb.String(), "usage")
		})
	}
}
