package codes

import "errors"

// Reason is a stable identifier of why a call failed, finer than its code:
// the reason field of v1.Error, as google.rpc.ErrorInfo.reason is beside a
// gRPC status code. Values are UPPER_SNAKE, at most 63 bytes, and each
// belongs to one code (named in its comment). A caller that must act
// differently on two failures of one code (send the geometry, or give up)
// branches on the reason, never on the message; one that does not know a
// reason acts on the code.
//
// The constants below are every reason of the module. They are defined
// here only: `make generate` writes them into the Python client
// (python/kvsidecar/reasons.py), and `make verify` fails when that copy is
// stale.
type Reason string

// The reasons. Each comment starts with the reason's code.
const (
	// ReasonGeometryRequired (CODE_INVALID_ARGUMENT): CreateKVCache
	// without a geometry to a sidecar that has none (started without
	// --model or the geometry flags) and no KV cache yet. Attach again
	// with the engine's geometry.
	ReasonGeometryRequired Reason = "GEOMETRY_REQUIRED"
	// ReasonNotAttached (CODE_UNAVAILABLE): a call that needs the KV cache
	// on a connection that did not send create, or before any engine
	// created the cache. Attach first.
	ReasonNotAttached Reason = "NOT_ATTACHED"
	// ReasonDraining (CODE_UNAVAILABLE): the sidecar or the rank is
	// shutting down and refuses new work. Move on to another instance.
	ReasonDraining Reason = "DRAINING"
	// ReasonNumBlocksRequired (CODE_INVALID_ARGUMENT): CreateKVCache with
	// num_blocks 0 to a sidecar started without --num-blocks: nobody sized
	// the cache. Attach again with the engine's block count.
	ReasonNumBlocksRequired Reason = "NUM_BLOCKS_REQUIRED"

	// ReasonParamsUndecodable (CODE_INVALID_ARGUMENT): kv_transfer_params
	// that are not a JSON object, or hold a value of the wrong type for
	// their field.
	ReasonParamsUndecodable Reason = "PARAMS_UNDECODABLE"
	// ReasonParamsMissing (CODE_INVALID_ARGUMENT): kv_transfer_params
	// without a field they need (tp_size, remote_engine_id,
	// remote_request_id, remote_host, an export's export_id or capability,
	// checksum_heads beside block_checksums).
	ReasonParamsMissing Reason = "PARAMS_MISSING"
	// ReasonParamsOutOfRange (CODE_INVALID_ARGUMENT): a kv_transfer_params
	// number outside its range: tp_size, remote_port, a negative
	// lease_expires_unix_ms, an export's tp_rank at or past tp_size, a
	// block id outside the prefill rank's pool, checksum_heads short of
	// the heads read.
	ReasonParamsOutOfRange Reason = "PARAMS_OUT_OF_RANGE"
	// ReasonParamsCountMismatch (CODE_INVALID_ARGUMENT): a
	// kv_transfer_params list of the wrong length: remote_rank_addrs other
	// than tp_size entries, an export's block_ids other than one per
	// remote block, block_checksums other than 4 bytes per block and head.
	ReasonParamsCountMismatch Reason = "PARAMS_COUNT_MISMATCH"
	// ReasonParamsBadAddress (CODE_INVALID_ARGUMENT): a remote_rank_addrs
	// entry that is not host:port with a port in [1, 65535].
	ReasonParamsBadAddress Reason = "PARAMS_BAD_ADDRESS"
	// ReasonParamsRankRepeated (CODE_INVALID_ARGUMENT): one prefill rank
	// exported twice, in one params' rank_exports or in two parts of a
	// merge.
	ReasonParamsRankRepeated Reason = "PARAMS_RANK_REPEATED"
	// ReasonParamsExportMissing (CODE_INVALID_ARGUMENT): params that carry
	// exports but none of a prefill rank a decode rank must read from.
	// Merge every prefill rank's RequestFinished params before the load.
	ReasonParamsExportMissing Reason = "PARAMS_EXPORT_MISSING"
	// ReasonMergeNoParts (CODE_INVALID_ARGUMENT): an export merge of no
	// params.
	ReasonMergeNoParts Reason = "MERGE_NO_PARTS"
	// ReasonMergePartsDiffer (CODE_INVALID_ARGUMENT): parts of an export
	// merge that name another request, engine, tp_size or number of
	// blocks: they are not the ranks of one prefill request.
	ReasonMergePartsDiffer Reason = "MERGE_PARTS_DIFFER"
	// ReasonTokenDigestMismatch (CODE_INVALID_ARGUMENT): a load whose
	// kv_transfer_params encode other tokens than the decode's prompt: a
	// block's token digest differs from the one the decode computed over
	// its own prompt (params of another request, mixed up or replayed by
	// a proxy). Nothing is read; the decode computes the prompt itself.
	ReasonTokenDigestMismatch Reason = "TOKEN_DIGEST_MISMATCH"
	// ReasonTokenDigestMissing (CODE_INVALID_ARGUMENT): params that carry
	// token digests, loaded by a decode that states none (or too few) of
	// its own prompt: what the KV encodes cannot be checked, so nothing
	// is read. Pass ReqMeta.token_digests.
	ReasonTokenDigestMissing Reason = "TOKEN_DIGEST_MISSING"

	// ReasonSocketPathInvalid (CODE_INVALID_ARGUMENT): no socket path can
	// be made of the arguments (a relative directory, an empty engine id,
	// a directory too long for a unix socket path), or the path holds a
	// file that is not a socket.
	ReasonSocketPathInvalid Reason = "SOCKET_PATH_INVALID"
)

// Reasoner is implemented by errors that carry a reason: *Error, and the
// struct errors that say why themselves (connector.ParamsError).
type Reasoner interface {
	ErrorReason() Reason
}

// ReasonOf returns the reason of err: that of the error that gives err its
// code (the first Coder in the chain, as Of finds it) when it is a
// Reasoner, otherwise "" (nil, no class, or a class with no reason). A
// reason thus never contradicts the code beside it.
func ReasonOf(err error) Reason {
	var c Coder
	if !errors.As(err, &c) {
		return ""
	}
	if r, ok := c.(Reasoner); ok {
		return r.ErrorReason()
	}
	return ""
}
