"""Calibration against brute-force threshold enumeration and scikit-learn's logistic regression."""
from __future__ import annotations

import json

import numpy as np
import pytest

from serving.calibration import counts, estimator as cal_mod, rules
from serving.calibration.chunks import dense_chunks
from serving.calibration.estimator import calibrate
from serving.calibration.counts import choose_thresholds
from serving.calibration.platt import fit_platt


def brute_force(scores: np.ndarray, positive: np.ndarray, target: dict) -> tuple[float, float, float, bool]:
    """Every distinct score as threshold, rates counted directly; the rule of DESIGN.md §6."""
    (kind, value), = target.items()
    rows = []
    for t in np.unique(scores):
        match = scores >= t
        tp = int((match & positive).sum())
        prec = tp / match.sum()
        rec = tp / positive.sum()
        rows.append((t, prec, rec))
    if kind == "precision":
        ok = [r for r in rows if r[1] >= value]
        if ok:
            best = max(ok, key=lambda r: (r[2], r[1]))
            return best[0], best[1], best[2], True
        best = max(rows, key=lambda r: (r[1], r[2]))
        return best[0], best[1], best[2], False
    ok = [r for r in rows if r[2] >= value]
    best = max(ok, key=lambda r: (r[1], r[2]))
    return best[0], best[1], best[2], True


def overlapping_logits(rng, n=300, classes=6, sep=2.0, ties=False):
    y = rng.integers(0, classes, n)
    y[:classes] = np.arange(classes)  # every class present
    logits = rng.standard_normal((n, classes))
    logits[np.arange(n), y] += sep
    if ties:
        logits = np.round(logits, 1)  # many equal scores
    return logits, y


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("target", [{"precision": 0.99}, {"precision": 0.8}, {"recall": 0.9}, {"recall": 1.0}])
def test_thresholds_match_brute_force(ties, target):
    rng = np.random.default_rng(1)
    logits, y = overlapping_logits(rng, ties=ties)
    positive = y[:, None] == np.arange(logits.shape[1])
    got = choose_thresholds(logits, positive, target)
    for j in range(logits.shape[1]):
        t, p, r, reached = brute_force(logits[:, j], positive[:, j], target)
        assert got["threshold"][j] == t
        assert got["precision"][j] == pytest.approx(p)
        assert got["recall"][j] == pytest.approx(r)
        assert got["reached"][j] == reached


def test_reaches_target_on_calibration_when_reachable_and_flags_when_not():
    rng = np.random.default_rng(2)
    logits, y = overlapping_logits(rng, n=400, classes=5, sep=1.0)
    # class 0 separable: reachable at full recall; class 1 hopeless: its positives score lowest
    logits[:, 0] = np.where(y == 0, 5.0, -5.0) + 0.01 * rng.standard_normal(len(y))
    logits[:, 1] = np.where(y == 1, -10.0, rng.standard_normal(len(y)))
    cal = calibrate(logits, y, {"precision": 0.99}, method={"name": "per_class"})
    json.dumps(cal, allow_nan=False)  # strict JSON
    positive = y[:, None] == np.arange(5)
    for entry in cal["per_class"]:
        j = entry["class_id"]
        t, p, r, reached = brute_force(logits[:, j], positive[:, j], {"precision": 0.99})
        assert entry["reached"] == reached
        assert entry["threshold"] == t
        match = logits[:, j] >= entry["threshold"]
        measured_precision = (match & positive[:, j]).sum() / match.sum()
        assert measured_precision == pytest.approx(entry["precision"])
        if reached:
            assert measured_precision >= 0.99
    assert cal["per_class"][0]["reached"] and cal["per_class"][0]["recall"] == 1.0
    assert not cal["per_class"][1]["reached"]
    # global: pooled over all (example, class) pairs
    tg, pg, rg, reached_g = brute_force(logits.ravel(), positive.ravel(), {"precision": 0.99})
    assert cal["global"]["threshold"] == tg and cal["global"]["reached"] == reached_g
    assert cal["global"]["recall"] == pytest.approx(rg)


