"""KVSidecarConnector's statistics in vLLM's metrics: its loads (time, bytes,
failures) and the KV bytes it copied between vLLM's tensors and the
sidecar's pages.

Each worker records its loads, and the scheduler half its refusals
(:class:`ConnectorStats`, taken by ``get_kv_connector_stats`` every step, on
both sides: vllm 0.32.0 ``Scheduler.update_from_output`` aggregates the
scheduler's with the workers'); vLLM aggregates the TP ranks'
records, ships them to its API server and observes them in
:class:`ConnectorPromMetrics`, per engine, at ``/metrics``:

- ``vllm:kvsidecar_xfer_time_seconds`` (histogram): per load and rank, from
  the worker's StartLoad until the worker saw it done (its ``get_finished``
  poll), the span ``vllm:nixl_xfer_time_seconds`` measures for
  NixlConnector (from posting the READ until the worker saw it done);
- ``vllm:kvsidecar_bytes_transferred`` (histogram): per load and rank, the
  KV bytes that landed (the blocks × the rank's block bytes of every
  region), as ``vllm:nixl_bytes_transferred``;
- ``vllm:kvsidecar_num_failed_transfers_total`` (counter): loads that did
  not land whole on a rank (refused by the sidecar, failed in part or in
  full, or lost with the connection; not aborts), as
  ``vllm:nixl_num_failed_transfers``;
- ``vllm:kvsidecar_num_refused_params_total`` (counter, the scheduler's):
  decode requests whose ``kv_transfer_params`` the connector refused before
  claiming a token (unusable, another prompt's token digests, a prefill of
  another kind): no load starts, the prompt is computed here, the log line
  says why;
- ``vllm:kvsidecar_copied_bytes_total`` (counter): the staging copies, every
  KV byte they move each way (prefill: vLLM to sidecar, decode: sidecar to
  vLLM); 0 under zero copy.

The histogram buckets are NixlConnector's, so the two connectors' series
compare bucket by bucket. (``KVConnectorStats``,
``KVConnectorPromMetrics``: ``vllm/distributed/kv_transfer/kv_connector/v1/
metrics.py``; NixlConnector's series and buckets: ``.../v1/nixl/stats.py``,
vllm 0.32.0.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["ConnectorPromMetrics", "ConnectorStats"]

#: ``vllm:kvsidecar_xfer_time_seconds`` buckets, seconds (NixlConnector's
#: ``vllm:nixl_xfer_time_seconds``, vllm 0.32.0 ``nixl/stats.py``).
XFER_TIME_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
#: ``vllm:kvsidecar_bytes_transferred`` buckets, bytes: 2 KiB to 8 GiB by
#: 4× (NixlConnector's ``vllm:nixl_bytes_transferred``, same source).
BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))


@dataclasses.dataclass
class ConnectorStats(KVConnectorStats):
    """One worker's records since the last take, or the TP ranks'
    aggregate. ``data`` (plain lists and ints: vLLM ships it between
    processes): ``transfer_duration`` (seconds per load), ``bytes_transferred``
    (bytes per load), ``num_failed_transfers``, ``num_refused_params`` and
    ``copied_bytes`` (ints)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"transfer_duration": [], "bytes_transferred": [], "num_failed_transfers": 0,
                     "num_refused_params": 0, "copied_bytes": 0}

    def record_transfer(self, duration_seconds: float, nbytes: int) -> None:
        """A load that landed whole on this rank."""
        self.data["transfer_duration"].append(float(duration_seconds))
        self.data["bytes_transferred"].append(int(nbytes))

    def record_failed_transfer(self) -> None:
        """A load that did not land whole on this rank."""
        self.data["num_failed_transfers"] = int(self.data.get("num_failed_transfers", 0)) + 1

    def record_refused_params(self) -> None:
        """A decode request's params refused before a token was claimed."""
        self.data["num_refused_params"] = int(self.data.get("num_refused_params", 0)) + 1

    def aggregate(self, other: KVConnectorStats) -> ConnectorStats:
        for k in ("transfer_duration", "bytes_transferred"):
            self.data.setdefault(k, []).extend(other.data.get(k, ()))
        for k in ("num_failed_transfers", "num_refused_params", "copied_bytes"):
            self.data[k] = int(self.data.get(k, 0)) + int(other.data.get(k, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: loads, their mean time (ms), bytes, failures
        and bytes copied."""
        d = self.data.get("transfer_duration", [])
        return {"Num successful transfers": len(d),
                "Avg xfer time (ms)": round(1000 * sum(d) / len(d), 3) if d else 0.0,
                "Total bytes transferred": int(sum(self.data.get("bytes_transferred", []))),
                "Num failed transfers": int(self.data.get("num_failed_transfers", 0)),
                "Num refused params": int(self.data.get("num_refused_params", 0)),
                "Bytes copied": int(self.data.get("copied_bytes", 0))}

    def is_empty(self) -> bool:
        return not (self.data.get("transfer_duration") or self.data.get("num_failed_transfers")
                    or self.data.get("num_refused_params") or self.data.get("copied_bytes"))


class ConnectorPromMetrics(KVConnectorPromMetrics):
    """The series named in the module doc, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(m: Any) -> dict[int, Any]:
            return create_metric_per_engine(m, per_engine_labelvalues)

        # vLLM's metric_types classes (prometheus_client's, or its Ray
        # wrappers), typed there as a union of the metric kinds.
        histogram: Any = self._histogram_cls

        self.xfer_time = per_engine(histogram(
            name="vllm:kvsidecar_xfer_time_seconds",
            documentation="KVSidecarConnector loads, per TP rank: seconds from StartLoad until the worker saw the "
                          "load done.",
            buckets=list(XFER_TIME_BUCKETS_SECONDS), labelnames=labelnames))
        self.xfer_bytes = per_engine(histogram(
            name="vllm:kvsidecar_bytes_transferred",
            documentation="KVSidecarConnector loads, per TP rank: KV bytes landed.",
            buckets=list(BYTES_BUCKETS), labelnames=labelnames))
        self.failed = per_engine(self._counter_cls(
            name="vllm:kvsidecar_num_failed_transfers",
            documentation="KVSidecarConnector loads that did not land whole on a TP rank (their blocks recomputed).",
            labelnames=labelnames))
        self.refused = per_engine(self._counter_cls(
            name="vllm:kvsidecar_num_refused_params",
            documentation="Decode requests whose kv_transfer_params KVSidecarConnector refused before claiming a "
                          "token (unusable, another prompt's, a prefill of another kind); computed locally.",
            labelnames=labelnames))
        self.copied = per_engine(self._counter_cls(
            name="vllm:kvsidecar_copied_bytes",
            documentation="KV bytes KVSidecarConnector copied between vLLM's KV tensors and the sidecar's pages "
                          "(staging; 0 under zero copy), all TP ranks.",
            labelnames=labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for s in transfer_stats_data.get("transfer_duration", ()):
            self.xfer_time[engine_idx].observe(float(s))
        for n in transfer_stats_data.get("bytes_transferred", ()):
            self.xfer_bytes[engine_idx].observe(int(n))
        # A counter only grows; vLLM's server stops on a negative inc.
        if (f := int(transfer_stats_data.get("num_failed_transfers", 0))) > 0:
            self.failed[engine_idx].inc(f)
        if (r := int(transfer_stats_data.get("num_refused_params", 0))) > 0:
            self.refused[engine_idx].inc(r)
        if (n := int(transfer_stats_data.get("copied_bytes", 0))) > 0:
            self.copied[engine_idx].inc(n)
