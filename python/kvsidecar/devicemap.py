"""What the local API hands an engine when a sidecar's pages are device
memory (``serve --backend cuda``): one CUDA POSIX file descriptor per page,
to import with ``cuMemImportFromShareableHandle`` and map into a virtual
range of the engine's own (docs/engine-integration.md section 3; the Go
client's importer is vmm/cuda's Backend)."""

from __future__ import annotations

import dataclasses

from kvsidecar.v1 import local_pb2

__all__ = ["DeviceMappingDelta"]


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
