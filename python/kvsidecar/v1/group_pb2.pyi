from kvsidecar.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor
OWNERSHIP_COORDINATED: Ownership
OWNERSHIP_LOCAL: Ownership
OWNERSHIP_UNSPECIFIED: Ownership

class GroupRequest(_message.Message):
    __slots__ = ["engine_id", "from_rank", "page_op", "ping", "resync", "to_rank", "tp_size", "wire_version"]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_RANK_FIELD_NUMBER: _ClassVar[int]
    PAGE_OP_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    TO_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    from_rank: int
    page_op: PageOp
    ping: bool
    resync: bool
    to_rank: int
    tp_size: int
    wire_version: _common_pb2.WireVersion
    def __init__(self, wire_version: _Optional[_Union[_common_pb2.WireVersion, str]] = ..., engine_id: _Optional[str] = ..., tp_size: _Optional[int] = ..., from_rank: _Optional[int] = ..., to_rank: _Optional[int] = ..., page_op: _Optional[_Union[PageOp, _Mapping]] = ..., ping: bool = ..., resync: bool = ...) -> None: ...

class GroupResponse(_message.Message):
    __slots__ = ["error", "tp_rank", "tp_size"]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    tp_rank: int
    tp_size: int
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class PageOp(_message.Message):
    __slots__ = ["blocks", "kind", "pages"]
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = []
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KIND_FREE: PageOp.Kind
    KIND_MAP: PageOp.Kind
    KIND_SYNC: PageOp.Kind
    KIND_UNMAP: PageOp.Kind
    KIND_UNSPECIFIED: PageOp.Kind
    PAGES_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedScalarFieldContainer[int]
    kind: PageOp.Kind
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[PageOp.Kind, str]] = ..., pages: _Optional[_Iterable[int]] = ..., blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class Ownership(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
