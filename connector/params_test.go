package connector_test

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

func validParams() *v1.KVTransferParams {
	return &v1.KVTransferParams{
		DoRemotePrefill:    true,
		RemoteEngineId:     "prefill-a",
		RemoteRequestId:    "cmpl-123",
		RemoteBlockIds:     []uint32{7, 8, 9},
		RemoteHost:         "10.0.0.1",
		RemotePort:         5600,
		TpSize:             proto.Uint32(2),
		RemoteRankAddrs:    []string{"10.0.0.1:5600", "10.0.0.2:5600"},
		RemoteIncarnation:  0xdeadbeefcafe,
		Capability:         []byte{1, 2, 3},
		LeaseExpiresUnixMs: 1_764_000_000_000,
	}
}

func TestParamsJSONFieldNames(t *testing.T) {
	b, err := connector.MarshalKVTransferParams(validParams())
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m))
	for _, k := range []string{"remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
		"remote_request_id", "tp_size", "do_remote_prefill", "remote_rank_addrs", "remote_incarnation",
		"capability", "lease_expires_unix_ms"} {
		require.Contains(t, m, k)
	}
	require.Equal(t, float64(2), m["tp_size"], "tp_size is a JSON number")
	require.Equal(t, float64(5600), m["remote_port"])
	require.Equal(t, []any{float64(7), float64(8), float64(9)}, m["remote_block_ids"])

	got, err := connector.UnmarshalKVTransferParams(b)
	require.NoError(t, err)
	require.True(t, proto.Equal(validParams(), got), "round trip: %v", got)
}

func TestParamsFromVLLM(t *testing.T) {
	// A dict as vLLM's NixlConnector builds it (request_finished), plus our
	// required tp_size and an unknown key vLLM may add.
	in := `{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [1, 2],
	  "remote_engine_id": "e1", "remote_request_id": "r1", "remote_host": "localhost",
	  "remote_port": 5600, "tp_size": 4, "some_future_key": {"x": 1}}`
	p, err := connector.UnmarshalKVTransferParams([]byte(in))
	require.NoError(t, err)
	require.Equal(t, uint32(4), p.GetTpSize())
	for r, want := range []string{"localhost:5600", "localhost:5601", "localhost:5602", "localhost:5603"} {
		got, err := connector.RankAddr(p, r)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	_, err = connector.RankAddr(p, 4)
	require.ErrorIs(t, err, connector.ErrInvalidParams)

	// The prefill-side request only asks to keep KV: no tp_size needed.
	p, err = connector.UnmarshalKVTransferParams([]byte(`{"do_remote_decode": true}`))
	require.NoError(t, err)
	require.True(t, p.GetDoRemoteDecode())
}

func TestParamsErrorsNameTheField(t *testing.T) {
	base := `"do_remote_prefill": true, "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 5600`
	tests := []struct {
		name, json, field, msg string
	}{
		{"missing tp_size", `{` + base + `}`, "tp_size",
			"connector: kv_transfer_params: tp_size: missing; the prefill TP size is required and never defaulted to 1"},
		{"null tp_size", `{` + base + `, "tp_size": null}`, "tp_size", ""},
		{"zero tp_size", `{` + base + `, "tp_size": 0}`, "tp_size", "connector: kv_transfer_params: tp_size=0: must be in [1, 1024]"},
		{"tp_size disagrees with addrs", `{` + base + `, "tp_size": 4, "remote_rank_addrs": ["a:1", "b:2"]}`, "remote_rank_addrs",
			"connector: kv_transfer_params: remote_rank_addrs=2 entries: must have exactly tp_size=4 entries, one per prefill rank"},
		{"bad rank addr", `{` + base + `, "tp_size": 2, "remote_rank_addrs": ["a:1", "b"]}`, "remote_rank_addrs[1]", ""},
		{"port overflow", `{"do_remote_prefill": true, "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 65535, "tp_size": 2}`, "remote_port", ""},
		{"missing engine", `{"do_remote_prefill": true, "remote_request_id": "r", "remote_host": "h", "remote_port": 1, "tp_size": 1}`, "remote_engine_id", ""},
		{"missing request", `{"do_remote_prefill": true, "remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "tp_size": 1}`, "remote_request_id", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := connector.UnmarshalKVTransferParams([]byte(tc.json))
			require.ErrorIs(t, err, connector.ErrInvalidParams)
			var pe *connector.ParamsError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, tc.field, pe.Field)
			if tc.msg != "" {
				require.EqualError(t, err, tc.msg)
			}
		})
	}

	t.Run("not JSON", func(t *testing.T) {
		_, err := connector.UnmarshalKVTransferParams([]byte(`{"tp_size": "two"`))
		require.ErrorIs(t, err, connector.ErrInvalidParams)
		require.ErrorContains(t, err, "cannot be decoded")
	})
}

// TestParamsDecodeErrorIsInvalidArgument: params that cannot be decoded
// are the caller's error, CODE_INVALID_ARGUMENT naming the field (they were
// CODE_INTERNAL), like every rule the decoded params break.
//
// fault-matrix: params-undecodable
func TestParamsDecodeErrorIsInvalidArgument(t *testing.T) {
	tests := []struct{ name, json, field string }{
		{"tp_size of another type", `{"do_remote_prefill": true, "tp_size": "two"}`, "tp_size"},
		{"block id beyond uint32", `{"do_remote_prefill": true, "remote_block_ids": [4294967296]}`, "remote_block_ids"},
		{"capability not base64", `{"rank_exports": [{"tp_rank": 0, "capability": "%%%"}]}`, "capability"},
		{"the second export's field", `{"rank_exports": [{"tp_rank": 0}, {"tpRank": "x"}]}`, "tp_rank"},
		{"a list that is not one", `{"rank_exports": 3, "tp_size": 1}`, "rank_exports"},
		{"truncated", `{"do_remote_prefill": true, "tp_size": 2`, "kv_transfer_params"},
		{"not an object", `[1, 2]`, "kv_transfer_params"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := connector.UnmarshalKVTransferParams([]byte(tc.json))
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err), "%v", err)
			require.ErrorIs(t, err, connector.ErrInvalidParams)
			var pe *connector.ParamsError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, tc.field, pe.Field, "%v", err)
			require.Equal(t, codes.ReasonParamsUndecodable, codes.ReasonOf(err))
			require.ErrorContains(t, err, "kv_transfer_params: "+tc.field)
		})
	}
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(fmt.Errorf("wrapped: %w", connector.ErrInvalidParams)))
}

// FuzzParamsJSON: any input decodes to validated params or an error naming
// why, never a panic; valid output re-encodes and decodes to the same params.
func FuzzParamsJSON(f *testing.F) {
	b, _ := connector.MarshalKVTransferParams(validParams())
	f.Add(b)
	f.Add([]byte(`{"do_remote_decode": true}`))
	f.Add([]byte(`{"do_remote_prefill": true, "tp_size": 99999999999}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		p, err := connector.UnmarshalKVTransferParams(in)
		if err != nil {
			require.ErrorIs(t, err, connector.ErrInvalidParams)
			return
		}
		out, err := connector.MarshalKVTransferParams(p)
		require.NoError(t, err)
		p2, err := connector.UnmarshalKVTransferParams(out)
		require.NoError(t, err)
		require.True(t, proto.Equal(p, p2))
	})
}
