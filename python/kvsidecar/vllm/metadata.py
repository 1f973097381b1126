"""KVSidecarConnector's settings (from vLLM's config objects) and the step
metadata its scheduler side sends every worker (see :mod:`kvsidecar.vllm`)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvsidecar import errors
from kvsidecar.limits import DEFAULT_CALL_TIMEOUT_SECONDS
from kvsidecar.local import DEFAULT_SIDECAR_WAIT_SECONDS
from kvsidecar.paths import default_socket_dir, local_socket_path
from kvsidecar.rankset import dtype_code
from kvsidecar.v1 import common_pb2, params_pb2
from kvsidecar.vllm.zerocopy import DEFAULT_FREE_HOLD_SECONDS, requested

__all__ = ["ConnectorConfig", "KVSidecarConnectorMetadata", "LoadSpec", "SaveSpec", "log", "role_name",
           "vllm_engine_facts"]

# A child of vLLM's "vllm" logger, so vLLM's handler, format and
# VLLM_LOGGING_LEVEL apply to the connector's lines too.
log = logging.getLogger("vllm.kvsidecar")


@dataclasses.dataclass
class LoadSpec:
    """One request a decode worker loads (scheduler -> worker).

    Attributes:
        req_id: the decode request id.
        block_ids: vLLM block ids to fill, in token order: the blocks after
            the local prefix hit, at most as many as the remote blocks left
            after that hit (a further block vLLM allocated is computed
            locally and not part of the load).
        params: the request's kv_transfer_params, parsed and validated once
            by the scheduler side (None only with ``refused``).
        notify_only: nothing to read (a full local prefix hit, or a request
            aborted before it was scheduled): the prefill ranks are only
            notified so they free their blocks; vLLM is not told anything.
        hit_blocks: leading remote blocks the decode holds already (its
            local prefix hit): remote block ``hit_blocks + i`` lands in
            ``block_ids[i]``.
        token_digests: the token digests of the prompt tokens the load
            takes, from block 0 (:func:`kvsidecar.params.token_digests`),
            which the sidecar checks the params' against before it reads.
        refused: why the load cannot run (""): the worker reports every
            one of ``block_ids`` for recompute without starting it.
    """

    req_id: str
    block_ids: list[int]
    params: params_pb2.KVTransferParams | None
    notify_only: bool = False
    hit_blocks: int = 0
    token_digests: bytes = b""
    refused: str = ""


@dataclasses.dataclass
class SaveSpec:
    """One request whose prompt KV a prefill worker copies into its rank's
    sidecar blocks in this step (scheduler -> worker).

    Attributes:
        req_id: the prefill request id.
        block_ids: vLLM block ids holding the prompt, in token order.
        staging: per TP rank, the sidecar block ids to copy them into (same
            length as ``block_ids``).
    """

    req_id: str
    block_ids: list[int]
    staging: list[list[int]]


@dataclasses.dataclass
class KVSidecarConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells every worker for one step.

    Attributes:
        loads: decode loads to start.
        saves: staging: prompts to copy into sidecar blocks.
        aborts: loads to abort.
        exported: zero copy: requests whose blocks vLLM keeps for the
            sidecars' exports until the workers report them in
            ``finished_sending`` (vLLM asserts it waits for each one).
        sync_mappings: zero copy: the sidecar mapped pages since the last
            step (rank 0 told the scheduler), so every worker maps them
            before it touches the step's blocks.
    """

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    aborts: list[str] = dataclasses.field(default_factory=list)
    exported: list[str] = dataclasses.field(default_factory=list)
    sync_mappings: bool = False


#: The ``kv_connector_extra_config`` keys the connector reads; another key
#: is logged once at start with the nearest of these (a misspelt key would
#: otherwise be its default, silently).
EXTRA_CONFIG_KEYS = ("socket_dir", "engine_id", "call_timeout_seconds", "sidecar_wait_seconds", "num_blocks", "tp_rank",
                     "zero_copy", "free_hold_seconds", "cuda_library", "enforce_handshake_compat")


