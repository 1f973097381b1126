package demo

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"runtime"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/benchxfer"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
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
	// DefaultMaxTransferBytes caps block × batch; larger cells are skipped
	// (and listed in TransferResult.Skipped).
	DefaultMaxTransferBytes = 128 << 20
	// DefaultCellTime is how long each (op, block, batch) cell runs.
	DefaultCellTime = 200 * time.Millisecond
	// DefaultBulkRounds: the bulk comparison runs each contender this many
	// times, interleaved, and keeps each one's best.
	DefaultBulkRounds = 3
	// DefaultLatencySamples: warm small READs (and raw quic-go round trips)
	// timed per size for the latency percentiles.
	DefaultLatencySamples = 2000
	// DefaultRTTBulkBytes: the READ at an injected RTT moves 16 MiB.
	DefaultRTTBulkBytes = 16 << 20
	// maxPathBlockBytes bounds TransferConfig.PathBlockBytes: a block
	// never straddles a page, and pages are 2 MiB (the host backend's, and
	// the CUDA granularity of current GPUs).
	maxPathBlockBytes = 2 << 20
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
	// MaxTransferBytes caps block × batch and sizes the two registered
	// buffers (2 × MaxTransferBytes of memory, at least 64 KiB each). Cells above it are skipped;
	// at least one block size must fit. Default DefaultMaxTransferBytes.
	MaxTransferBytes int
	// CellTime is the time spent per cell (at least 3 transfers run).
	// Default DefaultCellTime.
	CellTime time.Duration
	// BulkRounds of the baseline comparison, and of the path rows with
	// their floors (best kept). Default DefaultBulkRounds.
	BulkRounds int
	// LatencySamples is the number of timed warm READs of one 4 KiB and of
	// one 64 KiB descriptor, and of raw quic-go 4 KiB round trips, run
	// interleaved. Default DefaultLatencySamples.
	LatencySamples int
	// RTT, when > 0, adds a bulk READ of RTTBulkBytes between a second pair
	// of agents whose sockets delay every datagram by RTT/2 (in order,
	// batches kept: internal/netem), with receive windows sized for the
	// bandwidth-delay product. Default 0: none.
	RTT time.Duration
	// RTTBulkBytes is the size of that READ, in 1 MiB descriptors (fewer
	// when MaxTransferBytes is smaller). Default DefaultRTTBulkBytes.
	RTTBulkBytes int
	// Check verifies every byte of every transfer (the destination is
	// zeroed before each one).
	Check bool
	// Lanes are the READ lane counts (transfer.Config.ReadLanes) of the
	// path rows (LaneRow), each in [1, transfer.MaxReadLanes], none twice;
	// K = 1 is always measured, first (the headline figures are its).
	// Default DefaultLanes.
	Lanes []int
	// PathBlockBytes is the descriptor size of the path rows' READs, a
	// multiple of 4096 in [4096, 2 MiB] (a block never straddles a page of
	// the pools); they move the bulk comparison's bytes (BulkBytes, in
	// whole descriptors, at least one; a descriptor of fewer bytes when
	// the bulk is smaller). Default DefaultPathBlockBytes.
	PathBlockBytes int
	// Backend returns the vmm backend of the path rows' two pools, side
	// "prefill" (the serving agent's) and "decode" (the readers'), rank
	// 0; the bench closes them. A backend whose memory is not
	// host-addressable (vmm/cuda) makes the path rows device memory, with
	// the cuda floors. It is called before anything is measured, so a
	// driver that does not load fails the run at once. Default nil: one
	// host backend (memfd) for both pools.
	Backend BackendFunc
	// Logger receives the agents' logs. Default nil: discard.
	Logger *slog.Logger
}

// TransferRow is one nixlbench-style line. Times are in microseconds: post
// is from calling Transfer until the request is on the wire (each
// transfer's own observation of kvsidecar_transfer_post_seconds), tx is
// the whole transfer as Transfer returned it. The p99 figures are nearest
// rank over the cell's Transfers samples; with at most P99MaxSamples of
// them (P99IsMax) they are the maximum.
type TransferRow struct {
	Op           string  `json:"op"`
	BlockSize    int     `json:"block_size"`
	Batch        int     `json:"batch"`
	Transfers    int     `json:"transfers"`
	GBPerS       float64 `json:"gb_per_s"`
	AvgPostUs    float64 `json:"avg_post_us"`
	P99PostUs    float64 `json:"p99_post_us"`
	AvgTxUs      float64 `json:"avg_tx_us"`
	P99TxUs      float64 `json:"p99_tx_us"`
	P99IsMax     bool    `json:"p99_is_max"`
	CheckedBytes uint64  `json:"checked_bytes"`
}

