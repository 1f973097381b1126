from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineFacts(_message.Message):
    __slots__ = ["attention_backend", "engine", "engine_version", "kv_cache_dtype", "model"]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    attention_backend: str
    engine: str
    engine_version: str
    kv_cache_dtype: str
    model: str
    def __init__(self, engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., model: _Optional[str] = ..., attention_backend: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ["block_size", "capability", "checksums", "do_remote_decode", "do_remote_prefill", "engine_facts", "expected_consumers", "lease_expires_unix_ms", "prompt_tokens", "rank_exports", "remote_block_ids", "remote_engine_id", "remote_host", "remote_incarnation", "remote_port", "remote_rank_addrs", "remote_request_id", "token_digests", "tp_size"]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FACTS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANK_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_RANK_ADDRS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    capability: bytes
    checksums: bool
    do_remote_decode: bool
    do_remote_prefill: bool
    engine_facts: EngineFacts
    expected_consumers: int
    lease_expires_unix_ms: int
    prompt_tokens: int
    rank_exports: _containers.RepeatedCompositeFieldContainer[RankExport]
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    remote_engine_id: str
    remote_host: str
    remote_incarnation: int
    remote_port: int
    remote_rank_addrs: _containers.RepeatedScalarFieldContainer[str]
    remote_request_id: str
    token_digests: bytes
    tp_size: int
    def __init__(self, do_remote_prefill: bool = ..., do_remote_decode: bool = ..., remote_engine_id: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ..., tp_size: _Optional[int] = ..., remote_rank_addrs: _Optional[_Iterable[str]] = ..., remote_incarnation: _Optional[int] = ..., capability: _Optional[bytes] = ..., lease_expires_unix_ms: _Optional[int] = ..., expected_consumers: _Optional[int] = ..., rank_exports: _Optional[_Iterable[_Union[RankExport, _Mapping]]] = ..., block_size: _Optional[int] = ..., checksums: bool = ..., prompt_tokens: _Optional[int] = ..., token_digests: _Optional[bytes] = ..., engine_facts: _Optional[_Union[EngineFacts, _Mapping]] = ...) -> None: ...

class RankExport(_message.Message):
    __slots__ = ["block_checksums", "block_ids", "capability", "capability_key_id", "checksum_heads", "export_id", "tp_rank"]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    block_checksums: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    capability: bytes
    capability_key_id: str
    checksum_heads: int
    export_id: int
    tp_rank: int
    def __init__(self, tp_rank: _Optional[int] = ..., export_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., capability: _Optional[bytes] = ..., capability_key_id: _Optional[str] = ..., block_checksums: _Optional[bytes] = ..., checksum_heads: _Optional[int] = ...) -> None: ...

class ReqMeta(_message.Message):
    __slots__ = ["local_block_ids", "local_surplus_blocks", "params", "remote_hit_blocks", "request_id", "token_digests"]
    LOCAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SURPLUS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    local_block_ids: _containers.RepeatedScalarFieldContainer[int]
    local_surplus_blocks: int
    params: KVTransferParams
    remote_hit_blocks: int
    request_id: str
    token_digests: bytes
    def __init__(self, request_id: _Optional[str] = ..., local_block_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[KVTransferParams, _Mapping]] = ..., remote_hit_blocks: _Optional[int] = ..., local_surplus_blocks: _Optional[int] = ..., token_digests: _Optional[bytes] = ...) -> None: ...
