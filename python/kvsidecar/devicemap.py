"""What the local API hands an engine when a sidecar's pages are device
memory (``serve --backend cuda``): one CUDA POSIX file descriptor per page,
to import with ``cuMemImportFromShareableHandle`` and map into a virtual
range of the engine's own (docs/engine-integration.md section 3; the Go
client's importer is vmm/cuda's Backend), and :class:`CudaDeviceMapping`,
which does that through the CUDA driver. Importing this module loads no
CUDA library; constructing a CudaDeviceMapping does."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Protocol

from kvsidecar import errors
from kvsidecar.v1 import local_pb2

__all__ = ["CudaDeviceMapping", "CudaError", "DeviceMapping", "DeviceMappingDelta"]


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


class DeviceMapping(Protocol):
    """What :class:`kvsidecar.local.LocalClient` needs to keep a sidecar's
    device pages mapped in this process (:class:`CudaDeviceMapping`)."""

    def reserve(self, info: local_pb2.KVCacheInfo) -> None:
        """Reserves address ranges for ``info``'s regions (at attach)."""

    def apply(self, d: DeviceMappingDelta) -> None:
        """Applies one reply's changes (its fds are closed after)."""

    def close(self) -> None:
        """Unmaps everything (when the client closes)."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemAccessDesc(ctypes.Structure):
    # CUmemAccessDesc of vmm/cuda/internal/cudaabi/cuda_abi.h: 12 bytes.
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


# Values of cuda_abi.h (the CUDA Driver API reference, cuda.h 12.x).
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CudaError(errors.Unavailable):
    """A CUDA driver call failed; the message names the call and the
    CUresult."""


class CudaDeviceMapping:
    """Maps a sidecar's device pages into this process through the CUDA
    driver (ctypes over ``libcuda.so.1``, loaded when constructed, never at
    import), as the Go client's importer does (``localapi.DeviceImporter``,
    vmm/cuda's Backend): one device address reservation of ``region_len``
    bytes per region, each page imported from its POSIX fd
    (``cuMemImportFromShareableHandle``), mapped at its offset
    (``cuMemMap``) and made read-write for the device (``cuMemSetAccess``).

    Give it to :class:`kvsidecar.local.LocalClient` as its
    ``device_mapping``: the client reserves at attach and applies every
    reply's changes. Tested against fakecuda (vmm/cuda/cudatest); not yet
    measured on a GPU.

    Args:
        library: the driver to load, a name the dynamic loader finds or a
            path.
        device: the CUDA device ordinal the pages live on.

    Raises:
        CudaError: the driver cannot be loaded or initialised.
    """

    def __init__(self, library: str = "libcuda.so.1", device: int = 0) -> None:
        try:
            self._lib = ctypes.CDLL(library)
        except OSError as e:
            raise CudaError(f"CUDA driver {library}: {e}") from e
        self.device = device
        self._ctx = ctypes.c_void_p()
        self._call("cuInit", 0)
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), device)
        self._dev = dev.value
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self._ctx), self._dev)
        self.info = local_pb2.KVCacheInfo()
        #: Device address of each region's reservation.
        self.bases: list[int] = []
        self._handles: list[list[int]] = []  # [region][page]: 0 = not mapped

    def reserve(self, info: local_pb2.KVCacheInfo) -> None:
        """Reserves one device range of ``region_len`` bytes per region of
        ``info`` (``device_memory`` true: the page size is the device's
        granularity).

        Raises:
            CudaError: a reservation failed (every one made is freed), or
                the regions are not whole pages.
        """
        ps, rl = info.page_size, info.region_len
        if ps == 0 or rl % ps:
            raise CudaError(f"cache info page_size={ps} region_len={rl}: not whole pages")
        self.info = info
        try:
            for _ in range(info.num_regions):
                base = ctypes.c_ulonglong()
                self._call("cuMemAddressReserve", ctypes.byref(base), ctypes.c_size_t(rl), ctypes.c_size_t(ps),
                           ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
                self.bases.append(base.value)
                self._handles.append([0] * (rl // ps))
        except CudaError:
            self.close()
            raise

    def _call(self, name: str, *args: Any) -> None:
        self._lib.cuCtxSetCurrent(self._ctx)
        r = getattr(self._lib, name)(*args)
        if r != 0:
            raise CudaError(f"CUDA {name}: CUresult {r}")

    def apply(self, d: DeviceMappingDelta) -> None:
        """Unmaps ``d.unmapped_pages`` of every region, then imports and maps
        each of ``d.mappings`` (one page per fd) at its offset.

        Raises:
            CudaError: a driver call failed; InvalidArgument: a mapping that
                is not one whole page inside the regions.
        """
        ps = self.info.page_size
        for pg in d.unmapped_pages:
            for r in range(len(self.bases)):
                self._unmap(r, pg)
        for m, fd in d.mappings:
            if m.region >= len(self.bases) or m.len != ps or m.region_offset % ps or m.fd_offset \
                    or m.region_offset + ps > self.info.region_len:
                raise errors.InvalidArgument(
                    f"device mapping [{m.region_offset}, +{m.len}) of region {m.region} at fd offset {m.fd_offset}: "
                    f"one descriptor maps one whole page of {ps} bytes at offset 0 of its fd")
            pg = m.region_offset // ps
            self._unmap(m.region, pg)
            h = ctypes.c_ulonglong()
            self._call("cuMemImportFromShareableHandle", ctypes.byref(h), ctypes.c_void_p(fd),
                       _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            addr = self.bases[m.region] + m.region_offset
            try:
                self._call("cuMemMap", ctypes.c_ulonglong(addr), ctypes.c_size_t(ps), ctypes.c_size_t(0), h,
                           ctypes.c_ulonglong(0))
            except CudaError:
                self._lib.cuMemRelease(h)
                raise
            access = _MemAccessDesc(_MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, self._dev),
                                    _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            self._handles[m.region][pg] = h.value
            self._call("cuMemSetAccess", ctypes.c_ulonglong(addr), ctypes.c_size_t(ps), ctypes.byref(access),
                       ctypes.c_size_t(1))

    def _unmap(self, r: int, pg: int) -> None:
        h = self._handles[r][pg]
        if h:
            self._handles[r][pg] = 0
            self._call("cuMemUnmap", ctypes.c_ulonglong(self.bases[r] + pg * self.info.page_size),
                       ctypes.c_size_t(self.info.page_size))
            self._call("cuMemRelease", ctypes.c_ulonglong(h))

    def is_mapped(self, region: int, off: int) -> bool:
        """Whether byte ``off`` of ``region`` is on a page mapped here."""
        return bool(self._handles[region][off // self.info.page_size])

    def read(self, region: int, off: int, n: int) -> bytes:
        """``n`` bytes at ``off`` of ``region``, copied to the host
        (``cuMemcpyDtoH``); the page must be mapped here."""
        buf = ctypes.create_string_buffer(n)
        self._call("cuMemcpyDtoH_v2", buf, ctypes.c_ulonglong(self.bases[region] + off), ctypes.c_size_t(n))
        return buf.raw

    def write(self, region: int, off: int, data: bytes) -> None:
        """Copies ``data`` to ``off`` of ``region`` (``cuMemcpyHtoD``)."""
        self._call("cuMemcpyHtoD_v2", ctypes.c_ulonglong(self.bases[region] + off), data, ctypes.c_size_t(len(data)))

    def close(self) -> None:
        """Unmaps and releases every page, frees the reservations and the
        primary context. Addresses handed out must not be used after."""
        for r, base in enumerate(self.bases):
            for pg in range(len(self._handles[r])):
                self._unmap(r, pg)
            self._lib.cuMemAddressFree(ctypes.c_ulonglong(base), ctypes.c_size_t(self.info.region_len))
        self.bases, self._handles = [], []
        if self._ctx:
            self._lib.cuDevicePrimaryCtxRelease_v2(self._dev)
            self._ctx = ctypes.c_void_p()
