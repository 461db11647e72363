"""The lean query path (serving/http.py `_lean`) against FastAPI's own handler of the same route.

The truth is FastAPI's request cycle with the routes' pydantic models: a Content-Type the lean
path does not take (`application/json; v=1`, still JSON for FastAPI) sends the very same bytes
through it. Every body — valid or not — must get the same status and the same JSON from both,
and the ordinary valid request must really take the lean path.
"""
from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from tests.serving.helpers import D, INPUT_DIM, assert_envelope

LEAN_CT = {"Content-Type": "application/json"}
FASTAPI_CT = {"Content-Type": "application/json; v=1"}  # JSON to FastAPI, declined by the lean path


def _row(seed: int = 0, n: int = 1) -> list:
    return np.round(np.random.default_rng(seed).standard_normal((n, INPUT_DIM)), 4).tolist()


def _raw(obj) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj).encode()


ROW = json.dumps(_row()[0])
BODIES = {
    "valid": {"inputs": _row(0, 3)},
    "valid_threshold": {"inputs": _row(1, 2), "threshold": 0.25},
    "valid_int_values": {"inputs": [list(range(INPUT_DIM))]},
    "valid_threshold_null": {"inputs": _row(2), "threshold": None},
    "nan_literal": b'{"inputs": [[NaN' + b", 0" * (INPUT_DIM - 1) + b"]]}",
    "infinity_literal": b'{"inputs": [[Infinity' + b", 0" * (INPUT_DIM - 1) + b"]]}",
    "overflow_double": b'{"inputs": [[1e999' + b", 0" * (INPUT_DIM - 1) + b"]]}",
    "overflow_float32": {"inputs": [[1e39] + [0.0] * (INPUT_DIM - 1)]},
    "bool_value": {"inputs": [[True] + [0.0] * (INPUT_DIM - 1)]},
    "string_value": {"inputs": [["1.0"] + [0.0] * (INPUT_DIM - 1)]},
    "null_value": {"inputs": [[None] + [0.0] * (INPUT_DIM - 1)]},
    "extra_key": {"inputs": _row(), "foo": 1},
    "empty_inputs": {"inputs": []},
    "no_inputs": {"threshold": 0.1},
    "wrong_width": {"inputs": [[0.0] * (INPUT_DIM + 1)]},
    "ragged": {"inputs": [[0.0] * INPUT_DIM, [0.0] * (INPUT_DIM - 1)]},
    "too_many_inputs": {"inputs": [[0.0] * INPUT_DIM] * 5},
    "threshold_string": {"inputs": _row(), "threshold": "0.5"},
    "threshold_nan": b'{"inputs": [' + ROW.encode() + b'], "threshold": NaN}',
    "body_is_list": [[0.0] * INPUT_DIM],
    "malformed": b'{"inputs": [[1, 2,',
    "empty_body": b"",
    "k_too_large": {"inputs": _row(), "k": 10_000},
    "k_zero": {"inputs": _row(), "k": 0},
    "mode_unknown": {"inputs": _row(), "mode": "approx"},
    "mode_index": {"inputs": _row(3, 2), "mode": "index", "k": 3},
}
ROUTES = {"detect": "/v1/classes/7/detect", "softmax": "/v1/classes/7/softmax", "topk": "/v1/topk",
          "detect_unknown_class": f"/v1/classes/{D + 5}/detect"}


@pytest.fixture(scope="module")
def lean_client(bundle_path, tmp_path_factory):
    from fastapi.testclient import TestClient

    from serving.app import create_app
    from tests.serving.helpers import make_settings, wait_ready

    app = create_app(make_settings(bundle_path, tmp_path_factory.mktemp("lean"), max_inputs=4, max_topk=20))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client.get)
        yield client


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("case", sorted(BODIES))
def test_lean_path_answers_like_fastapi(lean_client, route, case):
    body = _raw(BODIES[case])
    lean = lean_client.post(ROUTES[route], content=body, headers=LEAN_CT)
    truth = lean_client.post(ROUTES[route], content=body, headers=FASTAPI_CT)
    assert lean.status_code == truth.status_code, (lean.text, truth.text)
    assert lean.json() == truth.json()
    assert lean.headers["content-type"] == truth.headers["content-type"]
    if lean.status_code != 200:
        assert_envelope(lean, truth.status_code)


def test_valid_requests_take_the_lean_path(lean_client, monkeypatch):
    import serving.http as http

    taken = []
    for endpoint, (model, fn) in list(http._LEAN.items()):
        async def spy(scope, parsed, _fn=fn):
            taken.append(scope["path"])
            return await _fn(scope, parsed)

        monkeypatch.setitem(http._LEAN, endpoint, (model, spy))
    for route in ("detect", "softmax", "topk"):
        assert lean_client.post(ROUTES[route], content=_raw(BODIES["valid"]), headers=LEAN_CT).status_code == 200
    assert taken == [ROUTES["detect"], ROUTES["softmax"], ROUTES["topk"]]
    # declined: FastAPI answers, the lean handler is never called
    for case in ("nan_literal", "bool_value", "malformed"):
        lean_client.post(ROUTES["detect"], content=_raw(BODIES[case]), headers=LEAN_CT)
    lean_client.post(ROUTES["detect"], content=_raw(BODIES["valid"]), headers=FASTAPI_CT)
    assert len(taken) == 3


def test_lean_path_limits_and_readiness(bundle_path, tmp_path):
    """413 while the body is read and 503 before ready keep the envelope on the lean path too."""
    from fastapi.testclient import TestClient

    from serving.app import create_app
    from tests.serving.helpers import make_settings, wait_ready

    app = create_app(make_settings(bundle_path, tmp_path, max_body_bytes=1024))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client.get)
        big = orjson.dumps({"inputs": _row(0, 40)})
        assert len(big) > 1024
        assert_envelope(client.post(ROUTES["detect"], content=big, headers=LEAN_CT), 413, "payload_too_large")

        def chunks():  # no Content-Length: the limit is counted while reading
            yield big[:600]
            yield big[600:]

        assert_envelope(client.post(ROUTES["detect"], content=chunks(), headers=LEAN_CT), 413, "payload_too_large")
        small = orjson.dumps({"inputs": _row(0, 1)})
        assert client.post(ROUTES["detect"], content=small, headers=LEAN_CT).status_code == 200
        state = app.state.slc
        state.ready = False
        try:
            for headers in (LEAN_CT, FASTAPI_CT):
                assert_envelope(client.post(ROUTES["detect"], content=small, headers=headers), 503, "not_ready")
        finally:
            state.ready = True
