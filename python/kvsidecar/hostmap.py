"""The engine's own mapping of a sidecar's host pages, and where blocks sit
in them.

:class:`Packing` is the block-offset rule (Go: ``internal/kvgeom.Packing``,
docs/engine-integration.md section 4). :class:`HostMapping` keeps one
inaccessible reservation per region (``region_len`` bytes) and maps the
sidecar's memfd pages into it as the local API's ``MappingDelta`` says, so a
block's bytes here are the sidecar's (``MAP_SHARED | MAP_FIXED``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import mmap
import os
import threading

from kvsidecar import errors
from kvsidecar.v1 import local_pb2

__all__ = ["HostMapping", "Packing"]

# Linux mmap flags the mmap module does not export (asm-generic/mman*.h).
_PROT_NONE = 0x0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where the blocks of one region sit: blocks of ``block_len`` bytes,
    packed whole into pages of ``page_size`` bytes, never straddling one, so
    block ``b`` starts at ``(b // per_page) * page_size + (b % per_page) *
    block_len`` and a page's tail shorter than a block is padding.
    ``page_size`` 0 means no pages: block ``b`` starts at ``b * block_len``.

    :meth:`check` tells whether it holds blocks; the other methods never
    divide by zero (a Packing that fails it is read as blocks back to back).

    Attributes:
        block_len: bytes of one block of one region, > 0.
        page_size: bytes of one page: 0, or at least ``block_len``.
    """

    block_len: int
    page_size: int

    def check(self) -> None:
        """Returns when this Packing holds blocks.

        Raises:
            GeometryError: block_len not > 0 (fields ``("block_len",)``), or
                larger than a page (``("block_len", "page_size")``), with
                both values and the rule, as Go's ``Packing.Check``.
        """
        if self.block_len <= 0:
            raise errors.GeometryError(f"block_len={self.block_len} must be > 0", fields=("block_len",))
        if self.page_size != 0 and self.block_len > self.page_size:
            raise errors.GeometryError(
                f"block_len={self.block_len} exceeds the page size (page_size={self.page_size}): "
                "blocks never straddle a page",
                fields=("block_len", "page_size"),
            )

    @property
    def blocks_per_page(self) -> int:
        """Whole blocks in one page: 0 when page_size is 0 or check fails."""
        if self.block_len <= 0 or self.page_size < self.block_len:
            return 0
        return self.page_size // self.block_len

    def offset(self, b: int) -> int:
        """Byte offset of block ``b`` inside its region."""
        per = self.blocks_per_page
        if per == 0:
            return b * self.block_len
        return b // per * self.page_size + b % per * self.block_len

    def block_at(self, off: int) -> int:
        """The block holding byte ``off`` of a region; a page's padding
        counts as its last block. 0 when block_len is not positive."""
        per = self.blocks_per_page
        if self.block_len <= 0:
            return 0
        if per == 0:
            return off // self.block_len
        return off // self.page_size * per + min((off % self.page_size) // self.block_len, per - 1)


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
        return int(p)

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


