"""Zero copy below a whole engine (the engines run in test_vllm_engines.py):
vLLM 0.32.0's own BlockPool turned into a SidecarBlockPool over a real
``kvsidecar serve``, with a clock of the test's; and what falls back to
staging, saying why once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from conftest import stats, wait_for
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

from kvsidecar.local import LocalClient
from kvsidecar.vllm import plugin as vllm_plugin
from kvsidecar.vllm.compat import Refused
from kvsidecar.vllm.compat.v0_32 import SidecarBlockPool
from kvsidecar.vllm.connector import KVConnectorRole, KVSidecarConnector
from kvsidecar.vllm.worker import ZeroCopyMode
from kvsidecar.vllm.zerocopy import (
    AVAILABLE_REFRESH_SECONDS,
    LIMIT_RETRY_SECONDS,
    LIMIT_WAIT_SECONDS,
    ModeHandshake,
    backend_layout,
    install_block_pool,
)

NUM_BLOCKS = 256
# 2 layers, 2 KV heads of 64, float32, 32 tokens: 32 KiB a block of a
# layer, 64 blocks to a 2 MiB page.
GEOMETRY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--dtype", "float32", "--block-size", "32",
            "--kv-layout", "H2ND", "--num-blocks", str(NUM_BLOCKS)]
PER_PAGE = 64


class Clock:
    """The pool's clock; its sleep advances it and runs ``on_sleep`` (a
    test's hook) first."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept = 0
        self.on_sleep: Callable[[int], None] = lambda n: None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += 1
        self.on_sleep(self.slept)
        self.now += seconds


@pytest.fixture
def pool(cluster):
    sc = cluster.start("zc", args=GEOMETRY)
    c = LocalClient(sc.socket)
    c.attach()
    clock = Clock()
    p = SidecarBlockPool.install(BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=32), c, hold_seconds=10,
                                 clock=clock, sleep=clock.sleep)
    yield SimpleNamespace(sc=sc, client=c, pool=p, clock=clock)
    c.close()


def cache(p: BlockPool, block, key: bytes) -> None:
    """Gives ``block`` a prefix-cache entry, as vLLM's cache_full_blocks does."""
    p._insert_block_hash(make_block_hash_with_group_id(BlockHash(key), 0), block, num_tokens=32)


def test_blocks_are_the_sidecars_and_follow_vllm(pool):
    assert stats(pool.sc)["blocks_used"] == 0
    a = pool.pool.get_new_blocks(3)
    ids = [b.block_id for b in a]
    assert sorted(ids) == [1, 2, 3], "the sidecar packs blocks into its first page (block 0 is the null block)"
    assert stats(pool.sc)["blocks_used"] == 3 and all(b.ref_cnt == 1 for b in a)
    assert pool.pool.get_num_free_blocks() == NUM_BLOCKS - 1 - 3
    # A block without prefix-cache content is freed on the sidecar at once;
    # one with content is held.
    cache(pool.pool, a[0], b"h0")
    pool.pool.free_blocks(a)
    assert stats(pool.sc)["blocks_used"] == 1
    assert pool.pool.get_num_free_blocks() == NUM_BLOCKS - 1, "vLLM counts a held block as free (evictable)"
    # A prefix hit takes the held block back; freed again, it is held again.
    hit = pool.pool.get_cached_block(BlockHash(b"h0"), [0])
    assert hit is not None and hit[0].block_id == 1
    pool.pool.touch(hit)
    assert hit[0].ref_cnt == 1 and stats(pool.sc)["blocks_used"] == 1
    pool.pool.free_blocks(hit)
    # New blocks never take a held one.
    b = pool.pool.get_new_blocks(2)
    assert sorted(x.block_id for x in b) == [2, 3]
    pool.pool.free_blocks(b)
    # Its hold runs out: the hash goes first, then the sidecar's block.
    pool.clock.now += 10
    assert pool.pool.release_is_due()
    pool.pool.release_due()
    assert pool.pool.get_cached_block(BlockHash(b"h0"), [0]) is None
    assert stats(pool.sc)["blocks_used"] == 0 and not pool.pool.release_is_due()


class Timers:
    """threading.Timer's stand-in: records each timer armed; the test fires
    them."""

    def __init__(self) -> None:
        self.armed: list[SimpleNamespace] = []

    def __call__(self, seconds: float, fn: Callable[[], None]) -> SimpleNamespace:
        t = SimpleNamespace(seconds=seconds, fn=fn, daemon=False, start=lambda: None)
        self.armed.append(t)
        return t