def test_test_split_is_only_measured():
    rng = np.random.default_rng(3)
    logits, y = overlapping_logits(rng, n=300, classes=4, sep=3.0)
    logits_t, y_t = overlapping_logits(rng, n=200, classes=4, sep=3.0)
    with_test = calibrate(logits, y, {"precision": 0.95}, logits_t, y_t)
    without = calibrate(logits, y, {"precision": 0.95})
    assert [e["threshold"] for e in with_test["per_class"]] == [e["threshold"] for e in without["per_class"]]
    for e in with_test["per_class"]:
        match = logits_t[:, e["class_id"]] >= e["threshold"]
        pos = y_t == e["class_id"]
        assert e["test"]["recall"] == pytest.approx((match & pos).sum() / pos.sum())
        assert e["test"]["precision"] == pytest.approx((match & pos).sum() / match.sum() if match.any() else 1.0)
    shortfall = np.mean([max(0.0, 0.95 - e["test"]["precision"]) for e in with_test["per_class"]])
    assert with_test["summary"]["test"]["mean_precision_shortfall"] == pytest.approx(shortfall)


def test_class_without_positives_never_matches():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((50, 3))
    y = rng.integers(0, 2, 50)  # class 2 absent
    cal = calibrate(logits, y, method={"name": "per_class"})
    entry = cal["per_class"][2]
    assert not entry["reached"] and entry["positives"] == 0
    assert (logits[:, 2] < entry["threshold"]).all()
    # ... also as the server compares: float32 logits against the float32-stored threshold
    assert (logits[:, 2].astype(np.float32) < np.float32(entry["threshold"])).all()
    # Platt: no slope to fit; the probability is the (smoothed) base rate, i.e. small
    assert entry["platt"]["a"] == 0.0
    assert 1 / (1 + np.exp(-entry["platt"]["b"])) < 0.02


def test_platt_matches_sklearn():
    sklearn_lm = pytest.importorskip("sklearn.linear_model")
    rng = np.random.default_rng(5)
    logits, y = overlapping_logits(rng, n=500, classes=4, sep=1.5)
    logits = 7.0 * logits - 3.0  # a scale and offset Platt must undo
    positive = y[:, None] == np.arange(4)
    a, b = fit_platt(logits, positive)
    for j in range(4):
        ref = sklearn_lm.LogisticRegression(C=1e8, tol=1e-10, max_iter=10000).fit(logits[:, j:j + 1], positive[:, j])
        p_ref = ref.predict_proba(logits[:, j:j + 1])[:, 1]
        p_ours = 1 / (1 + np.exp(-(a[j] * logits[:, j] + b[j])))
        assert np.max(np.abs(p_ours - p_ref)) < 1e-3
        assert a[j] == pytest.approx(ref.coef_[0, 0], rel=1e-2)
        assert b[j] == pytest.approx(ref.intercept_[0], rel=1e-2, abs=1e-2)


def test_platt_separable_is_finite_and_ordered():
    rng = np.random.default_rng(6)
    s = rng.standard_normal((200, 2))
    pos = np.stack([s[:, 0] > 0.3, s[:, 1] > -0.2], axis=1)  # perfectly separable
    a, b = fit_platt(s, pos)
    assert np.isfinite(a).all() and np.isfinite(b).all() and (a > 0).all()
    p = 1 / (1 + np.exp(-(a * s + b)))
    assert ((p > 0.5) == pos).mean() > 0.97


def test_large_d_is_vectorised():
    rng = np.random.default_rng(7)
    n, classes = 400, 2000
    y = rng.integers(0, classes, n)
    logits = rng.standard_normal((n, classes)).astype(np.float32)
    logits[np.arange(n), y] += 4
    cal = calibrate(logits, y, method={"name": "per_class"})
    assert len(cal["per_class"]) == classes
    present = np.unique(y)
    j = int(present[0])
    positive = y == j
    t, _, r, reached = brute_force(logits[:, j].astype(np.float64), positive, {"precision": 0.99})
    assert cal["per_class"][j]["threshold"] == pytest.approx(t) and cal["per_class"][j]["reached"] == reached


