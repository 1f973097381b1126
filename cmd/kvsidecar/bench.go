package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/kvsidecar/kvsidecar/internal/demo"
	"github.com/kvsidecar/kvsidecar/vmm"
)

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		stderr.Write([]byte("Usage: kvsidecar bench handshake|transfer [flags]\n"))
		if len(args) == 0 {
			return usageErrorf("missing benchmark name")
		}
		return nil
	}
	// The benchmarks' delaying sockets are not *net.UDPConn; quic-go's
	// warning about their buffer sizes is noise.
	os.Setenv("QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING", "true")
	switch args[0] {
	case "handshake":
		return benchHandshake(ctx, args[1:], stdout, stderr)
	case "transfer":
		return benchTransfer(ctx, args[1:], stdout, stderr)
	}
	return usageErrorf("unknown benchmark %q (want handshake or transfer)", args[0])
}

func benchHandshake(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench handshake", "Measure handshake latency in piggyback and legacy modes.", stderr)
	model := fs.String("model", demo.DefaultModel, "model geometry: "+strings.Join(vmm.ModelNames(), ", "))
	prefillTP := fs.Int("prefill-tp", demo.DefaultPrefillTP, "TP size of the prefill instance")
	decodeTP := fs.Int("decode-tp", demo.DefaultDecodeTP, "TP size of the decode instance")
	rtt := fs.Duration("rtt", demo.DefaultRTT, "injected round-trip time (one-way delay rtt/2 on every socket)")
	trials := fs.Int("trials", demo.DefaultTrials, "trials per mode; medians are reported")
	asJSON := fs.Bool("json", false, "print the result as one JSON object on the last line of stdout (the table goes to stderr)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	res, err := demo.RunHandshakeBench(ctx, &demo.HandshakeConfig{Model: *model, PrefillTP: *prefillTP,
		DecodeTP: *decodeTP, RTT: *rtt, Trials: *trials})
	if err != nil {
		return err
	}
	table := stdout
	if *asJSON {
		table = stderr
	}
	fmt.Fprintf(table, "handshake latency, %s, prefill TP %d -> decode TP %d, RTT %.1f ms, median of %d trials\n",
		res.Model, res.PrefillTP, res.DecodeTP, res.RTTMs, res.Trials)
	tw := tabwriter.NewWriter(table, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tdecode rank\ttarget\tfirst contact ms\tRTT\tcached ms\tRTT\t0-RTT reconnect ms\tRTT\t0-RTT trials\t")
	for _, name := range []string{"piggyback", "legacy"} {
		m := res.Modes[name]
		for d := range m.TargetRanks {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f\t%.2f\t%.3f\t%.2f\t%.1f\t%.2f\t%d/%d\t\n", name, d, m.TargetRanks[d],
				m.FirstContactMs[d], m.FirstContactRTT[d], m.CachedMs[d], m.CachedRTT[d],
				m.Reconnect0RTTMs[d], m.Reconnect0RTTRTT[d], m.ZeroRTTTrials[d], res.Trials)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if *asJSON {
		return printJSON(stdout, res)
	}
	return nil
}

func printJSON(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "%s\n", b)
	return err
}

func benchTransfer(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench transfer", "Measure transfer throughput against raw QUIC and TLS/TCP baselines.", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	return errNotImplemented
}
