"""Many class-sets on one server over HTTP (issue 51; docs/api.md "Several models"):

- every /v1 route of a model under /v1/models/{model}/… (`ModelPaths` rewrites the path to the /v1
  route and names the model in the scope: serving/http/fast_routes.app_state answers with that model);
  GET /v1/models/{model} is its /v1/model. Today's /v1 routes serve the default model.
- GET /v1/models: each served model's classes, memory, where its head lives, its backbone group.
- The KServe v2 repository extension: POST /v2/repository/index, POST /v2/repository/models/{name}/load
  and …/unload (writes: the API key). A load verifies the bundle and serves it beside the others; an
  unload stops routing to the model, waits for its requests to drain, then closes it.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from serving.http.deps import error_responses
from serving.http.errors import OrjsonResponse
from serving.http.v1 import require_api_key

PREFIX = "/v1/models/"


class ModelPaths:
    """Pure ASGI: /v1/models/{model}/<rest> -> /v1/<rest> with scope["slc.model"] = model
    (/v1/models/{model} -> /v1/model). /v1/models itself is the listing."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            name, _, rest = scope["path"][len(PREFIX):].partition("/")
            if name:
                scope["slc.model"] = name
                scope["path"] = "/v1/" + rest if rest else "/v1/model"
                raw = scope.get("raw_path")
                if raw is not None:  # kept for path_is_utf8: the rest of the raw path, as sent
                    head, _, tail = raw[len(PREFIX):].partition(b"/")
                    scope["raw_path"] = b"/v1/" + tail if tail else b"/v1/model"
        await self.app(scope, receive, send)


def add_model_paths(schema: dict) -> dict:
    """The OpenAPI schema with every /v1 route of a model under /v1/models/{model}/… too (what `ModelPaths`
    serves): the same operations, a `model` path parameter, and 404 unknown_model for a model not served."""
    import copy

    paths = schema.setdefault("paths", {})
    model = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"},
             "description": "a served model's name (GET /v1/models); the /v1 routes serve the default one"}
    for path, item in list(paths.items()):
        if not path.startswith("/v1/") or path.startswith(PREFIX) or path == "/v1/models":
            continue
        mine = PREFIX.rstrip("/") + "/{model}" + ("" if path == "/v1/model" else path[len("/v1"):])
        copied = copy.deepcopy(item)
        for op in copied.values():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            op["parameters"] = [model] + [q for q in op.get("parameters", []) if q.get("name") != "model"]
            if "operationId" in op:
                op["operationId"] += "_of_model"
            op["responses"].setdefault("404", {"description": "unknown model, class, item or route", "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}})
            op["tags"] = sorted(set(op.get("tags", [])) | {"several models"})
        paths.setdefault(mine, copied)
    return schema


router = APIRouter()


@router.get("/v1/models", responses=error_responses(503), tags=["model"])
async def models(request: Request):
    """Each served model: its classes, thresholds' hash, memory and where its head lives, its backbone group
    (models sharing a backbone graph share one session); and the bundles refused, each in one line."""
    return OrjsonResponse(request.app.state.slc.models.listing())


@router.post("/v2/repository/index", tags=["kserve v2"])
async def repository_index(request: Request):
    """Every model served or loadable by name, with its state (READY, LOADING, UNLOADING, UNAVAILABLE)."""
    return OrjsonResponse(request.app.state.slc.models.index())


@router.post("/v2/repository/models/{model}/load", dependencies=[Depends(require_api_key)],
             responses=error_responses(401, 403, 404, 409, 422, 503), tags=["kserve v2"])
async def repository_load(model: str, request: Request):
    """Verify and serve the bundle known by this name (a folder of the model repository, or a bundle this
    server was started with), beside the others; a bundle that fails `slc verify` is refused in one line."""
    state = request.app.state.slc
    state.check_loaded()
    loaded = await state.models.load(model)
    return OrjsonResponse({"name": loaded.name, "state": loaded.state})


@router.post("/v2/repository/models/{model}/unload", dependencies=[Depends(require_api_key)],
             responses=error_responses(401, 403, 404, 409, 503), tags=["kserve v2"])
async def repository_unload(model: str, request: Request):
    """Stop routing to the model, let its requests on their way finish, then close it (the default model stays)."""
    state = request.app.state.slc
    state.check_loaded()
    await state.models.unload(model)
    return OrjsonResponse({"name": model, "state": "UNAVAILABLE"})
