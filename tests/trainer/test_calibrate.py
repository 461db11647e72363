"""Calibration against brute-force threshold enumeration and scikit-learn's logistic regression."""
from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.calibrate import calibrate, choose_thresholds, fit_platt


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
