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
	// Every block verified on the same-host path too (it samples by
	// default: TestSameHostChecksumsSample).
	dec := startSide(t, env, "decode-c", 256, "--role", "decode", "--same-host-verify-every", "1")
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

	requestChecksums(t, pre, dec, "req-off", false)
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// TestChecksumsOffServeFlag: a prefill started with `serve
// --checksums=false` exports params that carry no checksums, so what the
// prefill's memory holds when the READ runs is what the decode gets, and it
// is reported done: a block overwritten after the export and a byte
// flipped in another land as they are (what checksums exist to catch), no
// mismatch is counted. A request's kv_transfer_params "checksums": true
// still turns them on for that request.
//
// fault-matrix: checksums-off
func TestChecksumsOffServeFlag(t *testing.T) {
	env := NewEnv(t)
	pre := startSide(t, env, "prefill-co", 256, "--role", "prefill", "--checksums=false")
	dec := startSide(t, env, "decode-co", 256, "--role", "decode")
	const key = 6
	p := pre.export(t, "req-co", key, 4)
	e := connector.ExportOf(p, 0)
	require.NotNil(t, e)
	require.Empty(t, e.GetBlockChecksums(), "serve --checksums=false: the export carries no checksums")
	require.Zero(t, e.GetChecksumHeads())
	src := p.GetRemoteBlockIds()
	// After the export the engine writes into block 2, and one byte of
	// block 0 changes in the prefill's memory.
	pre.e.fill(t, 77, src[2:3])
	flip, err := pre.e.Block(1, int(src[0]))
	require.NoError(t, err)
	flip[100] ^= 0xff

	dst := dec.load(t, "dec-co", p)
	require.Nil(t, dec.outcome(t, "dec-co", 30*time.Second), "without checksums the load is reported done")
	dec.e.checkAt(t, shape, key, dst[1:2], 1)
	dec.e.checkAt(t, shape, key, dst[3:], 3)
	dec.e.checkAt(t, shape, 77, dst[2:3], 0) // the overwritten block, as overwritten
	got, err := dec.e.Block(1, int(dst[0]))
	require.NoError(t, err)
	require.Equal(t, flip, got, "the flipped byte landed as flipped")
	require.Zero(t, dec.Sidecar.Metric(t, "kvsidecar_connector_checksum_mismatches_total"), "nothing to check, no mismatch")
	pre.waitSent(t, "req-co", 30*time.Second)
	dec.free(t, dst)

	// A request that asks for checksums gets them despite the flag.
	requestChecksums(t, pre, dec, "req-on", true)
	pre.requireIdle(t)
	dec.requireIdle(t)
}

// requestChecksums finishes a request of 2 blocks on pre whose
// kv_transfer_params set "checksums" to on, checks that its export carries
// a CRC-32C per block and KV head (8 heads, 4 regions) or none, and loads
// it on dec, which reports it done.
func requestChecksums(t *testing.T, pre, dec *side, id string, on bool) {
	t.Helper()
	src, err := pre.e.Alloc(t.Context(), 2)
	require.NoError(t, err)
	p, err := pre.e.RequestFinished(t.Context(), id, src, v1.FinishStatus_FINISH_STATUS_LENGTH,
		&v1.KVTransferParams{DoRemoteDecode: true, Checksums: new(on)})
	require.NoError(t, err)
	want := 0
	if on {
		want = 2 * 4 * 8
	}
	require.Len(t, connector.ExportOf(p, 0).GetBlockChecksums(), want, "the request's \"checksums\": %v overrides serve's flag", on)
	dst := dec.load(t, "dec-"+id, p)
	require.Nil(t, dec.outcome(t, "dec-"+id, 30*time.Second))
	pre.waitSent(t, id, 30*time.Second)
	dec.free(t, dst)
}
