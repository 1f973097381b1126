"""The scheduler-process half of KVSidecarConnector (see :mod:`kvsidecar.vllm`):
which requests load or export, the sidecar blocks of each export on every
rank (staging) or vLLM's own (zero copy, where vLLM's block pool takes its
blocks from the sidecar: :func:`kvsidecar.vllm.zerocopy.install_block_pool`),
and RequestFinished with the ranks' exports merged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

from kvsidecar import errors, reasons
from kvsidecar.params import (
    TOKEN_DIGEST_LEN,
    engine_facts_mismatch,
    params_from_json,
    params_to_json,
    token_digests,
    validate_remote_prefill,
)
from kvsidecar.rankset import RankSet
from kvsidecar.v1 import common_pb2, local_pb2, params_pb2
from kvsidecar.vllm.compat import SidecarPool
from kvsidecar.vllm.metadata import (
    ConnectorConfig,
    KVSidecarConnectorMetadata,
    LoadSpec,
    SaveSpec,
    log,
    role_name,
    vllm_engine_facts,
)
from kvsidecar.vllm.stats import ConnectorStats
from kvsidecar.vllm.zerocopy import ModeHandshake, install_block_pool

__all__ = ["SchedulerSide"]

# vLLM's RequestStatus (vllm/v1/request.py) by name -> why the sidecar is told
# the request finished. FINISHED_LENGTH_CAPPED is the prefill's max_tokens=1
# stop: the only status that keeps the KV for a decode.
_FINISH_STATUS = {
    "FINISHED_LENGTH_CAPPED": local_pb2.FINISH_STATUS_LENGTH,
    "FINISHED_STOPPED": local_pb2.FINISH_STATUS_STOP,
    "FINISHED_ABORTED": local_pb2.FINISH_STATUS_ABORTED,
    "FINISHED_IGNORED": local_pb2.FINISH_STATUS_ERROR,
    "FINISHED_ERROR": local_pb2.FINISH_STATUS_ERROR,
}


class SchedulerSide:
    """The scheduler-process half."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.ranks = RankSet(cfg.socket, cfg.tp_size, cfg.geometry, cfg.num_blocks, cfg.timeout,
                             default_blocks=cfg.num_vllm_blocks)
        # Decode: prefix hit tokens, noted by get_num_new_matched_tokens, and
        # each waiting request's params as parsed there once (vLLM asks
        # again every step the request waits), carried to the worker.
        self._hit_tokens: dict[str, int] = {}
        self._remote: dict[str, _Remote] = {}
        #: Params refused since the last take_stats (kvsidecar.vllm.stats).
        self.stats = ConnectorStats()
        self._loads: list[LoadSpec] = []
        self._aborts: list[str] = []
        self._loading: set[str] = set()
        # Prefill: requests to export -> prompt length, vLLM block ids so far,
        # tokens computed so far, and the staging blocks once allocated.
        self._exports: dict[str, _Export] = {}
        # Zero copy: vLLM's block pool (bound at start), the sidecar-backed
        # pool once every worker reported zero copy, the engine loop's
        # waker, and the exports vLLM waits for (told to the workers).
        self._vllm_pool: Any = None
        self.pool: SidecarPool | None = None
        self._waker: Callable[[], None] | None = None
        self._exported: list[str] = []
        # Zero copy: mappings rank 0's client had received at the last step.
        self._mappings_seen = -1
        #: This engine's facts (the attention backend once the workers
        #: reported it, set_modes): stated in every export's params,
        #: compared with every load's (compat_mismatch).
        self.facts = vllm_engine_facts(cfg.vllm_config)
        # Differences already logged at WARNING, by (prefill engine id,
        # difference), and prefill engines whose params state no facts.
        self._compat_logged: set[tuple[str, str]] = set()

    @property
    def zero_copy(self) -> bool:
        """Whether vLLM's KV cache is the sidecars' pages."""
        return self.pool is not None

    def bind_block_pool(self, pool: Any) -> None:
        """Keeps vLLM's block pool for zero copy (vLLM binds it at start)."""
        self._vllm_pool = pool

    def set_modes(self, modes: dict[int, ModeHandshake]) -> None:
        """Takes every worker's mode (vLLM collects them after the KV caches
        are allocated, before the first request): when every rank's KV
        tensors are its sidecar's pages, vLLM's block pool becomes a
        pool over rank 0's blocks (:func:`kvsidecar.vllm.zerocopy.install_block_pool`).

        Also takes the ranks' attention backend into :attr:`facts` (their
        names sorted and joined with "," where they differ; a rank that
        reports none is left out).

        Raises:
            RuntimeError: ranks disagree (some zero copy, some staging).
        """
        self.facts.attention_backend = ",".join(
            sorted({b for m in modes.values() if (b := getattr(m, "attention_backend", ""))}))
        zc = sorted(r for r, m in modes.items() if m.zero_copy)
        if not zc:
            return
        if len(zc) != self.cfg.tp_size:
            why = "; ".join(f"rank {r}: {m.why}" for r, m in sorted(modes.items()) if not m.zero_copy)
            raise RuntimeError(f"KVSidecarConnector: ranks {zc} run zero copy, the others stage ({why}); "
                               "every rank of an engine must do the same")
        assert self._vllm_pool is not None, "vLLM binds its block pool before it collects the workers' modes"
        self.pool = install_block_pool(self._vllm_pool, self.ranks.clients()[0], self.cfg.free_hold_seconds)
        if self._waker is not None:
            self.pool.set_waker(self._waker)
        log.info("zero copy: vLLM's block pool takes its %d blocks from the sidecars; freed prefix-cache blocks stay "
                 "mapped %.0fs", self.pool.num_gpu_blocks, self.cfg.free_hold_seconds)

    def set_engine_waker(self, wake: Callable[[], None]) -> None:
        """How to make the idle engine loop step (from the plugin)."""
        self._waker = wake
        if self.pool is not None:
            self.pool.set_waker(wake)

    def take_stats(self) -> ConnectorStats | None:
        """The params refused since the last call, None when none (vLLM
        aggregates them with the workers' loads)."""
        st, self.stats = self.stats, ConnectorStats()
        return None if st.is_empty() else st

    def has_pending_push_work(self) -> bool:
        """Zero copy: a held block is due for release, so vLLM should step
        (it calls this to decide whether to stay idle)."""
        return self.pool is not None and self.pool.release_is_due()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt tokens past the local prefix hit that the prefill's
        export holds: at most what ``remote_block_ids`` cover and the
        prefill's ``prompt_tokens``, so tokens the prefill never computed
        are never claimed (vLLM would attend over them as loaded). Params a
        load cannot use are refused here, once, with a log line: the prompt
        is computed locally and the prefill is not notified. So are params
        whose ``token_digests`` say their KV encodes other tokens than this
        request's prompt (:func:`token_digest_mismatch`): another prompt's
        params (a prompt list given one prefill's params), mixed up or
        replayed; reason ``TOKEN_DIGEST_MISMATCH`` in the log line. Before
        those, params of an incompatible prefill (:meth:`compat_mismatch`:
        another block_size, vLLM version, model, attention backend or KV
        cache dtype) are refused the same way, code
        ``CODE_INCOMPATIBLE_MODEL`` and each differing field with both
        values in the log line (once per prefill engine and difference at
        WARNING, later ones at DEBUG)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        rid = request.request_id
        if self.pool is not None:
            bs = self.cfg.block_size
            self.pool.note_waiting(rid, -(-int(request.num_tokens) // bs) - num_computed_tokens // bs)
        if not (self.cfg.consumer and params.get("do_remote_prefill")):
            return 0, False
        rem = self._remote.get(rid)
        if rem is None:
            try:
                p = _parse(params)
                if not p.remote_block_ids:
                    raise errors.ParamsError("kv_transfer_params: remote_block_ids: missing", field="remote_block_ids",
                                             reason=reasons.PARAMS_MISSING)
            except errors.KVSidecarError as e:
                log.warning("request %s: kv_transfer_params refused, the prompt is computed here: %s", rid, e)
                return self._refused(params)
            if why := self.compat_mismatch(rid, p):
                self._log_once(p.remote_engine_id, why,
                               "request %s: kv_transfer_params refused (%s), the prompt is computed here: prefill "
                               "engine %s is not this engine's kind: %s", rid,
                               common_pb2.Code.Name(common_pb2.CODE_INCOMPATIBLE_MODEL), p.remote_engine_id, why)
                return self._refused(params)
            covered = min(len(request.prompt_token_ids or ()), len(p.remote_block_ids) * self.cfg.block_size)
            if p.prompt_tokens:
                covered = min(covered, p.prompt_tokens)
            mine = token_digests(prompt_tokens(request)[:covered], self.cfg.block_size, token_salt(request, covered))
            if why := token_digest_mismatch(p, mine):
                log.warning("request %s: kv_transfer_params refused (%s), the prompt is computed here: %s", rid,
                            reasons.TOKEN_DIGEST_MISMATCH, why)
                return self._refused(params)
            rem = self._remote[rid] = _Remote(p, covered, mine)
        self._hit_tokens[rid] = num_computed_tokens
        count = rem.covered - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def _refused(self, params: dict[str, Any]) -> tuple[int, bool]:
        """Ends a refusal (its line logged): the params are consumed, as a
        load's are, so nothing is loaded or notified and vLLM computes the
        prompt; counted for vLLM's /metrics. get_num_new_matched_tokens'
        answer: (0, False)."""
        params["do_remote_prefill"] = False
        self.stats.record_refused_params()
        return 0, False

    def compat_mismatch(self, rid: str, p: params_pb2.KVTransferParams) -> str:
        """Why this decode cannot attend over the KV of the prefill that
        issued ``p``; "" when it can. The parts, joined with "; ", each name
        a field and both values ("model: prefill 'a', decode 'b'"):

        - ``block_size``, when the params state one (not 0) other than
          this engine's: the prefill's block ids do not map one to one
          onto this engine's blocks, and the sidecars move whole blocks
          (vLLM's NixlConnector reads a prefill of a smaller block size,
          vllm 0.32.0 ``kv_connector/utils.py`` ``block_size_ratio``; the
          sidecar does not). Never loosened.
        - the ``engine_facts`` fields both sides state
          (:func:`kvsidecar.params.engine_facts_mismatch`), unless
          ``enforce_handshake_compat`` is off: then each difference is
          logged once and the params are used.

        Params without ``engine_facts`` (a prefill connector from before
        they were stated, or params made by another engine) are used
        unchecked, logged once per prefill engine at INFO: the sidecars'
        handshake still compares the KV geometry (dtype, heads, head size,
        layers, block size, layout) before any byte is read."""
        parts = []
        if p.block_size and p.block_size != self.cfg.block_size:
            parts.append(f"block_size: prefill {p.block_size}, decode {self.cfg.block_size} (the sidecars move whole "
                         "blocks: start both engines with one --block-size)")
        if not p.HasField("engine_facts"):
            self._log_once(p.remote_engine_id, "", "request %s: prefill engine %s states no engine facts in its "
                           "kv_transfer_params (an older kvsidecar connector, or another engine): its vLLM version, "
                           "model, attention backend and KV cache dtype are not compared with this engine's; the "
                           "sidecars still compare the KV geometry", rid, p.remote_engine_id, level=logging.INFO)
            return "; ".join(parts)
        facts = engine_facts_mismatch(p.engine_facts, self.facts)
        if facts and not self.cfg.enforce_compat:
            self._log_once(p.remote_engine_id, "; ".join(facts), "request %s: prefill engine %s differs from this "
                           "engine (%s); loaded anyway: enforce_handshake_compat is off", rid, p.remote_engine_id,
                           "; ".join(facts))
            facts = []
        return "; ".join([*facts, *parts])

    def _log_once(self, engine: str, what: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
        """Logs ``msg`` at ``level`` the first time prefill ``engine`` shows
        ``what``, at DEBUG after (one line per refused request would flood
        the log of a decode paired with the wrong prefill)."""
        key = (engine, what)
        if key in self._compat_logged:
            level = logging.DEBUG
        self._compat_logged.add(key)
        log.log(level, msg, *args)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.cfg.producer and params.get("do_remote_decode") and rid not in self._exports:
            self._exports[rid] = _Export(prompt_len=len(request.prompt_token_ids or ()))
        if not (self.cfg.consumer and params.get("do_remote_prefill")):
            return
        # Consumed: a second update_state_after_alloc (after the load) must
        # not load again.
        params["do_remote_prefill"] = False
        rem = self._remote.pop(rid, None)
        hit_blocks = self._hit_tokens.pop(rid, 0) // self.cfg.block_size
        if rem is None:
            # vLLM asks get_num_new_matched_tokens first, which refuses bad
            # params; a caller that did not is refused here.
            try:
                p = _parse(params)
            except errors.KVSidecarError as e:
                log.warning("request %s: kv_transfer_params refused: %s", rid, e)
                if num_external_tokens > 0:
                    self._loads.append(LoadSpec(rid, list(blocks.get_unhashed_block_ids()), None, refused=str(e)))
                    self._loading.add(rid)
                return
            rem = _Remote(p, len(p.remote_block_ids) * self.cfg.block_size, b"")
        spec, digests, covered = rem.params, rem.digests, rem.covered
        if num_external_tokens <= 0:
            self._loads.append(LoadSpec(rid, [], spec, notify_only=True))
            return
        remote = spec.remote_block_ids
        # vLLM allocates the blocks after the local prefix hit (the unhashed
        # ones); the first ones take the remote blocks after the hit that
        # hold the claimed tokens, in order. A further block (vLLM can
        # allocate one more than the prompt fills) is computed locally.
        local = list(blocks.get_unhashed_block_ids())
        want = max(min(len(remote), -(-covered // self.cfg.block_size)) - hit_blocks, 0)
        if len(local) < want:
            # vLLM counts every claimed token as loaded: a load of fewer
            # blocks would leave the rest attended over unwritten. The
            # load fails whole instead (every block recomputed).
            log.warning("request %s: %d local blocks for %d remote blocks after a hit of %d; the load fails and the "
                        "prompt is recomputed", rid, len(local), len(remote), hit_blocks)
            self._loads.append(LoadSpec(rid, local, spec, hit_blocks=min(hit_blocks, len(remote)),
                                        refused=f"{len(local)} local blocks for the {want} to load"))
            self._loading.add(rid)
            return
        self._loads.append(LoadSpec(rid, local[:want], spec, hit_blocks=min(hit_blocks, len(remote)),
                                    token_digests=digests))
        self._loading.add(rid)

    def build_connector_meta(self, scheduler_output: Any) -> KVSidecarConnectorMetadata:
        saves = self._saves(scheduler_output) if self._exports and not self.zero_copy else []
        meta = KVSidecarConnectorMetadata(loads=self._loads, saves=saves, aborts=self._aborts, exported=self._exported)
        self._loads, self._aborts, self._exported = [], [], []
        if self.pool is not None:
            self.pool.step_done()
            # Under coordinated ownership rank 0 maps a page on every rank
            # before it tells this client, so a page new to rank 0's client
            # is mapped on every rank by now.
            n = self.ranks.clients()[0].mappings_received
            meta.sync_mappings, self._mappings_seen = n != self._mappings_seen, n
        return meta

    def _saves(self, so: Any) -> list[SaveSpec]:
        bs = self.cfg.block_size
        for nr in getattr(so, "scheduled_new_reqs", ()):
            exp = self._exports.get(nr.req_id)
            if exp is not None:
                exp.blocks = list(nr.block_ids[0])
                exp.computed = nr.num_computed_tokens
        cr = getattr(so, "scheduled_cached_reqs", None)
        if cr is not None:
            resumed: set[str] = getattr(cr, "resumed_req_ids", set()) or set()
            for i, rid in enumerate(cr.req_ids):
                exp = self._exports.get(rid)
                if exp is None:
                    continue
                new = cr.new_block_ids[i]
                if new is not None:
                    exp.blocks = list(new[0]) if rid in resumed else exp.blocks + list(new[0])
                exp.computed = cr.num_computed_tokens[i]
        out = []
        for rid, exp in self._exports.items():
            n = so.num_scheduled_tokens.get(rid, 0)
            if exp.staging is not None or n == 0 or exp.computed + n < exp.prompt_len:
                continue
            nblocks = -(-exp.prompt_len // bs)
            vblocks = exp.blocks[:nblocks]
            if len(vblocks) < nblocks:
                log.error("request %s: %d vLLM blocks for a prompt of %d tokens; not exported", rid, len(vblocks),
                          exp.prompt_len)
                exp.staging = []
                continue
            try:
                staging = self.ranks.alloc(nblocks)
            except errors.KVSidecarError as e:
                log.warning("request %s: sidecar blocks for the export refused (%s); it will not be exported", rid, e)
                exp.staging = []
                continue
            exp.staging = staging
            out.append(SaveSpec(rid, vblocks, staging))
        return out

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._hit_tokens.pop(rid, None)
        rem = self._remote.pop(rid, None)
        exp = self._exports.pop(rid, None)
        if exp is not None and self.zero_copy:
            return self._finish_in_place(request, exp, block_ids)
        if exp is not None and exp.staging:
            return False, self._finish_export(request, exp)
        if rid in self._loading:
            # Aborted while loading: vLLM keeps the blocks of a request in
            # WAITING_FOR_REMOTE_KVS until a worker reports it in
            # finished_recving (Scheduler.finish_requests); the workers
            # abort the load and report it.
            self._loading.discard(rid)
            self._aborts.append(rid)
            return False, None
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.cfg.consumer and params.get("do_remote_prefill"):
            # Finished before it was scheduled: notify the prefill so it
            # frees its blocks now, not at lease expiry.
            params["do_remote_prefill"] = False
            p = rem.params if rem is not None else None
            if p is None:
                try:
                    p = _parse(params)
                except errors.KVSidecarError as e:
                    log.warning("request %s: finished before its load; its kv_transfer_params cannot notify the "
                                "prefill: %s", rid, e)
                    return False, None
            self._loads.append(LoadSpec(rid, [], p, notify_only=True))
        return False, None

    def _finish_export(self, request: Any, exp: _Export) -> dict[str, Any] | None:
        status = _FINISH_STATUS.get(role_name(request.status), local_pb2.FINISH_STATUS_ERROR)
        assert exp.staging is not None
        merged = self.ranks.finish(request.request_id, exp.staging, status, _keep(request, self.cfg.block_size))
        return self._params(merged, exp)

    def _params(self, merged: params_pb2.KVTransferParams | None, exp: _Export) -> dict[str, Any] | None:
        """The decode's kv_transfer_params: the ranks' exports merged (each
        carries the prompt tokens and their digests, :func:`_keep`), with
        this engine's facts (:attr:`facts`) for the decode's check."""
        if merged is None:
            return None
        merged.engine_facts.CopyFrom(self.facts)
        return params_to_json(merged)

    def _finish_in_place(self, request: Any, exp: _Export, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Zero copy: exports the prompt's own vLLM blocks on every rank; vLLM
        keeps them (returns True) until the workers report the request in
        finished_sending, when every rank's lease ended."""
        status = _FINISH_STATUS.get(role_name(request.status), local_pb2.FINISH_STATUS_ERROR)
        if status != local_pb2.FINISH_STATUS_LENGTH:
            return False, None
        ids = list(block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids)
        nblocks = -(-exp.prompt_len // self.cfg.block_size)
        if len(ids) < nblocks:
            log.error("request %s: %d vLLM blocks for a prompt of %d tokens; not exported", request.request_id,
                      len(ids), exp.prompt_len)
            return False, None
        merged = self.ranks.finish(request.request_id, [ids[:nblocks]] * self.cfg.tp_size, status,
                                   _keep(request, self.cfg.block_size),
                                   engine_owned=True)
        if merged is None:
            return False, None
        self._exported.append(request.request_id)
        return True, self._params(merged, exp)

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(rid)

    def shutdown(self) -> None:
        self.ranks.close()


def _keep(request: Any, block_size: int) -> params_pb2.KVTransferParams:
    """What RequestFinished is told of the request: keep the KV for a
    decode; the tokens its blocks encode (``prompt_tokens``, and their
    ``token_digests``, which the decode checks its own prompt against), and
    the request's ``checksums`` choice (which overrides the sidecar's
    ``--checksums``)."""
    tokens = prompt_tokens(request)
    keep = params_pb2.KVTransferParams(do_remote_decode=True, prompt_tokens=len(tokens),
                                       token_digests=token_digests(tokens, block_size, token_salt(request, len(tokens))))
    checksums = (getattr(request, "kv_transfer_params", None) or {}).get("checksums")
    if isinstance(checksums, bool):
        keep.checksums = checksums
    return keep


def _parse(params: dict[str, Any]) -> params_pb2.KVTransferParams:
    """A decode request's ``kv_transfer_params``, parsed and validated for a
    remote prefill.

    Raises:
        KVSidecarError: params a load cannot use (the reason names the field).
    """
    p = params_from_json(params)
    validate_remote_prefill(p)
    return p


@dataclasses.dataclass
class _Remote:
    """A waiting decode request's params, parsed and validated once: the
    prompt tokens its export holds and their token digests."""

    params: params_pb2.KVTransferParams
    covered: int
    digests: bytes


@dataclasses.dataclass
class _Export:
    prompt_len: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    staging: list[list[int]] | None = None




def prompt_tokens(request: Any) -> list[int]:
    """A vLLM request's prompt token ids (``Request.prompt_token_ids``,
    vllm 0.32.0 ``vllm/v1/request.py``); a prompt given as embeddings only
    reads as zeros of its length (vLLM's own placeholder), its embeddings in
    :func:`token_salt`."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        return [0] * int(getattr(request, "num_prompt_tokens", 0) or 0)
    return list(ids)


def token_salt(request: Any, n_tokens: int) -> bytes:
    """What a request's KV depends on beside its first ``n_tokens`` prompt
    tokens, as vLLM folds it into its block hashes
    (``generate_block_hash_extra_keys``, vllm 0.32.0
    ``vllm/v1/core/kv_cache_utils.py``): the LoRA adapter's name and path,
    the ``cache_salt``, the multimodal inputs that start within the tokens
    (identifier and offset), the prompt embeddings; b"" when there is none,
    so a plain prompt's digests depend on its tokens alone."""
    keys: list[Any] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        keys.append(["lora", str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", ""))])
    if salt := getattr(request, "cache_salt", None):
        keys.append(["cache_salt", str(salt)])
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        offset = int(getattr(pos, "offset", 0) or 0)
        if offset < n_tokens:
            keys.append(["mm", str(getattr(f, "identifier", "")), offset])
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        from vllm.v1.utils import tensor_data

        keys.append(["prompt_embeds", hashlib.sha256(tensor_data(embeds[:n_tokens])).hexdigest()])
    return json.dumps(keys).encode() if keys else b""


def token_digest_mismatch(p: params_pb2.KVTransferParams, mine: bytes) -> str:
    """Why params ``p`` do not encode the prompt whose token digests (over
    the tokens a load would take) are ``mine``: the first block whose digest
    differs; "" when they agree or ``p`` carries none (a prefill engine that
    states none: nothing to check)."""
    theirs = p.token_digests
    if not theirs:
        return ""
    n = TOKEN_DIGEST_LEN
    for i in range(len(mine) // n):
        if mine[i * n:(i + 1) * n] != theirs[i * n:(i + 1) * n]:
            return (f"the prefill's KV (request {p.remote_request_id} of engine {p.remote_engine_id}) encodes other tokens in "
                    f"block {i} than this prompt's: params of another prompt (mixed up, replayed), or of a longer one")
    return ""
