package demo

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/transfer"
)

func TestTransferBenchShape(t *testing.T) {
	ops := []transfer.Op{transfer.OpRead, transfer.OpWrite}
	if raceEnabled {
		// A WRITE's bytes land in a serving goroutine that the dialer learns
		// about through a UDP ack, which the race detector cannot see: it
		// would flag the check (and later READs of the same bytes).
		ops = ops[:1]
	}
	res, err := RunTransferBench(t.Context(), &TransferConfig{BlockSizes: []int{4 << 10, 256 << 10}, BatchSizes: []int{1, 4},
		Ops: ops, MaxTransferBytes: 512 << 10, CellTime: time.Millisecond, BulkRounds: 1, LatencySamples: 7, Check: true})
	require.NoError(t, err)
	require.Equal(t, 7, res.LatencySamples)
	for _, p := range [][2]float64{{res.Read4KP50Us, res.Read4KP99Us}, {res.Read64KP50Us, res.Read64KP99Us}, {res.RawQUIC4KP50Us, res.RawQUIC4KP99Us}} {
		require.Positive(t, p[0])
		require.GreaterOrEqual(t, p[1], p[0], "p99 below p50")
	}
	require.InDelta(t, res.Read4KP50Us/res.RawQUIC4KP50Us, res.RatioRead4KOverRawQUIC, 0.01)
	// 256K × 4 exceeds MaxTransferBytes and is skipped.
	require.Len(t, res.Rows, 3*len(ops))
	require.Equal(t, []SkippedCell{{BlockSize: 256 << 10, Batch: 4}}, res.Skipped)
	for _, r := range res.Rows {
		require.GreaterOrEqual(t, r.Transfers, 3, "%+v", r)
		require.Equal(t, uint64(r.BlockSize*r.Batch*r.Transfers), r.CheckedBytes, "%+v", r)
		require.Positive(t, r.GBPerS, "%+v", r)
		require.Positive(t, r.AvgPostUs, "%+v", r)
		require.Equal(t, r.Transfers <= P99MaxSamples, r.P99IsMax, "%+v", r)
		if r.P99IsMax {
			// Nearest rank over so few samples is the maximum: never
			// below the mean.
			require.GreaterOrEqual(t, r.P99TxUs, r.AvgTxUs, "%+v", r)
			require.GreaterOrEqual(t, r.P99PostUs, r.AvgPostUs, "%+v", r)
		}
		require.LessOrEqual(t, r.AvgPostUs, r.AvgTxUs, "%+v: posting is part of the transfer", r)
	}
	require.Equal(t, "READ", res.Rows[0].Op)
	require.Equal(t, ops[len(ops)-1].String(), res.Rows[len(res.Rows)-1].Op)
	require.Equal(t, 256<<10, res.BulkBlockSize)
	require.Equal(t, 512<<10, res.BulkBytes)
	b, err := json.Marshal(res)
	require.NoError(t, err)
	var got map[string]any
	require.NoError(t, json.Unmarshal(b, &got))
	for _, k := range []string{"ratio_sidecar_over_raw_quic", "ratio_sidecar_over_tls_tcp", "raw_quic_gb_per_s", "tls_tcp_gb_per_s", "sidecar_read_gb_per_s",
		"read_4k_p50_us", "read_4k_p99_us", "read_64k_p50_us", "read_64k_p99_us", "raw_quic_4k_p50_us", "raw_quic_4k_p99_us"} {
		v, ok := got[k].(float64)
		require.True(t, ok, k)
		require.Positive(t, v, k)
	}
	checkPathFields(t, got, false, 512<<10, 512<<10, []int{1, 2, 4})
}

