"""HTTP/1.1 transport limits uvicorn does not have: a header read timeout (a client that opens a
connection, or starts a request, and never finishes its headers is cut off), a header size limit,
JSON answers for the protocol's own refusals (malformed HTTP), each counted in /metrics, and a
lingering close: a connection closed while its request is still arriving (413 on a body over the
limit, 431 on headers) is half-closed and drained for a moment first, so the client reads the
answer instead of a TCP reset (closing a socket with unread input sends RST, which discards the
answer from the client's receive buffer; nginx and Apache linger for the same reason).

Cheap on the ordinary request: a timer is armed when a connection opens (until its first request's
headers) and when a request's headers do not arrive in one read; headers that come whole in one
read, as nearly all do, cost one `find` and no timer.

A subclass of uvicorn's httptools protocol, passed as `http=` to uvicorn.Config by
`guarded_protocol(...)`. The body has its own read timeout (serving/http/body_limit.py),
which runs inside the app where the error envelope is at hand.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def raw_envelope(status: int, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 response carrying the error envelope; the connection is closed after it."""
    body = orjson.dumps({"error": {"code": code, "message": message}})
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, _REASONS.get(status, b"Error"), len(body)))
    return head + body


class _LingeringTransport:
    """The connection's transport, whose close() lingers while the request is still arriving:
    send what is buffered, half-close (FIN), then read and discard until the client closes, goes
    quiet for `quiet_s`, or `max_s` have passed. Everything else is the real transport."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 mid_request: Callable[[], bool], max_s: float = 5.0, quiet_s: float = 1.0):
        self._real, self._loop, self._mid_request = transport, loop, mid_request
        self._max_s, self._quiet_s = max_s, quiet_s
        self.lingering = False
        self._quiet: Optional[asyncio.TimerHandle] = None
        self._limit: Optional[asyncio.TimerHandle] = None

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def is_closing(self) -> bool:
        return self.lingering or self._real.is_closing()

    def close(self) -> None:
        if self.lingering or self._real.is_closing():
            return
        if not self._mid_request() or not self._real.can_write_eof():
            self._real.close()
            return
        self.lingering = True
        self._real.write_eof()       # the answer goes out, then FIN
        self._real.resume_reading()  # uvicorn's flow control may have paused it
        self._limit = self._loop.call_later(self._max_s, self.finish, True)
        self.discard()

    def discard(self, data: bytes = b"") -> None:
        """Input that arrives while lingering: thrown away; it only re-arms the quiet timer."""
        if self._quiet is not None:
            self._quiet.cancel()
        self._quiet = self._loop.call_later(self._quiet_s, self.finish)

    def finish(self, hard: bool = False) -> None:
        """Close; `hard` (the time limit): abort, even with output a client never reads."""
        for timer in (self._quiet, self._limit):
            if timer is not None:
                timer.cancel()
        self._quiet = self._limit = None
        self.lingering = False
        if hard:
            self._real.abort()
        else:
            self._real.close()


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (set on the subclass by guarded_protocol)."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    on_refused: Optional[Callable[[int, str], None]] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._linger = _LingeringTransport(transport, self.loop, self._mid_request)
        self.transport = self._linger  # type: ignore[assignment]  # what uvicorn closes, and request cycles get
        self._header_bytes = 0
        self._tail = b""
        self._in_headers = True
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._timer_after_response = False  # next request's header bytes came while one was in flight
        self._partial_headers = False  # a request has begun (its first byte parsed) and its headers are not complete
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        if self._in_headers and not self.transport.is_closing():
            self._refuse(408, "request_timeout",
                         f"the request headers did not arrive within {self.header_timeout_s:g} s")

    def _refuse(self, status: int, code: str, message: str) -> None:
        if self.on_refused is not None:
            self.on_refused(status, code)
        self.transport.write(raw_envelope(status, code, message))
        self.transport.close()

    def _mid_request(self) -> bool:
        """True while a request's headers or body are still arriving."""
        return not self._in_headers or self._header_bytes > 0

    def data_received(self, data: bytes) -> None:
        if self._linger.lingering:
            self._linger.discard(data)
            return
        if self._in_headers:  # the header block ends at the first blank line, maybe inside this chunk
            end = (self._tail + data if self._tail else data).find(b"\r\n\r\n")
            size = self._header_bytes + (len(data) if end < 0 else end + 4 - len(self._tail))
            self._header_bytes += len(data)
            if size > self.max_header_bytes:
                self._refuse(431, "headers_too_large", f"request headers are larger than {self.max_header_bytes} bytes")
                return
            self._tail = data[-3:]
        super().data_received(data)
        if self._partial_headers and self._header_timer is None and not self.transport.is_closing():
            # headers still incomplete after this chunk: they have header_timeout_s, counted once no
            # request is in flight (a slow answer is not the client's delay). Between requests
            # with no byte sent, the connection is idle: uvicorn's keep-alive timeout closes it.
            if self._request_in_flight():
                self._timer_after_response = True
            else:
                self._arm_header_timer()

    def _request_in_flight(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._timer_after_response and self._in_headers and self._header_timer is None \
                and not self.transport.is_closing():
            self._arm_header_timer()
        self._timer_after_response = False

    def on_message_complete(self) -> None:
        # the request is fully received (body included): what arrives next is the next request's headers
        self._in_headers, self._header_bytes, self._tail = True, 0, b""
        super().on_message_complete()

    def on_message_begin(self) -> None:
        self._partial_headers = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_headers, self._partial_headers = False, False
        self._disarm()
        super().on_headers_complete()

    def eof_received(self) -> bool | None:
        if self._linger.lingering:  # the client has sent everything and read our answer's FIN
            self._linger.finish()
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._linger.finish()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP: the envelope instead of uvicorn's plain text."""
        self._refuse(400, "malformed_http", f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})")


def guarded_protocol(header_timeout_s: float, max_header_bytes: int,
                     on_refused: Optional[Callable[[int, str], None]] = None) -> type[GuardedProtocol]:
    """A protocol class with these limits, for uvicorn.Config(http=...)."""
    return type("SlcHttpProtocol", (GuardedProtocol,), {
        "header_timeout_s": float(header_timeout_s), "max_header_bytes": int(max_header_bytes),
        "on_refused": staticmethod(on_refused) if on_refused else None})
