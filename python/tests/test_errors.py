"""Errors by code and reason: every wire code has a Python class of its
own, a reply's reason reaches ``err.reason``, and the connector's attach
branches on the reason a real sidecar sends (never on its message)."""

from __future__ import annotations

import pytest

from kvsidecar import errors, reasons
from kvsidecar.dev import devserve
from kvsidecar.local import LocalClient
from kvsidecar.rankset import attach_rank
from kvsidecar.v1 import common_pb2

GEOM = common_pb2.ModelGeometry(
    model="custom", num_layers=2, num_kv_heads=8, head_dim=64, dtype=common_pb2.DTYPE_BFLOAT16, block_size=16,
    layout=common_pb2.LAYOUT_HND, attention=common_pb2.ATTENTION_GQA,
)


@pytest.mark.parametrize("name", [n for n in common_pb2.Code.keys() if n != "CODE_OK"])
def test_every_code_has_its_class(name: str) -> None:
    # A wire code added to common.proto without a class here fails: it
    # would reach callers as the bare KVSidecarError.
    code = common_pb2.Code.Value(name)
    e = errors.from_proto(common_pb2.Error(code=code, message="m", reason="SOME_REASON"))
    assert type(e) is not errors.KVSidecarError, f"{name} has no class of its own"
    assert type(e).CODE == code and e.code == code and e.code_name == name
    assert isinstance(e, errors.KVSidecarError)
    assert (e.message, e.reason) == ("kvsidecar: m", "SOME_REASON")
    # The class's name is the code's: CODE_TP_MISMATCH -> TPMismatch.
    assert type(e).__name__.lower() == name.removeprefix("CODE_").replace("_", "").lower()


def test_an_unknown_code_keeps_code_and_reason() -> None:
    e = errors.from_proto(common_pb2.Error(code=99, message="new", reason="NEW_REASON"))
    assert (type(e), e.code, e.code_name, e.reason) == (errors.KVSidecarError, 99, "CODE_99", "NEW_REASON")


def test_reasons_module() -> None:
    # Generated from internal/codes/reason.go: every reason is its own name
    # and belongs to a code that has a class.
    assert reasons.GEOMETRY_REQUIRED == "GEOMETRY_REQUIRED"
    assert reasons.ALL == frozenset(reasons.CODE_OF)
    for r, code in reasons.CODE_OF.items():
        assert getattr(reasons, r) == r
        assert type(errors.error_for_code(code, "m", r)) is not errors.KVSidecarError
    assert reasons.CODE_OF[reasons.DRAINING] == common_pb2.CODE_UNAVAILABLE


def test_geometry_required_by_reason(cluster: devserve.Cluster) -> None:
    # A sidecar started without a geometry refuses an attach that carries
    # none with GEOMETRY_REQUIRED; attach_rank then sends the engine's.
    s = cluster.start("bare")
    with LocalClient(s.socket) as c:
        with pytest.raises(errors.InvalidArgument) as ei:
            c.attach(tp_rank=0, tp_size=1, num_blocks=64)
        assert ei.value.reason == reasons.GEOMETRY_REQUIRED
        assert ei.value.code == common_pb2.CODE_INVALID_ARGUMENT
    with LocalClient(s.socket) as c:
        info = attach_rank(c, 0, 1, GEOM, num_blocks=64)
        assert info.geometry.num_layers == 2 and info.num_blocks == 64


def test_num_blocks_required_by_reason(cluster: devserve.Cluster) -> None:
    # The reported input: a sidecar started without --num-blocks and an
    # engine that names none (vLLM's connector, unless told) could not
    # attach at all. The sidecar asks with NUM_BLOCKS_REQUIRED; attach_rank
    # then sends the engine's own count, after the geometry it asked first.
    s = cluster.start("unsized")
    with LocalClient(s.socket) as c:
        with pytest.raises(errors.InvalidArgument) as ei:
            c.attach(geometry=GEOM, tp_rank=0, tp_size=1)
        assert ei.value.reason == reasons.NUM_BLOCKS_REQUIRED
    with LocalClient(s.socket) as c:
        with pytest.raises(errors.InvalidArgument) as ei:
            attach_rank(c, 0, 1, GEOM)
        assert ei.value.reason == reasons.NUM_BLOCKS_REQUIRED, "no count of the engine's to give"
        info = attach_rank(c, 0, 1, GEOM, default_blocks=48)
        assert info.num_blocks == 48 and info.geometry.num_layers == 2


def test_not_attached_by_reason(cluster: devserve.Cluster) -> None:
    # Two refusals of one code (CODE_UNAVAILABLE) that ask for different
    # actions carry different reasons: NOT_ATTACHED here.
    s = cluster.start("eng")
    with LocalClient(s.socket) as c:
        with pytest.raises(errors.Unavailable) as ei:
            c.alloc(1)
        assert ei.value.reason == reasons.NOT_ATTACHED
