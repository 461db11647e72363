"""`create_app(settings) -> FastAPI`: the HTTP front (docs/api.md).

The app serves /v1 (serving/http/v1.py), /v2 (serving/http/v2.py), /metrics and the demo page over
the protocol-free core (serving/core/). Its lifespan starts and stops the core's `Lifecycle`:
the app's own when it is built alone (tests, an ASGI host), or the one serving/main.py shares
with the gRPC front. /health/live answers at once; readiness once the model is loaded.

Layout along the request path (as in the `infinity` embedding server):
http/fast_routes.py -> http/v1.py, http/v2.py -> core/engine.py -> core/batcher.py -> core/sessions.py.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Callable, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from serving.core.lifecycle import Lifecycle
from serving.http.body_limit import BodyLimitMiddleware
from serving.http.errors import OrjsonResponse, install_error_handlers
from serving.http.fast_routes import FastRoutes
from serving.http.metrics import MetricsMiddleware
from serving.http.schemas import describe_model_inputs
from serving.settings import Settings


def create_app(settings: Optional[Settings] = None, *, lifecycle: Optional[Lifecycle] = None,
               on_fatal: Optional[Callable[[BaseException], None]] = None) -> FastAPI:
    """The ASGI app over `lifecycle` (a new one on `settings` when not given). `on_fatal(exc)` is
    called when start-up fails (serving/main.py exits non-zero)."""
    lifecycle = lifecycle or Lifecycle(settings or Settings(), on_fatal)
    state = lifecycle.state

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await lifecycle.start()
        try:
            yield
        finally:
            await lifecycle.stop()

    # FastAPI's native OpenTelemetry hooks are off: slc's metrics are Prometheus (/metrics), and
    # the hooks look up the global providers on every request.
    # redirect_slashes off: `/v1/classes/` (an empty class name) answered 307 to a URL built from the
    # Host header; a path that matches no route is the 404 envelope (errors.py), never a redirect.
    app = FastAPI(title="slc", version="1", lifespan=lifespan, default_response_class=OrjsonResponse,
                  redirect_slashes=False, telemetry={"tracing": False, "metrics": False, "logs": False},
                  description="Single-logit classification: one logit per query (docs/api.md).")
    app.state.slc = state
    _include_routes(app, state)
    return app


def _include_routes(app: FastAPI, state) -> None:
    from serving.http.demo import router as demo_router
    from serving.http.metrics import metrics_router
    from serving.http.models import ModelPaths, router as models_router
    from serving.http.v1 import router as v1
    from serving.http.v2 import openapi_components, router as v2

    for router in (models_router, v1, v2, metrics_router, demo_router):
        app.include_router(router)
    install_error_handlers(app, on_error=state.metrics.reject)
    app.openapi = lambda: _openapi(app, state, openapi_components)
    # The request path, outermost first: metrics (sees every status, 413s included), the model paths
    # (/v1/models/{model}/… to the /v1 route, serving/http/models.py), the body
    # limit, the fast routes (serving/http/fast_routes.py), then FastAPI's own stack (its error,
    # telemetry and body-size layers, the router) for everything else. The three are wrapped
    # around FastAPI's stack rather than added as middleware, which FastAPI would put inside its
    # own layers: a fast route passes through none of them.
    fastapi_stack = app.build_middleware_stack
    settings = state.settings

    def build_middleware_stack():
        inner = FastRoutes(fastapi_stack(), routers=[v1, v2])
        inner = BodyLimitMiddleware(inner, max_bytes=settings.max_body_bytes, on_reject=state.metrics.reject,
                                    timeout_s=settings.body_timeout_s)
        return MetricsMiddleware(ModelPaths(inner), metrics=state.metrics, models=state.models)

    app.build_middleware_stack = build_middleware_stack


def _openapi(app: FastAPI, state, components: Callable[[], dict]) -> dict:
    """The schema, with the loaded model's input shape and the limits once the bundle is loaded."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from serving.http.models import add_model_paths

    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(components())
    add_model_paths(schema)
    if state.bundle is None:
        return schema  # not cached: it is completed once the model is loaded
    s = state.settings
    app.openapi_schema = describe_model_inputs(schema, state.bundle.input_shape, s.max_inputs, s.max_topk,
                                               [state.bundle.name, state.bundle.name + "-full"], s.max_detect_classes)
    return app.openapi_schema