class HostMapping:
    """This process's view of one rank's host pages (``device_memory``
    false).

    Args:
        info: the attached cache's ``KVCacheInfo``.
        name: for messages (the socket path).

    Raises:
        BrokenConnection: ``info`` is not a layout pages can be mapped in
            (page size not a multiple of the OS page, region length not a
            multiple of the page size, no regions, a block larger than a
            page), or the reservation failed.
    """

    def __init__(self, info: local_pb2.KVCacheInfo, name: str) -> None:
        ps, rl, nr, bl = info.page_size, info.region_len, info.num_regions, info.block_len
        self.info, self.name = info, name
        self.packing = Packing(block_len=bl, page_size=ps)
        if ps == 0 or ps % mmap.PAGESIZE or rl == 0 or rl % ps or nr == 0 or bl == 0 or bl > ps:
            raise self._broken(
                f"cache info page_size={ps} region_len={rl} num_regions={nr} block_len={bl} is not a usable layout"
            )
        self._lock = threading.RLock()
        self._bases: list[int] = []
        self._regions: list[memoryview] = []
        self._mapped: list[bytearray] = []
        libc = _get_libc()
        try:
            for _ in range(nr):
                base = libc.map(None, rl, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0,
                                f"reserve {rl} bytes")
                self._bases.append(base)
                self._regions.append(memoryview((ctypes.c_ubyte * rl).from_address(base)).cast("B"))
                self._mapped.append(bytearray(rl // ps))
        except OSError as e:
            self.close()
            raise self._broken(str(e)) from e

    def _broken(self, why: str) -> errors.BrokenConnection:
        return errors.BrokenConnection(f"kvsidecar local client {self.name}: {why}")

    def apply(self, d: local_pb2.MappingDelta, fds: list[int]) -> None:
        """Unmaps ``d.unmapped_pages`` of every region, then maps ``d.map``
        (each a range of ``fds[fd_index]``) at its offset.

        Raises:
            BrokenConnection: a page or mapping outside the reservation, not
                whole pages, an fd index outside ``fds``, a failed mmap.
        """
        libc = _get_libc()
        ps = self.info.page_size
        with self._lock:
            pages = len(self._mapped[0])
            for pg in d.unmapped_pages:
                if pg >= pages:
                    raise self._broken(f"unmapped page {pg} outside [0, {pages})")
                for r, base in enumerate(self._bases):
                    self._prot_none(libc, base + pg * ps, ps, f"region {r} page {pg}")
                    self._mapped[r][pg] = 0
            for m in d.map:
                r, off, n = m.region, m.region_offset, m.len
                if r >= len(self._bases):
                    raise self._broken(f"mapping of region {r} outside [0, {len(self._bases)})")
                rl = self.info.region_len
                if n == 0 or off % ps or n % ps or off + n > rl:
                    raise self._broken(f"mapping [{off}, +{n}) of region {r} is not whole pages of {ps} inside {rl} bytes")
                if m.fd_index >= len(fds):
                    raise self._broken(f"fd_index {m.fd_index} outside the {len(fds)} passed fds")
                try:
                    libc.map(self._bases[r] + off, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
                             fds[m.fd_index], m.fd_offset, f"region {r} [{off}, +{n}) at fd offset {m.fd_offset}")
                except OSError as e:
                    raise self._broken(str(e)) from e
                for pg in range(off // ps, (off + n) // ps):
                    self._mapped[r][pg] = 1

    def _prot_none(self, libc: _Libc, addr: int, n: int, what: str) -> None:
        try:
            libc.map(addr, n, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, 0,
                     what)
        except OSError as e:
            raise self._broken(f"unmap {what}: {e}") from e

    def region(self, i: int) -> memoryview:
        """Region ``i``'s whole reservation, ``region_len`` bytes; only mapped
        pages may be touched (others fault).

        Raises:
            InvalidArgument: ``i`` out of range.
        """
        if not 0 <= i < len(self._regions):
            raise errors.InvalidArgument(f"region {i} outside [0, {len(self._regions)})")
        return self._regions[i]

    def is_mapped(self, b: int) -> bool:
        """Whether block ``b``'s page is mapped here (every region maps the
        same pages)."""
        with self._lock:
            if not self._mapped or not 0 <= b < self.info.num_blocks:
                return False
            return bool(self._mapped[0][self.packing.offset(b) // self.info.page_size])

    def block(self, region: int, b: int) -> memoryview:
        """Block ``b`` of ``region``: ``block_len`` bytes of the shared page.

        Raises:
            InvalidArgument: region or block out of range, or the block's
                page not mapped here.
        """
        with self._lock:
            view = self.region(region)
            if not 0 <= b < self.info.num_blocks:
                raise errors.InvalidArgument(f"block {b} outside [0, {self.info.num_blocks})")
            off = self.packing.offset(b)
            pg = off // self.info.page_size
            if not self._mapped[region][pg]:
                raise errors.InvalidArgument(f"block {b} of region {region}: page {pg} is not mapped in this process")
            return view[off : off + self.info.block_len]

    def close(self) -> None:
        """Unmaps every region. Views handed out (and tensors over them) are
        not released: the caller must not use them after."""
        libc = _get_libc()
        for base in self._bases:
            libc.unmap(base, self.info.region_len)
        self._bases, self._regions, self._mapped = [], [], []
