"""Helpers for trials, tests and benchmarks on one machine, not needed at run
time by an engine: :mod:`kvsidecar.dev.devserve` (``kvsidecar serve``
processes on loopback), :mod:`kvsidecar.dev.devvllm` (vLLM engines and a
tiny model) and :mod:`kvsidecar.dev.pdproxy` (a prefill/decode proxy, like
vLLM's toy proxy for disaggregated serving)."""
