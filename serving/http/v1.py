"""The /v1 routes (docs/api.md): parse, resolve the class, hand over to the engine, answer.

Every POST or PUT with a body (detect, softmax, topk, gallery writes, class search) is answered by
its handler straight from ASGI (`fast_route`, serving/http/fast_routes.py) and checked by
serving/codecs/strict_json.py: the size while reading, the parse in C, the counts, then one
vectorised conversion of the examples; no value is coerced and no per-value Python runs on an
ordinary request. pydantic models describe each body in the OpenAPI schema; FastAPI's own
handler answers the other methods (GET, DELETE).
"""
from __future__ import annotations

import math
import re
import secrets
from urllib.parse import unquote_plus
from typing import Any, Callable, Optional

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response



from serving.bundle import sniff
from serving.codecs import fast_json, forms, image_decoder, images, strict_json as read
from serving.errors import Forbidden, InvalidInput, SlcError, Unauthorized, UnsupportedMediaType
from serving.codecs import gallery_bodies as bodies
from serving.http.deps import error_responses, ready_engine, server_state
from serving.http.errors import OrjsonResponse
from serving.http.fast_routes import RawAnswer, app_state, fast_route, path_is_utf8
from serving.http.schemas import (CalibrationReloadRequest, CalibrationReloadResponse, ClassSearchRequest,
                             ClassSearchResponse, DetectRequest, DetectResponse, DetectSetRequest,
                             DetectSetResponse, EnrollAnswer, EnrolledList,
                             EnrollRequest, GalleryInfo, GalleryItem, GalleryPutRequest, GalleryUpsertRequest,
                             GalleryUpsertResponse, Health, ModelInfo, SoftmaxRequest, SoftmaxResponse, TopkRequest,
                             TopkResponse)


