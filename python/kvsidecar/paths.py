"""The local API's socket path: where ``kvsidecar serve`` listens for the
engine of one TP rank (Go: ``localapi.SocketPath`` and ``internal/unixsock``,
the same rule; docs/engine-integration.md section 2)."""

from __future__ import annotations

import hashlib
import os

from kvsidecar import errors, reasons
from kvsidecar.limits import MAX_SOCKET_PATH_BYTES, MAX_TP_SIZE, SOCKET_ID_HASH_DIGITS

__all__ = ["default_socket_dir", "local_socket_path"]

# The bytes an engine id may keep in a socket path.
_ALLOWED = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


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
    path fits in :data:`~kvsidecar.limits.MAX_SOCKET_PATH_BYTES` (107)
    bytes; otherwise every other byte of its UTF-8 form becomes ``_``, it is
    cut to fit, and ``-`` plus the first 12 hex digits of its SHA-256 are
    appended, so distinct ids keep distinct paths. testdata/engine_vectors.json
    holds the cases both languages are tested against.

    Raises:
        InvalidArgument: ``tp_rank`` outside [0, :data:`~kvsidecar.limits.MAX_TP_SIZE`)
            (no reason); with reason ``SOCKET_PATH_INVALID``: ``socket_dir``
            not absolute or too long, an empty engine id.
    """
    if not 0 <= tp_rank < MAX_TP_SIZE:
        raise errors.InvalidArgument(f"tp_rank {tp_rank} must be in [0, {MAX_TP_SIZE})")

    def invalid(why: str) -> errors.InvalidArgument:
        return errors.InvalidArgument(f"invalid socket path: {why}", reason=reasons.SOCKET_PATH_INVALID)

    if not os.path.isabs(socket_dir):
        raise invalid(f"socket dir {socket_dir!r} must be an absolute path")
    if not engine_id:
        raise invalid("engine id is empty")
    prefix = _clean_dir(os.fsencode(socket_dir)) + b"/kvsidecar-"
    suffix = b"-tp%d-api.sock" % tp_rank
    room = MAX_SOCKET_PATH_BYTES - len(prefix) - len(suffix)
    raw = engine_id.encode("utf-8", "surrogateescape")
    ident = bytes(c if c in _ALLOWED else ord("_") for c in raw)
    if ident == raw and len(ident) <= room:
        return os.fsdecode(prefix + ident + suffix)
    tag = b"-" + hashlib.sha256(raw).hexdigest()[:SOCKET_ID_HASH_DIGITS].encode()
    keep = room - len(tag)
    if keep < 1:
        raise invalid(f"socket dir {socket_dir!r} is too long for a unix socket path of at most "
                      f"{MAX_SOCKET_PATH_BYTES} bytes")
    return os.fsdecode(prefix + ident[:keep] + tag + suffix)
