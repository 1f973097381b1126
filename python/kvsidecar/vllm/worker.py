"""The worker-process half of KVSidecarConnector (see :mod:`kvsidecar.vllm`):
one TP rank's KV tensors, its sidecar connection and the loads it started.

The mode is chosen once, at the KV cache's allocation, as an object
(:class:`StagingMode` or :class:`ZeroCopyMode`, the rank's ``mode``): what a
load lands in, what a lost connection means, when a released export is
forgotten. The sidecar client is made by ``dial`` (:data:`Dial`), which the
worker's unit tests replace with a fake client, as vLLM's NixlConnector
tests replace its NIXL wrapper."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kvsidecar import errors
from kvsidecar.devicemap import CudaDeviceMapping
from kvsidecar.local import LocalClient, dial_waiting
from kvsidecar.params import req_meta
from kvsidecar.rankset import attach_rank
from kvsidecar.staging import LayerLayout, Staging, layer_layout
from kvsidecar.v1 import common_pb2, group_pb2
from kvsidecar.vllm import plugin as vllm_plugin
from kvsidecar.vllm.compat import Refused
from kvsidecar.vllm.metadata import ConnectorConfig, KVSidecarConnectorMetadata, LoadSpec, log
from kvsidecar.vllm.stats import ConnectorStats
from kvsidecar.vllm.zerocopy import ModeHandshake, backend_layout, kv_cache_views, layer_index

__all__ = ["Dial", "StagingMode", "WorkerSide", "ZeroCopyMode"]

#: Makes one rank's sidecar client: called as ``dial(path, *, engine_id,
#: tp_rank, wait_seconds, setting, logger, timeout, **client_kwargs)`` and
#: returns a connected :class:`kvsidecar.local.LocalClient` (or an object with
#: its methods), raising :class:`kvsidecar.errors.KVSidecarError` as
#: :func:`kvsidecar.local.dial_waiting` does.
Dial = Callable[..., LocalClient]


@dataclasses.dataclass
class _Load:
    spec: LoadSpec
    staging: list[int]
    aborted: bool = False
    #: time.monotonic() when StartLoad was sent.
    started: float = dataclasses.field(default_factory=time.monotonic)


def _vllm_backend(cfg: ConnectorConfig) -> tuple[str, str, str]:
    """vLLM's attention backend in this worker (``get_current_attn_backends``,
    vllm 0.32.0 ``vllm/distributed/kv_transfer/kv_connector/utils.py``), the
    KV cache layout the engine resolved
    (``CacheConfig.get_resolved_kv_cache_layout``) and the cache dtype."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    vc = cfg.vllm_config
    names = sorted({b.get_name() for b in get_current_attn_backends(vc)})
    if len(names) != 1:
        raise errors.Unsupported(f"KVSidecarConnector: one attention backend per model is supported, vLLM runs {names}")
    return names[0], vc.cache_config.get_resolved_kv_cache_layout().name, \
        str(getattr(vc.cache_config, "cache_dtype", "auto"))


def _vllm_layout(cfg: ConnectorConfig) -> LayerLayout:
    """The layout of vLLM's KV tensors in this worker, for the staging copies."""
    backend, layout, cache_dtype = _vllm_backend(cfg)
    return layer_layout(backend, layout, int(cfg.vllm_config.model_config.get_head_size()), cache_dtype)


