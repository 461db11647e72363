"""Every bad input of DESIGN.md §7 gets its status and the one error envelope."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.serving.helpers import assert_envelope

GOOD = [[0.5] * 12]
DETECT = "/v1/classes/3/detect"


def _raw(client, path, text: str, method: str = "POST"):
    return client.request(method, path, content=text.encode(), headers={"content-type": "application/json"})


def test_malformed_json_is_400(client):
    assert_envelope(_raw(client, DETECT, '{"inputs": [[1, 2'), 400, "malformed_json")
    assert_envelope(_raw(client, DETECT, "{'inputs': 1}"), 400, "malformed_json")
    assert_envelope(_raw(client, "/v2/models/synthetic-D50-d16-s0/infer", "{nope"), 400, "malformed_json")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_json_literals_are_422(client, literal):
    """The stdlib parser reads NaN/Infinity/1e999 as floats; they must not reach the model."""
    text = '{"inputs": [[%s, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]}' % literal
    assert_envelope(_raw(client, DETECT, text), 422, "non_finite_value")
    assert_envelope(_raw(client, DETECT, '{"inputs": %s, "threshold": %s}' % (GOOD, literal)), 422, "non_finite_value")


def test_float32_overflow_is_422(client):
    assert_envelope(client.post(DETECT, json={"inputs": [[1e39] + [0.0] * 11]}), 422, "non_finite_value")


@pytest.mark.parametrize("body", [
    {},  # inputs missing
    {"inputs": []},  # empty
    {"inputs": "abc"},
    {"inputs": [["1.0"] * 12]},  # strings are not numbers
    {"inputs": [[True] * 12]},  # neither are booleans
    {"inputs": GOOD, "extra": 1},  # unknown field
    {"inputs": GOOD, "threshold": "high"},
], ids=["missing", "empty", "string", "string-values", "bools", "extra-field", "bad-threshold"])
def test_schema_violations_are_422(client, body):
    assert_envelope(client.post(DETECT, json=body), 422)


@pytest.mark.parametrize("inputs", [[[0.5] * 11], [[0.5] * 13], [[[0.5] * 6] * 2], [[0.5] * 12, [0.5] * 11], [0.5] * 12],
                         ids=["short", "long", "wrong-nesting", "ragged", "not-a-list-of-examples"])
def test_shape_violations_are_422(client, inputs):
    body = assert_envelope(client.post(DETECT, json={"inputs": inputs}), 422)
    assert body["error"]["code"] in ("shape_mismatch", "validation_error")


def test_too_many_inputs_is_422(client_factory):
    c = client_factory(max_inputs=4)
    assert c.post(DETECT, json={"inputs": GOOD * 4}).status_code == 200
    assert_envelope(c.post(DETECT, json={"inputs": GOOD * 5}), 422, "too_many_inputs")
    items = [{"id": str(i), "input": GOOD[0]} for i in range(5)]
    assert_envelope(c.post("/v1/gallery/items", json={"items": items}), 422, "too_many_inputs")


def test_topk_bad_k_and_mode(client):
    assert_envelope(client.post("/v1/topk", json={"inputs": GOOD, "k": 0}), 422)
    assert_envelope(client.post("/v1/topk", json={"inputs": GOOD, "k": 10**6}), 422, "k_too_large")
    assert_envelope(client.post("/v1/topk", json={"inputs": GOOD, "mode": "approximate"}), 422)


@pytest.mark.parametrize("ref", ["nope", "50", "-1", "1.5", "%20"])
def test_unknown_class_is_404(client, ref):
    for route in ("detect", "softmax", "search"):
        body = {"inputs": GOOD} if route != "search" else {}
        assert_envelope(client.post(f"/v1/classes/{ref}/{route}", json=body), 404, "unknown_class")


def test_unknown_route_item_and_method(client):
    assert_envelope(client.get("/v1/nothing-here"), 404, "not_found")
    assert_envelope(client.get("/v1/gallery/items/never-stored"), 404, "unknown_item")
    assert_envelope(client.delete("/v1/gallery/items/never-stored"), 404, "unknown_item")
    assert_envelope(client.get(DETECT), 405, "method_not_allowed")
    assert_envelope(client.get("/v2/models/not-a-model"), 404, "unknown_model")


def test_body_over_limit_is_413_with_and_without_content_length(client_factory):
    c = client_factory(max_body_bytes=4096)
    big = {"inputs": [[0.123456789] * 12] * 200}  # ~30 kB
    assert_envelope(c.post(DETECT, json=big), 413, "payload_too_large")

    def chunks():  # no Content-Length: the middleware must count while reading
        yield b'{"inputs": ['
        for i in range(400):
            yield (b"," if i else b"") + b"[" + b",".join([b"0.123456789"] * 12) + b"]"
        yield b"]}"

    r = c.post(DETECT, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert_envelope(r, 413, "payload_too_large")
    assert c.post(DETECT, json={"inputs": GOOD}).status_code == 200  # small bodies still pass
    assert 'slc_rejections_total{reason="payload_too_large"} 2.0' in c.get("/metrics").text


def test_api_key_guards_write_routes_only(client_factory):
    c = client_factory(api_key="s3cret")
    item = {"items": [{"id": "a", "input": GOOD[0]}]}
    assert_envelope(c.post("/v1/gallery/items", json=item), 401, "unauthorized")
    assert_envelope(c.post("/v1/gallery/items", json=item, headers={"x-api-key": "wrong"}), 401, "unauthorized")
    assert_envelope(c.delete("/v1/gallery/items/a"), 401, "unauthorized")
    assert c.post("/v1/gallery/items", json=item, headers={"authorization": "Bearer s3cret"}).status_code == 201
    assert c.post(DETECT, json={"inputs": GOOD}).status_code == 200  # queries need no key
    assert c.get("/v1/gallery/items/a").status_code == 200
    assert c.delete("/v1/gallery/items/a", headers={"x-api-key": "s3cret"}).status_code == 204


def test_not_ready_is_503_when_the_bundle_cannot_load(client_factory, tmp_path):
    c = client_factory(wait=False, bundle=tmp_path / "no-such-bundle")
    import time

    for _ in range(200):  # the loader fails in the background; live stays up, ready never comes
        body = c.get("/v1/health/ready").json()
        if "could not be loaded" in body["error"]["message"]:
            break
        time.sleep(0.02)
    assert c.get("/v1/health/live").status_code == 200
    assert_envelope(c.get("/v1/health/ready"), 503, "not_ready")
    assert_envelope(c.post(DETECT, json={"inputs": GOOD}), 503, "not_ready")
    assert_envelope(c.get("/v1/model"), 503, "not_ready")
    assert_envelope(c.get("/v2/health/ready"), 503, "not_ready")


def test_hash_mismatch_is_never_ready(client_factory, bundle_path, tmp_path):
    import shutil

    bad = tmp_path / "tampered"
    shutil.copytree(bundle_path, bad)
    raw = bytearray((bad / "head_bias.npy").read_bytes())
    raw[-1] ^= 0x01
    (bad / "head_bias.npy").write_bytes(bytes(raw))
    c = client_factory(wait=False, bundle=bad)
    import time

    for _ in range(300):
        body = c.get("/v1/health/ready").json()
        if "could not be loaded" in body["error"]["message"]:
            break
        time.sleep(0.02)
    msg = assert_envelope(c.get("/v1/health/ready"), 503, "not_ready")["error"]["message"]
    assert "head_bias.npy" in msg and "sha256" in msg


def test_device_cuda_without_a_usable_gpu_is_never_ready(client_factory):
    from serving.core.device.libcuda import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("a GPU is present")
    c = client_factory(wait=False, device="cuda")
    import time

    for _ in range(300):
        if "could not be loaded" in c.get("/v1/health/ready").json()["error"]["message"]:
            break
        time.sleep(0.02)
    assert "cuda" in assert_envelope(c.get("/v1/health/ready"), 503, "not_ready")["error"]["message"].lower()


@pytest.mark.parametrize("ref", ["%C2%B2", "--5", "1" * 5000], ids=["unicode-digit", "double-minus", "huge"])
def test_odd_class_refs_are_404_not_500(client, ref):
    assert_envelope(client.post(f"/v1/classes/{ref}/detect", json={"inputs": GOOD}), 404, "unknown_class")


@pytest.mark.parametrize("metadata", ['{"x": NaN}', '{"s": "\\ud800"}'], ids=["nan", "lone-surrogate"])
def test_gallery_metadata_that_cannot_be_answered_back_is_422(client, metadata):
    text = '{"items": [{"id": "m", "input": %s, "metadata": %s}]}' % (GOOD[0], metadata)
    assert_envelope(_raw(client, "/v1/gallery/items", text), 422)
    assert client.get("/v1/gallery/items/m").status_code == 404  # nothing stored


def test_deeply_nested_json_is_400_on_every_route(client):
    text = "[" * 5000 + "]" * 5000
    assert_envelope(_raw(client, DETECT, text), 400, "malformed_json")
    assert_envelope(_raw(client, "/v2/models/synthetic-D50-d16-s0/infer", text), 400, "malformed_json")


# --- no coercion anywhere: each of these was once silently accepted


def _upsert(client, item_json: str):
    return _raw(client, "/v1/gallery/items", '{"items": [%s]}' % item_json)


@pytest.mark.parametrize("metadata", ['{"n": %d}' % 2**70, '{"n": -%d}' % (2**53 + 1), '{"deep": [{"n": %d}]}' % 2**60])
def test_metadata_integers_beyond_2_53_are_refused(client, metadata):
    r = _upsert(client, '{"id": "big", "input": %s, "metadata": %s}' % (GOOD[0], metadata))
    assert "2^53" in assert_envelope(r, 422, "validation_error")["error"]["message"]


def test_metadata_integers_within_2_53_are_kept_exactly(client):
    n = 2**53 - 1
    assert _upsert(client, '{"id": "exact", "input": %s, "metadata": {"n": %d, "f": 0.1}}' % (GOOD[0], n)).status_code == 201
    got = client.get("/v1/gallery/items/exact").json()["metadata"]
    assert got == {"n": n, "f": 0.1} and type(got["n"]) is int


@pytest.mark.parametrize("item,needle", [
    ('{"id": 7, "input": %s}' % GOOD[0], "items[0].id"),
    ('{"id": "", "input": %s}' % GOOD[0], "items[0].id"),
    ('{"id": "a", "input": %s, "metadata": [1]}' % GOOD[0], "items[0].metadata"),
    ('{"id": "a", "input": %s, "extra": 1}' % GOOD[0], "unknown field 'extra'"),
    ('{"id": "a"}', "'input' is required"),
    ('{"id": "a", "input": [true%s]}' % (", 0" * 11), "is a boolean"),
])
def test_gallery_items_are_checked_strictly(client, item, needle):
    assert needle in assert_envelope(_upsert(client, item), 422)["error"]["message"]


@pytest.mark.parametrize("body", ['{"limit": null}', '{"limit": "5"}', '{"limit": 5.5}', '{"limit": 0}',
                                  '{"limit": 100001}', '{"threshold": true}', '{"threshold": "1"}', '{"top": 1}'])
def test_search_parameters_are_strict(client, body):
    assert_envelope(_raw(client, "/v1/classes/3/search", body), 422, "validation_error")


def test_search_with_no_body_uses_the_defaults(client):
    r = client.post("/v1/classes/3/search")
    assert r.status_code == 200, r.text
    assert r.json()["class_id"] == 3


@pytest.mark.parametrize("threshold,code", [("NaN", "non_finite_value"), ("Infinity", "non_finite_value"),
                                            ("1e999", "non_finite_value"), ("true", "validation_error")])
def test_threshold_nan_and_booleans_get_their_own_message(client, threshold, code):
    body = assert_envelope(_raw(client, DETECT, '{"inputs": %s, "threshold": %s}' % (GOOD, threshold)), 422, code)
    assert ("finite" in body["error"]["message"]) == (code == "non_finite_value")


# --- finite float32 inputs whose outputs overflow the network (found by `slc bench fuzz`: topk index was a 500)
HUGE = [[3.0e38, -3.0e38] * 6]


@pytest.mark.parametrize("path,body", [
    (DETECT, {"inputs": HUGE}), ("/v1/classes/3/softmax", {"inputs": HUGE}),
    ("/v1/topk", {"inputs": HUGE, "mode": "exact"}), ("/v1/topk", {"inputs": HUGE, "mode": "index"}),
    ("/v1/gallery/items", {"items": [{"id": "huge", "input": HUGE[0]}]})])
def test_outputs_that_overflow_are_422_not_500(client, path, body):
    assert_envelope(client.post(path, json=body), 422, "non_finite_output")
    assert client.get("/v1/gallery/items/huge").status_code == 404


def test_an_overflowing_input_does_not_spoil_the_others_in_its_request(client, offline):
    """One request with a normal input first: the answer is refused as a whole (422), and the
    next ordinary request is answered as before."""
    normal = [[0.5] * 12]
    assert_envelope(client.post("/v1/topk", json={"inputs": normal + HUGE, "mode": "index", "k": 3}), 422,
                    "non_finite_output")
    r = client.post("/v1/topk", json={"inputs": normal, "mode": "index", "k": 3})
    assert r.status_code == 200
    want = np.argsort(-offline.logits(np.asarray(normal, np.float32))[0])[:3]
    assert [e["class_id"] for e in r.json()["results"][0]] == want.tolist()


def test_the_deadline_covers_work_outside_the_batch_queue_too(client_factory, monkeypatch):
    """A gallery search (no batch queue) that takes longer than the deadline is answered 504,
    not late; the server answers the next request."""
    import time as _time

    c = client_factory(request_timeout_s=0.3)
    gallery = c.app.state.slc.gallery
    real = gallery.search_raw
    monkeypatch.setattr(gallery, "search_raw", lambda *a, **k: (_time.sleep(1.0), real(*a, **k))[1])
    body = assert_envelope(c.post("/v1/classes/3/search", json={}), 504, "deadline_exceeded")
    assert "0.3 s" in body["error"]["message"]
    monkeypatch.setattr(gallery, "search_raw", real)
    assert c.post("/v1/classes/3/search", json={}).status_code == 200


# --- found by review: each once wrong


def test_deeply_nested_metadata_is_422_not_500(client):
    deep = "[" * 300 + "1" + "]" * 300
    r = _upsert(client, '{"id": "deep", "input": %s, "metadata": {"a": %s}}' % (GOOD[0], deep))
    assert "nested deeper than 64" in assert_envelope(r, 422, "validation_error")["error"]["message"]
    chain = '{"a": ' * 1000 + "1" + "}" * 1000
    assert_envelope(_upsert(client, '{"id": "deep2", "input": %s, "metadata": %s}' % (GOOD[0], chain)), 422)


@pytest.mark.parametrize("metadata", ['{"csv": "%s"}' % ("a," * 70000), '{"vec": [%s]}' % ", ".join(["0.1"] * 70000),
                                      '{"ok": true, "n": [true, false]}',
                                      '{"size": 1e20, "note": "call 12345678901234567890"}'])
def test_legitimate_metadata_is_kept(client, metadata):
    r = _upsert(client, '{"id": "legit", "input": %s, "metadata": %s}' % (GOOD[0], metadata))
    assert r.status_code == 201, r.text
    assert client.get("/v1/gallery/items/legit").json()["metadata"] == json.loads(metadata)


def test_parameters_are_checked_before_the_examples_are_converted(client):
    """A bad threshold is reported even when the inputs would fail too: the cheap checks come first."""
    body = '{"inputs": [[true%s]], "threshold": "x"}' % (", 0" * 11)
    assert "threshold must be a number" in assert_envelope(_raw(client, DETECT, body), 422)["error"]["message"]


@pytest.mark.parametrize("ct", ["application/json ; charset=utf-8", "Application/JSON", "application/json;charset=UTF-8"])
def test_json_content_type_variants_are_json(client, ct):
    r = client.post(DETECT, content=json.dumps({"inputs": GOOD}).encode(), headers={"Content-Type": ct})
    assert r.status_code == 200, r.text


def test_an_overflowing_request_does_not_fail_its_batch_mates(live_server, offline):
    """Requests computed in one batch: the overflowing one gets 422, the others their answers."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    url = live_server(max_delay_ms=300, adaptive_delay=False)  # every request waits for the others
    normal = [[0.1] * 12]
    bodies = [{"inputs": HUGE if i % 2 else normal, "mode": "index", "k": 3} for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: httpx.post(url + "/v1/topk", json=b, timeout=30), bodies))
    want = np.argsort(-offline.logits(np.asarray(normal, np.float32))[0])[:3].tolist()
    for body, r in zip(bodies, answers):
        if body["inputs"] is HUGE:
            assert_envelope(r, 422, "non_finite_output")
        else:
            assert r.status_code == 200, r.text
            assert [e["class_id"] for e in r.json()["results"][0]] == want


