package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/demo"
	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/cuda"
)

// maxBenchRTT caps bench handshake --rtt: a handshake takes several round
// trips (QUIC+TLS, then the metadata exchange), and beyond about 2s of RTT
// they outlast the dial timeout, so 6s and 10s failed with a dial timeout
// instead of measuring anything.
const maxBenchRTT = 2 * time.Second

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		if len(args) == 0 {
			return usageErrorf("missing benchmark name: handshake or transfer")
		}
		fmt.Fprintln(stdout, "Usage: kvsidecar bench handshake|transfer [flags]\n\n"+
			"Run 'kvsidecar bench handshake --help' or 'kvsidecar bench transfer --help' for the flags.")
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
	fs := newFlagSet("bench handshake", "Measure handshake latency and the first KV byte in piggyback and legacy modes.", stdout)
	model := fs.String("model", demo.DefaultModel, "model geometry: "+strings.Join(kvgeom.ModelNames(), ", "))
	prefillTP := fs.Int("prefill-tp", demo.DefaultPrefillTP, fmt.Sprintf("TP size of the prefill instance, 1..%d", connector.MaxTPSize))
	decodeTP := fs.Int("decode-tp", demo.DefaultDecodeTP, fmt.Sprintf("TP size of the decode instance, 1..%d; one of the TP sizes must divide the other", connector.MaxTPSize))
	rtt := fs.Duration("rtt", demo.DefaultRTT, fmt.Sprintf("injected round-trip time, %v..%v (one-way delay rtt/2 on every socket)", minRTT, maxBenchRTT))
	trials := fs.Int("trials", demo.DefaultTrials, fmt.Sprintf("trials per mode, 1..%d; medians are reported", maxTrials))
	asJSON := fs.Bool("json", false, "print the result as one JSON object on the last line of stdout (the table goes to stderr)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if _, err := checkModelTP(*model, *prefillTP, *decodeTP); err != nil {
		return err
	}
	if err := checkDuration("rtt", *rtt, minRTT, maxBenchRTT); err != nil {
		return err
	}
	if err := checkInt("trials", *trials, 1, maxTrials); err != nil {
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
	// Each table: one row per mode and decode rank, three (ms, RTT) pairs
	// and the trials that resumed in 0-RTT.
	type cols struct{ ms, rtt [3][]float64 }
	modeTable := func(header string, pick func(m *demo.HandshakeModeResult) (cols, []int), msFmt [3]string) error {
		tw := tabwriter.NewWriter(table, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, header)
		for _, name := range []string{"piggyback", "legacy"} {
			m := res.Modes[name]
			c, zero := pick(m)
			for d := range m.TargetRanks {
				fmt.Fprintf(tw, "%s\t%d\t%d\t", name, d, m.TargetRanks[d])
				for i := range 3 {
					fmt.Fprintf(tw, msFmt[i]+"\t%.2f\t", c.ms[i][d], c.rtt[i][d])
				}
				fmt.Fprintf(tw, "%d/%d\t\n", zero[d], res.Trials)
			}
		}
		return tw.Flush()
	}
	err = modeTable("mode\tdecode rank\ttarget\tfirst contact ms\tRTT\tcached ms\tRTT\t0-RTT reconnect ms\tRTT\t0-RTT trials\t",
		func(m *demo.HandshakeModeResult) (cols, []int) {
			return cols{[3][]float64{m.FirstContactMs, m.CachedMs, m.Reconnect0RTTMs},
				[3][]float64{m.FirstContactRTT, m.CachedRTT, m.Reconnect0RTTRTT}}, m.ZeroRTTTrials
		}, [3]string{"%.1f", "%.3f", "%.1f"})
	if err != nil {
		return err
	}
	fmt.Fprintf(table, "\nfirst KV byte of a one-block load (StartLoad to first byte in decode memory), median of %d trials\n", res.Trials)
	err = modeTable("mode\tdecode rank\ttarget\tnew peer ms\tRTT\tcached ms\tRTT\treturning (0-RTT) ms\tRTT\t0-RTT trials\t",
		func(m *demo.HandshakeModeResult) (cols, []int) {
			return cols{[3][]float64{m.FirstKVByteMs, m.FirstKVByteCachedMs, m.FirstKVByte0RTTMs},
				[3][]float64{m.FirstKVByteRTT, m.FirstKVByteCachedRTT, m.FirstKVByte0RTTRTT}}, m.FirstKVByte0RTTTrials
		}, [3]string{"%.1f", "%.1f", "%.1f"})
	if err != nil {
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
	fs := newFlagSet("bench transfer", "Measure transfer throughput against raw QUIC and TLS/TCP baselines.", stdout)
	blocks := fs.String("block-sizes", "4K,64K,1M,16M,64M", "descriptor sizes, comma-separated (K, M, G suffixes: KiB, MiB, GiB); at least one within --max-bytes")
	batches := fs.String("batch-sizes", "1,16", fmt.Sprintf("descriptors per transfer, comma-separated, each 1..%d", transfer.DefaultMaxDescsPerTransfer))
	maxBytes := fs.String("max-bytes", "128M", fmt.Sprintf("cap of block size × batch, 1..%s (four buffers of it are allocated: two for the sweep, two pools for the path rows); larger cells are skipped with a note", sizeString(maxMaxBytes)))
	cellTime := fs.Duration("cell-time", demo.DefaultCellTime, fmt.Sprintf("time spent on each (op, block, batch) cell, > 0 and <= %v (at least 3 transfers run)", maxCellTime))
	rounds := fs.Int("bulk-rounds", demo.DefaultBulkRounds, fmt.Sprintf("rounds of the bulk comparison with the baselines and of the path rows with their floors (best kept), 1..%d", maxBulkRounds))
	samples := fs.Int("latency-samples", demo.DefaultLatencySamples, fmt.Sprintf("timed warm READs of one 4 KiB and one 64 KiB descriptor, and raw quic-go 4 KiB round trips, 1..%d", maxLatencySamples))
	check := fs.Bool("check", false, "verify every byte of every transfer")
	rtt := fs.Duration("rtt", 0, fmt.Sprintf("also time a 16 MiB READ through sockets that delay every packet by rtt/2, %v..%v; 0: none", minRTT, maxBenchRTT))
	lanes := fs.String("lanes", "1,2,4", fmt.Sprintf("READ lane counts of the path rows (same-host and QUIC READs), comma-separated, each 1..%d; 1 is always measured", transfer.MaxReadLanes))
	backend := fs.String("backend", "host", "page backend of the path rows' pools: host (memfd) or cuda (device 0: device memory, with the cuda floors)")
	cudaLibrary := fs.String("cuda-library", cuda.DefaultLibrary, "CUDA driver library to dlopen, a name the dynamic loader finds or a path (cuda backend only)")
	asJSON := fs.Bool("json", false, "print the result as one JSON object on the last line of stdout (the table goes to stderr)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	ks, err := parseLanes(*lanes)
	if err != nil {
		return usageErrorf("--lanes %q: %v", *lanes, err)
	}
	var be demo.BackendFunc
	switch *backend {
	case "host":
		if flagSet(fs.FlagSet, "cuda-library") {
			return usageErrorf("--cuda-library %q: only the cuda backend loads a driver", *cudaLibrary)
		}
	case "cuda":
		be = func(string, int) (vmm.Backend, error) {
			return cuda.New(&cuda.Config{Device: 0, Library: *cudaLibrary})
		}
	default:
		return usageErrorf("--backend %q: want host or cuda", *backend)
	}
	if *rtt != 0 {
		if err := checkDuration("rtt", *rtt, minRTT, maxBenchRTT); err != nil {
			return err
		}
	}
	bs, err := parseSizes(*blocks)
	if err != nil {
		return usageErrorf("--block-sizes %q: %v", *blocks, err)
	}
	ns, err := parseSizes(*batches)
	if err != nil {
		return usageErrorf("--batch-sizes %q: %v", *batches, err)
	}
	for _, n := range ns {
		if n > transfer.DefaultMaxDescsPerTransfer {
			return usageErrorf("--batch-sizes %d: want 1..%d descriptors per transfer", n, transfer.DefaultMaxDescsPerTransfer)
		}
	}
	mb, err := parseSizes(*maxBytes)
	if err != nil || len(mb) != 1 || mb[0] > maxMaxBytes {
		return usageErrorf("--max-bytes %q: want one size, 1..%s", *maxBytes, sizeString(maxMaxBytes))
	}
	if slices.Min(bs) > mb[0] {
		return usageErrorf("--block-sizes %s: every size exceeds --max-bytes %s; want at least one <= %s",
			*blocks, sizeString(mb[0]), sizeString(mb[0]))
	}
	if err := checkDuration("cell-time", *cellTime, time.Nanosecond, maxCellTime); err != nil {
		return usageErrorf("--cell-time %v: want > 0s and <= %v", *cellTime, maxCellTime)
	}
	if err := checkInt("bulk-rounds", *rounds, 1, maxBulkRounds); err != nil {
		return err
	}
	if err := checkInt("latency-samples", *samples, 1, maxLatencySamples); err != nil {
		return err
	}
	res, err := demo.RunTransferBench(ctx, &demo.TransferConfig{BlockSizes: bs, BatchSizes: ns, MaxTransferBytes: mb[0],
		CellTime: *cellTime, BulkRounds: *rounds, LatencySamples: *samples, RTT: *rtt, Check: *check, Lanes: ks, Backend: be})
	if err != nil {
		if be != nil && errors.Is(err, cuda.ErrNoGPU) {
			return fmt.Errorf("--backend cuda: no GPU this process can use (%s): %w", *cudaLibrary, err)
		}
		return err
	}
	table := stdout
	if *asJSON {
		table = stderr
	}
	tw := tabwriter.NewWriter(table, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "op\tblock size\tbatch\txfers\tGB/s\tavg post us\tp99 post us\tavg tx us\tp99 tx us\tchecked\t")
	for _, r := range res.Rows {
		mark := ""
		if r.P99IsMax {
			mark = "*"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.3f\t%.1f\t%.1f%s\t%.1f\t%.1f%s\t%s\t\n", r.Op, sizeString(r.BlockSize), r.Batch,
			r.Transfers, r.GBPerS, r.AvgPostUs, r.P99PostUs, mark, r.AvgTxUs, r.P99TxUs, mark, sizeString(int(r.CheckedBytes)))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if slices.ContainsFunc(res.Rows, func(r demo.TransferRow) bool { return r.P99IsMax }) {
		fmt.Fprintf(table, "* fewer than %d transfers in the cell: p99 is their maximum\n", demo.P99MaxSamples+1)
	}
	for _, c := range res.Skipped {
		fmt.Fprintf(table, "note: skipped block %s × batch %d = %s, over --max-bytes %s\n", sizeString(c.BlockSize), c.Batch,
			sizeString(c.BlockSize*c.Batch), sizeString(mb[0]))
	}
	fmt.Fprintf(table, "\nbulk, %s in %s descriptors, loopback, best of %d:\n", sizeString(res.BulkBytes), sizeString(res.BulkBlockSize), *rounds)
	fmt.Fprintf(table, "  sidecar READ    %.3f GB/s\n  raw quic-go     %.3f GB/s  (sidecar/raw quic-go = %.3f)\n  TLS 1.3 over TCP %.3f GB/s (sidecar/TLS-TCP = %.3f)\n",
		res.SidecarReadGBPerS, res.RawQUICGBPerS, res.RatioSidecarOverRawQUIC, res.TLSTCPGBPerS, res.RatioSidecarOverTLSTCP)
	fmt.Fprintf(table, "  checksums       %.4fs CRC-32C of the bytes in %s pieces, recorded and verified = %.1f%% of the READ's time\n",
		res.ChecksumSeconds, sizeString(res.ChecksumUnitBytes), 100*res.ChecksumShareOfRead)
	fmt.Fprintf(table, "\nwarm small reads, loopback, %d samples each (p50 / p99 us):\n", res.LatencySamples)
	fmt.Fprintf(table, "  sidecar READ 4K   %.1f / %.1f\n  sidecar READ 64K  %.1f / %.1f\n  raw quic-go 4K    %.1f / %.1f  (sidecar/raw quic-go p50 = %.3f)\n",
		res.Read4KP50Us, res.Read4KP99Us, res.Read64KP50Us, res.Read64KP99Us, res.RawQUIC4KP50Us, res.RawQUIC4KP99Us, res.RatioRead4KOverRawQUIC)
	if err := printPaths(table, res, *rounds); err != nil {
		return err
	}
	if res.RTTMs > 0 {
		fmt.Fprintf(table, "\nREAD of %s at %.1f ms RTT (receive windows %s), packets declared lost %d:\n", sizeString(res.RTTBulkBytes), res.RTTMs,
			sizeString(int(res.RTTWindowBytes)), *res.RTTBulkLostPackets)
		fmt.Fprintf(table, "  after one 4K READ  %.3f GB/s, %.2f RTT\n  warm, best of %d   %.2f RTT\n", res.RTTBulkGBPerS, res.RTTBulkRTTs, *rounds, res.RTTBulkWarmRTTs)
	}
	if *asJSON {
		return printJSON(stdout, res)
	}
	return nil
}

// printPaths prints the path rows of a transfer bench and the floors
// beside them.
func printPaths(w io.Writer, res *demo.TransferResult, rounds int) error {
	device := res.PathMemory == "device"
	mem := "host backend, memfd pages"
	if device {
		mem = "cuda backend, device pages"
	}
	fmt.Fprintf(w, "\nsame-host and QUIC READs of %s in %s descriptors between two pools (%s), loopback, best of %d:\n",
		sizeString(res.PathBytes), sizeString(res.PathBlockBytes), mem, rounds)
	fmt.Fprintln(w, "  floors, measured in the same rounds:")
	fw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if device {
		fmt.Fprintf(fw, "    pinned device->host copy\t%8.3f GB/s\n", res.DeviceToHostFloorGBPerS)
		fmt.Fprintf(fw, "    pinned host->device copy\t%8.3f GB/s\n", res.HostToDeviceFloorGBPerS)
		fmt.Fprintf(fw, "    device copy, imported pages\t%8.3f GB/s\n", res.DeviceCopyFloorGBPerS)
	} else {
		fmt.Fprintf(fw, "    memcpy, one thread\t%8.3f GB/s  (K threads: the memcpy column)\n", res.MemcpyFloorGBPerS)
	}
	chunks := sizeString(res.PathBlockBytes)
	fmt.Fprintf(fw, "    raw quic-go, %s chunks\t%8.3f GB/s\n", chunks, res.PathRawQUICGBPerS)
	fmt.Fprintf(fw, "    TLS 1.3 over TCP, %s chunks\t%8.3f GB/s\n", chunks, res.PathTLSTCPGBPerS)
	if err := fw.Flush(); err != nil {
		return err
	}
	if !device {
		fmt.Fprintf(w, "  mmap (MAP_POPULATE) + munmap of the READ's %s of source pages, no copy: %.4fs = %.1f%% of the 1-lane same-host READ\n",
			sizeString(res.PathBytes), res.MapUnmapSeconds, 100*res.MapUnmapShareOfSameHostRead)
	}
	fmt.Fprintf(w, "  checksums: CRC-32C in %s pieces, record (source) %.4fs + verify (destination, a pass after the READ) %.4fs\n",
		sizeString(res.ChecksumUnitBytes), res.ChecksumRecordSeconds, res.ChecksumVerifySeconds)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	floor := "memcpy GB/s\t/memcpy"
	if device {
		floor = "/device copy"
	}
	fmt.Fprintf(tw, "K\t%s\tsame-host GB/s\tGB/CPU-s\tcrc share\t\tQUIC GB/s\t/raw quic-go\t/TLS-TCP\tGB/CPU-s\tcrc share\tsame-host/QUIC\t\n",
		floor)
	for _, l := range res.Lanes {
		fmt.Fprintf(tw, "%d\t", l.K)
		if device {
			fmt.Fprintf(tw, "%.3f\t", l.RatioSameHostOverDeviceCopy)
		} else {
			fmt.Fprintf(tw, "%.3f\t%.3f\t", l.MemcpyFloorGBPerS, l.RatioSameHostOverMemcpy)
		}
		fmt.Fprintf(tw, "%.3f\t%.3f\t%.1f%%\t\t%.3f\t%.3f\t%.3f\t%.3f\t%.1f%%\t%.1f\t\n", l.SameHostReadGBPerS, l.SameHostReadGBPerCPUSecond,
			100*l.SameHostChecksumShareOfRead, l.QUICReadGBPerS, l.RatioQUICOverRawQUIC, l.RatioQUICOverTLSTCP, l.QUICReadGBPerCPUSecond,
			100*l.QUICChecksumShareOfRead, l.RatioSameHostOverQUIC)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	over, ratio := "memcpy", res.RatioSameHostOverMemcpy
	if device {
		over, ratio = "device copy", res.RatioSameHostOverDeviceCopy
	}
	fmt.Fprintf(w, "  1 lane: same-host READ %.3f GB/s = %.3f x %s, %.1f x the QUIC READ (%.3f GB/s)\n",
		res.SameHostReadGBPerS, ratio, over, res.RatioSameHostOverQUIC, res.QUICReadGBPerS)
	fmt.Fprintln(w, "  (GB per CPU-second: both agents, all rounds; crc share: record + verify over the READ's time)")
	return nil
}

// parseLanes parses "1,2,4": lane counts in [1, transfer.MaxReadLanes],
// none twice.
func parseLanes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		k, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || k < 1 || k > transfer.MaxReadLanes {
			return nil, fmt.Errorf("%q: want a lane count 1..%d", strings.TrimSpace(f), transfer.MaxReadLanes)
		}
		if slices.Contains(out, k) {
			return nil, fmt.Errorf("%d appears twice", k)
		}
		out = append(out, k)
	}
	return out, nil
}

// parseSizes parses "4K,64K,1M" (K = KiB, M = MiB, G = GiB).
func parseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		mult := 1
		switch {
		case strings.HasSuffix(f, "K"):
			mult, f = 1<<10, strings.TrimSuffix(f, "K")
		case strings.HasSuffix(f, "M"):
			mult, f = 1<<20, strings.TrimSuffix(f, "M")
		case strings.HasSuffix(f, "G"):
			mult, f = 1<<30, strings.TrimSuffix(f, "G")
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%q is not a positive size", f)
		}
		if n > math.MaxInt/mult {
			return nil, fmt.Errorf("%q overflows", f)
		}
		out = append(out, n*mult)
	}
	return out, nil
}

func sizeString(n int) string {
	switch {
	case n == 0:
		return "-"
	case n%(1<<30) == 0:
		return fmt.Sprintf("%dG", n>>30)
	case n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return strconv.Itoa(n)
}
