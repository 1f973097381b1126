package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"strings"
)

func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", "Print the module version, the VCS revision and the Go version of this binary.", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	bi, _ := debug.ReadBuildInfo()
	fmt.Fprintln(stdout, versionLine(bi))
	return nil
}

// versionLine describes a build in one line from its build info (nil when
// the binary has none): "kvsidecar v0.3.0 (revision 0123456789ab, 2026-01-02T03:04:05Z,
// modified) go1.26.8 linux/amd64". The module version is "(devel)" for a
// binary built from a checkout; the revision part is present when the build
// recorded VCS settings.
func versionLine(bi *debug.BuildInfo) string {
	version, goVersion := "(unknown)", runtime.Version()
	var vcs []string
	if bi != nil {
		if bi.Main.Version != "" {
			version = bi.Main.Version
		}
		if bi.GoVersion != "" {
			goVersion = bi.GoVersion
		}
		get := func(key string) string {
			for _, s := range bi.Settings {
				if s.Key == key {
					return s.Value
				}
			}
			return ""
		}
		if rev := get("vcs.revision"); rev != "" {
			vcs = append(vcs, "revision "+rev[:min(len(rev), 12)])
			if t := get("vcs.time"); t != "" {
				vcs = append(vcs, t)
			}
			if get("vcs.modified") == "true" {
				vcs = append(vcs, "modified")
			}
		}
	}
	line := "kvsidecar " + version
	if len(vcs) > 0 {
		line += " (" + strings.Join(vcs, ", ") + ")"
	}
	return line + " " + goVersion + " " + runtime.GOOS + "/" + runtime.GOARCH
}