// SkippedCell is a (block size, batch) pair of the sweep left out because
// BlockSize × Batch exceeds TransferConfig.MaxTransferBytes.
type SkippedCell struct {
	BlockSize int `json:"block_size"`
	Batch     int `json:"batch"`
}

// TransferResult is the outcome of RunTransferBench; JSON names are stable
// (the CLI's --json prints it). Throughputs in GB/s (10^9 bytes/s).
type TransferResult struct {
	Rows []TransferRow `json:"rows"`
	// Skipped lists the cells over MaxTransferBytes, once for all ops.
	Skipped []SkippedCell `json:"skipped,omitempty"`
	// The bulk comparison: BulkBytes moved in descriptors (chunks) of
	// BulkBlockSize by a sidecar READ, one raw quic-go stream and Go TLS
	// 1.3 over TCP, on loopback, connection set-up excluded.
	// BulkBlockSize is the largest block size within MaxTransferBytes;
	// BulkBytes is as many of them as fit in MaxTransferBytes, at most
	// transfer.DefaultMaxDescsPerTransfer (one READ's descriptor limit).
	BulkBlockSize           int     `json:"bulk_block_size"`
	BulkBytes               int     `json:"bulk_bytes"`
	SidecarReadGBPerS       float64 `json:"sidecar_read_gb_per_s"`
	RawQUICGBPerS           float64 `json:"raw_quic_gb_per_s"`
	TLSTCPGBPerS            float64 `json:"tls_tcp_gb_per_s"`
	RatioSidecarOverRawQUIC float64 `json:"ratio_sidecar_over_raw_quic"`
	RatioSidecarOverTLSTCP  float64 `json:"ratio_sidecar_over_tls_tcp"`
	// The cost of end-to-end checksums (serve --checksums) on the bulk
	// READ's bytes: CRC-32C over them in pieces of ChecksumUnitBytes (one KV
	// head of one block of one region of DefaultModel, the unit the
	// connector checksums), twice (recorded on the prefill, verified on the
	// decode), best of BulkRounds; ChecksumShareOfRead is that time over the
	// sidecar READ's.
	ChecksumUnitBytes   int     `json:"checksum_unit_bytes"`
	ChecksumSeconds     float64 `json:"checksum_seconds"`
	ChecksumShareOfRead float64 `json:"checksum_share_of_read"`
	// Small reads on the warm connection, in microseconds, nearest rank
	// over LatencySamples each: a sidecar READ of one 4 KiB and one 64 KiB
	// descriptor (the wall time of Transfer), and a raw quic-go 4 KiB
	// request/response on a new stream of a warm connection (same TLS and
	// quic-go configuration). RatioRead4KOverRawQUIC is
	// Read4KP50Us / RawQUIC4KP50Us.
	LatencySamples         int     `json:"latency_samples"`
	Read4KP50Us            float64 `json:"read_4k_p50_us"`
	Read4KP99Us            float64 `json:"read_4k_p99_us"`
	Read64KP50Us           float64 `json:"read_64k_p50_us"`
	Read64KP99Us           float64 `json:"read_64k_p99_us"`
	RawQUIC4KP50Us         float64 `json:"raw_quic_4k_p50_us"`
	RawQUIC4KP99Us         float64 `json:"raw_quic_4k_p99_us"`
	RatioRead4KOverRawQUIC float64 `json:"ratio_read_4k_over_raw_quic"`
	// The path rows (TransferConfig.Lanes, Backend): PathBytes in
	// descriptors of PathBlockBytes read from one vmm pool into another,
	// on the same-host path and over QUIC, with K READ lanes each (Lanes,
	// K = 1 first), and the floors measured beside them in the same
	// rounds. PathMemory is "host" (memfd pages: the memcpy floor) or
	// "device" (the cuda backend: the pinned device→host and host→device
	// copies of the bytes, in runs contiguous in device memory, and the
	// device copy from the source pages imported into the destination's
	// backend); on both, raw quic-go and Go TLS 1.3 over TCP moving
	// PathBytes in chunks of PathBlockBytes (PathRawQUICGBPerS,
	// PathTLSTCPGBPerS), the QUIC READ's floors. The headline figures are those of K = 1: the same-host
	// and QUIC READs, their ratios, and the checksums' share of each.
	// Checksums: one CRC-32C pass over the source's bytes (recording, as
	// the prefill does at RequestFinished) and one over the destination's
	// (verifying, as the decode does once they landed), in pieces of
	// ChecksumUnitBytes, staged to the host for device memory, best of
	// BulkRounds; the verify pass runs after the READ, not fused with it
	// (ChecksumVerifyFused false: the transfer layer has no callback for
	// the bytes as they land yet). MapUnmapSeconds (host) is the mmap
	// with MAP_POPULATE and munmap of every source page a same-host READ
	// maps, without its copy, best of BulkRounds, and its share of the
	// one-lane same-host READ.
	PathMemory                  string    `json:"path_memory"`
	PathBlockBytes              int       `json:"path_block_bytes"`
	PathBytes                   int       `json:"path_bytes"`
	MemcpyFloorGBPerS           float64   `json:"memcpy_floor_gb_per_s,omitempty"`
	DeviceToHostFloorGBPerS     float64   `json:"device_to_host_floor_gb_per_s,omitempty"`
	HostToDeviceFloorGBPerS     float64   `json:"host_to_device_floor_gb_per_s,omitempty"`
	DeviceCopyFloorGBPerS       float64   `json:"device_copy_floor_gb_per_s,omitempty"`
	PathRawQUICGBPerS           float64   `json:"path_raw_quic_gb_per_s"`
	PathTLSTCPGBPerS            float64   `json:"path_tls_tcp_gb_per_s"`
	SameHostReadGBPerS          float64   `json:"same_host_read_gb_per_s"`
	QUICReadGBPerS              float64   `json:"quic_read_gb_per_s"`
	RatioSameHostOverMemcpy     float64   `json:"ratio_same_host_over_memcpy,omitempty"`
	RatioSameHostOverDeviceCopy float64   `json:"ratio_same_host_over_device_copy,omitempty"`
	RatioSameHostOverQUIC       float64   `json:"ratio_same_host_over_quic"`
	MapUnmapSeconds             float64   `json:"map_unmap_seconds,omitempty"`
	MapUnmapShareOfSameHostRead float64   `json:"map_unmap_share_of_same_host_read,omitempty"`
	ChecksumRecordSeconds       float64   `json:"checksum_record_seconds"`
	ChecksumVerifySeconds       float64   `json:"checksum_verify_seconds"`
	ChecksumVerifyFused         bool      `json:"checksum_verify_fused"`
	SameHostChecksumShareOfRead float64   `json:"same_host_checksum_share_of_read"`
	QUICChecksumShareOfRead     float64   `json:"quic_checksum_share_of_read"`
	Lanes                       []LaneRow `json:"lanes"`
	// The READ at an injected RTT (TransferConfig.RTT > 0; absent, and
	// no packets lost, otherwise): RTTBulkBytes in 1 MiB descriptors over a connection that
	// has carried one 4 KiB READ (so its congestion window starts small, as
	// on a fresh connection), its throughput and duration in RTTs; then the
	// best of BulkRounds more on the same connection (window grown:
	// RTTBulkWarmRTTs); the receive window used (RTTWindowBytes); and the
	// packets quic-go declared lost on both sides over all of them (nil
	// without an RTT, so the JSON leaves it out).
	RTTMs              float64 `json:"rtt_ms,omitempty"`
	RTTBulkBytes       int     `json:"rtt_bulk_bytes,omitempty"`
	RTTBulkGBPerS      float64 `json:"rtt_bulk_gb_per_s,omitempty"`
	RTTBulkRTTs        float64 `json:"rtt_bulk_rtts,omitempty"`
	RTTBulkWarmRTTs    float64 `json:"rtt_bulk_warm_rtts,omitempty"`
	RTTWindowBytes     uint64  `json:"rtt_window_bytes,omitempty"`
	RTTBulkLostPackets *int64  `json:"rtt_bulk_lost_packets,omitempty"`
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
	if out.LatencySamples == 0 {
		out.LatencySamples = DefaultLatencySamples
	}
	if out.RTTBulkBytes == 0 {
		out.RTTBulkBytes = DefaultRTTBulkBytes
	}
	if len(out.Lanes) == 0 {
		out.Lanes = DefaultLanes
	}
	if out.PathBlockBytes == 0 {
		out.PathBlockBytes = DefaultPathBlockBytes
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	bad := func(field, format string, a ...any) (TransferConfig, error) {
		return TransferConfig{}, fmt.Errorf("%w: TransferConfig.%s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, a...))
	}
	if out.MaxTransferBytes < 0 {
		return bad("MaxTransferBytes", "%d must be positive", out.MaxTransferBytes)
	}
	for i, b := range out.BlockSizes {
		if b < 1 {
			return bad("BlockSizes", "[%d]=%d must be at least 1", i, b)
		}
	}
	if slices.Min(out.BlockSizes) > out.MaxTransferBytes {
		return bad("BlockSizes", "every size exceeds MaxTransferBytes=%d; at least one must fit", out.MaxTransferBytes)
	}
	for i, b := range out.BatchSizes {
		if b < 1 || b > transfer.DefaultMaxDescsPerTransfer {
			return bad("BatchSizes", "[%d]=%d must be in [1, %d]", i, b, transfer.DefaultMaxDescsPerTransfer)
		}
	}
	for i, k := range out.Lanes {
		if k < 1 || k > transfer.MaxReadLanes {
			return bad("Lanes", "[%d]=%d must be in [1, %d]", i, k, transfer.MaxReadLanes)
		}
		if slices.Contains(out.Lanes[:i], k) {
			return bad("Lanes", "[%d]=%d appears twice", i, k)
		}
	}
	switch {
	case out.PathBlockBytes < 4096 || out.PathBlockBytes > maxPathBlockBytes || out.PathBlockBytes%4096 != 0:
		return bad("PathBlockBytes", "%d must be a multiple of 4096 in [4096, %d]", out.PathBlockBytes, maxPathBlockBytes)
	case out.CellTime < 0:
		return bad("CellTime", "%v must not be negative", out.CellTime)
	case out.BulkRounds < 1:
		return bad("BulkRounds", "%d must be at least 1", out.BulkRounds)
	case out.LatencySamples < 1:
		return bad("LatencySamples", "%d must be at least 1", out.LatencySamples)
	case out.RTT < 0:
		return bad("RTT", "%v must not be negative", out.RTT)
	case out.RTTBulkBytes < 0:
		return bad("RTTBulkBytes", "%d must be positive", out.RTTBulkBytes)
	}
	return out, nil
}

// skippedCells lists the (block, batch) cells of the sweep whose
// block × batch exceeds MaxTransferBytes, in sweep order.
func (c *TransferConfig) skippedCells() []SkippedCell {
	var out []SkippedCell
	for _, bs := range c.BlockSizes {
		for _, n := range c.BatchSizes {
			if bs*n > c.MaxTransferBytes {
				out = append(out, SkippedCell{BlockSize: bs, Batch: n})
			}
		}
	}
	return out
}

// bulkPlan picks the bulk comparison's shape: the largest block size
// within MaxTransferBytes, and as many of them as fit in MaxTransferBytes,
// at most transfer.DefaultMaxDescsPerTransfer (one READ's descriptor
// limit). c must have passed withDefaults (one block size fits).
func (c *TransferConfig) bulkPlan() (blockBytes, descs int) {
	for _, x := range c.BlockSizes {
		if x <= c.MaxTransferBytes {
			blockBytes = max(blockBytes, x)
		}
	}
	return blockBytes, min(c.MaxTransferBytes/blockBytes, transfer.DefaultMaxDescsPerTransfer)
}

// RunTransferBench runs the sweep (READ and WRITE, every block and batch
// size whose product fits MaxTransferBytes; the others are listed in
// Skipped) between two agents on loopback, then the bulk comparison against
// the raw quic-go and TLS-over-TCP baselines at the largest block size that
// fits. Errors: ErrInvalidConfig naming the field, a failed transfer, or
// context.Cause(ctx).
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
	// At least 64 KiB: the latency READs' largest descriptor.
	memBytes := max(c.MaxTransferBytes, 64<<10)
	srvMem, cliMem := make([]byte, memBytes), make([]byte, memBytes)
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
	// The path rows' pools and agents first: a backend that does not load
	// fails the run before anything is measured.
	bs, n := c.bulkPlan()
	pbs, pn := c.pathPlan(bs * n)
	if b.pb, err = newPathBench(ctx, c, pbs, pn, c.laneSet(), srvTLS, cliTLS); err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, b.pb.close()) }()
	// Warm the connection: set-up is not what the sweep measures.
	if _, err := b.xfer(ctx, transfer.OpRead, 4096, 1); err != nil {
		return nil, err
	}
	res := &TransferResult{Skipped: c.skippedCells()}
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
	if err := b.latency(ctx, res, srvTLS, cliTLS); err != nil {
		return nil, err
	}
	if err := b.paths(ctx, res, srvTLS, cliTLS); err != nil {
		return nil, err
	}
	if c.RTT > 0 {
		if err := b.rttBulk(ctx, res, srvTLS, cliTLS); err != nil {
			return nil, err
		}
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
	pb             *pathBench // the path rows
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
	prev, err := postHist(b.reg, label)
	if err != nil {
		return TransferRow{}, err
	}
	var txs, posts []time.Duration
	var txSum, postSum time.Duration
	start := time.Now()
	for len(txs) < 3 || time.Since(start) < b.c.CellTime {
		d, err := b.xfer(ctx, op, bs, n)
		if err != nil {
			return TransferRow{}, err
		}
		// One transfer at a time: the histogram grew by exactly this
		// transfer's post time.
		cur, err := postHist(b.reg, label)
		if err != nil {
			return TransferRow{}, err
		}
		if cur.count != prev.count+1 {
			return TransferRow{}, fmt.Errorf("demo: transfer bench %s %d × %d B: %d post observations for one transfer",
				op, n, bs, cur.count-prev.count)
		}
		p := time.Duration((cur.sum - prev.sum) * 1e9)
		prev = cur
		txs, txSum = append(txs, d), txSum+d
		posts, postSum = append(posts, p), postSum+p
	}
	slices.Sort(txs)
	slices.Sort(posts)
	k := len(txs)
	us := func(d time.Duration) float64 { return round(float64(d)/1e3, 1) }
	row := TransferRow{Op: op.String(), BlockSize: bs, Batch: n, Transfers: k,
		GBPerS:    round(float64(bs*n*k)/txSum.Seconds()/1e9, 4),
		AvgTxUs:   us(txSum / time.Duration(k)),
		P99TxUs:   us(nearestRank(txs, 0.99)),
		AvgPostUs: us(postSum / time.Duration(k)),
		P99PostUs: us(nearestRank(posts, 0.99)),
		P99IsMax:  k <= P99MaxSamples}
	if b.c.Check {
		row.CheckedBytes = uint64(bs * n * k)
	}
	return row, nil
}

