"""Client of a kvsidecar's local API: the engine's side of the unix socket.

One ``kvsidecar serve`` runs beside each tensor-parallel rank. Its engine
(each worker process, and an engine's scheduler where it needs to) connects
to the rank's socket, ``local_socket_path(socket_dir, engine_id, tp_rank)``,
and makes the calls of ``proto/kvsidecar/v1/local.proto``: create/attach the
KV cache, alloc/free blocks, available, set the memory limit,
RequestFinished, StartLoad, GetFinished, Abort, Stats, Sync.

Wire format: every request and reply is one protobuf message preceded by its
size as a varint (Go's ``protodelim``; the C++ and Java libraries call it
"delimited"). Replies to a connection that attached the cache carry a
``MappingDelta``: the pages the sidecar mapped or unmapped since the
previous reply, with one file descriptor per mapping passed beside the
frame (SCM_RIGHTS). :class:`LocalClient` applies it to a reservation of its
own, so :meth:`LocalClient.block` addresses the same physical memory as the
sidecar (host backend: memfd ranges mapped ``MAP_SHARED|MAP_FIXED``). When
the pages are device memory (``--backend cuda``), the client maps nothing:
it hands each delta with its fds to a ``device_handler`` the engine gives,
which imports them with ``cuMemImportFromShareableHandle``.

The smallest use::

    from kvsidecar.local import LocalClient, local_socket_path
    from kvsidecar.v1 import local_pb2

    c = LocalClient(local_socket_path("/run/kvsidecar", "prefill-a", 0))
    info = c.attach(local_pb2.CreateKVCache(tp_rank=0, tp_size=2))
    ids = c.alloc(4)
    c.block(0, ids[0])[:4] = b"\\x01\\x02\\x03\\x04"  # region 0 (layer 0 K)
    c.free(ids)
    c.close()
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import dataclasses
import hashlib
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from kvsidecar import errors
from kvsidecar.v1 import common_pb2, group_pb2, local_pb2, params_pb2

__all__ = [
    "DEFAULT_CALL_TIMEOUT_SECONDS",
    "DEFAULT_MAX_REPLY_BYTES",
    "DEFAULT_MAX_REQUEST_BYTES",
    "MAX_TP_SIZE",
    "DeviceMappingDelta",
    "LocalClient",
    "default_socket_dir",
    "local_socket_path",
    "merge_exports",
    "params_from_json",
    "req_meta",
    "params_to_json",
]

#: Bounds one request frame; the sidecar's default limit (1 MiB: about
#: 200,000 block ids). A larger request is refused here before it is sent.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
#: Bounds one reply frame (64 MiB), as the Go client does.
DEFAULT_MAX_REPLY_BYTES = 64 << 20
#: Seconds one call may take, from sending the request to the whole reply.
DEFAULT_CALL_TIMEOUT_SECONDS = 30.0
#: The largest tp_size anywhere (tp_size in kv_transfer_params, TP groups).
MAX_TP_SIZE = 1024

# sun_path is 108 bytes with its NUL.
_MAX_SOCKET_PATH = 107
# Descriptors queued for frames not yet read; a sidecar that sends more is
# cut off (the Go client's limit, internal/fdpass.MaxQueued).
_MAX_QUEUED_FDS = 1 << 16
# One recvmsg takes at most this many descriptors; the sidecar sends at most
# 250 per sendmsg (SCM_MAX_FD is 253).
_MAX_FDS_PER_RECV = 256
_RECV_BYTES = 1 << 16

# Linux mmap flags the mmap module does not export (asm-generic/mman*.h).
_PROT_NONE = 0x0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000


def default_socket_dir() -> str:
    """The socket directory ``kvsidecar serve`` uses without ``--socket-dir``:
    ``$XDG_RUNTIME_DIR/kvsidecar`` when that variable is an absolute path,
    else ``/tmp/kvsidecar-<uid>``."""
    d = os.environ.get("XDG_RUNTIME_DIR", "")
    if d and os.path.isabs(d):
        return os.path.join(d, "kvsidecar")
    return os.path.join("/tmp", f"kvsidecar-{os.getuid()}")


def _clean_dir(d: bytes) -> bytes:
    # Go's filepath.Clean: normpath, and a leading "//" is one "/".
    c = os.path.normpath(d)
    if c.startswith(b"//"):
        c = b"/" + c.lstrip(b"/")
    return c


def local_socket_path(socket_dir: str, engine_id: str, tp_rank: int) -> str:
    """The local API socket of rank ``tp_rank`` of engine ``engine_id``:
    ``<socket_dir>/kvsidecar-<id>-tp<rank>-api.sock``, the path ``kvsidecar
    serve`` listens on (Go: ``localapi.SocketPath``, same rule).

    ``<id>`` is ``engine_id`` when it holds only ``[A-Za-z0-9._-]`` and the
    path fits in 107 bytes; otherwise every other byte of its UTF-8 form
    becomes ``_``, it is cut to fit, and ``-`` plus the first 12 hex digits
    of its SHA-256 are appended, so distinct ids keep distinct paths.

    Raises:
        InvalidArgument: ``socket_dir`` not absolute or too long, an empty
            engine id, ``tp_rank`` outside [0, 1024).
    """
    if not os.path.isabs(socket_dir):
        raise errors.InvalidArgument(f"socket dir {socket_dir!r} must be an absolute path")
    if not engine_id:
        raise errors.InvalidArgument("engine id is empty")
    if not 0 <= tp_rank < MAX_TP_SIZE:
        raise errors.InvalidArgument(f"tp_rank {tp_rank} must be in [0, {MAX_TP_SIZE})")
    prefix = _clean_dir(os.fsencode(socket_dir)) + b"/kvsidecar-"
    suffix = b"-tp%d-api.sock" % tp_rank
    room = _MAX_SOCKET_PATH - len(prefix) - len(suffix)
    raw = engine_id.encode("utf-8", "surrogateescape")
    ok = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
    ident = bytes(c if c in ok else ord("_") for c in raw)
    if ident == raw and len(ident) <= room:
        return os.fsdecode(prefix + ident + suffix)
    tag = b"-" + hashlib.sha256(raw).hexdigest()[:12].encode()
    keep = room - len(tag)
    if keep < 1:
        raise errors.InvalidArgument(
            f"socket dir {socket_dir!r} is too long for a unix socket path of at most {_MAX_SOCKET_PATH} bytes"
        )
    return os.fsdecode(prefix + ident[:keep] + tag + suffix)


def params_to_json(p: params_pb2.KVTransferParams) -> dict[str, Any]:
    """``kv_transfer_params`` as the JSON object engines and proxies carry:
    proto field names (vLLM NixlConnector's plus kvsidecar's), fields at
    their default left out, 64-bit integers (``remote_incarnation``,
    ``lease_expires_unix_ms``) as decimal strings, ``capability`` as base64
    (protobuf's canonical JSON mapping, as Go's MarshalKVTransferParams)."""
    return json_format.MessageToDict(p, preserving_proto_field_name=True)


def params_from_json(d: dict[str, Any]) -> params_pb2.KVTransferParams:
    """Parses a ``kv_transfer_params`` object; fields kvsidecar does not know
    (vLLM adds its own) are ignored.

    Raises:
        InvalidArgument: a known field with a value of the wrong type.
    """
    p = params_pb2.KVTransferParams()
    try:
        json_format.ParseDict(d, p, ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise errors.InvalidArgument(f"kv_transfer_params: {e}") from e
    return p


def merge_exports(parts: Sequence[params_pb2.KVTransferParams]) -> params_pb2.KVTransferParams:
    """The decode's ``kv_transfer_params`` from every prefill rank's
    RequestFinished reply (Go: ``connector.MergeExports``, same rule).

    Each rank's reply names that rank's export (``rank_exports``, one
    entry); the merged params are rank 0's with every rank's entry, an
    entry's ``block_ids`` kept only when they differ from
    ``remote_block_ids``, and the earliest lease expiry. A sidecar whose
    params carry no ``rank_exports`` (every rank serves
    ``remote_block_ids``) gets rank 0's part (the first) unchanged.

    Raises:
        InvalidArgument: no part; parts naming another request, engine or
            TP size, another number of blocks, or the same rank twice.
    """
    if not parts:
        raise errors.InvalidArgument("merge_exports: needs at least one part")
    if not any(p.rank_exports for p in parts):
        return parts[0]
    base = next((p for p in parts if any(e.tp_rank == 0 for e in p.rank_exports)), parts[0])
    out = params_pb2.KVTransferParams()
    out.CopyFrom(base)
    del out.rank_exports[:]
    seen: dict[int, int] = {}
    exports = []
    for i, p in enumerate(parts):
        for field, v, w in (("remote_request_id", p.remote_request_id, base.remote_request_id),
                            ("remote_engine_id", p.remote_engine_id, base.remote_engine_id),
                            ("tp_size", p.tp_size, base.tp_size),
                            ("remote_block_ids", len(p.remote_block_ids), len(base.remote_block_ids))):
            if v != w:
                raise errors.InvalidArgument(f"merge_exports: part {i}: {field}={v!r} differs from {w!r}")
        if p.lease_expires_unix_ms and (not out.lease_expires_unix_ms or p.lease_expires_unix_ms < out.lease_expires_unix_ms):
            out.lease_expires_unix_ms = p.lease_expires_unix_ms
        for e in p.rank_exports:
            if e.tp_rank in seen:
                raise errors.InvalidArgument(
                    f"merge_exports: part {i}: rank_exports: rank {e.tp_rank}: part {seen[e.tp_rank]} exports the same rank"
                )
            seen[e.tp_rank] = i
            m = type(e)()
            m.CopyFrom(e)
            ids = list(e.block_ids) or list(p.remote_block_ids)
            del m.block_ids[:]
            if ids != list(out.remote_block_ids):
                m.block_ids.extend(ids)
            exports.append(m)
    out.rank_exports.extend(sorted(exports, key=lambda e: e.tp_rank))
    return out


def req_meta(request_id: str, local_block_ids: Sequence[int], params: params_pb2.KVTransferParams,
             remote_hit_blocks: int = 0, local_surplus_blocks: int = 0) -> params_pb2.ReqMeta:
    """A StartLoad request: remote block ``remote_hit_blocks + i`` lands in
    ``local_block_ids[i]``; the first ``remote_hit_blocks`` remote blocks are
    the decode's prefix hit (not read) and the last ``local_surplus_blocks``
    local blocks its own (never written)."""
    m = params_pb2.ReqMeta(request_id=request_id, local_block_ids=list(local_block_ids), params=params)
    if local_block_ids:
        m.remote_hit_blocks = remote_hit_blocks
    m.local_surplus_blocks = local_surplus_blocks
    return m


@dataclasses.dataclass(frozen=True)
class DeviceMappingDelta:
    """What a ``device_handler`` gets when the sidecar's pages are device
    memory (CUDA POSIX file descriptors, one per page).

    Attributes:
        mappings: ``(mapping, fd)`` pairs: bytes ``[fd_offset, fd_offset +
            len)`` of the allocation behind ``fd`` back bytes
            ``[region_offset, region_offset + len)`` of region
            ``mapping.region``; import ``fd`` with
            ``cuMemImportFromShareableHandle`` (handle type
            ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``) and map it there.
            The fds are closed by the client when the handler returns.
        unmapped_pages: page indices (of every region) the engine must unmap
            before it touches them again.
    """

    mappings: tuple[tuple[local_pb2.PageMapping, int], ...]
    unmapped_pages: tuple[int, ...]


class _Libc:
    """mmap/munmap through ctypes: the mmap module cannot map at a fixed
    address, which the shared pages need (they must land at their offset in
    the reservation)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self.mmap = lib.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.munmap = lib.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def map(self, addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int, what: str) -> int:
        p = self.mmap(addr, length, prot, flags, fd, offset)
        if p is None or p == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap {what}: {os.strerror(err)}")
        return p

    def unmap(self, addr: int, length: int) -> None:
        if self.munmap(addr, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap: {os.strerror(err)}")


_libc: _Libc | None = None


def _get_libc() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


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
        path: the socket path (see :func:`local_socket_path`).
        timeout: seconds per call, and for connecting. Default 30.
        max_reply_bytes: bound of one reply frame. Default 64 MiB.
        device_handler: called with a :class:`DeviceMappingDelta` for every
            reply that changes the mappings when the sidecar's pages are
            device memory. Without one, attaching to such a sidecar raises
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
    ) -> None:
        if timeout <= 0:
            raise errors.InvalidArgument(f"timeout {timeout} must be positive seconds")
        if max_reply_bytes < 64:
            raise errors.InvalidArgument(f"max_reply_bytes {max_reply_bytes} must be at least 64")
        self.path = path
        self.timeout = timeout
        self._max_reply = max_reply_bytes
        self._device_handler = device_handler
        self._lock = threading.RLock()
        self._map_lock = threading.RLock()
        self._next_id = 0
        self._broken: str | None = None
        self._buf = bytearray()
        self._fds: collections.deque[int] = collections.deque()
        self._info: local_pb2.KVCacheInfo | None = None
        self._bases: list[int] = []
        self._regions: list[memoryview] = []
        self._mapped: list[bytearray] = []
        self._region_len = 0
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except TimeoutError as e:
            self._sock.close()
            raise errors.Timeout(f"connect {path}: no answer within {timeout}s") from e
        except OSError as e:
            self._sock.close()
            raise errors.Unavailable(f"connect {path}: {e.strerror or e}") from e

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- framing -------------------------------------------------------------

    def _fail(self, why: str, cls: type[errors.KVSidecarError] = errors.BrokenConnection) -> errors.KVSidecarError:
        self._broken = why
        return cls(f"kvsidecar local client {self.path}: {why}")

    def _recv_more(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        self._sock.settimeout(left)
        data, fds, flags, _ = socket.recv_fds(self._sock, _RECV_BYTES, _MAX_FDS_PER_RECV)
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise self._fail("control message truncated, file descriptors lost")
        if len(self._fds) + len(fds) > _MAX_QUEUED_FDS:
            for fd in fds:
                os.close(fd)
            raise self._fail(f"more than {_MAX_QUEUED_FDS} file descriptors queued")
        self._fds.extend(fds)
        if not data:
            raise self._fail("the sidecar closed the connection")
        self._buf += data

    def _read_frame(self, deadline: float) -> bytes:
        while True:
            size, shift, i = 0, 0, 0
            complete = False
            while i < len(self._buf) and i < 10:
                b = self._buf[i]
                size |= (b & 0x7F) << shift
                shift += 7
                i += 1
                if not b & 0x80:
                    complete = True
                    break
            if not complete and i >= 10:
                raise self._fail("bad frame length (varint longer than 10 bytes)")
            if complete:
                if size > self._max_reply:
                    raise self._fail(f"reply frame of {size} bytes exceeds the limit of {self._max_reply} bytes")
                if len(self._buf) >= i + size:
                    frame = bytes(self._buf[i : i + size])
                    del self._buf[: i + size]
                    return frame
            self._recv_more(deadline)

    def _take_fds(self, n: int) -> list[int]:
        if n > len(self._fds):
            have = len(self._fds)
            raise self._fail(f"file descriptors missing: the reply declares {n}, {have} arrived")
        return [self._fds.popleft() for _ in range(n)]

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
            self._sock.settimeout(t)
            self._sock.sendall(_varint(len(body)) + body)
            frame = self._read_frame(deadline)
        except (socket.timeout, TimeoutError) as e:
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
            raise errors.error_for_code(rep.error.code, f"kvsidecar: {rep.error.message}")
        return rep

    # -- mappings ------------------------------------------------------------

    def _apply(self, rep: local_pb2.LocalReply) -> None:
        """Applies rep's MappingDelta; its fds are closed after."""
        if not rep.HasField("mappings"):
            return
        d = rep.mappings
        fds = self._take_fds(d.num_fds)
        try:
            with self._map_lock:
                if self._info is None:
                    raise self._fail("mappings before attach")
                if self._info.device_memory:
                    self._apply_device(d, fds)
                else:
                    self._apply_host(d, fds)
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

    def _apply_host(self, d: local_pb2.MappingDelta, fds: list[int]) -> None:
        libc = _get_libc()
        ps = self._info.page_size
        pages = len(self._mapped[0])
        for pg in d.unmapped_pages:
            if pg >= pages:
                raise self._fail(f"unmapped page {pg} outside [0, {pages})")
            for r, base in enumerate(self._bases):
                self._prot_none(libc, base + pg * ps, ps, f"region {r} page {pg}")
                self._mapped[r][pg] = 0
        for m in d.map:
            r, off, n = m.region, m.region_offset, m.len
            if r >= len(self._bases):
                raise self._fail(f"mapping of region {r} outside [0, {len(self._bases)})")
            rl = self._info.region_len
            if n == 0 or off % ps or n % ps or off + n > rl:
                raise self._fail(
                    f"mapping [{off}, +{n}) of region {r} is not whole pages of {ps} inside {rl} bytes"
                )
            if m.fd_index >= len(fds):
                raise self._fail(f"fd_index {m.fd_index} outside the {len(fds)} passed fds")
            try:
                libc.map(
                    self._bases[r] + off,
                    n,
                    mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_SHARED | _MAP_FIXED,
                    fds[m.fd_index],
                    m.fd_offset,
                    f"region {r} [{off}, +{n}) at fd offset {m.fd_offset}",
                )
            except OSError as e:
                raise self._fail(str(e)) from e
            for pg in range(off // ps, (off + n) // ps):
                self._mapped[r][pg] = 1

    def _prot_none(self, libc: _Libc, addr: int, n: int, what: str) -> None:
        try:
            libc.map(
                addr,
                n,
                _PROT_NONE,
                mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE,
                -1,
                0,
                what,
            )
        except OSError as e:
            raise self._fail(f"unmap {what}: {e}") from e

    def _reserve(self, info: local_pb2.KVCacheInfo) -> None:
        ps, rl, nr, bl = info.page_size, info.region_len, info.num_regions, info.block_len
        if info.device_memory:
            if self._device_handler is None:
                raise errors.Unsupported(
                    "kvsidecar local client: the sidecar's pages are device memory; pass device_handler "
                    "to import their fds with cuMemImportFromShareableHandle"
                )
            self._info = info
            return
        if ps == 0 or ps % mmap.PAGESIZE or rl == 0 or rl % ps or nr == 0 or bl == 0 or bl > ps:
            raise self._fail(
                f"cache info page_size={ps} region_len={rl} num_regions={nr} block_len={bl} is not a usable layout"
            )
        libc = _get_libc()
        self._region_len = rl
        try:
            for _ in range(nr):
                base = libc.map(
                    None, rl, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0,
                    f"reserve {rl} bytes",
                )
                self._bases.append(base)
                self._regions.append(memoryview((ctypes.c_ubyte * rl).from_address(base)).cast("B"))
                self._mapped.append(bytearray(rl // ps))
        except OSError as e:
            self._unreserve()
            raise self._fail(str(e)) from e
        self._info = info

    def _unreserve(self) -> None:
        # Views handed out (and tensors over them) are not released: they
        # may still be referenced; the caller must not use them after close.
        libc = _get_libc()
        for base in self._bases:
            libc.unmap(base, self._region_len)
        self._bases, self._regions, self._mapped = [], [], []
        self._info = None

    # -- calls ---------------------------------------------------------------

    def attach(
        self,
        create: local_pb2.CreateKVCache | None = None,
        *,
        geometry: common_pb2.ModelGeometry | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        num_blocks: int = 0,
        ownership: int = group_pb2.OWNERSHIP_UNSPECIFIED,
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
                for fd in self._take_fds(rep.mappings.num_fds if rep.HasField("mappings") else 0):
                    os.close(fd)
                raise errors.error_for_code(rep.error.code, f"kvsidecar: {rep.error.message}")
            try:
                with self._map_lock:
                    self._reserve(rep.cache)
            except errors.KVSidecarError:
                for fd in self._take_fds(rep.mappings.num_fds if rep.HasField("mappings") else 0):
                    os.close(fd)
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

    def region(self, i: int) -> memoryview:
        """Region ``i``'s whole reservation here, ``region_len`` bytes. Only
        mapped pages may be touched (others fault); :meth:`block` checks.

        Raises:
            InvalidArgument: not attached (or device memory), i out of range.
        """
        with self._map_lock:
            if not self._regions:
                raise errors.InvalidArgument("kvsidecar local client: no host mapping (not attached, or device memory)")
            if not 0 <= i < len(self._regions):
                raise errors.InvalidArgument(f"region {i} outside [0, {len(self._regions)})")
            return self._regions[i]

    def block_offset(self, b: int) -> int:
        """Byte offset of block ``b`` in every region: blocks never straddle
        a page, so it is ``(b // per_page) * page_size + (b % per_page) *
        block_len`` with ``per_page = page_size // block_len``."""
        info = self._info
        if info is None:
            raise errors.InvalidArgument("kvsidecar local client: not attached")
        per_page = info.page_size // info.block_len
        return (b // per_page) * info.page_size + (b % per_page) * info.block_len

    def is_mapped(self, b: int) -> bool:
        """Whether block ``b``'s page is mapped here (every region maps the
        same pages)."""
        with self._map_lock:
            if not self._mapped or not 0 <= b < self._info.num_blocks:
                return False
            return bool(self._mapped[0][self.block_offset(b) // self._info.page_size])

    def block(self, region: int, b: int) -> memoryview:
        """Block ``b`` of ``region``: ``block_len`` bytes of this process's
        mapping of the shared page (HND layout: heads_per_rank × block_size ×
        head_dim elements). Valid while the block stays allocated.

        Raises:
            InvalidArgument: not attached, region or block out of range, or
                the page not mapped here (the block is not allocated; call
                :meth:`sync` first when another connection allocated it).
        """
        with self._map_lock:
            info = self._info
            if info is None or not self._regions:
                raise errors.InvalidArgument("kvsidecar local client: no host mapping (not attached, or device memory)")
            if not 0 <= region < len(self._regions):
                raise errors.InvalidArgument(f"region {region} outside [0, {len(self._regions)})")
            if not 0 <= b < info.num_blocks:
                raise errors.InvalidArgument(f"block {b} outside [0, {info.num_blocks})")
            off = self.block_offset(b)
            pg = off // info.page_size
            if not self._mapped[region][pg]:
                raise errors.InvalidArgument(f"block {b} of region {region}: page {pg} is not mapped in this process")
            return self._regions[region][off : off + info.block_len]

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

    def available(self, *, timeout: float | None = None) -> int:
        """Blocks that can still be allocated under the current limit."""
        return self._call("available", None, timeout).available.blocks

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
        status: int,
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
            with self._map_lock:
                if self._bases:
                    self._unreserve()
                self._info = None
            while self._fds:
                os.close(self._fds.popleft())
            self._sock.close()
