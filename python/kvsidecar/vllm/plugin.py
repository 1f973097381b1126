"""kvsidecar's vLLM plugin: routes vLLM's KV cache allocation to the sidecar
for zero copy (:mod:`kvsidecar.vllm.zerocopy`).

vLLM loads it in every process it starts (the API server, the engine core
and each worker) through the ``vllm.general_plugins`` entry point
``kvsidecar`` of this package (``python/pyproject.toml``); ``VLLM_PLUGINS``,
when set, must name it. :func:`register` asks
:func:`kvsidecar.vllm.compat.for_release` for the installed release's module
(``compat/v0_32.py`` for vllm 0.32.0, upstream tag v0.32.0), which checks the
private names it relies on against its record and then replaces:

- ``vllm.v1.worker.gpu_model_runner.allocate_kv_cache``: when this process's
  KV connector is a KVSidecarConnector with zero copy on, the per-layer KV
  tensors are views of the sidecar's pages (:func:`_allocate`); otherwise
  vLLM's own runs.
- ``vllm.v1.engine.core.EngineCoreProc._process_input_queue`` (wrapped): on
  its first call hands the scheduler's KVSidecarConnector a way to wake the
  idle engine loop (:func:`_hand_waker`), so that blocks vLLM freed are
  released on time while no request runs.

Nothing changes in a process whose connector is another one. On a vLLM
release zero copy does not know, or one whose private names moved, it
replaces nothing and says why in :data:`why_not`; the connector then logs
that line and stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["register", "why_not"]

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

    from kvsidecar.vllm import compat

    try:
        rel = compat.for_release(vllm.__version__)
    except compat.Refused as e:
        why_not = f"{e}: its KV cache allocation was left alone"
        return
    rel.install_hooks(_allocate, _hand_waker)
    why_not, _installed = "", True


def _allocate(kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None) -> dict[str, Any] | None:
    """vLLM's allocate_kv_cache in this process: the views of this
    worker's KVSidecarConnector, or None (vLLM allocates its own)."""
    connector = _connector()
    if connector is None:
        return None
    return connector.allocate_kv_cache(kv_cache_config, layout, kernel_block_sizes, device)


def _hand_waker(connector: Any, wake: Callable[[], None]) -> None:
    """Hands the engine core's ``wake`` to its scheduler's connector when
    that is a KVSidecarConnector (another connector has no such hook)."""
    if hasattr(connector, "set_engine_waker"):
        connector.set_engine_waker(wake)


def _connector() -> Any:
    """This worker's KVSidecarConnector, or None: the connector with the
    plugin's hook ``allocate_kv_cache`` (``kvsidecar.vllm.connector.
    PLUGIN_HOOKS``; no vLLM connector has one). Told by its hook rather than
    its class, so that this module imports nothing of the connector's and the
    connector's worker can read :data:`why_not`."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    c = get_kv_transfer_group()
    return c if callable(getattr(c, "allocate_kv_cache", None)) else None