# fault-matrix: zero-copy-blocks-returned
def test_a_block_taken_back_and_freed_again_is_released_on_time(cluster):
    """The reported input: a zero-copy engine, idle after two requests of
    one prompt (the second a prefix hit on the first's held blocks), kept
    their blocks mapped past the hold until the next request: the wake-up
    armed for the first free fired before the blocks (freed again by the
    second) were due, the engine did not step, and nothing armed another."""
    sc = cluster.start("zc-wake", args=GEOMETRY)
    c = LocalClient(sc.socket)
    c.attach()
    clock, timers, woken = Clock(), Timers(), []
    p = SidecarBlockPool.install(BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=32), c, hold_seconds=10,
                                 clock=clock, sleep=clock.sleep, timer=timers)
    p.set_waker(lambda: woken.append(clock.now))
    try:
        a = p.get_new_blocks(2)
        for i, b in enumerate(a):
            cache(p, b, b"w%d" % i)
        p.free_blocks(a)  # held at 1000
        assert [t.seconds for t in timers.armed] == [pytest.approx(10.05)]
        clock.now += 4
        hit = p.get_cached_block(BlockHash(b"w0"), [0]) or []
        hit += p.get_cached_block(BlockHash(b"w1"), [0]) or []
        p.touch(hit)  # the second request's prefix hit
        p.free_blocks(hit)  # held again at 1004
        assert len(timers.armed) == 1, "one wake-up pending"
        clock.now += 6.05
        timers.armed[0].fn()  # fires at 1010.05: nothing is due yet
        assert woken == [1010.05] and p.release_is_due(), "the engine steps once"
        p.step_done()
        assert not p.release_is_due() and stats(sc)["blocks_used"] == 2
        assert len(timers.armed) == 2 and timers.armed[1].seconds == pytest.approx(4.0), "armed for the blocks held"
        clock.now += 4.0
        timers.armed[1].fn()
        assert p.release_is_due()
        p.step_done()
        assert stats(sc)["blocks_used"] == 0 and not p.release_is_due() and len(timers.armed) == 2
    finally:
        c.close()


def test_pages_follow_the_working_set(pool):
    pages = lambda: pool.sc.metric("kvsidecar_vmm_pages_mapped")  # noqa: E731
    # The sidecar maps its reserve (one empty page, serve --reserve-pages'
    # default) beside the attach, on vmm's refill goroutine: the base is
    # read once it is there. The reported input: under load the base was
    # read before, as 1, and the settled 2 failed the last assertion.
    wait_for("the sidecar's reserve mapped", lambda: pool.client.stats().reserve_pages == 1)
    base = pages()
    blocks = pool.pool.get_new_blocks(3 * PER_PAGE)
    assert pages() >= base + 2, "three pages' worth of blocks maps them"
    for i, b in enumerate(blocks):
        cache(pool.pool, b, b"k%d" % i)
    pool.pool.free_blocks(blocks)
    assert stats(pool.sc)["blocks_used"] == 3 * PER_PAGE, "freed prefix-cache blocks are held"
    pool.clock.now += 10
    pool.pool.release_due()
    assert stats(pool.sc)["blocks_used"] == 0
    # The sidecar refills its reserve beside the frees (vmm's refill
    # goroutine): a page it maps while they trim is trimmed when it lands.
    wait_for("released, the pages are unmapped (the sidecar keeps its reserve)", lambda: pages() <= base)


def test_reset_prefix_cache_releases_every_held_block(pool):
    a = pool.pool.get_new_blocks(4)
    for i, b in enumerate(a):
        cache(pool.pool, b, b"r%d" % i)
    pool.pool.free_blocks(a)
    assert stats(pool.sc)["blocks_used"] == 4
    assert pool.pool.reset_prefix_cache()
    assert stats(pool.sc)["blocks_used"] == 0 and not pool.pool.release_is_due()


