"""The errors every part of the server raises, in a vocabulary no protocol owns.

An `SlcError` carries a stable snake_case `code` (what the client reads, docs/api.md), a `kind`
(the class of failure) and a message. Each front maps the kind to its own status: HTTP
(serving/http/errors.py) to a status code and the JSON envelope, gRPC (serving/grpc/server.py) to a
grpc.StatusCode with the code in the message. Nothing here knows either protocol.
"""
from __future__ import annotations

from enum import Enum
from typing import Optional


class Kind(str, Enum):
    """The class of a failure; one front status each."""

    BAD_REQUEST = "bad_request"  # the request cannot be parsed
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # the request contradicts the state it needs (a name taken by a trained class, a bundle folder changed)
    TIMEOUT = "timeout"  # the request itself did not arrive in time
    TOO_LARGE = "too_large"
    UNSUPPORTED_MEDIA = "unsupported_media"
    INVALID = "invalid"  # parsed, but not a valid request
    OVERLOADED = "overloaded"  # retry after `retry_after` s
    UNAVAILABLE = "unavailable"  # not ready, draining, or a store unreachable
    DEADLINE = "deadline"  # not answered within the request deadline
    STORAGE_FULL = "storage_full"  # a write that could not be committed; nothing was written
    INTERNAL = "internal"  # a bug


class SlcError(Exception):
    """An expected failure: its kind, a stable snake_case code, a message, and (for retriable
    kinds) the seconds after which a retry makes sense."""

    kind = Kind.INTERNAL
    code = "internal_error"

    def __init__(self, message: str, *, code: Optional[str] = None, kind: Optional[Kind] = None,
                 retry_after: Optional[int] = None):
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        if kind is not None:
            self.kind = kind
        self.retry_after = None if retry_after is None else max(1, int(retry_after))


class BadRequest(SlcError):
    kind, code = Kind.BAD_REQUEST, "bad_request"


class Unauthorized(SlcError):
    kind, code = Kind.UNAUTHENTICATED, "unauthorized"


class Forbidden(SlcError):
    kind, code = Kind.FORBIDDEN, "forbidden"


class NotFound(SlcError):
    kind, code = Kind.NOT_FOUND, "not_found"


class Conflict(SlcError):
    kind, code = Kind.CONFLICT, "conflict"


class RequestTimeout(SlcError):
    kind, code = Kind.TIMEOUT, "request_timeout"


class PayloadTooLarge(SlcError):
    kind, code = Kind.TOO_LARGE, "payload_too_large"


class UnsupportedMediaType(SlcError):
    kind, code = Kind.UNSUPPORTED_MEDIA, "unsupported_media_type"


class InvalidInput(SlcError):
    kind, code = Kind.INVALID, "invalid_input"


class Overloaded(SlcError):
    """The batch queue is full: retry after `retry_after` seconds."""

    kind, code = Kind.OVERLOADED, "overloaded"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, retry_after=retry_after)


class InsufficientStorage(SlcError):
    """A write that could not be committed for lack of space; nothing was written."""

    kind, code = Kind.STORAGE_FULL, "insufficient_storage"


class NotReady(SlcError):
    kind, code = Kind.UNAVAILABLE, "not_ready"


class GalleryDown(SlcError):
    """The shared gallery database cannot be reached: retry (other routes keep answering)."""

    kind, code = Kind.UNAVAILABLE, "gallery_unavailable"

    def __init__(self, message: str):
        super().__init__(message, retry_after=1)


class StoreDown(SlcError):
    """The store refuses writes for now (read-only, locked past its timeout, an I/O error): nothing was
    written; reads still answer; retry after `retry_after` seconds."""

    kind, code = Kind.UNAVAILABLE, "store_unavailable"
    RETRY_AFTER_S = 5

    def __init__(self, message: str):
        super().__init__(message, retry_after=self.RETRY_AFTER_S)


class DeadlineExceeded(SlcError):
    kind, code = Kind.DEADLINE, "deadline_exceeded"
