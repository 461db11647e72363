"""`create_app(settings) -> FastAPI`: the server's assembly and lifecycle (docs/api.md).

Start-up runs in the background so /health/live answers at once: load and verify the bundle
(a hash mismatch means never ready; under `slc serve` the process exits non-zero), open the
ORT sessions, the class index and the gallery, warm up, then ready. On SIGTERM (serving/main.py)
readiness turns 503 at once, uvicorn lets in-flight requests finish, and the lifespan's end
drains the batch queue before the worker thread stops.

Layout along the request path (as in the `infinity` embedding server):
http.py / kserve.py -> engine.py -> batcher.py -> runtime.py (onnxruntime).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Callable, Optional

import numpy as np
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from serving.body_routes import BodyRoutes
from serving.errors import BodyLimitMiddleware, NotReady, OrjsonResponse, install_error_handlers
from serving.metrics import Metrics, MetricsMiddleware
from serving.schemas import describe_model_inputs
from serving.settings import Settings

log = logging.getLogger(__name__)


class ServerState:
    """What the routes see: settings, metrics and, once loaded, the bundle and engine."""

    def __init__(self, settings: Settings, metrics: Metrics, on_fatal: Optional[Callable[[BaseException], None]]):
        self.settings = settings
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.bundle = None
        self.engine = None
        self.runtime = None
        self.index = None
        self.gallery = None
        self.ready = False
        self.draining = False
        self.load_error: Optional[str] = None
        self.loader: Optional[asyncio.Task] = None

    @property
    def is_ready(self) -> bool:
        return self.ready and not self.draining

    def not_ready_reason(self) -> str:
        if self.draining:
            return "the server is shutting down"
        if self.load_error:
            return f"the model could not be loaded: {self.load_error}"
        return "the model is still loading"

    def ready_engine(self):
        """The engine, or NotReady (503) while loading / after a failed load. A draining server
        still answers: requests already on their way finish."""
        if self.engine is None or not self.ready:
            raise NotReady(self.not_ready_reason())
        return self.engine

    def set_ready(self, value: bool) -> None:
        self.ready = value
        self.metrics.ready.set(1 if self.is_ready else 0)

    def start_draining(self) -> None:
        """Readiness -> 503 now; in-flight and queued requests still finish."""
        self.draining = True
        self.metrics.ready.set(0)

    def model_info(self) -> dict:
        b, engine = self.bundle, self.engine
        m = b.manifest
        summary = {k: m[k] for k in ("format", "format_version", "name", "version", "created", "input", "embed_dim",
                                     "num_classes", "loss", "backbone", "test_metrics", "calibration_metrics", "dataset",
                                     "content_sha256") if k in m}
        summary["classes_preview"] = list(b.classes[:10])
        cal = b.calibration
        thr = b.thresholds[np.isfinite(b.thresholds)]
        calibration = {k: cal[k] for k in cal if k != "per_class"}
        calibration["per_class"] = {"count": len(cal.get("per_class", []))}
        if len(thr):
            calibration["per_class"].update(threshold_min=float(thr.min()), threshold_median=float(np.median(thr)),
                                            threshold_max=float(thr.max()))
        s = self.settings
        return {
            "name": b.name,
            "version": m.get("version"),
            "input": m.get("input", {"shape": list(b.input_shape), "dtype": "float32"}),
            "image": b.image,  # how an image body becomes one input; null: JSON only
            "embed_dim": b.embed_dim,
            "num_classes": b.num_classes,
            "digest": b.digest,
            "manifest": summary,
            "calibration": calibration,
            "providers": list(self.runtime.providers),
            "device": s.device,
            "softmax_impl": engine.softmax_impl,
            "softmax_timing_ms": {k: round(v * 1e3, 3) for k, v in engine.softmax_timing.items()},
            "index": self.index.info(),
            "gallery": {"index_kind": self.gallery.index_kind},
            "batching": {"max_batch": s.max_batch, "max_delay_ms": s.max_delay_ms, "queue_size_inputs": s.queue_size,
                         "request_timeout_s": s.request_timeout_s, "max_inputs": s.max_inputs,
                         "intra_op_threads": s.intra_op_threads, "inline_max_ms": s.inline_max_ms,
                         "one_thread_backbone_max_batch": self.runtime.small_batch_max,
                         "concurrent_batches": engine.batcher.lanes},
        }


async def _load(state: ServerState) -> None:
    """Bundle -> sessions -> index -> gallery -> warm-up -> ready. Any failure: never ready."""
    from serving import image_decoder
    from serving.bundle import load_bundle, release_memory
    from serving.engine import Engine
    from serving.gallery import open_gallery
    from serving.index import ClassIndex
    from serving.runtime import Runtime

    s = state.settings
    try:
        path = s.bundle
        if path is None:
            from serving.default_model import ensure_default_bundle

            path = await asyncio.to_thread(ensure_default_bundle, s.home)
        log.info("loading bundle %s (verify=%s)", path, s.verify)
        bundle = await asyncio.to_thread(load_bundle, path, s.verify)
        state.bundle = bundle
        if bundle.image is not None:  # image bodies: decode processes, starting while the rest loads
            image_decoder.pool_for(s)
        state.runtime = await asyncio.to_thread(Runtime, bundle, s.device, s.intra_op_threads)
        device = "cuda" if state.runtime.uses_cuda else "cpu"
        s.data_dir.mkdir(parents=True, exist_ok=True)
        state.index = await asyncio.to_thread(ClassIndex.open, bundle, s.data_dir / "index-cache", device,
                                              None if s.class_index == "auto" else s.class_index)
        state.gallery = await asyncio.to_thread(open_gallery, s.gallery_url, s.data_dir, bundle.digest,
                                                bundle.embed_dim, device, s.gallery_max_bytes)
        engine = Engine(bundle, state.runtime, s, index=state.index, gallery=state.gallery, metrics=state.metrics)
        engine.start()
        state.engine = engine
        await asyncio.to_thread(_reembed_gallery, state.gallery, engine)
        if s.warmup:
            await engine.warm_up()
        # start-up garbage (1M calibration dicts, a trained-then-dropped class index) back to the OS
        await asyncio.to_thread(release_memory)
        if bundle.image is not None:
            await image_decoder.start(s)
        state.set_ready(True)
        log.info("ready: %s (D=%d, d=%d, input %s) providers=%s softmax=%s index=%s",
                 bundle.name, bundle.num_classes, bundle.embed_dim, list(bundle.input_shape), state.runtime.providers,
                 engine.softmax_impl, state.index.kind)
        if s.bundle is None:
            from serving.default_model import curl_hint

            hint = curl_hint(s.home, s.host, s.port)
            if hint:
                log.info(hint)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, and the process exits under `slc serve`
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("cannot serve bundle %s: %s", s.bundle or "(default)", state.load_error)
        if state.on_fatal is not None:
            state.on_fatal(exc)


def _reembed_gallery(gallery, engine) -> None:
    """Items stored under another bundle are re-embedded from their inputs with this backbone."""
    from serving.errors import ApiError

    stale = gallery.stale_count()
    if not stale:
        return

    def embed(inputs: list):
        try:
            return engine.runtime.embed(engine.to_batch(inputs, what="gallery inputs"))
        except ApiError as exc:  # the gallery expects ValueError for inputs this bundle cannot take
            raise ValueError(exc.message) from None

    log.info("gallery: re-embedding %d items stored under another bundle", stale)
    done = gallery.reembed(embed, batch_size=min(256, engine.settings.max_inputs))
    log.info("gallery: %d of %d items re-embedded", done, stale)


def create_app(settings: Optional[Settings] = None, *, on_fatal: Optional[Callable[[BaseException], None]] = None
               ) -> FastAPI:
    """The ASGI app. `on_fatal(exc)` is called when start-up fails (serving/main.py exits non-zero)."""
    settings = settings or Settings()
    metrics = Metrics()
    state = ServerState(settings, metrics, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        grpc_server = None
        if settings.grpc_port is not None:  # before the model loads: it answers UNAVAILABLE until ready
            from serving.grpc_v2 import start_grpc

            grpc_server = await start_grpc(state, settings.host, settings.grpc_port, settings.max_body_bytes)
        loader = asyncio.create_task(_load(state), name="slc-load")
        state.loader = loader
        try:
            yield
        finally:
            state.start_draining()
            if grpc_server is not None:
                await grpc_server.stop(settings.request_timeout_s)
            if not loader.done():
                loader.cancel()
                try:
                    await loader
                except asyncio.CancelledError:
                    pass
            if state.engine is not None:
                await state.engine.stop()  # finishes whatever is still queued
            from serving import image_decoder

            image_decoder.stop(settings)  # kills the decode processes
            if state.gallery is not None:
                await asyncio.to_thread(state.gallery.close)
            log.info("stopped")

    # FastAPI's native OpenTelemetry hooks are off: slc's metrics are Prometheus (/metrics), and
    # the hooks look up the global providers on every request.
    app = FastAPI(title="slc", version="1", lifespan=lifespan, default_response_class=OrjsonResponse,
                  telemetry={"tracing": False, "metrics": False, "logs": False},
                  description="Single-logit classification: one logit per query (docs/api.md).")
    app.state.slc = state

    def openapi() -> dict:
        """The schema, with the loaded model's input shape and the limits once the bundle is loaded."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(kserve_components())
        if state.bundle is None:
            return schema  # not cached: it is completed once the model is loaded
        app.openapi_schema = describe_model_inputs(schema, state.bundle.input_shape, settings.max_inputs,
                                                   settings.max_topk, [state.bundle.name, state.bundle.name + "-full"])
        return app.openapi_schema

    app.openapi = openapi

    from serving.http import metrics_router, router as v1
    from serving.demo import router as demo_router
    from serving.kserve import openapi_components as kserve_components, router as v2

    app.include_router(v1)
    app.include_router(v2)
    app.include_router(metrics_router)
    app.include_router(demo_router)
    install_error_handlers(app, on_error=metrics.reject)
    # The request path, outermost first: metrics (sees every status, 413s included), the body
    # limit, the body routes (serving/body_routes.py), then FastAPI's own stack (its error,
    # telemetry and body-size layers, the router) for everything else. The three are wrapped
    # around FastAPI's stack rather than added as middleware, which FastAPI would put inside its
    # own layers: a body route passes through none of them.
    fastapi_stack = app.build_middleware_stack

    def build_middleware_stack():
        inner = BodyRoutes(fastapi_stack(), routers=[v1, v2])
        inner = BodyLimitMiddleware(inner, max_bytes=settings.max_body_bytes, on_reject=metrics.reject,
                                    timeout_s=settings.body_timeout_s)
        return MetricsMiddleware(inner, metrics=metrics)

    app.build_middleware_stack = build_middleware_stack
    return app
