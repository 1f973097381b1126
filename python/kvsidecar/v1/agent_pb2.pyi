from kvsidecar.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor
PAGE_KIND_CUDA_POSIX_FD: PageKind
PAGE_KIND_MEMFD: PageKind
PAGE_KIND_UNSPECIFIED: PageKind
REGION_KIND_COMPOUND: RegionKind
REGION_KIND_K: RegionKind
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_V: RegionKind

class AgentMetadata(_message.Message):
    __slots__ = ["agent_name", "block_size", "capability_key_id", "device_id", "engine_id", "geometry", "heads_per_rank", "incarnation", "model_hash", "num_blocks", "pp_rank", "quic_addr", "regions", "same_host", "tp_rank", "tp_size", "wire_version"]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    QUIC_ADDR_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    block_size: int
    capability_key_id: str
    device_id: int
    engine_id: str
    geometry: _common_pb2.ModelGeometry
    heads_per_rank: int
    incarnation: int
    model_hash: bytes
    num_blocks: int
    pp_rank: int
    quic_addr: str
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    same_host: SameHost
    tp_rank: int
    tp_size: int
    wire_version: _common_pb2.WireVersion
    def __init__(self, wire_version: _Optional[_Union[_common_pb2.WireVersion, str]] = ..., engine_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., incarnation: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., device_id: _Optional[int] = ..., model_hash: _Optional[bytes] = ..., geometry: _Optional[_Union[_common_pb2.ModelGeometry, _Mapping]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., heads_per_rank: _Optional[int] = ..., quic_addr: _Optional[str] = ..., capability_key_id: _Optional[str] = ..., same_host: _Optional[_Union[SameHost, _Mapping]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ["dialer", "expected_engine_id", "expected_tp_rank", "expected_tp_size", "wire_version"]
    DIALER_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    dialer: AgentMetadata
    expected_engine_id: str
    expected_tp_rank: int
    expected_tp_size: int
    wire_version: _common_pb2.WireVersion
    def __init__(self, wire_version: _Optional[_Union[_common_pb2.WireVersion, str]] = ..., expected_engine_id: _Optional[str] = ..., expected_tp_rank: _Optional[int] = ..., expected_tp_size: _Optional[int] = ..., dialer: _Optional[_Union[AgentMetadata, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ["error", "metadata"]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    metadata: AgentMetadata
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., metadata: _Optional[_Union[AgentMetadata, _Mapping]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ["base", "block_len", "dev_id", "kind", "layer", "len", "page_size"]
    BASE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    DEV_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    base: int
    block_len: int
    dev_id: int
    kind: RegionKind
    layer: int
    len: int
    page_size: int
    def __init__(self, base: _Optional[int] = ..., len: _Optional[int] = ..., block_len: _Optional[int] = ..., dev_id: _Optional[int] = ..., layer: _Optional[int] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., page_size: _Optional[int] = ...) -> None: ...

class SameHost(_message.Message):
    __slots__ = ["host_id", "page_kind", "socket", "token"]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_KIND_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    page_kind: PageKind
    socket: str
    token: bytes
    def __init__(self, host_id: _Optional[str] = ..., socket: _Optional[str] = ..., token: _Optional[bytes] = ..., page_kind: _Optional[_Union[PageKind, str]] = ...) -> None: ...

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class PageKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
