"""Enrolled classes (issue 38) through the HTTP API, checked against float64 numpy over the extended
head [W; E], [b; b_e], E computed offline by the documented rule (docs/api.md "Enroll a class") from
the examples' embeddings under an independent onnxruntime session (tests/serving/helpers.py Offline)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.serving.helpers import D, INPUT_DIM, assert_envelope

KEY = "s3cret-key"


def examples(seed: int, n: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, INPUT_DIM)).astype(np.float32)


def imprint(offline, x: np.ndarray) -> tuple[np.ndarray, float]:
    """The rule, written out here: normalise each embedding, average, renormalise, scale to the
    median norm of the trained rows; bias = the median trained bias."""
    h = offline.embed(x).astype(np.float64)
    e = h / np.linalg.norm(h, axis=1, keepdims=True)
    m = e.mean(axis=0)
    row = np.median(np.linalg.norm(offline.W, axis=1)) * m / np.linalg.norm(m)
    return row, float(np.median(offline.b))


def lookalikes_truth(logits: np.ndarray, thr: np.ndarray) -> set[int]:
    """The look-alikes an enrollment stores (docs/api.md "Look-alikes"), from the examples' logits over
    the trained classes [n, D] and their thresholds [D]: every class at or above its threshold on some
    example, and each example's best-scoring class."""
    return {int(c) for c in np.flatnonzero((logits >= thr).any(axis=0))} | {int(c) for c in logits.argmax(axis=1)}


def enrolled_lookalikes_truth(z: np.ndarray, thr: np.ndarray, ids: np.ndarray, own: int | None = None) -> set[int]:
    """The look-alikes an enrollment stores (docs/api.md "Look-alikes"), from the examples' float64 logits
    z [n, C] over the served classes `ids` [C] (trained first) and their thresholds [C]: among each
    example's 16 best classes (the enrollment's top-k), every one at or above its threshold, the best
    trained one and the best other enrolled one."""
    out: set[int] = set()
    for zi in z:
        best = np.argsort(-zi, kind="stable")[:16]
        row = ids[best]
        out |= {int(c) for c in row[(zi[best] >= thr[best]) & (row != own)]}
        out |= {int(c) for c in row[row < D][:1]} | {int(c) for c in row[(row >= D) & (row != own)][:1]}
    return out


class Extended:
    """[W; E], [b; b_e] with the enrolled rows in id order, and their ids; `lookalikes`: {enrolled id:
    trained ids} for detect's rule between look-alikes."""

    def __init__(self, offline, rows: list[tuple[int, np.ndarray, float]], lookalikes: dict | None = None):
        self.offline = offline
        self.ids = np.concatenate([np.arange(D), [i for i, _, _ in rows]]).astype(np.int64)
        self.W = np.vstack([offline.W] + [r[None] for _, r, _ in rows])
        self.b = np.concatenate([offline.b, [b for _, _, b in rows]])
        self.lookalikes = lookalikes or {}

    def matches(self, z: np.ndarray, thr: np.ndarray) -> np.ndarray:
        """[N, C] detect's answers, the rule written out: z >= t, and of a look-alike pair, an input
        matches only the one whose margin z - t is larger (a tie: both)."""
        m = z - thr
        out = m >= 0
        for e, trained in self.lookalikes.items():
            for t in trained:
                a, b = self.column(e), self.column(t)
                for i in range(len(z)):
                    if m[i, b] > m[i, a]:
                        out[i, a] = False
                    if m[i, a] > m[i, b]:
                        out[i, b] = False
        return out

    def logits(self, x) -> np.ndarray:  # [N, D + n_e] float64, columns in id order
        return self.offline.embed(x).astype(np.float64) @ self.W.T + self.b

    def column(self, class_id: int) -> int:
        return int(np.flatnonzero(self.ids == class_id)[0])


