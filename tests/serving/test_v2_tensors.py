"""serving/codecs/v2_tensors.py's one-pass reader of the usual infer body against the general readers
(fast_json + the checks, and orjson + the checks): whatever it reads it reads exactly as they do,
and it leaves every other body, valid or not, to them. Fuzzed bodies too."""
from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from serving.codecs import strict_json as read

from serving.codecs import v2_tensors
from serving.errors import SlcError
from tools.loadtest.client import v2_binary_body, v2_json_body
from tests.serving.helpers import json_mutations

SHAPE, MAX_INPUTS = (12,), 8
X = np.round(np.random.default_rng(11).standard_normal((3, 12)), 5)


def _general(body: bytes, strict: bool, binary: bytes = b""):
    """(id, parameters, outputs, {name: (values, dtype, shape, datatype)}) by the general path, or its error."""
    try:
        v2_tensors.check_structure(body, MAX_INPUTS, SHAPE)
        fast = None if strict else v2_tensors.fast_json.infer(body)
        obj, bools = fast if fast is not None else (read.parse_object(body), read.has_bool_token(body))
        req = v2_tensors.parse_infer_request(obj)
        return _plain(req, v2_tensors.decode_inputs(req["inputs"], binary, bools))
    except SlcError as exc:
        return type(exc), exc.code, str(exc)


def _plain(req: dict, tensors: dict):
    """(the strict reader keeps float data as float64 until the model takes float32: compare as the model sees it)"""
    as_model = {n: a.astype(np.float32) if n == "input" else a for n, (a, _) in tensors.items()}
    return (req["id"], req["parameters"], req["outputs"],
            {n: (a.tolist(), str(a.dtype), a.shape, tensors[n][1]) for n, a in as_model.items()})


def _common(body: bytes, binary: bytes = b""):
    got = v2_tensors.read_common(body, binary)
    return None if got is None else _plain(*got)


def _body(x: np.ndarray = X, ids=(4, 0, 9), **fields) -> bytes:
    body = v2_json_body(x, 0)
    body["inputs"][1]["data"] = list(ids)[: len(x)]
    return orjson.dumps({**body, **fields})


def _tensor_edit(i: int, **change) -> bytes:
    body = v2_json_body(X[:1], 2)
    body["inputs"][i].update(change)
    return orjson.dumps(body)


def _binary(x: np.ndarray = X, class_id: int = 4) -> tuple[bytes, bytes]:
    """(JSON header, raw tensors) as tritonclient.http sends them."""
    body, headers = v2_binary_body(x, class_id)
    return v2_tensors.split_binary(headers["Inference-Header-Content-Length"].encode(), body)


def _half_binary() -> tuple[bytes, bytes]:
    """input as raw bytes, class_id as JSON data."""
    body = v2_json_body(X[:1], 2)
    raw = X[:1].astype("<f4").tobytes()
    body["inputs"][0] = {k: v for k, v in body["inputs"][0].items() if k != "data"}
    body["inputs"][0]["parameters"] = {"binary_data_size": len(raw)}
    return orjson.dumps(body), raw


USUAL = {
    "tritonclient's JSON": _body(),
    "one input": _body(X[:1]),
    "id, parameters, outputs": _body(id="r1", parameters={"binary_data_output": False},
                                     outputs=[{"name": "logit"}, {"name": "match", "parameters": {"binary_data": True}}]),
    "class_id first, lower-case datatypes": orjson.dumps({"inputs": [
        {"data": [1], "datatype": "int32", "shape": [1], "name": "class_id"},
        {"name": "input", "shape": [1, 3, 4], "datatype": "fp32", "data": list(range(12))}]}),
    "UINT8 ids": orjson.dumps({"inputs": [v2_json_body(X[:1], 0)["inputs"][0],
                                          {"name": "class_id", "shape": [1], "datatype": "UINT8", "data": [255]}]}),
    "an id out of the model's range (the model says so, not the reader)": _body(X[:1], ids=(10**6,)),
}


