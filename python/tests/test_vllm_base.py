"""KVSidecarConnector against vLLM's KVConnectorBase_V1: method names and
parameter order from the checked-in list (python/tools/vllm_base_methods.py
made it from vLLM's source), and the subclassing branch with a stand-in
`vllm` package built from that list."""

from __future__ import annotations

import abc
import enum
import importlib
import inspect
import os
import sys
import types
from types import SimpleNamespace

import pytest

from kvsidecar import errors

LIST = os.path.join(os.path.dirname(__file__), "kvconnector_base_v1.txt")


def base_methods() -> dict[str, tuple[str, list[str]]]:
    """name -> (kind, parameter names) from the checked-in list."""
    out = {}
    with open(LIST) as f:
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


def test_list_names_its_source():
    with open(LIST) as f:
        head = f.readline() + f.readline()
    assert "vllm-project/vllm" in head and "commit " in head
    commit = head.split("commit ", 1)[1].split()[0]
    assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit)
    m = base_methods()
    # The heart of the v1 API is in the list (a parse that lost methods would
    # make the comparison below vacuous).
    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "request_finished", "register_kv_caches", "start_load_kv", "wait_for_layer_load",
                 "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors"):
        assert name in m, name
    assert sum(k == "abstract" for k, _ in m.values()) == 7


def test_connector_matches_the_base_by_name_and_parameter_order():
    from kvsidecar.vllm import KVSidecarConnector

    m = base_methods()
    own = {n: f for n, f in vars(KVSidecarConnector).items() if callable(f) and not n.startswith("__") or n == "__init__"}
    for name, (kind, _) in m.items():
        if kind == "abstract":
            assert name in own, f"abstract {name} is not implemented"
    for name, fn in own.items():
        if name.startswith("_") and name != "__init__":
            continue
        assert name in m, f"{name} is not a method of KVConnectorBase_V1 (a misspelt override is never called)"
        kind, want = m[name]
        assert kind not in ("property", "classmethod", "staticmethod"), f"{name} is a {kind} in the base"
        assert params_of(fn) == want, f"{name}: parameters {params_of(fn)}, the base has {want}"


def _standin_vllm(m: dict[str, tuple[str, list[str]]], rank: int) -> dict[str, types.ModuleType]:
    """A `vllm` package whose KVConnectorBase_V1 is an ABC with the listed
    methods (abstract ones abstract, so an incomplete subclass cannot be
    instantiated) and the base's constructor rule."""

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(abc.ABC):  # noqa: B024
        pass

    ns: dict[str, object] = {}
    for name, (kind, params) in m.items():
        if name == "__init__" or kind in ("property", "classmethod"):
            continue
        ns[name] = abc.abstractmethod(lambda self, *a, **k: None) if kind == "abstract" else (lambda self, *a, **k: None)

    def __init__(self, vllm_config, role, kv_cache_config=None):
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._connector_metadata = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._role = role

    def bind(self, md):
        self._connector_metadata = md

    def get_md(self):
        assert self._connector_metadata is not None
        return self._connector_metadata

    ns.update(__init__=__init__, role=property(lambda self: self._role), bind_connector_metadata=bind,
              _get_connector_metadata=get_md)
    base_cls = abc.ABCMeta("KVConnectorBase_V1", (abc.ABC,), ns)

    mods = {}
    for name in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
                 "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.base",
                 "vllm.distributed.parallel_state"):
        mods[name] = types.ModuleType(name)
    base = mods["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    base.KVConnectorBase_V1, base.KVConnectorMetadata, base.KVConnectorRole = base_cls, KVConnectorMetadata, KVConnectorRole
    mods["vllm.distributed.parallel_state"].get_tensor_model_parallel_rank = lambda: rank
    return mods


@pytest.fixture
def with_standin_vllm(monkeypatch):
    import kvsidecar.vllm as kv

    mods = _standin_vllm(base_methods(), rank=3)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    yield importlib.reload(kv), mods
    for name in mods:
        sys.modules.pop(name, None)
    importlib.reload(kv)


def config(**kt):
    kt = {"engine_id": "prefill-a", "kv_role": "kv_both", "kv_connector_extra_config": {"socket_dir": "/tmp/nowhere"}, **kt}
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(**kt),
                           parallel_config=SimpleNamespace(tensor_parallel_size=4),
                           cache_config=SimpleNamespace(block_size=16))


def test_subclasses_vllm_base_when_vllm_is_importable(with_standin_vllm):
    kv, mods = with_standin_vllm
    base = mods["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    assert kv.HAVE_VLLM
    assert issubclass(kv.KVSidecarConnector, base.KVConnectorBase_V1)
    assert issubclass(kv.KVSidecarConnectorMetadata, base.KVConnectorMetadata)
    # Instantiable: every abstract method of the base is implemented.
    sched = kv.KVSidecarConnector(config(), base.KVConnectorRole.SCHEDULER)
    worker = kv.KVSidecarConnector(config(), base.KVConnectorRole.WORKER)
    assert sched.role is base.KVConnectorRole.SCHEDULER
    assert worker._worker.rank == 3, "a worker's rank comes from vllm's parallel_state"
    md = kv.KVSidecarConnectorMetadata()
    worker.bind_connector_metadata(md)
    assert worker._get_connector_metadata() is md
    with pytest.raises(ValueError, match="kv_transfer_config must be set"):
        kv.KVSidecarConnector(SimpleNamespace(kv_transfer_config=None), base.KVConnectorRole.WORKER)


def test_without_vllm_the_module_stands_alone():
    import kvsidecar.vllm as kv

    assert "vllm" not in sys.modules or not kv.HAVE_VLLM or isinstance(sys.modules["vllm"], types.ModuleType)
    if not kv.HAVE_VLLM:
        assert kv.KVSidecarConnector.__mro__[1].__module__ == "kvsidecar.vllm"
    c = kv.KVSidecarConnector(config(kv_connector_extra_config={"socket_dir": "/x", "tp_rank": 1}), kv.KVConnectorRole.WORKER)
    assert c._worker.rank == 1


@pytest.mark.parametrize("kt, match", [
    ({"engine_id": ""}, "engine_id"),
    ({"kv_role": "kv_sender"}, "kv_role 'kv_sender' must be kv_producer, kv_consumer or kv_both"),
])
def test_bad_config_is_refused(kt, match):
    from kvsidecar.vllm import KVConnectorRole, KVSidecarConnector

    with pytest.raises(errors.InvalidArgument, match=match):
        KVSidecarConnector(config(**kt), KVConnectorRole.SCHEDULER)
