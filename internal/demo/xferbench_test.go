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
		Ops: ops, MaxTransferBytes: 512 << 10, CellTime: time.Millisecond, BulkRounds: 1, Check: true})
	require.NoError(t, err)
	// 256K × 4 exceeds MaxTransferBytes and is skipped.
	require.Len(t, res.Rows, 3*len(ops))
	for _, r := range res.Rows {
		require.GreaterOrEqual(t, r.Transfers, 3, "%+v", r)
		require.Equal(t, uint64(r.BlockSize*r.Batch*r.Transfers), r.CheckedBytes, "%+v", r)
		require.Positive(t, r.GBps, "%+v", r)
		require.Positive(t, r.AvgPostUs, "%+v", r)
		require.GreaterOrEqual(t, r.P99TxUs, r.AvgTxUs*0.5, "%+v", r)
	}
	require.Equal(t, "READ", res.Rows[0].Op)
	require.Equal(t, ops[len(ops)-1].String(), res.Rows[len(res.Rows)-1].Op)
	require.Equal(t, 256<<10, res.BulkBlockSize)
	require.Equal(t, 512<<10, res.BulkBytes)
	b, err := json.Marshal(res)
	require.NoError(t, err)
	var got map[string]any
	require.NoError(t, json.Unmarshal(b, &got))
	for _, k := range []string{"ratio_sidecar_over_raw_quic", "ratio_sidecar_over_tls_tcp", "raw_quic_gbps", "tls_tcp_gbps", "sidecar_read_gbps"} {
		v, ok := got[k].(float64)
		require.True(t, ok, k)
		require.Positive(t, v, k)
	}
}

func TestTransferConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  TransferConfig
		want string
	}{
		{"block too big", TransferConfig{BlockSizes: []int{2 << 20}, MaxTransferBytes: 1 << 20}, "TransferConfig.BlockSizes: [0]=2097152 must be in [1, MaxTransferBytes=1048576]"},
		{"batch zero", TransferConfig{BatchSizes: []int{1, 0}}, "TransferConfig.BatchSizes: [1]=0 must be in [1, 65536]"},
		{"rounds", TransferConfig{BulkRounds: -1}, "TransferConfig.BulkRounds: -1 must be at least 1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := RunTransferBench(t.Context(), &tc.cfg)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}
