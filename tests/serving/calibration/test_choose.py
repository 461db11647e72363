"""The tail rule (serving/calibration/ tail_thresholds) and the cross-validated choice of a rule
(serving/calibration/choose.py), against independent truth: a per-column float64 loop over sorted
negatives, the precision the rule promises measured on fresh draws of a known distribution, and a
brute-force cross-validation built on the dense estimator (serving.calibration.calibrate) and plain
counting."""
from __future__ import annotations

import math

import numpy as np
import pytest

from serving.calibration import choose as threshold_cv
from serving.calibration.estimator import calibrate
from serving.calibration.chunks import chunk_classes, dense_chunks
from serving.calibration.defaults import TAIL_K
from serving.calibration.rules import tail_thresholds

P = 0.99


def reference_tail(z: np.ndarray, y: np.ndarray, p: float, k: int = TAIL_K) -> np.ndarray:
    """Column by column in float64: u the k-th highest negative, beta the mean excess of the k highest
    over it, t where k exp(-(t - u) / beta) equals the n_j (1 - p) / p false matches the target allows."""
    out = np.empty(z.shape[1])
    for j in range(z.shape[1]):
        neg = np.sort(z[y != j, j])[::-1][:k]
        n_j = int((y == j).sum())
        out[j] = neg[-1] + (neg - neg[-1]).mean() * math.log(k * p / (n_j * (1 - p)))
    return out


def test_the_tail_rule_equals_a_per_column_reference():
    rng = np.random.default_rng(0)
    n, d = 3000, 40
    y = rng.integers(0, d, n)
    z = rng.normal(size=(n, d)) * rng.uniform(0.5, 2, d)  # columns with tails of different widths
    z[np.arange(n), y] += 4
    got = tail_thresholds(z, y[:, None] == np.arange(d), {"precision": P})
    np.testing.assert_allclose(got, reference_tail(z, y, P), rtol=1e-12, atol=1e-12)


def test_the_tail_rule_keeps_the_precision_it_promises_on_fresh_data():
    """Negatives with an exponential tail of a different scale per column, positives far above: the
    thresholds fitted on one draw give pooled precision close to the target on a second draw (a
    wrong constant in the rule, say ln(k / n_j), lands far from it)."""
    rng = np.random.default_rng(1)
    d, n_neg, n_pos = 60, 20000, 200
    scale = rng.uniform(0.5, 3, d)

    def draw():
        neg = rng.exponential(scale, size=(n_neg, d))  # [n_neg, D] column j: Exp(scale_j)
        z = np.concatenate([neg, np.full((n_pos * d, d), -np.inf)])
        y = np.concatenate([np.full(n_neg, -1), np.repeat(np.arange(d), n_pos)])
        z[n_neg + np.arange(n_pos * d), y[n_neg:]] = 1e3  # every positive far above its column's negatives
        z[n_neg:][~np.isfinite(z[n_neg:])] = -50.0  # a positive of class i scores low on the other columns
        return z, y

    z, y = draw()
    t = tail_thresholds(z, y[:, None] == np.arange(d), {"precision": P})
    z2, y2 = draw()
    match = z2 >= t
    tp = match[y2[:, None] == np.arange(d)].sum()
    assert tp == n_pos * d
    precision = tp / match.sum()
    assert abs(precision - P) < 0.004, precision


def test_the_tail_rule_edges():
    z = np.array([[5.0, 1.0], [0.5, 2.0], [0.2, 0.1]])
    y = np.array([0, 0, 0])  # class 1 has no positive: it never matches
    t = tail_thresholds(z, y[:, None] == np.arange(2), {"precision": P})
    assert t[1] > z[:, 1].max() and t[0] == z[:, 0].min()  # class 0 has no negative: its lowest positive
    with pytest.raises(ValueError, match="precision target"):
        tail_thresholds(z, y[:, None] == np.arange(2), {"recall": 0.9})


def brute_force_cv(z: np.ndarray, y: np.ndarray, target: dict, seed: int) -> list[dict]:
    """Each candidate fitted by the dense estimator on one fold, judged by counting on the other."""
    d = z.shape[1]
    fold = threshold_cv.folds(y, seed)
    rows = []
    for method in threshold_cv.CANDIDATES:
        tp = np.zeros(d)
        matches = np.zeros(d)
        positives = np.zeros(d)
        for f in range(threshold_cv.FOLDS):
            fit, judge = fold != f, fold == f
            t = np.array([e["threshold"] for e in calibrate(z[fit], y[fit], target, method=method)["per_class"]])
            m = z[judge] >= t.astype(np.float32)
            own = y[judge][:, None] == np.arange(d)
            tp += (m & own).sum(0)
            matches += m.sum(0)
            positives += own.sum(0)
        has = positives > 0
        rows.append({"method": method["name"], "pooled_precision": tp.sum() / matches.sum(),
                     "mean_recall": (tp[has] / positives[has]).mean(), "matches": int(matches.sum())})
    return rows


