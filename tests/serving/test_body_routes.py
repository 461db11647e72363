"""Body routes answered before FastAPI's router (serving/http/fast_routes.py): the same answers and
envelopes as FastAPI would give, behind a root path too, labelled by route template in /metrics."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np

from tests.serving.helpers import assert_envelope


async def _with_app(app, fn, root_path: str = ""):
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            for _ in range(500):
                if (await c.get(f"{root_path}/v1/health/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.01)
            return await fn(c)


def test_detect_behind_a_root_path_answers_as_offline_math(app_factory, offline, inputs):
    async def call(c):
        return await c.post("/api/v1/classes/3/detect", json={"inputs": inputs.tolist()})

    r = asyncio.run(_with_app(app_factory(), call, root_path="/api"))
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([x["logit"] for x in r.json()["results"]], offline.logits(inputs)[:, 3], rtol=1e-5, atol=1e-4)


def test_a_handler_error_gets_the_apps_envelope_and_its_rejection_count(app_factory, inputs):
    async def call(c):
        bad = await c.post("/v1/classes/no-such-class/detect", json={"inputs": inputs.tolist()})
        return bad, (await c.get("/metrics")).text

    bad, metrics = asyncio.run(_with_app(app_factory(), call))
    assert_envelope(bad, 404, "unknown_class")
    assert 'slc_rejections_total{reason="unknown_class"} 1.0' in metrics
    assert 'endpoint="/v1/classes/{class}/detect",method="POST",status="404"' in metrics


def test_a_body_route_called_with_another_method_is_405_from_fastapi(app_factory):
    async def call(c):
        return await c.put("/v1/classes/3/detect", json={"inputs": [[0.0]]})

    r = asyncio.run(_with_app(app_factory(), call))
    assert_envelope(r, 405, "method_not_allowed")
    assert "POST" in r.headers["allow"]


def test_v2_infer_and_the_versioned_route_answer_alike(app_factory, bundle, inputs):
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(inputs.shape), "data": inputs.ravel().tolist()},
                       {"name": "class_id", "datatype": "INT64", "shape": [len(inputs)], "data": [2] * len(inputs)}]}

    async def call(c):
        plain = await c.post(f"/v2/models/{bundle.name}/infer", json=body)
        versioned = await c.post(f"/v2/models/{bundle.name}/versions/1/infer", json=body)
        return plain, versioned

    plain, versioned = asyncio.run(_with_app(app_factory(), call))
    assert plain.status_code == 200 and versioned.status_code == 200, (plain.text, versioned.text)
    assert plain.json()["outputs"] == versioned.json()["outputs"]


def test_every_post_and_put_route_has_exactly_one_implementation_its_fast_route():
    """FastAPI holds each POST/PUT route's description only: its endpoint is one _description
    registered to a handler, so no second (drifting) implementation can exist."""
    from serving.http import v1, v2
    from serving.http.fast_routes import _FAST_HANDLERS

    routes = [r for router in (v1.router, v2.router) for r in router.routes if {"POST", "PUT"} & set(r.methods)]
    assert len(routes) == 12  # detect (one class, a set), softmax, topk, gallery POST + PUT, class search, enroll, examples, infer
    # (+ versioned), reload-calibration
    assert all(r.endpoint in _FAST_HANDLERS for r in routes)
    assert all(r.endpoint.__qualname__.startswith("_description.") for r in routes)


def test_the_openapi_schema_still_describes_each_fast_routes_body(app_factory):
    schema = app_factory().openapi()
    detect = schema["paths"]["/v1/classes/{class}/detect"]["post"]
    assert detect["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/DetectRequest")
    assert [p["name"] for p in detect["parameters"]] == ["class"]
    put = schema["paths"]["/v1/gallery/items/{item_id}"]["put"]
    assert put["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/GalleryPutRequest")
    assert "requestBody" in schema["paths"]["/v2/models/{model}/infer"]["post"]