class WorkerSide:
    """The half in each worker process: one TP rank's KV."""

    def __init__(self, cfg: ConnectorConfig, dial: Dial = dial_waiting) -> None:
        self.cfg = cfg
        #: How the worker connects to its sidecar (replaced by the unit tests).
        self.dial = dial
        if cfg.tp_rank_override is not None:
            self.rank = cfg.tp_rank_override
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        self.client: LocalClient | None = None
        self.staging: Staging | None = None
        self.layout: LayerLayout | None = None
        #: How vLLM's KV tensors are laid out (replaced by tests that run
        #: the worker without a vLLM model).
        self.layout_of = _vllm_layout
        #: vLLM's attention backend, KV cache layout and cache dtype
        #: (replaced by tests, as layout_of).
        self.backend_of = _vllm_backend
        #: StagingMode until allocate_kv_cache put vLLM's KV tensors over
        #: the sidecar's pages (ZeroCopyMode); chosen once, before vLLM
        #: registers its KV caches.
        self.mode: StagingMode | ZeroCopyMode = StagingMode(self)
        #: Why the rank stages when zero copy was asked for ("" while that is
        #: not known yet, "not asked for" when it was not).
        self.why_staging = "" if cfg.zero_copy else "not asked for"
        self._exported: set[str] = set()
        # Exports the sidecar reported released, by the step they came in:
        # vLLM learns of its exports a step after the sidecar may release
        # them (a fast decode), so each waits here a while for its match.
        self._sent: dict[str, int] = {}
        self._step = 0
        # Staging.copied_bytes already counted by take_copied_bytes, and the
        # bytes a Staging lost with its connection copied but not yet taken.
        self._copied_seen = 0
        self._copied_banked = 0
        #: This rank's loads since the last take_stats.
        self.stats = ConnectorStats()
        self.layers: dict[str, int] = {}
        self.kv: list[Any] = []
        self._loads: dict[str, _Load] = {}
        self._silent: set[str] = set()
        self._recving: set[str] = set()
        self._sending: set[str] = set()
        self._invalid: set[int] = set()
        # Layers of this step's saves copied so far (by save_kv_layer).
        self._saved: set[int] = set()
        #: Layer copies made by save_kv_layer and by wait_for_save (the
        #: layers whose save_kv_layer vLLM did not call).
        self.layer_saves = {"save_kv_layer": 0, "wait_for_save": 0}

    # -- zero copy -------------------------------------------------------------

    def allocate_kv_cache(self, kv_cache_config: Any, layout: Any, kernel_block_sizes: Any,
                          device: Any = None) -> dict[str, Any] | None:
        """Zero copy: vLLM's per-layer KV tensors as views of this rank's
        sidecar regions (:func:`kvsidecar.vllm.zerocopy.kv_cache_views`), or
        None when zero copy is not asked for or cannot run here (logged once
        with the reason; vLLM then allocates its own and the connector
        stages). Called by the plugin in place of vLLM's allocation. On a
        CUDA ``device`` the sidecar must serve device pages (``--backend
        cuda``), which this process imports with
        :class:`kvsidecar.devicemap.CudaDeviceMapping` (``cuda_library`` of
        ``kv_connector_extra_config``, default libcuda.so.1): written, not
        yet measured on a GPU.

        Raises:
            KVSidecarError: the sidecar cannot be reached or attached.
        """
        if not self.cfg.zero_copy:
            return None
        c: LocalClient | None = None
        try:
            if vllm_plugin.why_not:
                raise Refused(vllm_plugin.why_not)
            backend, kv_layout, cache_dtype = self.backend_of(self.cfg)
            want = backend_layout(backend, kv_layout, cache_dtype)
            on_device = getattr(device, "type", "cpu") == "cuda"
            dm = CudaDeviceMapping(self.cfg.cuda_library, getattr(device, "index", None) or 0) if on_device else None
            c = self._dial(self.cfg.sidecar_wait_seconds, device_mapping=dm)
            spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
            try:
                info = attach_rank(c, self.rank, self.cfg.tp_size, self.cfg.geometry(spec.dtype, want),
                                   int(kv_cache_config.num_blocks), device_memory_ok=on_device)
            except (errors.InvalidArgument, errors.AlreadyExists) as e:
                # E.g. serve --num-blocks other than vLLM's block count.
                raise Refused(f"sidecar rank {self.rank} refused a cache of vLLM's {kv_cache_config.num_blocks} "
                              f"blocks: {e.message}") from e
            if info.device_memory != on_device:
                raise Refused(f"sidecar rank {self.rank} holds {'device' if info.device_memory else 'host'} pages, "
                              f"vLLM's KV cache is on {device}")
            have = info.geometry.layout
            if have != want:
                raise Refused(f"sidecar rank {self.rank} holds layout {common_pb2.Layout.Name(have)}, {backend} "
                              f"needs {common_pb2.Layout.Name(want)} (serve --kv-layout "
                              f"{common_pb2.Layout.Name(want).removeprefix('LAYOUT_')}, or no geometry flags)")
            if self.cfg.tp_size > 1 and info.ownership != group_pb2.OWNERSHIP_COORDINATED:
                raise Refused(f"sidecar rank {self.rank} runs --ownership {group_pb2.Ownership.Name(info.ownership)}; "
                              "vLLM's ranks share block ids: serve --ownership coordinated")
            views = kv_cache_views(c, kv_cache_config, layout, kernel_block_sizes, device)
        except Refused as e:
            if c is not None:
                c.close()
            self.why_staging = str(e)
            log.warning("rank %d: zero copy off, the connector stages: %s", self.rank, e)
            return None
        except Exception:
            if c is not None:
                c.close()
            raise
        self.client, self.mode = c, ZeroCopyMode(self)
        log.info("rank %d: zero copy: vLLM's KV cache is sidecar %s's pages (%d layers of %d blocks of %d bytes)",
                 self.rank, c.path, len(views), info.num_blocks, info.block_len)
        return views

    def handshake(self) -> ModeHandshake:
        """What this rank tells the scheduler side at start: its mode and its
        attention backend (for the prefill/decode compatibility check; ""
        when vLLM cannot name it here, e.g. under a test's stand-in config)."""
        try:
            backend = self.backend_of(self.cfg)[0]
        except Exception as e:  # reported when known, never required
            log.debug("rank %d: attention backend not reported: %s", self.rank, e)
            backend = ""
        return ModeHandshake(zero_copy=isinstance(self.mode, ZeroCopyMode), why=self.why_staging,
                             attention_backend=backend)

    def sync_mappings(self, meta: KVSidecarConnectorMetadata) -> None:
        """Before vLLM touches the step's blocks (vLLM calls
        ``handle_preemptions`` first in ``execute_model``): the mode's
        :meth:`ZeroCopyMode.sync_mappings`."""
        self.mode.sync_mappings(meta)

    # -- both modes ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """vLLM's per-layer KV tensors, by layer name; the mode's
        ``register`` (staging: check them and attach)."""
        names = sorted(kv_caches, key=layer_index)
        self.layers = {n: i for i, n in enumerate(names)}
        self.kv = [kv_caches[n] for n in names]
        self.mode.register(kv_caches)

    def _dial(self, wait_seconds: float, **kwargs: Any) -> LocalClient:
        """Connects to this rank's sidecar through :attr:`dial`, waiting up
        to ``wait_seconds`` for its socket (logged once, naming the rule)."""
        return self.dial(self.cfg.socket(self.rank), engine_id=self.cfg.engine_id, tp_rank=self.rank,
                         wait_seconds=wait_seconds, setting="kv_connector_extra_config.sidecar_wait_seconds",
                         logger=log, timeout=self.cfg.timeout, **kwargs)

    def _connect(self, wait_seconds: float = 0) -> LocalClient:
        """Dials and attaches to this rank's sidecar and checks vLLM's KV
        tensors against its cache. At start the worker waits up to
        ``wait_seconds`` for the sidecar; a redial during serving does not
        wait (it runs in the engine's step)."""
        first = self.kv[0]
        layout = self.layout
        assert layout is not None, "register_kv_caches first"
        c = self._dial(wait_seconds)
        try:
            info = attach_rank(c, self.rank, self.cfg.tp_size, self.cfg.geometry(first.dtype), self.cfg.num_blocks,
                               default_blocks=self.cfg.num_vllm_blocks)
            k, _ = layout.kv_views(first, self.cfg.num_vllm_blocks)
            _, ratio, heads, nk, hd = k.shape
            # HND: a K and a V region per layer; otherwise one region holds
            # both, and a block of it twice the bytes.
            per_layer = 2 if info.geometry.layout == common_pb2.LAYOUT_HND else 1
            layers = info.num_regions // per_layer
            block_len = ratio * nk * heads * hd * first.element_size() * (3 - per_layer)
            if len(self.kv) != layers or ratio * nk != info.geometry.block_size or heads != info.heads_per_rank \
                    or hd != info.geometry.head_dim or block_len != info.block_len:
                raise errors.IncompatibleModel(
                    f"KVSidecarConnector: vLLM's KV cache ({len(self.kv)} layers of {tuple(first.shape)}, "
                    f"{first.dtype}, {layout.describe()}) does not match sidecar rank {self.rank} "
                    f"({layers} layers, {info.heads_per_rank} heads of {info.geometry.head_dim}, block_size "
                    f"{info.geometry.block_size}, block_len {info.block_len} bytes)"
                )
        except Exception:
            c.close()
            raise
        self.client = c
        self.staging = Staging(c, info, layout, self.cfg.num_vllm_blocks)
        self._copied_seen = 0
        return c

    def _client(self) -> LocalClient | None:
        """The connection, dialled again after it was lost; None while the
        sidecar cannot be reached."""
        if self.client is None:
            try:
                self._connect()
                log.info("rank %d: connected to the sidecar again", self.rank)
            except errors.KVSidecarError as e:
                log.error("rank %d: sidecar unreachable: %s", self.rank, e)
                return None
        return self.client

    def _lost(self, err: Exception) -> None:
        """The connection broke (the sidecar exited or restarted): every load
        in flight fails (its blocks are recomputed) and the next step dials
        again. The sidecar released this session's blocks when it saw the
        connection close. In zero-copy mode the engine cannot go on
        (:meth:`ZeroCopyMode.lost` raises)."""
        self.mode.lost(err)
        log.error("rank %d: sidecar connection lost, %d loads fail: %s", self.rank, len(self._loads), err)
        for rid, ld in self._loads.items():
            if rid in self._silent:
                continue
            if ld.aborted:
                self._recving.add(rid)
            else:
                self._fail(ld.spec, err)
        self._loads.clear()
        self._silent.clear()
        if self.client is not None:
            self.client.close()
        if self.staging is not None:
            self._copied_banked += self.staging.copied_bytes - self._copied_seen
        self.client, self.staging, self._copied_seen = None, None, 0

    # -- decode --------------------------------------------------------------

    def start_load_kv(self, meta: KVSidecarConnectorMetadata) -> None:
        assert self.kv, "register_kv_caches first"
        self._client()
        for rid in meta.aborts:
            self._abort(rid)
        for spec in meta.loads:
            self._start(spec)

    def _start(self, spec: LoadSpec) -> None:
        c = self._client()
        rid = spec.req_id
        if c is None:
            self._fail(spec, "the sidecar is unreachable")
            return
        if spec.refused or spec.params is None:
            self._fail(spec, spec.refused or "no kv_transfer_params")
            return
        staging: list[int] = []
        try:
            staging = self.mode.staging_blocks(c, len(spec.block_ids))
            local = staging or spec.block_ids
            c.start_load(req_meta(rid, local, spec.params, remote_hit_blocks=spec.hit_blocks,
                                  token_digests=spec.token_digests))
        except errors.BrokenConnection as e:
            self._fail(spec, e)
            self._lost(e)
            return
        except errors.KVSidecarError as e:
            if staging:
                c.free(staging)
            self._fail(spec, e)
            return
        if spec.notify_only:
            self._silent.add(rid)
        self._loads[rid] = _Load(spec, staging)

    def _fail(self, spec: LoadSpec, err: Exception | str) -> None:
        """A load that cannot complete: its blocks are reported for
        recompute and the request as received (vLLM requires both)."""
        if spec.notify_only:
            log.warning("request %s: notifying the prefill failed: %s", spec.req_id, err)
            return
        log.warning("request %s: load failed, %d blocks to recompute: %s", spec.req_id, len(spec.block_ids), err)
        self.stats.record_failed_transfer()
        self._invalid.update(spec.block_ids)
        self._recving.add(spec.req_id)

    def _abort(self, rid: str) -> None:
        ld = self._loads.get(rid)
        if ld is None:
            return  # finished (and reported) already, or never started here
        ld.aborted = True
        if self.client is None:
            return  # the connection was lost: the sidecar aborted the session's loads
        try:
            self.client.abort(rid)
        except errors.BrokenConnection as e:
            self._lost(e)
        except errors.KVSidecarError as e:
            log.error("request %s: abort failed: %s", rid, e)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        c = self.client
        if c is not None:
            try:
                f = c.get_finished()
                for rid in f.done_recving:
                    self._done(rid, None)
                for fl in f.failed:
                    self._done(fl.request_id, fl)
                self._sent.update(dict.fromkeys(f.done_sending, self._step))
                self._report_sent()
            except errors.BrokenConnection as e:
                self._lost(e)
        sending, recving = self._sending, self._recving
        self._sending, self._recving = set(), set()
        return (sending or None), (recving or None)

    def _done(self, rid: str, failed: Any) -> None:
        """A load's result from the sidecar: ``failed`` None (done) or its
        Failed entry. vLLM takes every loaded block it is not told about as
        holding the prompt's KV (a failed block truncates the request there,
        ``_update_requests_with_invalid_blocks``, vllm 0.32.0
        ``vllm/v1/core/sched/scheduler.py``), so exactly the blocks whose
        KV is not in vLLM's blocks are reported: those the sidecar names
        (every block, or those whose checksums differ), and under staging
        any block not copied out of the sidecar's, the copy of the others
        made first."""
        ld = self._loads.pop(rid, None)
        if ld is None:
            return
        silent = rid in self._silent
        self._silent.discard(rid)
        c = self.client
        assert c is not None, "a result arrives only on a live connection"
        # The local blocks (the sidecar's: staging ones, or vLLM's own under
        # zero copy) whose KV did not land.
        local = ld.staging if ld.staging else ld.spec.block_ids
        bad: set[int] = set()
        if failed is not None:
            bad = set(failed.block_ids).intersection(local) or set(local)
        if ld.staging:  # zero copy loads straight into vLLM's blocks
            try:
                if not ld.aborted and not silent:
                    bad |= self._copy_out(rid, ld, bad)
            finally:
                c.free(ld.staging)
        if silent:
            if failed is not None:
                # The sidecar's message says whether it sends it again.
                log.info("request %s: prefill notification failed: %s", rid, failed.error.message)
            return
        if ld.aborted:
            self._recving.add(rid)
            return
        if bad:
            vblocks = [v for v, s in zip(ld.spec.block_ids, local, strict=True) if s in bad]
            why = f"{common_pb2.Code.Name(failed.error.code)}: {failed.error.message}" if failed is not None else \
                "copying the loaded blocks into vLLM's failed"
            self._fail(dataclasses.replace(ld.spec, block_ids=vblocks), why)
            return
        info = c.info
        if info is not None:
            self.stats.record_transfer(time.monotonic() - ld.started, len(local) * info.block_len * info.num_regions)
        self._recving.add(rid)

    def _copy_out(self, rid: str, ld: _Load, bad: set[int]) -> set[int]:
        """Staging: copies every loaded block but ``bad`` (sidecar block
        ids) from the sidecar's blocks into vLLM's; returns the blocks not
        copied because the copy failed (all of them: a copy that stops
        part way leaves no layer set known whole)."""
        st = self.staging
        assert st is not None, "staged loads have a Staging"
        pairs = [(v, s) for v, s in zip(ld.spec.block_ids, ld.staging, strict=True) if s not in bad]
        if not pairs:
            return set()
        vblocks, sblocks = [v for v, _ in pairs], [s for _, s in pairs]
        try:
            for layer, kv in enumerate(self.kv):
                st.load(layer, kv, vblocks, sblocks)
        except Exception:
            log.exception("request %s: copying %d loaded blocks into vLLM failed; they are recomputed", rid, len(pairs))
            return set(sblocks)
        return set()

    def take_stats(self) -> ConnectorStats | None:
        """This rank's loads and staging copies since the last call
        (:mod:`kvsidecar.vllm.stats`), None when there were none."""
        st, self.stats = self.stats, ConnectorStats()
        st.data["copied_bytes"] = self.take_copied_bytes()
        return None if st.is_empty() else st

    def take_copied_bytes(self) -> int:
        """KV bytes the staging copies moved since the last call (0 under
        zero copy)."""
        n = self.staging.copied_bytes if self.staging is not None else 0
        d = self._copied_banked + n - self._copied_seen
        self._copied_banked, self._copied_seen = 0, n
        return d

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def note_exported(self, meta: KVSidecarConnectorMetadata) -> None:
        """Zero copy: the requests whose blocks vLLM keeps for this rank's
        export; each is reported in ``finished_sending`` once the sidecar
        reported it done (vLLM frees the blocks then)."""
        self._step += 1
        self._exported.update(meta.exported)
        self._report_sent()

    #: Steps a released export waits for vLLM to name it as one it keeps
    #: blocks for (it does in the step after the request finished).
    SENT_MATCH_STEPS = 64

    def _report_sent(self) -> None:
        done = self._exported.intersection(self._sent)
        self._sending |= done
        self._exported -= done
        for rid in done:
            del self._sent[rid]
        # The sidecar reports every export it released; one vLLM never waited
        # for (staging, a request not delayed, an export withdrawn) is
        # dropped: at once under staging, after a while under zero copy.
        self._sent = self.mode.still_awaited(self._sent, self._step)

    # -- prefill -------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: Any, meta: KVSidecarConnectorMetadata) -> None:
        """Copies one layer of the step's saves, after vLLM's forward wrote
        it (vLLM 0.32.0 calls it on the way out of each attention layer,
        ``maybe_transfer_kv_layer``; the step's start_load_kv may come after
        the forward, so the saves are read from the bound metadata). Under
        zero copy the scheduler sends no saves: the forward wrote the
        sidecar's pages."""
        layer = self.layers.get(layer_name)
        if not meta.saves or layer is None or layer in self._saved:
            return
        if not self._saved:
            self._sync()  # the scheduler allocated the staging blocks
        st = self.staging
        assert st is not None, "_sync connected"
        for sv in meta.saves:
            st.save(layer, kv_layer, sv.block_ids, sv.staging[self.rank])
        self._saved.add(layer)
        self.layer_saves["save_kv_layer"] += 1

    def wait_for_save(self, meta: KVSidecarConnectorMetadata) -> None:
        """Copies the layers of the step's saves that save_kv_layer did not."""
        try:
            if not meta.saves:
                return
            if not self._saved:
                self._sync()
            st = self.staging
            assert st is not None, "_sync connected"
            for layer, kv in enumerate(self.kv):
                if layer in self._saved:
                    continue
                for sv in meta.saves:
                    st.save(layer, kv, sv.block_ids, sv.staging[self.rank])
                self.layer_saves["wait_for_save"] += 1
        finally:
            self._saved = set()

    def _sync(self) -> None:
        """Maps the step's staging blocks here. A connection lost since the
        last step (the sidecar restarted, and the scheduler allocated on the
        new one) is dialled again once; an export that cannot be written is
        an error, never a silent export of wrong bytes."""
        try:
            c = self._client()
            if c is None:
                raise errors.Unavailable(f"KVSidecarConnector rank {self.rank}: the sidecar is unreachable")
            c.sync()
        except errors.BrokenConnection as e:
            self._lost(e)
            c = self._client()
            if c is None:
                raise errors.Unavailable(f"KVSidecarConnector rank {self.rank}: the sidecar is unreachable") from e
            c.sync()

    def shutdown(self) -> None:
        copied = self.staging.copied_bytes if self.staging is not None else 0
        log.info("rank %d: shutting down; staged %d bytes, layer copies %s", self.rank, copied, self.layer_saves)
        if self.client is not None:
            self.client.close()
            self.client = None




class StagingMode:
    """vLLM keeps its own KV tensors; every export and load is copied through
    blocks of the sidecar's pages (:class:`kvsidecar.staging.Staging`)."""

    def __init__(self, worker: WorkerSide) -> None:
        self.w = worker

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Checks vLLM's KV tensors against their layout and attaches to the
        sidecar (waiting ``sidecar_wait_seconds`` for it). Logs once why
        zero copy, when asked for, did not run: the plugin never routed
        vLLM's allocation here (not loaded, or ``VLLM_PLUGINS`` leaves it
        out).

        Raises:
            IncompatibleModel: the tensors do not match the sidecar's cache.
            KVSidecarError: the sidecar cannot be reached or attached.
        """
        w = self.w
        if w.cfg.zero_copy and not w.why_staging:
            w.why_staging = vllm_plugin.why_not or "vLLM allocated its KV cache without the kvsidecar plugin"
            log.warning("rank %d: zero copy off, the connector stages: %s", w.rank, w.why_staging)
        w.layout = w.layout_of(w.cfg)
        for kv in kv_caches.values():
            # Raises naming the shape when a tensor is not the layout's.
            w.layout.kv_views(kv, w.cfg.num_vllm_blocks)
        w._connect(w.cfg.sidecar_wait_seconds)
        log.info("rank %d: staging: vLLM keeps its KV tensors (%s) and the connector copies each exported or "
                 "loaded block through sidecar %s's pages", w.rank, w.layout.describe(), w.cfg.socket(w.rank))

    def sync_mappings(self, meta: KVSidecarConnectorMetadata) -> None:
        """Nothing: the staging blocks of a step's saves are mapped when the
        first layer is copied."""

    def lost(self, err: Exception) -> None:
        """Nothing to stop: the worker fails the loads in flight and dials
        again at the next step."""

    def staging_blocks(self, client: LocalClient, n: int) -> list[int]:
        """``n`` sidecar blocks a load lands in before it is copied into
        vLLM's (none for ``n`` 0).

        Raises:
            KVSidecarError: the sidecar's allocation failed (its error).
        """
        return client.alloc(n) if n else []

    def still_awaited(self, released: dict[str, int], step: int) -> dict[str, int]:
        """Released exports vLLM did not wait for: none are kept (vLLM's blocks
        are free once the sidecar holds its copy)."""
        return {}


class ZeroCopyMode:
    """vLLM's KV tensors are views of the sidecar's pages
    (:mod:`kvsidecar.vllm.zerocopy`): loads land in vLLM's own blocks,
    nothing is copied, and the engine cannot outlive its sidecar."""

    def __init__(self, worker: WorkerSide) -> None:
        self.w = worker

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Nothing: the tensors are the sidecar's pages, attached at
        allocation."""

    def sync_mappings(self, meta: KVSidecarConnectorMetadata) -> None:
        """Maps here every page the sidecar mapped since the last call when
        the step's metadata says there are any. Pages unmapped since need
        nothing: vLLM no longer uses their blocks, and the next sync drops
        them.

        Raises:
            RuntimeError: the sidecar connection is lost (:meth:`lost`).
        """
        if not meta.sync_mappings:
            return
        assert self.w.client is not None, "zero copy attached at allocation"
        try:
            self.w.client.sync()
        except errors.KVSidecarError as e:
            self.lost(e)

    def lost(self, err: Exception) -> None:
        """Stops the engine: the sidecar held its KV cache.

        Raises:
            RuntimeError: always, naming the rank, the error and what to do.
        """
        raise RuntimeError(f"rank {self.w.rank}: sidecar connection lost ({err}); in zero-copy mode the sidecar holds "
                           "this engine's KV cache, so the engine cannot go on: restart it with its sidecars") from err

    def staging_blocks(self, client: LocalClient, n: int) -> list[int]:
        """None: a load lands in vLLM's own blocks."""
        return []

    def still_awaited(self, released: dict[str, int], step: int) -> dict[str, int]:
        """Released exports, by the step they came in, that vLLM may still
        name as kept (it does a step after the request finished): those
        younger than :attr:`WorkerSide.SENT_MATCH_STEPS` steps."""
        old = step - WorkerSide.SENT_MATCH_STEPS
        return {r: s for r, s in released.items() if s > old}
