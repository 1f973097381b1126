"""Size-delimited protobuf frames over a unix socket, with the file
descriptors that arrive beside them (Go: ``internal/wire`` and
``internal/fdpass``).

Every frame is a message's bytes preceded by their length as a protobuf
varint (Go's ``protodelim``; "delimited" in C++ and Java). Descriptors come
with ``SCM_RIGHTS`` and may be split over several reads; they are queued in
arrival order and taken by count once a frame says how many are its own.
"""

from __future__ import annotations

import collections
import os
import socket
import time

from kvsidecar import errors
from kvsidecar.limits import MAX_FDS_PER_SENDMSG, MAX_QUEUED_FDS

__all__ = ["MAX_FDS_PER_RECV", "FrameSocket", "varint"]

#: Descriptors one recvmsg takes at most: what one sendmsg of the sidecar
#: carries (:data:`kvsidecar.limits.MAX_FDS_PER_SENDMSG`; the kernel stops a
#: read at the end of a message that brought descriptors), and spare room.
MAX_FDS_PER_RECV = MAX_FDS_PER_SENDMSG + 6
_RECV_BYTES = 1 << 16
# A varint of a 64-bit length is at most 10 bytes.
_MAX_VARINT_BYTES = 10


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class FrameSocket:
    """Frames and descriptors over one connected stream socket.

    Every failure is a :class:`kvsidecar.errors.BrokenConnection` (the
    stream cannot be read further) whose message starts with ``name``,
    except a deadline, which raises :class:`TimeoutError`.

    Args:
        sock: a connected ``AF_UNIX`` stream socket; owned from here on.
        name: for messages (the socket path).
        max_frame_bytes: the largest frame read.
    """

    def __init__(self, sock: socket.socket, name: str, max_frame_bytes: int) -> None:
        self.sock, self.name, self.max_frame_bytes = sock, name, max_frame_bytes
        self._buf = bytearray()
        self._fds: collections.deque[int] = collections.deque()

    def _broken(self, why: str) -> errors.BrokenConnection:
        return errors.BrokenConnection(f"kvsidecar local client {self.name}: {why}")

    def send(self, body: bytes, timeout: float) -> None:
        """Writes one frame within ``timeout`` seconds.

        Raises:
            TimeoutError: not written in time.
            OSError: the socket failed.
        """
        self.sock.settimeout(timeout)
        self.sock.sendall(varint(len(body)) + body)

    def _recv_more(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError()
        self.sock.settimeout(left)
        data, fds, flags, _ = socket.recv_fds(self.sock, _RECV_BYTES, MAX_FDS_PER_RECV)
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise self._broken("control message truncated, file descriptors lost")
        if len(self._fds) + len(fds) > MAX_QUEUED_FDS:
            for fd in fds:
                os.close(fd)
            raise self._broken(f"more than {MAX_QUEUED_FDS} file descriptors queued")
        self._fds.extend(fds)
        if not data:
            raise self._broken("the sidecar closed the connection")
        self._buf += data

    def read_frame(self, deadline: float) -> bytes:
        """The next frame's bytes, reading until ``deadline`` (monotonic
        seconds).

        Raises:
            BrokenConnection: a bad length, a frame over the limit, the
                peer closed, descriptors lost.
            TimeoutError: no whole frame by the deadline.
        """
        while True:
            size, shift, i = 0, 0, 0
            complete = False
            while i < len(self._buf) and i < _MAX_VARINT_BYTES:
                b = self._buf[i]
                size |= (b & 0x7F) << shift
                shift += 7
                i += 1
                if not b & 0x80:
                    complete = True
                    break
            if not complete and i >= _MAX_VARINT_BYTES:
                raise self._broken(f"bad frame length (varint longer than {_MAX_VARINT_BYTES} bytes)")
            if complete:
                if size > self.max_frame_bytes:
                    raise self._broken(f"reply frame of {size} bytes exceeds the limit of {self.max_frame_bytes} bytes")
                if len(self._buf) >= i + size:
                    frame = bytes(self._buf[i : i + size])
                    del self._buf[: i + size]
                    return frame
            self._recv_more(deadline)

    def take_fds(self, n: int) -> list[int]:
        """The next ``n`` queued descriptors, in arrival order (the caller
        owns and closes them).

        Raises:
            BrokenConnection: fewer than ``n`` arrived with the frame.
        """
        if n > len(self._fds):
            raise self._broken(f"file descriptors missing: the reply declares {n}, {len(self._fds)} arrived")
        return [self._fds.popleft() for _ in range(n)]

    def close(self) -> None:
        """Closes the queued descriptors and the socket."""
        while self._fds:
            os.close(self._fds.popleft())
        self.sock.close()
