package main

import (
	"context"
	"io"
)

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("serve", "Run the sidecar beside one GPU (one tp_rank) of an inference engine.", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	return errNotImplemented
}