def enroll(client, name: str, x: np.ndarray, **headers):
    return client.put(f"/v1/classes/{name}", json={"inputs": x.tolist()}, headers=headers)


def test_enrolled_row_is_the_documented_rule(client, offline, bundle, inputs):
    x = examples(10)
    r = enroll(client, "newt", x)
    assert r.status_code == 201, r.text
    got = r.json()
    row, b = imprint(offline, x)
    assert got["class_id"] == D and got["class_name"] == "newt" and got["examples"] == 3
    assert got["rule"] == "imprint+global"
    np.testing.assert_allclose(got["norm"], np.linalg.norm(row), rtol=1e-5)
    np.testing.assert_allclose(got["bias"], b, rtol=1e-6, atol=1e-7)
    assert got["threshold"] == pytest.approx(bundle.global_threshold)
    assert got["platt"]["a"] == pytest.approx(float(np.median(bundle.platt_a)), rel=1e-6)
    assert got["platt"]["b"] == pytest.approx(float(np.median(bundle.platt_b)), rel=1e-6)
    # the row itself, seen through detect on fresh inputs
    det = client.post("/v1/classes/newt/detect", json={"inputs": inputs.tolist()}).json()
    want = offline.embed(inputs).astype(np.float64) @ row + b
    np.testing.assert_allclose([res["logit"] for res in det["results"]], want, rtol=1e-5, atol=1e-5)
    assert [res["match"] for res in det["results"]] == list(want >= got["threshold"])


@pytest.mark.parametrize("impl", ["numpy", "ort", "onnx", "device"])  # ort: the enrolled rows by onnxruntime too
def test_enrolled_classes_answer_like_rows_of_the_head(client_factory, offline, bundle, inputs, impl):
    """detect, softmax, exact top-k, both top-k modes and v2 `<name>` / `<name>-full` over [W; E]."""
    client = client_factory(softmax_impl=impl)
    made = []
    for seed, name in ((1, "alpha"), (2, "beta")):
        x = examples(seed, n=seed + 1)
        got = enroll(client, name, x).json()
        made.append((got["class_id"], *imprint(offline, x)))
    ext = Extended(offline, made)
    z = ext.logits(inputs)  # [5, D + 2]
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    for name, (cid, _, _) in zip(("alpha", "beta"), made):
        col = ext.column(cid)
        det = client.post(f"/v1/classes/{name}/detect", json={"inputs": inputs.tolist()}).json()
        assert det["class_id"] == cid
        np.testing.assert_allclose([r["logit"] for r in det["results"]], z[:, col], rtol=1e-5, atol=1e-5)
        for ref in (name, str(cid)):
            sm = client.post(f"/v1/classes/{ref}/softmax", json={"inputs": inputs.tolist()}).json()
            np.testing.assert_allclose([r["probability"] for r in sm["results"]], p[:, col], rtol=1e-4, atol=1e-7)
            np.testing.assert_allclose([r["logit"] for r in sm["results"]], z[:, col], rtol=1e-5, atol=1e-5)
            assert [r["is_top1"] for r in sm["results"]] == list(z.argmax(axis=1) == col)
    trained = client.post("/v1/classes/7/softmax", json={"inputs": inputs.tolist()}).json()  # normaliser over D + 2
    np.testing.assert_allclose([r["probability"] for r in trained["results"]], p[:, 7], rtol=1e-4, atol=1e-7)
    for mode in ("exact", "index"):
        top = client.post("/v1/topk", json={"inputs": inputs.tolist(), "k": 5, "mode": mode}).json()
        _check_topk(top, z, ext, {cid: n for (cid, _, _), n in zip(made, ("alpha", "beta"))}, 5)
    _check_v2(client, bundle, ext, inputs, [c for c, _, _ in made])