BINARY = {"tritonclient's binary": _binary(), "one input, binary": _binary(X[:1]), "input binary, ids JSON": _half_binary(),
          "NaN in the binary input (the decoder says so)": _binary(np.full((1, 12), np.nan))}


@pytest.mark.parametrize("body", USUAL.values(), ids=USUAL.keys())
def test_usual_bodies_are_read_in_one_pass_exactly_as_the_general_readers_read_them(body):
    got = _common(body)
    assert got is not None
    assert got == _general(body, strict=False) == _general(body, strict=True)


@pytest.mark.parametrize("header, raw", BINARY.values(), ids=BINARY.keys())
def test_usual_binary_bodies_are_read_in_one_pass_exactly_as_the_general_readers_read_them(header, raw):
    got = _common(header, raw)
    want = _general(header, strict=True, binary=raw)
    if isinstance(want[0], type) and issubclass(want[0], SlcError):  # an error: left to the general readers, which name it
        assert got is None
    else:
        assert got is not None and got == want


OTHER = {
    "an FP64 input": _tensor_edit(0, datatype="FP64"),
    "binary size beside JSON data": _tensor_edit(0, parameters={"binary_data_size": 48}),
    "binary size with other parameters": orjson.dumps({"inputs": [
        {"name": "input", "shape": [1, 12], "datatype": "FP32", "parameters": {"binary_data_size": 48, "x": 1}},
        v2_json_body(X[:1], 2)["inputs"][1]]}),
    "a third tensor": orjson.dumps({"inputs": [*v2_json_body(X[:1], 2)["inputs"], {"name": "x", "shape": [1],
                                                                                   "datatype": "FP32", "data": [1]}]}),
    "one tensor": orjson.dumps({"inputs": v2_json_body(X[:1], 2)["inputs"][:1]}),
    "the same tensor twice": orjson.dumps({"inputs": [v2_json_body(X[:1], 2)["inputs"][0]] * 2}),
    "an unknown tensor name": _tensor_edit(1, name="class"),
    "a float class id": _tensor_edit(1, data=[2.0]),
    "a boolean class id": _tensor_edit(1, data=[True]),
    "an id beyond INT8": _tensor_edit(1, datatype="INT8", data=[200]),
    "a negative dimension": _tensor_edit(1, shape=[-1]),
    "data short of the shape": _tensor_edit(0, shape=[2, 12]),
    "nested input data": _tensor_edit(0, data=X[:1].reshape(3, 4).tolist()),
    "nested class ids": _tensor_edit(1, data=[[2]]),
    "input data nested one value deep": _tensor_edit(0, data=[[v] for v in X[0].tolist()]),
    "string input data": _tensor_edit(0, shape=[12], data="abcdefghijkl"),
    "object input data": _tensor_edit(0, shape=[1], data={"a": 1}),
    "string class ids": _tensor_edit(1, data="a"),
    "UINT64 ids beyond int64 beside small ones": orjson.dumps({"inputs": [
        v2_json_body(X[:2], 0)["inputs"][0],
        {"name": "class_id", "shape": [2], "datatype": "UINT64", "data": [2 ** 63, 1]}]}),
    "a boolean dimension in a binary tensor": orjson.dumps({"inputs": [
        {"name": "input", "shape": [True, 12], "datatype": "FP32", "parameters": {"binary_data_size": 48}},
        v2_json_body(X[:1], 2)["inputs"][1]]}),
    "an unknown request field": _body(X[:1], foo=1),
    "a wrong id type": _body(X[:1], id=5),
    "outputs not objects": _body(X[:1], outputs=["logit"]),
    "a bracket in a string": _body(X[:1], id="[x"),
    "a repeated key": _body(X[:1])[:-1] + b', "id": "a", "id": "b"}',
    "a byte-order mark": b"\xef\xbb\xbf" + _body(X[:1]),
    "not JSON": _body(X[:1])[:-1],
}


