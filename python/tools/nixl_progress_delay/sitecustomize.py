"""Bench-only shim (``make bench-vllm``'s ``-evt`` NIXL setups): gives NIXL's
progress thread a poll timeout instead of a busy poll.

nixl 1.5.1's Python API builds every agent with ``pthrDelay = 0``
(``nixl_cu13/_api.py``, ``nixl_agent.__init__``), and vLLM 0.32.0's
NixlConnector exposes no setting for it. With 0, the UCX backend's shared
progress thread (``nixlUcxSharedThread::run``) calls ``poll`` with a zero
timeout in a loop: one core per engine, for the engine's whole life. This
module, put on ``PYTHONPATH`` of a vLLM server, sets ``pthrDelay`` to
``KVSIDECAR_NIXL_PTHR_DELAY_US`` microseconds before each agent is created,
so the thread sleeps in ``poll`` until UCX has an event or the delay passes.
It changes nothing else, and nothing when the variable is unset. It is not
part of kvsidecar: the benchmark uses it to show what the busy poll costs on
a machine with two cores.
"""

import os

_delay = os.environ.get("KVSIDECAR_NIXL_PTHR_DELAY_US")
if _delay:
    try:
        import nixl_cu13._api as _api

        _new_agent = _api.nixlBind.nixlAgent

        def _agent(name, config, _new_agent=_new_agent, _delay_us=int(_delay)):  # type: ignore[no-untyped-def]
            config.pthrDelay = _delay_us
            return _new_agent(name, config)

        _api.nixlBind.nixlAgent = _agent
    except Exception as e:  # a bench shim must not stop the server; it says why
        import sys

        print(f"kvsidecar nixl_progress_delay: not applied: {e}", file=sys.stderr)
