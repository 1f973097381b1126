"""kvsidecar: the engine side of a KV-cache transfer sidecar.

One ``kvsidecar serve`` process runs beside each tensor-parallel rank of an
inference engine and moves finished requests' KV from prefill to decode
ranks over QUIC. This package is what an engine written in Python uses.

Modules by concern (the Go package each mirrors, where there is one):

- :mod:`kvsidecar.local`: the local API client (``localapi.Client``), over
  :mod:`kvsidecar.framing` (size-delimited frames and passed descriptors:
  ``internal/wire``, ``internal/fdpass``) and :mod:`kvsidecar.hostmap` (the
  engine's mapping of host pages and the block-offset rule:
  ``internal/kvgeom.Packing``); :mod:`kvsidecar.devicemap` maps a sidecar's
  device pages through the CUDA driver (``CudaDeviceMapping``, ctypes over
  libcuda: vmm/cuda's importer), or hands them to an engine's handler.
- :mod:`kvsidecar.paths`: the socket path rule (``localapi.SocketPath``).
- :mod:`kvsidecar.params`: ``kv_transfer_params`` JSON, the merge of the
  prefill ranks' exports (``connector.MergeExports``), ``ReqMeta``.
- :mod:`kvsidecar.rankset`: the sidecars of one engine instance, one client
  per rank: attach, allocate, free and finish on every rank, redial.
- :mod:`kvsidecar.staging`: a sidecar region as a tensor, and copies between
  an engine's KV tensors and sidecar blocks through vLLM's KV layouts (the
  one module that imports torch).
- :mod:`kvsidecar.vllm`: ``KVSidecarConnector``, the vLLM v1 KV connector,
  a package in the shape of vLLM's NIXL connector (front, scheduler and
  worker halves, metadata, stats, the plugin, zero copy, and vLLM's private
  names one module per release in :mod:`kvsidecar.vllm.compat`).
- :mod:`kvsidecar.errors`: typed errors carrying the wire code and reason.
- :mod:`kvsidecar.v1`: the generated protobuf modules (``make generate``).
- :mod:`kvsidecar.limits` and :mod:`kvsidecar.reasons`: the sidecar's limits
  and every error reason, generated from their Go constants (``make
  generate``, ``internal/pygen``).
- For trials and tests on one machine, not needed at run time:
  :mod:`kvsidecar.dev` (``kvsidecar serve`` processes, vLLM engines and a tiny
  model, a prefill/decode proxy).

The engine contract (call order, block ids, layouts, kv_transfer_params) is
``docs/engine-integration.md`` in the repository.
"""

__version__ = "0.1.0"