// bulk compares a sidecar READ with the baselines at the largest block.
func (b *xferBench) bulk(ctx context.Context, res *TransferResult, st, ct *tls.Config) error {
	bs, n := b.c.bulkPlan()
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
	unit, err := checksumUnit()
	if err != nil {
		return err
	}
	var sums time.Duration
	for range b.c.BulkRounds {
		best(&sums, checksumCost(b.srvMem[:total], b.cliMem[:total], unit))
	}
	res.ChecksumUnitBytes, res.ChecksumSeconds = unit, round(sums.Seconds(), 6)
	res.ChecksumShareOfRead = round(sums.Seconds()/side.Seconds(), 4)
	gbPerS := func(d time.Duration) float64 { return float64(total) / d.Seconds() / 1e9 }
	res.SidecarReadGBPerS, res.RawQUICGBPerS, res.TLSTCPGBPerS = round(gbPerS(side), 4), round(gbPerS(raw), 4), round(gbPerS(tcp), 4)
	res.RatioSidecarOverRawQUIC = round(raw.Seconds()/side.Seconds(), 3)
	res.RatioSidecarOverTLSTCP = round(tcp.Seconds()/side.Seconds(), 3)
	return nil
}

// checksumUnit is the bytes the connector checksums at a time for
// DefaultModel: one KV head of one block of one region.
func checksumUnit() (int, error) {
	g, err := kvgeom.Model(DefaultModel)
	if err != nil {
		return 0, err
	}
	sh, err := connector.ShapeOf(g)
	if err != nil {
		return 0, err
	}
	return int(sh.HeadBlockBytes), nil
}

