package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRunUsage(t *testing.T) {
	tests := []struct {
		name     string
		args     []string
		wantCode int
		wantErr  string
	}{
		{"no args", nil, 2, "Usage: kvsidecar <command>"},
		{"help", []string{"--help"}, 0, "Commands:"},
		{"unknown", []string{"frobnicate"}, 2, `unknown command "frobnicate"`},
		{"serve help", []string{"serve", "--help"}, 0, "Usage: kvsidecar serve"},
		{"demo help", []string{"demo", "-h"}, 0, "Usage: kvsidecar demo"},
		{"bench unknown", []string{"bench", "disk"}, 2, `unknown benchmark "disk"`},
		{"bench handshake help", []string{"bench", "handshake", "--help"}, 0, "Usage: kvsidecar bench handshake"},
		{"bad flag", []string{"serve", "--no-such-flag"}, 2, "flag provided but not defined"},
		{"stray arg", []string{"ctl", "extra"}, 2, `unexpected argument "extra"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(context.Background(), tc.args, &out, &errb)
			require.Equal(t, tc.wantCode, code, errb.String())
			require.Contains(t, errb.String(), tc.wantErr)
		})
	}
}

// TestCtlHelpOnce is a regression test: ctl printed its usage twice.
func TestCtlHelpOnce(t *testing.T) {
	var out, errb bytes.Buffer
	require.Equal(t, 0, run(context.Background(), []string{"ctl", "--help"}, &out, &errb))
	require.Equal(t, 1, strings.Count(errb.String(), "Usage: kvsidecar ctl"), errb.String())
}
