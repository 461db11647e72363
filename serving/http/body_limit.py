"""The request body's limits on the HTTP front (pure ASGI, outside FastAPI's stack): its size, by
Content-Length up front and by counting while it is read, and its read time (FastAPI has neither)."""
from __future__ import annotations

import asyncio
from typing import Optional

from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.core.deadlines import Deadline
from serving.http.errors import envelope


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):  # the rest of the body is never read: the connection cannot be reused
        super().__init__(413, f"request body is larger than the limit of {limit} bytes", headers={"Connection": "close"})


class _BodyTooSlow(StarletteHTTPException):
    def __init__(self, timeout: float):
        super().__init__(408, f"the request body did not arrive within {timeout:g} s", headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Pure ASGI: refuse a body over `max_bytes`, by Content-Length up front and by counting
    the bytes while they are read (chunked bodies declare no length), and one that takes longer
    than `timeout_s` to arrive (a client that stops sending mid-body): 408. A request cut off by
    the end of the shutdown grace period gets 503 `shutting_down` instead of a plain-text 500."""

    def __init__(self, app, max_bytes: int, on_reject=None, timeout_s: float = 30.0):
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        if _declared_length(scope) > limit:
            return await self._reject(send, limit)
        guard = _BodyGuard(receive, send, limit, self.timeout_s)
        try:
            await self.app(scope, guard.receive, guard.send)
        except _BodyTooLarge:
            # Raised where nothing turned it into a response (e.g. outside a FastAPI route).
            if guard.started:
                raise
            await self._reject(send, limit)
        except asyncio.CancelledError:
            # the server's grace period ended with this request still running: uvicorn would
            # answer a plain-text 500; the envelope says what happened (retry elsewhere)
            if not guard.started:
                await _send(send, envelope(503, "shutting_down", "the server shut down before this request was "
                                           "answered; retry", {"Connection": "close", "Retry-After": "1"}))
            raise
        except _BodyTooSlow as exc:
            if guard.started:
                raise
            if self.on_reject is not None:
                self.on_reject("request_timeout")
            await _send(send, envelope(408, "request_timeout", exc.detail, {"Connection": "close"}))

    async def _reject(self, send, limit: int):
        if self.on_reject is not None:
            self.on_reject("payload_too_large")
        await _send(send, envelope(413, "payload_too_large", f"request body is larger than the limit of {limit} bytes",
                                   {"Connection": "close"}))


class _BodyGuard:
    """The request's receive, counting body bytes against the limit under the read deadline (set
    at the first read), and its send, noting whether the answer has started."""

    def __init__(self, receive, send, limit: int, timeout_s: float):
        self._receive, self._send = receive, send
        self.limit, self.timeout_s = limit, timeout_s
        self.seen = 0
        self.started = False
        self.deadline: Optional[float] = None

    async def receive(self):
        if self.deadline is None:
            self.deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            with Deadline(self.deadline):
                message = await self._receive()
        except TimeoutError:
            raise _BodyTooSlow(self.timeout_s) from None
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                raise _BodyTooLarge(self.limit)
        return message

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


def _declared_length(scope) -> int:
    """The Content-Length header's value; -1 when absent or not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return -1


async def _send(send, resp) -> None:
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})
