"""KVSidecarConnector's statistics in vLLM's metrics: the KV bytes the
connector copied between vLLM's tensors and the sidecar's pages.

The workers count (``get_kv_connector_stats``); vLLM sums the TP ranks'
counts every step, ships them to its API server and adds them to
``vllm:kvsidecar_copied_bytes_total`` (a counter per engine, at ``/metrics``):
the staging copies count every KV byte they move, each way (prefill: vLLM
to sidecar, decode: sidecar to vLLM); zero copy moves none.
(``KVConnectorStats``, ``KVConnectorPromMetrics``:
``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``, vllm 0.32.0.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["CopyPromMetrics", "CopyStats"]


@dataclasses.dataclass
class CopyStats(KVConnectorStats):
    """``data``: ``copied_bytes`` (int), KV bytes the connector copied."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"copied_bytes": 0}

    def aggregate(self, other: KVConnectorStats) -> CopyStats:
        self.data["copied_bytes"] = int(self.data.get("copied_bytes", 0)) + int(other.data.get("copied_bytes", 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {"copied_bytes": int(self.data.get("copied_bytes", 0))}

    def is_empty(self) -> bool:
        return not self.data.get("copied_bytes")


class CopyPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvsidecar_copied_bytes_total``, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(
            name="vllm:kvsidecar_copied_bytes",
            documentation="KV bytes KVSidecarConnector copied between vLLM's KV tensors and the sidecar's pages "
                          "(staging; 0 under zero copy), all TP ranks.",
            labelnames=labelnames,
        )
        self.copied: dict[int, Any] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        n = int(transfer_stats_data.get("copied_bytes", 0))
        if n > 0:  # a counter only grows; vLLM's server stops on a negative inc
            self.copied[engine_idx].inc(n)