def _check_topk(top: dict, z: np.ndarray, ext: Extended, names: dict, k: int) -> None:
    for row, zi in zip(top["results"], z):
        want = ext.ids[np.argsort(-zi, kind="stable")[:k]]
        assert [e["class_id"] for e in row] == want.tolist()
        np.testing.assert_allclose([e["logit"] for e in row], zi[[ext.column(c) for c in want]], rtol=1e-5, atol=1e-5)
        assert all(e["class_name"] == names.get(e["class_id"], str(e["class_id"])) for e in row)


def _check_v2(client, bundle, ext: Extended, inputs: np.ndarray, enrolled_ids: list[int]) -> None:
    ids = np.array([0, enrolled_ids[0], 7, enrolled_ids[1], enrolled_ids[0]], dtype=np.int64)
    body = {"inputs": [{"name": "input", "shape": list(inputs.shape), "datatype": "FP32", "data": inputs.ravel().tolist()},
                       {"name": "class_id", "shape": [5], "datatype": "INT64", "data": ids.tolist()}]}
    out = {o["name"]: o for o in client.post(f"/v2/models/{bundle.name}/infer", json=body).json()["outputs"]}
    z = ext.logits(inputs)
    want = z[np.arange(5), [ext.column(c) for c in ids]]
    np.testing.assert_allclose(out["logit"]["data"], want, rtol=1e-5, atol=1e-5)
    full = client.post(f"/v2/models/{bundle.name}-full/infer", json={"inputs": body["inputs"][:1]}).json()["outputs"][0]
    assert full["shape"] == [5, D + len(enrolled_ids)]
    np.testing.assert_allclose(np.reshape(full["data"], full["shape"]), z, rtol=1e-5, atol=1e-5)
    meta = client.get(f"/v2/models/{bundle.name}-full").json()
    assert meta["outputs"][0]["shape"] == [-1, D + len(enrolled_ids)]
    bad = dict(body, inputs=[body["inputs"][0], dict(body["inputs"][1], data=[0, 1, 2, 3, D + 40])])
    assert_envelope(client.post(f"/v2/models/{bundle.name}/infer", json=bad), 404, "unknown_class")


def test_index_top_k_merges_an_exact_scan_of_the_enrolled_rows(client, offline, inputs, monkeypatch):
    """mode=index through the class index (not the pass), merged with the enrolled rows."""
    from serving.core.class_index import ClassIndex

    monkeypatch.setattr(ClassIndex, "reads_every_row", property(lambda self: False))
    made = []
    for seed, name in ((3, "gamma"), (4, "delta")):
        x = examples(seed)
        made.append((enroll(client, name, x).json()["class_id"], *imprint(offline, x)))
    ext = Extended(offline, made)
    top = client.post("/v1/topk", json={"inputs": inputs.tolist(), "k": 4, "mode": "index"}).json()
    _check_topk(top, ext.logits(inputs), ext, {made[0][0]: "gamma", made[1][0]: "delta"}, 4)
    # a query made of an example: its own class first
    top = client.post("/v1/topk", json={"inputs": examples(3)[:1].tolist(), "k": D + 2, "mode": "index"}).json()
    assert len(top["results"][0]) == D + 2


def test_class_search_uses_the_enrolled_row(client, offline, bundle):
    """Every item at or above the threshold, by the enrolled row, best first, less the items one of the
    class's look-alikes passes by more (at the request's threshold, every class's)."""
    from tests.serving.test_open_set import calibrated

    x = examples(5)
    row, b = imprint(offline, x)
    got = enroll(client, "eps", x).json()
    want_alikes = lookalikes_truth(offline.embed(x).astype(np.float64) @ offline.W.T + offline.b, calibrated(bundle))
    assert got["lookalikes"] == sorted(want_alikes)
    ext = Extended(offline, [(got["class_id"], row, b)], {got["class_id"]: want_alikes})
    items = [{"id": f"i{i}", "input": v.tolist()} for i, v in enumerate(examples(6, n=6))]
    assert client.post("/v1/gallery/items", json={"items": items}).status_code == 201
    for threshold in (-100.0, 0.0):
        found = client.post("/v1/classes/eps/search", json={"threshold": threshold}).json()
        z = ext.logits(examples(6, n=6))
        want = z[:, -1]
        kept = ext.matches(z, np.full(z.shape[1], threshold))[:, -1]
        order = [i for i in np.argsort(-want, kind="stable") if kept[i]]
        assert [h["id"] for h in found["results"]] == [f"i{i}" for i in order]
        np.testing.assert_allclose([h["logit"] for h in found["results"]], want[order], rtol=1e-5, atol=1e-5)
        if threshold == -100.0:
            assert 0 < len(order) < 6  # the look-alikes took some items (so the rule is what is checked)


