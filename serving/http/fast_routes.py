"""POST/PUT bodies answered straight on ASGI (detect, softmax, top-k, v2 infer, gallery writes).

A route registers `fn(scope, body) -> (status, payload)` with `@fast_route(router, method, path)`. The
`FastRoutes` middleware, the innermost of the server's own (inside the metrics and body-limit
ones, which app.py wraps around FastAPI's whole stack), matches such a request against the
routers' routes and answers it there: none of FastAPI's layers (its error, telemetry and
body-size middleware, router, dependency solving, route wrappers) is on this path (on a detect
request they cost about as much as detect's own work). Errors still go through the app's
exception handlers, so the envelope is the same; every other request goes on to FastAPI. Each
fast route has one implementation, its handler; FastAPI holds only its description (OpenAPI).
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence
from urllib.parse import unquote_to_bytes

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.routing import Match

from serving.core.deadlines import within
from serving.errors import DeadlineExceeded

_FAST_HANDLERS: dict[Callable, Callable] = {}
BODY_METHODS = ("POST", "PUT")


@dataclass
class RawAnswer:
    """A body handler's answer that is not JSON (the v2 binary tensor extension)."""

    body: bytes
    content_type: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def fast_route(router, method: str, path: str, *, name: str, body: Any = None, body_default: Any = ...,
               **route_kwargs):
    """Register `handler(scope, body) -> (status, payload)` as THE implementation of `method path`
    (payload: a JSON-able object, a RawAnswer, or None for no body). FastAPI gets the route's
    description for OpenAPI only (its `body` model, path parameters, responses); FastRoutes answers
    every request of it before FastAPI's router is reached."""
    def register(handler: Callable) -> Callable:
        endpoint = _description(handler, path, name, body, body_default)
        router.add_api_route(path, endpoint, methods=[method], name=name, **route_kwargs)
        _FAST_HANDLERS[endpoint] = handler
        return handler

    return register


def _description(handler: Callable, path: str, name: str, body: Any, body_default: Any) -> Callable:
    """An endpoint FastAPI can describe (signature: the body model and the path's parameters) and
    never calls: its route is answered by `handler`."""
    from fastapi import Body, Path as PathParam

    params = []
    for part in re.findall(r"{([^}:]+)", path):
        alias = {"class": "class_ref"}.get(part, part)  # `class` is a Python keyword
        params.append(inspect.Parameter(alias, inspect.Parameter.KEYWORD_ONLY, annotation=str,
                                        default=PathParam(..., alias=part) if alias != part else PathParam(...)))
    if body is not None:
        params.append(inspect.Parameter("body", inspect.Parameter.KEYWORD_ONLY, annotation=body,
                                        default=Body(body_default)))

    async def endpoint(**_):
        raise RuntimeError(f"{name} is answered by its fast route")  # pragma: no cover - FastRoutes answers first

    endpoint.__signature__ = inspect.Signature(params)
    endpoint.__name__, endpoint.__doc__ = name, handler.__doc__
    return endpoint


def path_is_utf8(scope) -> bool:
    """Whether the request path, percent-decoded, is UTF-8. The ASGI server decodes it with
    errors="replace", so `a%FFb` and `a%FEb` both arrive as "a\ufffdb": only the raw bytes tell them
    apart from each other and from a real U+FFFD (%EF%BF%BD). Costs one `in` on an ordinary path;
    True when the server gives no raw_path (nothing to tell by)."""
    if "\ufffd" not in scope["path"]:
        return True
    raw = scope.get("raw_path")
    if raw is None:
        return True
    try:
        unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def app_state(scope):
    """The server's state object (serving/http/app.py) from an ASGI scope; for a path under
    /v1/models/{model}/ (serving/http/models.py), that model's view of it (404 for a model not served)."""
    state = scope["app"].state.slc
    model = scope.get("slc.model")
    return state if model is None else state.view(model)


class FastRoutes:
    """Pure ASGI: answer POST/PUT requests of routes with a body handler (see the module docstring)."""

    def __init__(self, app, routers: Sequence):
        self.app = app
        self.routers = routers
        self._routes: list | None = None  # built on the first request, when every route is registered

    def _candidates(self) -> list:
        """(static start of the path, route) of every POST/PUT route, in the routers' order."""
        if self._routes is None:
            self._routes = [(r.path.split("{", 1)[0], r) for router in self.routers for r in router.routes
                            if set(BODY_METHODS) & set(getattr(r, "methods", None) or ())]
        return self._routes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in BODY_METHODS:
            path = scope["path"]
            for start, route in self._candidates():
                if start not in path:  # a string test before the route's regex (`in`: a root_path may lead)
                    continue
                match, child = route.matches(scope)
                if match is Match.FULL:
                    handler = _FAST_HANDLERS.get(route.endpoint)
                    if handler is not None:
                        scope.update(child)
                        return await self._answer(handler, scope, receive, send)
                    break
        await self.app(scope, receive, send)

    async def _answer(self, handler: Callable, scope, receive, send) -> None:
        try:
            status, body, headers = await _run(handler, scope, receive)
        except Exception as exc:  # the app's handlers make the envelope (an unknown error: 500, logged)
            on_error = _exception_handler(scope["app"], exc)
            if on_error is None:
                raise
            response = await on_error(Request(scope, receive), exc)
            return await response(scope, receive, send)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _run(handler: Callable, scope, receive) -> tuple[int, bytes, list]:
    """Read the body, answer within the request deadline (queue and compute included), encode."""
    body = await _read_body(receive)  # size and read-time limits: BodyLimitMiddleware
    timeout = app_state(scope).settings.request_timeout_s
    try:
        with within(timeout):
            status, payload = await handler(scope, body)
    except TimeoutError:
        raise DeadlineExceeded(f"request not answered within its deadline of {timeout:g} s") from None
    if isinstance(payload, RawAnswer):
        out, headers = payload.body, [(b"content-type", payload.content_type), *payload.headers]
    else:
        out = b"" if payload is None else orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
        headers = [(b"content-type", b"application/json")] if payload is not None else []
    headers.append((b"content-length", str(len(out)).encode()))
    return status, out, headers


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()  # BodyLimitMiddleware's receive raises 413 past the limit
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _exception_handler(app, exc: Exception):
    """The handler the app registered for the closest class of `exc` (as Starlette looks it up)."""
    handlers = app.exception_handlers
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None
