"""What the HTTP routes share: FastAPI dependencies on the server's state and the documented
error answers of a route (OpenAPI)."""
from __future__ import annotations

from fastapi import Request

from serving.http.fast_routes import app_state
from serving.http.schemas import ErrorEnvelope


def error_responses(*codes: int) -> dict:
    text = {400: "malformed JSON", 401: "missing or wrong API key",
            403: "no API key is set on a host others can reach (writes refused)", 404: "unknown class, item or route",
            408: "the body did not arrive in time", 409: "the name is taken by a class of the bundle (class_exists), a "
            "trained class cannot be deleted, or the bundle folder holds another model or a calibration that does not "
            "match its manifest (nothing reloaded)", 413: "body over the limit",
            415: "the body is not declared as application/json",
            422: "schema or shape violation, NaN/inf, too many inputs", 429: "queue full (Retry-After)",
            503: "not ready, or shutting down; a store that refuses writes (store_unavailable, Retry-After)", 504: "deadline passed (queue and compute)",
            507: "the store could not commit: disk or quota full, or the enrolled classes' limit (enrolled_limit)"}
    return {c: {"model": ErrorEnvelope, "description": text[c]} for c in codes}



# Dependencies are `async def`: a sync one runs in the AnyIO thread pool on every request.
async def server_state(request: Request):
    """The server's state, or under /v1/models/{model}/ that model's view of it (fast_routes.app_state)."""
    return app_state(request.scope)


async def ready_engine(request: Request):
    """The engine, or 503 while loading / after a failed load."""
    return app_state(request.scope).ready_engine()
