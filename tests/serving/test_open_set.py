"""Open-set answers (issue 51, parts 1 and 2) checked against independent truth: the offline logits of
the synthetic bundle (tests/serving/helpers.py Offline: its own onnxruntime session, the head in
float64), extended with enrolled rows computed by the documented imprinting rule (test_enroll.py),
against thresholds read from the bundle (calibration.json) or the rule (the global threshold).

- /v1/topk: every entry carries `match` and `threshold` as detect decides them, exact and index
  mode, trained and enrolled classes, the request's threshold; `matches_only`; `complete`.
- POST /v1/detect over a set of classes: each entry equals the single detect of its class and the
  offline math; only the set's rows are read and the pass over the head never runs; refusals.
- a calibration reload moves top-k, set detect and detect together."""
from __future__ import annotations

import numpy as np
import pytest

from tests.serving.helpers import D, INPUT_DIM, assert_envelope
from tests.serving.test_enroll import Extended, enroll, enrolled_lookalikes_truth, examples, imprint


def calibrated(bundle) -> np.ndarray:
    """[D] float64 of the thresholds detect uses: calibration.json's per-class ones (float32), the
    global one where a class has none."""
    thr = np.asarray(bundle.thresholds, dtype=np.float32).astype(np.float64)
    return np.where(np.isfinite(thr), thr, bundle.global_threshold)


@pytest.fixture
def served(client, offline, bundle):
    """A server with two enrolled classes; (client, Extended truth, thresholds [D + 2] in id order, names).
    Each class's look-alikes are checked against the offline rule as it is enrolled."""
    made, alikes = [], {}
    for seed, name in ((1, "alpha"), (2, "beta")):
        x = examples(seed, n=seed + 1)
        got = enroll(client, name, x).json()
        so_far = Extended(offline, made)  # the classes served when it is enrolled
        thr = np.concatenate([calibrated(bundle), [bundle.global_threshold] * len(made)])
        want = enrolled_lookalikes_truth(so_far.logits(x), thr, so_far.ids)
        assert got["lookalikes"] == sorted(want)
        made.append((got["class_id"], *imprint(offline, x)))
        alikes[got["class_id"]] = want
    ext = Extended(offline, made, alikes)
    thr = np.concatenate([calibrated(bundle), [bundle.global_threshold] * 2])  # enrolled: the global threshold
    names = {**{j: str(bundle.classes[j]) for j in range(D)}, made[0][0]: "alpha", made[1][0]: "beta"}
    return client, ext, thr, names


