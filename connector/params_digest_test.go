package connector_test

import (
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// tokens returns n token ids of prompt seed.
func tokens(seed uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = (seed*7919 + uint32(i)*104729) % 50000
	}
	return out
}

func TestTokenDigests(t *testing.T) {
	const bs = 16
	a := tokens(1, 3*bs+5)
	da := connector.TokenDigests(a, bs, nil)
	require.Len(t, da, 4*connector.TokenDigestLen, "one digest per block, the last part full")

	// A prefix of whole blocks has the prefix of the digests.
	require.Equal(t, da[:2*connector.TokenDigestLen], connector.TokenDigests(a[:2*bs], bs, nil))
	// The last block covers only its tokens: fewer of them digest otherwise.
	short := connector.TokenDigests(a[:3*bs+4], bs, nil)
	require.Equal(t, da[:3*connector.TokenDigestLen], short[:3*connector.TokenDigestLen])
	require.NotEqual(t, da[3*connector.TokenDigestLen:], short[3*connector.TokenDigestLen:])

	// Chained: a token changed in block 1 changes the digest of block 1
	// and of every block after it, not of block 0.
	b := slices.Clone(a)
	b[bs+3]++
	db := connector.TokenDigests(b, bs, nil)
	require.Equal(t, da[:connector.TokenDigestLen], db[:connector.TokenDigestLen])
	for i := 1; i < 4; i++ {
		require.NotEqual(t, da[i*connector.TokenDigestLen:(i+1)*connector.TokenDigestLen], db[i*connector.TokenDigestLen:(i+1)*connector.TokenDigestLen], "block %d", i)
	}
	// Two blocks swapped: equal blocks in another order differ.
	c := slices.Concat(a[bs:2*bs], a[:bs])
	require.NotEqual(t, connector.TokenDigests(c, bs, nil)[connector.TokenDigestLen:], da[connector.TokenDigestLen:2*connector.TokenDigestLen])

	// A salt (an adapter, multimodal inputs) changes every block.
	ds := connector.TokenDigests(a, bs, []byte("lora:a"))
	for i := range 4 {
		require.NotEqual(t, da[i*8:(i+1)*8], ds[i*8:(i+1)*8], "block %d", i)
	}
	require.Empty(t, connector.TokenDigests(nil, bs, nil))
	require.Nil(t, connector.TokenDigests(a, 0, nil))
}

// TestParamsTokenDigestsCount: params whose token_digests do not give one
// digest per remote block are refused by name.
func TestParamsTokenDigestsCount(t *testing.T) {
	p := &v1.KVTransferParams{DoRemotePrefill: true, RemoteEngineId: "e", RemoteRequestId: "r", RemoteHost: "h", RemotePort: 1,
		TpSize: new(uint32(1)), RemoteBlockIds: []uint32{1, 2}, TokenDigests: make([]byte, 3*connector.TokenDigestLen)}
	err := connector.ValidateRemotePrefill(p)
	pe, ok := err.(*connector.ParamsError)
	require.True(t, ok, "%v", err)
	require.Equal(t, "token_digests", pe.Field)
	require.Equal(t, codes.ReasonParamsCountMismatch, pe.Reason)
	p.TokenDigests = p.TokenDigests[:2*connector.TokenDigestLen]
	require.NoError(t, connector.ValidateRemotePrefill(p))
}

