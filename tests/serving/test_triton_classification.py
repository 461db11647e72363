"""Triton's classification extension on the KServe v2 fronts (issue 51, part 3), driven by the real,
unmodified tritonclient over HTTP (JSON and binary outputs) and gRPC against a real uvicorn:
`InferRequestedOutput("logits", class_count=k)` on `<name>-full` answers "value:index:label" [N, k],
best first, equal to /v1/topk's entries (an enrolled class included); `match` / `threshold` asked
beside it are those entries' (the open-set answer of part 1), and without classification each logit
against its class's threshold, checked against the offline math (tests/serving/helpers.py)."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.serving.helpers import D, assert_envelope, free_port
from tests.serving.test_enroll import Extended, examples, imprint, lookalikes_truth
from tests.serving.test_open_set import calibrated

httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http,grpc]'")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[http,grpc]'")


@pytest.fixture
def served(live_server):
    """(HTTP url, gRPC port) of a server with one enrolled class, 'gamma'."""
    port = free_port()
    url = live_server(grpc_port=port)
    r = httpx.put(f"{url}/v1/classes/gamma", json={"inputs": examples(3).tolist()})
    assert r.status_code == 201, r.text
    return url, port


def topk(url: str, x: np.ndarray, k: int, **extra) -> dict:
    return httpx.post(f"{url}/v1/topk", json={"inputs": x.tolist(), "k": k, **extra}).json()


def check_against_topk(got: np.ndarray, top: dict, k: int) -> None:
    """Triton's strings, exactly: the /v1/topk entry's float32 logit with 9 decimals, its id, its name."""
    assert got.shape == (len(top["results"]), k)
    for row, want in zip(got.tolist(), top["results"]):
        texts = [s.decode() if isinstance(s, bytes) else s for s in row]
        assert texts == [f"{e['logit']:.9f}:{e['class_id']}:{e['class_name']}" for e in want]


def _probe(enrolled_example: bool = True) -> np.ndarray:
    """Inputs whose top-k mixes trained classes and, for the enrolled class's own example, 'gamma'."""
    x = np.random.default_rng(5).standard_normal((4, examples(3).shape[1])).astype(np.float32)
    return np.concatenate([x, examples(3)[:1]]) if enrolled_example else x


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("k", [1, 5, D + 1])
def test_tritonclient_http_class_count_equals_v1_topk(served, bundle, binary, k):
    url, _ = served
    x = _probe()
    client = httpclient.InferenceServerClient(url=url.removeprefix("http://"))
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outs = [httpclient.InferRequestedOutput("logits", binary_data=binary, class_count=k),
            httpclient.InferRequestedOutput("match", binary_data=binary),
            httpclient.InferRequestedOutput("threshold", binary_data=binary)]
    result = client.infer(bundle.name + "-full", [inp], outputs=outs)
    top = topk(url, x, k)
    check_against_topk(result.as_numpy("logits"), top, k)
    assert any("gamma" in str(s) for s in result.as_numpy("logits")[-1])
    assert result.as_numpy("match").tolist() == [[e["match"] for e in row] for row in top["results"]]
    np.testing.assert_allclose(result.as_numpy("threshold"), [[e["threshold"] for e in row] for row in top["results"]],
                               rtol=1e-7)
    client.close()


@pytest.mark.parametrize("k", [1, 5, D + 1])
def test_tritonclient_grpc_class_count_equals_v1_topk(served, bundle, k):
    url, port = served
    x = _probe()
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    outs = [grpcclient.InferRequestedOutput("logits", class_count=k), grpcclient.InferRequestedOutput("match")]
    result = client.infer(bundle.name + "-full", [inp], outputs=outs, parameters={"threshold": 0.25})
    top = topk(url, x, k, threshold=0.25)
    check_against_topk(result.as_numpy("logits"), top, k)
    assert result.as_numpy("match").tolist() == [[e["match"] for e in row] for row in top["results"]]
    assert client.get_server_metadata().extensions == ["classification"]
    client.close()


def test_match_and_threshold_of_every_logit_without_classification(served, bundle, offline):
    """`<name>-full` asked for match / threshold: each of the D + 1 logits against its class's threshold."""
    url, port = served
    x = _probe()
    row, b = imprint(offline, examples(3))
    ext = Extended(offline, [(D, row, b)], {D: lookalikes_truth(offline.logits(examples(3)), calibrated(bundle))})
    z = ext.logits(x)
    thr = np.concatenate([calibrated(bundle), [bundle.global_threshold]])
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    names = ("logits", "match", "threshold")
    result = client.infer(bundle.name + "-full", [inp], outputs=[grpcclient.InferRequestedOutput(n) for n in names])
    np.testing.assert_allclose(result.as_numpy("logits"), z, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(result.as_numpy("match"), ext.matches(z, thr))  # with gamma's look-alikes
    np.testing.assert_allclose(result.as_numpy("threshold"), np.broadcast_to(thr, z.shape), rtol=1e-7)
    default = client.infer(bundle.name + "-full", [inp])  # no outputs named: the logits alone, as before
    assert [o.name for o in default.get_response().outputs] == ["logits"]
    client.close()


def test_classification_refusals(served, bundle):
    url, _ = served
    x = _probe(False)
    tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}

    def infer(model: str, outputs: list, **extra) -> httpx.Response:
        return httpx.post(f"{url}/v2/models/{model}/infer", json={"inputs": [tensor, *extra.pop("more", [])],
                                                                  "outputs": outputs, **extra})

    full = bundle.name + "-full"
    assert_envelope(infer(full, [{"name": "logits", "parameters": {"classification": 10_000}}]), 422, "k_too_large")
    for bad in (-1, "3", True, 2.5):
        assert_envelope(infer(full, [{"name": "logits", "parameters": {"classification": bad}}]), 422, "validation_error")
    assert_envelope(infer(full, [{"name": "match", "parameters": {"classification": 2}}]), 422, "unsupported_classification")
    ids = {"name": "class_id", "shape": [len(x)], "datatype": "INT64", "data": [1] * len(x)}
    assert_envelope(infer(bundle.name, [{"name": "logit", "parameters": {"classification": 1}}], more=[ids]), 422,
                    "unsupported_classification")
    assert_envelope(infer(full, [{"name": "logits"}, {"name": "logits"}]), 422, "validation_error")
    assert_envelope(infer(full, [{"name": "logits"}], parameters={"threshold": "high"}), 422, "validation_error")
    got = infer(full, [{"name": "logits", "parameters": {"classification": 0}}]).json()  # 0: no classification
    assert got["outputs"][0]["datatype"] == "FP32"
    # the request's threshold reaches the single-logit model's match too
    got = infer(bundle.name, [{"name": "match"}], more=[ids], parameters={"threshold": -100.0}).json()
    assert got["outputs"][0]["data"] == [True] * len(x)
