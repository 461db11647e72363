"""serving/codecs/fast_json.py against the strict reader (orjson + serving/codecs/strict_json.py, serving/http/v2.py):
a body the fast path reads must give exactly what the strict reader gives (values, fields, or
the same error), and every unusual body must be left to the strict reader. Fuzzed bodies too."""
from __future__ import annotations

import numpy as np
import orjson
import pytest

from serving.codecs import fast_json

from serving.codecs import strict_json as read

from serving.codecs import v2_tensors
from serving.errors import SlcError
from tools.loadtest.client import v2_json_body
from tests.serving.helpers import json_mutations

SHAPE, MAX_INPUTS = (12,), 8
ALLOWED = ("inputs", "threshold")


def _strict_query(body: bytes):
    """What the /v1 routes do without the fast path: fields, then float32 examples (or the error)."""
    try:
        obj = read.parse_object(body)
        read.check_keys(obj, ALLOWED, required=("inputs",))
        threshold = read.number(obj, "threshold")
        x = read.examples(obj["inputs"], SHAPE, MAX_INPUTS, read.has_bool_token(body))
        return threshold, x
    except SlcError as exc:
        return type(exc), exc.code, str(exc)


def _fast_query(body: bytes):
    obj = fast_json.query(body, SHAPE, MAX_INPUTS)
    if obj is None:
        return None
    try:
        read.check_keys(obj, ALLOWED, required=("inputs",))
        return read.number(obj, "threshold"), obj["inputs"]
    except SlcError as exc:
        return type(exc), exc.code, str(exc)


def _same(a, b) -> bool:
    if isinstance(a[1], np.ndarray) and isinstance(b[1], np.ndarray):
        return a[0] == b[0] and a[1].dtype == b[1].dtype and a[1].shape == b[1].shape and np.array_equal(a[1], b[1])
    return a == b


def _rows(seed: int, n: int, digits: int = 4) -> list:
    return np.round(np.random.default_rng(seed).standard_normal((n, SHAPE[0])) * 10, digits).tolist()


PLAIN = [
    orjson.dumps({"inputs": _rows(0, 1)}),
    orjson.dumps({"inputs": _rows(1, MAX_INPUTS), "threshold": 0.25}),
    orjson.dumps({"threshold": None, "inputs": _rows(2, 3, digits=12)}),
    orjson.dumps({"inputs": [list(range(-6, 6))]}),  # integers
    b'{ "inputs" : [ [ 1e-3, -2.5E+2, 0, -0, 3.0, 1e-400, 7, 8, 9, 10, 11, 9007199254740991 ] ] }\n',
    b'{"inputs": [[' + b", ".join(b"%.17g" % v for v in np.random.default_rng(3).standard_normal(12)) + b"]]}",
    orjson.dumps({"inputs": _rows(4, 2), "threshold": "high"}),  # a field error: the same error both ways
    orjson.dumps({"inputs": _rows(5, 1), "foo": 1}),  # an unknown field: the same error both ways
]


@pytest.mark.parametrize("body", PLAIN, ids=range(len(PLAIN)))
def test_plain_query_bodies_take_the_fast_path_and_match_the_strict_reader(body):
    fast = _fast_query(body)
    assert fast is not None
    assert _same(fast, _strict_query(body))


ROW = b"1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11"
UNUSUAL = {
    "boolean": b'{"inputs": [[true, ' + ROW + b"]]}",
    "string": b'{"inputs": [["1", ' + ROW + b"]]}",
    "null": b'{"inputs": [[null, ' + ROW + b"]]}",
    "nested value": b'{"inputs": [[[1], ' + ROW + b"]]}",
    "empty list value": b'{"inputs": [[[], 1, ' + ROW + b"]]}",
    "ragged": b'{"inputs": [[0, ' + ROW + b"], [" + ROW + b"]]}",
    "nested example": b'{"inputs": [[[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]]}',
    "duplicate key": b'{"inputs": [[0, ' + ROW + b']], "inputs": [[1, ' + ROW + b"]]}",
    "byte-order mark": b'\xef\xbb\xbf{"inputs": [[0, ' + ROW + b"]]}",
    "NaN": b'{"inputs": [[NaN, ' + ROW + b"]]}",
    "overflow": b'{"inputs": [[1e400, ' + ROW + b"]]}",
    "beyond 2^53": b'{"inputs": [[9007199254740993, ' + ROW + b"]]}",
    "beyond int64": b'{"inputs": [[99999999999999999999, ' + ROW + b"]]}",
    "too many examples": orjson.dumps({"inputs": _rows(0, MAX_INPUTS + 1)}),
    "no examples": b'{"inputs": []}',
    "no inputs": b'{"threshold": 1}',
    "array field": b'{"inputs": [[0, ' + ROW + b']], "threshold": [1]}',
    "bracket in a string": b'{"inputs": [[0, ' + ROW + b']], "threshold": "["}',
    "not an object": b"[[0, " + ROW + b"]]",
    "trailing comma": b'{"inputs": [[0, ' + ROW + b",]]}",
    "trailing garbage": b'{"inputs": [[0, ' + ROW + b"]]} x",
    "invalid UTF-8": b'{"x": "\xff", "inputs": [[0, ' + ROW + b"]]}",
    "lone surrogate": b'{"x": "\\ud800", "inputs": [[0, ' + ROW + b"]]}",
}


