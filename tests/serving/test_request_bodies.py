"""Every POST body of the query routes against the answer written down for it: status and error
code per body and route, the bad position named, and valid bodies answered like the offline math.
(The bodies are read by serving/codecs/strict_json.py, not by FastAPI; this table is the contract.)"""
from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from tests.serving.helpers import D, INPUT_DIM, assert_envelope

CT = {"Content-Type": "application/json"}


def _row(seed: int = 0, n: int = 1) -> list:
    return np.round(np.random.default_rng(seed).standard_normal((n, INPUT_DIM)), 4).tolist()


def _raw(obj) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj).encode()


ROW = json.dumps(_row()[0])
ZEROS = [0.0] * (INPUT_DIM - 1)
BODIES = {
    "valid": {"inputs": _row(0, 3)},
    "valid_threshold": {"inputs": _row(1, 2), "threshold": 0.25},
    "valid_int_values": {"inputs": [list(range(INPUT_DIM))]},
    "valid_threshold_null": {"inputs": _row(2), "threshold": None},
    "nan_literal": b'{"inputs": [[NaN' + b", 0" * (INPUT_DIM - 1) + b"]]}",
    "infinity_literal": b'{"inputs": [[Infinity' + b", 0" * (INPUT_DIM - 1) + b"]]}",
    "overflow_double": b'{"inputs": [[1e999' + b", 0" * (INPUT_DIM - 1) + b"]]}",
    "overflow_float32": {"inputs": [[1e39] + ZEROS]},
    "bool_value": {"inputs": [ZEROS[:3] + [True] + ZEROS[3:]]},
    "string_value": {"inputs": [["1.0"] + ZEROS]},
    "null_value": {"inputs": [[None] + ZEROS]},
    "object_value": {"inputs": [[{"x": 1}] + ZEROS]},
    "extra_key": {"inputs": _row(), "foo": 1},
    "empty_inputs": {"inputs": []},
    "inputs_not_list": {"inputs": "0,1,2"},
    "no_inputs": {"threshold": 0.1},
    "wrong_width": {"inputs": [[0.0] * (INPUT_DIM + 1)]},
    "ragged": {"inputs": [[0.0] * INPUT_DIM, [[0.0]] * INPUT_DIM]},
    "too_many_inputs": {"inputs": [[0.0] * INPUT_DIM] * 5},
    "threshold_string": {"inputs": _row(), "threshold": "0.5"},
    "threshold_bool": {"inputs": _row(), "threshold": True},
    "threshold_nan": b'{"inputs": [' + ROW.encode() + b'], "threshold": NaN}',
    "body_is_list": [[0.0] * INPUT_DIM],
    "malformed": b'{"inputs": [[1, 2,',
    "empty_body": b"",
    "k_too_large": {"inputs": _row(), "k": 10_000},
    "k_zero": {"inputs": _row(), "k": 0},
    "k_string": {"inputs": _row(), "k": "5"},
    "k_float": {"inputs": _row(), "k": 5.0},
    "k_fraction": {"inputs": _row(), "k": 4.5},
    "mode_unknown": {"inputs": _row(), "mode": "approx"},
    "mode_index": {"inputs": _row(3, 2), "mode": "index", "k": 3},
}
ROUTES = {"detect": "/v1/classes/7/detect", "softmax": "/v1/classes/7/softmax", "topk": "/v1/topk",
          "detect_unknown_class": f"/v1/classes/{D + 5}/detect"}
FIELDS = {"detect": {"inputs", "threshold"}, "softmax": {"inputs"}, "topk": {"inputs", "k", "mode", "threshold", "matches_only"}}
V, S, NF = "validation_error", "shape_mismatch", "non_finite_value"
# the body's own fault, whatever the route (before any field is read)
BODY_FAULT = {"nan_literal": (422, NF), "infinity_literal": (422, NF), "overflow_double": (422, NF),
              "threshold_nan": (422, NF), "body_is_list": (422, V), "malformed": (400, "malformed_json"),
              "empty_body": (400, "malformed_json")}
INPUTS_FAULT = {"overflow_float32": (422, NF), "bool_value": (422, V), "string_value": (422, V),
                "null_value": (422, V), "object_value": (422, V), "empty_inputs": (422, S),
                "inputs_not_list": (422, V), "wrong_width": (422, S), "ragged": (422, S),
                "too_many_inputs": (422, "too_many_inputs")}
TOPK_FAULT = {"k_too_large": (422, "k_too_large"), "k_zero": (422, V), "k_string": (422, V), "k_fraction": (422, V),
              "mode_unknown": (422, V)}  # k 5.0 is the integer 5 (JSON Schema's rule): valid


def expected(route: str, case: str) -> tuple[int, str | None]:
    """The answer written out: the body's faults, then unknown or missing fields, then the inputs,
    then the other fields, then the class."""
    if case in BODY_FAULT:
        return BODY_FAULT[case]
    kind = "detect" if route.startswith("detect") else route
    body = BODIES[case]
    if set(body) - FIELDS[kind] or "inputs" not in body:
        return 422, V
    if case in INPUTS_FAULT:
        return INPUTS_FAULT[case]
    if case in ("threshold_string", "threshold_bool") or (kind == "topk" and case in TOPK_FAULT):
        return TOPK_FAULT.get(case, (422, V))
    if route == "detect_unknown_class":
        return 404, "unknown_class"
    return 200, None