def regime(hard: bool, seed: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Logits of 4 examples per class over 150 classes, negatives N(0, 1). Easy: positives from 3.5 to
    8 in every column alike, where one pooled threshold recalls the most. Hard: a few columns with a heavy negative tail and positives of uneven height, the case
    where one pooled threshold must sit high for all."""
    rng = np.random.default_rng(seed)
    d, per = 150, 4
    y = np.repeat(np.arange(d), per)
    z = rng.normal(size=(len(y), d))
    if hard:
        z[:, :8] *= 3  # heavy tails on 8 columns
        z[np.arange(len(y)), y] = rng.uniform(1.5, 7, len(y))
    else:
        z[np.arange(len(y)), y] = rng.uniform(3.5, 8, len(y))
    return z, y


@pytest.mark.parametrize("hard", [False, True])
def test_the_choice_equals_a_brute_force_cross_validation(hard):
    z, y = regime(hard)
    d = z.shape[1]
    method, record = threshold_cv.choose(lambda r: dense_chunks(z[r], chunk_classes(len(r), d)), y, d,
                                         {"precision": P}, seed=3)
    want = brute_force_cv(z, y, {"precision": P}, seed=3)
    for got, ref in zip(record["candidates"], want):
        assert got["method"] == ref["method"] and got["matches"] == ref["matches"]
        assert got["pooled_precision"] == pytest.approx(ref["pooled_precision"], abs=1e-12)
        assert got["mean_recall"] == pytest.approx(ref["mean_recall"], abs=1e-12)
    # the documented rule: within two binomial standard errors of the target, the most recall
    ok = [r for r in want if r["pooled_precision"] >= P - 2 * math.sqrt(P * (1 - P) / r["matches"])]
    best = max(ok, key=lambda r: r["mean_recall"])["method"] if ok else max(want, key=lambda r: r["pooled_precision"])["method"]
    assert method["name"] == record["chosen"] == best
    # the regimes do what they are built for: a rule that reads each column's own negatives wins the hard one
    assert best in (("tail", "norm") if hard else ("global",))


def test_the_folds_split_every_class_in_two_and_a_recall_target_leaves_tail_out():
    y = np.repeat(np.arange(7), [1, 2, 3, 4, 5, 6, 9])
    fold = threshold_cv.folds(y, seed=5)
    for j in range(7):
        counts = np.bincount(fold[y == j], minlength=2)
        assert abs(counts[0] - counts[1]) <= 1
    z, y = regime(False)
    _, record = threshold_cv.choose(lambda r: dense_chunks(z[r], chunk_classes(len(r), z.shape[1])), y, z.shape[1],
                                    {"recall": 0.9})
    assert "tail" not in [r["method"] for r in record["candidates"]]


def test_with_one_image_to_fit_per_fold_cv_leaves_norm_out_and_still_chooses():
    z = np.array([[3.0, 0.1], [2.5, -0.2]])  # two images of class 0: each fold is fitted on one
    y = np.array([0, 0])
    method, record = threshold_cv.choose(lambda r: dense_chunks(z[r], 2), y, 2, {"precision": P})
    names = [r["method"] for r in record["candidates"]]
    assert "norm" not in names and "global" in names and method["name"] in names


def test_slc_calibrate_options_default_to_norm_and_refuse_what_cannot_work():
    import click

    from serving.calibration.options import resolve_options

    old = {"target": {"precision": 0.99}, "method": {"name": "global"}}
    assert resolve_options(old, None, None, None, None, False).method == {"name": "norm", "k": 100}
    assert resolve_options(old, None, None, "cv", None, False).method == {"name": "cv"}
    assert resolve_options(old, None, None, "tail", None, False).method == {"name": "tail", "k": 20}
    with pytest.raises(click.UsageError, match="needs a precision target"):
        resolve_options(old, None, 0.9, "tail", None, False)
    with pytest.raises(click.UsageError, match="--kappa goes with"):
        resolve_options(old, None, None, None, 8.0, False)
    assert resolve_options(old, None, None, "shrink", 8.0, False).method == {"name": "shrink", "kappa": 8.0}