def test_shrunk_thresholds_are_the_positive_weighted_mean_and_their_rates_are_measured():
    rng = np.random.default_rng(8)
    logits, y = overlapping_logits(rng, n=300, classes=6, sep=1.5)
    per = calibrate(logits, y, {"precision": 0.9}, method={"name": "per_class"})
    shrunk = calibrate(logits, y, {"precision": 0.9}, method={"name": "shrink", "kappa": 2})
    assert shrunk["method"] == {"name": "shrink", "kappa": 2.0} and per["method"] == {"name": "per_class"}
    g = per["global"]["threshold"]
    positive = y[:, None] == np.arange(6)
    for e_per, e in zip(per["per_class"], shrunk["per_class"]):
        n = e_per["positives"]
        assert e["threshold"] == float(np.float32((n * e_per["threshold"] + 2 * g) / (n + 2)))  # stored as float32
        assert e["reached"] is False or n > 0
        match = logits[:, e["class_id"]] >= e["threshold"]
        pos = positive[:, e["class_id"]]
        assert e["precision"] == pytest.approx((match & pos).sum() / match.sum() if match.any() else 1.0)
        assert e["recall"] == pytest.approx((match & pos).sum() / pos.sum())
        assert e["reached"] == (e["precision"] >= 0.9 - 1e-12 and e_per["positives"] > 0)


def test_the_global_method_gives_every_class_the_pooled_threshold():
    rng = np.random.default_rng(9)
    logits, y = overlapping_logits(rng, n=200, classes=4, sep=2.0)
    cal = calibrate(logits, y, method={"name": "global"})
    assert {e["threshold"] for e in cal["per_class"]} == {float(np.float32(cal["global"]["threshold"]))}


@pytest.mark.parametrize("method", [{"name": "median"}, {"name": "shrink", "kappa": 0}, {"name": "shrink", "kappa": -1}])
def test_an_unknown_method_or_a_bad_kappa_is_refused(method):
    logits, y = overlapping_logits(np.random.default_rng(0), n=50, classes=3, sep=1.0)
    with pytest.raises(ValueError):
        calibrate(logits, y, method=method)


# ----------------------------------------------------------------------------- by class chunks = dense
def dense_reference(logits, y, target, logits_t=None, y_t=None, method=None) -> dict:
    """calibrate() as it was before it streamed (commit 51b1760): one float64 [N, D] matrix, the pooled
    threshold by sorting all N·D pairs in one column. The independent truth for the chunked path."""
    kind, value = next(iter(target.items()))
    method = rules.check_method(method)
    logits = np.asarray(logits, dtype=np.float64)
    D = logits.shape[1]
    positive = y[:, None] == np.arange(D)[None, :]  # [N, D]
    per = choose_thresholds(logits, positive, target)
    pooled = choose_thresholds(logits.reshape(-1, 1), positive.reshape(-1, 1), target)
    a, b = fit_platt(logits, positive)
    g = float(pooled["threshold"][0])
    if method["name"] != "per_class":
        n = per["positives"].astype(np.float64)
        t = np.full(D, g) if method["name"] == "global" else (n * per["threshold"] + method["kappa"] * g) / (n + method["kappa"])
        t = t.astype(np.float32).astype(np.float64)
        r = dense_rates(logits, positive, t)
        per = {**per, "threshold": t, "precision": r["precision"], "recall": r["recall"],
               "reached": (r[kind] >= value - 1e-12) & (per["positives"] > 0)}
    test = None
    if logits_t is not None:
        pos_t = y_t[:, None] == np.arange(D)[None, :]
        test = {"per_class": dense_rates(logits_t, pos_t, per["threshold"]),
                "global": dense_rates(logits_t.reshape(-1, 1), pos_t.reshape(-1, 1), np.array([g])),
                "per_class_at_global": dense_rates(logits_t, pos_t, np.full(D, g)), "examples": len(y_t)}
    out = {"target": {kind: float(value)}, "method": method, "decision": "match = logit >= threshold",
           "probability": "sigmoid(a * logit + b)", "split": "calibration", "examples": len(y),
           "global": cal_mod.global_entry(pooled, test), "per_class": cal_mod.per_class_entries(per, a, b, test),
           "summary": cal_mod.summary(per, dense_rates(logits, positive, np.full(D, g)), test, kind, value)}
    if test is not None:
        out["test_examples"] = len(y_t)
    return out


