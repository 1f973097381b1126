package main

import (
	"bytes"
	"io"
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestVersionLine(t *testing.T) {
	platform := " " + runtime.GOOS + "/" + runtime.GOARCH
	vcs := []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
		{Key: "vcs.time", Value: "2026-01-02T03:04:05Z"}, {Key: "vcs.modified", Value: "true"}}
	tests := []struct {
		name string
		bi   *debug.BuildInfo
		want string
	}{
		{"no build info", nil, "kvsidecar (unknown) " + runtime.Version() + platform},
		{"checkout without vcs", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}}, "kvsidecar (devel) go1.26.8" + platform},
		{"released", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.3.0"}}, "kvsidecar v0.3.0 go1.26.8" + platform},
		{"checkout with vcs", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}, Settings: vcs},
			"kvsidecar (devel) (revision 0123456789ab, 2026-01-02T03:04:05Z, modified) go1.26.8" + platform},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, versionLine(tc.bi))
		})
	}
}

func TestVersionCommand(t *testing.T) {
	for _, args := range [][]string{{"version"}, {"--version"}, {"-version"}} {
		t.Run(args[0], func(t *testing.T) {
			var out bytes.Buffer
			require.Equal(t, 0, run(t.Context(), args, &out, io.Discard))
			require.Regexp(t, `^kvsidecar \S+ .*go1\.\d+.* `+runtime.GOOS+`/`+runtime.GOARCH+"\n$", out.String())
		})
	}
	var errb bytes.Buffer
	require.Equal(t, 2, run(t.Context(), []string{"version", "extra"}, io.Discard, &errb))
	require.Contains(t, errb.String(), `unexpected argument "extra"`)
}
