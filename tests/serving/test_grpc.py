"""KServe v2 over gRPC (serving/grpc/server.py) driven by tritonclient.grpc, unmodified, against the
offline math: health and metadata, the single-logit and full models, and errors as gRPC status
codes; the same requests counted in /metrics."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.serving.helpers import free_port, serve_process

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")


@pytest.fixture
def served(live_server):
    port = free_port()
    url = live_server(grpc_port=port)
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    yield client, url
    client.close()


def _inputs(inputs, ids=None):
    x = grpcclient.InferInput("input", list(inputs.shape), "FP32")
    x.set_data_from_numpy(inputs)
    if ids is None:
        return [x]
    c = grpcclient.InferInput("class_id", [len(ids)], "INT64")
    c.set_data_from_numpy(ids)
    return [x, c]


def test_health_and_metadata(served, bundle):
    client, _ = served
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().name == "slc"
    assert client.is_model_ready(bundle.name) and client.is_model_ready(bundle.name + "-full")
    meta = client.get_model_metadata(bundle.name)
    assert [i.name for i in meta.inputs] == ["input", "class_id"]
    assert list(meta.inputs[0].shape) == [-1, *bundle.input_shape]
    assert {o.name: o.datatype for o in meta.outputs} == {"logit": "FP32", "match": "BOOL"}


def test_single_logit_model_equals_offline_math(served, bundle, offline, inputs):
    client, _ = served
    ids = np.array([0, 7, 7, 49, 3], dtype=np.int64)
    result = client.infer(bundle.name, _inputs(inputs, ids))
    logit, match = result.as_numpy("logit"), result.as_numpy("match")
    want = offline.logits(inputs)[np.arange(5), ids]
    np.testing.assert_allclose(logit, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(match, want >= bundle.thresholds[ids].astype(np.float64))


def test_full_model_equals_offline_math(served, bundle, offline, inputs):
    client, _ = served
    z = client.infer(bundle.name + "-full", _inputs(inputs)).as_numpy("logits")
    assert z.shape == (5, bundle.num_classes) and z.dtype == np.float32
    np.testing.assert_allclose(z, offline.logits(inputs), rtol=1e-5, atol=1e-4)


def test_grpc_answers_equal_the_http_v2_answers(served, bundle, inputs):
    client, url = served
    ids = np.array([1, 2, 3, 4, 5], dtype=np.int64)
    by_grpc = client.infer(bundle.name, _inputs(inputs, ids)).as_numpy("logit")
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(inputs.shape), "data": inputs.ravel().tolist()},
                       {"name": "class_id", "datatype": "INT64", "shape": [5], "data": ids.tolist()}]}
    by_http = httpx.post(f"{url}/v2/models/{bundle.name}/infer", json=body).json()["outputs"]
    np.testing.assert_array_equal(by_grpc, np.asarray(next(o for o in by_http if o["name"] == "logit")["data"], np.float32))


@pytest.mark.parametrize("case,code,envelope", [
    ("unknown_model", "NOT_FOUND", "unknown_model"), ("unknown_class", "NOT_FOUND", "unknown_class"),
    ("wrong_shape", "INVALID_ARGUMENT", "shape_mismatch"), ("nan", "INVALID_ARGUMENT", "non_finite_value")])
def test_errors_are_grpc_status_codes_naming_the_envelope_code(served, bundle, inputs, case, code, envelope):
    from tritonclient.utils import InferenceServerException

    client, url = served
    model, ids, x = bundle.name, np.array([0, 1, 2, 3, 4], dtype=np.int64), inputs.copy()
    if case == "unknown_model":
        model = "no-such-model"
    elif case == "unknown_class":
        ids[2] = bundle.num_classes
    elif case == "wrong_shape":
        x = np.zeros((5, 3), np.float32)
    else:
        x[1, 0] = np.nan
    with pytest.raises(InferenceServerException) as err:
        client.infer(model, _inputs(x, ids))
    assert err.value.status() == f"StatusCode.{code}" and err.value.message().startswith(f"{envelope}: ")
    metrics = httpx.get(f"{url}/metrics").text
    assert f'endpoint="grpc:ModelInfer",method="POST",status="{code}"' in metrics


def test_a_request_past_its_deadline_is_deadline_exceeded(live_server, bundle, inputs):
    """The HTTP routes' request deadline holds over gRPC too (queue and compute included)."""
    from tritonclient.utils import InferenceServerException

    port = free_port()
    live_server(grpc_port=port, request_timeout_s=0.05, max_delay_ms=400, adaptive_delay=False)
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer(bundle.name, _inputs(inputs[:1], np.array([0], dtype=np.int64)))
    finally:
        client.close()
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    # answered at the deadline, not when the batch queue dropped the request 400 ms later
    assert err.value.message().startswith("deadline_exceeded: request not answered within its deadline of 0.05 s")


@pytest.mark.integration
def test_grpc_alone_serves_the_offline_math_with_no_http_app(bundle_path, bundle, offline, inputs, tmp_path):
    """`slc serve --grpc-port P --no-http`: the gRPC front on the core, no HTTP port opened, and a
    SIGTERM ends it with exit code 0."""
    import signal
    import socket
    import time

    port, gport = free_port(), free_port()
    proc = serve_process(bundle_path, tmp_path, port, "--grpc-port", str(gport), "--no-http")
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gport}")
    try:
        deadline = time.monotonic() + 60
        while not _ready(client) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert client.is_server_ready(), proc.stdout.read() if proc.poll() is not None else "not ready in 60 s"
        ids = np.array([0, 7, 7, 49, 3], dtype=np.int64)
        logit = client.infer(bundle.name, _inputs(inputs, ids)).as_numpy("logit")
        np.testing.assert_allclose(logit, offline.logits(inputs)[np.arange(5), ids], rtol=1e-5, atol=1e-4)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens for HTTP
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def _ready(client) -> bool:
    from tritonclient.utils import InferenceServerException

    try:
        return client.is_server_ready()
    except InferenceServerException:
        return False
