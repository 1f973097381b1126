package e2e

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestChecksumsOverwrittenAfterExport: with checksums on (serve's
// default) a block the prefill engine overwrites after RequestFinished
// arrives intact over QUIC but is reported as a load error for exactly
// that block, never done; the other blocks land byte-exact and the
// prefill is notified. A request whose kv_transfer_params say
// "checksums": false gets an export without them.
//
// fault-matrix: checksum-mismatch
func TestChecksumsOverwrittenAfterExport(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "prefill-c", 256, "--role", "prefill")
	dec := startSide(t, env, "decode-c", 256, "--role", "decode")
	const key = 5
	p := pre.export(t, "req-c", key, 4)
	e := connector.ExportOf(p, 0)
	require.Equal(t, uint32(8), e.GetChecksumHeads(), "one CRC per KV head of the rank")
	require.Len(t, e.GetBlockChecksums(), 4*4*8)
	// The engine writes into block 2 after the export.
	pre.e.fill(t, 77, p.GetRemoteBlockIds()[2:3])

	dst := dec.load(t, "dec-c", p)
	f := dec.outcome(t, "dec-c", 30*time.Second)
	require.NotNil(t, f, "a load with an overwritten block was reported done")
	require.Equal(t, v1.Code_CODE_DATA_LOSS, f.GetError().GetCode(), f.GetError().GetMessage())
	require.Equal(t, []uint32{dst[2]}, f.GetBlockIds(), "exactly the block that differs is recomputed")
	require.Contains(t, f.GetError().GetMessage(), "1 of 4 blocks differ from the CRC-32C their prefill recorded")
	dec.e.checkAt(t, shape, key, dst[:2], 0)
	dec.e.checkAt(t, shape, key, dst[3:], 3)
	pre.waitSent(t, "req-c", 30*time.Second)
	dec.free(t, dst)

	src, err := pre.e.Alloc(t.Context(), 2)
	require.NoError(t, err)
	off, err := pre.e.RequestFinished(t.Context(), "req-off", src, v1.FinishStatus_FINISH_STATUS_LENGTH,
		&v1.KVTransferParams{DoRemoteDecode: true, Checksums: new(false)})
	require.NoError(t, err)
	require.Empty(t, connector.ExportOf(off, 0).GetBlockChecksums(), "the request turned checksums off")
	dst = dec.load(t, "dec-off", off)
	require.Nil(t, dec.outcome(t, "dec-off", 30*time.Second))
	pre.waitSent(t, "req-off", 30*time.Second)
	dec.free(t, dst)
	pre.requireIdle(t)
	dec.requireIdle(t)
}
