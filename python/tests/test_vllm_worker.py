"""KVSidecarConnector's worker half against a fake sidecar client (the
worker's ``dial`` replaced, as vLLM's NixlConnector tests replace its NIXL
wrapper): what a load allocates, sends and frees, which vLLM blocks a failed,
partly failed or aborted load reports, what a lost connection does in each
mode, and that the staging copy lands the sidecar's bytes in vLLM's blocks.
The same worker against real sidecars runs in test_staging.py and
test_vllm_engines.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_loop import BLOCK_SIZE, HEAD_DIM, KV_HEADS, LAYERS, vllm_config

from kvsidecar import errors, reasons
from kvsidecar.hostmap import Packing
from kvsidecar.params import params_from_json
from kvsidecar.staging import layer_layout
from kvsidecar.v1 import common_pb2, local_pb2
from kvsidecar.vllm.connector import KVConnectorRole, KVSidecarConnector
from kvsidecar.vllm.metadata import KVSidecarConnectorMetadata, LoadSpec
from kvsidecar.vllm.worker import StagingMode, WorkerSide, ZeroCopyMode

NUM_BLOCKS = 8
PARAMS = params_from_json({"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_request_id": "p-1",
                           "remote_block_ids": [5, 6, 7], "remote_host": "127.0.0.1", "remote_port": 7000,
                           "tp_size": 1})


class FakeClient:
    """Stands in for :class:`kvsidecar.local.LocalClient`, enforcing its
    rules: block ids come from a counter and must be freed exactly once,
    a load needs its local blocks allocated (staging) and a request id not
    already loading, and every call after ``broken`` is set raises it (a
    connection that failed stays failed)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.info: local_pb2.KVCacheInfo | None = None
        self.next_id = 1
        self.held: set[int] = set()
        self.loads: dict[str, local_pb2.ReqMeta] = {}
        self.calls: list[str] = []
        self.finished = local_pb2.GetFinishedReply()
        self.broken: errors.KVSidecarError | None = None
        self.refuse_alloc: errors.KVSidecarError | None = None
        self.regions: list[bytearray] = []
        self.closed = False
        self.device_mapping = None

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.broken is not None:
            raise self.broken

    def attach(self, geometry: Any = None, tp_rank: int = 0, tp_size: int = 1, num_blocks: int = 0) -> Any:
        self._call("attach")
        if geometry is None:
            raise errors.InvalidArgument("geometry required", reason=reasons.GEOMETRY_REQUIRED)
        if num_blocks == 0:
            raise errors.InvalidArgument("num_blocks required", reason=reasons.NUM_BLOCKS_REQUIRED)
        block_len = geometry.block_size * (geometry.num_kv_heads // tp_size) * geometry.head_dim * 2  # bf16
        self.info = local_pb2.KVCacheInfo(geometry=geometry, tp_rank=tp_rank, tp_size=tp_size, num_blocks=num_blocks,
                                          heads_per_rank=geometry.num_kv_heads // tp_size, block_len=block_len,
                                          region_len=block_len * num_blocks, num_regions=2 * geometry.num_layers)
        self.regions = [bytearray(block_len * num_blocks) for _ in range(self.info.num_regions)]
        return self.info

    def region(self, i: int) -> memoryview:
        return memoryview(self.regions[i])

    @property
    def packing(self) -> Packing:
        assert self.info is not None
        return Packing(self.info.block_len, 0)

    def is_mapped(self, b: int) -> bool:
        return True

    def sync(self) -> None:
        self._call("sync")

    def alloc(self, n: int) -> list[int]:
        self._call("alloc")
        if self.refuse_alloc is not None:
            raise self.refuse_alloc
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        self.held.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        self._call("free")
        assert set(ids) <= self.held, f"freed blocks not held: {sorted(set(ids) - self.held)}"
        self.held -= set(ids)

    def start_load(self, meta: local_pb2.ReqMeta) -> None:
        self._call("start_load")
        assert meta.request_id not in self.loads, f"{meta.request_id} loading already"
        self.loads[meta.request_id] = meta

    def abort(self, request_id: str) -> None:
        self._call("abort")

    def get_finished(self) -> local_pb2.GetFinishedReply:
        self._call("get_finished")
        out, self.finished = self.finished, local_pb2.GetFinishedReply()
        for rid in list(out.done_recving) + [f.request_id for f in out.failed]:
            self.loads.pop(rid, None)
        return out

    def close(self) -> None:
        self.closed = True


class Dialer:
    """The worker's ``dial``: a new FakeClient per call, all kept."""

    def __init__(self) -> None:
        self.clients: list[FakeClient] = []
        self.refuse: errors.KVSidecarError | None = None

    def __call__(self, path: str, **kwargs: Any) -> FakeClient:
        if self.refuse is not None:
            raise self.refuse
        c = FakeClient(path)
        self.clients.append(c)
        return c

    @property
    def last(self) -> FakeClient:
        return self.clients[-1]


def kv_tensor() -> torch.Tensor:
    """One layer's vLLM KV tensor in the CPU backend's layout: [blocks,
    heads, block_size, 2 * head_dim], bf16."""
    return torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.bfloat16)