def test_replace_delete_and_stable_ids(client, offline, bundle, inputs):
    ids = {n: enroll(client, n, examples(s)).json()["class_id"] for s, n in ((1, "a"), (2, "b"), (3, "c"))}
    assert ids == {"a": D, "b": D + 1, "c": D + 2}
    again = enroll(client, "b", examples(9))
    assert again.status_code == 200 and again.json()["class_id"] == D + 1  # replaced in place
    assert client.delete("/v1/classes/b").status_code == 204
    assert_envelope(client.post("/v1/classes/b/detect", json={"inputs": inputs.tolist()}), 404, "unknown_class")
    assert_envelope(client.post(f"/v1/classes/{D + 1}/detect", json={"inputs": inputs.tolist()}), 404, "unknown_class")
    assert_envelope(client.delete("/v1/classes/b"), 404, "unknown_class")
    assert client.post("/v1/classes/c/detect", json={"inputs": inputs.tolist()}).json()["class_id"] == D + 2
    assert enroll(client, "b", examples(2)).json()["class_id"] == D + 3  # slots are never reused
    listing = client.get("/v1/classes").json()
    assert [(c["class_id"], c["class_name"]) for c in listing["classes"]] == [(D, "a"), (D + 2, "c"), (D + 3, "b")]
    assert client.delete(f"/v1/classes/{D}").status_code == 204  # by id too
    model = client.get("/v1/model").json()["classes"]
    assert (model["trained"], model["enrolled"], model["total"]) == (D, 2, D + 2)
    # v2 -full: D trained columns, then the enrolled ones in id order (c, b)
    made = [(D + 2, *imprint(offline, examples(3))), (D + 3, *imprint(offline, examples(2)))]
    body = {"inputs": [{"name": "input", "shape": list(inputs.shape), "datatype": "FP32", "data": inputs.ravel().tolist()}]}
    full = client.post(f"/v2/models/{bundle.name}-full/infer", json=body).json()["outputs"][0]
    np.testing.assert_allclose(np.reshape(full["data"], full["shape"]), Extended(offline, made).logits(inputs),
                               rtol=1e-5, atol=1e-5)


def test_refusals(client_factory, inputs):
    client = client_factory(max_enrolled_classes=2)
    assert_envelope(enroll(client, "7", examples(1)), 409, "class_exists")  # a class of the bundle
    assert_envelope(client.delete("/v1/classes/7"), 409, "trained_class")
    assert_envelope(client.delete("/v1/classes/nobody"), 404, "unknown_class")
    assert_envelope(client.put("/v1/classes/zero", json={"inputs": []}), 422)
    assert_envelope(enroll(client, "big", np.full((2, INPUT_DIM), 3e38, np.float32)), 422, "non_finite_output")
    assert_envelope(enroll(client, "123", examples(1)), 422, "invalid_class_name")
    assert_envelope(enroll(client, "x" * 257, examples(1)), 422, "invalid_class_name")
    assert_envelope(enroll(client, "tab%09name", examples(1)), 422, "invalid_class_name")
    assert_envelope(client.put("/v1/classes/bad", json={"inputs": [[1.0] * (INPUT_DIM + 1)]}), 422, "shape_mismatch")
    assert_envelope(client.put("/v1/classes/bad", json={"inputs": examples(1).tolist(), "k": 1}), 422)
    assert enroll(client, "one", examples(1)).status_code == 201
    assert enroll(client, "two", examples(2)).status_code == 201
    assert_envelope(enroll(client, "three", examples(3)), 507, "enrolled_limit")
    assert enroll(client, "two", examples(4)).status_code == 200  # replacing is not creating
    assert client.delete("/v1/classes/one").status_code == 204
    assert enroll(client, "three", examples(3)).status_code == 201
    assert client.get("/v1/classes").json()["count"] == 2


