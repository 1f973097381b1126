package demo

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/internal/benchxfer"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// Defaults of TransferConfig.
var (
	// DefaultBlockSizes: 4 KiB … 64 MiB, every 16×, the span nixlbench's
	// default sweep covers.
	DefaultBlockSizes = []int{4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20}
	// DefaultBatchSizes: one descriptor, and a batch of 16.
	DefaultBatchSizes = []int{1, 16}
)

const (
	// DefaultMaxTransferBytes caps block × batch; larger cells are skipped.
	DefaultMaxTransferBytes = 128 << 20
	// DefaultCellTime is how long each (op, block, batch) cell runs.
	DefaultCellTime = 200 * time.Millisecond
	// DefaultBulkRounds: the bulk comparison runs each contender this many
	// times, interleaved, and keeps each one's best.
	DefaultBulkRounds = 3
)

// TransferConfig configures RunTransferBench; the zero value (and nil)
// runs the default sweep.
type TransferConfig struct {
	// BlockSizes are descriptor sizes in bytes. Default DefaultBlockSizes.
	BlockSizes []int
	// BatchSizes are descriptors per transfer. Default DefaultBatchSizes.
	BatchSizes []int
	// Ops swept, in order. Default READ then WRITE.
	Ops []transfer.Op
	// MaxTransferBytes caps block × batch and sizes the registered buffers.
	// Default DefaultMaxTransferBytes.
	MaxTransferBytes int
	// CellTime is the time spent per cell (at least 3 transfers run).
	// Default DefaultCellTime.
	CellTime time.Duration
	// BulkRounds of the baseline comparison. Default DefaultBulkRounds.
	BulkRounds int
	// Check verifies every byte of every transfer (the destination is
	// zeroed before each one).
	Check bool
	// Logger receives the agents' logs. Default nil: discard.
	Logger *slog.Logger
}

// TransferRow is one nixlbench-style line. Times are in microseconds: post
// is from calling Transfer until the request is on the wire (from
// kvsidecar_transfer_post_seconds, p99 interpolated in its buckets), tx is
// the whole transfer as Transfer returned it.
type TransferRow struct {
	Op           string  `json:"op"`
	BlockSize    int     `json:"block_size"`
	Batch        int     `json:"batch"`
	Transfers    int     `json:"transfers"`
	GBps         float64 `json:"gbps"`
	AvgPostUs    float64 `json:"avg_post_us"`
	P99PostUs    float64 `json:"p99_post_us"`
	AvgTxUs      float64 `json:"avg_tx_us"`
	P99TxUs      float64 `json:"p99_tx_us"`
	CheckedBytes uint64  `json:"checked_bytes"`
}

// TransferResult is the outcome of RunTransferBench; JSON names are stable
// (the CLI's --json prints it). Throughputs in GB/s (10^9 bytes/s).
type TransferResult struct {
	Rows []TransferRow `json:"rows"`
	// The bulk comparison: BulkBytes moved in descriptors (chunks) of
	// BulkBlockSize by a sidecar READ, one raw quic-go stream and Go TLS
	// 1.3 over TCP, on loopback, connection set-up excluded.
	BulkBlockSize           int     `json:"bulk_block_size"`
	BulkBytes               int     `json:"bulk_bytes"`
	SidecarReadGBps         float64 `json:"sidecar_read_gbps"`
	RawQUICGBps             float64 `json:"raw_quic_gbps"`
	TLSTCPGBps              float64 `json:"tls_tcp_gbps"`
	RatioSidecarOverRawQUIC float64 `json:"ratio_sidecar_over_raw_quic"`
	RatioSidecarOverTLSTCP  float64 `json:"ratio_sidecar_over_tls_tcp"`
}