@pytest.mark.parametrize("body", UNUSUAL.values(), ids=UNUSUAL.keys())
def test_unusual_query_bodies_are_left_to_the_strict_reader(body):
    assert fast_json.query(body, SHAPE, MAX_INPUTS) is None


def test_fuzzed_query_bodies_read_fast_match_the_strict_reader():
    taken = 0
    for body in json_mutations(0, PLAIN[:6], 3000):
        fast = _fast_query(body)
        if fast is not None:
            taken += 1
            assert _same(fast, _strict_query(body)), body
    assert 100 < taken < 3000  # both paths were exercised


# ----------------------------------------------------------------------------- KServe v2
def _strict_infer(body: bytes):
    return _decoded(read.parse_object(body), read.has_bool_token(body))


def _decoded(obj: dict, bools: bool):
    """What the v2 route does with a parsed body up to the model: the request's fields and tensors."""
    try:
        req = v2_tensors.parse_infer_request(obj)
        tensors = v2_tensors.decode_inputs(req["inputs"], b"", bools)
        x = tensors["input"][0]
        return req["id"], req["outputs"], x.astype(np.float32), {n: (a.tolist(), t) for n, (a, t) in tensors.items() if n != "input"}
    except SlcError as exc:
        return type(exc), exc.code, str(exc)


def _fast_infer(body: bytes):
    fast = fast_json.infer(body)
    return None if fast is None else _decoded(*fast)


def _same_infer(a, b) -> bool:
    if len(a) == 4 and len(b) == 4:
        return a[0] == b[0] and a[1] == b[1] and a[3] == b[3] and a[2].shape == b[2].shape and np.array_equal(a[2], b[2])
    return a == b


X = np.round(np.random.default_rng(7).standard_normal((2, 12)), 4)
V2_PLAIN = [
    orjson.dumps(v2_json_body(X, 3)),
    orjson.dumps({**v2_json_body(X[:1], 0), "id": "r1", "parameters": {"binary_data_output": False},
                  "outputs": [{"name": "logit"}, {"name": "match", "parameters": {"binary_data": True}}]}),
    orjson.dumps({"inputs": [{"name": "input", "shape": [1, 12], "datatype": "fp64", "data": list(range(12))},
                             {"name": "class_id", "shape": [1], "datatype": "INT32", "data": [1]}]}),
    orjson.dumps({"inputs": [{"name": "input", "shape": [1, 12], "datatype": "FP32", "data": X[0].tolist()},
                             {"name": "class_id", "shape": [1], "datatype": "INT64", "data": [True]}]}),  # bool in int data
    orjson.dumps({"inputs": [{"name": "input", "shape": [1, 12], "datatype": "FP32", "data": X[0].tolist()},
                             {"name": "class_id", "shape": [1], "datatype": "INT64", "data": [1.5]}]}),  # not an int
    orjson.dumps({"inputs": [{"name": "input", "shape": [3, 12], "datatype": "FP32", "data": X[0].tolist()}]}),
]


@pytest.mark.parametrize("body", V2_PLAIN, ids=range(len(V2_PLAIN)))
def test_plain_infer_bodies_take_the_fast_path_and_match_the_strict_reader(body):
    fast = _fast_infer(body)
    assert fast is not None
    assert _same_infer(fast, _strict_infer(body))


def _v2(data: bytes, extra: bytes = b"") -> bytes:
    return (b'{"inputs": [{"name": "input", "shape": [1, 12], "datatype": "FP32", "data": ' + data
            + b'}, {"name": "class_id", "shape": [1], "datatype": "INT64", "data": [1]}]' + extra + b"}")


