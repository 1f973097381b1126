"""``kv_transfer_params`` and ``ReqMeta`` helpers: the JSON form engines and
proxies carry, the merge of every prefill rank's export into the decode's
params (Go: ``connector.MergeExports``), and the StartLoad request."""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format, message_factory

from kvsidecar import errors, reasons
from kvsidecar.limits import MAX_TP_SIZE
from kvsidecar.v1 import params_pb2

__all__ = [
    "ENGINE_FACT_FIELDS",
    "TOKEN_DIGEST_LEN",
    "engine_facts_mismatch",
    "merge_exports",
    "params_from_json",
    "params_to_json",
    "req_meta",
    "token_digests",
    "validate_remote_prefill",
]

#: Bytes of one block's token digest (Go: ``connector.TokenDigestLen``).
TOKEN_DIGEST_LEN = 8

# Opens every block's hash input (Go: tokenDigestTag).
_TOKEN_DIGEST_TAG = b"kvsidecar/token-digest/v1\x00"


def token_digests(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> bytes:
    """The chained token digest of every block of ``tokens`` (Go:
    ``connector.TokenDigests``, the one definition; the cases of
    testdata/engine_vectors.json hold both to it): :data:`TOKEN_DIGEST_LEN`
    bytes per block in token order, block ``i`` covering tokens ``[i *
    block_size, min((i + 1) * block_size, len(tokens)))`` (the last block may
    be part full), its digest the first 8 bytes of ``SHA-256(tag ||
    uint32le(len(salt)) || salt || digest(i - 1) || tokens as uint32 LE)``.
    Chained like vLLM's block hashes, so equal digests of block ``i`` mean
    equal tokens in blocks ``0..i``. ``salt`` carries what the KV depends on
    beside the tokens (b"" for none). ``block_size`` below 1 gives b"".

    Raises:
        ValueError: a token id outside [0, 2**32).
    """
    if block_size < 1:
        return b""
    out = bytearray()
    prev = b""
    head = _TOKEN_DIGEST_TAG + struct.pack("<I", len(salt)) + bytes(salt)
    for i in range(0, len(tokens), block_size):
        block = tokens[i:i + block_size]
        try:
            data = struct.pack(f"<{len(block)}I", *block)
        except struct.error as e:
            raise ValueError(f"token_digests: a token id of block {i // block_size} is not a uint32: {e}") from e
        prev = hashlib.sha256(head + prev + data).digest()[:TOKEN_DIGEST_LEN]
        out += prev
    return bytes(out)


#: The fields of ``EngineFacts`` a decode compares, in the order its
#: refusal names them.
ENGINE_FACT_FIELDS = ("engine", "engine_version", "model", "attention_backend", "kv_cache_dtype")


def engine_facts_mismatch(prefill: params_pb2.EngineFacts, decode: params_pb2.EngineFacts) -> list[str]:
    """How a prefill's engine facts (``kv_transfer_params.engine_facts``)
    differ from the decode's own: one ``"<field>: prefill '<value>', decode
    '<value>'"`` per field of :data:`ENGINE_FACT_FIELDS` that both state
    (non-empty) with other values, in that order; [] when none does. A
    field one side leaves empty is not known there and is not compared.
    Engine-neutral: each engine connector fills the facts in its engine's
    own spelling (``kvsidecar.vllm.metadata.vllm_engine_facts``)."""
    out = []
    for f in ENGINE_FACT_FIELDS:
        a, b = getattr(prefill, f), getattr(decode, f)
        if a and b and a != b:
            out.append(f"{f}: prefill {a!r}, decode {b!r}")
    return out


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
        ParamsError: a known field with a value of the wrong type (reason
            ``PARAMS_UNDECODABLE``, naming the innermost such field, as Go's
            ``UnmarshalKVTransferParams``).
    """
    p = params_pb2.KVTransferParams()
    try:
        json_format.ParseDict(d, p, ignore_unknown_fields=True)
    except json_format.ParseError as e:
        field = _undecodable_field(p.DESCRIPTOR, d) or "kv_transfer_params"
        raise errors.ParamsError(f"kv_transfer_params: {field}: cannot be decoded: {e}", field=field,
                                 reason=reasons.PARAMS_UNDECODABLE) from e
    return p


def _undecodable_field(md: Any, d: object) -> str:
    # md: a message's Descriptor (protobuf's Python one or its upb one, as
    # the runtime has it). The first field, in key order, whose value alone does not decode;
    # inside a message (or a list of them) the innermost. "" when none does
    # alone. It reads the JSON, not the parser's message.
    if not isinstance(d, dict):
        return ""
    for k in sorted(d):
        fd = md.fields_by_camelcase_name.get(k) or md.fields_by_name.get(k)
        if fd is None:
            continue
        try:
            json_format.ParseDict({k: d[k]}, message_factory.GetMessageClass(md)(), ignore_unknown_fields=True)
            continue
        except json_format.ParseError:
            pass
        if fd.message_type is not None:
            elems = d[k] if isinstance(d[k], list) else [d[k]]
            for e in elems:
                if f := _undecodable_field(fd.message_type, e):
                    return f
        return fd.name
    return ""


def _check_host_port(a: str) -> str:
    # Go's net.SplitHostPort and the port rule of connector.checkHostPort:
    # "" when a is host:port, otherwise what is wrong.
    i = a.rfind(":")
    if i < 0:
        return "must be host:port"
    j = k = 0
    if a.startswith("["):
        end = a.find("]")
        if end < 0 or end + 1 != i:
            return "must be host:port"
        host, j, k = a[1:end], 1, end + 1
    else:
        host = a[:i]
        if ":" in host:
            return "must be host:port"
    if "[" in a[j:] or "]" in a[k:]:
        return "must be host:port"
    if host == "":
        return "host must not be empty"
    port = a[i + 1 :]
    if not _ATOI.fullmatch(port) or not 1 <= int(port) <= 65535:
        return "port must be in [1, 65535]"
    return ""


# What Go's strconv.Atoi takes: an optional sign and decimal digits.
_ATOI = re.compile(r"[+-]?[0-9]+")


def validate_remote_prefill(p: params_pb2.KVTransferParams) -> None:
    """Checks the params a decode rank needs to pull KV (Go:
    ``connector.ValidateRemotePrefill``, the same rules in the same order):
    ``tp_size`` present and in [1, :data:`~kvsidecar.limits.MAX_TP_SIZE`];
    ``remote_engine_id`` and ``remote_request_id`` set;
    ``remote_rank_addrs`` either empty (then ``remote_host`` and
    ``remote_port`` locate rank 0, rank r at ``remote_port + r``) or exactly
    ``tp_size`` host:port entries; ``token_digests`` empty or
    :data:`TOKEN_DIGEST_LEN` bytes per remote block;
    ``lease_expires_unix_ms`` not negative;
    ``rank_exports`` entries of ranks below ``tp_size``, each with an
    ``export_id``, a ``capability`` and no ``block_ids`` or one per remote
    block, no rank twice.

    Raises:
        ParamsError: the first rule broken, naming the field and the reason
            (:mod:`kvsidecar.reasons`: ``PARAMS_MISSING``,
            ``PARAMS_OUT_OF_RANGE``, ``PARAMS_COUNT_MISMATCH``,
            ``PARAMS_BAD_ADDRESS``, ``PARAMS_RANK_REPEATED``).
    """

    def bad(field: str, reason: str, rule: str) -> errors.ParamsError:
        return errors.ParamsError(f"kv_transfer_params: {field}: {rule}", field=field, reason=reason)

    if not p.HasField("tp_size"):
        raise bad("tp_size", reasons.PARAMS_MISSING, "missing; the prefill TP size is required and never defaulted to 1")
    tp = p.tp_size
    if not 1 <= tp <= MAX_TP_SIZE:
        raise bad("tp_size", reasons.PARAMS_OUT_OF_RANGE, f"{tp} must be in [1, {MAX_TP_SIZE}]")
    if not p.remote_engine_id:
        raise bad("remote_engine_id", reasons.PARAMS_MISSING, "missing")
    if not p.remote_request_id:
        raise bad("remote_request_id", reasons.PARAMS_MISSING, "missing")
    if p.remote_rank_addrs:
        if len(p.remote_rank_addrs) != tp:
            raise bad("remote_rank_addrs", reasons.PARAMS_COUNT_MISMATCH,
                      f"{len(p.remote_rank_addrs)} entries: must have exactly tp_size={tp}, one per prefill rank")
        for i, a in enumerate(p.remote_rank_addrs):
            if why := _check_host_port(a):
                raise bad(f"remote_rank_addrs[{i}]", reasons.PARAMS_BAD_ADDRESS, f"{a!r}: {why}")
    else:
        if not p.remote_host:
            raise bad("remote_host", reasons.PARAMS_MISSING, "missing while remote_rank_addrs is empty")
        if p.remote_port < 1 or p.remote_port + tp - 1 > 65535:
            raise bad("remote_port", reasons.PARAMS_OUT_OF_RANGE,
                      f"{p.remote_port} must be in [1, {65536 - tp}] so that ranks 0..{tp - 1} fit at remote_port+rank")
    if p.token_digests and len(p.token_digests) != TOKEN_DIGEST_LEN * len(p.remote_block_ids):
        n = len(p.remote_block_ids)
        raise bad("token_digests", reasons.PARAMS_COUNT_MISMATCH,
                  f"{len(p.token_digests)} bytes: must be empty or {TOKEN_DIGEST_LEN} bytes per block ({n} blocks: "
                  f"{TOKEN_DIGEST_LEN * n} bytes)")
    if p.lease_expires_unix_ms < 0:
        raise bad("lease_expires_unix_ms", reasons.PARAMS_OUT_OF_RANGE, f"{p.lease_expires_unix_ms} must not be negative")
    seen: dict[int, int] = {}
    for i, e in enumerate(p.rank_exports):
        f = f"rank_exports[{i}]."
        if e.tp_rank >= tp:
            raise bad(f + "tp_rank", reasons.PARAMS_OUT_OF_RANGE, f"{e.tp_rank} must be below tp_size={tp}")
        if e.export_id == 0:
            raise bad(f + "export_id", reasons.PARAMS_MISSING, "missing (0)")
        if not e.capability:
            raise bad(f + "capability", reasons.PARAMS_MISSING, "missing")
        if e.block_ids and len(e.block_ids) != len(p.remote_block_ids):
            raise bad(f + "block_ids", reasons.PARAMS_COUNT_MISMATCH,
                      f"{len(e.block_ids)} entries: must be empty or one per remote block ({len(p.remote_block_ids)})")
        if e.tp_rank in seen:
            raise bad(f + "tp_rank", reasons.PARAMS_RANK_REPEATED,
                      f"{e.tp_rank}: rank_exports[{seen[e.tp_rank]}] names the same rank")
        seen[e.tp_rank] = i


def merge_exports(parts: Sequence[params_pb2.KVTransferParams]) -> params_pb2.KVTransferParams:
    """The decode's ``kv_transfer_params`` from every prefill rank's
    RequestFinished reply (Go: ``connector.MergeExports``, same rule; the
    cases of testdata/engine_vectors.json hold both to it).

    Each rank's reply names that rank's export (``rank_exports``, one
    entry). The merged params are the base's (the part that exports rank 0,
    or else the first part: its ``remote_block_ids``, addresses and
    incarnation) with every rank's entry, sorted by rank, an entry's
    ``block_ids`` kept only when they differ from the base's
    ``remote_block_ids``, and the earliest lease expiry of the parts (0,
    no lease, does not count), also when no part carries ``rank_exports``.
    Every part must pass :func:`validate_remote_prefill`. Parts are not
    modified.

    Raises:
        ParamsError: no part (reason ``MERGE_NO_PARTS``, ``part`` None); a
            part (``part``, its index) that breaks a rule of
            :func:`validate_remote_prefill` (its reason), names another
            request, engine, TP size, number of blocks, prompt length or
            token digests (``MERGE_PARTS_DIFFER``), or exports a rank an earlier part
            exported (``PARAMS_RANK_REPEATED``).
    """
    if not parts:
        raise errors.ParamsError("merge_exports: needs at least one part", field="kv_transfer_params",
                                 reason=reasons.MERGE_NO_PARTS)
    base = next((p for p in parts if any(e.tp_rank == 0 for e in p.rank_exports)), parts[0])
    out = params_pb2.KVTransferParams()
    out.CopyFrom(base)
    del out.rank_exports[:]
    seen: dict[int, int] = {}
    exports = []
    for i, p in enumerate(parts):
        try:
            validate_remote_prefill(p)
        except errors.ParamsError as pe:
            raise errors.ParamsError(f"merge_exports: part {i}: {pe.message}", field=pe.field, reason=pe.reason,
                                     part=i) from pe
        for field, v, w in (("remote_request_id", p.remote_request_id, base.remote_request_id),
                            ("remote_engine_id", p.remote_engine_id, base.remote_engine_id),
                            ("tp_size", p.tp_size, base.tp_size),
                            ("remote_block_ids", len(p.remote_block_ids), len(base.remote_block_ids)),
                            ("prompt_tokens", p.prompt_tokens, base.prompt_tokens),
                            ("token_digests", p.token_digests.hex(), base.token_digests.hex())):
            if v != w:
                raise errors.ParamsError(f"merge_exports: part {i}: {field}={v!r} differs from {w!r}", field=field,
                                         reason=reasons.MERGE_PARTS_DIFFER, part=i)
        if p.lease_expires_unix_ms and (not out.lease_expires_unix_ms or p.lease_expires_unix_ms < out.lease_expires_unix_ms):
            out.lease_expires_unix_ms = p.lease_expires_unix_ms
        for e in p.rank_exports:
            if e.tp_rank in seen:
                raise errors.ParamsError(
                    f"merge_exports: part {i}: rank_exports: rank {e.tp_rank}: part {seen[e.tp_rank]} exports the same rank",
                    field="rank_exports", reason=reasons.PARAMS_RANK_REPEATED, part=i)
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
             remote_hit_blocks: int = 0, local_surplus_blocks: int = 0, token_digests: bytes = b"") -> params_pb2.ReqMeta:
    """A StartLoad request: remote block ``remote_hit_blocks + i`` lands in
    ``local_block_ids[i]``; the first ``remote_hit_blocks`` remote blocks are
    the decode's prefix hit (not read) and the last ``local_surplus_blocks``
    local blocks its own (never written). ``token_digests``: the decode
    prompt's own (:func:`token_digests` of the tokens it takes from the
    params), which the sidecar compares with the params' before it reads a
    byte."""
    m = params_pb2.ReqMeta(request_id=request_id, local_block_ids=list(local_block_ids), params=params,
                           token_digests=token_digests)
    if local_block_ids:
        m.remote_hit_blocks = remote_hit_blocks
    m.local_surplus_blocks = local_surplus_blocks
    return m
