"""Torch over a sidecar's blocks: a region as a tensor over this process's
mapping (:func:`region_tensor`, which zero copy builds vLLM's KV tensors on),
and the staging copies between an engine's KV tensors and a sidecar's blocks.

The only module of the package that imports torch (lazily, on first use).

The sidecar holds a rank's KV as regions of blocks (docs/engine-integration.md
section 4): in its layout HND region ``2l`` holds K and region ``2l + 1``
holds V of layer ``l``, one block of one region ``[heads_per_rank,
block_size, head_size]`` elements, ``block_len`` bytes; in the compound
layouts region ``l`` holds both, a block ``[heads_per_rank, 2, block_size,
head_size]`` (H2ND) or ``[heads_per_rank, block_size, 2, head_size]`` (HN2D). vLLM keeps one
tensor per layer whose layout its attention backend fixes; a
:class:`LayerLayout` names how K and V sit in it, and :class:`Staging`
copies blocks both ways through that layout, on the tensor's device.

Layouts, as vLLM 0.32.0 (upstream tag v0.32.0) reads them. Every per-layer
tensor is the logical ``[B, H, N, C]`` view of vLLM's allocation
(``vllm/v1/kv_cache_interface.py``, ``create_kv_cache_views``: B blocks, H
KV heads of this rank, N tokens per kernel block, C = 2 * head_size
elements), with the physical stride order of the resolved
``KVCacheLayout``:

- ``CPU_ATTN`` (``vllm/v1/attention/backends/cpu_attn.py``): the backend
  supports only ``LBHNC`` and reinterprets each ``(block, head)`` run of
  ``N * C`` elements as ``[2N, head_size]``: rows ``[0, N)`` are K, rows
  ``[N, 2N)`` are V (``kv_cache.view(B, H, 2N, -1).chunk(2, dim=2)``).
- ``FLASH_ATTN`` and ``FLASHINFER`` (``flash_attn.py``, ``flashinfer.py``):
  K is ``C[:head_size]`` and V is ``C[head_size:]`` of every token, in any
  of the layouts those backends accept (torch indexing follows the strides).
  FlashInfer's NVFP4 cache packs K and V as head groups instead: refused.

When vLLM splits a block into kernel blocks (``kernel_block_size`` smaller
than ``block_size``), dim 0 holds ``B * ratio`` kernel blocks
(``group_kernel_blocks``); a sidecar block then holds the ratio kernel blocks
of one vLLM block in token order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kvsidecar import errors
from kvsidecar.hostmap import Packing
from kvsidecar.v1 import common_pb2, local_pb2

__all__ = ["KNOWN_LAYOUTS", "LayerLayout", "Staging", "layer_layout", "region_tensor"]

#: Attention backends (vLLM's ``AttentionBackend.get_name()``) whose KV
#: tensors the staging copies understand, with how K and V are split.
KNOWN_LAYOUTS = {
    "CPU_ATTN": "tokens",
    "FLASH_ATTN": "content",
    "FLASHINFER": "content",
}


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """How one vLLM per-layer KV tensor holds K and V.

    Attributes:
        backend: vLLM's attention backend name (``CPU_ATTN``, ...).
        layout: vLLM's resolved ``KVCacheLayout`` name (``LBHNC``, ...), for
            messages.
        split: ``"tokens"`` (K rows then V rows of each block and head, the
            CPU backend) or ``"content"`` (K then V inside each token's
            content, the GPU backends).
        head_size: elements of one head of K (and of V).
    """

    backend: str
    layout: str
    split: str
    head_size: int

    def describe(self) -> str:
        return f"{self.backend} ({self.layout})"

    def kv_views(self, kv: Any, num_blocks: int) -> tuple[Any, Any]:
        """K and V of one layer's tensor ``kv`` (``[B * ratio, H, N, 2 *
        head_size]``), each a view ``[num_blocks, ratio, H, N, head_size]``
        over the same memory.

        Raises:
            IncompatibleModel: a tensor of another shape than this layout's.
        """
        if kv.dim() != 4 or kv.shape[-1] != 2 * self.head_size or kv.shape[0] % num_blocks:
            raise errors.IncompatibleModel(
                f"KVSidecarConnector: a {self.describe()} KV tensor of shape {tuple(kv.shape)} is not "
                f"[num_blocks * ratio, heads, tokens, 2 * head_size] with num_blocks {num_blocks} and "
                f"head_size {self.head_size}"
            )
        if self.split == "tokens":
            b, h, n, _ = kv.shape
            try:
                rows = kv.view(b, h, 2 * n, self.head_size)
            except RuntimeError as e:
                raise errors.IncompatibleModel(
                    f"KVSidecarConnector: a {self.describe()} KV tensor with strides {kv.stride()} cannot be "
                    f"read as [blocks, heads, 2 * tokens, head_size] as the CPU backend does: {e}"
                ) from e
            k, v = rows[:, :, :n], rows[:, :, n:]
        else:
            k, v = kv[..., : self.head_size], kv[..., self.head_size :]
        return k.unflatten(0, (num_blocks, -1)), v.unflatten(0, (num_blocks, -1))


def layer_layout(backend: str, layout: str, head_size: int, kv_cache_dtype: str = "auto") -> LayerLayout:
    """The :class:`LayerLayout` of vLLM attention backend ``backend`` with
    the resolved ``layout`` (a ``KVCacheLayout`` name).

    Raises:
        Unsupported: a backend (or a FlashInfer NVFP4 cache, or a CPU cache
            in a layout other than LBHNC) the copies do not know; the message
            names what it got and the backends it knows.
    """
    split = KNOWN_LAYOUTS.get(backend)
    known = ", ".join(f"{b} ({'LBHNC' if s == 'tokens' else 'any layout'})" for b, s in KNOWN_LAYOUTS.items())
    if split is None or (split == "tokens" and layout != "LBHNC") or "nvfp4" in kv_cache_dtype:
        raise errors.Unsupported(
            f"KVSidecarConnector: vLLM's KV cache is {backend} with layout {layout} and cache dtype "
            f"{kv_cache_dtype}; the staging copies know {known}, without NVFP4"
        )
    return LayerLayout(backend=backend, layout=layout, split=split, head_size=head_size)


class _CudaRange:
    """A device range as ``__cuda_array_interface__`` (version 3) presents
    it, so that ``torch.as_tensor(r, device=...)`` views it without a copy."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|i1", "data": (ptr, False), "version": 3,
                                         "strides": None}


