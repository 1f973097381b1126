package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRunUsage: help asked for goes to stdout with exit 0; an error goes to
// stderr as one line naming what was wrong plus where the help is, exit 2,
// never with the flag list dumped around it.
func TestRunUsage(t *testing.T) {
	tests := []struct {
		name     string
		args     []string
		wantCode int
		wantOut  string // in stdout; "" = stdout empty
		wantErr  string // in stderr; "" = stderr empty
	}{
		{"no args", nil, 2, "", "Usage: kvsidecar <command>"},
		{"help", []string{"--help"}, 0, "Commands:", ""},
		{"help word", []string{"help"}, 0, "Commands:", ""},
		{"unknown", []string{"frobnicate"}, 2, "", "kvsidecar: unknown command \"frobnicate\"\nsee 'kvsidecar --help'\n"},
		{"serve help", []string{"serve", "--help"}, 0, "Usage: kvsidecar serve", ""},
		{"demo help", []string{"demo", "-h"}, 0, "Usage: kvsidecar demo", ""},
		{"ctl help", []string{"ctl", "--help"}, 0, "Usage: kvsidecar ctl", ""},
		{"version help", []string{"version", "--help"}, 0, "Usage: kvsidecar version", ""},
		{"bench help", []string{"bench", "--help"}, 0, "Usage: kvsidecar bench handshake|transfer", ""},
		{"bench unknown", []string{"bench", "disk"}, 2, "", `unknown benchmark "disk"`},
		{"bench handshake help", []string{"bench", "handshake", "--help"}, 0, "Usage: kvsidecar bench handshake", ""},
		{"bad flag", []string{"serve", "--no-such-flag"}, 2, "",
			"kvsidecar serve: usage: flag provided but not defined: -no-such-flag\nsee 'kvsidecar serve --help'\n"},
		{"bad value", []string{"serve", "--tp-size", "two"}, 2, "",
			"kvsidecar serve: usage: invalid value \"two\" for flag -tp-size: parse error\nsee 'kvsidecar serve --help'\n"},
		{"bad demo value", []string{"demo", "--requests", "many"}, 2, "",
			"kvsidecar demo: usage: invalid value \"many\" for flag -requests: parse error\nsee 'kvsidecar demo --help'\n"},
		{"bad ctl value", []string{"ctl", "--timeout", "soon", "stats"}, 2, "",
			"kvsidecar ctl: usage: invalid value \"soon\" for flag -timeout: parse error\nsee 'kvsidecar ctl --help'\n"},
		{"stray arg", []string{"ctl", "extra"}, 2, "", `unexpected argument "extra"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(context.Background(), tc.args, &out, &errb)
			require.Equal(t, tc.wantCode, code, errb.String())
			if tc.wantOut == "" {
				require.Empty(t, out.String())
			} else {
				require.Contains(t, out.String(), tc.wantOut)
			}
			if tc.wantErr == "" {
				require.Empty(t, errb.String())
			} else {
				require.Contains(t, errb.String(), tc.wantErr)
				require.NotContains(t, errb.String(), "Flags:", "no flag list around an error")
			}
		})
	}
}

// TestCtlHelpOnce is a regression test: ctl printed its usage twice.
func TestCtlHelpOnce(t *testing.T) {
	var out, errb bytes.Buffer
	require.Equal(t, 0, run(context.Background(), []string{"ctl", "--help"}, &out, &errb))
	require.Equal(t, 1, strings.Count(out.String(), "Usage: kvsidecar ctl"), out.String())
	require.Empty(t, errb.String())
}