# fault-matrix: zero-copy-memory-limit
def test_at_the_memory_limit_held_blocks_make_room(pool):
    a = pool.pool.get_new_blocks(PER_PAGE)
    for i, b in enumerate(a):
        cache(pool.pool, b, b"l%d" % i)
    pool.pool.free_blocks(a)
    # Two pages of each region: the held blocks' and the reserve. One
    # page more than the reserve holds needs the held blocks' page.
    pool.client.set_memory_limit(2 * 2 * (2 << 20))
    assert pool.pool.get_num_free_blocks() == NUM_BLOCKS - 1, "read again only after a while or a step"
    pool.pool.step_done()
    # vLLM's scheduler sees the limit: the two pages of each region, less
    # the null block's slot, not the whole cache (the held blocks count:
    # releasing them gives their slots back).
    assert pool.pool.get_num_free_blocks() == 2 * PER_PAGE - 1 < NUM_BLOCKS - 1
    got = pool.pool.get_new_blocks(PER_PAGE + 1)
    assert len(got) == PER_PAGE + 1
    assert pool.pool.get_cached_block(BlockHash(b"l0"), [0]) is None, "the held blocks were released for them"
    assert pool.pool.get_num_free_blocks() == PER_PAGE - 2
    with pytest.raises(ValueError, match=f"Cannot get {PER_PAGE} free blocks"):
        pool.pool.get_new_blocks(PER_PAGE)
    assert len(pool.pool.get_new_blocks(PER_PAGE - 2)) == PER_PAGE - 2
    # Should the count be stale (a limit lowered in the middle of a step),
    # the sidecar refuses: nothing is allocated past the limit; the step
    # waits for the limit, then stops the engine naming it.
    pool.pool._sc_avail = NUM_BLOCKS
    start = pool.clock.now
    with pytest.raises(RuntimeError, match=rf"refused 1 blocks at its memory limit for {LIMIT_WAIT_SECONDS:.0f} s"
                                           r".*raise the limit"):
        pool.pool.get_new_blocks(1)
    assert pool.clock.now - start == pytest.approx(LIMIT_WAIT_SECONDS, abs=LIMIT_RETRY_SECONDS)
    assert pool.clock.slept == pytest.approx(LIMIT_WAIT_SECONDS / LIMIT_RETRY_SECONDS, abs=1)
    assert stats(pool.sc)["blocks_used"] == 2 * PER_PAGE - 1, "nothing past the limit"


# fault-matrix: zero-copy-memory-limit
def test_a_limit_lowered_during_a_step_and_raised_again_is_waited_for(pool, caplog):
    """A new user's run: switching `kvsidecar ctl limit 8MiB` and `limit
    none` every 0.15 s under load stopped a decode engine: a limit lowered
    after the step read the count refused blocks vLLM's scheduler had
    already promised (47 wanted, 45 allowed). The step waits for the limit
    instead, and goes on once it is raised."""
    assert pool.pool.get_num_free_blocks() == NUM_BLOCKS - 1  # read in this step
    pool.client.set_memory_limit(2 * (2 << 20))  # the reserve's page of each region: 63 blocks
    want = PER_PAGE + 1

    def raise_limit(n: int) -> None:
        if n == 3:
            pool.client.set_memory_limit(0)

    pool.clock.on_sleep = raise_limit
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        got = pool.pool.get_new_blocks(want)
    assert len(got) == want and stats(pool.sc)["blocks_used"] == want
    assert pool.clock.slept == 3, "tried again until the limit allowed them"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and f"refused {want} blocks at its memory limit, lowered during this scheduler step" in \
        lines[0] and f"allocated the {want} blocks its limit had refused" in lines[1], lines


# fault-matrix: zero-copy-memory-limit
def test_a_limit_lowered_under_an_idle_engine_is_seen_by_the_next_request(pool, caplog):
    """A new user's run: `kvsidecar ctl limit 8MiB` under an idle zero-copy
    engine, then a request of more blocks than the limit leaves, stopped the
    engine (the pool answered with a count read before the limit changed,
    and counted held blocks whose release unmapped pages over the limit)."""
    a = pool.pool.get_new_blocks(3 * PER_PAGE)
    for i, b in enumerate(a[:2 * PER_PAGE]):
        cache(pool.pool, b, b"i%d" % i)
    pool.pool.free_blocks(a[:2 * PER_PAGE])  # held, their two pages mapped
    pool.pool.step_done()
    assert pool.pool.get_num_free_blocks() == NUM_BLOCKS - 1 - PER_PAGE
    # The limit falls to two pages of each region, under the four mapped.
    pool.client.set_memory_limit(2 * 2 * (2 << 20))
    pool.clock.now += AVAILABLE_REFRESH_SECONDS  # idle: no step ends
    left = pool.pool.get_num_free_blocks()
    assert pool.client.available().over_limit
    assert left == pool.client.available().blocks < PER_PAGE, "held blocks count for nothing over the limit"
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        pool.pool.note_waiting("r-big", 2 * PER_PAGE)
        pool.pool.note_waiting("r-big", 2 * PER_PAGE)
        pool.pool.note_waiting("r-small", 1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"request r-big needs {2 * PER_PAGE} blocks" in lines[0] \
        and f"memory limit leaves {left}" in lines[0], lines
    # Nothing vLLM would ask for now is refused...
    assert len(pool.pool.get_new_blocks(left)) == left
    # ...and the step's end releases the held blocks: the pages over the
    # limit go, and the count is what the sidecar then allows.
    pool.pool.step_done()
    assert stats(pool.sc)["blocks_used"] == PER_PAGE + left
    # Still over the limit (blocks in use hold three pages), the free slots
    # of mapped pages are left: page 0's 63 and block 128's.
    assert pool.pool.get_num_free_blocks() == pool.client.available().blocks == PER_PAGE


# fault-matrix: zero-copy-sidecar-gone
def test_a_gone_sidecar_stops_the_engine_with_the_reason(pool):
    pool.pool.get_new_blocks(1)
    pool.sc.kill()
    with pytest.raises(RuntimeError, match="the sidecar holds this engine's KV cache, so the engine cannot go on"):
        pool.pool.get_new_blocks(1)


def test_install_refuses_a_pool_in_use_or_of_another_size(pool):
    used = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=32)
    used.get_new_blocks(1)
    with pytest.raises(Refused, match="1 in use"):
        SidecarBlockPool.install(used, pool.client)
    # Through zero copy's door (zerocopy -> compat.for_release -> v0_32), as the scheduler installs it.
    with pytest.raises(Refused, match=f"{NUM_BLOCKS + 1} blocks, 0 in use.*{NUM_BLOCKS} blocks"):
        install_block_pool(BlockPool(NUM_BLOCKS + 1, enable_caching=True, hash_block_size=32), pool.client)