def warn_unknown_keys(extra: dict[str, Any]) -> list[str]:
    """Logs a warning for each key of ``extra`` not in
    :data:`EXTRA_CONFIG_KEYS`, naming the nearest known one; returns them."""
    unknown = sorted(k for k in extra if k not in EXTRA_CONFIG_KEYS)
    for k in unknown:
        near = difflib.get_close_matches(str(k), EXTRA_CONFIG_KEYS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        log.warning("KVSidecarConnector: kv_connector_extra_config key %r is not one it reads%s; it reads %s",
                    k, hint, ", ".join(EXTRA_CONFIG_KEYS))
    return unknown


def seconds_setting(extra: dict[str, Any], key: str, default: float, what: str) -> float:
    """``kv_connector_extra_config[key]``: a finite number of seconds >= 0,
    ``default`` when absent; ``what`` says what it bounds (for the error).

    Raises:
        InvalidArgument: not a finite number >= 0 (naming the key, the value
            and the rule).
    """
    v = extra.get(key, default)
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = float("nan")
    if isinstance(v, bool) or not (f >= 0 and f != float("inf")):
        raise errors.InvalidArgument(
            f"KVSidecarConnector: kv_connector_extra_config.{key} {v!r} must be a number of seconds >= 0 ({what})")
    return f


def sidecar_wait_seconds(extra: dict[str, Any]) -> float:
    """``kv_connector_extra_config.sidecar_wait_seconds``: a number >= 0,
    default :data:`kvsidecar.local.DEFAULT_SIDECAR_WAIT_SECONDS`.

    Raises:
        InvalidArgument: not a finite number >= 0 (naming the value).
    """
    return seconds_setting(extra, "sidecar_wait_seconds", DEFAULT_SIDECAR_WAIT_SECONDS,
                           "how long a worker waits at start for its sidecar; 0: not at all")


def enforce_handshake_compat(extra: dict[str, Any]) -> bool:
    """``kv_connector_extra_config.enforce_handshake_compat`` (NixlConnector's
    name for its switch, vllm 0.32.0 ``kv_connector/v1/nixl/base_worker.py``):
    a bool, default True.

    Raises:
        InvalidArgument: not a bool (naming the value).
    """
    v = extra.get("enforce_handshake_compat", True)
    if not isinstance(v, bool):
        raise errors.InvalidArgument(
            f"KVSidecarConnector: kv_connector_extra_config.enforce_handshake_compat {v!r} must be true or false "
            "(false: a decode loads KV of a prefill whose vLLM version, model, attention backend or KV cache "
            "dtype differ, logging the differences)")
    return v


def vllm_engine_facts(vllm_config: Any, attention_backend: str = "") -> params_pb2.EngineFacts:
    """This vLLM engine's facts for the prefill/decode compatibility check
    (``kv_transfer_params.engine_facts``, compared by
    :func:`kvsidecar.params.engine_facts_mismatch`): ``vllm.__version__``,
    ``model_config.model`` (the --model string, the identity vLLM's
    NixlConnector hashes: vllm 0.32.0 ``kv_connector/v1/nixl/metadata.py``
    ``compute_nixl_compatibility_hash``), ``attention_backend`` (what the
    workers reported at start; "" before that), and the KV cache dtype
    (``cache_config.cache_dtype``, for "auto" the model's dtype without
    "torch.", as the KV tensors hold it). A fact the config does not carry
    (a test's stand-in) is left empty: not compared."""
    from vllm import __version__

    mc = getattr(vllm_config, "model_config", None)
    cd = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto") or "auto")
    if cd == "auto":
        dt = getattr(mc, "dtype", None)
        cd = str(dt).removeprefix("torch.") if dt is not None else ""
    return params_pb2.EngineFacts(engine="vllm", engine_version=str(__version__),
                                  model=str(getattr(mc, "model", "") or ""), attention_backend=attention_backend,
                                  kv_cache_dtype=cd)


def role_name(role: Any) -> str:
    return getattr(role, "name", str(role))


class ConnectorConfig:
    """The connector's settings, from vLLM's config objects."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any = None) -> None:
        kt = vllm_config.kv_transfer_config
        # vLLM's blocks per layer tensor (KVCacheConfig.num_blocks; the
        # scheduler's and the workers' copies agree).
        self.num_vllm_blocks: int = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        extra = dict(getattr(kt, "kv_connector_extra_config", None) or {})
        warn_unknown_keys(extra)
        self.engine_id: str = extra.get("engine_id") or getattr(kt, "engine_id", None) or ""
        if not self.engine_id:
            raise errors.InvalidArgument(
                "KVSidecarConnector: kv_transfer_config.engine_id (or kv_connector_extra_config.engine_id) is "
                "required: it must equal every sidecar's --engine-id"
            )
        self.socket_dir: str = extra.get("socket_dir") or default_socket_dir()
        self.timeout: float = float(extra.get("call_timeout_seconds", DEFAULT_CALL_TIMEOUT_SECONDS))
        #: Seconds a worker waits at start for its sidecar's socket
        #: (``sidecar_wait_seconds``, default 60; 0: fail at once).
        self.sidecar_wait_seconds: float = sidecar_wait_seconds(extra)
        self.num_blocks: int = int(extra.get("num_blocks", 0))
        self.tp_rank_override: int | None = int(extra["tp_rank"]) if "tp_rank" in extra else None
        role = getattr(kt, "kv_role", None) or "kv_both"
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise errors.InvalidArgument(
                f"KVSidecarConnector: kv_role {role!r} must be kv_producer, kv_consumer or kv_both"
            )
        self.producer = role in ("kv_producer", "kv_both")
        self.consumer = role in ("kv_consumer", "kv_both")
        #: Zero copy asked for (``zero_copy``, or KVSIDECAR_ZERO_COPY=1);
        #: whether it runs is the workers' finding (kvsidecar.vllm.zerocopy).
        self.zero_copy: bool = requested(extra)
        self.free_hold_seconds: float = seconds_setting(
            extra, "free_hold_seconds", DEFAULT_FREE_HOLD_SECONDS,
            "how long zero copy keeps a freed prefix-cache block mapped for a later hit")
        #: The CUDA driver a zero-copy worker imports device pages with.
        self.cuda_library: str = str(extra.get("cuda_library", "libcuda.so.1"))
        #: Decode: refuse a prefill's KV whose engine facts differ from this
        #: engine's (``enforce_handshake_compat``, default True; False loads
        #: it, logging the differences). Never loosens block_size.
        self.enforce_compat: bool = enforce_handshake_compat(extra)
        self.tp_size: int = int(vllm_config.parallel_config.tensor_parallel_size)
        self.block_size: int = int(vllm_config.cache_config.block_size)
        self.vllm_config = vllm_config

    def socket(self, rank: int) -> str:
        return local_socket_path(self.socket_dir, self.engine_id, rank)

    def geometry(self, dtype: Any | None = None, layout: int = common_pb2.LAYOUT_HND) -> common_pb2.ModelGeometry:
        """The model's KV geometry from vLLM's model config (for a sidecar
        started without --model or explicit geometry flags), in ``layout``.
        The KV dtype is ``dtype`` (the KV tensors'), else
        cache_config.cache_dtype, else the model's dtype."""
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        if dtype is None:
            cd = str(getattr(self.vllm_config.cache_config, "cache_dtype", "auto"))
            dtype = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(cd)
        return common_pb2.ModelGeometry(
            model=str(getattr(mc, "model", "")),
            num_layers=int(mc.get_num_layers(pc)),
            num_kv_heads=int(mc.get_total_num_kv_heads()),
            head_dim=int(mc.get_head_size()),
            dtype=dtype_code(dtype if dtype is not None else mc.dtype),
            block_size=self.block_size,
            layout=layout,  # type: ignore[arg-type]
            attention=common_pb2.ATTENTION_GQA,
        )