def _is_json(scope) -> bool:
    """Content-Type application/json (parameters such as a charset allowed, spaces around `;` too)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def _read_object(scope, body: bytes, optional: bool = False) -> dict:
    """The body as a JSON object; with `optional`, an empty body is {} whatever its type. Another type:
    415 naming what came and that the route takes JSON."""
    if optional and not body.strip():
        return {}
    if not _is_json(scope):
        raise images.unsupported_body(images.content_type_of(scope), body, None)
    return read.parse_object(body)


def _class_ref(scope) -> str:
    """The `{class}` of the path; 422 invalid_class_name when its bytes are not UTF-8 (path_is_utf8):
    two such names would otherwise be one class."""
    params = scope["path_params"]
    ref = params["class"] if "class" in params else params["class_ref"]
    if not path_is_utf8(scope):
        raise InvalidInput("the class name in the path is not UTF-8 once percent-decoded; percent-encode "
                           "the name's UTF-8 bytes", code="invalid_class_name")
    return ref


_QUERY_ERRORS = error_responses(400, 404, 408, 413, 415, 422, 429, 503, 504)
_WRITE_ERRORS = error_responses(400, 401, 403, 408, 413, 415, 422, 429, 503, 504, 507)
_SEARCH_ERRORS = error_responses(400, 404, 408, 413, 415, 422, 429, 503, 504)
_ADMIN_ERRORS = error_responses(400, 401, 403, 408, 409, 413, 415, 422, 503)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ENROLL_ERRORS = error_responses(400, 401, 403, 408, 409, 413, 415, 422, 429, 503, 504, 507)
_ADD_ERRORS = error_responses(400, 401, 403, 404, 408, 409, 413, 415, 422, 429, 503, 504, 507)


async def require_api_key(request: Request) -> None:
    """Write routes need the key when SLC_API_KEY is set: `Authorization: Bearer KEY` or `X-API-Key: KEY`."""
    settings = request.app.state.slc.settings
    refuse_open_writes(settings)
    check_api_key(settings.api_key_value(), request.headers.get("x-api-key"), request.headers.get("authorization", ""))


OPEN_WRITES_REFUSED = ("gallery writes are refused: this server listens on {host} (reachable from other machines) "
                       "and has no API key. Set one (SLC_API_KEY=$(openssl rand -hex 32); clients then send "
                       "`Authorization: Bearer KEY`), or let anyone write with SLC_ALLOW_OPEN_WRITES=1 / "
                       "--allow-open-writes, or listen on 127.0.0.1")


def refuse_open_writes(settings) -> None:
    """403 on a write when no key is set on a non-loopback host and open writes are not allowed."""
    if settings.open_writes_refused():
        raise Forbidden(OPEN_WRITES_REFUSED.format(host=settings.host), code="writes_need_api_key")


def check_api_key(expected: Optional[str], given: Optional[str], auth: str) -> None:
    if not expected:
        return
    if given is None and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    if not given or not secrets.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized("missing or wrong API key (send `Authorization: Bearer KEY` or `X-API-Key: KEY`)",
                           code="unauthorized")


router = APIRouter(prefix="/v1")


@router.get("/health/live", response_model=Health, tags=["health"])
async def live(request: Request) -> dict:
    """The process answers; under /v1/models/{model}/, only for a model it serves (404 unknown_model)."""
    if request.scope.get("slc.model") is not None:
        app_state(request.scope)
    return {"status": "live"}


@router.get("/health/ready", response_model=Health, responses=error_responses(503), tags=["health"])
async def ready(state=Depends(server_state)) -> dict:
    await state.check_ready()
    return {"status": "ready"}


@router.get("/model", response_model=ModelInfo, responses=error_responses(503), tags=["model"])
async def model(engine=Depends(ready_engine), state=Depends(server_state)):
    return OrjsonResponse(state.model_info())


# ----------------------------------------------------------------------------- POST and PUT bodies
# Answered from the raw body by FastRoutes (serving/http/fast_routes.py): one implementation each.
async def _query(scope, body: bytes, allowed: tuple[str, ...], params: Callable[[dict], dict],
                 extra_values: int = 0, lists: tuple[str, ...] = (), forms: bool = False) -> tuple[Any, dict, np.ndarray]:
    """(engine, the route's parameters, examples [N, *shape]) of a query route: bounds on the raw bytes,
    the parse, the fields, the parameters (`params(obj)`), and only then the examples' conversion.
    An image body (Content-Type image/*) is one example; its parameters come from the query string.
    `extra_values`: values and lists the route's other fields may hold; `lists`: those fields (a list of classes)."""
    engine = app_state(scope).ready_engine()
    content_type = images.content_type_of(scope)
    if images.is_image(content_type):
        obj = _query_string(scope)
        read.check_keys(obj, tuple(k for k in allowed if k != "inputs"), where="query string")
        p = params(obj)
        return engine, p, await _image_example(engine, body, content_type)
    if not _is_json(scope):  # 415 first: a PNG sent without its type is not counted as JSON
        raise images.unsupported_body(content_type, body, engine.bundle.image, forms)
    n, shape = engine.settings.max_inputs, engine.input_shape
    lists_per_example = sum(math.prod(shape[:i]) for i in range(len(shape)))  # nested form; 1 when flat
    read.check_structure(body, max_values=n * math.prod(shape) + 8 + extra_values,
                         max_lists=1 + n * lists_per_example + extra_values, max_objects=1)
    fast = fast_json.query(body, shape, n, lists)  # plain bodies: no float objects
    obj = fast if fast is not None else _read_object(scope, body)
    read.check_keys(obj, allowed, required=("inputs",))
    p = params(obj)
    if fast is not None:
        return engine, p, fast["inputs"]
    return engine, p, read.examples(obj["inputs"], engine.input_shape, n, read.has_bool_token(body))


async def _image_example(engine, body: bytes, content_type: bytes) -> np.ndarray:
    """One example [1, *input_shape] from an image body (decoded by a worker process, under a time budget)."""
    x = await image_decoder.decode(engine.settings, body, content_type, engine.bundle.image, engine.input_shape)
    return x[None].astype(np.float32, copy=False)


def _query_string(scope) -> dict:
    """?threshold=0.5&k=3&mode=index -> {"threshold": 0.5, "k": 3, "mode": "index"} (JSON values where they parse)."""
    from urllib.parse import parse_qsl

    out = {}
    for key, value in parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True):
        try:
            out[key] = orjson.loads(value)
        except orjson.JSONDecodeError:
            out[key] = value
    return out


@fast_route(router, "POST", "/classes/{class}/detect", name="detect", body=DetectRequest,
            response_model=DetectResponse, responses=_QUERY_ERRORS, tags=["query"])
async def detect(scope, body: bytes):
    """One logit per input: W[class]·h(x) + b[class] against the class's threshold."""
    engine, p, x = await _query(scope, body, ("inputs", "threshold"), lambda o: {"threshold": read.number(o, "threshold")})
    cls = engine.classes.resolve_class(_class_ref(scope))
    return 200, await engine.detect(cls, x, p["threshold"])


@fast_route(router, "POST", "/detect", name="detect_set", body=DetectSetRequest, response_model=DetectSetResponse,
            responses=_QUERY_ERRORS, tags=["query"])
async def detect_set(scope, body: bytes):
    """detect for a set of classes in one call: each input against each named class's row (the set's
    rows are read, never the whole head), with its logit, match and probability."""
    limit = app_state(scope).settings.max_detect_classes
    engine, p, x = await _query(scope, body, ("inputs", "classes", "threshold"), lambda o: {
        "classes": _class_list(o, limit), "threshold": read.number(o, "threshold")}, extra_values=4 * limit,
        lists=("classes",))
    refs, snap = engine.classes.resolve_classes(p["classes"])
    return 200, await engine.detect_set(refs, snap, x, p["threshold"])


def _class_list(obj: dict, limit: int) -> list:
    """`classes`: 1..limit class names (strings, read as a path's `{class}`) or ids (integers)."""
    if "classes" not in obj:
        raise InvalidInput("body: field 'classes' is required", code="validation_error")
    refs = obj["classes"]
    if type(refs) is not list or not refs:
        raise InvalidInput("classes must be a non-empty list of class names or ids", code="validation_error")
    if len(refs) > limit:
        raise InvalidInput(f"{len(refs)} classes in one request; the limit is {limit} (SLC_MAX_DETECT_CLASSES)",
                           code="too_many_classes")
    for i, r in enumerate(refs):
        if type(r) is float and r.is_integer():  # as JSON Schema: 5.0 is the integer 5
            refs[i] = r = int(r)
        if type(r) not in (str, int) or r == "":
            raise InvalidInput(f"classes[{i}] must be a class name (a non-empty string) or id (an integer)",
                               code="validation_error")
    return refs


def _flag(obj: dict, key: str) -> bool:
    """A JSON boolean, false when absent; nothing coerced (1, "true" are refused)."""
    v = obj.get(key, False)
    if type(v) is not bool:
        raise InvalidInput(f"{key} must be true or false", code="validation_error")
    return v


@fast_route(router, "POST", "/classes/{class}/softmax", name="softmax", body=SoftmaxRequest,
            response_model=SoftmaxResponse, responses=_QUERY_ERRORS, tags=["query"])
async def softmax(scope, body: bytes):
    """The full-softmax baseline: all D logits per input, the class's softmax entry."""
    engine, _, x = await _query(scope, body, ("inputs",), lambda o: {})
    cls = engine.classes.resolve_class(_class_ref(scope))
    return 200, await engine.softmax(cls, x)


@fast_route(router, "POST", "/topk", name="topk", body=TopkRequest, response_model=TopkResponse,
            responses=_QUERY_ERRORS, tags=["query"])
async def topk(scope, body: bytes):
    """The k best classes per input: exact (all D logits) or through the faiss class index; each entry
    judged against its class's threshold as detect judges it (`matches_only`: the matching ones)."""
    max_topk = app_state(scope).settings.max_topk
    engine, p, x = await _query(scope, body, ("inputs", "k", "mode", "threshold", "matches_only"), lambda o: {
        "k": read.integer(o, "k", 5, 1, max_topk, code="k_too_large"),
        "mode": read.choice(o, "mode", "exact", ("exact", "index")),
        "threshold": read.number(o, "threshold"), "matches_only": _flag(o, "matches_only")})
    return 200, await engine.topk(x, p["k"], p["mode"], p["threshold"], p["matches_only"])


def _require_key(scope) -> None:
    headers = dict(scope["headers"])
    given, auth = headers.get(b"x-api-key"), headers.get(b"authorization", b"")
    settings = app_state(scope).settings
    refuse_open_writes(settings)
    check_api_key(settings.api_key_value(), None if given is None else given.decode("latin-1"), auth.decode("latin-1"))


@fast_route(router, "POST", "/gallery/items", name="gallery_upsert", body=GalleryUpsertRequest, status_code=201,
            response_model=GalleryUpsertResponse, responses=_WRITE_ERRORS, tags=["gallery"])
async def gallery_upsert(scope, body: bytes):
    """Upsert by id; answered only once the items are committed to disk."""
    # counts on the raw bytes here; the parse and every per-value check on the gallery's executor
    # (serving/codecs/gallery_bodies.py)
    _require_key(scope)  # 401 before the body is parsed
    engine = app_state(scope).ready_engine()
    s = engine.settings
    bodies.check_upsert_structure(body, s.max_inputs, engine.input_shape, s.max_metadata_values)
    if not _is_json(scope):
        raise images.unsupported_body(images.content_type_of(scope), body, None)
    items, x = await engine.off_loop(bodies.read_upsert, body, s, engine.input_shape)
    ids = await engine.gallery_upsert(items, x)
    return 201, {"upserted": len(ids), "ids": ids}


@fast_route(router, "PUT", "/gallery/items/{item_id:path}", name="gallery_put", body=GalleryPutRequest,
            status_code=201, response_model=GalleryUpsertResponse, responses=_WRITE_ERRORS, tags=["gallery"])
async def gallery_put(scope, body: bytes):
    """Upsert one item by its id: JSON {input, metadata?}, or an image body (metadata as a JSON
    object in ?metadata=) for bundles whose input is an image. Answered once committed."""
    _require_key(scope)
    engine = app_state(scope).ready_engine()
    s = engine.settings
    item_id = bodies.item_id(scope["path_params"]["item_id"], "item id")
    content_type = images.content_type_of(scope)
    if not images.is_image(content_type):
        bodies.check_upsert_structure(body, 1, engine.input_shape, s.max_metadata_values, what="item")
        if not _is_json(scope):
            raise images.unsupported_body(content_type, body, engine.bundle.image)
        items, x = await engine.off_loop(bodies.read_put, body, item_id, s, engine.input_shape)
        ids = await engine.gallery_upsert(items, x)
        return 201, {"upserted": len(ids), "ids": ids}
    obj = _query_string(scope)  # metadata as JSON in ?metadata= (bounded by the header size limit)
    read.check_keys(obj, ("metadata",), where="query string")
    source = unquote_plus(scope.get("query_string", b"").decode("latin-1")).encode()  # metadata's raw text
    meta = bodies.metadata_json(obj.get("metadata"), source, "metadata", s.max_metadata_values, s.max_metadata_bytes)
    x = await _image_example(engine, body, content_type)
    item = {"id": item_id, "input": x[0].tolist(), "metadata": obj.get("metadata"), "metadata_json": meta}
    ids = await engine.gallery_upsert([item], x)
    return 201, {"upserted": len(ids), "ids": ids}


@router.get("/gallery/items/{item_id:path}", response_model=GalleryItem, responses=error_responses(404, 429, 503),
            tags=["gallery"])
async def gallery_get(item_id: str, engine=Depends(ready_engine)):
    return Response(await engine.gallery_get(item_id), media_type="application/json")


@router.delete("/gallery/items/{item_id:path}", status_code=204, responses=error_responses(401, 403, 404, 429, 503, 507),
               dependencies=[Depends(require_api_key)], tags=["gallery"])
async def gallery_delete(item_id: str, engine=Depends(ready_engine)):
    await engine.gallery_delete(item_id)
    return Response(status_code=204)


@fast_route(router, "POST", "/classes/{class}/search", name="class_search", body=ClassSearchRequest,
            body_default=None, response_model=ClassSearchResponse, responses=_SEARCH_ERRORS, tags=["gallery"])
async def class_search(scope, body: bytes):
    """Gallery items whose logit for the class is >= the threshold, best first."""
    engine = app_state(scope).ready_engine()
    obj = _read_object(scope, body, optional=True)
    read.check_keys(obj, ("limit", "threshold"))
    limit = read.integer(obj, "limit", 100, 1, 100_000)
    threshold = read.number(obj, "threshold")
    cls = engine.classes.resolve_class(_class_ref(scope))
    return 200, RawAnswer(await engine.gallery_search(cls, threshold, limit), b"application/json")


@router.get("/gallery", response_model=GalleryInfo, responses=error_responses(429, 503), tags=["gallery"])
async def gallery_info(engine=Depends(ready_engine)):
    return OrjsonResponse(await engine.gallery_info())


@fast_route(router, "POST", "/admin/reload-calibration", name="reload_calibration", body=CalibrationReloadRequest,
            body_default=None, response_model=CalibrationReloadResponse, responses=_ADMIN_ERRORS, tags=["admin"])
async def reload_calibration(scope, body: bytes):
    """Serve the calibration now in the bundle's folder (after `slc calibrate BUNDLE --in-place`): its
    hash checked against the folder's manifest, the rest of the model checked unchanged, then swapped
    in whole, so every query decides with all old or all new thresholds. A write: the API key."""
    _require_key(scope)  # 401 before the body is read
    engine = app_state(scope).ready_engine()
    obj = _read_object(scope, body, optional=True)
    read.check_keys(obj, ("expect_sha256",))
    expect = obj.get("expect_sha256")
    if expect is not None and not (type(expect) is str and _SHA256.fullmatch(expect)):
        raise InvalidInput("expect_sha256 must be a sha256 as 64 lowercase hex digits", code="validation_error")
    return 200, await engine.classes.reload_calibration(expect)


# ----------------------------------------------------------------------------- enrolled classes (issue 38)
@fast_route(router, "PUT", "/classes/{class}", name="enroll", body=EnrollRequest, status_code=201,
            response_model=EnrollAnswer, responses=_ENROLL_ERRORS, tags=["classes"])
async def enroll(scope, body: bytes):
    """Create (201) or replace (200) a class from examples: JSON {inputs} like detect, one image body,
    or several images as multipart/form-data (curl -F image=@a.png -F image=@b.png). Its row is
    computed by the server's enrollment rule; answered once committed."""
    _require_key(scope)  # 401 before the body is parsed
    name = _class_ref(scope)
    engine, x = await _enroll_examples(scope, body)
    answer, created = await engine.enroll(name, x)
    return (201 if created else 200), answer


@fast_route(router, "POST", "/classes/{class}/examples", name="enroll_add", body=EnrollRequest,
            response_model=EnrollAnswer, responses=_ADD_ERRORS, tags=["classes"])
async def enroll_add(scope, body: bytes):
    """Add examples to an enrolled class (200): the same bodies as PUT. Its row is made again from the
    embeddings of all its examples, kept with the class: exactly the row of enrolling them at once."""
    _require_key(scope)
    name = _class_ref(scope)
    engine, x = await _enroll_examples(scope, body)
    answer, _ = await engine.enroll(name, x, add=True)
    return 200, answer


async def _enroll_examples(scope, body: bytes) -> tuple[Any, np.ndarray]:
    """(engine, examples [N, *shape]) of an enrollment body: JSON {inputs}, one image, or images as
    multipart/form-data, each part decoded like an image body, in order; a refusal names the part."""
    if images.content_type_of(scope) != forms.FORM_TYPE:
        engine, _, x = await _query(scope, body, ("inputs",), lambda o: {}, forms=True)
        return engine, x
    engine = app_state(scope).ready_engine()
    if engine.bundle.image is None:
        raise UnsupportedMediaType("this bundle's input is not an image: send JSON {\"inputs\": [...]} "
                                   "(Content-Type: application/json), not files")
    read.check_keys(_query_string(scope), (), where="query string")
    header = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    parts = forms.parse(header, body, engine.settings.max_inputs)
    return engine, np.concatenate([await _part_example(engine, part) for part in parts])


async def _part_example(engine, part: forms.Part) -> np.ndarray:
    """One example [1, *shape] from a form's part, decoded by the type its bytes show (browsers label
    by extension; every type slc reads has its magic bytes); 415 / 422 for a part that is no image
    (422 when it was declared image/*), naming it."""
    content_type = (sniff.image_type(part.data) or "").encode()
    if not content_type:
        declared = part.content_type.decode("latin-1") or "none"
        error = InvalidInput if images.is_image(part.content_type) else UnsupportedMediaType
        raise error(f"{part.label()} is not an image slc reads: it holds {sniff.describe(part.data)} (Content-Type "
                    f"{declared}); send image files ({', '.join(images.IMAGE_TYPES)})",
                    code="invalid_image" if error is InvalidInput else None)
    try:
        return await _image_example(engine, part.data, content_type)
    except SlcError as exc:  # the same error, the part named
        exc.message = f"{part.label()}: {exc.message}"
        exc.args = (exc.message,)
        raise


@router.delete("/classes/{class_ref}", status_code=204, responses=error_responses(401, 403, 404, 409, 422, 429, 503, 507),
               dependencies=[Depends(require_api_key)], tags=["classes"])
async def unenroll(class_ref: str, request: Request, engine=Depends(ready_engine)):
    """Delete an enrolled class (by name or id); its id is never given to another class."""
    await engine.unenroll(_class_ref(request.scope))
    return Response(status_code=204)


@router.get("/classes", response_model=EnrolledList, responses=error_responses(503), tags=["classes"])
async def enrolled_classes(engine=Depends(ready_engine)):
    """The enrolled classes, in id order (the order of their columns in `<name>-full`)."""
    return OrjsonResponse(await engine.enrolled_classes())