// TestLoadRefusesOtherTokens: params whose KV encodes other tokens than
// the decode's prompt (another prompt of a prompt list, params mixed up or
// replayed) are refused by StartLoad before any byte is read, naming the
// first block that differs; a decode that states no digests of its own is
// refused too; nothing is notified, so the params still load byte-exact
// for the prompt they were made for.
//
// fault-matrix: token-digest-mismatch
func TestLoadRefusesOtherTokens(t *testing.T) {
	const bs = 16
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8})
	reg := prometheus.NewRegistry()
	dec := newInstance(t, instOpts{engine: "decode", tp: 1, geom: gqa8, reg: reg})
	const n, key = 4, 5
	prompt := tokens(1, n*bs-3)
	other := slices.Clone(prompt)
	other[2*bs+1]++ // the same first two blocks, another third

	blocks := pre.alloc(t, n)
	pre.fill(t, key, blocks)
	params, err := pre.ranks[0].RequestFinished(t.Context(), "cmpl-0", blocks, v1.FinishStatus_FINISH_STATUS_LENGTH,
		&v1.KVTransferParams{DoRemoteDecode: true, PromptTokens: uint32(len(prompt)), TokenDigests: connector.TokenDigests(prompt, bs, nil)})
	require.NoError(t, err)
	require.Equal(t, connector.TokenDigests(prompt, bs, nil), params.GetTokenDigests(), "the params carry what the engine said")
	require.Equal(t, uint32(len(prompt)), params.GetPromptTokens())
	params = roundTrip(t, params)

	local := dec.alloc(t, n)
	dec.fill(t, 99, local)
	meta := func(id string, digests []byte) *v1.ReqMeta {
		return &v1.ReqMeta{RequestId: id, LocalBlockIds: local, Params: params, RemoteHitBlocks: new(uint32(0)), TokenDigests: digests}
	}
	for _, tc := range []struct {
		name, field string
		digests     []byte
		reason      codes.Reason
	}{
		{"another prompt", "token_digests[2]", connector.TokenDigests(other, bs, nil), codes.ReasonTokenDigestMismatch},
		{"another salt", "token_digests[0]", connector.TokenDigests(prompt, bs, []byte("lora:b")), codes.ReasonTokenDigestMismatch},
		{"no digests of the decode's", "token_digests", nil, codes.ReasonTokenDigestMissing},
		{"fewer blocks than it reads", "token_digests", connector.TokenDigests(prompt[:2*bs], bs, nil), codes.ReasonTokenDigestMissing},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := dec.ranks[0].StartLoad(t.Context(), meta("d-"+tc.name, tc.digests))
			pe, ok := err.(*connector.ParamsError)
			require.True(t, ok, "%v", err)
			require.Equal(t, tc.field, pe.Field)
			require.Equal(t, tc.reason, pe.Reason)
			require.Equal(t, tc.reason, codes.ReasonOf(err))
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err))
			require.Zero(t, counter(t, reg, "kvsidecar_transfer_bytes_total"), "no byte read")
			dec.check(t, 99, local, 0) // untouched: no READ landed
		})
	}
	// The params as issued load byte-exact: nothing above ended the export.
	require.NoError(t, dec.ranks[0].StartLoad(t.Context(), meta("d-same", connector.TokenDigests(prompt, bs, nil))))
	requireAllDone(t, dec.wait(t, "d-same"))
	dec.check(t, key, local, 0)

	// A decode that holds the first two blocks (its prefix hit) states the
	// digests up to the last block it reads and loads the rest.
	blocks2 := pre.alloc(t, n)
	pre.fill(t, key, blocks2)
	params2, err := pre.ranks[0].RequestFinished(t.Context(), "cmpl-1", blocks2, v1.FinishStatus_FINISH_STATUS_LENGTH,
		&v1.KVTransferParams{DoRemoteDecode: true, PromptTokens: uint32(len(prompt)), TokenDigests: connector.TokenDigests(prompt, bs, nil)})
	require.NoError(t, err)
	local2 := dec.alloc(t, n-2)
	require.NoError(t, dec.ranks[0].StartLoad(t.Context(), &v1.ReqMeta{RequestId: "d-hit", LocalBlockIds: local2, Params: roundTrip(t, params2),
		RemoteHitBlocks: new(uint32(2)), TokenDigests: connector.TokenDigests(prompt, bs, nil)}))
	requireAllDone(t, dec.wait(t, "d-hit"))
	dec.check(t, key, local2, 2)
}

// TestRequestFinishedChecksWhatTheBlocksEncode: token digests or a prompt
// length that do not fit the exported blocks are refused by name, and
// nothing is taken over (the engine may free its blocks).
func TestRequestFinishedChecksWhatTheBlocksEncode(t *testing.T) {
	pre := newInstance(t, instOpts{engine: "prefill", tp: 1, geom: gqa8})
	blocks := pre.alloc(t, 3)
	for _, tc := range []struct {
		name, field string
		in          *v1.KVTransferParams
		reason      codes.Reason
	}{
		{"two digests for three blocks", "token_digests", &v1.KVTransferParams{TokenDigests: make([]byte, 2*connector.TokenDigestLen)}, codes.ReasonParamsCountMismatch},
		{"a digest of 7 bytes", "token_digests", &v1.KVTransferParams{TokenDigests: make([]byte, 3*connector.TokenDigestLen-1)}, codes.ReasonParamsCountMismatch},
		{"a prompt that fills two blocks", "prompt_tokens", &v1.KVTransferParams{PromptTokens: 32}, codes.ReasonParamsOutOfRange},
		{"a prompt longer than three blocks", "prompt_tokens", &v1.KVTransferParams{PromptTokens: 49}, codes.ReasonParamsOutOfRange},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.in.DoRemoteDecode = true
			_, err := pre.ranks[0].RequestFinished(t.Context(), "r", blocks, v1.FinishStatus_FINISH_STATUS_LENGTH, tc.in)
			pe, ok := err.(*connector.ParamsError)
			require.True(t, ok, "%v", err)
			require.Equal(t, tc.field, pe.Field)
			require.Equal(t, tc.reason, pe.Reason)
		})
	}
	// Nothing was taken over: the blocks are still the engine's to free.
	ints := make([]int, len(blocks))
	for i, b := range blocks {
		ints[i] = int(b)
	}
	require.NoError(t, pre.ranks[0].FreeBlocks(t.Context(), ints))
}