def test_the_rule_refuses_examples_without_a_direction():
    from serving.core.enrollment import HeadStats, imprint as rule
    from serving.errors import InvalidInput

    stats = HeadStats(row_norm=2.0, bias=0.1, platt_a=1.0, platt_b=0.0, threshold=0.5, target_precision=0.99)
    v = np.array([1.0, 2.0, -0.5])
    for h, code in ((np.stack([v, -v]), "degenerate_examples"), (np.stack([v, 0 * v]), "degenerate_examples"),
                    (np.zeros((0, 3)), "no_examples"), (np.stack([v, v * np.inf]), "non_finite_output")):
        with pytest.raises(InvalidInput) as err:
            rule(h, stats)
        assert err.value.code == code
    row = rule(np.stack([v, 3 * v]), stats)
    np.testing.assert_allclose(row.row, 2.0 * v / np.linalg.norm(v), rtol=1e-6)


@pytest.mark.parametrize("method", ["put", "delete"])
def test_writes_need_the_api_key(client_factory, method):
    client = client_factory(api_key=KEY)
    call = (lambda **h: enroll(client, "keyed", examples(1), **h)) if method == "put" else \
        (lambda **h: client.delete("/v1/classes/keyed", headers=h))
    assert_envelope(call(), 401, "unauthorized")
    assert_envelope(call(**{"X-API-Key": "wrong"}), 401, "unauthorized")
    if method == "delete":
        assert enroll(client, "keyed", examples(1), Authorization=f"Bearer {KEY}").status_code == 201
    assert call(Authorization=f"Bearer {KEY}").status_code in (201, 204)


def test_writes_refused_on_an_open_host_without_a_key(client_factory):
    client = client_factory(host="0.0.0.0")
    assert_envelope(enroll(client, "open", examples(1)), 403, "writes_need_api_key")
    assert_envelope(client.delete("/v1/classes/open"), 403, "writes_need_api_key")


def test_per_class_threshold_from_the_bundle_negatives(tmp_path, app_factory):
    """SLC_ENROLL_THRESHOLD=negatives on a bundle with calibration negatives: the lowest logit at
    which the examples (weighted as an average class's share of the sample) reach the target
    precision against the negatives, checked by brute force over every candidate."""
    from fastapi.testclient import TestClient

    from serving.bundle import load_bundle
    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.main import build
    from tests.serving.helpers import Offline, make_settings, wait_ready

    path = build_synthetic_bundle(classes=D, dim=16, input_dim=INPUT_DIM, seed=0, out=tmp_path / "neg", negatives=400)
    offline = Offline(load_bundle(path))
    near = examples(11, n=1) + 0.01 * examples(12, n=4)  # one direction: examples above every negative
    spread = examples(13, n=4)  # random directions: the negatives reach the examples, the target is missed
    with TestClient(build(make_settings(path, tmp_path, enroll_threshold="negatives", enroll_rule="imprint"))[0]) as client:
        wait_ready(client.get)
        answers = [enroll(client, name, x).json() for name, x in (("near", near), ("spread", spread))]
    rules = []
    for got, x in zip(answers, (near, spread)):
        row, b = imprint(offline, x)
        z_pos = offline.embed(x).astype(np.float64) @ row + b
        z_neg = np.load(path / "calibration_embeddings.npy").astype(np.float64) @ row + b
        _check_negatives_threshold(got, z_pos, z_neg, weight=(len(z_neg) / D) / len(z_pos))
        rules.append(got["rule"])
    assert rules == ["imprint+negatives", "imprint+global"]


