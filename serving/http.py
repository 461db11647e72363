"""The /v1 routes (docs/api.md): parse, resolve the class, hand over to the engine, answer.

Request bodies are parsed with orjson (much faster than the stdlib on float arrays); if orjson
refuses a body, the stdlib parser gets a second try so the JSON literals `NaN` / `Infinity`
become floats that validation turns into 422 (non_finite_value), and truly malformed JSON
still fails there (400 malformed_json).

detect, softmax and topk have a lean path for the ordinary request (see `_lean` below): the same
pydantic model and engine checks, without FastAPI's per-request machinery; any request it
declines goes through FastAPI as before (docs/results/detect-path.md).
"""
from __future__ import annotations

import json
import secrets
from typing import Callable, Optional

import orjson
from fastapi import APIRouter, Depends, Path, Request
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from serving.errors import InvalidInput, NotReady, OrjsonResponse, Unauthorized
from serving.schemas import (ClassSearchRequest, ClassSearchResponse, DetectRequest, DetectResponse, ErrorEnvelope,
                             GalleryInfo, GalleryItem, GalleryUpsertRequest, GalleryUpsertResponse, Health, ModelInfo,
                             SoftmaxRequest, SoftmaxResponse, TopkRequest, TopkResponse)


def parse_json(body: bytes):
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            return json.loads(body)  # NaN/Infinity literals -> float (rejected later); else JSONDecodeError -> 400
        except RecursionError:  # nesting deeper than the parser allows: malformed for us
            raise json.JSONDecodeError("JSON nested too deeply", body.decode("utf-8", "replace")[:32], 0) from None


class FastJSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class FastJSONRoute(APIRoute):
    """APIRoute whose request.json() is `parse_json`. A route with a lean handler (`_lean`) first
    tries that, straight on ASGI, and falls back to FastAPI's handler when it declines."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def fast_handler(request: Request) -> Response:
            return await handler(FastJSONRequest(request.scope, request.receive))

        return fast_handler

    async def handle(self, scope, receive, send) -> None:
        lean = _LEAN.get(self.endpoint)  # per request: lean handlers register after their route
        # (a route given extra dependencies, e.g. an API key, always takes FastAPI's handler)
        if lean is None or self.dependencies or scope["method"] != "POST" or not _is_json(scope):
            return await super().handle(scope, receive, send)
        model, fn = lean
        body = await _read_body(receive)
        parsed = _validate(body, model)
        if parsed is None:
            # Odd JSON or a schema violation: FastAPI's handler answers from the same bytes, so
            # every error keeps exactly the envelope, status and message it always had.
            return await super().handle(scope, _replay(body, receive), send)
        payload = orjson.dumps(await fn(scope, parsed), option=orjson.OPT_SERIALIZE_NUMPY)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


# ----------------------------------------------------------------------------- lean query path
# The hot query routes (detect, softmax, topk) skip FastAPI's request cycle for the ordinary
# request, a JSON object their pydantic model accepts: no Request/Response objects, no
# content-type parsing through email.message, no dependency solving or signature binding.
# The same model validates the body (same rules: strict finite numbers, no extra keys), the
# engine checks the shape, and ApiErrors still reach the app's handlers (one envelope). Anything
# else goes to FastAPI's handler; the routes keep their signatures, hence their OpenAPI schema.
_LEAN: dict[Callable, tuple] = {}


def _lean(endpoint: Callable, model):
    """Register `fn(scope, body_model) -> dict` as the lean handler of `endpoint`'s route."""
    def register(fn: Callable) -> Callable:
        _LEAN[endpoint] = (model, fn)
        return fn

    return register


def _is_json(scope) -> bool:
    """Content-Type application/json (charset allowed); anything else is left to FastAPI's rules."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            ct = value.lower()
            return ct == b"application/json" or (ct.startswith(b"application/json;") and b"charset" in ct)
    return False


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()  # BodyLimitMiddleware's receive raises 413 past the limit
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive() that yields the already-read body once, then defers to the real one."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


def _validate(body: bytes, model):
    """The validated body model, or None when FastAPI's handler should answer (and report)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict:
        return None
    try:
        return model.model_validate(obj)
    except ValidationError:
        return None


def _engine_of(scope):
    """`ready_engine` without the dependency machinery."""
    return scope["app"].state.slc.ready_engine()


def error_responses(*codes: int) -> dict:
    text = {400: "malformed JSON", 401: "missing or wrong API key", 404: "unknown class, item or route",
            413: "body over the limit", 422: "schema or shape violation, NaN/inf, too many inputs",
            429: "queue full (Retry-After)", 503: "not ready", 504: "deadline passed in the queue"}
    return {c: {"model": ErrorEnvelope, "description": text[c]} for c in codes}


_QUERY_ERRORS = error_responses(400, 404, 413, 422, 429, 503, 504)
_WRITE_ERRORS = error_responses(400, 401, 404, 413, 422, 429, 503, 504)


# Dependencies are `async def`: a sync one runs in the AnyIO thread pool on every request.
async def server_state(request: Request):
    return request.app.state.slc


async def ready_engine(request: Request):
    """The engine, or 503 while loading / after a failed load."""
    return request.app.state.slc.ready_engine()


async def require_api_key(request: Request) -> None:
    """Write routes need the key when SLC_API_KEY is set: `Authorization: Bearer KEY` or `X-API-Key: KEY`."""
    expected = request.app.state.slc.settings.api_key_value()
    if not expected:
        return
    given: Optional[str] = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    if not given or not secrets.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized("missing or wrong API key (send `Authorization: Bearer KEY` or `X-API-Key: KEY`)",
                           code="unauthorized", headers={"WWW-Authenticate": "Bearer"})


