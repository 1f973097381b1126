"""kvsidecar.staging's layouts: which vLLM KV tensors the copies take, how
they split K and V, and what they refuse (the copies themselves run through
real sidecars in test_vllm_connector.py and test_vllm_engines.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsidecar import errors
from kvsidecar.staging import KNOWN_LAYOUTS, layer_layout
from kvsidecar.vllm.connector import KVConnectorRole, KVSidecarConnector


@pytest.mark.parametrize("backend, layout, dtype, why", [
    ("TRITON_ATTN", "LBNHC", "auto", "TRITON_ATTN with layout LBNHC"),
    ("CPU_ATTN", "LBNHC", "auto", "CPU_ATTN with layout LBNHC"),
    ("FLASHINFER", "LBHNC", "nvfp4", "cache dtype nvfp4"),
])
def test_unknown_layouts_are_refused_naming_both(backend, layout, dtype, why):
    with pytest.raises(errors.Unsupported) as e:
        layer_layout(backend, layout, 64, dtype)
    msg = e.value.message
    assert why in msg
    assert "CPU_ATTN (LBHNC), FLASH_ATTN (any layout), FLASHINFER (any layout)" in msg
    assert set(KNOWN_LAYOUTS) == {"CPU_ATTN", "FLASH_ATTN", "FLASHINFER"}


def test_cpu_backend_keeps_k_rows_before_v_rows():
    # vLLM 0.32.0's CPU backend reads each (block, head) run of N tokens x
    # 2D elements as 2N rows of D: K rows first.
    nb, h, n, d = 3, 2, 32, 4
    kv = torch.arange(nb * h * n * 2 * d, dtype=torch.float32).reshape(nb, h, n, 2 * d)
    k, v = layer_layout("CPU_ATTN", "LBHNC", d).kv_views(kv, nb)
    assert k.shape == v.shape == (nb, 1, h, n, d)
    run = kv[1, 1].reshape(2 * n, d)
    assert torch.equal(k[1, 0, 1], run[:n]) and torch.equal(v[1, 0, 1], run[n:])
    # The GPU backends split the same memory inside each token instead.
    k, v = layer_layout("FLASH_ATTN", "LBHNC", d).kv_views(kv, nb)
    assert torch.equal(k[1, 0, 1], kv[1, 1, :, :d]) and torch.equal(v[1, 0, 1], kv[1, 1, :, d:])
    k[2, 0, 0, 5] = -1
    assert kv[2, 0, 5, 0] == -1, "a view, not a copy"


def test_kernel_blocks_group_under_their_block():
    # 2 vLLM blocks of 64 tokens, held as 4 kernel blocks of 32.
    kv = torch.zeros(4, 2, 32, 8)
    k, _ = layer_layout("FLASH_ATTN", "LBNHC", 4).kv_views(kv, 2)
    assert k.shape == (2, 2, 2, 32, 4)
    k[1, 1, 0, 3] = 7
    assert kv[3, 0, 3, 0] == 7


@pytest.mark.parametrize("shape, num_blocks", [((2, 10, 32, 2, 64), 10), ((10, 2, 32, 64), 10), ((9, 2, 32, 128), 2)])
def test_a_tensor_of_another_shape_is_refused(shape, num_blocks):
    with pytest.raises(errors.IncompatibleModel, match=r"of shape \(.*\) is not \[num_blocks \* ratio"):
        layer_layout("FLASH_ATTN", "LBHNC", 64).kv_views(torch.zeros(shape), num_blocks)


def test_register_kv_caches_refuses_an_old_layout():
    # vLLM before the [L, B, H, N, C] layouts gave FlashAttention tensors of
    # [2, num_blocks, block_size, heads, head_size]: refused before any
    # sidecar is dialled.
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_role="kv_both",
                                           kv_connector_extra_config={"socket_dir": "/nowhere", "tp_rank": 0}),
        parallel_config=SimpleNamespace(tensor_parallel_size=1), cache_config=SimpleNamespace(block_size=32))
    w = KVSidecarConnector(cfg, KVConnectorRole.WORKER, SimpleNamespace(num_blocks=10))
    w._worker.layout_of = lambda c: layer_layout("FLASH_ATTN", "LBNHC", 64)
    with pytest.raises(errors.IncompatibleModel, match=r"FLASH_ATTN \(LBNHC\) KV tensor of shape \(2, 10, 32, 2, 64\)"):
        w.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(2, 10, 32, 2, 64)})


@pytest.mark.parametrize("backend, sidecar_layout", [("CPU_ATTN", "H2ND"), ("FLASH_ATTN", "HN2D")])
def test_compound_layouts_are_the_backends_own_bytes(cluster, backend, sidecar_layout):
    # A layer's tensor in vLLM's LBHNC layout and the sidecar's compound
    # block are the same bytes: CPU_ATTN's [heads, 2 * tokens, head_size]
    # runs are H2ND, FlashAttention's [heads, tokens, 2 * head_size] HN2D.
    # So staging into such a sidecar copies each block verbatim, and zero
    # copy can hand vLLM the sidecar's pages as they are.
    from kvsidecar.local import LocalClient
    from kvsidecar.staging import Staging

    sc = cluster.start("st", args=["--layers", "1", "--kv-heads", "2", "--head-dim", "64", "--dtype", "float32",
                                   "--block-size", "32", "--num-blocks", "16", "--kv-layout", sidecar_layout])
    with LocalClient(sc.socket) as c:
        info = c.attach()
        ids = c.alloc(3)
        kv = torch.randn(8, 2, 32, 128)  # [blocks, heads, tokens, 2 * head_size], LBHNC
        st = Staging(c, info, layer_layout(backend, "LBHNC", 64), 8)
        st.save(0, kv, [5, 2, 7], ids)
        for v, s in zip([5, 2, 7], ids, strict=True):
            assert bytes(c.block(0, s)) == kv[v].numpy().tobytes(), f"vLLM block {v} -> sidecar block {s}"
        back = torch.zeros_like(kv)
        st.load(0, back, [1, 3, 4], ids)
        assert torch.equal(back[[1, 3, 4]], kv[[5, 2, 7]])
        assert st.copied_bytes == 2 * 3 * info.block_len


class _Pages:
    """A stand-in for a LocalClient's host mapping (Staging reads
    ``packing``, ``info``, ``region`` and ``is_mapped``): regions of
    ``size`` random bytes each over plain buffers, every block mapped."""

    def __init__(self, packing, size, num_blocks, regions=2):
        from kvsidecar.v1 import common_pb2, local_pb2

        self.packing = packing
        self.info = local_pb2.KVCacheInfo(block_len=packing.block_len, region_len=size, num_blocks=num_blocks,
                                          page_size=packing.page_size,
                                          geometry=common_pb2.ModelGeometry(layout=common_pb2.LAYOUT_HND))
        g = torch.Generator().manual_seed(7)
        self.bufs = [bytearray(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes())
                     for _ in range(regions)]

    def region(self, r):
        return memoryview(self.bufs[r])

    def is_mapped(self, b):
        return 0 <= b < self.info.num_blocks


def _old_byte_index(packing, ids):
    # The rule staging used before it gathered rows: one int64 byte index
    # [len(ids), block_len] at Packing.offset.
    starts = torch.tensor([packing.offset(b) for b in ids], dtype=torch.long)
    return starts[:, None] + torch.arange(packing.block_len, dtype=torch.long)


@pytest.mark.parametrize("page_size", [100, 99, 96, 0], ids=["gap-4", "odd-gap", "no-gap", "no-pages"])
def test_block_rows_are_the_byte_index_rule(page_size):
    # Blocks of 24 bytes (float32, 1 head, 2 tokens, head_size 3). 100-byte
    # pages hold 4 blocks and a 4-byte gap; 99-byte ones 4 and 3 (the rows
    # step 3 bytes, copied a byte at a time). The regions end in a partial
    # page holding 2 more blocks, the last of them a copied one.
    from kvsidecar.hostmap import Packing
    from kvsidecar.staging import Staging

    p = Packing(block_len=24, page_size=page_size)
    size = 4 * max(page_size, 96) + 60
    num_blocks = 18
    assert p.offset(num_blocks - 1) + 24 <= size < p.offset(num_blocks) + 24
    c = _Pages(p, size, num_blocks)
    st = Staging(c, c.info, layer_layout("FLASH_ATTN", "LBHNC", 3), 8)
    vllm_ids, sidecar_ids = [6, 0, 3, 7, 1], [17, 4, 0, 9, 3]
    regions = [torch.frombuffer(c.bufs[r], dtype=torch.uint8) for r in range(2)]
    at = _old_byte_index(p, sidecar_ids)

    kv = torch.zeros(8, 1, 2, 6)  # [blocks, heads, tokens, 2 * head_size]
    st.load(0, kv, vllm_ids, sidecar_ids)
    for x, half in zip(regions, (kv[..., :3], kv[..., 3:]), strict=True):
        assert torch.equal(half[vllm_ids].contiguous().view(torch.uint8).reshape(5, 24), x[at])
    assert not kv[[2, 4, 5]].any(), "only the loaded vLLM blocks are written"

    kv = torch.randn(8, 1, 2, 6)
    want = [x.clone() for x in regions]
    for w, half in zip(want, (kv[..., :3], kv[..., 3:]), strict=True):
        w[at] = half[vllm_ids].contiguous().view(torch.uint8).reshape(5, 24)
    st.save(0, kv, vllm_ids, sidecar_ids)
    for x, w in zip(regions, want, strict=True):
        assert torch.equal(x, w), "every byte as the byte index writes it, the gaps and other blocks kept"
    assert st.copied_bytes == 2 * 2 * 5 * 24


def test_an_unmapped_block_is_refused_before_any_copy():
    from kvsidecar.hostmap import Packing
    from kvsidecar.staging import Staging

    p = Packing(block_len=24, page_size=100)
    c = _Pages(p, 400, 16)
    before = bytes(c.bufs[0])
    st = Staging(c, c.info, layer_layout("FLASH_ATTN", "LBHNC", 3), 8)
    with pytest.raises(errors.InvalidArgument, match="sidecar block 16 is not mapped here"):
        st.save(0, torch.randn(8, 1, 2, 6), [0, 1], [3, 16])
    assert bytes(c.bufs[0]) == before and st.copied_bytes == 0
