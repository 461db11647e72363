"""The HTTP front's errors: every non-2xx answer is one JSON envelope (docs/api.md),
{"error": {"code", "message"}}, its status the HTTP one of the error's kind (serving/errors.py).

FastAPI's own failures (validation 422, unknown route 404, malformed JSON) are rewritten into
the same envelope, and an uncaught exception becomes a logged 500: a 5xx is a bug.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from serving.errors import Kind, SlcError

log = logging.getLogger(__name__)

HTTP_STATUS = {Kind.BAD_REQUEST: 400, Kind.UNAUTHENTICATED: 401, Kind.FORBIDDEN: 403, Kind.NOT_FOUND: 404,
               Kind.CONFLICT: 409, Kind.TIMEOUT: 408, Kind.TOO_LARGE: 413, Kind.UNSUPPORTED_MEDIA: 415, Kind.INVALID: 422,
               Kind.OVERLOADED: 429, Kind.UNAVAILABLE: 503, Kind.DEADLINE: 504, Kind.STORAGE_FULL: 507,
               Kind.INTERNAL: 500}


def http_status(exc: SlcError) -> int:
    return HTTP_STATUS[exc.kind]


def http_headers(exc: SlcError) -> dict[str, str]:
    """Retry-After for a retriable error, the Bearer challenge for a missing key."""
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if exc.kind is Kind.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def error_response(exc: SlcError) -> "OrjsonResponse":
    return envelope(http_status(exc), exc.code, exc.message, http_headers(exc))


class OrjsonResponse(JSONResponse):
    """JSON via orjson (numpy arrays serialised natively); FastAPI's ORJSONResponse is deprecated.
    A JSONResponse, so FastAPI documents each route's response model in the OpenAPI schema."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def envelope(status: int, code: str, message: str, headers: Optional[dict] = None) -> OrjsonResponse:
    return OrjsonResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 409: "conflict",
               408: "request_timeout", 413: "payload_too_large", 415: "unsupported_media_type",
               422: "invalid_input", 429: "overloaded",
               503: "not_ready", 504: "deadline_exceeded", 507: "insufficient_storage"}


# /v1/classes/ or /v1/classes//detect: a class route with an empty `{class}`, which matches no route
_EMPTY_CLASS = re.compile(r"/v1/classes/(?:/|$)")


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

    @app.exception_handler(SlcError)
    async def _slc_error(request: Request, exc: SlcError):
        count(exc.code)
        return error_response(exc)

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
        if exc.status_code == 404 and request.method != "GET" and _EMPTY_CLASS.search(request.url.path):
            count("invalid_class_name")
            return envelope(422, "invalid_class_name", "the class name in the path is empty "
                            "(/v1/classes/{name}: a name of 1 to 256 characters)")
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