V2_UNUSUAL = {
    "nested data": _v2(b"[[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]"),
    "ragged nesting": _v2(b"[[0], 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]"),
    "boolean data": _v2(b"[true, " + ROW + b"]"),
    "string data": _v2(b'["1", ' + ROW + b"]"),
    "beyond 2^53": _v2(b"[9007199254740993, " + ROW + b"]"),
    "duplicate tensor key": _v2(b"[0, " + ROW + b'], "data": [1, ' + ROW + b"]"),
    "duplicate top key": _v2(b"[0, " + ROW + b"]", b', "inputs": []'),
    "bracket in a string": _v2(b"[0, " + ROW + b"]", b', "id": "["'),
    "byte-order mark": b"\xef\xbb\xbf" + _v2(b"[0, " + ROW + b"]"),
    "NaN": _v2(b"[NaN, " + ROW + b"]"),
    "inputs not a list": b'{"inputs": {"name": "input"}}',
    "not an object": b"[1]",
}


@pytest.mark.parametrize("body", V2_UNUSUAL.values(), ids=V2_UNUSUAL.keys())
def test_unusual_infer_bodies_are_left_to_the_strict_reader(body):
    assert fast_json.infer(body) is None


def test_fuzzed_infer_bodies_read_fast_match_the_strict_reader():
    taken = 0
    for body in json_mutations(1, V2_PLAIN, 3000):
        fast = _fast_infer(body)
        if fast is not None:
            taken += 1
            assert _same_infer(fast, _strict_infer(body)), body
    assert 100 < taken < 3000


def test_infer_reports_a_boolean_anywhere_outside_float_data():
    assert fast_json.infer(V2_PLAIN[0])[1] is False
    assert fast_json.infer(V2_PLAIN[3])[1] is True  # the class_id's true
    assert fast_json.infer(_v2(b"[0, " + ROW + b"]", b', "parameters": {"x": false}'))[1] is True


# ----------------------------------------------------------------------------- over HTTP
def _spy(monkeypatch, name: str) -> list:
    """Record what fast_json.<name> returned to the routes (None: the strict reader took the body)."""
    seen, real = [], getattr(fast_json, name)

    def spy(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(fast_json, name, spy)
    return seen


def test_a_plain_detect_body_is_read_fast_and_answered_like_the_strict_reader(client, inputs, monkeypatch):
    seen = _spy(monkeypatch, "query")
    rows = orjson.dumps(inputs.tolist())
    fast = client.post("/v1/classes/3/detect", content=b'{"inputs": ' + rows + b"}", headers={"Content-Type": "application/json"})
    # a duplicate key: orjson keeps the last, the fast path declines it
    strict = client.post("/v1/classes/3/detect", content=b'{"inputs": [[0]], "inputs": ' + rows + b"}",
                         headers={"Content-Type": "application/json"})
    assert seen[0] is not None and seen[1] is None
    assert fast.status_code == strict.status_code == 200
    assert fast.json() == strict.json()


def test_a_v2_body_with_an_extra_field_is_read_fast_and_answered_like_the_strict_reader(client, bundle, inputs,
                                                                                        monkeypatch):
    seen = _spy(monkeypatch, "infer")  # (the usual body takes serving/codecs/v2_tensors.py's one pass: not this one)
    body = orjson.dumps({**v2_json_body(inputs.astype(np.float64), 5), "inputs_note": 1})
    fast = client.post(f"/v2/models/{bundle.name}/infer", content=body, headers={"Content-Type": "application/json"})
    strict = client.post(f"/v2/models/{bundle.name}/infer", content=body[:-1] + b', "id": null, "id": null}',
                         headers={"Content-Type": "application/json"})  # a duplicate key: strict reader
    assert seen[0] is not None and seen[1] is None
    assert fast.status_code == strict.status_code == 200
    assert fast.json() == strict.json()


def test_binary_tensor_data_is_checked_for_nan_even_beside_json_data(client, bundle):
    from tests.serving.helpers import INPUT_DIM, assert_envelope

    raw = np.zeros(INPUT_DIM, np.float32)
    raw[3] = np.nan
    head = orjson.dumps({"inputs": [
        {"name": "input", "shape": [1, INPUT_DIM], "datatype": "FP32", "data": [0.0] * INPUT_DIM,  # read fast, and ignored
         "parameters": {"binary_data_size": raw.nbytes}},
        {"name": "class_id", "shape": [1], "datatype": "INT64", "data": [1]}]})
    r = client.post(f"/v2/models/{bundle.name}/infer", content=head + raw.tobytes(),
                    headers={"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))})
    assert_envelope(r, 422, "non_finite_value")
