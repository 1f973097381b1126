"""The Python importer of device pages (kvsidecar.devicemap.CudaDeviceMapping)
against fakecuda, the CUDA driver stand-in of vmm/cuda/cudatest (built here
with gcc from its C source, as the Go tests build it), behind a real
``kvsidecar serve --backend cuda``; and the host backend's promise that no
CUDA library is loaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from kvsidecar.devicemap import CudaDeviceMapping
from kvsidecar.local import LocalClient

GEOMETRY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--dtype", "bfloat16", "--block-size", "16"]


@pytest.fixture(scope="module")
def fakecuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of the fake driver, named libcuda.so.1 (soname libfakecuda.so.1,
    so it never stands in for the real driver by accident)."""
    src = os.path.join(REPO, "vmm", "cuda", "cudatest", "testdata", "fakecuda.c")
    inc = os.path.join(REPO, "vmm", "cuda", "internal", "cudaabi")
    out = str(tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1")
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        pytest.fail(f"{cc} is not installed: it builds the fake CUDA driver")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-I", inc, "-Wl,-soname,libfakecuda.so.1",
                    "-o", out, src, "-lpthread"], check=True, capture_output=True)
    return out


def pattern(region: int, block: int, n: int) -> bytes:
    return bytes((region * 31 + block * 7 + i) % 251 for i in range(n))


def test_device_pages_map_and_read_back(cluster, fakecuda, tmp_path, monkeypatch):
    trace = tmp_path / "trace"
    monkeypatch.setenv("FAKECUDA_TRACE", str(trace))
    sc = cluster.start("dev", args=[*GEOMETRY, "--num-blocks", "1200", "--backend", "cuda", "--cuda-library", fakecuda])
    # Two connections of one engine, each with its own import of the pages:
    # a writes through its device addresses, b reads the same memory back.
    a = LocalClient(sc.socket, device_mapping=CudaDeviceMapping(fakecuda))
    b = LocalClient(sc.socket, device_mapping=CudaDeviceMapping(fakecuda))
    try:
        info = a.attach()
        assert info.device_memory and info.num_regions == 4
        b.attach()
        ma, mb = a.device_mapping, b.device_mapping
        assert isinstance(ma, CudaDeviceMapping) and isinstance(mb, CudaDeviceMapping)
        per_page = info.page_size // info.block_len
        ids = a.alloc(per_page + 5)  # two pages of every region
        b.sync()
        pages = {a.packing.offset(i) // info.page_size for i in ids}
        assert len(pages) == 2
        picks = [ids[0], ids[per_page - 1], ids[-1]]
        for r in range(info.num_regions):
            for blk in picks:
                ma.write(r, a.packing.offset(blk), pattern(r, blk, info.block_len))
        for r in range(info.num_regions):
            for blk in picks:
                assert mb.read(r, b.packing.offset(blk), info.block_len) == pattern(r, blk, info.block_len)
        assert set(ma.bases).isdisjoint(mb.bases), "each import has addresses of its own"
        calls = trace.read_text()
        assert calls.count("cuMemImportFromShareableHandle") >= 2 * 2 * info.num_regions
        # Freed pages beyond the sidecar's reserve are unmapped here too.
        a.free(ids)
        b.sync()
        mapped = [pg for pg in pages if mb.is_mapped(0, pg * info.page_size)]
        assert len(mapped) <= 1, f"pages {sorted(pages)} freed, {mapped} still mapped"
        assert "cuMemUnmap" in trace.read_text()
    finally:
        a.close()
        b.close()


def test_host_backend_loads_no_cuda_library(cluster, fakecuda):
    # A libcuda.so.1 the loader would find (the fake, on LD_LIBRARY_PATH) is
    # never loaded by the package on the host backend: first its modules
    # that do not need vLLM, run against a host sidecar, leave no CUDA
    # library mapped; then the connector's modules are imported too (vLLM
    # probes the driver itself when imported) and no ctypes load of a CUDA
    # library was made by kvsidecar's code.
    sc = cluster.start("host", args=[*GEOMETRY, "--num-blocks", "64"])
    prog = f"""
import ctypes, importlib, inspect, pkgutil
loads = []
cdll_init = ctypes.CDLL.__init__
def spy(self, name, *a, **k):
    if "cuda" in str(name) and "/kvsidecar/" in inspect.stack()[1].filename:
        loads.append(str(name))
    return cdll_init(self, name, *a, **k)
ctypes.CDLL.__init__ = spy
import kvsidecar
names = [m.name for m in pkgutil.iter_modules(kvsidecar.__path__)]
for n in names:
    if not n.startswith("vllm"):
        importlib.import_module("kvsidecar." + n)
from kvsidecar.local import LocalClient
c = LocalClient({sc.socket!r})
c.attach()
ids = c.alloc(3)
c.block(0, ids[0])[:4] = b"abcd"
c.free(ids)
c.close()
maps = open("/proc/self/maps").read()
print("cuda libraries:", sorted({{l.split()[-1] for l in maps.splitlines() if "libcuda" in l or "fakecuda" in l}}))
for n in names:
    importlib.import_module("kvsidecar." + n)
print("modules:", len(names), "loads by kvsidecar:", loads)
"""
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(fakecuda))
    out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cuda libraries: []" in out.stdout, out.stdout
    assert "loads by kvsidecar: []" in out.stdout, out.stdout
