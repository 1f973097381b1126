package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", "Print the module version, the VCS revision and the Go version of this binary.", stdout)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	bi, _ := debug.ReadBuildInfo()
	fmt.Fprintln(stdout, versionLine(bi))
	return nil
}

// buildOf is what a binary's build info (nil when it has none) says: the
// module version ("(devel)" for a binary built from a checkout, "(unknown)"
// without build info), the VCS revision, its time and whether the tree was
// modified (empty and false when the build recorded no VCS settings), and
// the Go version.
type buildOf struct {
	version, revision, vcsTime, goVersion string
	modified                              bool
}

func readBuild(bi *debug.BuildInfo) buildOf {
	b := buildOf{version: "(unknown)", goVersion: runtime.Version()}
	if bi == nil {
		return b
	}
	if bi.Main.Version != "" {
		b.version = bi.Main.Version
	}
	if bi.GoVersion != "" {
		b.goVersion = bi.GoVersion
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.revision = s.Value
		case "vcs.time":
			b.vcsTime = s.Value
		case "vcs.modified":
			b.modified = s.Value == "true"
		}
	}
	return b
}

// versionLine describes a build in one line from its build info (nil when
// the binary has none): "kvsidecar v0.3.0 (revision 0123456789ab, 2026-01-02T03:04:05Z,
// modified) go1.26.8 linux/amd64". The module version is "(devel)" for a
// binary built from a checkout; the revision part is present when the build
// recorded VCS settings.
func versionLine(bi *debug.BuildInfo) string {
	b := readBuild(bi)
	line := "kvsidecar " + b.version
	if b.revision != "" {
		vcs := []string{"revision " + b.revision[:min(len(b.revision), 12)]}
		if b.vcsTime != "" {
			vcs = append(vcs, b.vcsTime)
		}
		if b.modified {
			vcs = append(vcs, "modified")
		}
		line += " (" + strings.Join(vcs, ", ") + ")"
	}
	return line + " " + b.goVersion + " " + runtime.GOOS + "/" + runtime.GOARCH
}

// buildInfoGauge is kvsidecar_build_info: 1, labelled with the module
// version, the VCS revision (12 hex digits, "" when unknown) and the Go
// version of this binary, so dashboards can tell the versions of a fleet
// apart (the Prometheus *_build_info convention).
func buildInfoGauge(bi *debug.BuildInfo) prometheus.Gauge {
	b := readBuild(bi)
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvsidecar_build_info",
		Help: "Always 1; the labels give the module version, VCS revision and Go version of this binary.",
		ConstLabels: prometheus.Labels{"version": b.version, "revision": b.revision[:min(len(b.revision), 12)],
			"go_version": b.goVersion},
	})
	g.Set(1)
	return g
}