def test_a_global_threshold_that_rejects_every_example_gives_way_to_the_negatives(tmp_path):
    """Under SLC_ENROLL_THRESHOLD=global (the default), a class whose global threshold says no to every
    one of its own examples (here the bundle's global raised above every logit, as a small model's can
    sit) gets the negatives rule, checked by brute force; one that reaches no target keeps the global."""
    from fastapi.testclient import TestClient

    from serving.bundle import load_bundle
    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.main import build
    from tests.serving.helpers import Offline, make_settings, wait_ready

    path = build_synthetic_bundle(classes=D, dim=16, input_dim=INPUT_DIM, seed=0, out=tmp_path / "neg", negatives=400)
    offline = Offline(load_bundle(path))
    near = examples(11, n=1) + 0.01 * examples(12, n=4)
    spread = examples(13, n=4)
    with TestClient(build(make_settings(path, tmp_path, enroll_rule="imprint"))[0]) as client:
        wait_ready(client.get)
        client.app.state.slc.bundle.global_threshold = 50.0  # read by the rule at the first enrollment
        answers = [enroll(client, name, x).json() for name, x in (("near", near), ("spread", spread))]
    for got, x in zip(answers, (near, spread)):
        row, b = imprint(offline, x)
        z_pos = offline.embed(x).astype(np.float64) @ row + b
        assert (z_pos < 50.0).all()
        z_neg = np.load(path / "calibration_embeddings.npy").astype(np.float64) @ row + b
        _check_negatives_threshold(got, z_pos, z_neg, weight=(len(z_neg) / D) / len(z_pos))
    assert [a["rule"] for a in answers] == ["imprint+negatives", "imprint+global"]
    assert answers[1]["threshold"] == 50.0


def test_rejects_all_against_each_logit():
    from serving.bundle.class_row import ClassRow
    from serving.core.enrollment import rejects_all

    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((5, 4)), rng.standard_normal(4)
    z = h @ w + 0.25
    for t in (z.min() - 1, z.min(), np.median(z), z.max(), z.max() + 1e-9):
        row = ClassRow(row=w, bias=0.25, threshold=float(t), platt_a=1.0, platt_b=0.0, examples=5, rule="x")
        assert rejects_all(row, h) == all(zi < t for zi in z.tolist())


def _check_negatives_threshold(got: dict, z_pos, z_neg, weight) -> None:
    """The answered threshold is the lowest candidate reaching the target precision (0.99: the
    synthetic calibration names a quantile, not a precision)."""
    want = None
    for t in np.unique(np.concatenate([z_pos, z_neg])):
        tp, fp = weight * (z_pos >= t).sum(), (z_neg >= t).sum()
        if tp > 0 and tp / (tp + fp) >= 0.99:
            want = float(t)
            break
    if want is None:
        assert got["rule"] == "imprint+global"
    else:
        assert got["rule"] == "imprint+negatives"
        assert got["threshold"] == pytest.approx(want, rel=1e-6, abs=1e-6)  # the server's row is float32


