"""KVSidecarConnector in a vLLM-ordered engine loop against real `kvsidecar
serve` processes: prefill TP 2 -> decode TP 4 of llama-3.2-1b's geometry."""

from __future__ import annotations

import logging
import signal

import pytest
import torch
from conftest import Background, LogWatch, stats, wait_for
from engine_loop import BLOCK_SIZE, LAYERS, Engine, RequestStatus, pattern

from kvsidecar import errors
from kvsidecar.dev.devserve import time_scale
from kvsidecar.local import LocalClient
from kvsidecar.paths import local_socket_path

MODEL = ["--model", "llama-3.2-1b"]
REGIONS = 2 * LAYERS


def start(cluster, engine: str, tp: int, role: str, num_blocks: int, *extra: str):
    return cluster.start_group(engine, tp_size=tp, role=role, args=[*MODEL, "--num-blocks", str(num_blocks), *extra])


def check_decode(dec: Engine, pre: Engine, rid_seed: int, dec_blocks: list[int], pre_blocks: list[int],
                 prompt_len: int, first_block: int = 0) -> int:
    """Every byte of the decode's blocks [first_block:] on every rank equals
    the prefill's blocks for the decode rank's heads, and every prompt
    token holds its pattern. Returns the bytes checked."""
    checked = 0
    hd = dec.heads
    pos = torch.arange(first_block * BLOCK_SIZE, prompt_len)
    for r in range(dec.tp_size):
        p, off = divmod(r * hd, pre.heads)
        heads = torch.arange(r * hd, (r + 1) * hd)
        for i, name in enumerate(dec.kv[r]):
            for kvi in (0, 1):
                got = dec.blocks_hnd(r, name, kvi, dec_blocks[first_block:])
                want = pre.blocks_hnd(p, name, kvi, pre_blocks[first_block:])[:, off:off + hd]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                    f"rank {r} layer {i} kv {kvi}: bytes differ"
                tok = dec.tokens(r, name, kvi, dec_blocks, pos)
                assert torch.equal(tok.view(torch.int16), pattern(rid_seed, i, kvi, pos, heads).view(torch.int16)), \
                    f"rank {r} layer {i} kv {kvi}: a prompt token's KV is wrong"
                checked += got.numel() * got.element_size()
    return checked


@pytest.fixture
def p2d4(cluster):
    """Prefill TP 2 and decode TP 4 sidecars with one engine each."""
    pre_sc = start(cluster, "prefill-a", 2, "prefill", 1024)
    # Every block verified on the same-host path too (its default samples
    # one block in 16): the checksum test names the block that differs.
    dec_sc = start(cluster, "decode-a", 4, "decode", 1024, "--same-host-verify-every", "1")
    pre = Engine("prefill-a", "kv_producer", 2, cluster.socket_dir, num_blocks=512)
    dec = Engine("decode-a", "kv_consumer", 4, cluster.socket_dir, num_blocks=512)
    yield pre_sc, dec_sc, pre, dec
    pre.close()
    dec.close()