@pytest.fixture(scope="module")
def client(bundle_path, tmp_path_factory):
    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, wait_ready

    app = create_app(make_settings(bundle_path, tmp_path_factory.mktemp("bodies"), max_inputs=4, max_topk=20))
    with TestClient(app, raise_server_exceptions=False) as c:
        wait_ready(c.get)
        yield c


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("case", sorted(BODIES))
def test_each_body_gets_its_answer(client, route, case):
    status, code = expected(route, case)
    r = client.post(ROUTES[route], content=_raw(BODIES[case]), headers=CT)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert_envelope(r, status, code)


@pytest.mark.parametrize("case,where", [("bool_value", "inputs[0][3] is a boolean"),
                                        ("string_value", "inputs[0][0] is a string ('1.0')"),
                                        ("null_value", "inputs[0][0] is null"),
                                        ("object_value", "inputs[0][0] is an object")])
def test_a_bad_value_is_named_by_example_and_position(client, case, where):
    body = assert_envelope(client.post(ROUTES["detect"], content=_raw(BODIES[case]), headers=CT), 422)
    assert where in body["error"]["message"]


def test_only_the_first_three_bad_values_are_named(client):
    body = {"inputs": [["x"] * INPUT_DIM] * 4}
    message = assert_envelope(client.post(ROUTES["detect"], json=body), 422)["error"]["message"]
    assert message.count(" is a string") == 3


def test_valid_bodies_answer_like_the_offline_math(client, offline):
    x = np.asarray(BODIES["valid"]["inputs"], np.float32)
    got = client.post(ROUTES["detect"], content=_raw(BODIES["valid"]), headers=CT).json()
    np.testing.assert_allclose([e["logit"] for e in got["results"]], offline.logits(x)[:, 7], rtol=1e-4, atol=1e-4)
    got = client.post(ROUTES["detect"], content=_raw(BODIES["valid_int_values"]), headers=CT).json()
    x = np.asarray(BODIES["valid_int_values"]["inputs"], np.float32)
    np.testing.assert_allclose(got["results"][0]["logit"], offline.logits(x)[0, 7], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ct", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_declared_json_is_415(client, ct):
    headers = {} if ct is None else {"Content-Type": ct}
    assert_envelope(client.post(ROUTES["detect"], content=_raw(BODIES["valid"]), headers=headers), 415,
                    "unsupported_media_type")


def test_json_with_a_charset_is_json(client):
    r = client.post(ROUTES["detect"], content=_raw(BODIES["valid"]),
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", [" 7", "7 ", "+7", "7.0", "٧"])
def test_class_paths_are_not_trimmed_or_coerced(client, path):
    from urllib.parse import quote

    r = client.post(f"/v1/classes/{quote(path)}/detect", content=_raw(BODIES["valid"]), headers=CT)
    assert_envelope(r, 404, "unknown_class")


def test_limits_and_readiness_keep_the_envelope(bundle_path, tmp_path):
    """413 while the body is read (declared or chunked) and 503 before ready."""
    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, wait_ready

    app = create_app(make_settings(bundle_path, tmp_path, max_body_bytes=1024))
    with TestClient(app, raise_server_exceptions=False) as c:
        wait_ready(c.get)
        big = orjson.dumps({"inputs": _row(0, 40)})
        assert len(big) > 1024
        assert_envelope(c.post(ROUTES["detect"], content=big, headers=CT), 413, "payload_too_large")

        def chunks():  # no Content-Length: the limit is counted while reading
            yield big[:600]
            yield big[600:]

        assert_envelope(c.post(ROUTES["detect"], content=chunks(), headers=CT), 413, "payload_too_large")
        small = orjson.dumps({"inputs": _row(0, 1)})
        assert c.post(ROUTES["detect"], content=small, headers=CT).status_code == 200
        state = app.state.slc
        state.ready = False
        try:
            assert_envelope(c.post(ROUTES["detect"], content=small, headers=CT), 503, "not_ready")
        finally:
            state.ready = True


@pytest.mark.parametrize("body, found", [
    (b'{"inputs": [[1.5, true, 2]]}', True),
    (b'{"inputs": [[false]]}', True),
    (b'{"inputs":[[1,2],[3,true]]}', True),
    (b'{"inputs": [[1.5, 2.0, 3]]}', False),
    (b'{"inputs": [[1.5]], "name": "true"}', False),  # a string, not a boolean
    (b'{"inputs": [[0.1, 0.2]], "class": "roller"}', False),  # r and l present, no boolean
])
def test_the_boolean_scan_finds_json_booleans_and_only_them(body, found):
    from serving.codecs.strict_json import has_bool_token

    assert has_bool_token(body) is found
