"""The sidecars of one engine instance, one per TP rank: what any engine
integration (vLLM's connector, an SGLang client, a layer-wise pusher) does
with them, independent of the engine.

- :func:`attach_rank` attaches one rank's client with the sidecar's own
  geometry, or the engine's when the sidecar was started without one, and
  checks that they agree and that the pages are host memory.
- :class:`RankSet` keeps a client per rank (dialled and attached on first
  use) and allocates, frees and finishes a request on every rank; a
  connection a sidecar restart broke is dialled again once per call (the
  redial policy), anything else is the caller's.

docs/engine-integration.md sections 4 to 7 are the calls' contract.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvsidecar import errors, reasons
from kvsidecar.limits import DEFAULT_CALL_TIMEOUT_SECONDS
from kvsidecar.local import LocalClient
from kvsidecar.params import merge_exports
from kvsidecar.v1 import common_pb2, local_pb2, params_pb2

__all__ = ["GEOMETRY_FIELDS", "RankSet", "attach_rank", "dtype_code"]

log = logging.getLogger("kvsidecar.rankset")

#: The geometry fields a sidecar and its engine must agree on (the model's
#: name may differ).
GEOMETRY_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")

_DTYPES: dict[str, common_pb2.DType] = {
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float16": common_pb2.DTYPE_FLOAT16,
    "half": common_pb2.DTYPE_FLOAT16,
    "float32": common_pb2.DTYPE_FLOAT32,
    "float": common_pb2.DTYPE_FLOAT32,
    "float8_e4m3fn": common_pb2.DTYPE_FP8_E4M3,
    "float8_e5m2": common_pb2.DTYPE_FP8_E5M2,
}


def dtype_code(dtype: object) -> common_pb2.DType:
    """The wire ``DType`` of a KV dtype given by name or as a torch dtype
    (``torch.bfloat16``, ``"float16"``, ...).

    Raises:
        InvalidArgument: a dtype with no wire code.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise errors.InvalidArgument(f"KV dtype {dtype} has no kvsidecar DType (known: {', '.join(_DTYPES)})")
    return _DTYPES[name]


def attach_rank(client: LocalClient, rank: int, tp_size: int, geometry: common_pb2.ModelGeometry,
                num_blocks: int = 0, *, device_memory_ok: bool = False, default_blocks: int = 0) -> local_pb2.KVCacheInfo:
    """Attaches ``client`` to rank ``rank``'s cache with the sidecar's own
    geometry (``serve --model`` or explicit flags), or with ``geometry``
    (the engine's) when the sidecar has none, and checks that the two agree
    on :data:`GEOMETRY_FIELDS`. ``num_blocks`` 0 takes the sidecar's
    ``--num-blocks``, or ``default_blocks`` (the engine's own count) when
    the sidecar was started without one.

    Raises:
        IncompatibleModel: a field differs (named, with both values).
        Unsupported: an MLA cache, or device memory unless
            ``device_memory_ok`` (the staging copies go
            through host memory).
        KVSidecarError: what the attach itself raised.
    """
    give: common_pb2.ModelGeometry | None = None
    # At most once each: the geometry, then the block count, as the sidecar
    # asks for them (their reasons).
    for _ in range(3):
        try:
            info = client.attach(geometry=give, tp_rank=rank, tp_size=tp_size, num_blocks=num_blocks)
            break
        except errors.InvalidArgument as e:
            if e.reason == reasons.GEOMETRY_REQUIRED and give is None:
                give = geometry
            elif e.reason == reasons.NUM_BLOCKS_REQUIRED and num_blocks == 0 and default_blocks:
                num_blocks = default_blocks
            else:
                raise
    else:
        raise AssertionError("unreachable: each retry adds what the sidecar asked for")
    have = info.geometry

    def name(field: str, v: int) -> str:
        return common_pb2.DType.Name(v) if field == "dtype" else str(v)

    for field in GEOMETRY_FIELDS:
        if getattr(have, field) != getattr(geometry, field):
            raise errors.IncompatibleModel(
                f"sidecar {client.path} has {field} {name(field, getattr(have, field))}, the engine's KV cache has "
                f"{name(field, getattr(geometry, field))}"
            )
    if have.attention != common_pb2.ATTENTION_GQA:
        raise errors.Unsupported("only GQA/MHA layouts are staged (the sidecar holds MLA)")
    if info.device_memory and not device_memory_ok:
        raise errors.Unsupported("the staging copies go through host memory: run the sidecar with --backend host")
    return info


