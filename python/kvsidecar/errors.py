"""Typed errors of the kvsidecar Python client.

Every error the client raises is a :class:`KVSidecarError` carrying ``code``,
a value of the wire enum ``kvsidecar.v1.Code`` (``common.proto``). An error
reply from the sidecar becomes the subclass of its code, so callers branch
with ``except Busy:`` or on ``err.code``, and where one code is too coarse on
``err.reason`` (``v1.Error.reason``, one of :mod:`kvsidecar.reasons`, generated
from Go's). ``err.message`` is the sidecar's text, which names the offending
value and the rule for people: no code branches on it. Errors the client
detects itself (a bad argument, a broken connection, a deadline) use the
same classes, codes and reasons.
"""

from __future__ import annotations

from kvsidecar.v1 import common_pb2

__all__ = [
    "Aborted",
    "AlreadyExists",
    "BrokenConnection",
    "Busy",
    "CapabilityDenied",
    "DataLoss",
    "GeometryError",
    "IncompatibleModel",
    "Internal",
    "InvalidArgument",
    "KVSidecarError",
    "LeaseExpired",
    "NotFound",
    "OutOfRange",
    "ParamsError",
    "TPMismatch",
    "Timeout",
    "Unavailable",
    "Unsupported",
    "error_for_code",
    "from_proto",
]


class KVSidecarError(Exception):
    """Base of every kvsidecar client error.

    Attributes:
        code: the wire code (``kvsidecar.v1.Code`` value, an int).
        message: the text without the code suffix, for people.
        reason: why, finer than the code: a :mod:`kvsidecar.reasons` value
            (e.g. ``GEOMETRY_REQUIRED``), or ``""`` when the code says all.
            A reason this client does not know is kept as it came.
    """

    #: The code of the class; instances may carry another (an unknown code).
    CODE: int = common_pb2.CODE_INTERNAL

    def __init__(self, message: str, code: int | None = None, *, reason: str = "") -> None:
        self.code = self.CODE if code is None else code
        self.message = message
        self.reason = reason
        super().__init__(f"{message} ({self.code_name})")

    @property
    def code_name(self) -> str:
        """The code's enum name, e.g. ``CODE_BUSY``, or ``CODE_<n>`` if unknown."""
        try:
            return common_pb2.Code.Name(self.code)
        except ValueError:
            return f"CODE_{self.code}"


class InvalidArgument(KVSidecarError):
    """A malformed message or a value that breaks a documented rule."""

    CODE = common_pb2.CODE_INVALID_ARGUMENT


class ParamsError(InvalidArgument):
    """``kv_transfer_params`` that break a rule (Go: ``connector.ParamsError``;
    in a merge, ``connector.PartError``). ``reason`` is always set.

    Attributes:
        field: the JSON field name (``tp_size``) or its path
            (``rank_exports[1].tp_rank``).
        part: the index of the refused part of a merge; None outside one,
            or when no part is to blame.
    """

    def __init__(self, message: str, *, field: str, reason: str, part: int | None = None) -> None:
        super().__init__(message, reason=reason)
        self.field, self.part = field, part


class GeometryError(InvalidArgument):
    """A geometry value that breaks a rule (Go: ``internal/kvgeom.Error``).

    Attributes:
        fields: the wire field names involved, e.g. ``("block_len", "page_size")``.
    """

    def __init__(self, message: str, *, fields: tuple[str, ...]) -> None:
        super().__init__(message)
        self.fields = fields


class NotFound(KVSidecarError):
    """Unknown request id, engine id, descriptor list or block."""

    CODE = common_pb2.CODE_NOT_FOUND


class OutOfRange(KVSidecarError):
    """A descriptor or block id outside registered memory."""

    CODE = common_pb2.CODE_OUT_OF_RANGE


class CapabilityDenied(KVSidecarError):
    """The capability does not cover the named blocks or is forged."""

    CODE = common_pb2.CODE_CAPABILITY_DENIED


class LeaseExpired(KVSidecarError):
    """The request's lease has expired; its blocks may be reused."""

    CODE = common_pb2.CODE_LEASE_EXPIRED


class TPMismatch(KVSidecarError):
    """A TP size other than the one fixed at start."""

    CODE = common_pb2.CODE_TP_MISMATCH


class IncompatibleModel(KVSidecarError):
    """Model geometry, compatibility hash or wire version differ."""

    CODE = common_pb2.CODE_INCOMPATIBLE_MODEL


class Busy(KVSidecarError):
    """Back-pressure or the memory limit: try again later or recompute."""

    CODE = common_pb2.CODE_BUSY


class Aborted(KVSidecarError):
    """The transfer or request was aborted by either side."""

    CODE = common_pb2.CODE_ABORTED


class Internal(KVSidecarError):
    """A bug or a backend failure on the replying side."""

    CODE = common_pb2.CODE_INTERNAL


class Timeout(KVSidecarError, TimeoutError):
    """A deadline passed: the sidecar's, or the client's call timeout."""

    CODE = common_pb2.CODE_TIMEOUT


class Unavailable(KVSidecarError):
    """The sidecar is shutting down, not ready, or has no KV cache yet."""

    CODE = common_pb2.CODE_UNAVAILABLE


class AlreadyExists(KVSidecarError):
    """The object exists (e.g. a KV cache of another geometry)."""

    CODE = common_pb2.CODE_ALREADY_EXISTS


class DataLoss(KVSidecarError):
    """Bytes arrived but do not match their checksum."""

    CODE = common_pb2.CODE_DATA_LOSS


class BrokenConnection(Unavailable):
    """An earlier call on this client failed mid-exchange (timeout, bad or
    missing reply, lost file descriptors): the stream's state is unknown, so
    every later call fails with this error. Connect again."""


class Unsupported(InvalidArgument, NotImplementedError):
    """The client cannot do what was asked here, e.g. map device memory
    without a device handler."""


_BY_CODE: dict[int, type[KVSidecarError]] = {
    cls.CODE: cls
    for cls in (
        InvalidArgument,
        NotFound,
        OutOfRange,
        CapabilityDenied,
        LeaseExpired,
        TPMismatch,
        IncompatibleModel,
        Busy,
        Aborted,
        Internal,
        Timeout,
        Unavailable,
        AlreadyExists,
        DataLoss,
    )
}


def error_for_code(code: int, message: str, reason: str = "") -> KVSidecarError:
    """Returns the typed error of wire code ``code`` carrying ``reason`` (a
    :class:`KVSidecarError` carrying the code for a code this client does not
    know)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return KVSidecarError(message, code, reason=reason)
    return cls(message, reason=reason)


def from_proto(e: common_pb2.Error, who: str = "kvsidecar") -> KVSidecarError:
    """The typed error of a reply's ``v1.Error`` (not ``CODE_OK``): its code's
    class, its reason, and its message prefixed by ``who`` said it."""
    return error_for_code(e.code, f"{who}: {e.message}", e.reason)
