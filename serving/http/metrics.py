"""The HTTP front's telemetry: every request counted and timed by its route template and final
status (serving/core/metrics.py holds the registry), and GET /metrics."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.core.metrics import Metrics


class MetricsMiddleware:
    """Pure ASGI: counts and times every HTTP request by its route template and final status."""

    def __init__(self, app, metrics: Metrics, models=None):
        self.app = app
        self.metrics = metrics
        self.models = models  # serving/core/models.ModelRepository: requests to a model's routes counted per model

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight += 1
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.in_flight -= 1
            route = scope.get("route")
            endpoint = getattr(route, "path_format", None) or getattr(route, "path", None) or "unmatched"
            seconds = time.perf_counter() - start
            self.metrics.observe_request(endpoint, scope.get("method", ""), str(status), seconds)
            model = self._model_of(scope, endpoint)
            if model is not None:
                self.metrics.observe_model(model, endpoint, str(status), seconds)

    def _model_of(self, scope, endpoint: str):
        """The served model a request was for: named in the path (/v1/models/{model}/…, a v2 model name),
        or the default one for today's /v1 routes; None for other routes and names no model is served under."""
        if self.models is None:
            return None
        model = scope.get("slc.model")
        if model is None and endpoint.startswith("/v2/models/"):
            model = (scope.get("path_params") or {}).get("model")
            if model is not None and model not in self.models.models and model.endswith("-full"):
                model = model[:-5]
        elif model is None and endpoint.startswith("/v1/") and not endpoint.startswith(("/v1/health", "/v1/models")):
            default = self.models.default
            model = default.name if default is not None else None
        return model if model in self.models.models else None


metrics_router = APIRouter()


@metrics_router.get("/metrics", include_in_schema=True, tags=["metrics"],
                    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(request: Request):
    body, content_type = request.app.state.slc.metrics.render()
    return Response(body, media_type=content_type)
