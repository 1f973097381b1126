from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

ATTENTION_GQA: Attention
ATTENTION_MLA: Attention
ATTENTION_UNSPECIFIED: Attention
CODE_ABORTED: Code
CODE_ALREADY_EXISTS: Code
CODE_BUSY: Code
CODE_CAPABILITY_DENIED: Code
CODE_DATA_LOSS: Code
CODE_INCOMPATIBLE_MODEL: Code
CODE_INTERNAL: Code
CODE_INVALID_ARGUMENT: Code
CODE_LEASE_EXPIRED: Code
CODE_NOT_FOUND: Code
CODE_OK: Code
CODE_OUT_OF_RANGE: Code
CODE_TIMEOUT: Code
CODE_TP_MISMATCH: Code
CODE_UNAVAILABLE: Code
DESCRIPTOR: _descriptor.FileDescriptor
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FP8_E4M3: DType
DTYPE_FP8_E5M2: DType
DTYPE_UNSPECIFIED: DType
LAYOUT_H2ND: Layout
LAYOUT_HN2D: Layout
LAYOUT_HND: Layout
LAYOUT_UNSPECIFIED: Layout
WIRE_VERSION_1: WireVersion
WIRE_VERSION_UNSPECIFIED: WireVersion

class Error(_message.Message):
    __slots__ = ["code", "message", "reason"]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: Code
    message: str
    reason: str
    def __init__(self, code: _Optional[_Union[Code, str]] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ModelGeometry(_message.Message):
    __slots__ = ["attention", "block_size", "dtype", "head_dim", "layout", "model", "num_kv_heads", "num_layers"]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    attention: Attention
    block_size: int
    dtype: DType
    head_dim: int
    layout: Layout
    model: str
    num_kv_heads: int
    num_layers: int
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., block_size: _Optional[int] = ..., layout: _Optional[_Union[Layout, str]] = ..., attention: _Optional[_Union[Attention, str]] = ...) -> None: ...

class WireVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class Attention(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
