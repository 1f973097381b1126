"""kvsidecar: the engine side of a KV-cache transfer sidecar.

One ``kvsidecar serve`` process runs beside each tensor-parallel rank of an
inference engine and moves finished requests' KV from prefill to decode
ranks over QUIC. This package is what an engine written in Python uses:

- :mod:`kvsidecar.local`: a client of the sidecar's local API (unix socket,
  size-delimited protobuf frames, shared pages passed as file descriptors).
- :mod:`kvsidecar.vllm`: ``KVSidecarConnector``, a vLLM v1 KV connector that
  stages vLLM's KV blocks through the sidecar's pages.
- :mod:`kvsidecar.errors`: typed errors carrying the wire code.
- :mod:`kvsidecar.v1`: the generated protobuf modules (``make generate``).

The engine contract (call order, block ids, layouts, kv_transfer_params) is
``docs/engine-integration.md`` in the repository.
"""

__version__ = "0.1.0"
