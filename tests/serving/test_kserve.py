"""KServe v2 / Open Inference Protocol with the real tritonclient.http against a real uvicorn."""
from __future__ import annotations

import httpx
import orjson
import numpy as np
import pytest

from tests.serving.helpers import assert_envelope

tritonclient_http = pytest.importorskip("tritonclient.http")


@pytest.fixture
def server(live_server):
    return live_server()


@pytest.fixture
def triton(server):
    client = tritonclient_http.InferenceServerClient(url=server.removeprefix("http://"))
    yield client
    client.close()


def test_health_and_metadata(triton, bundle):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.get_server_metadata()["name"] == "slc"
    name = bundle.name
    assert triton.is_model_ready(name) and triton.is_model_ready(name + "-full")
    meta = triton.get_model_metadata(name)
    assert [i["name"] for i in meta["inputs"]] == ["input", "class_id"]
    assert meta["inputs"][0]["shape"] == [-1, *bundle.input_shape]
    assert {o["name"]: o["datatype"] for o in meta["outputs"]} == {"logit": "FP32", "match": "BOOL"}
    full = triton.get_model_metadata(name + "-full")
    shape = [-1, bundle.num_classes]
    assert full["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": shape},
                               {"name": "match", "datatype": "BOOL", "shape": shape},
                               {"name": "threshold", "datatype": "FP32", "shape": shape}]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_single_logit_model(triton, bundle, offline, inputs, binary):
    ids = np.array([0, 7, 7, 49, 3], dtype=np.int64)
    x_in = tritonclient_http.InferInput("input", list(inputs.shape), "FP32")
    x_in.set_data_from_numpy(inputs, binary_data=binary)
    c_in = tritonclient_http.InferInput("class_id", [len(ids)], "INT64")
    c_in.set_data_from_numpy(ids, binary_data=binary)
    outs = [tritonclient_http.InferRequestedOutput(n, binary_data=binary) for n in ("logit", "match")]
    result = triton.infer(bundle.name, [x_in, c_in], outputs=outs)
    logit, match = result.as_numpy("logit"), result.as_numpy("match")
    assert logit.dtype == np.float32 and logit.shape == (5,) and match.dtype == np.bool_
    want = offline.logits(inputs)[np.arange(5), ids]
    np.testing.assert_allclose(logit, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(logit, offline.single_logit(inputs, ids), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(match, want >= bundle.thresholds[ids].astype(np.float64))


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_full_model(triton, bundle, offline, inputs, binary):
    x_in = tritonclient_http.InferInput("input", list(inputs.shape), "FP32")
    x_in.set_data_from_numpy(inputs, binary_data=binary)
    result = triton.infer(bundle.name + "-full", [x_in],
                          outputs=[tritonclient_http.InferRequestedOutput("logits", binary_data=binary)])
    z = result.as_numpy("logits")
    assert z.shape == (5, bundle.num_classes) and z.dtype == np.float32
    np.testing.assert_allclose(z, offline.logits(inputs), rtol=1e-5, atol=1e-4)


def test_tritonclient_surfaces_errors(triton, inputs):
    from tritonclient.utils import InferenceServerException

    x_in = tritonclient_http.InferInput("input", list(inputs.shape), "FP32")
    x_in.set_data_from_numpy(inputs)
    with pytest.raises(InferenceServerException):
        triton.infer("no-such-model", [x_in])


def test_plain_json_nested_data_and_errors(server, bundle, offline, inputs):
    url = f"{server}/v2/models/{bundle.name}/infer"
    body = {"id": "req-1", "inputs": [
        {"name": "input", "shape": list(inputs.shape), "datatype": "FP32", "data": inputs.tolist()},  # nested
        {"name": "class_id", "shape": [5], "datatype": "INT64", "data": [1, 1, 2, 2, 3]}]}
    r = httpx.post(url, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "req-1" and out["model_name"] == bundle.name
    logit = next(o for o in out["outputs"] if o["name"] == "logit")
    assert logit["shape"] == [5] and logit["datatype"] == "FP32"
    np.testing.assert_allclose(logit["data"], offline.logits(inputs)[np.arange(5), [1, 1, 2, 2, 3]], rtol=1e-5, atol=1e-4)

    bad_shape = {"inputs": [dict(body["inputs"][0], shape=[5, 11]), body["inputs"][1]]}
    assert_envelope(httpx.post(url, json=bad_shape), 422)
    missing = {"inputs": [body["inputs"][0]]}
    assert_envelope(httpx.post(url, json=missing), 422, "missing_input")
    unknown_class = {"inputs": [body["inputs"][0], dict(body["inputs"][1], data=[1, 1, 2, 2, 50])]}
    assert_envelope(httpx.post(url, json=unknown_class), 404, "unknown_class")
    import json

    nan = json.dumps({"inputs": [dict(body["inputs"][0], data=[float("nan")] * 60), body["inputs"][1]]})
    r = httpx.post(url, content=nan.encode(), headers={"content-type": "application/json"})  # NaN literals
    assert_envelope(r, 422, "non_finite_value")
    assert_envelope(httpx.post(f"{server}/v2/models/nope/infer", json=body), 404, "unknown_model")
    assert httpx.get(f"{server}/v2").json()["extensions"] == ["binary_tensor_data", "classification", "model_repository"]


def _infer(server, model, inputs, version=None):
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    return httpx.post(server + path, json={"inputs": inputs}, timeout=30)


@pytest.mark.parametrize("class_id,needle", [([7.9], "is a number (7.9)"), ([True], "is a boolean"),
                                             (["7"], "is a string")])
def test_class_ids_are_integers_not_coerced(server, bundle, class_id, needle):
    r = _infer(server, bundle.name, [
        {"name": "input", "datatype": "FP32", "shape": [1, 12], "data": [0.5] * 12},
        {"name": "class_id", "datatype": "INT64", "shape": [1], "data": class_id}])
    assert needle in assert_envelope(r, 422, "validation_error")["error"]["message"]


@pytest.mark.parametrize("data,needle", [(["0.5"] + [0.5] * 11, "is a string"), ([True] + [0.5] * 11, "is a boolean")])
def test_fp32_data_is_numbers_not_coerced(server, bundle, data, needle):
    r = _infer(server, bundle.name + "-full", [{"name": "input", "datatype": "FP32", "shape": [1, 12], "data": data}])
    assert needle in assert_envelope(r, 422, "validation_error")["error"]["message"]


def test_tensor_shapes_are_integers(server, bundle):
    r = _infer(server, bundle.name + "-full", [{"name": "input", "datatype": "FP32", "shape": ["1", 12],
                                                 "data": [0.5] * 12}])
    assert_envelope(r, 422, "validation_error")


def test_only_version_1_exists(server, bundle):
    good = [{"name": "input", "datatype": "FP32", "shape": [1, 12], "data": [0.5] * 12}]
    assert _infer(server, bundle.name + "-full", good, version="1").status_code == 200
    assert_envelope(_infer(server, bundle.name + "-full", good, version="7"), 404, "unknown_version")
    assert_envelope(httpx.get(f"{server}/v2/models/{bundle.name}/versions/2", timeout=10), 404, "unknown_version")


def test_datatypes_are_case_insensitive_and_unknown_ones_named(server, bundle):
    good = {"name": "input", "shape": [1, 12], "data": [0.5] * 12}
    assert _infer(server, bundle.name + "-full", [{**good, "datatype": "fp32"}]).status_code == 200
    assert_envelope(_infer(server, bundle.name + "-full", [{**good, "datatype": "BYTES"}]), 422, "unsupported_datatype")


def test_unknown_input_tensors_are_refused(server, bundle):
    r = _infer(server, bundle.name + "-full", [
        {"name": "input", "datatype": "FP32", "shape": [1, 12], "data": [0.5] * 12},
        {"name": "extra", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]}])
    assert "'extra'" in assert_envelope(r, 422, "unknown_input")["error"]["message"]


@pytest.mark.parametrize("datatype,data,status,needle", [
    ("INT64", [1e20], 422, "range of a 64-bit integer"),
    ("UINT64", [18446744073709551615], 404, "unknown class id 18446744073709551615")])
def test_class_ids_never_wrap_around(server, bundle, datatype, data, status, needle):
    r = _infer(server, bundle.name, [
        {"name": "input", "datatype": "FP32", "shape": [1, 12], "data": [0.5] * 12},
        {"name": "class_id", "datatype": datatype, "shape": [1], "data": data}])
    assert needle in assert_envelope(r, status)["error"]["message"]


def test_a_json_header_too_large_for_any_valid_request_is_refused_unparsed(server, bundle):
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 12], "data": [[]] * 300_000}]}
    assert_envelope(httpx.post(f"{server}/v2/models/{bundle.name}-full/infer", json=body, timeout=30), 422,
                    "shape_mismatch")