def test_prefill_tp2_to_decode_tp4_every_byte(p2d4):
    pre_sc, dec_sc, pre, dec = p2d4
    # Prefill rank 1's pool is skewed by 5 blocks, so the two ranks stage
    # every request in different sidecar block ids (each rank's export
    # carries its own).
    skew = pre.sched._scheduler.ranks.clients()[1].alloc(5)
    # One request prefilled at once, one in chunks of 100 tokens (the
    # cached-request path of the scheduler output); both end mid-block.
    reqs = {"r-short": (37, 11, None), "r-long": (517, 12, 100)}
    params, pblocks = {}, {}
    for rid, (n, seed, chunk) in reqs.items():
        params[rid], pblocks[rid] = pre.prefill(rid, n, seed, chunk=chunk)
        p = params[rid]
        assert p["do_remote_prefill"] is True and p["tp_size"] == 2 and p["remote_engine_id"] == "prefill-a"
        assert len(p["remote_block_ids"]) == -(-n // BLOCK_SIZE) and len(p["remote_rank_addrs"]) == 2
        ex = {e.get("tp_rank", 0): e for e in p["rank_exports"]}
        assert sorted(ex) == [0, 1] and "block_ids" not in ex[0]
        assert len(ex[1]["block_ids"]) == len(p["remote_block_ids"]) and ex[1]["block_ids"] != p["remote_block_ids"]
    for s in pre_sc:
        assert stats(s)["leases_held"] == 2, "each prefill rank holds both exports under a lease"

    dblocks = {}
    for rid, (n, _, _) in reqs.items():
        _, dblocks[rid] = dec.start_decode(rid, n, params[rid])
    got, invalid = dec.run_until(set(reqs))
    assert got == set(reqs) and invalid == set()

    total = 0
    for rid, (n, seed, _) in reqs.items():
        total += check_decode(dec, pre, seed, dblocks[rid], pblocks[rid], n)
    blocks = sum(-(-n // BLOCK_SIZE) for n, _, _ in reqs.values())
    assert total == blocks * REGIONS * BLOCK_SIZE * 8 * 64 * 2  # all 8 heads of every block, bf16
    # Every sidecar block is free again: the decode's staging after the copy,
    # the prefill's when its lease was notified.
    for s in dec_sc:
        assert stats(s)["blocks_used"] == 0
    pre.sched._scheduler.ranks.clients()[1].free(skew)
    for s in pre_sc:
        wait_for(f"{s.name} freed its exports",
                 lambda s=s: stats(s) == {"blocks_used": 0, "leases_held": 0, "loads_in_flight": 0})


@pytest.mark.parametrize("pre_backend, pre_ratio, dec_backend, sidecar_layout", [
    ("FLASH_ATTN", 1, "CPU_ATTN", "HND"), ("CPU_ATTN", 1, "FLASHINFER", "HND"), ("FLASHINFER", 1, "FLASH_ATTN", "HND"),
    ("FLASH_ATTN", 2, "CPU_ATTN", "HND"), ("FLASH_ATTN", 2, "CPU_ATTN", "H2ND"), ("CPU_ATTN", 1, "FLASH_ATTN", "HN2D"),
])
def test_every_layout(cluster, pre_backend, pre_ratio, dec_backend, sidecar_layout):
    # The sidecar's regions are the interchange: a prefill on one backend's
    # layout and a decode on another's move the same K and V (FlashAttention
    # runs LBNHC here, a permuted view: the copies follow the strides; with
    # pre_ratio 2 the prefill's blocks are split in two kernel blocks), also
    # when the sidecars keep K and V of a layer in one region (H2ND, HN2D).
    start(cluster, "prefill-a", 2, "prefill", 512, "--kv-layout", sidecar_layout)
    start(cluster, "decode-a", 4, "decode", 512, "--kv-layout", sidecar_layout)
    pre = Engine("prefill-a", "kv_producer", 2, cluster.socket_dir, num_blocks=64, backend=pre_backend,
                 kernel_ratio=pre_ratio)
    dec = Engine("decode-a", "kv_consumer", 4, cluster.socket_dir, num_blocks=64, backend=dec_backend)
    try:
        layouts = {pre.layout.describe(), dec.layout.describe()}
        assert len(layouts) == 2, layouts
        params, pblocks = pre.prefill("r-hnd", 100, 51)
        _, dblocks = dec.start_decode("r-hnd", 100, params)
        assert dec.run_until({"r-hnd"}) == ({"r-hnd"}, set())
        check_decode(dec, pre, 51, dblocks, pblocks, 100)
    finally:
        pre.close()
        dec.close()


def test_partial_prefix_hit_reads_only_the_tail(p2d4):
    _pre_sc, dec_sc, pre, dec = p2d4
    n, seed, hit = 10 * BLOCK_SIZE, 21, 4
    params, pblocks = pre.prefill("r-hit", n, seed)
    # The decode already holds the first 4 blocks (computed locally); mark
    # them so an overwrite shows.
    hit_blocks = dec.alloc(hit)
    for r in range(dec.tp_size):
        for kv in dec.kv[r].values():
            kv[hit_blocks] = torch.full((1,), 7, dtype=torch.int16).view(torch.bfloat16)
    _, dblocks = dec.start_decode("r-hit", n, params, hit_blocks=hit_blocks)
    got, invalid = dec.run_until({"r-hit"})
    assert got == {"r-hit"} and invalid == set()
    check_decode(dec, pre, seed, dblocks, pblocks, n, first_block=hit)
    for r in range(dec.tp_size):
        for kv in dec.kv[r].values():
            assert bool((kv[hit_blocks].view(torch.int16) == 7).all()), "a prefix-hit block was overwritten"
    # Each decode rank read 6 blocks of its 2 heads in 32 regions, no more.
    per_rank = (10 - hit) * REGIONS * BLOCK_SIZE * 2 * 64 * 2
    for s in dec_sc:
        assert s.metric("kvsidecar_transfer_bytes_total") == per_rank, s.name


# fault-matrix: vllm-load-partly-failed
def test_a_load_failed_in_part_reports_exactly_the_blocks_not_copied(p2d4):
    """The reported input: a load whose checksums showed 1 of 4 blocks
    differing was reported with that block alone, while staging had copied
    none of the 4 into vLLM's blocks: vLLM kept the first ones as loaded
    and answered with wrong tokens. The blocks that verified are copied now,
    and exactly the one that differs is reported."""
    pre_sc, dec_sc, pre, dec = p2d4
    n = 4 * BLOCK_SIZE
    params, pblocks = pre.prefill("r-bad", n, 21)
    # One byte of block 2 changes in prefill rank 0's memory after the
    # export: its checksums were recorded at RequestFinished. The byte is
    # head 0's, which decode rank 0 reads.
    with LocalClient(pre_sc[0].socket) as c:
        c.attach(tp_rank=0, tp_size=2)
        c.sync()
        c.block(0, params["remote_block_ids"][2])[0] ^= 0xFF
    _, dblocks = dec.start_decode("r-bad", n, params)
    got, invalid = dec.run_until({"r-bad"})
    assert got == {"r-bad"} and invalid == {dblocks[2]}, invalid
    # The other blocks are in vLLM's, on every rank, byte-exact.
    check_decode(dec, pre, 21, dblocks[:2], pblocks[:2], 2 * BLOCK_SIZE)
    check_decode(dec, pre, 21, dblocks, pblocks, n, first_block=3)
    for s in dec_sc:
        assert stats(s)["blocks_used"] == 0, "the staging blocks are freed"
    for s in pre_sc:
        wait_for(f"{s.name} released the export", lambda s=s: stats(s)["leases_held"] == 0)


# fault-matrix: vllm-client-abort-mid-load
def test_aborted_requests_free_their_blocks(cluster):
    pre_sc = start(cluster, "prefill-a", 2, "prefill", 1024, "--lease-ttl", "2s")
    dec_sc = start(cluster, "decode-a", 4, "decode", 1024)
    pre = Engine("prefill-a", "kv_producer", 2, cluster.socket_dir, num_blocks=256)
    dec = Engine("decode-a", "kv_consumer", 4, cluster.socket_dir, num_blocks=256)
    try:
        # Prefill side: a request aborted at its end gives no params and its
        # sidecar blocks are freed at once.
        params, _ = pre.prefill("r-gone", 64, 1, status=RequestStatus.FINISHED_ABORTED)
        assert params is None
        for s in pre_sc:
            assert stats(s) == {"blocks_used": 0, "leases_held": 0, "loads_in_flight": 0}

        # Decode side: abort while the load cannot progress (both prefill
        # sidecars stopped).
        params, _ = pre.prefill("r-abort", 20 * BLOCK_SIZE, 2)
        for s in pre_sc:
            s.signal(signal.SIGSTOP)
        req, dblocks = dec.start_decode("r-abort", 20 * BLOCK_SIZE, params)
        dec.step(__import__("engine_loop").empty_output())  # start_load_kv: the loads start
        for s in dec_sc:
            assert stats(s)["loads_in_flight"] == 1 and stats(s)["blocks_used"] == 20
        req.status = RequestStatus.FINISHED_ABORTED
        assert dec.sched.request_finished(req, dblocks) == (False, None)
        dec.finished_req_ids.add("r-abort")
        # vLLM holds the blocks of a request aborted in WAITING_FOR_REMOTE_KVS
        # until the workers report it received; they do once the load stopped.
        got, invalid = dec.run_until({"r-abort"})
        assert got == {"r-abort"} and invalid == set()
        for s in dec_sc:
            assert stats(s) == {"blocks_used": 0, "leases_held": 0, "loads_in_flight": 0}
        for s in pre_sc:
            s.signal(signal.SIGCONT)
        for s in pre_sc:
            wait_for(f"{s.name} freed the aborted export", lambda s=s: stats(s)["blocks_used"] == 0)
    finally:
        for s in pre_sc:
            s.signal(signal.SIGCONT)
        pre.close()
        dec.close()


# fault-matrix: vllm-prefill-sidecar-killed
def test_prefill_killed_mid_read_fails_only_that_request(cluster):
    # Prefill A serves a large request, prefill B a small one; both load at
    # once into decode TP 4. A's rank 1 (serving decode ranks 2 and 3) is
    # killed once it has served bytes.
    a_sc = start(cluster, "prefill-a", 2, "prefill", 1024)
    start(cluster, "prefill-b", 2, "prefill", 256)
    dec_sc = start(cluster, "decode-a", 4, "decode", 2048, "--progress-timeout", "2s")
    a = Engine("prefill-a", "kv_producer", 2, cluster.socket_dir, num_blocks=700)
    b = Engine("prefill-b", "kv_producer", 2, cluster.socket_dir, num_blocks=64)
    dec = Engine("decode-a", "kv_consumer", 4, cluster.socket_dir, num_blocks=800)
    try:
        # r-x: 600 blocks, 75 MiB per prefill rank to read.
        nx, ny = 600 * BLOCK_SIZE, 30 * BLOCK_SIZE
        px, _ = a.prefill("r-x", nx, 31)
        py, pyb = b.prefill("r-y", ny, 32)
        _, xb = dec.start_decode("r-x", nx, px)
        _, yb = dec.start_decode("r-y", ny, py)
        assert not set(xb) & set(yb)
        dec.step(__import__("engine_loop").empty_output())
        wait_for("prefill-a rank 1 serving", lambda: a_sc[1].metric("kvsidecar_transfer_bytes_total") > 0, timeout=60)
        a_sc[1].signal(signal.SIGSTOP)  # no byte more; then the crash
        a_sc[1].kill()
        got, invalid = dec.run_until({"r-x", "r-y"}, timeout=120)
        assert got == {"r-x", "r-y"}
        # Decode ranks 2 and 3 lost r-x: every block of r-x is reported (the
        # decode's blocks are the same on every rank), none of r-y.
        assert invalid == set(xb)
        check_decode(dec, b, 32, yb, pyb, ny)
        for s in dec_sc:
            wait_for(f"{s.name} freed its staging", lambda s=s: stats(s)["blocks_used"] == 0)
    finally:
        a.close()
        b.close()
        dec.close()


# fault-matrix: vllm-sidecar-restart
def test_sidecar_restarts(p2d4, cluster):
    pre_sc, dec_sc, pre, dec = p2d4
    from engine_loop import empty_output

    # Decode rank 3's sidecar crashes while the request loads (the prefill
    # sidecars are stopped, so no load can finish first).
    n = 12 * BLOCK_SIZE
    params, _ = pre.prefill("r-a", n, 41)
    for s in pre_sc:
        s.signal(signal.SIGSTOP)
    _, a_blocks = dec.start_decode("r-a", n, params)
    dec.step(empty_output())
    dec_sc[3].kill()
    for s in pre_sc:
        s.signal(signal.SIGCONT)
    got, invalid = dec.run_until({"r-a"})
    # Ranks 0..2 received it, rank 3 lost it: every block is recomputed.
    assert got == {"r-a"} and invalid == set(a_blocks)

    # Both a decode and a prefill sidecar restart; the connector dials them
    # again (the prefill scheduler when it next allocates, the workers at
    # their next step) and the next request moves byte-exact.
    dec_sc[3] = cluster.restart(dec_sc[3])
    pre_sc[1].kill()
    pre_sc[1] = cluster.restart(pre_sc[1])
    params, pblocks = pre.prefill("r-b", n, 42)
    assert params is not None, "the scheduler connected to the restarted prefill sidecar again"
    _, b_blocks = dec.start_decode("r-b", n, params)
    got, invalid = dec.run_until({"r-b"})
    assert got == {"r-b"} and invalid == set()
    check_decode(dec, pre, 42, b_blocks, pblocks, n)


# fault-matrix: engine-before-sidecar
def test_engine_started_before_its_sidecar_waits(cluster):
    # Issue 36: an engine started before its sidecar failed at once with
    # "connect ...: No such file or directory". Its worker now waits
    # (sidecar_wait_seconds), logs that once with the path, the engine id
    # and the rule, and attaches when the sidecar is up.
    with LogWatch("vllm.kvsidecar", logging.WARNING) as logs:
        run = Background(lambda: Engine("late-a", "kv_producer", 1, cluster.socket_dir, num_blocks=64,
                                        extra={"sidecar_wait_seconds": 600}))
        try:
            assert logs.seen.wait(60 * time_scale()), "the worker logs that it waits"
            (sc,) = start(cluster, "late-a", 1, "prefill", 128)
        finally:
            eng = run.result()
    try:
        path = local_socket_path(cluster.socket_dir, "late-a", 0)
        wait_msgs = [m for m in logs.messages(logging.WARNING) if "is not there yet" in m]
        assert len(wait_msgs) == 1, logs.messages(logging.WARNING)
        assert path in wait_msgs[0] and "'late-a' tp_rank 0" in wait_msgs[0]
        assert "must be a running sidecar's --engine-id" in wait_msgs[0]
        with LocalClient(sc.socket) as c:
            st = c.stats()
        assert st.engine_attached and st.engine_session == 1 and st.blocks_total == 127
    finally:
        eng.close()


# fault-matrix: engine-before-sidecar
def test_engine_without_a_sidecar_fails_after_the_bound(cluster):
    # No sidecar serves this engine id: after sidecar_wait_seconds the
    # worker's error names the path, the rule and the setting.
    with pytest.raises(errors.Unavailable) as ei:
        Engine("ghost", "kv_producer", 1, cluster.socket_dir, num_blocks=64, extra={"sidecar_wait_seconds": 0.3})
    msg = ei.value.message
    assert msg.startswith(f"connect {local_socket_path(cluster.socket_dir, 'ghost', 0)}: no sidecar of engine 'ghost'")
    assert "the engine id must be a running sidecar's --engine-id" in msg
    assert msg.endswith("or raise kv_connector_extra_config.sidecar_wait_seconds")
    for bad in (-1, "soon", True, float("inf")):
        with pytest.raises(errors.InvalidArgument, match=r"sidecar_wait_seconds .* must be a number of seconds >= 0"):
            Engine("ghost", "kv_producer", 1, cluster.socket_dir, num_blocks=64, extra={"sidecar_wait_seconds": bad})
