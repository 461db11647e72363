"""The HTTP front's telemetry: every request counted and timed by its route template and final
status (serving/core/metrics.py holds the registry), and GET /metrics."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.core.metrics import Metrics


class MetricsMiddleware:
    """Pure ASGI: counts and times every HTTP request by its route template and final status."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

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
            self.metrics.observe_request(endpoint, scope.get("method", ""), str(status), time.perf_counter() - start)


metrics_router = APIRouter()


@metrics_router.get("/metrics", include_in_schema=True, tags=["metrics"],
                    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(request: Request):
    body, content_type = request.app.state.slc.metrics.render()
    return Response(body, media_type=content_type)
