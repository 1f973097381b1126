from kvsidecar.v1 import common_pb2 as _common_pb2
from kvsidecar.v1 import group_pb2 as _group_pb2
from kvsidecar.v1 import params_pb2 as _params_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor
FINISH_STATUS_ABORTED: FinishStatus
FINISH_STATUS_ERROR: FinishStatus
FINISH_STATUS_LENGTH: FinishStatus
FINISH_STATUS_STOP: FinishStatus
FINISH_STATUS_UNSPECIFIED: FinishStatus

class Abort(_message.Message):
    __slots__ = ["request_id"]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AllocBlocks(_message.Message):
    __slots__ = ["count"]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class AllocBlocksReply(_message.Message):
    __slots__ = ["block_ids", "mappings"]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    mappings: _containers.RepeatedCompositeFieldContainer[PageMapping]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., mappings: _Optional[_Iterable[_Union[PageMapping, _Mapping]]] = ...) -> None: ...

class AvailableReply(_message.Message):
    __slots__ = ["blocks", "over_limit"]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OVER_LIMIT_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    over_limit: bool
    def __init__(self, blocks: _Optional[int] = ..., over_limit: bool = ...) -> None: ...

class CreateKVCache(_message.Message):
    __slots__ = ["geometry", "num_blocks", "ownership", "tp_rank", "tp_size"]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    geometry: _common_pb2.ModelGeometry
    num_blocks: int
    ownership: _group_pb2.Ownership
    tp_rank: int
    tp_size: int
    def __init__(self, geometry: _Optional[_Union[_common_pb2.ModelGeometry, _Mapping]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., ownership: _Optional[_Union[_group_pb2.Ownership, str]] = ...) -> None: ...

class FailedRequest(_message.Message):
    __slots__ = ["block_ids", "error", "request_id"]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    error: _common_pb2.Error
    request_id: str
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class FreeBlocks(_message.Message):
    __slots__ = ["block_ids"]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetFinished(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class GetFinishedReply(_message.Message):
    __slots__ = ["done_recving", "done_sending", "failed", "invalid_block_ids"]
    DONE_RECVING_FIELD_NUMBER: _ClassVar[int]
    DONE_SENDING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    INVALID_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    done_recving: _containers.RepeatedScalarFieldContainer[str]
    done_sending: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.RepeatedCompositeFieldContainer[FailedRequest]
    invalid_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, done_sending: _Optional[_Iterable[str]] = ..., done_recving: _Optional[_Iterable[str]] = ..., failed: _Optional[_Iterable[_Union[FailedRequest, _Mapping]]] = ..., invalid_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVCacheInfo(_message.Message):
    __slots__ = ["block_len", "device_memory", "engine_id", "geometry", "heads_per_rank", "mappings", "num_blocks", "num_regions", "ownership", "page_size", "region_len", "tp_rank", "tp_size"]
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGION_LEN_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_len: int
    device_memory: bool
    engine_id: str
    geometry: _common_pb2.ModelGeometry
    heads_per_rank: int
    mappings: _containers.RepeatedCompositeFieldContainer[PageMapping]
    num_blocks: int
    num_regions: int
    ownership: _group_pb2.Ownership
    page_size: int
    region_len: int
    tp_rank: int
    tp_size: int
    def __init__(self, geometry: _Optional[_Union[_common_pb2.ModelGeometry, _Mapping]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., heads_per_rank: _Optional[int] = ..., block_len: _Optional[int] = ..., region_len: _Optional[int] = ..., num_regions: _Optional[int] = ..., page_size: _Optional[int] = ..., mappings: _Optional[_Iterable[_Union[PageMapping, _Mapping]]] = ..., engine_id: _Optional[str] = ..., device_memory: bool = ..., ownership: _Optional[_Union[_group_pb2.Ownership, str]] = ...) -> None: ...

class LocalReply(_message.Message):
    __slots__ = ["alloc", "available", "cache", "call_id", "error", "get_finished", "mappings", "request_finished", "stats"]
    ALLOC_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GET_FINISHED_FIELD_NUMBER: _ClassVar[int]
    MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FINISHED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    alloc: AllocBlocksReply
    available: AvailableReply
    cache: KVCacheInfo
    call_id: int
    error: _common_pb2.Error
    get_finished: GetFinishedReply
    mappings: MappingDelta
    request_finished: RequestFinishedReply
    stats: StatsReply
    def __init__(self, call_id: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., cache: _Optional[_Union[KVCacheInfo, _Mapping]] = ..., alloc: _Optional[_Union[AllocBlocksReply, _Mapping]] = ..., available: _Optional[_Union[AvailableReply, _Mapping]] = ..., request_finished: _Optional[_Union[RequestFinishedReply, _Mapping]] = ..., get_finished: _Optional[_Union[GetFinishedReply, _Mapping]] = ..., stats: _Optional[_Union[StatsReply, _Mapping]] = ..., mappings: _Optional[_Union[MappingDelta, _Mapping]] = ...) -> None: ...

class LocalRequest(_message.Message):
    __slots__ = ["abort", "alloc", "available", "call_id", "create", "free", "get_finished", "request_finished", "set_limit", "start_load", "stats", "sync", "wire_version"]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ALLOC_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    GET_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FINISHED_FIELD_NUMBER: _ClassVar[int]
    SET_LIMIT_FIELD_NUMBER: _ClassVar[int]
    START_LOAD_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    abort: Abort
    alloc: AllocBlocks
    available: bool
    call_id: int
    create: CreateKVCache
    free: FreeBlocks
    get_finished: GetFinished
    request_finished: RequestFinished
    set_limit: SetMemoryLimit
    start_load: StartLoad
    stats: Stats
    sync: bool
    wire_version: _common_pb2.WireVersion
    def __init__(self, wire_version: _Optional[_Union[_common_pb2.WireVersion, str]] = ..., call_id: _Optional[int] = ..., create: _Optional[_Union[CreateKVCache, _Mapping]] = ..., alloc: _Optional[_Union[AllocBlocks, _Mapping]] = ..., free: _Optional[_Union[FreeBlocks, _Mapping]] = ..., available: bool = ..., set_limit: _Optional[_Union[SetMemoryLimit, _Mapping]] = ..., request_finished: _Optional[_Union[RequestFinished, _Mapping]] = ..., start_load: _Optional[_Union[StartLoad, _Mapping]] = ..., get_finished: _Optional[_Union[GetFinished, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., sync: bool = ...) -> None: ...

class MappingDelta(_message.Message):
    __slots__ = ["map", "num_fds", "unmapped_pages"]
    MAP_FIELD_NUMBER: _ClassVar[int]
    NUM_FDS_FIELD_NUMBER: _ClassVar[int]
    UNMAPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    map: _containers.RepeatedCompositeFieldContainer[PageMapping]
    num_fds: int
    unmapped_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, map: _Optional[_Iterable[_Union[PageMapping, _Mapping]]] = ..., unmapped_pages: _Optional[_Iterable[int]] = ..., num_fds: _Optional[int] = ...) -> None: ...

class PageMapping(_message.Message):
    __slots__ = ["fd_index", "fd_offset", "len", "region", "region_offset"]
    FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    FD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    fd_index: int
    fd_offset: int
    len: int
    region: int
    region_offset: int
    def __init__(self, region: _Optional[int] = ..., region_offset: _Optional[int] = ..., len: _Optional[int] = ..., fd_index: _Optional[int] = ..., fd_offset: _Optional[int] = ...) -> None: ...

class RequestFinished(_message.Message):
    __slots__ = ["block_ids", "params", "request_id", "status"]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _params_pb2.KVTransferParams
    request_id: str
    status: FinishStatus
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., status: _Optional[_Union[FinishStatus, str]] = ..., params: _Optional[_Union[_params_pb2.KVTransferParams, _Mapping]] = ...) -> None: ...

class RequestFinishedReply(_message.Message):
    __slots__ = ["delay_free", "params"]
    DELAY_FREE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    delay_free: bool
    params: _params_pb2.KVTransferParams
    def __init__(self, params: _Optional[_Union[_params_pb2.KVTransferParams, _Mapping]] = ..., delay_free: bool = ...) -> None: ...

class SetMemoryLimit(_message.Message):
    __slots__ = ["bytes", "strict"]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    strict: bool
    def __init__(self, bytes: _Optional[int] = ..., strict: bool = ...) -> None: ...

class StartLoad(_message.Message):
    __slots__ = ["meta"]
    META_FIELD_NUMBER: _ClassVar[int]
    meta: _params_pb2.ReqMeta
    def __init__(self, meta: _Optional[_Union[_params_pb2.ReqMeta, _Mapping]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ["blocks_total", "blocks_used", "bytes_mapped", "cache_ready", "device_bytes", "engine_attached", "engine_session", "leases_held", "loads_in_flight", "memory_limit_bytes", "num_regions", "page_size", "pages_mapped", "reservation_bytes", "reserve_pages"]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MAPPED_FIELD_NUMBER: _ClassVar[int]
    CACHE_READY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASES_HELD_FIELD_NUMBER: _ClassVar[int]
    LOADS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    PAGES_MAPPED_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_PAGES_FIELD_NUMBER: _ClassVar[int]
    blocks_total: int
    blocks_used: int
    bytes_mapped: int
    cache_ready: bool
    device_bytes: int
    engine_attached: bool
    engine_session: int
    leases_held: int
    loads_in_flight: int
    memory_limit_bytes: int
    num_regions: int
    page_size: int
    pages_mapped: int
    reservation_bytes: int
    reserve_pages: int
    def __init__(self, pages_mapped: _Optional[int] = ..., bytes_mapped: _Optional[int] = ..., blocks_used: _Optional[int] = ..., blocks_total: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., leases_held: _Optional[int] = ..., loads_in_flight: _Optional[int] = ..., device_bytes: _Optional[int] = ..., reserve_pages: _Optional[int] = ..., reservation_bytes: _Optional[int] = ..., page_size: _Optional[int] = ..., num_regions: _Optional[int] = ..., cache_ready: bool = ..., engine_attached: bool = ..., engine_session: _Optional[int] = ...) -> None: ...

class FinishStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
