package main

import (
	"context"
	"io"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo", "Run a prefill and a decode instance on the host backend and replay a real trace through them.", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	return errNotImplemented
}
