"""``kv_transfer_params`` and ``ReqMeta`` helpers: the JSON form engines and
proxies carry, the merge of every prefill rank's export into the decode's
params (Go: ``connector.MergeExports``), and the StartLoad request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format

from kvsidecar import errors
from kvsidecar.v1 import params_pb2

__all__ = ["merge_exports", "params_from_json", "params_to_json", "req_meta"]


def params_to_json(p: params_pb2.KVTransferParams) -> dict[str, Any]:
    """``kv_transfer_params`` as the JSON object engines and proxies carry:
    proto field names (vLLM NixlConnector's plus kvsidecar's), fields at
    their default left out, 64-bit integers (``remote_incarnation``,
    ``lease_expires_unix_ms``) as decimal strings, ``capability`` as base64
    (protobuf's canonical JSON mapping, as Go's MarshalKVTransferParams)."""
    return json_format.MessageToDict(p, preserving_proto_field_name=True)


def params_from_json(d: dict[str, Any]) -> params_pb2.KVTransferParams:
    """Parses a ``kv_transfer_params`` object; fields kvsidecar does not know
    (vLLM adds its own) are ignored.

    Raises:
        InvalidArgument: a known field with a value of the wrong type.
    """
    p = params_pb2.KVTransferParams()
    try:
        json_format.ParseDict(d, p, ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise errors.InvalidArgument(f"kv_transfer_params: {e}") from e
    return p


def merge_exports(parts: Sequence[params_pb2.KVTransferParams]) -> params_pb2.KVTransferParams:
    """The decode's ``kv_transfer_params`` from every prefill rank's
    RequestFinished reply (Go: ``connector.MergeExports``, same rule).

    Each rank's reply names that rank's export (``rank_exports``, one
    entry); the merged params are rank 0's with every rank's entry, an
    entry's ``block_ids`` kept only when they differ from
    ``remote_block_ids``, and the earliest lease expiry. A sidecar whose
    params carry no ``rank_exports`` (every rank serves
    ``remote_block_ids``) gets rank 0's part (the first) unchanged.

    Raises:
        InvalidArgument: no part; parts naming another request, engine or
            TP size, another number of blocks, or the same rank twice.
    """
    if not parts:
        raise errors.InvalidArgument("merge_exports: needs at least one part")
    if not any(p.rank_exports for p in parts):
        return parts[0]
    base = next((p for p in parts if any(e.tp_rank == 0 for e in p.rank_exports)), parts[0])
    out = params_pb2.KVTransferParams()
    out.CopyFrom(base)
    del out.rank_exports[:]
    seen: dict[int, int] = {}
    exports = []
    for i, p in enumerate(parts):
        for field, v, w in (("remote_request_id", p.remote_request_id, base.remote_request_id),
                            ("remote_engine_id", p.remote_engine_id, base.remote_engine_id),
                            ("tp_size", p.tp_size, base.tp_size),
                            ("remote_block_ids", len(p.remote_block_ids), len(base.remote_block_ids))):
            if v != w:
                raise errors.InvalidArgument(f"merge_exports: part {i}: {field}={v!r} differs from {w!r}")
        if p.lease_expires_unix_ms and (not out.lease_expires_unix_ms or p.lease_expires_unix_ms < out.lease_expires_unix_ms):
            out.lease_expires_unix_ms = p.lease_expires_unix_ms
        for e in p.rank_exports:
            if e.tp_rank in seen:
                raise errors.InvalidArgument(
                    f"merge_exports: part {i}: rank_exports: rank {e.tp_rank}: part {seen[e.tp_rank]} exports the same rank"
                )
            seen[e.tp_rank] = i
            m = type(e)()
            m.CopyFrom(e)
            ids = list(e.block_ids) or list(p.remote_block_ids)
            del m.block_ids[:]
            if ids != list(out.remote_block_ids):
                m.block_ids.extend(ids)
            exports.append(m)
    out.rank_exports.extend(sorted(exports, key=lambda e: e.tp_rank))
    return out


def req_meta(request_id: str, local_block_ids: Sequence[int], params: params_pb2.KVTransferParams,
             remote_hit_blocks: int = 0, local_surplus_blocks: int = 0) -> params_pb2.ReqMeta:
    """A StartLoad request: remote block ``remote_hit_blocks + i`` lands in
    ``local_block_ids[i]``; the first ``remote_hit_blocks`` remote blocks are
    the decode's prefix hit (not read) and the last ``local_surplus_blocks``
    local blocks its own (never written)."""
    m = params_pb2.ReqMeta(request_id=request_id, local_block_ids=list(local_block_ids), params=params)
    if local_block_ids:
        m.remote_hit_blocks = remote_hit_blocks
    m.local_surplus_blocks = local_surplus_blocks
    return m