def region_tensor(client: Any, r: int, device: Any = None) -> Any:
    """Region ``r`` of ``client``'s cache (a :class:`kvsidecar.local.LocalClient`)
    as a flat uint8 tensor of ``region_len`` bytes over this process's
    mapping, no copy (only mapped pages may be touched): host pages through
    ``torch.frombuffer``;
    device pages (``client.device_mapping``, a CudaDeviceMapping) through
    ``__cuda_array_interface__`` on ``device``. The device path is written
    but not yet measured on a GPU (this project's machines have none)."""
    import torch

    info = client.info
    assert info is not None, "attached"
    if not info.device_memory:
        return torch.frombuffer(client.region(r), dtype=torch.uint8)
    m = client.device_mapping
    assert m is not None and hasattr(m, "bases"), "device pages need a CudaDeviceMapping"
    return torch.as_tensor(_CudaRange(m.bases[r], info.region_len), device=device)


def _row_step(p: Packing) -> int:
    """Bytes between the starts of neighbouring rows of :func:`_block_rows`:
    ``gcd(block_len, page_size)``, which divides every ``Packing.offset``
    (``block_len`` itself where blocks lie back to back: no pages, or pages
    a whole number of blocks long)."""
    return math.gcd(p.block_len, p.page_size if p.blocks_per_page else 0)


#: The integer dtype of each element width :func:`_block_rows` copies in.
_WIDE = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


