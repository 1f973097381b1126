"""A vLLM stand-in for the connector tests that real vLLM engines cannot
run on this machine (decode TP 4, kills and restarts of single ranks,
hundreds of blocks per rank): config objects, requests, the scheduler
output and an engine loop that calls KVSidecarConnector (the real
KVConnectorBase_V1 subclass) in the order vLLM's v1 engine does, on torch
tensors in the per-layer layouts of vLLM 0.32.0's attention backends
(``[num_blocks, heads, block_size, 2 * head_size]`` logical, see
kvsidecar.staging).

The call order (vLLM's Scheduler.schedule / update_from_output and the
model runner's KV connector mixin): scheduler get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta; each worker
bind_connector_metadata, per layer wait_for_layer_load and save_kv_layer,
start_load_kv, wait_for_save, get_finished, get_block_ids_with_load_errors,
clear_connector_metadata; scheduler request_finished for requests that
stopped, then update_connector_output with the workers' output aggregated
(a request is finished when every worker reported it; invalid blocks are
the union).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from types import SimpleNamespace
from typing import Any

import torch

from kvsidecar.dev.devserve import time_scale
from kvsidecar.staging import LayerLayout, layer_layout
from kvsidecar.vllm.connector import KVConnectorRole, KVSidecarConnector

# llama-3.2-1b's KV geometry (its config.json): 16 layers, 8 KV heads of 64.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 64, 16


class RequestStatus(enum.Enum):
    """vLLM's RequestStatus names the connector reads."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0


class KVCacheBlocks:
    """vLLM's KVCacheBlocks as the connector reads it (one KV cache group)."""

    def __init__(self, ids: list[int], unhashed: list[int]) -> None:
        self._ids, self._unhashed = ids, unhashed

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self._ids),)

    def get_unhashed_block_ids(self) -> list[int]:
        return list(self._unhashed)


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclasses.dataclass
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: set[str]


def empty_output(finished: set[str] | None = None) -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData([], set(), [], []), {}, finished or set())


@dataclasses.dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)


class ModelConfig:
    model = "meta-llama/Llama-3.2-1B"
    dtype = torch.bfloat16

    def get_num_layers(self, parallel_config: Any) -> int:
        return LAYERS

    def get_total_num_kv_heads(self) -> int:
        return KV_HEADS

    def get_head_size(self) -> int:
        return HEAD_DIM


#: The resolved KVCacheLayout each backend runs with here: the CPU backend's
#: only one, FlashAttention's default (LBNHC, tokens outside heads: a
#: permuted view), FlashInfer's HND.
LAYOUTS = {"CPU_ATTN": "LBHNC", "FLASH_ATTN": "LBNHC", "FLASHINFER": "LBHNC"}


def vllm_config(engine_id: str, kv_role: str, tp_size: int, socket_dir: str, tp_rank: int | None = None,
                more: dict[str, Any] | None = None) -> Any:
    extra: dict[str, Any] = {"socket_dir": socket_dir, **(more or {})}
    if tp_rank is not None:
        extra["tp_rank"] = tp_rank
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=engine_id, kv_role=kv_role, kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto"),
        model_config=ModelConfig(),
    )


