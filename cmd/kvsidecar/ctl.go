package main

import (
	"context"
	"io"
)

func runCtl(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("ctl", "Show stats and set the memory limit of a running sidecar.", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	return errNotImplemented
}