# -- what falls back to staging -----------------------------------------------


def worker(**extra) -> KVSidecarConnector:
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_role="kv_both", kv_connector_extra_config={
            "socket_dir": "/nowhere", "tp_rank": 0, **extra}),
        parallel_config=SimpleNamespace(tensor_parallel_size=1), cache_config=SimpleNamespace(block_size=32))
    return KVSidecarConnector(cfg, KVConnectorRole.WORKER, SimpleNamespace(num_blocks=NUM_BLOCKS))


def zero_copy_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "zero copy off" in r.getMessage()]


# fault-matrix: zero-copy-fallback
def test_an_unknown_release_falls_back_with_one_line(monkeypatch, caplog):
    import vllm
    from vllm.v1.worker import gpu_model_runner

    vllm_allocate = gpu_model_runner.allocate_kv_cache
    monkeypatch.setattr(vllm_plugin, "_installed", False)
    monkeypatch.setattr(vllm_plugin, "why_not", vllm_plugin.why_not)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    vllm_plugin.register()
    assert gpu_model_runner.allocate_kv_cache is vllm_allocate, "nothing replaced"
    assert vllm_plugin.why_not == ("vLLM 0.33.0 is not a release kvsidecar's zero copy knows (0.32.0): its KV cache "
                                   "allocation was left alone")
    w = worker(zero_copy=True)
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        assert w.allocate_kv_cache(SimpleNamespace(num_blocks=NUM_BLOCKS), None, None) is None
    assert zero_copy_lines(caplog) == [f"rank 0: zero copy off, the connector stages: {vllm_plugin.why_not}"]
    assert w.get_handshake_metadata() == ModeHandshake(zero_copy=False, why=vllm_plugin.why_not)


# fault-matrix: zero-copy-fallback
def test_an_unknown_backend_falls_back_with_one_line(monkeypatch, caplog):
    monkeypatch.setattr(vllm_plugin, "why_not", "")
    w = worker(zero_copy=True)
    assert w._worker is not None
    w._worker.backend_of = lambda cfg: ("TRITON_ATTN", "LBHNC", "auto")
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        assert w.allocate_kv_cache(SimpleNamespace(num_blocks=NUM_BLOCKS), None, None) is None
    lines = zero_copy_lines(caplog)
    assert len(lines) == 1 and "attention backend TRITON_ATTN keeps a layout the sidecar cannot express" in lines[0]
    assert "known: CPU_ATTN, FLASH_ATTN, FLASHINFER" in lines[0]


def test_zero_copy_not_asked_for_says_nothing(caplog):
    w = worker()
    with caplog.at_level(logging.INFO, logger="vllm.kvsidecar"):
        assert w.allocate_kv_cache(SimpleNamespace(num_blocks=NUM_BLOCKS), None, None) is None
    assert not [r for r in caplog.records if r.name == "vllm.kvsidecar"]
    assert w.get_handshake_metadata() == ModeHandshake(zero_copy=False, why="not asked for")