def test_a_client_that_leaves_mid_body_is_not_a_server_error(live_server):
    import socket
    import time

    import httpx

    url = live_server()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/classes/3/detect HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"inputs\":")
    time.sleep(0.5)
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'status="500"' not in text and 'reason="internal_error"' not in text
    assert 'slc_rejections_total{reason="client_disconnected"}' in text


# ---------------------------------------------------------------------------- kinds -> each front's status
def test_every_error_kind_has_an_http_status_and_a_grpc_code():
    """The core's errors name no protocol: each front maps every kind, so a new kind without a
    status in either front fails here."""
    pytest.importorskip("grpc", reason="pip install 'slc[grpc]'")
    from serving.errors import Kind
    from serving.grpc.server import GRPC_CODES
    from serving.http.errors import HTTP_STATUS

    assert set(HTTP_STATUS) == set(Kind) and set(GRPC_CODES) == set(Kind)


@pytest.mark.parametrize("kind, status, code", [("OVERLOADED", 429, "RESOURCE_EXHAUSTED"), ("UNAVAILABLE", 503, "UNAVAILABLE"),
                                                ("DEADLINE", 504, "DEADLINE_EXCEEDED"), ("INVALID", 422, "INVALID_ARGUMENT"),
                                                ("NOT_FOUND", 404, "NOT_FOUND"), ("FORBIDDEN", 403, "PERMISSION_DENIED"),
                                                ("CONFLICT", 409, "FAILED_PRECONDITION")])
def test_a_kind_maps_to_the_status_its_protocol_documents(kind, status, code):
    pytest.importorskip("grpc", reason="pip install 'slc[grpc]'")
    from serving.errors import Kind
    from serving.grpc.server import GRPC_CODES
    from serving.http.errors import HTTP_STATUS

    assert (HTTP_STATUS[Kind[kind]], GRPC_CODES[Kind[kind]]) == (status, code)


def test_a_retriable_error_carries_retry_after_only_in_the_http_header():
    from serving.errors import Overloaded
    from serving.http.errors import error_response

    r = error_response(Overloaded("queue full", retry_after=3))
    assert (r.status_code, r.headers["retry-after"], json.loads(r.body)) == (
        429, "3", {"error": {"code": "overloaded", "message": "queue full"}})
