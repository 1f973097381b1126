package main

import (
	"context"
	"io"
)

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		stderr.Write([]byte("Usage: kvsidecar bench handshake|transfer [flags]\n"))
		if len(args) == 0 {
			return usageErrorf("missing benchmark name")
		}
		return nil
	}
	switch args[0] {
	case "handshake":
		fs := newFlagSet("bench handshake", "Measure handshake latency in piggyback and legacy modes.", stderr)
		if err := parseFlags(fs, args[1:]); err != nil {
			return err
		}
		return errNotImplemented
	case "transfer":
		fs := newFlagSet("bench transfer", "Measure transfer throughput against raw QUIC and TLS/TCP baselines.", stderr)
		if err := parseFlags(fs, args[1:]); err != nil {
			return err
		}
		return errNotImplemented
	}
	return usageErrorf("unknown benchmark %q (want handshake or transfer)", args[0])
}