@pytest.mark.parametrize("backend, layout, dtype, why", [
    ("CPU_ATTN", "LBNHC", "auto", "KV cache layout LBNHC"),
    ("FLASHINFER", "LBHNC", "nvfp4", "cache dtype nvfp4"),
])
def test_layouts_the_sidecar_cannot_hold_are_refused(backend, layout, dtype, why):
    with pytest.raises(Refused, match=why):
        backend_layout(backend, layout, dtype)


# fault-matrix: zero-copy-fallback
def test_ranks_that_disagree_stop_the_engine_at_start():
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_role="kv_both", kv_connector_extra_config={
            "socket_dir": "/nowhere", "zero_copy": True}),
        parallel_config=SimpleNamespace(tensor_parallel_size=2), cache_config=SimpleNamespace(block_size=32))
    s = KVSidecarConnector(cfg, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=NUM_BLOCKS))
    with pytest.raises(RuntimeError, match=r"ranks \[0\] run zero copy.*rank 1: sidecar rank 1 holds layout"):
        s.set_xfer_handshake_metadata({0: ModeHandshake(True), 1: ModeHandshake(False, "sidecar rank 1 holds layout")})
    # Every rank staging: vLLM's block pool is left alone.
    s.set_xfer_handshake_metadata({0: ModeHandshake(False, "x"), 1: ModeHandshake(False, "x")})
    assert s._scheduler is not None and not s._scheduler.zero_copy
    assert not s.has_pending_push_work()


def test_released_exports_are_reported_once_vllm_names_them():
    # vLLM names an export it keeps blocks for in the step after the request
    # finished; the sidecar may release it before (a fast decode) or after.
    # Either way it is reported in finished_sending once; one vLLM never
    # waits for (an export withdrawn) is dropped after a while.
    from kvsidecar.v1 import local_pb2
    from kvsidecar.vllm.metadata import KVSidecarConnectorMetadata

    class Client:
        def __init__(self) -> None:
            self.done: list[str] = []

        def get_finished(self) -> local_pb2.GetFinishedReply:
            out, self.done = self.done, []
            return local_pb2.GetFinishedReply(done_sending=out)

    w = worker(zero_copy=True)._worker
    assert w is not None
    client = Client()
    w.mode, w.client = ZeroCopyMode(w), client  # type: ignore[assignment]

    def step(exported=(), released=()) -> set[str]:
        w.note_exported(KVSidecarConnectorMetadata(exported=list(exported)))
        client.done = list(released)
        sending, _ = w.get_finished()
        return sending or set()

    assert step(released=["early"]) == set(), "not before vLLM names it"
    assert step(exported=["early", "late"]) == {"early"}
    assert step() == set()
    assert step(released=["late", "withdrawn"]) == {"late"}
    for _ in range(w.SENT_MATCH_STEPS):
        assert step() == set()
    assert step(exported=["withdrawn"]) == set(), "a release nobody named in time is dropped"


def test_copied_bytes_survive_a_lost_sidecar():
    # The reported input: a staging worker whose sidecar died reported a
    # negative count (the copies since the last report were subtracted), and
    # vLLM's API server stopped on the negative counter increment.
    w = worker()._worker
    assert w is not None
    w.staging = SimpleNamespace(copied_bytes=100)  # type: ignore[assignment]
    assert w.take_copied_bytes() == 100
    w.staging.copied_bytes = 160  # type: ignore[union-attr]
    w._lost(ConnectionError("sidecar gone"))
    assert w.staging is None
    assert w.take_copied_bytes() == 60, "copied before the loss, reported after it"
    assert w.take_copied_bytes() == 0
    w.staging = SimpleNamespace(copied_bytes=7)  # type: ignore[assignment]
    assert w.take_copied_bytes() == 7, "a new connection's copies count from 0"


# fault-matrix: zero-copy-fallback
def test_a_plugin_that_never_ran_falls_back_with_one_line(monkeypatch, caplog):
    # The reported input: VLLM_PLUGINS without kvsidecar, zero copy asked
    # for: vLLM allocated its own KV cache and nothing said zero copy was off.
    monkeypatch.setattr(vllm_plugin, "why_not", "the kvsidecar vLLM plugin was not loaded (VLLM_PLUGINS ...)")
    w = worker(zero_copy=True)

    class Stop(Exception):
        pass

    def stop(cfg):
        raise Stop

    assert w._worker is not None
    w._worker.layout_of = stop
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"), pytest.raises(Stop):
        w.register_kv_caches({"model.layers.0.self_attn.attn": object()})
    assert zero_copy_lines(caplog) == [f"rank 0: zero copy off, the connector stages: {vllm_plugin.why_not}"]
    assert w.get_handshake_metadata() == ModeHandshake(zero_copy=False, why=vllm_plugin.why_not)
