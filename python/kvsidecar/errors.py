"""Typed errors of the kvsidecar Python client.

Every error the client raises is a :class:`KVSidecarError` carrying ``code``,
a value of the wire enum ``kvsidecar.v1.Code`` (``common.proto``). An error
reply from the sidecar becomes the subclass of its code, so callers branch
with ``except Busy:`` or on ``err.code``; ``err.message`` is the sidecar's
text, which names the offending value and the rule. Errors the client
detects itself (a bad argument, a broken connection, a deadline) use the
same classes and codes.
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
    "IncompatibleModel",
    "Internal",
    "InvalidArgument",
    "KVSidecarError",
    "LeaseExpired",
    "NotFound",
    "OutOfRange",
    "TPMismatch",
    "Timeout",
    "Unavailable",
    "Unsupported",
    "error_for_code",
]


class KVSidecarError(Exception):
    """Base of every kvsidecar client error.

    Attributes:
        code: the wire code (``kvsidecar.v1.Code`` value, an int).
        message: the text without the code suffix.
    """

    #: The code of the class; instances may carry another (an unknown code).
    CODE: int = common_pb2.CODE_INTERNAL

    def __init__(self, message: str, code: int | None = None) -> None:
        self.code = self.CODE if code is None else code
        self.message = message
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


def error_for_code(code: int, message: str) -> KVSidecarError:
    """Returns the typed error of wire code ``code`` (a :class:`KVSidecarError`
    carrying the code for a code this client does not know)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return KVSidecarError(message, code)
    return cls(message)
