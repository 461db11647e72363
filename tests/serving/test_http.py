"""Every /v1 route against offline math on the same bundle (DESIGN.md §7)."""
from __future__ import annotations

import numpy as np
import pytest


def _softmax64(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def test_health_and_model(client, bundle):
    assert client.get("/v1/health/live").json() == {"status": "live"}
    assert client.get("/v1/health/ready").json() == {"status": "ready"}
    info = client.get("/v1/model").json()
    assert info["name"] == bundle.name
    assert info["num_classes"] == bundle.num_classes and info["embed_dim"] == bundle.embed_dim
    assert info["input"]["shape"] == list(bundle.input_shape)
    assert info["digest"] == bundle.digest
    assert info["providers"] and all(p.endswith("ExecutionProvider") for p in info["providers"])
    assert info["calibration"]["per_class"]["count"] == bundle.num_classes
    assert info["calibration"]["global"]["threshold"] == pytest.approx(bundle.global_threshold)
    assert info["index"]["kind"] and "recall_at_k" in info["index"]
    assert info["softmax_impl"] in ("numpy", "ort", "ort_pair", "packed_pair", "onnx", "device")


@pytest.mark.parametrize("ref", ["7", "name"])
def test_detect_matches_offline(client, bundle, offline, inputs, ref):
    j = 7
    path_ref = bundle.classes[j] if ref == "name" else str(j)
    r = client.post(f"/v1/classes/{path_ref}/detect", json={"inputs": inputs.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["class_id"] == j and body["class_name"] == bundle.classes[j]
    thr = float(bundle.thresholds[j])
    assert body["threshold"] == pytest.approx(thr)
    got = np.array([res["logit"] for res in body["results"]])
    # truth 1: the backbone's embedding @ W[j] + b[j], all in float64
    want = offline.logits(inputs)[:, j]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # truth 2: the bundle's own single.onnx graph (gathers the row inside the graph)
    np.testing.assert_allclose(got, offline.single_logit(inputs, [j] * len(inputs)), rtol=1e-4, atol=1e-4)
    assert [res["match"] for res in body["results"]] == [bool(z >= thr) for z in got]
    a, b = float(bundle.platt_a[j]), float(bundle.platt_b[j])
    np.testing.assert_allclose([res["probability"] for res in body["results"]], 1 / (1 + np.exp(-(a * want + b))),
                               rtol=1e-5, atol=1e-7)


def test_detect_threshold_override_decides_match(client, offline, inputs):
    z = offline.logits(inputs)[:, 3]
    zs = np.sort(z)
    cut = float((zs[1] + zs[2]) / 2)  # between two logits: no rounding decides the test
    body = client.post("/v1/classes/3/detect", json={"inputs": inputs.tolist(), "threshold": cut}).json()
    assert body["threshold"] == cut
    assert [r["match"] for r in body["results"]] == [bool(v >= cut) for v in z]
    assert any(r["match"] for r in body["results"]) and not all(r["match"] for r in body["results"])


def test_single_input_and_integer_values(client, offline):
    x = [list(range(12))]  # ints are numbers too
    body = client.post("/v1/classes/0/detect", json={"inputs": x}).json()
    assert body["results"][0]["logit"] == pytest.approx(offline.logits(np.array(x, np.float32))[0, 0], abs=1e-4)


def test_softmax_matches_numpy(client, bundle, offline, inputs):
    j = 11
    body = client.post(f"/v1/classes/{j}/softmax", json={"inputs": inputs.tolist()}).json()
    z = offline.logits(inputs)
    p = _softmax64(z)
    assert body["class_id"] == j
    np.testing.assert_allclose([r["probability"] for r in body["results"]], p[:, j], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose([r["logit"] for r in body["results"]], z[:, j], rtol=1e-5, atol=1e-4)
    assert [r["is_top1"] for r in body["results"]] == list(z.argmax(axis=1) == j)


@pytest.mark.parametrize("impl", ["numpy", "ort", "ort_pair", "packed_pair", "onnx", "device"])
def test_every_softmax_impl_answers_softmax_and_exact_topk_as_offline_math(client_factory, offline, inputs, impl):
    client = client_factory(softmax_impl=impl, intra_op_threads=2)  # (the pairs take two threads)
    assert client.get("/v1/model").json()["softmax_impl"] == impl
    z = offline.logits(inputs)
    body = client.post("/v1/classes/3/softmax", json={"inputs": inputs.tolist()}).json()
    np.testing.assert_allclose([r["probability"] for r in body["results"]], _softmax64(z)[:, 3], rtol=1e-4, atol=1e-7)
    top = client.post("/v1/topk", json={"inputs": inputs.tolist(), "k": 4, "mode": "exact"}).json()
    assert [[e["class_id"] for e in row] for row in top["results"]] == np.argsort(-z, axis=1)[:, :4].tolist()


def test_packed_pair_answers_a_job_larger_than_a_batch_as_offline_math(client_factory, offline, inputs):
    """A lone job above max_batch goes through the pass sized for it (ort_pair's chunks, not the
    packed head's fixed ones) and gets the float64 answer."""
    client = client_factory(softmax_impl="packed_pair", intra_op_threads=2, max_batch=2)
    assert client.get("/v1/model").json()["softmax_impl"] == "packed_pair"
    body = client.post("/v1/classes/3/softmax", json={"inputs": inputs.tolist()}).json()  # 5 inputs, batches of 2
    np.testing.assert_allclose([r["probability"] for r in body["results"]], _softmax64(offline.logits(inputs))[:, 3],
                               rtol=1e-4, atol=1e-7)


def test_softmax_is_top1_true_for_the_argmax_class(client, offline, inputs):
    top = int(offline.logits(inputs[:1]).argmax())
    body = client.post(f"/v1/classes/{top}/softmax", json={"inputs": inputs[:1].tolist()}).json()
    assert body["results"][0]["is_top1"] is True


@pytest.mark.parametrize("mode", ["exact", "index"])
def test_topk_matches_argsort(client, bundle, offline, inputs, mode):
    k = 5
    body = client.post("/v1/topk", json={"inputs": inputs.tolist(), "k": k, "mode": mode}).json()
    z = offline.logits(inputs)
    order = np.argsort(-z, axis=1)[:, :k]
    assert body["k"] == k and body["mode"] == mode and len(body["results"]) == len(inputs)
    for row, want_ids, zrow in zip(body["results"], order, z):
        assert [e["class_id"] for e in row] == list(want_ids)
        assert [e["class_name"] for e in row] == [bundle.classes[c] for c in want_ids]
        np.testing.assert_allclose([e["logit"] for e in row], zrow[want_ids], rtol=1e-5, atol=1e-4)


def test_topk_k_larger_than_d_returns_all_classes(client, bundle, inputs):
    body = client.post("/v1/topk", json={"inputs": inputs[:1].tolist(), "k": 999}).json()
    assert body["k"] == bundle.num_classes
    assert sorted(e["class_id"] for e in body["results"][0]) == list(range(bundle.num_classes))


def test_batching_does_not_mix_requests(client, offline):
    """Concurrent requests of different sizes and classes each get their own rows back."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    jobs = [(int(rng.integers(50)), rng.standard_normal((int(rng.integers(1, 6)), 12)).astype(np.float32))
            for _ in range(24)]

    def call(job):
        j, x = job
        return client.post(f"/v1/classes/{j}/detect", json={"inputs": x.tolist()}).json()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, jobs))
    for (j, x), body in zip(jobs, answers):
        assert body["class_id"] == j
        np.testing.assert_allclose([r["logit"] for r in body["results"]], offline.logits(x)[:, j], rtol=1e-5, atol=1e-4)


def test_gallery_round_trip(client, bundle, offline):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((6, 12)).astype(np.float32)
    items = [{"id": f"item-{i}", "input": x[i].tolist(), "metadata": {"i": i}} for i in range(6)]
    r = client.post("/v1/gallery/items", json={"items": items})
    assert r.status_code == 201, r.text
    assert r.json() == {"upserted": 6, "ids": [it["id"] for it in items]}
    assert client.get("/v1/gallery").json()["count"] == 6

    got = client.get("/v1/gallery/items/item-2").json()
    assert got["id"] == "item-2" and got["metadata"] == {"i": 2}
    np.testing.assert_allclose(got["input"], x[2], rtol=1e-6)

    j = 4
    z = offline.logits(x)[:, j]
    cut = float((np.sort(z)[1] + np.sort(z)[2]) / 2)  # the 4 best of 6 pass
    body = client.post(f"/v1/classes/{j}/search", json={"threshold": cut}).json()
    want = [f"item-{i}" for i in np.argsort(-z) if z[i] >= cut]
    assert [h["id"] for h in body["results"]] == want
    np.testing.assert_allclose([h["logit"] for h in body["results"]], np.sort(z)[::-1][:len(want)], rtol=1e-4, atol=1e-4)
    assert body["results"][0]["metadata"] == {"i": int(np.argmax(z))}
    limited = client.post(f"/v1/classes/{j}/search", json={"threshold": cut, "limit": 2}).json()
    assert [h["id"] for h in limited["results"]] == want[:2]

    # upsert replaces by id
    client.post("/v1/gallery/items", json={"items": [{"id": "item-2", "input": x[0].tolist(), "metadata": None}]})
    assert client.get("/v1/gallery/items/item-2").json()["metadata"] is None
    assert client.get("/v1/gallery").json()["count"] == 6

    assert client.delete("/v1/gallery/items/item-2").status_code == 204
    assert client.get("/v1/gallery/items/item-2").status_code == 404
    assert client.delete("/v1/gallery/items/item-2").status_code == 404
    assert client.get("/v1/gallery").json()["count"] == 5


def test_search_with_calibrated_threshold_and_no_body(client, bundle):
    r = client.post("/v1/classes/1/search")
    assert r.status_code == 200, r.text
    assert r.json()["threshold"] == pytest.approx(float(bundle.thresholds[1]))


def test_metrics_count_requests_by_route_template(client, inputs):
    for j in (1, 2, 3):
        client.post(f"/v1/classes/{j}/detect", json={"inputs": inputs[:2].tolist()})
    client.post("/v1/classes/nope/detect", json={"inputs": inputs[:1].tolist()})
    text = client.get("/metrics").text
    assert 'slc_http_requests_total{endpoint="/v1/classes/{class}/detect",method="POST",status="200"} 3.0' in text
    assert 'status="404"' in text and 'slc_rejections_total{reason="unknown_class"} 1.0' in text
    assert "slc_batch_size_inputs_count" in text and "slc_queue_depth_inputs" in text
    assert "slc_http_request_duration_seconds_bucket" in text


def test_examples_accepts_nested_and_flat_examples():
    """A [3, 4] input shape: nested [3][4] and flat 12-value examples give the same array."""
    from serving.codecs.strict_json import examples
    from serving.errors import InvalidInput

    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(examples(x.tolist(), (3, 4), 4), x)
    np.testing.assert_array_equal(examples(x.reshape(2, 12).tolist(), (3, 4), 4), x)
    for bad in (x.reshape(2, 4, 3).tolist(), [[1.0] * 11], [[[1.0] * 4] * 3, [1.0] * 12], [[1.0] * 12] * 5):
        with pytest.raises(InvalidInput):
            examples(bad, (3, 4), 4)


def test_gallery_persists_across_restarts_and_is_reembedded_for_a_new_bundle(client_factory, bundle_path, tmp_path):
    from serving.bundle import load_bundle
    from tests.serving.helpers import INPUT_DIM, Offline
    from serving.bundle.synthetic import build_synthetic_bundle

    x = np.random.default_rng(4).standard_normal((3, INPUT_DIM)).astype(np.float32)
    first = client_factory()
    items = [{"id": f"k{i}", "input": x[i].tolist()} for i in range(3)]
    assert first.post("/v1/gallery/items", json={"items": items}).status_code == 201
    first.__exit__(None, None, None)

    again = client_factory()  # same data dir, same bundle
    assert again.get("/v1/gallery").json()["count"] == 3
    again.__exit__(None, None, None)

    other_path = build_synthetic_bundle(classes=50, dim=16, input_dim=INPUT_DIM, seed=1, out=tmp_path / "other")
    other = Offline(load_bundle(other_path))
    c = client_factory(bundle=other_path)
    assert c.get("/v1/gallery").json()["count"] == 3
    body = c.post("/v1/classes/5/search", json={"threshold": -1e9}).json()
    z = other.logits(x)[:, 5]
    assert [h["id"] for h in body["results"]] == [f"k{i}" for i in np.argsort(-z)]
    np.testing.assert_allclose([h["logit"] for h in body["results"]], np.sort(z)[::-1], rtol=1e-4, atol=1e-4)


def test_class_index_exact_answers_topk_index_from_the_pass_without_building(client_factory, offline, inputs):
    """SLC_CLASS_INDEX=exact: no index built (kind exact in /v1/model), topk mode=index answers the
    exact top-k of the float64 logits."""
    client = client_factory(class_index="exact")
    assert client.get("/v1/model").json()["index"]["kind"] == "exact"
    top = client.post("/v1/topk", json={"inputs": inputs.tolist(), "k": 4, "mode": "index"}).json()
    assert [[e["class_id"] for e in row] for row in top["results"]] == np.argsort(-offline.logits(inputs), axis=1)[:, :4].tolist()
