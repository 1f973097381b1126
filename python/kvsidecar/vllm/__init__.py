"""kvsidecar's vLLM integration, in the shape of vLLM's own NIXL connector
package (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``):

- :mod:`kvsidecar.vllm.connector`: ``KVSidecarConnector``, the
  ``KVConnectorBase_V1`` front vLLM builds (``kv_connector_module_path``
  ``kvsidecar.vllm``; the name is also importable from this package);
- :mod:`kvsidecar.vllm.scheduler` and :mod:`kvsidecar.vllm.worker`: its
  halves in vLLM's scheduler process and in each worker (one TP rank);
- :mod:`kvsidecar.vllm.metadata`: its settings and the per-step metadata the
  scheduler half sends the workers;
- :mod:`kvsidecar.vllm.stats`: its counters in vLLM's metrics;
- :mod:`kvsidecar.vllm.zerocopy`: zero copy's release-independent part (the
  mode the ranks agree on, the block layouts);
- :mod:`kvsidecar.vllm.compat`: every use of vLLM's private code, one module
  per supported release, imported only when zero copy is asked for;
- :mod:`kvsidecar.vllm.plugin`: the ``vllm.general_plugins`` entry point
  that routes vLLM's KV cache allocation through the connector.

This module imports nothing from vLLM itself: the plugin entry point loads
it in every vLLM process, and ``KVSidecarConnector`` is imported on first
use (vLLM's connector factory does ``getattr(module, "KVSidecarConnector")``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsidecar.vllm.connector import KVSidecarConnector, KVSidecarConnectorMetadata

__all__ = ["KVSidecarConnector", "KVSidecarConnectorMetadata"]


def __getattr__(name: str) -> Any:
    """``KVSidecarConnector`` and ``KVSidecarConnectorMetadata``, imported
    from :mod:`kvsidecar.vllm.connector` on first use (PEP 562)."""
    if name in __all__:
        from kvsidecar.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