def probes(ext: Extended, thr: np.ndarray, n: int = 6) -> np.ndarray:
    """Inputs that some class claims (margin z - threshold > 0 somewhere) and some none claims, from
    a pool judged offline, so both outcomes are checked; one of them an enrolled class's own example."""
    pool = np.random.default_rng(7).standard_normal((4000, INPUT_DIM)).astype(np.float32)
    margin = (ext.logits(pool) - thr).max(axis=1)
    order = np.argsort(margin)
    picked = np.concatenate([pool[order[-(n // 2):]], pool[order[:n // 2 - 1]], examples(1, n=1)])
    assert (margin[order[-1]] > 0) and (margin[order[0]] < 0)
    return picked


def check_entries(top: dict, z: np.ndarray, ext: Extended, thr: np.ndarray, names: dict, k: int,
                  threshold=None, matches_only=False) -> None:
    for row, zi in zip(top["results"], z):
        want = ext.ids[np.argsort(-zi, kind="stable")[:k]]
        cols = [ext.column(c) for c in want]
        t = thr[cols] if threshold is None else np.full(k, threshold)
        m = ext.matches(zi[None], thr if threshold is None else np.full(len(thr), threshold))[0, cols]
        keep = m if matches_only else np.ones(k, bool)
        assert [e["class_id"] for e in row] == want[keep].tolist()
        assert [e["class_name"] for e in row] == [names[c] for c in want[keep]]
        np.testing.assert_allclose([e["logit"] for e in row], zi[cols][keep], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose([e["threshold"] for e in row], t[keep], rtol=1e-7)
        assert [e["match"] for e in row] == m[keep].tolist()


@pytest.mark.parametrize("mode", ["exact", "index"])
def test_topk_entries_are_judged_at_each_class_threshold(served, mode, monkeypatch):
    """Trained and enrolled classes, the calibrated thresholds and the request's, all entries and only
    the matching ones; mode=index through the class index itself (not the pass)."""
    from serving.core.class_index import ClassIndex

    client, ext, thr, names = served
    if mode == "index":
        monkeypatch.setattr(ClassIndex, "reads_every_row", property(lambda self: False))
    x = probes(ext, thr)
    z = ext.logits(x)
    assert any(ext.ids[np.argmax(zi)] >= D for zi in z)  # an enrolled class leads somewhere
    for k in (1, 5, D + 2):
        body = {"inputs": x.tolist(), "k": k, "mode": mode}
        check_entries(client.post("/v1/topk", json=body).json(), z, ext, thr, names, k)
        only = client.post("/v1/topk", json={**body, "matches_only": True}).json()
        check_entries(only, z, ext, thr, names, k, matches_only=True)
        if k == D + 2:  # the probes hold both outcomes
            assert any(only["results"]) and not all(only["results"])
        t = float(np.median(z))
        check_entries(client.post("/v1/topk", json={**body, "threshold": t, "matches_only": True}).json(),
                      z, ext, thr, names, k, threshold=t, matches_only=True)


def test_matches_only_is_empty_for_an_input_no_class_claims(served):
    """The input furthest below every class's threshold: [] for any k, `complete` as the truth says
    (the k-th logit below the lowest threshold, or k = every class); with a request threshold above
    its best logit, complete from k = 1."""
    client, ext, thr, _ = served
    pool = np.random.default_rng(11).standard_normal((4000, INPUT_DIM)).astype(np.float32)
    far = pool[np.argmin((ext.logits(pool) - thr).max(axis=1))][None]
    z = ext.logits(far)[0]
    assert (z < thr).all()  # the truth: no class at all matches it
    for mode in ("exact", "index"):
        for k in (1, 3, D + 2):
            got = client.post("/v1/topk", json={"inputs": far.tolist(), "k": k, "mode": mode, "matches_only": True})
            assert got.json()["results"] == [[]]
            assert got.json()["complete"] == [bool(np.sort(z)[::-1][k - 1] < thr.min() or k == D + 2)]
        t = float(z.max()) + 0.01
        got = client.post("/v1/topk", json={"inputs": far.tolist(), "k": 1, "mode": mode, "matches_only": True,
                                            "threshold": t}).json()
        assert got["results"] == [[]] and got["complete"] == [True]


def test_complete_says_whether_every_match_is_listed(served):
    """complete: the k entries are every class, or the last one's logit is below every threshold."""
    client, ext, thr, _ = served
    x = probes(ext, thr)
    z = ext.logits(x)
    for k in (1, 4, D + 2):
        got = client.post("/v1/topk", json={"inputs": x.tolist(), "k": k}).json()["complete"]
        kth = np.sort(z, axis=1)[:, ::-1][:, k - 1]
        assert got == ((kth < thr.min()) | (k == D + 2)).tolist()
        got = client.post("/v1/topk", json={"inputs": x.tolist(), "k": k, "threshold": 0.3}).json()["complete"]
        assert got == ((kth < 0.3) | (k == D + 2)).tolist()


def test_set_detect_equals_single_detects(served, bundle, inputs):
    """Names, ids (integers and decimal strings), an enrolled class by name and id, a class twice: each
    entry is the single detect of its class (same logit, match, probability), and the offline math."""
    client, ext, thr, names = served
    alpha = ext.ids[D]
    classes = [7, "3", str(bundle.classes[12]), "alpha", int(alpha), "beta", 7]
    for threshold in (None, 0.2):
        body = {"inputs": inputs.tolist(), "classes": classes, **({} if threshold is None else {"threshold": threshold})}
        got = client.post("/v1/detect", json=body)
        assert got.status_code == 200, got.text
        got = got.json()
        assert len(got["classes"]) == len(classes) and all(len(row) == len(classes) for row in got["results"])
        z = ext.logits(inputs)
        for c, ref in enumerate(classes):
            single = client.post(f"/v1/classes/{ref}/detect", json={k: v for k, v in body.items() if k != "classes"}).json()
            assert got["classes"][c] == {"class_id": single["class_id"], "class_name": single["class_name"],
                                         "threshold": single["threshold"]}
            col = ext.column(single["class_id"])
            want_thr = thr[col] if threshold is None else threshold
            assert single["threshold"] == pytest.approx(want_thr, rel=1e-7)
            for i, (entry, one) in enumerate(zip((row[c] for row in got["results"]), single["results"])):
                assert entry["match"] == one["match"] == bool(ext.matches(z, np.where(threshold is None, thr, want_thr))[i, col])
                assert entry["logit"] == pytest.approx(one["logit"], rel=1e-12, abs=1e-12)
                assert entry["probability"] == pytest.approx(one["probability"], rel=1e-12, abs=1e-15)
                assert entry["logit"] == pytest.approx(z[i, col], rel=1e-5, abs=1e-5)


def test_set_detect_reads_the_set_rows_and_never_the_head(client, inputs, monkeypatch):
    """The cost is the set's rows: the head is indexed only at the named ids, the pass never runs."""
    engine = client.app.state.slc.engine
    seen = []

    class Rows:
        def __init__(self, a):
            self.a = a

        def __getitem__(self, key):
            seen.append(np.asarray(key).copy())
            return self.a[key]

    monkeypatch.setattr(engine.classes, "weight", Rows(engine.classes.weight))
    monkeypatch.setattr(engine.head_pass, "run", lambda *a, **k: pytest.fail("the pass over the head ran"))
    got = client.post("/v1/detect", json={"inputs": inputs.tolist(), "classes": [40, 2, 40, 9]})
    assert got.status_code == 200, got.text
    assert len(seen) == 1 and sorted(seen[0].tolist()) == [2, 9, 40]


def test_set_detect_refusals(client_factory, inputs):
    client = client_factory(max_detect_classes=3)
    x = inputs.tolist()
    got = assert_envelope(client.post("/v1/detect", json={"inputs": x, "classes": [1, "nobody", 2]}), 404, "unknown_class")
    assert "nobody" in got["error"]["message"]
    got = assert_envelope(client.post("/v1/detect", json={"inputs": x, "classes": [1, D + 5]}), 404, "unknown_class")
    assert str(D + 5) in got["error"]["message"]
    assert_envelope(client.post("/v1/detect", json={"inputs": x, "classes": [-1]}), 404, "unknown_class")
    assert_envelope(client.post("/v1/detect", json={"inputs": x, "classes": [1, 2, 3, 4]}), 422, "too_many_classes")
    for bad in ([], [True], [1.5], [None], [{"id": 1}], [[1]], [""], "7", 7):
        assert_envelope(client.post("/v1/detect", json={"inputs": x, "classes": bad}), 422, "validation_error")
    assert_envelope(client.post("/v1/detect", json={"inputs": x}), 422, "validation_error")
    assert_envelope(client.post("/v1/detect", json={"inputs": x, "classes": [1], "k": 3}), 422, "validation_error")
    assert_envelope(client.post("/v1/detect", json={"inputs": x, "classes": [1], "threshold": "1"}), 422)
    assert client.post("/v1/detect", json={"inputs": x, "classes": [1, 2.0, "3"]}).status_code == 200  # 2.0 is 2
    assert enroll(client, "odd[1],name", examples(1)).status_code == 201  # brackets and commas in a name: still read
    got = client.post("/v1/detect", json={"inputs": x, "classes": ["odd[1],name", 1]})
    assert got.status_code == 200 and got.json()["classes"][0]["class_name"] == "odd[1],name"
    for bad in (1, "true", None):
        assert_envelope(client.post("/v1/topk", json={"inputs": x, "matches_only": bad}), 422, "validation_error")


def test_a_calibration_reload_moves_topk_set_detect_and_detect_together(folder, client_factory, offline, inputs):
    """The Thresholds object a reload swaps is the one all three decide with."""
    from tests.serving.test_admin_calibration import AUTH, KEY, ROUTE, recalibrated, thresholds

    client = client_factory(bundle=folder, api_key=KEY)
    z = offline.logits(inputs)
    shift = float(-np.max(z)) - 1.0  # every threshold below every logit: everything matches after the reload
    new = thresholds(recalibrated(folder, shift)).astype(np.float64)
    assert client.post(ROUTE, headers=AUTH).json()["reloaded"]
    top = client.post("/v1/topk", json={"inputs": inputs.tolist(), "k": 3}).json()
    for row in top["results"]:
        assert all(e["match"] and e["threshold"] == pytest.approx(new[e["class_id"]], rel=1e-7) for e in row)
    got = client.post("/v1/detect", json={"inputs": inputs.tolist(), "classes": [4, 7]}).json()
    one = client.post("/v1/classes/7/detect", json={"inputs": inputs.tolist()}).json()
    assert got["classes"][1]["threshold"] == one["threshold"] == pytest.approx(new[7], rel=1e-7)
    assert all(e["match"] for row in got["results"] for e in row) and all(r["match"] for r in one["results"])


@pytest.fixture
def folder(bundle_path, tmp_path):
    import shutil
    from pathlib import Path

    return Path(shutil.copytree(bundle_path, tmp_path / "served"))


def _matched_by_truth(ext: Extended, thr: np.ndarray, x: np.ndarray, own: int, names: dict, k: int = 16):
    """(matched_by, complete) of an enrollment answer, offline: per example the k best of every class
    (the new one included), those at or above their threshold other than the new class, counted."""
    z = ext.logits(x)  # [n, D + n_e]
    counts: dict[int, int] = {}
    complete = True
    for zi in z:
        order = np.argsort(-zi, kind="stable")[:k]
        complete &= bool(len(zi) <= k or zi[order[-1]] < thr.min())
        for col in order:
            if zi[col] >= thr[col] and ext.ids[col] != own:
                counts[int(ext.ids[col])] = counts.get(int(ext.ids[col]), 0) + 1
    by = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [{"class_id": c, "class_name": names[c], "examples": n, "threshold": thr[ext.column(c)]} for c, n in by], complete


def _check_matched_by(got: dict, want: tuple) -> None:
    by, complete = want
    assert [(e["class_id"], e["class_name"], e["examples"]) for e in got["matched_by"]] == \
        [(e["class_id"], e["class_name"], e["examples"]) for e in by]
    np.testing.assert_allclose([e["threshold"] for e in got["matched_by"]], [e["threshold"] for e in by], rtol=1e-7)
    assert got["matched_by_complete"] is complete


def test_an_enrollment_names_the_classes_that_also_match_its_examples(served, offline, bundle):
    """PUT and POST .../examples answer `matched_by`: the other classes (trained and enrolled) whose
    detect says yes to the request's examples, with how many, as the offline logits and thresholds say;
    the new class itself is not among them."""
    client, ext, thr, names = served
    pool = np.random.default_rng(11).standard_normal((4000, INPUT_DIM)).astype(np.float32)
    margin = (ext.logits(pool) - thr).max(axis=1)
    claimed = pool[np.argsort(margin)[-3:]]  # inputs other classes claim
    r = enroll(client, "gamma", claimed)
    assert r.status_code == 201, r.text
    got = r.json()
    row, b = imprint(offline, claimed)
    made = Extended(offline, [*zip(ext.ids[D:].tolist(), ext.W[D:], ext.b[D:]), (got["class_id"], row, b)])
    thr3 = np.concatenate([thr, [bundle.global_threshold]])
    names3 = {**names, got["class_id"]: "gamma"}
    want = _matched_by_truth(made, thr3, claimed, got["class_id"], names3)
    assert want[0], "the probes must be claimed by some other class"
    _check_matched_by(got, want)

    unclaimed = pool[np.argsort(margin)[:2]]  # inputs no class claims: only the new row could
    r = client.post("/v1/classes/gamma/examples", json={"inputs": unclaimed.tolist()})
    assert r.status_code == 200, r.text
    row, b = imprint(offline, np.concatenate([claimed, unclaimed]))
    made = Extended(offline, [*zip(ext.ids[D:].tolist(), ext.W[D:], ext.b[D:]), (got["class_id"], row, b)])
    want = _matched_by_truth(made, thr3, unclaimed, got["class_id"], names3)
    _check_matched_by(r.json(), want)
    listed = client.get("/v1/classes").json()["classes"]
    assert all("matched_by" not in c for c in listed)  # the answer of a write, not a property of the class


def test_an_enrollment_whose_look_alikes_cannot_be_computed_writes_nothing(served, monkeypatch):
    """The look-alikes are sought before the write, in the pass that embeds the examples: a refusal of
    that pass (here an overload) is the answer, and nothing is written (no class without its look-alikes)."""
    from serving.core.engine import Engine
    from serving.errors import Overloaded

    client = served[0]

    async def refused(self, *args, **kwargs):
        raise Overloaded("busy")

    monkeypatch.setattr(Engine, "topk_arrays", refused)
    assert_envelope(enroll(client, "delta", examples(5)), 429, "overloaded")
    assert "delta" not in [c["class_name"] for c in client.get("/v1/classes").json()["classes"]]
    monkeypatch.undo()
    assert enroll(client, "delta", examples(5)).status_code == 201