// checkPathFields checks the path rows of a transfer bench's JSON: every
// field of the backend's kind is there and positive (and none of the
// other kind's), and every ratio and share is the quotient of the fields
// it names.
func checkPathFields(t *testing.T, got map[string]any, device bool, blockBytes, pathBytes int, lanes []int) {
	t.Helper()
	num := func(m map[string]any, k string) float64 {
		t.Helper()
		v, ok := m[k].(float64)
		require.True(t, ok, "%s is in the JSON", k)
		require.Positive(t, v, k)
		return v
	}
	absent := func(m map[string]any, keys ...string) {
		t.Helper()
		for _, k := range keys {
			require.NotContains(t, m, k)
		}
	}
	quotient := func(want, num, den float64, what string) {
		t.Helper()
		require.InEpsilon(t, num/den, want, 1e-9, what)
	}
	require.Equal(t, map[bool]string{false: "host", true: "device"}[device], got["path_memory"])
	require.Equal(t, float64(blockBytes), got["path_block_bytes"])
	require.Equal(t, float64(pathBytes), got["path_bytes"])
	require.Equal(t, false, got["checksum_verify_fused"])
	hostFloors := []string{"memcpy_floor_gb_per_s", "ratio_same_host_over_memcpy", "map_unmap_seconds", "map_unmap_share_of_same_host_read"}
	deviceFloors := []string{"device_to_host_floor_gb_per_s", "host_to_device_floor_gb_per_s", "device_copy_floor_gb_per_s", "ratio_same_host_over_device_copy"}
	floorKey, ratioKey := "memcpy_floor_gb_per_s", "ratio_same_host_over_memcpy"
	if device {
		absent(got, hostFloors...)
		for _, k := range deviceFloors {
			num(got, k)
		}
		floorKey, ratioKey = "device_copy_floor_gb_per_s", "ratio_same_host_over_device_copy"
	} else {
		absent(got, deviceFloors...)
		for _, k := range hostFloors {
			num(got, k)
		}
	}
	sums := num(got, "checksum_record_seconds") + num(got, "checksum_verify_seconds")
	rawQUIC, tlsTCP := num(got, "path_raw_quic_gb_per_s"), num(got, "path_tls_tcp_gb_per_s")
	rows, ok := got["lanes"].([]any)
	require.True(t, ok, "lanes")
	require.Len(t, rows, len(lanes))
	for i, r := range rows {
		row := r.(map[string]any)
		require.Equal(t, float64(lanes[i]), row["k"])
		same, quic := num(row, "same_host_read_gb_per_s"), num(row, "quic_read_gb_per_s")
		sameSecs, quicSecs := num(row, "same_host_read_seconds"), num(row, "quic_read_seconds")
		num(row, "same_host_read_gb_per_cpu_second")
		num(row, "quic_read_gb_per_cpu_second")
		quotient(same, float64(pathBytes)/1e9, sameSecs, "same-host GB/s")
		quotient(quic, float64(pathBytes)/1e9, quicSecs, "QUIC GB/s")
		quotient(num(row, "ratio_same_host_over_quic"), same, quic, "same-host over QUIC")
		quotient(num(row, "ratio_quic_over_raw_quic"), quic, rawQUIC, "QUIC over raw quic-go")
		quotient(num(row, "ratio_quic_over_tls_tcp"), quic, tlsTCP, "QUIC over TLS-TCP")
		quotient(num(row, "same_host_checksum_share_of_read"), sums, sameSecs, "same-host checksum share")
		quotient(num(row, "quic_checksum_share_of_read"), sums, quicSecs, "QUIC checksum share")
		if device {
			absent(row, "memcpy_floor_gb_per_s", "ratio_same_host_over_memcpy")
			quotient(num(row, "ratio_same_host_over_device_copy"), same, num(got, "device_copy_floor_gb_per_s"), "same-host over device copy")
		} else {
			absent(row, "ratio_same_host_over_device_copy")
			quotient(num(row, "ratio_same_host_over_memcpy"), same, num(row, "memcpy_floor_gb_per_s"), "same-host over memcpy on K threads")
		}
		if i == 0 {
			require.Equal(t, same, got["same_host_read_gb_per_s"], "the headline is K=1's")
			require.Equal(t, quic, got["quic_read_gb_per_s"])
			require.Equal(t, row["ratio_same_host_over_quic"], got["ratio_same_host_over_quic"])
			require.Equal(t, row[ratioKey], got[ratioKey])
			require.Equal(t, row["same_host_checksum_share_of_read"], got["same_host_checksum_share_of_read"])
			require.Equal(t, row["quic_checksum_share_of_read"], got["quic_checksum_share_of_read"])
			if !device {
				require.Equal(t, row[floorKey], got[floorKey], "the one-thread memcpy is K=1's")
				quotient(num(got, "map_unmap_share_of_same_host_read"), num(got, "map_unmap_seconds"), sameSecs, "map+unmap share")
			}
		}
	}
}

func TestTransferConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  TransferConfig
		want string
	}{
		{"every block too big", TransferConfig{BlockSizes: []int{4 << 20, 2 << 20}, MaxTransferBytes: 1 << 20}, "TransferConfig.BlockSizes: every size exceeds MaxTransferBytes=1048576; at least one must fit"},
		{"block zero", TransferConfig{BlockSizes: []int{4096, 0}}, "TransferConfig.BlockSizes: [1]=0 must be at least 1"},
		{"max bytes", TransferConfig{MaxTransferBytes: -1}, "TransferConfig.MaxTransferBytes: -1 must be positive"},
		{"batch zero", TransferConfig{BatchSizes: []int{1, 0}}, "TransferConfig.BatchSizes: [1]=0 must be in [1, 65536]"},
		{"rounds", TransferConfig{BulkRounds: -1}, "TransferConfig.BulkRounds: -1 must be at least 1"},
		{"latency samples", TransferConfig{LatencySamples: -2}, "TransferConfig.LatencySamples: -2 must be at least 1"},
		{"rtt", TransferConfig{RTT: -time.Millisecond}, "TransferConfig.RTT: -1ms must not be negative"},
		{"lanes zero", TransferConfig{Lanes: []int{1, 0}}, "TransferConfig.Lanes: [1]=0 must be in [1, 16]"},
		{"lanes twice", TransferConfig{Lanes: []int{2, 4, 2}}, "TransferConfig.Lanes: [2]=2 appears twice"},
		{"path block", TransferConfig{PathBlockBytes: 5000}, "TransferConfig.PathBlockBytes: 5000 must be a multiple of 4096 in [4096, 2097152]"},
		{"path block over a page", TransferConfig{PathBlockBytes: 4 << 20}, "TransferConfig.PathBlockBytes: 4194304 must be a multiple of 4096"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := RunTransferBench(t.Context(), &tc.cfg)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

// TestTransferBenchSkipsAndCaps is a regression test: a block size above
// MaxTransferBytes failed the run although its cells are skipped, and the
// bulk run at small blocks asked for more descriptors than one transfer
// takes (131072, want 1..65536) after the table was printed. It checks the
// plan RunTransferBench follows (TestTransferBenchShape runs one on the
// wire); running this one would move 65536 descriptors of 8 bytes, whose
// time on a loaded machine says nothing about the plan.
func TestTransferBenchSkipsAndCaps(t *testing.T) {
	c, err := (&TransferConfig{BlockSizes: []int{8, 2 << 20}, BatchSizes: []int{1},
		Ops: []transfer.Op{transfer.OpRead}, MaxTransferBytes: 1 << 20, CellTime: time.Millisecond, BulkRounds: 1}).withDefaults()
	require.NoError(t, err)
	require.Equal(t, []SkippedCell{{BlockSize: 2 << 20, Batch: 1}}, c.skippedCells())
	bs, n := c.bulkPlan()
	require.Equal(t, 8, bs, "the largest block that fits")
	require.Equal(t, transfer.DefaultMaxDescsPerTransfer, n, "capped at one transfer's descriptors")
	// Without the descriptor cap the plan is as many blocks as fit.
	c.BlockSizes = []int{4 << 10, 2 << 20}
	bs, n = c.bulkPlan()
	require.Equal(t, 4<<10, bs)
	require.Equal(t, 256, n)
}

// TestTransferBenchRTT: the READ at an injected RTT goes through sockets
// that delay every datagram, so it cannot take less than one round trip
// (its request and its bytes), and it moves the bytes asked for.
func TestTransferBenchRTT(t *testing.T) {
	const rtt = 4 * time.Millisecond
	res, err := RunTransferBench(t.Context(), &TransferConfig{BlockSizes: []int{64 << 10}, BatchSizes: []int{1},
		Ops: []transfer.Op{transfer.OpRead}, MaxTransferBytes: 3 << 20, CellTime: time.Millisecond, BulkRounds: 1,
		LatencySamples: 1, RTT: rtt, RTTBulkBytes: 3<<20 - 5})
	require.NoError(t, err)
	require.Equal(t, 4.0, res.RTTMs)
	require.Equal(t, 3<<20-5, res.RTTBulkBytes)
	require.GreaterOrEqual(t, res.RTTBulkRTTs, 1.0, "faster than the round trip the delay imposes")
	require.GreaterOrEqual(t, res.RTTBulkWarmRTTs, 1.0)
	require.InDelta(t, float64(res.RTTBulkBytes)/(res.RTTBulkRTTs*rtt.Seconds())/1e9, res.RTTBulkGBPerS, res.RTTBulkGBPerS*0.02+1e-4)
	require.GreaterOrEqual(t, res.RTTWindowBytes, uint64(transfer.DefaultMaxStreamWindow))
}

// TestTransferBenchPathPlan: the path rows read the bulk's bytes in
// descriptors of PathBlockBytes (fewer bytes when the bulk is smaller,
// rounded up to 4 KiB), and always measure one lane first.
func TestTransferBenchPathPlan(t *testing.T) {
	c, err := (&TransferConfig{Lanes: []int{4, 2}}).withDefaults()
	require.NoError(t, err)
	require.Equal(t, []int{1, 4, 2}, c.laneSet(), "K=1 first, then the others in their order")
	c.Lanes = []int{2, 1}
	require.Equal(t, []int{1, 2}, c.laneSet())
	for _, tc := range []struct{ bulk, block, descs int }{
		{128 << 20, 1 << 20, 128},
		{512 << 10, 512 << 10, 1},
		{3<<20 + 5, 1 << 20, 3},
		{1000, 4096, 1},
	} {
		bs, n := c.pathPlan(tc.bulk)
		require.Equal(t, [2]int{tc.block, tc.descs}, [2]int{bs, n}, "bulk of %d bytes", tc.bulk)
	}
}
