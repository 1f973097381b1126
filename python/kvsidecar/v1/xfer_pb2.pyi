from kvsidecar.v1 import agent_pb2 as _agent_pb2
from kvsidecar.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor
XFER_OP_READ: XferOp
XFER_OP_UNSPECIFIED: XferOp
XFER_OP_WRITE: XferOp

class BlockDescs(_message.Message):
    __slots__ = ["block_ids", "first_region", "len", "num_regions", "offset"]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_REGION_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_region: int
    len: int
    num_regions: int
    offset: int
    def __init__(self, first_region: _Optional[int] = ..., num_regions: _Optional[int] = ..., offset: _Optional[int] = ..., len: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Descriptor(_message.Message):
    __slots__ = ["addr", "dev_id", "len"]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    DEV_ID_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    addr: int
    dev_id: int
    len: int
    def __init__(self, addr: _Optional[int] = ..., len: _Optional[int] = ..., dev_id: _Optional[int] = ...) -> None: ...

class DescriptorList(_message.Message):
    __slots__ = ["descs"]
    DESCS_FIELD_NUMBER: _ClassVar[int]
    descs: _containers.RepeatedCompositeFieldContainer[Descriptor]
    def __init__(self, descs: _Optional[_Iterable[_Union[Descriptor, _Mapping]]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ["capabilities", "consumer_engine_id", "consumer_tp_rank", "export_ids", "request_ids"]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPORT_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    capabilities: _containers.RepeatedScalarFieldContainer[bytes]
    consumer_engine_id: str
    consumer_tp_rank: int
    export_ids: _containers.RepeatedScalarFieldContainer[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., consumer_engine_id: _Optional[str] = ..., consumer_tp_rank: _Optional[int] = ..., capabilities: _Optional[_Iterable[bytes]] = ..., export_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ["error", "lease_expires_unix_ms"]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    lease_expires_unix_ms: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., lease_expires_unix_ms: _Optional[_Iterable[int]] = ...) -> None: ...

class IndexedDescs(_message.Message):
    __slots__ = ["dlist_id", "indices"]
    DLIST_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    dlist_id: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dlist_id: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class LocalHello(_message.Message):
    __slots__ = ["error", "page_kinds", "token", "wire_version"]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PAGE_KINDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    page_kinds: _containers.RepeatedScalarFieldContainer[_agent_pb2.PageKind]
    token: bytes
    wire_version: _common_pb2.WireVersion
    def __init__(self, wire_version: _Optional[_Union[_common_pb2.WireVersion, str]] = ..., token: _Optional[bytes] = ..., page_kinds: _Optional[_Iterable[_Union[_agent_pb2.PageKind, str]]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class LocalProgress(_message.Message):
    __slots__ = ["bytes", "done", "error"]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    done: bool
    error: _common_pb2.Error
    def __init__(self, bytes: _Optional[int] = ..., done: bool = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class Notification(_message.Message):
    __slots__ = ["capability", "consumer_count", "consumer_engine_id", "consumer_tp_rank", "export_id", "payload", "request_id"]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_COUNT_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    capability: bytes
    consumer_count: int
    consumer_engine_id: str
    consumer_tp_rank: int
    export_id: int
    payload: bytes
    request_id: str
    def __init__(self, request_id: _Optional[str] = ..., capability: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., consumer_engine_id: _Optional[str] = ..., consumer_tp_rank: _Optional[int] = ..., consumer_count: _Optional[int] = ..., export_id: _Optional[int] = ...) -> None: ...

class NotificationAck(_message.Message):
    __slots__ = ["error"]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class PeerExpect(_message.Message):
    __slots__ = ["block_len", "capability_key_id", "engine_id", "geometry", "incarnation", "layout", "model_hash", "num_regions", "tp_rank", "tp_size"]
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_len: int
    capability_key_id: str
    engine_id: str
    geometry: _common_pb2.ModelGeometry
    incarnation: int
    layout: _containers.RepeatedCompositeFieldContainer[RegionShape]
    model_hash: bytes
    num_regions: int
    tp_rank: int
    tp_size: int
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., model_hash: _Optional[bytes] = ..., geometry: _Optional[_Union[_common_pb2.ModelGeometry, _Mapping]] = ..., num_regions: _Optional[int] = ..., block_len: _Optional[int] = ..., incarnation: _Optional[int] = ..., capability_key_id: _Optional[str] = ..., layout: _Optional[_Iterable[_Union[RegionShape, _Mapping]]] = ...) -> None: ...

class PeerRequest(_message.Message):
    __slots__ = ["handshake", "heartbeat", "notification", "prep", "unprep", "wire_version", "xfer"]
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    PREP_FIELD_NUMBER: _ClassVar[int]
    UNPREP_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    XFER_FIELD_NUMBER: _ClassVar[int]
    handshake: _agent_pb2.HandshakeRequest
    heartbeat: Heartbeat
    notification: Notification
    prep: PrepDescList
    unprep: UnprepDescList
    wire_version: _common_pb2.WireVersion
    xfer: XferRequest
    def __init__(self, wire_version: _Optional[_Union[_common_pb2.WireVersion, str]] = ..., handshake: _Optional[_Union[_agent_pb2.HandshakeRequest, _Mapping]] = ..., prep: _Optional[_Union[PrepDescList, _Mapping]] = ..., xfer: _Optional[_Union[XferRequest, _Mapping]] = ..., notification: _Optional[_Union[Notification, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., unprep: _Optional[_Union[UnprepDescList, _Mapping]] = ...) -> None: ...

class PeerResponse(_message.Message):
    __slots__ = ["handshake", "heartbeat", "notification", "prep", "shared", "unprep", "xfer"]
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    PREP_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    UNPREP_FIELD_NUMBER: _ClassVar[int]
    XFER_FIELD_NUMBER: _ClassVar[int]
    handshake: _agent_pb2.HandshakeResponse
    heartbeat: HeartbeatAck
    notification: NotificationAck
    prep: _common_pb2.Error
    shared: SharedPages
    unprep: _common_pb2.Error
    xfer: XferStatus
    def __init__(self, handshake: _Optional[_Union[_agent_pb2.HandshakeResponse, _Mapping]] = ..., prep: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., xfer: _Optional[_Union[XferStatus, _Mapping]] = ..., notification: _Optional[_Union[NotificationAck, _Mapping]] = ..., heartbeat: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., unprep: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., shared: _Optional[_Union[SharedPages, _Mapping]] = ...) -> None: ...

class PrepDescList(_message.Message):
    __slots__ = ["descs", "dlist_id"]
    DESCS_FIELD_NUMBER: _ClassVar[int]
    DLIST_ID_FIELD_NUMBER: _ClassVar[int]
    descs: DescriptorList
    dlist_id: int
    def __init__(self, dlist_id: _Optional[int] = ..., descs: _Optional[_Union[DescriptorList, _Mapping]] = ...) -> None: ...

class RegionShape(_message.Message):
    __slots__ = ["block_len", "kind", "layer"]
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    block_len: int
    kind: _agent_pb2.RegionKind
    layer: int
    def __init__(self, layer: _Optional[int] = ..., kind: _Optional[_Union[_agent_pb2.RegionKind, str]] = ..., block_len: _Optional[int] = ...) -> None: ...

class SharedPage(_message.Message):
    __slots__ = ["addr", "file", "file_offset", "len"]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    FILE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    addr: int
    file: int
    file_offset: int
    len: int
    def __init__(self, addr: _Optional[int] = ..., len: _Optional[int] = ..., file: _Optional[int] = ..., file_offset: _Optional[int] = ...) -> None: ...

class SharedPages(_message.Message):
    __slots__ = ["kind", "num_files", "pages", "spans"]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_FILES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    kind: _agent_pb2.PageKind
    num_files: int
    pages: _containers.RepeatedCompositeFieldContainer[SharedPage]
    spans: DescriptorList
    def __init__(self, kind: _Optional[_Union[_agent_pb2.PageKind, str]] = ..., pages: _Optional[_Iterable[_Union[SharedPage, _Mapping]]] = ..., num_files: _Optional[int] = ..., spans: _Optional[_Union[DescriptorList, _Mapping]] = ...) -> None: ...

class UnprepDescList(_message.Message):
    __slots__ = ["dlist_id"]
    DLIST_ID_FIELD_NUMBER: _ClassVar[int]
    dlist_id: int
    def __init__(self, dlist_id: _Optional[int] = ...) -> None: ...

class XferRequest(_message.Message):
    __slots__ = ["blocks", "capability", "checksum", "consumer_engine_id", "consumer_tp_rank", "expect", "export_id", "indexed", "list", "op", "request_id", "total_len", "xfer_id"]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    INDEXED_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LEN_FIELD_NUMBER: _ClassVar[int]
    XFER_ID_FIELD_NUMBER: _ClassVar[int]
    blocks: BlockDescs
    capability: bytes
    checksum: bool
    consumer_engine_id: str
    consumer_tp_rank: int
    expect: PeerExpect
    export_id: int
    indexed: IndexedDescs
    list: DescriptorList
    op: XferOp
    request_id: str
    total_len: int
    xfer_id: int
    def __init__(self, op: _Optional[_Union[XferOp, str]] = ..., request_id: _Optional[str] = ..., capability: _Optional[bytes] = ..., indexed: _Optional[_Union[IndexedDescs, _Mapping]] = ..., list: _Optional[_Union[DescriptorList, _Mapping]] = ..., blocks: _Optional[_Union[BlockDescs, _Mapping]] = ..., checksum: bool = ..., xfer_id: _Optional[int] = ..., total_len: _Optional[int] = ..., export_id: _Optional[int] = ..., expect: _Optional[_Union[PeerExpect, _Mapping]] = ..., consumer_engine_id: _Optional[str] = ..., consumer_tp_rank: _Optional[int] = ...) -> None: ...

class XferStatus(_message.Message):
    __slots__ = ["bytes", "checksums", "error"]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    error: _common_pb2.Error
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., bytes: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class XferOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