def pattern(seed: int, layer: int, kvi: int, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """bf16 KV values (given by their bit patterns) of token positions ×
    global heads × head_dim: a shifted token (16 positions), another head,
    layer or K/V, or another request's seed gives other values."""
    c = (seed * 7919 + layer * 104_729 + kvi * 15_485_863) & 0x7FFF
    v = (positions.to(torch.int32).view(-1, 1, 1) * 131 + heads.to(torch.int32).view(1, -1, 1) * 8191
         + torch.arange(0, 3 * HEAD_DIM, 3, dtype=torch.int32).view(1, 1, -1) + c)
    return (v & 0x7FFF).to(torch.int16).view(torch.bfloat16)


class Engine:
    """One vLLM instance: a scheduler-side connector, one worker-side
    connector per TP rank, each with its own KV tensors, and a block pool."""

    def __init__(self, engine_id: str, kv_role: str, tp_size: int, socket_dir: str, num_blocks: int,
                 backend: str = "CPU_ATTN", kernel_ratio: int = 1, extra: dict[str, Any] | None = None) -> None:
        self.engine_id, self.tp_size, self.num_blocks = engine_id, tp_size, num_blocks
        # vLLM splits each block into kernel_ratio kernel blocks when the
        # backend's kernels take smaller blocks (dim 0 then counts those).
        self.kernel_ratio = kernel_ratio
        self.heads = KV_HEADS // tp_size
        self.layout: LayerLayout = layer_layout(backend, LAYOUTS[backend], HEAD_DIM)
        kcc = SimpleNamespace(num_blocks=num_blocks)
        self.sched = KVSidecarConnector(vllm_config(engine_id, kv_role, tp_size, socket_dir, more=extra),
                                        KVConnectorRole.SCHEDULER, kcc)
        self.workers = []
        self.kv: list[dict[str, torch.Tensor]] = []
        for r in range(tp_size):
            w = KVSidecarConnector(vllm_config(engine_id, kv_role, tp_size, socket_dir, tp_rank=r, more=extra),
                                   KVConnectorRole.WORKER, kcc)
            # No vLLM model runs here to name its attention backend.
            w._worker.layout_of = lambda cfg: self.layout
            caches = {f"model.layers.{i}.self_attn.attn": self._kv_tensor(num_blocks) for i in range(LAYERS)}
            w.register_kv_caches(caches)
            self.workers.append(w)
            self.kv.append(caches)
        self.free_blocks = list(range(1, num_blocks))  # vLLM's block 0 is its null block too
        self.finished_req_ids: set[str] = set()
        self._reported: dict[tuple[str, str], set[int]] = {}

    def _kv_tensor(self, num_blocks: int) -> torch.Tensor:
        """One layer's tensor, logical [kernel blocks, heads, kernel block
        size, 2 * head_dim], in the memory order of the backend's layout."""
        nb, bs = num_blocks * self.kernel_ratio, BLOCK_SIZE // self.kernel_ratio
        if self.layout.layout == "LBNHC":
            t = torch.zeros(nb, bs, self.heads, 2 * HEAD_DIM, dtype=torch.bfloat16)
            return t.permute(0, 2, 1, 3)
        return torch.zeros(nb, self.heads, bs, 2 * HEAD_DIM, dtype=torch.bfloat16)

    def kvs(self, rank: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer of ``rank``, each [blocks, kernel_ratio,
        heads, kernel block size, head_dim] over the layer's tensor (the
        backend's split)."""
        return self.layout.kv_views(self.kv[rank][name], self.num_blocks)

    def tokens(self, rank: int, name: str, kvi: int, blocks: list[int], positions: torch.Tensor) -> torch.Tensor:
        """K (kvi 0) or V of ``positions`` of a request in ``blocks``:
        [positions, heads, head_dim]; a view, so assigning writes."""
        nk = BLOCK_SIZE // self.kernel_ratio
        b = torch.tensor([blocks[q // BLOCK_SIZE] for q in positions.tolist()])
        t = positions % BLOCK_SIZE
        return self.kvs(rank, name)[kvi][b, t // nk, :, t % nk]

    def blocks_hnd(self, rank: int, name: str, kvi: int, blocks: list[int]) -> torch.Tensor:
        """K or V of ``blocks`` as [blocks, heads, block_size, head_dim] (a copy)."""
        v = self.kvs(rank, name)[kvi][blocks]
        return v.permute(0, 2, 1, 3, 4).reshape(len(blocks), self.heads, BLOCK_SIZE, HEAD_DIM)

    def alloc(self, n: int) -> list[int]:
        assert len(self.free_blocks) >= n, "vLLM block pool exhausted"
        out, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return out

    def free(self, ids: list[int]) -> None:
        self.free_blocks.extend(ids)

    def step(self, so: SchedulerOutput, compute: dict[str, tuple[list[int], int, int, int]] | None = None) -> KVConnectorOutput:
        """One engine step: build_connector_meta, then every worker runs the
        connector's forward-pass hooks; ``compute`` maps a request to
        (its vLLM blocks, first position, tokens, seed): the KV the forward
        pass writes (the pattern) before each layer is saved."""
        so.finished_req_ids = self.finished_req_ids
        self.finished_req_ids = set()
        meta = self.sched.build_connector_meta(so)
        outs = []
        for r, w in enumerate(self.workers):
            # vLLM 0.32.0's KVConnectorModelRunnerMixin with asynchronous
            # loads: bind, the forward pass (each attention layer between
            # wait_for_layer_load and save_kv_layer), then start_load_kv and
            # wait_for_save.
            w.bind_connector_metadata(meta)
            for i, (name, kv) in enumerate(self.kv[r].items()):
                w.wait_for_layer_load(name)
                for blocks, start, n, seed in (compute or {}).values():
                    self.write(r, i, name, blocks, start, n, seed)
                w.save_kv_layer(name, kv, None)
            w.start_load_kv(SimpleNamespace(no_compile_layers={}))
            w.wait_for_save()
            sending, recving = w.get_finished(so.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            outs.append((sending or set(), recving or set(), invalid))
        # KVOutputAggregator: a request is finished once every worker has
        # reported it, in this step or earlier ones.
        out = KVConnectorOutput(invalid_block_ids=set().union(*(o[2] for o in outs)))
        for kind, i in (("sending", 0), ("recving", 1)):
            ready = set()
            for r, o in enumerate(outs):
                for rid in o[i]:
                    ranks = self._reported.setdefault((kind, rid), set())
                    assert r not in ranks, f"worker {r} reported {rid} in finished_{kind} twice"
                    ranks.add(r)
                    if len(ranks) == self.tp_size:
                        ready.add(rid)
            setattr(out, "finished_" + kind, ready or None)
        self.sched.update_connector_output(out)
        return out

    def write(self, rank: int, layer: int, name: str, blocks: list[int], start: int, n: int, seed: int) -> None:
        """The forward pass writing positions [start, start+n) of a request
        whose KV lives in ``blocks`` (vLLM's slot mapping)."""
        pos = torch.arange(start, start + n)
        heads = torch.arange(rank * self.heads, (rank + 1) * self.heads)
        nk = BLOCK_SIZE // self.kernel_ratio
        b = torch.tensor([blocks[q // BLOCK_SIZE] for q in pos.tolist()])
        t = pos % BLOCK_SIZE
        for kvi, view in enumerate(self.kvs(rank, name)):
            view[b, t // nk, :, t % nk] = pattern(seed, layer, kvi, pos, heads)

    # -- the two roles ---------------------------------------------------------

    def prefill(self, rid: str, prompt_len: int, seed: int, chunk: int | None = None,
                status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED) -> tuple[dict[str, Any] | None, list[int]]:
        """Runs a prefill request (max_tokens=1) to its end in chunks of
        ``chunk`` tokens; returns its kv_transfer_params for the decode and
        the vLLM blocks it used (freed already)."""
        req = Request(rid, list(range(prompt_len)), {"do_remote_decode": True})
        n, is_async = self.sched.get_num_new_matched_tokens(req, 0)
        assert (n, is_async) == (0, False)
        nblocks = -(-prompt_len // BLOCK_SIZE)
        blocks = self.alloc(nblocks)
        self.sched.update_state_after_alloc(req, KVCacheBlocks(blocks, blocks), 0)
        chunk = chunk or prompt_len
        done = 0
        while done < prompt_len:
            n = min(chunk, prompt_len - done)
            have = -(-(done + n) // BLOCK_SIZE)
            given = -(-done // BLOCK_SIZE)
            if done == 0:
                so = SchedulerOutput([NewRequestData(rid, req.prompt_token_ids, (blocks[:have],), 0)],
                                     CachedRequestData([], set(), [], []), {rid: n}, set())
            else:
                so = SchedulerOutput([], CachedRequestData([rid], set(), [(blocks[given:have],)], [done]), {rid: n}, set())
            self.step(so, {rid: (blocks, done, n, seed)})
            done += n
        req.status = status
        delay, params = self.sched.request_finished(req, blocks)
        assert delay is False, "the sidecar keeps its own copy: vLLM's blocks are never held"
        self.free(blocks)
        self.finished_req_ids.add(rid)
        return params, blocks

    def start_decode(self, rid: str, prompt_len: int, params: dict[str, Any],
                     hit_blocks: list[int] | None = None) -> tuple[Request, list[int]]:
        """Schedules a decode request whose KV comes from a remote prefill;
        ``hit_blocks`` are vLLM blocks already holding its first tokens
        (a local prefix cache hit). Returns the request and all its blocks."""
        req = Request(rid, list(range(prompt_len)), dict(params))
        hit = hit_blocks or []
        n, is_async = self.sched.get_num_new_matched_tokens(req, len(hit) * BLOCK_SIZE)
        assert (n, is_async) == (prompt_len - len(hit) * BLOCK_SIZE, True)
        new = self.alloc(-(-prompt_len // BLOCK_SIZE) - len(hit))
        self.sched.update_state_after_alloc(req, KVCacheBlocks(hit + new, new), n)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return req, hit + new

    def run_until(self, rids: set[str], timeout: float = 60.0) -> tuple[set[str], set[int]]:
        """Steps (no tokens scheduled) until every request in rids is in
        finished_recving; returns them and the union of invalid block ids."""
        got: set[str] = set()
        invalid: set[int] = set()
        deadline = time.monotonic() + timeout * time_scale()
        while not rids <= got:
            if time.monotonic() > deadline:
                raise AssertionError(f"finished_recving {got} of {rids} within {timeout}s")
            out = self.step(empty_output())
            got |= out.finished_recving or set()
            invalid |= out.invalid_block_ids
            time.sleep(0.002)
        return got, invalid

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.sched.shutdown()