class RankSet:
    """A client per TP rank of one engine instance.

    Args:
        socket_of: the local API socket of a rank.
        tp_size: the instance's TP size.
        geometry: the engine's KV geometry (for :func:`attach_rank`),
            asked for at the first attach.
        num_blocks: blocks per region to create the caches with (0: the
            sidecars' ``--num-blocks``, else ``default_blocks``).
        timeout: seconds per local API call.
        default_blocks: the engine's own block count, for sidecars started
            without ``--num-blocks`` when ``num_blocks`` is 0.
    """

    def __init__(self, socket_of: Callable[[int], str], tp_size: int,
                 geometry: Callable[[], common_pb2.ModelGeometry], num_blocks: int = 0,
                 timeout: float = DEFAULT_CALL_TIMEOUT_SECONDS, default_blocks: int = 0) -> None:
        self.socket_of, self.tp_size, self.geometry = socket_of, tp_size, geometry
        self.num_blocks, self.timeout, self.default_blocks = num_blocks, timeout, default_blocks
        self._clients: list[LocalClient] | None = None

    def clients(self) -> list[LocalClient]:
        """Every rank's client, dialled and attached on first use.

        Raises:
            KVSidecarError: a rank cannot be reached or attached (every
                client made so far is closed).
        """
        if self._clients is None:
            cs: list[LocalClient] = []
            try:
                for r in range(self.tp_size):
                    c = LocalClient(self.socket_of(r), timeout=self.timeout)
                    cs.append(c)
                    attach_rank(c, r, self.tp_size, self.geometry(), self.num_blocks,
                                default_blocks=self.default_blocks)
            except Exception:
                for c in cs:
                    c.close()
                raise
            self._clients = cs
        return self._clients

    def alloc(self, n: int) -> list[list[int]]:
        """``n`` blocks on every rank (``[rank][i]``). A connection a sidecar
        restart broke is dialled again once; blocks a failed attempt got are
        freed.

        Raises:
            KVSidecarError: a rank refused (Busy: over its limit), or the
                redial failed too.
        """
        for attempt in (0, 1):
            got: list[list[int]] = []
            clients: list[LocalClient] = []
            try:
                clients = self.clients()
                for c in clients:
                    got.append(c.alloc(n))
                return got
            except errors.KVSidecarError as e:
                self.free(got, clients)
                if attempt == 1 or not isinstance(e, (errors.BrokenConnection, errors.Unavailable)):
                    raise
                log.warning("sidecar connection lost (%s); connecting again", e)
                self.reset()
        raise AssertionError("unreachable")

    def free(self, per_rank: Sequence[Sequence[int]], clients: Sequence[LocalClient] | None = None) -> None:
        """Frees ``per_rank[r]`` on rank r; a rank whose connection is broken
        is skipped (its sidecar frees the session's blocks itself)."""
        for c, ids in zip(clients if clients is not None else self.clients(), per_rank, strict=False):
            if not ids:
                continue
            try:
                c.free(ids)
            except errors.KVSidecarError as e:
                log.warning("freeing %d blocks on %s failed: %s", len(ids), c.path, e)

    def finish(self, request_id: str, per_rank: Sequence[Sequence[int]], status: local_pb2.FinishStatus,
               keep: params_pb2.KVTransferParams, *, engine_owned: bool = False) -> params_pb2.KVTransferParams | None:
        """RequestFinished on every rank with that rank's blocks; returns the
        ranks' exports merged (:func:`kvsidecar.params.merge_exports`), or
        None when the request is not exported (``status`` other than
        FINISH_STATUS_LENGTH, or a rank failed: the others then release
        their blocks at once with FINISH_STATUS_ERROR, withdrawing an export
        already made, and the failed rank's blocks are freed here unless
        ``engine_owned``: blocks the engine keeps and frees itself, as
        vLLM does under zero copy)."""
        parts: list[params_pb2.KVTransferParams] = []
        clients = self.clients()
        for r, c in enumerate(clients):
            try:
                p = c.request_finished(request_id, per_rank[r], status, keep)
            except errors.KVSidecarError as e:
                log.error("request %s: RequestFinished on rank %d failed: %s", request_id, r, e)
                if not engine_owned:
                    self.free([per_rank[r]], [c])
                if status == local_pb2.FINISH_STATUS_LENGTH:
                    self._withdraw(request_id, per_rank, clients[:r])
                p, status = None, local_pb2.FINISH_STATUS_ERROR
            if p is not None:
                parts.append(p)
        if any(c.broken for c in clients):
            self.reset()
        if status != local_pb2.FINISH_STATUS_LENGTH or len(parts) != len(per_rank):
            return None
        return merge_exports(parts)

    def _withdraw(self, request_id: str, per_rank: Sequence[Sequence[int]], clients: Sequence[LocalClient]) -> None:
        """Withdraws the exports ``clients`` (ranks 0..) made of the request:
        RequestFinished again with FINISH_STATUS_ERROR ends each lease now."""
        for r, c in enumerate(clients):
            try:
                c.request_finished(request_id, per_rank[r], local_pb2.FINISH_STATUS_ERROR, params_pb2.KVTransferParams())
            except errors.KVSidecarError as e:
                log.error("request %s: withdrawing rank %d's export failed (it lasts its lease): %s", request_id, r, e)

    def reset(self) -> None:
        """Closes every client; the next call dials again."""
        for c in self._clients or ():
            c.close()
        self._clients = None

    close = reset
