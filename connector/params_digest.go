package connector

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strconv"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TokenDigestLen is the bytes of one block's token digest
// (KVTransferParams.token_digests, ReqMeta.token_digests).
const TokenDigestLen = 8

// tokenDigestTag opens every block's hash input: a digest of this scheme
// never equals one of another.
const tokenDigestTag = "kvsidecar/token-digest/v1\x00"

// TokenDigests returns the chained token digest of every block of tokens,
// TokenDigestLen bytes per block in token order: block i covers tokens
// [i*blockSize, min((i+1)*blockSize, len(tokens))) (the last block may be
// part full) and its digest is the first 8 bytes of
//
//	SHA-256(tag || salt_len || salt || digest(i-1) || tokens as uint32 LE)
//
// where tag is "kvsidecar/token-digest/v1\x00", salt_len is len(salt) as
// uint32 LE, and digest(-1) is empty. Chained like vLLM's block hashes
// (vllm/v1/core/kv_cache_utils.py hash_block_tokens: each block's hash
// covers its parent's), so equal digests of block i mean equal tokens in
// blocks 0..i. salt carries what the KV depends on besides the tokens (an
// engine's adapter, cache salt, multimodal inputs; the Python connector's
// kvsidecar.params.token_salt); nil for none. It is the one definition:
// kvsidecar.params.token_digests computes the same bytes, and
// testdata/engine_vectors.json holds both to it. A blockSize below 1
// returns nil.
func TokenDigests(tokens []uint32, blockSize int, salt []byte) []byte {
	if blockSize < 1 {
		return nil
	}
	n := (len(tokens) + blockSize - 1) / blockSize
	out := make([]byte, 0, n*TokenDigestLen)
	var prev []byte
	buf := make([]byte, 0, 4*blockSize)
	for i := range n {
		h := sha256.New()
		h.Write([]byte(tokenDigestTag))
		h.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(salt))))
		h.Write(salt)
		h.Write(prev)
		buf = buf[:0]
		for _, t := range tokens[i*blockSize : min((i+1)*blockSize, len(tokens))] {
			buf = binary.LittleEndian.AppendUint32(buf, t)
		}
		h.Write(buf)
		d := h.Sum(nil)[:TokenDigestLen]
		out = append(out, d...)
		prev = d
	}
	return out
}

// checkTokenDigestCount checks a token_digests field against the blocks it
// describes: empty, or TokenDigestLen bytes per block. field names it.
func checkTokenDigestCount(field string, digests []byte, blocks int) *ParamsError {
	if len(digests) == 0 || len(digests) == blocks*TokenDigestLen {
		return nil
	}
	return &ParamsError{Field: field, Value: fmt.Sprintf("%d bytes", len(digests)),
		Rule:   fmt.Sprintf("must be empty or %d bytes per block (%d blocks: %d bytes)", TokenDigestLen, blocks, blocks*TokenDigestLen),
		Reason: codes.ReasonParamsCountMismatch}
}

// checkPromptTokens checks prompt_tokens against the blocks that hold
// them: 0 (not known), or a count whose last token falls in the last block.
func checkPromptTokens(n uint32, blocks, blockSize int) *ParamsError {
	if n == 0 || blockSize < 1 || (int64(n) > int64(blocks-1)*int64(blockSize) && int64(n) <= int64(blocks)*int64(blockSize)) {
		return nil
	}
	return &ParamsError{Field: "prompt_tokens", Value: strconv.FormatUint(uint64(n), 10),
		Rule:   fmt.Sprintf("must be 0 or fill the last of the %d blocks of %d tokens: in [%d, %d]", blocks, blockSize, (blocks-1)*blockSize+1, blocks*blockSize),
		Reason: codes.ReasonParamsOutOfRange}
}

// checkTokenDigests is StartLoad's check, before any byte is read, that
// the params' KV encodes the decode's prompt: when params.token_digests is
// set and the load reads blocks, meta.token_digests must give the digest
// of every block up to the last one read (hit + dst blocks) and each must
// equal the params'. A refusal is a *ParamsError naming the first block
// that differs (TOKEN_DIGEST_MISMATCH) or the digests missing
// (TOKEN_DIGEST_MISSING). Params without digests (an engine that states
// none) are not checked.
func checkTokenDigests(meta *v1.ReqMeta, hit, dst int) error {
	want, have := meta.GetParams().GetTokenDigests(), meta.GetTokenDigests()
	n := hit + dst
	if len(want) == 0 || dst == 0 {
		return nil
	}
	if len(have) < n*TokenDigestLen || len(have)%TokenDigestLen != 0 {
		return &ParamsError{Field: "token_digests", Value: fmt.Sprintf("%d bytes", len(have)),
			Rule: fmt.Sprintf("kv_transfer_params carry the token digests of the prefill's prompt; the decode must state its own prompt's (ReqMeta.token_digests, %d bytes per block) for the %d blocks up to the last one it reads, "+
				"so that KV of other tokens is never read", TokenDigestLen, n),
			Reason: codes.ReasonTokenDigestMissing}
	}
	for i := range n {
		w, h := want[i*TokenDigestLen:(i+1)*TokenDigestLen], have[i*TokenDigestLen:(i+1)*TokenDigestLen]
		if !bytes.Equal(w, h) {
			return &ParamsError{Field: fmt.Sprintf("token_digests[%d]", i), Value: hex.EncodeToString(w),
				Rule: fmt.Sprintf("the prefill's KV (request %q of engine %q) encodes other tokens in block %d than request %q's prompt (its digest %s): params of another prompt, mixed up or replayed; nothing is read",
					meta.GetParams().GetRemoteRequestId(), meta.GetParams().GetRemoteEngineId(), i, meta.GetRequestId(), hex.EncodeToString(h)),
				Reason: codes.ReasonTokenDigestMismatch}
		}
	}
	return nil
}