def test_a_quantized_pass_goes_on_over_the_enrolled_rows(tmp_path, inputs):
    """SLC_HEAD_PRECISION=int8: the trained rows' pass on the int8 head (its top-k and the asked logit
    re-scored on the float32 rows), then the enrolled rows in float32."""
    from fastapi.testclient import TestClient

    from serving.bundle import load_bundle
    from serving.bundle.heads import add_heads
    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.main import build
    from tests.serving.helpers import Offline, make_settings, wait_ready

    path = build_synthetic_bundle(classes=D, dim=16, input_dim=INPUT_DIM, seed=0, out=tmp_path / "q")
    add_heads(path, ("int8",))
    offline = Offline(load_bundle(path))
    with TestClient(build(make_settings(path, tmp_path, head_precision="int8"))[0]) as client:
        wait_ready(client.get)
        x = examples(7)
        cid = enroll(client, "quant", x).json()["class_id"]
        ext = Extended(offline, [(cid, *imprint(offline, x))])
        z = ext.logits(inputs)
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        sm = client.post("/v1/classes/quant/softmax", json={"inputs": inputs.tolist()}).json()["results"]
        np.testing.assert_allclose([r["logit"] for r in sm], z[:, -1], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose([r["probability"] for r in sm], p[:, -1], rtol=2e-2)  # int8 normaliser
        top = client.post("/v1/topk", json={"inputs": inputs.tolist(), "k": 5}).json()
        _check_topk(top, z, ext, {cid: "quant"}, 5)


def test_standardised_rule_on_a_bundle_with_negatives(tmp_path):
    """SLC_ENROLL_RULE=standardised (auto's rule for a class of one example where the bundle carries
    calibration negatives; tests/serving/test_enroll_fitted.py has auto's fitted rule): the examples' direction centred
    on the negatives' mean, and the new class's logits on the negatives spread as a typical trained
    class's do (the medians of their mean and std) and reach no further into the tail (the median of
    their 1 - 2/N quantile), all checked by brute force over the bundle."""
    from fastapi.testclient import TestClient

    from serving.bundle import load_bundle
    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.main import build
    from tests.serving.helpers import Offline, make_settings, wait_ready

    path = build_synthetic_bundle(classes=D, dim=16, input_dim=INPUT_DIM, seed=0, out=tmp_path / "neg", negatives=400)
    b = load_bundle(path)
    offline = Offline(b)
    h_neg = np.load(path / "calibration_embeddings.npy").astype(np.float64)
    y_neg = np.load(path / "calibration_labels.npy")
    x = examples(21, n=3)
    with TestClient(build(make_settings(path, tmp_path, enroll_rule="standardised"))[0]) as client:
        wait_ready(client.get)
        assert client.get("/v1/model").json()["classes"]["enroll_rule"] == "standardised"
        got = enroll(client, "centred", x).json()
        assert got["rule"] == "standardised+global"
        z = np.array([r["logit"] for r in client.post("/v1/classes/centred/detect", json={"inputs": h_inputs(b)}).json()["results"]])
    w, bias = np.asarray(b.weight, np.float64), np.asarray(b.bias, np.float64)
    z_all = h_neg @ w.T + bias  # [N, D]
    means = [z_all[y_neg != j, j].mean() for j in range(D)]
    stds = [z_all[y_neg != j, j].std() for j in range(D)]
    mu = h_neg.mean(axis=0)
    e = offline.embed(x).astype(np.float64) - mu
    u = (e / np.linalg.norm(e, axis=1, keepdims=True)).mean(axis=0)
    u /= np.linalg.norm(u)
    p = (h_neg - mu) @ u
    scale = np.median(stds) / p.std()
    q = 1 - 2 / len(h_neg)  # the far tail: the new class's logits on the negatives no higher there
    tails = [np.quantile(z_all[y_neg != j, j], q) for j in range(D)]  # than a trained class's (median)
    shift = max(0.0, np.median(means) + scale * (np.quantile(p, q) - p.mean()) - np.median(tails))
    assert shift > 0  # these examples reach further into the tail than a trained class: lowered
    want = offline.embed(np.asarray(h_inputs(b), np.float32)).astype(np.float64) @ (scale * u) \
        + np.median(means) - scale * p.mean() - scale * u @ mu - shift
    np.testing.assert_allclose(z, want, rtol=1e-4, atol=1e-4)


def h_inputs(b) -> list:
    return np.random.default_rng(5).standard_normal((4, INPUT_DIM)).astype(np.float32).tolist()