func (c *TransferConfig) withDefaults() (TransferConfig, error) {
	var out TransferConfig
	if c != nil {
		out = *c
	}
	if len(out.BlockSizes) == 0 {
		out.BlockSizes = DefaultBlockSizes
	}
	if len(out.BatchSizes) == 0 {
		out.BatchSizes = DefaultBatchSizes
	}
	if len(out.Ops) == 0 {
		out.Ops = []transfer.Op{transfer.OpRead, transfer.OpWrite}
	}
	for i, op := range out.Ops {
		if op != transfer.OpRead && op != transfer.OpWrite {
			return TransferConfig{}, fmt.Errorf("%w: TransferConfig.Ops: [%d]=%v is neither OpRead nor OpWrite", ErrInvalidConfig, i, op)
		}
	}
	if out.MaxTransferBytes == 0 {
		out.MaxTransferBytes = DefaultMaxTransferBytes
	}
	if out.CellTime == 0 {
		out.CellTime = DefaultCellTime
	}
	if out.BulkRounds == 0 {
		out.BulkRounds = DefaultBulkRounds
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	bad := func(field, format string, a ...any) (TransferConfig, error) {
		return TransferConfig{}, fmt.Errorf("%w: TransferConfig.%s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, a...))
	}
	for i, b := range out.BlockSizes {
		if b < 1 || b > out.MaxTransferBytes {
			return bad("BlockSizes", "[%d]=%d must be in [1, MaxTransferBytes=%d]", i, b, out.MaxTransferBytes)
		}
	}
	for i, b := range out.BatchSizes {
		if b < 1 || b > transfer.DefaultMaxDescsPerTransfer {
			return bad("BatchSizes", "[%d]=%d must be in [1, %d]", i, b, transfer.DefaultMaxDescsPerTransfer)
		}
	}
	switch {
	case out.MaxTransferBytes < 0:
		return bad("MaxTransferBytes", "%d must be positive", out.MaxTransferBytes)
	case out.CellTime < 0:
		return bad("CellTime", "%v must not be negative", out.CellTime)
	case out.BulkRounds < 1:
		return bad("BulkRounds", "%d must be at least 1", out.BulkRounds)
	}
	return out, nil
}

// RunTransferBench runs the sweep (READ and WRITE, every block and batch
// size) between two agents on loopback, then the bulk comparison against
// the raw quic-go and TLS-over-TCP baselines at the largest block size.
func RunTransferBench(ctx context.Context, cfg *TransferConfig) (_ *TransferResult, err error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	ca, err := devtls.NewCA()
	if err != nil {
		return nil, err
	}
	srvTLS, err := ca.ServerConfig()
	if err != nil {
		return nil, err
	}
	cliTLS, err := ca.ClientConfig()
	if err != nil {
		return nil, err
	}
	srvMem, cliMem := make([]byte, c.MaxTransferBytes), make([]byte, c.MaxTransferBytes)
	_, _ = crand.Read(srvMem[:min(len(srvMem), 1<<20)])
	for off := 1 << 20; off < len(srvMem); off *= 2 {
		copy(srvMem[off:], srvMem[:off])
	}
	copy(cliMem, srvMem) // WRITE sources the client buffer
	srvReg, cliReg := transfer.SliceRegion(srvMem, 0, 0), transfer.SliceRegion(cliMem, 0, 0)
	allow := func(context.Context, *transfer.Access) error { return nil }
	srv, err := transfer.New(&transfer.Config{ServerTLS: srvTLS, Regions: []transfer.Region{srvReg}, Authorize: allow, Logger: c.Logger})
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, srv.Close()) }()
	reg := prometheus.NewRegistry()
	cli, err := transfer.New(&transfer.Config{ClientTLS: cliTLS, Regions: []transfer.Region{cliReg}, Logger: c.Logger, Registerer: reg})
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, cli.Close()) }()
	peer := srv.Addr().String()
	b := &xferBench{c: c, cli: cli, peer: peer, reg: reg, srvReg: srvReg, cliReg: cliReg, srvMem: srvMem, cliMem: cliMem}
	// Warm the connection: set-up is not what the sweep measures.
	if _, err := b.xfer(ctx, transfer.OpRead, 4096, 1); err != nil {
		return nil, err
	}
	res := &TransferResult{}
	for _, op := range c.Ops {
		for _, bs := range c.BlockSizes {
			for _, n := range c.BatchSizes {
				if bs*n > c.MaxTransferBytes {
					continue
				}
				row, err := b.cell(ctx, op, bs, n)
				if err != nil {
					return nil, err
				}
				res.Rows = append(res.Rows, row)
			}
		}
	}
	if err := b.bulk(ctx, res, srvTLS, cliTLS); err != nil {
		return nil, err
	}
	return res, nil
}

type xferBench struct {
	c              TransferConfig
	cli            *transfer.Agent
	peer           string
	reg            *prometheus.Registry
	srvReg, cliReg transfer.Region
	srvMem, cliMem []byte
}

// xfer runs one transfer of n descriptors of bs bytes, checking the bytes
// when asked; it returns the transfer's duration.
func (b *xferBench) xfer(ctx context.Context, op transfer.Op, bs, n int) (time.Duration, error) {
	x := &transfer.Xfer{Op: op, Peer: b.peer}
	for i := range n {
		off := uint64(i * bs)
		x.Local = append(x.Local, transfer.Desc{Addr: b.cliReg.Base + off, Len: uint64(bs)})
		x.Remote = append(x.Remote, transfer.Desc{Addr: b.srvReg.Base + off, Len: uint64(bs)})
	}
	total := bs * n
	src, dst := b.srvMem[:total], b.cliMem[:total]
	if op == transfer.OpWrite {
		src, dst = b.cliMem[:total], b.srvMem[:total]
	}
	if b.c.Check {
		clear(dst)
	}
	res, err := b.cli.Transfer(ctx, x)
	if err != nil {
		return 0, fmt.Errorf("demo: transfer bench %s %d × %d B: %w", op, n, bs, err)
	}
	if b.c.Check {
		if i := firstDiff(src, dst); i >= 0 {
			return 0, fmt.Errorf("demo: transfer bench %s %d × %d B: byte %d differs after the transfer", op, n, bs, i)
		}
		copy(dst, src) // restore, so the next WRITE/READ source is intact
	}
	return res.Duration, nil
}