// checksumCost times CRC-32C over src and then dst in pieces of unit
// bytes: what recording (prefill) and verifying (decode) cost.
func checksumCost(src, dst []byte, unit int) time.Duration {
	tab := crc32.MakeTable(crc32.Castagnoli)
	start := time.Now()
	var sink uint32
	for _, m := range [][]byte{src, dst} {
		for off := 0; off < len(m); off += unit {
			sink ^= crc32.Update(0, tab, m[off:min(off+unit, len(m))])
		}
	}
	d := time.Since(start)
	runtime.KeepAlive(sink)
	return d
}

// hist is a snapshot of one histogram series: observations and their sum
// in seconds.
type hist struct {
	count uint64
	sum   float64
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
			return hist{count: h.GetSampleCount(), sum: h.GetSampleSum()}, nil
		}
	}
	return hist{}, nil // nothing observed yet
}

// latencyBatch is how many samples of one kind run back to back before the
// next kind's turn, so machine noise spreads over all kinds alike; each
// batch starts with latencyWarm untimed runs, so no kind pays for the
// switch from another (a 64 KiB READ leaves the connection's pacer and
// acknowledgements in another state than a 4 KiB one).
const (
	latencyBatch = 50
	latencyWarm  = 5
)

// latency times warm READs of one 4 KiB and one 64 KiB descriptor against
// raw quic-go 4 KiB round trips on a new stream of a warm connection,
// interleaved in batches.
func (b *xferBench) latency(ctx context.Context, res *TransferResult, st, ct *tls.Config) error {
	rt, err := benchxfer.NewRoundTripper(ctx, st, ct, transfer.QUICConfig(nil))
	if err != nil {
		return fmt.Errorf("demo: raw quic-go round trips: %w", err)
	}
	defer rt.Close()
	n := b.c.LatencySamples
	x4, x64 := b.readOne(4<<10), b.readOne(64<<10)
	kinds := []func() (time.Duration, error){
		func() (time.Duration, error) { return b.timedRead(ctx, x4) },
		func() (time.Duration, error) {
			d, err := rt.RoundTrip(ctx, 4<<10)
			if err != nil {
				return 0, fmt.Errorf("demo: raw quic-go round trip: %w", err)
			}
			return d, nil
		},
		func() (time.Duration, error) { return b.timedRead(ctx, x64) },
	}
	samples := make([][]time.Duration, len(kinds))
	for done := 0; done < n; done += latencyBatch {
		for i, run := range kinds {
			for j := range latencyWarm + min(latencyBatch, n-done) {
				d, err := run()
				if err != nil {
					return err
				}
				if j >= latencyWarm {
					samples[i] = append(samples[i], d)
				}
			}
		}
	}
	for _, s := range samples {
		slices.Sort(s)
	}
	r4, raw, r64 := samples[0], samples[1], samples[2]
	us := func(s []time.Duration, q float64) float64 { return round(float64(nearestRank(s, q))/1e3, 1) }
	res.LatencySamples = n
	res.Read4KP50Us, res.Read4KP99Us = us(r4, 0.5), us(r4, 0.99)
	res.Read64KP50Us, res.Read64KP99Us = us(r64, 0.5), us(r64, 0.99)
	res.RawQUIC4KP50Us, res.RawQUIC4KP99Us = us(raw, 0.5), us(raw, 0.99)
	res.RatioRead4KOverRawQUIC = round(float64(nearestRank(r4, 0.5))/float64(nearestRank(raw, 0.5)), 3)
	return nil
}

// readOne is a READ of one descriptor of bs bytes at the start of both
// buffers.
func (b *xferBench) readOne(bs int) *transfer.Xfer {
	return &transfer.Xfer{Op: transfer.OpRead, Peer: b.peer,
		Local:  []transfer.Desc{{Addr: b.cliReg.Base, Len: uint64(bs)}},
		Remote: []transfer.Desc{{Addr: b.srvReg.Base, Len: uint64(bs)}}}
}

// timedRead runs x and returns the wall time of the Transfer call.
func (b *xferBench) timedRead(ctx context.Context, x *transfer.Xfer) (time.Duration, error) {
	start := time.Now()
	if _, err := b.cli.Transfer(ctx, x); err != nil {
		return 0, fmt.Errorf("demo: transfer bench latency READ of %d B: %w", x.Local[0].Len, err)
	}
	return time.Since(start), nil
}
