"""The calibration study's methods and judge, against brute force on small random problems."""
from __future__ import annotations

import numpy as np

from tools.experiments.calibration_study import judge, method_thresholds


def _problem(seed=0, n=120, classes=6):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    logits = rng.normal(size=(n, classes)) + 2.5 * (labels[:, None] == np.arange(classes))
    return logits, labels


def _brute_threshold(scores, positive, p):
    """Highest-recall threshold among observed scores with precision >= p (ties: higher precision)."""
    best = None
    for t in np.unique(scores):
        match = scores >= t
        prec = (match & positive).sum() / match.sum()
        rec = (match & positive).sum() / positive.sum()
        if prec >= p and (best is None or (rec, prec) > best[1:]):
            best = (t, rec, prec)
    return best[0]


def test_per_class_and_global_thresholds_are_the_brute_force_ones():
    logits, labels = _problem()
    got = method_thresholds(logits, labels, {"precision": 0.9})
    positive = labels[:, None] == np.arange(logits.shape[1])
    for j in range(logits.shape[1]):
        assert got["per_class"][j] == _brute_threshold(logits[:, j], positive[:, j], 0.9)
    assert np.all(got["global"] == _brute_threshold(logits.ravel(), positive.ravel(), 0.9))


def test_shrinkage_is_the_positive_weighted_mean_of_class_and_global():
    logits, labels = _problem(1)
    got = method_thresholds(logits, labels, {"precision": 0.9})
    n = np.bincount(labels, minlength=logits.shape[1])
    for kappa in (1, 4, 16):
        want = (n * got["per_class"] + kappa * got["global"]) / (n + kappa)
        np.testing.assert_allclose(got[f"shrink k={kappa}"], want, rtol=0, atol=1e-12)
        assert np.all(np.minimum(got["per_class"], got["global"]) - 1e-12 <= got[f"shrink k={kappa}"])


def test_judge_counts_precision_recall_and_the_worst_decile_by_hand():
    logits, labels = _problem(2, n=200, classes=20)
    t = np.full(20, 1.0)
    got = judge(logits, labels, t, 0.9)
    precision, recall = [], []
    for j in range(20):
        match, pos = logits[:, j] >= 1.0, labels == j
        precision.append((match & pos).sum() / match.sum() if match.any() else 1.0)
        recall.append((match & pos).sum() / pos.sum() if pos.any() else 0.0)
    assert abs(got["mean_precision"] - np.mean(precision)) < 1e-12
    assert abs(got["mean_recall"] - np.mean(recall)) < 1e-12
    assert abs(got["worst_decile_precision"] - np.mean(sorted(precision)[:2])) < 1e-12
    assert got["classes_reaching_target"] == np.mean(np.array(precision) >= 0.9)


def test_pooled_precision_counts_every_decision_once():
    logits, labels = _problem(3, n=150, classes=10)
    t = np.full(10, 0.5)
    got = judge(logits, labels, t, 0.9)
    match, positive = logits >= 0.5, labels[:, None] == np.arange(10)
    assert got["matches"] == match.sum()
    assert abs(got["pooled_precision"] - (match & positive).sum() / match.sum()) < 1e-12
