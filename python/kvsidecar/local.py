"""Client of a kvsidecar's local API: the engine's side of the unix socket.

One ``kvsidecar serve`` runs beside each tensor-parallel rank. Its engine
(each worker process, and an engine's scheduler where it needs to) connects
to the rank's socket, :func:`kvsidecar.paths.local_socket_path`, and makes
the calls of ``proto/kvsidecar/v1/local.proto``: create/attach the KV cache,
alloc/free blocks, available, set the memory limit, RequestFinished,
StartLoad, GetFinished, Abort, Stats, Sync.

Every request and reply is one size-delimited protobuf frame
(:mod:`kvsidecar.framing`). Replies to a connection that attached the cache
carry a ``MappingDelta``: the pages the sidecar mapped or unmapped since the
previous reply, with one file descriptor per mapping passed beside the
frame. On the host backend :class:`LocalClient` applies it to a reservation
of its own (:class:`kvsidecar.hostmap.HostMapping`), so :meth:`LocalClient.block`
addresses the same physical memory as the sidecar; when the pages are device
memory (``--backend cuda``) it hands each delta with its fds to a
``device_handler`` the engine gives, which imports them with
``cuMemImportFromShareableHandle``.

The smallest use::

    from kvsidecar.local import LocalClient
    from kvsidecar.paths import local_socket_path
    from kvsidecar.v1 import local_pb2

    c = LocalClient(local_socket_path("/run/kvsidecar", "prefill-a", 0))
    info = c.attach(local_pb2.CreateKVCache(tp_rank=0, tp_size=2))
    ids = c.alloc(4)
    c.block(0, ids[0])[:4] = b"\\x01\\x02\\x03\\x04"  # region 0 (layer 0 K)
    c.free(ids)
    c.close()
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.protobuf.message import DecodeError, Message

from kvsidecar import errors, limits
from kvsidecar.devicemap import DeviceMapping, DeviceMappingDelta
from kvsidecar.framing import FrameSocket
from kvsidecar.hostmap import HostMapping, Packing
from kvsidecar.v1 import common_pb2, group_pb2, local_pb2, params_pb2

__all__ = [
    "DEFAULT_CALL_TIMEOUT_SECONDS",
    "DEFAULT_MAX_REPLY_BYTES",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_SIDECAR_WAIT_SECONDS",
    "LocalClient",
    "dial_waiting",
]

#: Bounds one request frame: the sidecar's default limit
#: (:data:`kvsidecar.limits.MAX_REQUEST_BYTES`). A larger request is refused
#: here before it is sent.
DEFAULT_MAX_REQUEST_BYTES = limits.MAX_REQUEST_BYTES
#: Bounds one reply frame, as the Go client does (:mod:`kvsidecar.limits`).
DEFAULT_MAX_REPLY_BYTES = limits.DEFAULT_MAX_REPLY_BYTES
#: Seconds one call may take, from sending the request to the whole reply:
#: the sidecar's own bound on a call (:mod:`kvsidecar.limits`).
DEFAULT_CALL_TIMEOUT_SECONDS = limits.DEFAULT_CALL_TIMEOUT_SECONDS
#: Seconds :func:`dial_waiting` waits for a sidecar whose socket is not
#: there yet (an engine started before its sidecar).
DEFAULT_SIDECAR_WAIT_SECONDS = 60.0

_log = logging.getLogger("kvsidecar.local")


class LocalClient:
    """One connection to a sidecar's local API.

    After :meth:`attach` it reserves one inaccessible address range per
    region (``region_len`` bytes each) and maps every page the sidecar has
    mapped at its offset, so :meth:`block` and :meth:`region` address the
    sidecar's own memory. Every reply brings the pages mapped and unmapped
    since the previous one, so a mapping of a page the sidecar released
    never outlives the next call; pages allocated through *another*
    connection appear here at this connection's next call (:meth:`sync` asks
    for nothing else).

    Calls are serialized (one at a time per connection); the client is safe
    for use from several threads. Each call waits at most ``timeout``
    seconds (the connection is broken after a timeout). Errors are
    :class:`kvsidecar.errors.KVSidecarError` subclasses carrying the wire
    code. Use as a context manager or call :meth:`close`.

    Args:
        path: the socket path (see :func:`kvsidecar.paths.local_socket_path`).
        timeout: seconds per call, and for connecting. Default 30.
        max_reply_bytes: bound of one reply frame. Default 64 MiB.
        device_mapping: keeps the sidecar's device pages mapped here when
            they are device memory (:class:`kvsidecar.devicemap.CudaDeviceMapping`):
            reserved at attach, every reply's changes applied, closed with
            the client.
        device_handler: instead, called with a :class:`DeviceMappingDelta`
            for every reply that changes the mappings of device pages. With
            neither, attaching to such a sidecar raises
            :class:`kvsidecar.errors.Unsupported`.

    Raises:
        Unavailable: the socket cannot be reached (no sidecar, refused).
        Timeout: connecting took longer than ``timeout``.
    """

    def __init__(
        self,
        path: str,
        *,
        timeout: float = DEFAULT_CALL_TIMEOUT_SECONDS,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        device_handler: Callable[[DeviceMappingDelta], None] | None = None,
        device_mapping: DeviceMapping | None = None,
    ) -> None:
        if timeout <= 0:
            raise errors.InvalidArgument(f"timeout {timeout} must be positive seconds")
        if max_reply_bytes < 64:
            raise errors.InvalidArgument(f"max_reply_bytes {max_reply_bytes} must be at least 64")
        self.path = path
        self.timeout = timeout
        self._device_handler = device_mapping.apply if device_mapping is not None else device_handler
        #: Page mappings the sidecar sent this connection so far (every
        #: reply's MappingDelta ``map`` entries): a change means pages were
        #: mapped since it was last read.
        self.mappings_received = 0
        #: The device mapping given, or None.
        self.device_mapping = device_mapping
        self._lock = threading.RLock()
        self._next_id = 0
        self._broken: str | None = None
        self._info: local_pb2.KVCacheInfo | None = None
        self._host: HostMapping | None = None
        self._closed = False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except TimeoutError as e:
            sock.close()
            raise errors.Timeout(f"connect {path}: no answer within {timeout}s") from e
        except OSError as e:
            sock.close()
            raise errors.Unavailable(f"connect {path}: {e.strerror or e}") from e
        self._frames = FrameSocket(sock, path, max_reply_bytes)

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call --------------------------------------------------------------

    def _fail(self, why: str, cls: type[errors.KVSidecarError] = errors.BrokenConnection) -> errors.KVSidecarError:
        self._broken = why
        return cls(f"kvsidecar local client {self.path}: {why}")

    def _exchange(self, req: local_pb2.LocalRequest, timeout: float | None) -> local_pb2.LocalReply:
        """Sends req and reads its reply (mappings not yet applied)."""
        if self._closed:
            raise errors.Unavailable(f"kvsidecar local client {self.path}: closed")
        if self._broken is not None:
            raise errors.BrokenConnection(
                f"kvsidecar local client {self.path}: connection broken by an earlier error: {self._broken}"
            )
        self._next_id += 1
        req.wire_version = common_pb2.WIRE_VERSION_1
        req.call_id = self._next_id
        body = req.SerializeToString()
        if len(body) > DEFAULT_MAX_REQUEST_BYTES:
            raise errors.InvalidArgument(
                f"request of {len(body)} bytes exceeds the sidecar's frame limit of {DEFAULT_MAX_REQUEST_BYTES} bytes"
            )
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        try:
            self._frames.send(body, t)
            frame = self._frames.read_frame(deadline)
        except errors.BrokenConnection as e:
            self._broken = e.message
            raise
        except TimeoutError as e:
            raise self._fail(f"no reply within {t}s (call timeout)", errors.Timeout) from e
        except OSError as e:
            raise self._fail(f"{e.strerror or e}") from e
        rep = local_pb2.LocalReply()
        try:
            rep.ParseFromString(frame)
        except DecodeError as e:
            raise self._fail(f"unreadable reply frame: {e}") from e
        if rep.call_id != req.call_id:
            raise self._fail(f"reply for call {rep.call_id}, want {req.call_id}")
        return rep

    def _call(self, field: str, msg: Message | None = None, timeout: float | None = None) -> local_pb2.LocalReply:
        req = local_pb2.LocalRequest()
        if msg is None:
            setattr(req, field, True)
        else:
            getattr(req, field).CopyFrom(msg)
        with self._lock:
            rep = self._exchange(req, timeout)
            self._apply(rep)
        if rep.HasField("error") and rep.error.code != common_pb2.CODE_OK:
            raise errors.from_proto(rep.error)
        return rep

    # -- mappings ------------------------------------------------------------

    def _take_fds(self, n: int) -> list[int]:
        try:
            return self._frames.take_fds(n)
        except errors.BrokenConnection as e:
            self._broken = e.message
            raise

    def _drop_fds(self, rep: local_pb2.LocalReply) -> None:
        for fd in self._take_fds(rep.mappings.num_fds if rep.HasField("mappings") else 0):
            os.close(fd)

    def _apply(self, rep: local_pb2.LocalReply) -> None:
        """Applies rep's MappingDelta; its fds are closed after."""
        if not rep.HasField("mappings"):
            return
        d = rep.mappings
        self.mappings_received += len(d.map)
        fds = self._take_fds(d.num_fds)
        try:
            if self._info is None:
                raise self._fail("mappings before attach")
            if self._info.device_memory:
                self._apply_device(d, fds)
            elif self._host is not None:
                try:
                    self._host.apply(d, fds)
                except errors.BrokenConnection as e:
                    self._broken = e.message
                    raise
        finally:
            for fd in fds:
                os.close(fd)

    def _apply_device(self, d: local_pb2.MappingDelta, fds: list[int]) -> None:
        for m in d.map:
            if m.fd_index >= len(fds):
                raise self._fail(f"fd_index {m.fd_index} outside the {len(fds)} passed fds")
        delta = DeviceMappingDelta(
            mappings=tuple((m, fds[m.fd_index]) for m in d.map), unmapped_pages=tuple(d.unmapped_pages)
        )
        assert self._device_handler is not None  # attach refused otherwise
        self._device_handler(delta)

    def _reserve(self, info: local_pb2.KVCacheInfo) -> None:
        if info.device_memory:
            if self._device_handler is None:
                raise errors.Unsupported(
                    "kvsidecar local client: the sidecar's pages are device memory; pass device_mapping "
                    "(kvsidecar.devicemap.CudaDeviceMapping) or device_handler to import their fds with "
                    "cuMemImportFromShareableHandle"
                )
            if self.device_mapping is not None:
                self.device_mapping.reserve(info)
        else:
            try:
                self._host = HostMapping(info, self.path)
            except errors.BrokenConnection as e:
                self._broken = e.message
                raise
        self._info = info

    # -- calls ---------------------------------------------------------------

    def attach(
        self,
        create: local_pb2.CreateKVCache | None = None,
        *,
        geometry: common_pb2.ModelGeometry | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        num_blocks: int = 0,
        ownership: group_pb2.Ownership = group_pb2.OWNERSHIP_UNSPECIFIED,
        timeout: float | None = None,
    ) -> local_pb2.KVCacheInfo:
        """Creates the rank's KV cache, or attaches to the existing one, then
        reserves the regions here and maps every page the sidecar has mapped.

        Give either ``create`` or the keyword fields. ``geometry`` may be left
        out when the sidecar was started with ``--model`` or an explicit
        geometry (it then uses its own); one that is given must equal it.
        ``num_blocks`` 0 lets the sidecar decide (``--num-blocks``).

        Returns:
            The cache's ``KVCacheInfo``: ``num_blocks`` per region (block 0
            is reserved, never allocated), ``block_len`` (bytes of one block
            in one region), ``region_len``, ``num_regions`` (2 per layer,
            K then V, for GQA; 1 per layer for MLA), ``page_size`` (bytes),
            ``heads_per_rank``.

        Raises:
            AlreadyExists: a cache with another geometry, tp rank, tp size,
                num_blocks or ownership exists.
            InvalidArgument: no geometry anywhere, tp_rank >= tp_size, a
                geometry that differs from the sidecar's flags, or this
                client is already attached.
            Unsupported: device memory without a ``device_handler``.
        """
        if create is None:
            create = local_pb2.CreateKVCache(tp_rank=tp_rank, tp_size=tp_size, num_blocks=num_blocks, ownership=ownership)
            if geometry is not None:
                create.geometry.CopyFrom(geometry)
        req = local_pb2.LocalRequest()
        req.create.CopyFrom(create)
        with self._lock:
            if self._info is not None:
                raise errors.InvalidArgument("kvsidecar local client: already attached")
            rep = self._exchange(req, timeout)
            if rep.HasField("error") and rep.error.code != common_pb2.CODE_OK:
                self._drop_fds(rep)
                raise errors.from_proto(rep.error)
            try:
                self._reserve(rep.cache)
            except errors.KVSidecarError:
                self._drop_fds(rep)
                raise
            self._apply(rep)
        return rep.cache

    @property
    def broken(self) -> bool:
        """Whether an earlier call broke the connection (every call now
        raises BrokenConnection: connect again)."""
        return self._broken is not None

    @property
    def info(self) -> local_pb2.KVCacheInfo | None:
        """The attached cache's description (None before :meth:`attach`)."""
        return self._info

    def _mapping(self) -> HostMapping:
        if self._host is None:
            raise errors.InvalidArgument("kvsidecar local client: no host mapping (not attached, or device memory)")
        return self._host

    def region(self, i: int) -> memoryview:
        """Region ``i``'s whole reservation here, ``region_len`` bytes. Only
        mapped pages may be touched (others fault); :meth:`block` checks.

        Raises:
            InvalidArgument: not attached (or device memory), i out of range.
        """
        return self._mapping().region(i)

    @property
    def packing(self) -> Packing:
        """Where blocks sit in every region (the attached cache's block_len
        and page_size).

        Raises:
            InvalidArgument: not attached.
        """
        if self._info is None:
            raise errors.InvalidArgument("kvsidecar local client: not attached")
        return Packing(block_len=self._info.block_len, page_size=self._info.page_size)

    def is_mapped(self, b: int) -> bool:
        """Whether block ``b``'s page is mapped here (every region maps the
        same pages)."""
        return self._host is not None and self._host.is_mapped(b)

    def block(self, region: int, b: int) -> memoryview:
        """Block ``b`` of ``region``: ``block_len`` bytes of this process's
        mapping of the shared page (HND layout: heads_per_rank × block_size ×
        head_dim elements). Valid while the block stays allocated.

        Raises:
            InvalidArgument: not attached, region or block out of range, or
                the page not mapped here (the block is not allocated; call
                :meth:`sync` first when another connection allocated it).
        """
        return self._mapping().block(region, b)

    def alloc(self, n: int, *, timeout: float | None = None) -> list[int]:
        """Allocates ``n`` blocks (ids in every region); the pages they need
        are mapped here before it returns.

        Raises:
            Busy: over the memory limit or out of blocks.
            InvalidArgument: ``n`` outside [1, num_blocks).
        """
        if n < 1 or n > 1 << 31:
            raise errors.InvalidArgument(f"alloc count {n} must be at least 1")
        rep = self._call("alloc", local_pb2.AllocBlocks(count=n), timeout)
        return list(rep.alloc.block_ids)

    def free(self, block_ids: Iterable[int], *, timeout: float | None = None) -> None:
        """Frees blocks; pages the sidecar unmapped are unmapped here before
        it returns.

        Raises:
            InvalidArgument: a block that is not allocated, or is held.
            Busy: a block a load writes into, or held under a lease.
        """
        self._call("free", local_pb2.FreeBlocks(block_ids=list(block_ids)), timeout)

    def available(self, *, timeout: float | None = None) -> local_pb2.AvailableReply:
        """``blocks`` that can still be allocated under the current limit, and
        ``over_limit``: more pages are mapped than the limit allows."""
        return self._call("available", None, timeout).available

    def set_memory_limit(self, limit_bytes: int, strict: bool = False, *, timeout: float | None = None) -> None:
        """Sets the limit on mapped bytes across all regions (0 = none). With
        ``strict`` a limit below what is in use is refused.

        Raises:
            InvalidArgument: outside [one page of every region, the
                reservation], or below use with ``strict``.
        """
        self._call("set_limit", local_pb2.SetMemoryLimit(bytes=limit_bytes, strict=strict), timeout)

    def request_finished(
        self,
        request_id: str,
        block_ids: Sequence[int],
        status: local_pb2.FinishStatus,
        params: params_pb2.KVTransferParams | None = None,
        *,
        timeout: float | None = None,
    ) -> params_pb2.KVTransferParams | None:
        """A prefill request finished (vLLM ``request_finished``). With
        ``params.do_remote_decode`` and ``status`` FINISH_STATUS_LENGTH the
        blocks are held under a lease and the ``kv_transfer_params`` for the
        decode are returned; otherwise the blocks are released at once and
        None is returned. The sidecar takes the blocks over either way
        (under local ownership it frees them itself).

        Raises:
            InvalidArgument: empty request id, a block id out of range.
            Busy: a block a load writes into.
            Unavailable: the sidecar is draining.
        """
        rf = local_pb2.RequestFinished(request_id=request_id, block_ids=list(block_ids), status=status)
        if params is not None:
            rf.params.CopyFrom(params)
        rep = self._call("request_finished", rf, timeout)
        if not rep.request_finished.HasField("params"):
            return None
        return rep.request_finished.params

    def start_load(self, meta: params_pb2.ReqMeta, *, timeout: float | None = None) -> None:
        """Starts importing a request's KV into local blocks (the sidecar's
        ``StartLoad``); the result comes from :meth:`get_finished`.

        Raises:
            InvalidArgument: bad params (the message names the field),
                blocks that are not allocated, TP sizes that do not map.
            Busy: the request id is already loading, or a block is in use.
        """
        self._call("start_load", local_pb2.StartLoad(meta=meta), timeout)

    def get_finished(self, *, timeout: float | None = None) -> local_pb2.GetFinishedReply:
        """What finished since the last call (the sidecar forgets it):
        ``done_sending`` (prefill request ids whose lease ended),
        ``done_recving`` (loads complete), ``failed`` (loads that failed,
        each with its local block ids and error) and ``invalid_block_ids``
        (the union of the failed block ids)."""
        return self._call("get_finished", local_pb2.GetFinished(), timeout).get_finished

    def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        """Stops a load; returns once no READ writes into its blocks. The
        request is then reported failed with CODE_ABORTED. An unknown or
        finished request is not an error."""
        self._call("abort", local_pb2.Abort(request_id=request_id), timeout)

    def stats(self, *, timeout: float | None = None) -> local_pb2.StatsReply:
        """Pool and connector counters (``cache_ready`` False, every other
        field 0, before an engine created the cache). Needs no attach."""
        return self._call("stats", local_pb2.Stats(), timeout).stats

    def sync(self, *, timeout: float | None = None) -> None:
        """Brings this process's mappings up to date and does nothing else."""
        self._call("sync", None, timeout)

    def close(self) -> None:
        """Closes the connection and unmaps every region; views from
        :meth:`region` and :meth:`block` must not be used after. When this
        was the engine's last connection, the sidecar aborts its loads and
        frees its blocks (those under a lease when the lease ends). Closing
        twice does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._host is not None:
                self._host.close()
                self._host = None
            if self.device_mapping is not None and self._info is not None and self._info.device_memory:
                self.device_mapping.close()
            self._info = None
            self._frames.close()


def _not_up_yet(e: errors.Unavailable) -> bool:
    """The sidecar is not running (yet): no socket file, or a stale one
    nobody listens on. Anything else (permissions, a bad path) is final."""
    return isinstance(e.__cause__, (FileNotFoundError, ConnectionRefusedError))


def dial_waiting(
    path: str,
    *,
    engine_id: str,
    tp_rank: int,
    wait_seconds: float = DEFAULT_SIDECAR_WAIT_SECONDS,
    setting: str = "wait_seconds",
    logger: logging.Logger | None = None,
    **client_kwargs: Any,
) -> LocalClient:
    """Connects to the sidecar of ``engine_id``'s rank ``tp_rank`` at
    ``path``, waiting up to ``wait_seconds`` for it when its socket is not
    there yet (an engine started before its sidecar, or while it restarts).

    The wait is logged once (warning) with the socket path, the engine id
    and the rule: the engine id must be a running sidecar's ``--engine-id``
    (and the socket dir its ``--socket-dir``), so start the sidecar first.
    The socket is tried again every 50 ms at first, every second at most.

    Args:
        path: the socket path (:func:`kvsidecar.paths.local_socket_path`).
        engine_id: the engine id the path was made from (for the messages).
        tp_rank: the rank the path was made from (for the messages).
        wait_seconds: how long to wait, >= 0; 0 tries once.
        setting: the name of the setting that gave ``wait_seconds``, named
            in the error after the bound (the vLLM connector passes
            ``kv_connector_extra_config.sidecar_wait_seconds``).
        logger: where the wait is logged; default ``kvsidecar.local``.
        client_kwargs: passed to :class:`LocalClient`.

    Raises:
        InvalidArgument: ``wait_seconds`` negative or not finite.
        Unavailable: no sidecar answered within ``wait_seconds``; the message
            names the path, the engine id, the rule and ``setting``. Other
            connect errors (permissions, say) are raised at once.
    """
    if not (isinstance(wait_seconds, (int, float)) and math.isfinite(wait_seconds) and wait_seconds >= 0):
        raise errors.InvalidArgument(f"{setting} {wait_seconds!r} must be a finite number of seconds >= 0")
    log = logger or _log
    # wallclock: the wait is for another process (the sidecar) to start.
    start = time.monotonic()
    deadline = start + wait_seconds
    pause, waited = 0.05, False
    while True:
        try:
            c = LocalClient(path, **client_kwargs)
        except errors.Unavailable as e:
            if not _not_up_yet(e):
                raise
            now = time.monotonic()
            if now >= deadline:
                raise errors.Unavailable(
                    f"connect {path}: no sidecar of engine {engine_id!r} tp_rank {tp_rank} answered within "
                    f"{wait_seconds:g}s ({e.message}): the engine id must be a running sidecar's --engine-id and the "
                    f"socket dir its --socket-dir; start `kvsidecar serve --engine-id {engine_id} --tp-rank {tp_rank}` "
                    f"before the engine, or raise {setting}"
                ) from e
            if not waited:
                waited = True
                log.warning(
                    "sidecar socket %s is not there yet (%s): waiting up to %gs for the sidecar of engine %r tp_rank %d "
                    "(the engine id must be a running sidecar's --engine-id; start the sidecar first)",
                    path, e.message, wait_seconds, engine_id, tp_rank,
                )
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 1.0)
            continue
        if waited:
            log.info("sidecar socket %s is up after %.1fs: engine %r tp_rank %d attaches",
                     path, time.monotonic() - start, engine_id, tp_rank)
        return c