_X = {"name": "input", "datatype": "FP32", "shape": [1, 12], "data": [0.5] * 12}


@pytest.mark.parametrize("body,needle", [
    ({}, "inputs: field required"),
    ({"inputs": []}, "at least one tensor"),
    ({"inputs": [[1, 2]]}, "inputs[0]: must be an object"),
    ({"inputs": [{**_X, "name": 7}]}, "inputs[0].name: must be a string"),
    ({"inputs": [{k: v for k, v in _X.items() if k != "datatype"}]}, "inputs[0].datatype: field required"),
    ({"inputs": [{**_X, "shape": [True, 12]}]}, "inputs[0].shape: must be a list of integers"),
    ({"inputs": [{**_X, "parameters": []}]}, "inputs[0].parameters: must be an object"),
    ({"inputs": [_X], "outputs": {"name": "logits"}}, "outputs: must be a list"),
    ({"inputs": [_X], "outputs": [{"name": None}]}, "outputs[0].name: field required"),
    ({"inputs": [_X], "id": 5}, "id: must be a string"),
])
def test_malformed_infer_bodies_name_the_field(server, bundle, body, needle):
    r = httpx.post(f"{server}/v2/models/{bundle.name}-full/infer", json=body, timeout=30)
    assert needle in assert_envelope(r, 422, "validation_error")["error"]["message"]


def test_the_request_id_and_binary_output_parameter_come_back(server, bundle, offline):
    body = {"id": "r-1", "inputs": [_X], "parameters": {"binary_data_output": True}}
    r = httpx.post(f"{server}/v2/models/{bundle.name}-full/infer", json=body, timeout=30)
    n = int(r.headers["inference-header-content-length"])
    head = orjson.loads(r.content[:n])
    assert head["id"] == "r-1" and head["outputs"][0]["parameters"]["binary_data_size"] == 4 * bundle.num_classes
    logits = np.frombuffer(r.content[n:], np.float32)
    np.testing.assert_allclose(logits, offline.logits(np.full((1, 12), 0.5, np.float32))[0], rtol=1e-5, atol=1e-5)