@pytest.mark.parametrize("body", OTHER.values(), ids=OTHER.keys())
def test_other_bodies_are_left_to_the_general_readers(body):
    assert v2_tensors.read_common(body) is None


def test_fuzzed_bodies_read_in_one_pass_match_the_general_readers():
    taken = 0
    for body in json_mutations(5, list(USUAL.values()), 3000):
        got = _common(body)
        if got is not None:
            taken += 1
            assert got == _general(body, strict=True), body
    assert 100 < taken < 3000  # both ways were exercised


ODD_VALUES = ["abc", "", {"a": 1}, {}, True, False, None, 1.5, 0, -1, 2 ** 63, 2 ** 64, [], [1], [[1]], [True], ["1"],
              [1.5], [2 ** 63, 1], [-1], "input", "class_id", "FP32", "INT64", "UINT8", {"binary_data_size": 48},
              {"binary_data_size": True}, {"binary_data_size": 48, "x": 1}]


def test_bodies_with_odd_field_values_read_in_one_pass_match_the_general_readers():
    """Every field of a usual body (JSON and binary form) replaced by odd values, one or two at a time:
    the one pass never raises, and what it reads the general readers read the same."""
    rng = np.random.default_rng(8)
    json_body = v2_json_body(X[:1], 2)
    binary = orjson.loads(_binary(X[:1])[0])
    raw = _binary(X[:1])[1]
    taken = 0
    for _ in range(3000):
        body = orjson.loads(orjson.dumps(json_body if rng.random() < 0.5 else binary))
        for _ in range(rng.integers(1, 3)):
            tensor = body["inputs"][rng.integers(2)]
            key = ["name", "shape", "datatype", "data", "parameters"][rng.integers(5)]
            tensor[key] = ODD_VALUES[rng.integers(len(ODD_VALUES))]
        text = json.dumps(body).encode()  # (orjson refuses integers beyond 64 bits)
        got = _common(text, raw)
        if got is not None:
            taken += 1
            assert got == _general(text, strict=True, binary=raw), text
    assert 20 < taken < 3000


def test_fuzzed_binary_headers_read_in_one_pass_match_the_general_readers():
    header, raw = _binary()
    taken = 0
    for mutated in json_mutations(6, [header], 2000):
        got = _common(mutated, raw)
        if got is not None:
            taken += 1
            assert got == _general(mutated, strict=True, binary=raw), mutated
    assert 20 < taken < 2000


@pytest.mark.parametrize("name", ["string input data", "object input data", "string class ids"])
def test_data_that_is_not_a_list_is_a_422_over_http(client, bundle, name):
    from tests.serving.helpers import assert_envelope

    body = OTHER[name]
    r = client.post(f"/v2/models/{bundle.name}/infer", content=body, headers={"Content-Type": "application/json"})
    assert_envelope(r, 422, "validation_error")


def test_the_usual_body_over_http_takes_the_one_pass_and_is_answered_like_the_strict_reader(client, bundle, inputs,
                                                                                            monkeypatch):
    seen, real = [], v2_tensors.read_common
    monkeypatch.setattr(v2_tensors, "read_common", lambda *args: seen.append(real(*args)) or seen[-1])
    body = orjson.dumps(v2_json_body(inputs.astype(np.float64), 5))
    usual = client.post(f"/v2/models/{bundle.name}/infer", content=body, headers={"Content-Type": "application/json"})
    strict = client.post(f"/v2/models/{bundle.name}/infer", content=body[:-1] + b', "id": null, "id": null}',
                         headers={"Content-Type": "application/json"})  # a repeated key: left to orjson
    assert seen[0] is not None and seen[1] is None
    assert usual.status_code == strict.status_code == 200
    assert usual.json() == strict.json()