func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

func (b *xferBench) cell(ctx context.Context, op transfer.Op, bs, n int) (TransferRow, error) {
	label := "read"
	if op == transfer.OpWrite {
		label = "write"
	}
	before, err := postHist(b.reg, label)
	if err != nil {
		return TransferRow{}, err
	}
	var ds []time.Duration
	var sum time.Duration
	start := time.Now()
	for len(ds) < 3 || time.Since(start) < b.c.CellTime {
		d, err := b.xfer(ctx, op, bs, n)
		if err != nil {
			return TransferRow{}, err
		}
		ds, sum = append(ds, d), sum+d
	}
	after, err := postHist(b.reg, label)
	if err != nil {
		return TransferRow{}, err
	}
	slices.Sort(ds)
	row := TransferRow{Op: op.String(), BlockSize: bs, Batch: n, Transfers: len(ds),
		GBps:    round(float64(bs*n*len(ds))/sum.Seconds()/1e9, 4),
		AvgTxUs: round(float64(sum)/float64(len(ds))/1e3, 1),
		P99TxUs: round(float64(ds[min(len(ds)-1, (len(ds)*99+99)/100-1)])/1e3, 1)}
	row.AvgPostUs, row.P99PostUs = after.since(before)
	if b.c.Check {
		row.CheckedBytes = uint64(bs * n * len(ds))
	}
	return row, nil
}

// bulk compares a sidecar READ with the baselines at the largest block.
func (b *xferBench) bulk(ctx context.Context, res *TransferResult, st, ct *tls.Config) error {
	bs := slices.Max(b.c.BlockSizes)
	n := max(b.c.MaxTransferBytes/bs, 1)
	total := bs * n
	res.BulkBlockSize, res.BulkBytes = bs, total
	best := func(cur *time.Duration, d time.Duration) {
		if *cur == 0 || d < *cur {
			*cur = d
		}
	}
	var side, raw, tcp time.Duration
	for range b.c.BulkRounds {
		d, err := b.xfer(ctx, transfer.OpRead, bs, n)
		if err != nil {
			return err
		}
		best(&side, d)
		if d, err = benchxfer.RawQUIC(ctx, total, bs, st, ct, transfer.QUICConfig(nil)); err != nil {
			return fmt.Errorf("demo: raw quic-go baseline: %w", err)
		}
		best(&raw, d)
		if d, err = benchxfer.TLSTCP(ctx, total, bs, st, ct); err != nil {
			return fmt.Errorf("demo: TLS-over-TCP baseline: %w", err)
		}
		best(&tcp, d)
	}
	gbps := func(d time.Duration) float64 { return float64(total) / d.Seconds() / 1e9 }
	res.SidecarReadGBps, res.RawQUICGBps, res.TLSTCPGBps = round(gbps(side), 4), round(gbps(raw), 4), round(gbps(tcp), 4)
	res.RatioSidecarOverRawQUIC = round(raw.Seconds()/side.Seconds(), 3)
	res.RatioSidecarOverTLSTCP = round(tcp.Seconds()/side.Seconds(), 3)
	return nil
}

// hist is a snapshot of one histogram series.
type hist struct {
	count  uint64
	sum    float64
	bounds []float64
	cum    []uint64
}

func postHist(g prometheus.Gatherer, op string) (hist, error) {
	mfs, err := g.Gather()
	if err != nil {
		return hist{}, err
	}
	for _, mf := range mfs {
		if mf.GetName() != "kvsidecar_transfer_post_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			lv := ""
			for _, l := range m.GetLabel() {
				if l.GetName() == "op" {
					lv = l.GetValue()
				}
			}
			if lv != op {
				continue
			}
			h := m.GetHistogram()
			out := hist{count: h.GetSampleCount(), sum: h.GetSampleSum()}
			for _, bk := range h.GetBucket() {
				out.bounds = append(out.bounds, bk.GetUpperBound())
				out.cum = append(out.cum, bk.GetCumulativeCount())
			}
			return out, nil
		}
	}
	return hist{}, nil // nothing observed yet
}

// since returns the mean and the p99 (linear inside its bucket) of the
// observations between before and h, in microseconds.
func (h hist) since(before hist) (avgUs, p99Us float64) {
	n := h.count - before.count
	if n == 0 {
		return 0, 0
	}
	avgUs = (h.sum - before.sum) / float64(n) * 1e6
	target := 0.99 * float64(n)
	lo, prev := 0.0, uint64(0)
	for i, ub := range h.bounds {
		c := h.cum[i]
		if i < len(before.cum) {
			c -= before.cum[i]
		}
		if float64(c) >= target {
			frac := (target - float64(prev)) / float64(max(c-prev, 1))
			return round(avgUs, 1), round((lo+frac*(ub-lo))*1e6, 1)
		}
		lo, prev = ub, c
	}
	return round(avgUs, 1), round(lo*1e6, 1) // beyond the last bucket: its bound, a floor
}