def dense_rates(scores, positive, threshold) -> dict:
    match = scores >= threshold[None, :]
    tp, predicted, n_pos = (match & positive).sum(axis=0), match.sum(axis=0), positive.sum(axis=0)
    return {"precision": np.where(predicted > 0, tp / np.maximum(predicted, 1), 1.0),
            "recall": np.where(n_pos > 0, tp / np.maximum(n_pos, 1), 0.0), "positives": n_pos}


def assert_same_document(got: dict, want: dict) -> None:
    """Equal in every field; Platt (a, b) within 1e-9 (its sums run in another order by chunks)."""
    got, want = json.loads(json.dumps(got)), json.loads(json.dumps(want))
    platt_got = [e.pop("platt") for e in got["per_class"]]
    platt_want = [e.pop("platt") for e in want["per_class"]]
    assert got == want
    for pg, pw in zip(platt_got, platt_want):
        assert pg["a"] == pytest.approx(pw["a"], rel=1e-9, abs=1e-9)
        assert pg["b"] == pytest.approx(pw["b"], rel=1e-9, abs=1e-9)


def tied_logits(rng, n=160, classes=13, absent=(4, 11)):
    """Rounded logits (ties within classes, across classes and between positives and negatives),
    some classes without a calibration positive."""
    present = np.setdiff1d(np.arange(classes), absent)
    y = rng.choice(present, n)
    logits = np.round(rng.standard_normal((n, classes)), 1)
    logits[np.arange(n), y] += np.round(rng.uniform(0, 2.5, n), 1)
    return logits, y


TARGETS = [{"precision": 0.9}, {"precision": 0.999}, {"recall": 0.8}, {"recall": 1.0}]


@pytest.mark.parametrize("method", [{"name": "per_class"}, {"name": "global"}, {"name": "shrink", "kappa": 3.0}])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 40])  # 13 = D; 4 and 5 do not divide it
def test_calibration_by_class_chunks_equals_the_dense_computation(chunk, target, method):
    rng = np.random.default_rng(11)
    logits, y = tied_logits(rng)
    logits_t, y_t = tied_logits(rng, n=90, absent=(2,))
    want = dense_reference(logits, y, target, logits_t, y_t, method)
    assert_same_document(calibrate(logits, y, target, logits_t, y_t, method=method, chunk=chunk), want)
    assert_same_document(calibrate(logits, y, target, method=method, chunk=chunk),
                         dense_reference(logits, y, target, method=method))


@pytest.mark.parametrize("target", TARGETS + [{"precision": 1e-13}, {"precision": 1.0}, {"recall": 1e-13}])
@pytest.mark.parametrize("seed", range(6))
def test_the_pooled_threshold_is_the_brute_force_one(target, seed):
    """PooledThreshold (counts at the true logits only) against every distinct pooled score tried."""
    rng = np.random.default_rng(seed)
    n, classes = int(rng.integers(1, 60)), int(rng.integers(1, 9))
    y = rng.integers(0, classes, n)
    logits = rng.integers(-3, 4, (n, classes)).astype(np.float64)  # few values: ties everywhere
    logits[np.arange(n), y] += rng.integers(0, 3, n)
    pooled = counts.PooledThreshold(logits[np.arange(n), y])
    for first in range(0, classes, 2):
        pooled.add(logits[:, first:first + 2])
    got = pooled.choose(target)
    positive = (y[:, None] == np.arange(classes)).ravel()
    t, p, r, reached = brute_force(logits.ravel(), positive, target)
    assert (got["threshold"][0], got["reached"][0]) == (t, reached)
    assert got["precision"][0] == pytest.approx(p, abs=1e-15) and got["recall"][0] == pytest.approx(r, abs=1e-15)


