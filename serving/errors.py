"""One error envelope for every non-2xx answer (docs/api.md): {"error": {"code", "message"}}.

FastAPI's own failures (validation 422, unknown route 404, malformed JSON) are rewritten into
the same envelope, the request body is capped while it is read (FastAPI has no limit), and an
uncaught exception becomes a logged 500 — a 5xx is a bug.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from serving.deadlines import Deadline

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An expected failure with its HTTP status and a stable snake_case code."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, code: Optional[str] = None, status: Optional[int] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        if status:
            self.status = status
        self.headers = headers or {}


class BadRequest(ApiError):
    status, code = 400, "bad_request"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class NotFound(ApiError):
    status, code = 404, "not_found"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class InvalidInput(ApiError):
    status, code = 422, "invalid_input"


class Overloaded(ApiError):
    """The batch queue is full: retry after `retry_after` seconds."""

    status, code = 429, "overloaded"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, headers={"Retry-After": str(max(1, int(retry_after)))})
        self.retry_after = retry_after


class InsufficientStorage(ApiError):
    """A write that could not be committed for lack of space; nothing was written."""

    status, code = 507, "insufficient_storage"


class NotReady(ApiError):
    status, code = 503, "not_ready"


class GalleryDown(ApiError):
    """The shared gallery database cannot be reached: retry (other routes keep answering)."""

    status, code = 503, "gallery_unavailable"

    def __init__(self, message: str):
        super().__init__(message, headers={"Retry-After": "1"})


class DeadlineExceeded(ApiError):
    status, code = 504, "deadline_exceeded"


class OrjsonResponse(JSONResponse):
    """JSON via orjson (numpy arrays serialised natively); FastAPI's ORJSONResponse is deprecated.
    A JSONResponse, so FastAPI documents each route's response model in the OpenAPI schema."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def envelope(status: int, code: str, message: str, headers: Optional[dict] = None) -> OrjsonResponse:
    return OrjsonResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
               408: "request_timeout", 413: "payload_too_large", 415: "unsupported_media_type",
               422: "invalid_input", 429: "overloaded",
               503: "not_ready", 504: "deadline_exceeded", 507: "insufficient_storage"}


def _describe_validation(errors: list[dict]) -> tuple[int, str, str]:
    """(status, code, message) of a RequestValidationError: malformed JSON is 400, NaN/inf and
    schema violations 422."""
    if any(e.get("type") == "json_invalid" for e in errors):
        err = next(e for e in errors if e.get("type") == "json_invalid")
        detail = (err.get("ctx") or {}).get("error", "")
        return 400, "malformed_json", f"request body is not valid JSON ({detail})".replace(" ()", "")
    if any(e.get("type") == "finite_number" for e in errors):
        return 422, "non_finite_value", "inputs must be finite numbers (NaN and Infinity are rejected)"
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return 422, "validation_error", "; ".join(parts) + more


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Route every failure through `envelope`; `on_error(reason)` counts rejections for /metrics."""

    def count(reason: str) -> None:
        if on_error is not None:
            on_error(reason)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        count(exc.code)
        return envelope(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        status, code, message = _describe_validation(list(exc.errors()))
        count(code)
        return envelope(status, code, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:  # every method of every route on this path, not only the first match's
            allowed = _allowed_methods(request)
            headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}"
        count(code)
        return envelope(exc.status_code, code, message, headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        """The client closed the connection before its body arrived: nobody to answer, not a bug."""
        count("client_disconnected")
        return Response(status_code=499)  # nginx's "client closed request", for the metrics only

    @app.exception_handler(Exception)
    async def _uncaught(request: Request, exc: Exception):
        log.exception("uncaught error on %s %s", request.method, request.url.path)
        count("internal_error")
        return envelope(500, "internal_error", "internal server error (this is a bug; it was logged)")


def _allowed_methods(request: Request) -> list[str]:
    from starlette.routing import Match

    methods: set[str] = set()
    for route in _leaf_routes(request.app.router.routes):
        if getattr(route, "methods", None) and route.matches({**request.scope, "method": "GET"})[0] != Match.NONE:
            methods |= set(route.methods)
    return sorted(methods)


def _leaf_routes(routes):
    """Every route, included routers walked into (FastAPI keeps an included router as one entry)."""
    for route in routes:
        inner = getattr(route, "routes", None) or getattr(getattr(route, "original_router", None), "routes", None)
        if inner:
            yield from _leaf_routes(inner)
        else:
            yield route


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
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    return await self._reject(send, limit)
                break

        seen = 0
        started = False
        deadline: Optional[float] = None

        async def counting_receive():
            nonlocal seen, deadline
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.timeout_s
            try:
                with Deadline(deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyTooSlow(self.timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(limit)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            # Raised where nothing turned it into a response (e.g. outside a FastAPI route).
            if started:
                raise
            await self._reject(send, limit)
        except asyncio.CancelledError:
            # the server's grace period ended with this request still running: uvicorn would
            # answer a plain-text 500; the envelope says what happened (retry elsewhere)
            if not started:
                resp = envelope(503, "shutting_down", "the server shut down before this request was answered; retry",
                                {"Connection": "close", "Retry-After": "1"})
                await send({"type": "http.response.start", "status": 503, "headers": resp.raw_headers})
                await send({"type": "http.response.body", "body": resp.body})
            raise
        except _BodyTooSlow as exc:
            if started:
                raise
            if self.on_reject is not None:
                self.on_reject("request_timeout")
            resp = envelope(408, "request_timeout", exc.detail, {"Connection": "close"})
            await send({"type": "http.response.start", "status": 408, "headers": resp.raw_headers})
            await send({"type": "http.response.body", "body": resp.body})

    async def _reject(self, send, limit: int):
        if self.on_reject is not None:
            self.on_reject("payload_too_large")
        resp = envelope(413, "payload_too_large", f"request body is larger than the limit of {limit} bytes",
                        {"Connection": "close"})
        await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})