def staging_worker(tmp_path: Any) -> tuple[WorkerSide, Dialer, dict[str, torch.Tensor]]:
    w = KVSidecarConnector(vllm_config("decode", "kv_consumer", 1, str(tmp_path), tp_rank=0),
                           KVConnectorRole.WORKER, SimpleNamespace(num_blocks=NUM_BLOCKS))._worker
    assert w is not None
    dial = Dialer()
    w.dial = dial  # type: ignore[assignment]
    w.layout_of = lambda cfg: layer_layout("CPU_ATTN", "LBHNC", HEAD_DIM)
    caches = {f"model.layers.{i}.self_attn.attn": kv_tensor() for i in range(LAYERS)}
    w.register_kv_caches(caches)
    return w, dial, caches


def load(rid: str, block_ids: list[int], **kw: Any) -> KVSidecarConnectorMetadata:
    return KVSidecarConnectorMetadata(loads=[LoadSpec(rid, block_ids, PARAMS, **kw)])


def test_a_staged_load_lands_the_sidecars_bytes_in_vllms_blocks_and_frees_its_own(tmp_path: Any) -> None:
    w, dial, caches = staging_worker(tmp_path)
    c = dial.last
    assert isinstance(w.mode, StagingMode) and c.calls[:1] == ["attach"]
    w.start_load_kv(load("r1", [3, 5]))
    meta = c.loads["r1"]
    # The load lands in two sidecar blocks allocated for it, from remote block 0.
    assert list(meta.local_block_ids) == [1, 2] and c.held == {1, 2}
    assert list(meta.params.remote_block_ids) == [5, 6, 7]
    # The sidecar wrote sidecar block 2 of layer 1's K region (region 2).
    assert c.info is not None
    bl = c.info.block_len
    c.regions[2][2 * bl:3 * bl] = bytes(range(256)) * (bl // 256)
    c.finished = local_pb2.GetFinishedReply(done_recving=["r1"])
    assert w.get_finished() == (None, {"r1"})
    # Staging block 2 pairs with vLLM block 5: layer 1's K of block 5 holds
    # those bytes ([heads, block_size, head_dim], HND as the sidecar's).
    assert w.layout is not None
    k, v = w.layout.kv_views(caches["model.layers.1.self_attn.attn"], NUM_BLOCKS)
    assert k[5].contiguous().view(torch.uint8).flatten().tolist() == list(bytes(range(256)) * (bl // 256))
    assert v[5].count_nonzero() == 0
    assert caches["model.layers.1.self_attn.attn"][3].count_nonzero() == 0
    assert c.held == set() and w.get_block_ids_with_load_errors() == set()
    # What vLLM's /metrics gets from this rank: one load of 2 blocks of every
    # region (K and V of each layer), copied out once; then nothing new.
    st = w.take_stats()
    assert st is not None and len(st.data["transfer_duration"]) == 1 and st.data["transfer_duration"][0] >= 0
    assert st.data["bytes_transferred"] == [2 * bl * 2 * LAYERS] and st.data["num_failed_transfers"] == 0
    assert st.data["copied_bytes"] == 2 * bl * 2 * LAYERS
    assert w.take_stats() is None


def test_a_partly_failed_load_reports_exactly_the_vllm_blocks_that_did_not_land(tmp_path: Any) -> None:
    w, dial, _ = staging_worker(tmp_path)
    c = dial.last
    w.start_load_kv(load("r1", [3, 5, 6]))
    assert list(c.loads["r1"].local_block_ids) == [1, 2, 3]
    # Sidecar block 2 (vLLM's 5) failed its checksum.
    c.finished = local_pb2.GetFinishedReply(failed=[local_pb2.FailedRequest(
        request_id="r1", block_ids=[2], error=common_pb2.Error(code=common_pb2.CODE_DATA_LOSS, message="checksum"))])
    assert w.get_finished() == (None, {"r1"})
    assert w.get_block_ids_with_load_errors() == {5}
    assert c.held == set()
    # A failed transfer, not a transfer; the blocks that landed were copied.
    st = w.take_stats()
    assert st is not None and st.data["num_failed_transfers"] == 1 and st.data["transfer_duration"] == []
    assert c.info is not None and st.data["copied_bytes"] == 2 * c.info.block_len * 2 * LAYERS


def test_a_refused_allocation_fails_the_load_and_allocates_nothing(tmp_path: Any) -> None:
    w, dial, _ = staging_worker(tmp_path)
    c = dial.last
    c.refuse_alloc = errors.Busy("no free blocks")
    w.start_load_kv(load("r1", [3, 5]))
    assert "start_load" not in c.calls and c.held == set()
    assert w.get_finished() == (None, {"r1"})
    assert w.get_block_ids_with_load_errors() == {3, 5}


def test_an_aborted_load_is_reported_received_without_errors_and_its_blocks_freed(tmp_path: Any) -> None:
    w, dial, caches = staging_worker(tmp_path)
    c = dial.last
    w.start_load_kv(load("r1", [3]))
    w.start_load_kv(KVSidecarConnectorMetadata(aborts=["r1"]))
    assert c.calls.count("abort") == 1
    c.regions[0][:16] = b"\xff" * 16
    c.finished = local_pb2.GetFinishedReply(done_recving=["r1"])
    assert w.get_finished() == (None, {"r1"})
    # Nothing is copied into vLLM's block for an aborted request.
    assert caches["model.layers.0.self_attn.attn"][3].count_nonzero() == 0
    assert w.get_block_ids_with_load_errors() == set() and c.held == set()


def test_staging_survives_a_lost_connection_failing_its_loads_and_dialling_again(tmp_path: Any) -> None:
    w, dial, _ = staging_worker(tmp_path)
    first = dial.last
    w.start_load_kv(load("r1", [3, 5]))
    first.broken = errors.BrokenConnection("sidecar exited")
    assert w.get_finished() == (None, {"r1"})
    assert w.get_block_ids_with_load_errors() == {3, 5} and first.closed
    # The next step dials again and the next load runs on the new connection.
    w.start_load_kv(load("r2", [4]))
    assert len(dial.clients) == 2 and list(dial.last.loads) == ["r2"]


def test_staging_with_the_sidecar_unreachable_fails_each_load_and_never_raises(tmp_path: Any) -> None:
    w, dial, _ = staging_worker(tmp_path)
    dial.last.broken = errors.BrokenConnection("sidecar exited")
    dial.refuse = errors.Unavailable("no socket")
    w.start_load_kv(load("r1", [3]))
    assert w.get_finished() == (None, {"r1"})
    w.start_load_kv(load("r2", [4]))
    assert w.get_finished() == (None, {"r2"})
    assert w.get_block_ids_with_load_errors() == {3, 4}
    st = w.take_stats()
    assert st is not None and st.data["num_failed_transfers"] == 2 and st.data["bytes_transferred"] == []


def test_zero_copy_loads_into_vllms_own_blocks_and_stops_the_engine_on_a_lost_connection(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    w = KVSidecarConnector(vllm_config("decode", "kv_consumer", 1, str(tmp_path), tp_rank=0, more={"zero_copy": True}),
                           KVConnectorRole.WORKER, SimpleNamespace(num_blocks=NUM_BLOCKS))._worker
    assert w is not None
    c = FakeClient("fake")
    # What allocate_kv_cache leaves after it attached (its views are tested
    # in test_vllm_zerocopy.py).
    w.client, w.mode = c, ZeroCopyMode(w)  # type: ignore[assignment]
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": kv_tensor() for i in range(LAYERS)})
    assert c.calls == [], "zero copy attached at allocation: register attaches nothing"
    assert w.handshake().zero_copy
    w.start_load_kv(load("r1", [3, 5]))
    assert list(c.loads["r1"].local_block_ids) == [3, 5] and "alloc" not in c.calls
    w.sync_mappings(KVSidecarConnectorMetadata(sync_mappings=False))
    assert "sync" not in c.calls
    w.sync_mappings(KVSidecarConnectorMetadata(sync_mappings=True))
    assert c.calls.count("sync") == 1
    c.broken = errors.BrokenConnection("sidecar exited")
    with pytest.raises(RuntimeError, match=r"rank 0: sidecar connection lost \(sidecar exited \(CODE_UNAVAILABLE\)\); "
                                           r"in zero-copy mode .* restart it with its sidecars"):
        w.get_finished()
    with pytest.raises(RuntimeError, match="in zero-copy mode"):
        w.sync_mappings(KVSidecarConnectorMetadata(sync_mappings=True))


def test_a_worker_that_stages_says_why_when_zero_copy_was_asked_for(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    w = KVSidecarConnector(vllm_config("decode", "kv_consumer", 1, str(tmp_path), tp_rank=0, more={"zero_copy": True}),
                           KVConnectorRole.WORKER, SimpleNamespace(num_blocks=NUM_BLOCKS))._worker
    assert w is not None
    w.dial = Dialer()  # type: ignore[assignment]
    w.layout_of = lambda cfg: layer_layout("CPU_ATTN", "LBHNC", HEAD_DIM)
    with caplog.at_level(logging.WARNING):
        w.register_kv_caches({f"model.layers.{i}.self_attn.attn": kv_tensor() for i in range(LAYERS)})
    hs = w.handshake()
    assert not hs.zero_copy and hs.why == w.why_staging and hs.why
    assert [r.getMessage() for r in caplog.records if "zero copy off" in r.getMessage()] == [
        f"rank 0: zero copy off, the connector stages: {hs.why}"]
