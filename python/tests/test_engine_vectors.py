"""The Python copies of Go's rules, held to the cases the Go functions wrote
(testdata/engine_vectors.json, from engine_vectors_test.go): block offsets
(:class:`kvsidecar.hostmap.Packing`, Go ``kvgeom.Packing``), socket paths
(:func:`kvsidecar.paths.local_socket_path`, Go ``localapi.SocketPath``) and
export merges (:func:`kvsidecar.params.merge_exports`, Go
``connector.MergeExports``) and token digests
(:func:`kvsidecar.params.token_digests`, Go ``connector.TokenDigests``). A rule changed in one language fails this test
or the Go one until the other follows; the file is rewritten only by
``go test -run TestEngineVectors -update .``.

The tests below the vectors pin, each by itself, a place where the Python
copy drifted from Go before the vectors existed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from kvsidecar import errors, reasons
from kvsidecar.hostmap import Packing
from kvsidecar.params import TOKEN_DIGEST_LEN, merge_exports, params_from_json, params_to_json, token_digests
from kvsidecar.paths import local_socket_path
from kvsidecar.v1 import common_pb2, params_pb2

VECTORS_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "testdata", "engine_vectors.json")

with open(VECTORS_PATH, encoding="utf-8") as _f:
    VECTORS: dict[str, Any] = json.load(_f)


def _cases(section: str) -> list[Any]:
    cases = VECTORS[section]
    assert cases, f"{section}: no cases in {VECTORS_PATH}"
    return [pytest.param(c, id=c["name"]) for c in cases]


@pytest.mark.parametrize("case", _cases("block_offsets"))
def test_block_offsets(case: dict[str, Any]) -> None:
    p = Packing(block_len=case["block_len"], page_size=case["page_size"])
    if "error" in case:
        with pytest.raises(errors.GeometryError) as ei:
            p.check()
        assert list(ei.value.fields) == case["error"]["fields"]
        assert ei.value.code == common_pb2.CODE_INVALID_ARGUMENT
        return
    p.check()
    assert p.blocks_per_page == case["blocks_per_page"]
    assert [[b, p.offset(b)] for b, _ in case["offsets"]] == case["offsets"]
    assert [[off, p.block_at(off)] for off, _ in case["block_at"]] == case["block_at"]


@pytest.mark.parametrize("case", _cases("socket_paths"))
def test_socket_paths(case: dict[str, Any]) -> None:
    args = (case["dir"], case["engine_id"], case["tp_rank"])
    if "error" in case:
        with pytest.raises(errors.KVSidecarError) as ei:
            local_socket_path(*args)
        assert {"code": ei.value.code_name, "reason": ei.value.reason} == {"reason": "", **case["error"]}
        return
    assert local_socket_path(*args) == case["path"]


@pytest.mark.parametrize("case", _cases("export_merges"))
def test_export_merges(case: dict[str, Any]) -> None:
    parts = [params_from_json(p) for p in case["parts"]]
    before = [p.SerializeToString(deterministic=True) for p in parts]
    if "refusal" in case:
        with pytest.raises(errors.ParamsError) as ei:
            merge_exports(parts)
        e = ei.value
        got = {"code": e.code_name, "reason": e.reason, "field": e.field}
        if e.part is not None:
            got["part"] = e.part
        assert got == case["refusal"]
    else:
        assert params_to_json(merge_exports(parts)) == case["merged"]
    assert [p.SerializeToString(deterministic=True) for p in parts] == before, "parts are not modified"


@pytest.mark.parametrize("case", _cases("token_digests"))
def test_token_digests(case: dict[str, Any]) -> None:
    got = token_digests(case["tokens"], case["block_size"], case["salt"].encode())
    assert got.hex() == case["digests"]
    assert len(got) == TOKEN_DIGEST_LEN * -(-len(case["tokens"]) // case["block_size"])


def test_every_reason_of_the_vectors_is_generated() -> None:
    # The reasons the Go functions gave are the ones kvsidecar.reasons
    # knows, each with the code the vector names beside it.
    seen = [c["error"] for c in VECTORS["socket_paths"] if "error" in c]
    seen += [c["refusal"] for c in VECTORS["export_merges"] if "refusal" in c]
    with_reason = [e for e in seen if "reason" in e]
    assert with_reason
    for e in with_reason:
        assert e["reason"] in reasons.ALL
        assert common_pb2.Code.Name(reasons.CODE_OF[e["reason"]]) == e["code"]


# -- the drifts, each by itself ----------------------------------------------


def _part(rank: int, ids: list[int], lease: int, **kw: Any) -> params_pb2.KVTransferParams:
    p = params_pb2.KVTransferParams(remote_engine_id="prefill-a", remote_request_id="cmpl-1", tp_size=2,
                                    remote_host="10.0.0.1", remote_port=5600, remote_block_ids=ids,
                                    lease_expires_unix_ms=lease, **kw)
    p.rank_exports.add(tp_rank=rank, export_id=100 + rank, capability=b"c")
    return p


def test_merge_validates_every_part() -> None:
    # Drift: merge_exports never validated its parts, so params a decode
    # rank refuses (tp_size 0, an export of rank 2 of tp_size 2) merged
    # into params Go's MergeExports refuses.
    bad = _part(1, [4, 5], 1000)
    bad.rank_exports[0].tp_rank = 2
    with pytest.raises(errors.ParamsError) as ei:
        merge_exports([_part(0, [1, 2], 1000), bad])
    assert (ei.value.part, ei.value.field, ei.value.reason) == (1, "rank_exports[0].tp_rank", reasons.PARAMS_OUT_OF_RANGE)

    no_tp = _part(0, [1, 2], 1000)
    no_tp.ClearField("tp_size")
    with pytest.raises(errors.ParamsError) as ei:
        merge_exports([no_tp])
    assert (ei.value.part, ei.value.field, ei.value.reason) == (0, "tp_size", reasons.PARAMS_MISSING)


def test_merge_without_rank_exports_takes_the_earliest_lease() -> None:
    # Drift: with no rank_exports in any part, merge_exports returned the
    # first part itself, unchecked and with its own lease, where Go takes
    # the earliest lease of the parts.
    p0, p1 = _part(0, [1, 2], 3000), _part(1, [3, 4], 2000)
    del p0.rank_exports[:]
    del p1.rank_exports[:]
    m = merge_exports([p0, p1])
    assert m is not p0
    assert m.lease_expires_unix_ms == 2000
    assert list(m.remote_block_ids) == [1, 2] and not m.rank_exports
    assert p0.lease_expires_unix_ms == 3000, "parts are not modified"
    p1.remote_request_id = "cmpl-2"
    with pytest.raises(errors.ParamsError) as ei:
        merge_exports([p0, p1])
    assert (ei.value.part, ei.value.reason) == (1, reasons.MERGE_PARTS_DIFFER)


def test_packing_without_pages_and_a_bad_layout() -> None:
    # Drift: the offset was written again as per-page strides, so a cache
    # of page size 0 raised ZeroDivisionError and a block longer than its
    # page computed garbage; Go reads page size 0 as blocks back to back
    # and refuses the other with a named error.
    p = Packing(block_len=18432, page_size=0)
    p.check()
    assert (p.blocks_per_page, p.offset(3), p.block_at(3 * 18432 + 5)) == (0, 3 * 18432, 3)
    with pytest.raises(errors.GeometryError) as ei:
        Packing(block_len=8192, page_size=4096).check()
    assert ei.value.fields == ("block_len", "page_size")
    with pytest.raises(errors.GeometryError) as ei:
        Packing(block_len=0, page_size=0).check()
    assert ei.value.fields == ("block_len",)
    assert Packing(block_len=0, page_size=4096).offset(5) == 0, "no division by zero"


def test_socket_paths_beyond_plain_ids() -> None:
    # Drift: only the plain-id path was compared with Go. A hashed UTF-8
    # id, a directory left with room for one byte of the id, and one too
    # long for any are Go's answers from the vectors (the refusal is
    # SOCKET_PATH_INVALID; a bad rank has no reason).
    by_name = {c["name"]: c for c in VECTORS["socket_paths"]}
    for name in ("UTF-8 id: each byte outside the set is _", "a long directory leaves one byte of a hashed id",
                 "a long id is cut and hashed", "two ids that sanitize alike differ by hash: second"):
        c = by_name[name]
        assert local_socket_path(c["dir"], c["engine_id"], c["tp_rank"]) == c["path"], name
    with pytest.raises(errors.InvalidArgument) as ei:
        local_socket_path("/" + "d" * 199, "e", 0)
    assert ei.value.reason == reasons.SOCKET_PATH_INVALID
    with pytest.raises(errors.InvalidArgument) as ei:
        local_socket_path("rel", "e", 1024)
    assert ei.value.reason == "", "the rank is checked first, as in Go"