@pytest.mark.parametrize("few", [None, 0, 10**9])  # as shipped; always sort; always count
@pytest.mark.parametrize("target", TARGETS + [{"precision": 1e-13}, {"precision": 1.0}])
@pytest.mark.parametrize("seed", range(4))
def test_counting_at_the_positives_equals_sorting_the_columns(seed, target, few, monkeypatch):
    """class_thresholds (candidates = the positives' scores) against choose_thresholds (every
    distinct score), for classes with 0, 1, a few and many positives, ties everywhere."""
    if few is not None:
        monkeypatch.setattr(counts, "FEW_POSITIVES", few)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 120))
    y = rng.choice(8, n, p=[0.4, 0.2, 0.15, 0.1, 0.1, 0.04, 0.01, 0.0])  # class 7 never, 6 rarely
    scores = rng.integers(-4, 5, (n, 8)).astype(np.float64)
    scores[np.arange(n), y] += rng.integers(0, 4, n)
    positive = y[:, None] == np.arange(8)
    got, want = counts.class_thresholds(scores, positive, target), choose_thresholds(scores, positive, target)
    for key in ("threshold", "precision", "recall", "reached", "positives"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_calibration_from_a_head_by_chunks_equals_the_dense_logits(chunk):
    """Export's route: embeddings [N, d] and a head W [D, d], b [D] (trainer.metrics.head_chunks).
    Small integers, so every logit is exact whatever the GEMM's summation order (and ties abound)."""
    from serving.calibration.chunks import head_chunks

    rng = np.random.default_rng(12)
    n, d, classes = 120, 5, 70
    h, h_t = rng.integers(-2, 3, (n, d)).astype(np.float64), rng.integers(-2, 3, (50, d)).astype(np.float64)
    w, b = rng.integers(-2, 3, (classes, d)).astype(np.float32), rng.integers(-1, 2, classes).astype(np.float32)
    y, y_t = rng.integers(0, classes - 3, n), rng.integers(0, classes, 50)  # the last 3 classes: no positive
    got = cal_mod.calibrate_chunks(head_chunks(h, w, b, chunk), y, classes, {"precision": 0.7},
                                   head_chunks(h_t, w, b, chunk), y_t)
    want = dense_reference(h @ w.T.astype(np.float64) + b, y, {"precision": 0.7}, h_t @ w.T.astype(np.float64) + b, y_t)
    assert_same_document(got, want)


def test_chunks_that_do_not_cover_the_classes_in_order_are_refused():
    logits, y = tied_logits(np.random.default_rng(13))
    whole = dense_chunks(logits, 5)
    for chunks in (lambda: [c for c in whole()][::-1],  # out of order
                   lambda: list(whole())[:-1],  # one missing
                   lambda: [(f, z[:-1]) for f, z in whole()]):  # rows missing
        with pytest.raises(ValueError):
            cal_mod.calibrate_chunks(chunks, y, logits.shape[1])


@pytest.mark.slow
def test_calibration_memory_grows_with_the_chunk_not_with_d():
    """tracemalloc sees numpy's buffers: by chunks of 64 classes the peak stays far below one dense
    float64 [N, D] matrix (N·D = 1.6·10^7 values, 128 MB)."""
    import tracemalloc

    from serving.calibration.chunks import head_chunks

    rng = np.random.default_rng(14)
    n, d, classes = 2000, 8, 8000
    h, w, b = rng.standard_normal((n, d)), rng.standard_normal((classes, d)), rng.standard_normal(classes)
    y = rng.integers(0, classes, n)
    tracemalloc.start()
    try:
        cal = cal_mod.calibrate_chunks(head_chunks(h, w, b, 32), y, classes, method={"name": "shrink"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(cal["per_class"]) == classes
    assert peak < n * classes * 8 / 8, f"peak {peak / 1e6:.1f} MB"
    print(f"peak {peak / 1e6:.1f} MB")
