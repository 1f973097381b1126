package connector_test

import (
	"math"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestParamsErrorCode: a *ParamsError carries CODE_INVALID_ARGUMENT, so
// bad kv_transfer_params crossing the local API are reported as the
// caller's error, not as CODE_INTERNAL.
func TestParamsErrorCode(t *testing.T) {
	p := &v1.KVTransferParams{DoRemotePrefill: true, RemoteEngineId: "e", RemoteRequestId: "r"}
	err := connector.ValidateRemotePrefill(p)
	require.ErrorIs(t, err, connector.ErrInvalidParams)
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err))
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.ToProto(err).GetCode())
}

// TestRemoteBlockIDsOutOfRange: remote_block_ids beyond the prefill's
// num_blocks fail the load with an error naming the entry, and nothing is
// read (before the fix the prefill refused the descriptor as outside its
// regions, with a message naming no field).
func TestRemoteBlockIDsOutOfRange(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8})
	reg := prometheus.NewRegistry()
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8, reg: reg})
	tests := []struct {
		name string
		id   uint32
		want string
	}{
		{"just beyond num_blocks", 64, "remote_block_ids[1]=64: outside [1, 64)"},
		{"far beyond the regions", math.MaxUint32, "remote_block_ids[1]=4294967295: outside [1, 64)"},
		{"the null block", 0, "remote_block_ids[1]=0: outside [1, 64)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			blocks := pre.alloc(t, 2)
			pre.fill(t, 5, blocks)
			params := pre.finish(t, tc.name, blocks)
			params.RemoteBlockIds[1] = tc.id
			dec.startLoad(t, tc.name, dec.alloc(t, 2), params)
			f := dec.wait(t, tc.name)[0]
			require.NotNil(t, f, "the load must fail")
			require.ErrorIs(t, f.Err, connector.ErrInvalidParams)
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(f.Err))
			require.ErrorContains(t, f.Err, tc.want)
			require.Zero(t, counter(t, reg, "kvsidecar_transfer_bytes_total"), "no bytes moved")
		})
	}
}

// TestHandshakeErrorsNameTheParams: a load whose handshake fails because
// of the params says which kv_transfer_params fields it expected.
func TestHandshakeErrorsNameTheParams(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8})
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8})
	blocks := pre.alloc(t, 1)
	params := pre.finish(t, "r", blocks)
	params.RemoteEngineId = "nope"
	dec.startLoad(t, "r", dec.alloc(t, 1), params)
	f := dec.wait(t, "r")[0]
	require.NotNil(t, f, "the load must fail")
	require.Equal(t, v1.Code_CODE_NOT_FOUND, codes.Of(f.Err))
	require.ErrorContains(t, f.Err, `prefill rank 0 at `+pre.addrs[0]+` (kv_transfer_params remote_engine_id="nope" tp_size=1)`)
}