ClassPath = Path(..., alias="class", description="class name from the manifest, else integer id")

router = APIRouter(prefix="/v1", route_class=FastJSONRoute)


@router.get("/health/live", response_model=Health, tags=["health"])
async def live() -> dict:
    return {"status": "live"}


@router.get("/health/ready", response_model=Health, responses=error_responses(503), tags=["health"])
async def ready(state=Depends(server_state)) -> dict:
    if not state.is_ready:
        raise NotReady(state.not_ready_reason())
    return {"status": "ready"}


@router.get("/model", response_model=ModelInfo, responses=error_responses(503), tags=["model"])
async def model(engine=Depends(ready_engine), state=Depends(server_state)):
    return OrjsonResponse(state.model_info())


@router.post("/classes/{class}/detect", response_model=DetectResponse, responses=_QUERY_ERRORS, tags=["query"])
async def detect(body: DetectRequest, class_ref: str = ClassPath, engine=Depends(ready_engine)):
    """One logit per input: W[class]·h(x) + b[class] against the class's threshold."""
    cls = engine.resolve_class(class_ref)
    x = engine.to_batch(body.inputs)
    return OrjsonResponse(await engine.detect(cls, x, body.threshold))


@router.post("/classes/{class}/softmax", response_model=SoftmaxResponse, responses=_QUERY_ERRORS, tags=["query"])
async def softmax(body: SoftmaxRequest, class_ref: str = ClassPath, engine=Depends(ready_engine)):
    """The full-softmax baseline: all D logits per input, the class's softmax entry."""
    cls = engine.resolve_class(class_ref)
    x = engine.to_batch(body.inputs)
    return OrjsonResponse(await engine.softmax(cls, x))


def _check_k(k: int, state) -> None:
    if k > state.settings.max_topk:
        raise InvalidInput(f"k={k} is over the limit of {state.settings.max_topk}", code="k_too_large")


@router.post("/topk", response_model=TopkResponse, responses=_QUERY_ERRORS, tags=["query"])
async def topk(body: TopkRequest, engine=Depends(ready_engine), state=Depends(server_state)):
    """The k best classes per input: exact (all D logits) or through the faiss class index."""
    _check_k(body.k, state)
    x = engine.to_batch(body.inputs)
    return OrjsonResponse(await engine.topk(x, body.k, body.mode))


@_lean(detect, DetectRequest)
async def _detect_lean(scope, body: DetectRequest) -> dict:
    engine = _engine_of(scope)
    cls = engine.resolve_class(scope["path_params"]["class"])
    return await engine.detect(cls, engine.to_batch(body.inputs), body.threshold)


@_lean(softmax, SoftmaxRequest)
async def _softmax_lean(scope, body: SoftmaxRequest) -> dict:
    engine = _engine_of(scope)
    cls = engine.resolve_class(scope["path_params"]["class"])
    return await engine.softmax(cls, engine.to_batch(body.inputs))


@_lean(topk, TopkRequest)
async def _topk_lean(scope, body: TopkRequest) -> dict:
    engine = _engine_of(scope)
    _check_k(body.k, scope["app"].state.slc)
    return await engine.topk(engine.to_batch(body.inputs), body.k, body.mode)


@router.post("/gallery/items", status_code=201, response_model=GalleryUpsertResponse, responses=_WRITE_ERRORS,
             dependencies=[Depends(require_api_key)], tags=["gallery"])
async def gallery_upsert(body: GalleryUpsertRequest, engine=Depends(ready_engine)):
    """Upsert by id; answered only once the items are committed to disk."""
    items = list({it.id: it.model_dump() for it in body.items}.values())  # last one wins per id
    ids = await engine.gallery_upsert(items)
    return OrjsonResponse({"upserted": len(ids), "ids": ids}, status_code=201)


@router.get("/gallery/items/{item_id:path}", response_model=GalleryItem, responses=error_responses(404, 503), tags=["gallery"])
async def gallery_get(item_id: str, engine=Depends(ready_engine)):
    return OrjsonResponse(await engine.gallery_get(item_id))


@router.delete("/gallery/items/{item_id:path}", status_code=204, responses=error_responses(401, 404, 503),
               dependencies=[Depends(require_api_key)], tags=["gallery"])
async def gallery_delete(item_id: str, engine=Depends(ready_engine)):
    await engine.gallery_delete(item_id)
    return Response(status_code=204)


@router.post("/classes/{class}/search", response_model=ClassSearchResponse, responses=_QUERY_ERRORS, tags=["gallery"])
async def class_search(body: Optional[ClassSearchRequest] = None, class_ref: str = ClassPath,
                       engine=Depends(ready_engine)):
    """Gallery items whose logit for the class is >= the threshold, best first."""
    body = body or ClassSearchRequest()
    cls = engine.resolve_class(class_ref)
    return OrjsonResponse(await engine.gallery_search(cls, body.threshold, body.limit))


@router.get("/gallery", response_model=GalleryInfo, responses=error_responses(503), tags=["gallery"])
async def gallery_info(engine=Depends(ready_engine)):
    return OrjsonResponse(await engine.gallery_info())


metrics_router = APIRouter()


@metrics_router.get("/metrics", include_in_schema=True, tags=["metrics"],
                    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(state=Depends(server_state)):
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)