def _block_rows(region: Any, p: Packing) -> Any:
    """A region (a flat uint8 tensor, :func:`region_tensor`) as rows of one
    block each, no copy: a view ``[rows, block_len // w]`` of w-byte integers
    (w the widest of 8, 4, 2, 1 that divides the row step and the region's
    address; a copy moves w bytes an element), row ``i`` starting at byte
    ``i * step`` (:func:`_row_step`), so block ``b`` is row
    ``Packing.offset(b) // step``.

    Where a page ends in a gap shorter than a block, step is less than
    block_len and the rows overlap; only the rows of blocks are ever read or
    written, and those never overlap. Every row ends inside the region
    (``rows`` counts the whole blocks that fit, a partial last page
    included), so a copy never reaches past the mapped length.
    """
    import torch

    step = _row_step(p)
    w = next(w for w in _WIDE if step % w == 0 and region.data_ptr() % w == 0)
    size = region.numel()
    rows = max(0, (size - p.block_len) // step + 1)
    flat = region[: size // w * w].view(getattr(torch, _WIDE[w]))
    return flat.as_strided((rows, p.block_len // w), (step // w, 1))


class Staging:
    """Copies blocks of one rank between vLLM's per-layer KV tensors and
    the sidecar's regions, mapped in this process by ``client``
    (:class:`kvsidecar.local.LocalClient`; host memory).

    Args:
        client: the rank's attached local client.
        info: its ``KVCacheInfo``.
        layout: how vLLM's tensors hold K and V.
        num_blocks: vLLM's blocks per layer tensor (``KVCacheConfig.num_blocks``).
    """

    def __init__(self, client: Any, info: local_pb2.KVCacheInfo, layout: LayerLayout, num_blocks: int) -> None:
        import torch

        self.torch = torch
        self.client = client
        self.info = info
        self.layout = layout
        self.num_blocks = num_blocks
        self.packing = client.packing
        self.packing.check()
        #: Where K and V of a block sit in the sidecar: the axis of a
        #: ``[n, heads, tokens, head_size]`` block view they are stacked on
        #: in one region (2: H2ND, 3: HN2D), or None (HND: two regions).
        self.kv_axis: int | None = {common_pb2.LAYOUT_H2ND: 2, common_pb2.LAYOUT_HN2D: 3}.get(info.geometry.layout)
        self._regions: dict[int, Any] = {}
        self._rows: dict[int, Any] = {}
        #: Bytes copied each way since start (prefill: vLLM -> sidecar;
        #: decode: sidecar -> vLLM).
        self.copied_bytes = 0

    def region(self, r: int) -> Any:
        """Region r as a flat uint8 tensor (:func:`region_tensor`), made once."""
        t = self._regions.get(r)
        if t is None:
            t = self._regions[r] = region_tensor(self.client, r)
        return t

    def _rows_of(self, r: int) -> Any:
        """Region r as rows of blocks, a view ``[rows, block_len // w]`` of
        w-byte integers over :meth:`region` (:func:`_block_rows`), made once;
        :meth:`_row_ids` says which rows hold blocks."""
        v = self._rows.get(r)
        if v is None:
            v = self._rows[r] = _block_rows(self.region(r), self.packing)
        return v

    def _row_ids(self, ids: list[int]) -> Any:
        """The rows of :meth:`_rows_of` (an int64 tensor ``[len(ids)]``) that
        hold sidecar blocks ``ids``.

        Raises:
            InvalidArgument: a block not mapped in this process.
        """
        for b in ids:
            if not self.client.is_mapped(b):
                raise errors.InvalidArgument(f"KVSidecarConnector: sidecar block {b} is not mapped here (not allocated)")
        step = _row_step(self.packing)
        return self.torch.tensor([self.packing.offset(b) // step for b in ids], dtype=self.torch.long)

    def _regions_of(self, layer: int) -> list[int]:
        """The sidecar regions of ``layer``: K then V, or the one compound."""
        return [layer] if self.kv_axis is not None else [2 * layer, 2 * layer + 1]

    def save(self, layer: int, kv: Any, vllm_ids: list[int], sidecar_ids: list[int]) -> None:
        """vLLM blocks ``vllm_ids`` of one layer -> sidecar blocks
        ``sidecar_ids`` of its region(s), in the sidecar's layout."""
        t = self.torch
        at = self._row_ids(sidecar_ids)
        vidx = t.tensor(vllm_ids, dtype=t.long, device=kv.device)
        n = len(vllm_ids)
        # Each [n, ratio, H, Nk, D] -> [n, H, ratio * Nk, D]: heads outermost.
        k, v = (x.index_select(0, vidx).permute(0, 2, 1, 3, 4).flatten(2, 3)
                for x in self.layout.kv_views(kv, self.num_blocks))
        blobs = [k, v] if self.kv_axis is None else [t.stack((k, v), dim=self.kv_axis)]
        for r, blob in zip(self._regions_of(layer), blobs, strict=True):
            data = blob.contiguous().cpu().view(t.uint8).reshape(n, -1)
            self._check_len(data)
            rows = self._rows_of(r)
            rows.index_copy_(0, at, data.view(rows.dtype))
            self.copied_bytes += data.numel()

    def load(self, layer: int, kv: Any, vllm_ids: list[int], sidecar_ids: list[int]) -> None:
        """Sidecar blocks ``sidecar_ids`` of the layer's region(s) -> vLLM
        blocks ``vllm_ids`` of one layer."""
        t = self.torch
        at = self._row_ids(sidecar_ids)
        vidx = t.tensor(vllm_ids, dtype=t.long, device=kv.device)
        n = len(vllm_ids)
        views = self.layout.kv_views(kv, self.num_blocks)
        _, ratio, h, nk, d = views[0].shape
        blobs = []
        for r in self._regions_of(layer):
            data = self._rows_of(r).index_select(0, at).view(t.uint8)  # [n, block_len], a copy
            self._check_len(data)
            self.copied_bytes += data.numel()
            blobs.append(data.view(kv.dtype))
        if self.kv_axis is None:
            parts = [b.reshape(n, h, ratio * nk, d) for b in blobs]
        else:
            shape = [n, h, ratio * nk, d]
            shape.insert(self.kv_axis, 2)
            parts = list(blobs[0].reshape(shape).unbind(self.kv_axis))
        for view, part in zip(views, parts, strict=True):
            view.index_copy_(0, vidx, part.reshape(n, h, ratio, nk, d).permute(0, 2, 1, 3, 4).to(kv.device))

    def _check_len(self, blob: Any) -> None:
        if blob.shape[-1] != self.info.block_len:
            raise errors.IncompatibleModel(
                f"KVSidecarConnector: one block of one layer's K is {blob.shape[-1]} bytes in vLLM's "
                f"{self.layout.describe()} cache, the sidecar's block_len is {self.info.block_len} bytes"
            )
