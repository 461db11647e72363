"""The norm rule (serving/calibration/norm.py) against independent truth: a per-column float64 loop
over sorted negatives with the dense estimator choosing tau on the pooled column, and the precision
the rule promises measured on fresh draws of a known distribution."""
from __future__ import annotations

import numpy as np
import pytest

from serving.calibration.estimator import calibrate
from serving.calibration.chunks import dense_chunks
from serving.calibration.counts import choose_thresholds
from serving.calibration.defaults import NORM_K
from serving.calibration.norm import halves, norm_thresholds

P = 0.99


def column_stats(z: np.ndarray, y: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Column by column: mean and population spread of the k highest negatives among `rows`."""
    d = z.shape[1]
    mu, sd = np.empty(d), np.empty(d)
    for j in range(d):
        neg = np.sort(z[rows][y[rows] != j, j])[::-1][:k]
        mu[j], sd[j] = neg.mean(), neg.std()
    return mu, sd


def reference_norm(z: np.ndarray, y: np.ndarray, target: dict, k: int = NORM_K) -> np.ndarray:
    """Each half standardised by the other's statistics; tau from choose_thresholds on all its
    (example, class) pairs as one column; the mean tau on the full statistics."""
    a, b = halves(y)
    n, d = z.shape
    taus = []
    for rows, other in ((a, b), (b, a)):
        mu, sd = column_stats(z, y, other, max(2, round(k * len(other) / n)))
        s = (z[rows] - mu) / sd  # [n_h, D]
        positive = y[rows][:, None] == np.arange(d)
        taus.append(choose_thresholds(s.reshape(-1, 1), positive.reshape(-1, 1), target)["threshold"][0])
    mu, sd = column_stats(z, y, np.arange(n), k)
    return mu + sd * np.mean(taus)


def columns(rng, d: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Column j's location a_j and scale b_j, spread widely."""
    return rng.uniform(-3, 3, d), rng.uniform(0.4, 2.5, d)


def heteroscedastic(rng, a: np.ndarray, b: np.ndarray, per: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Column j: negatives a_j + b_j N(0, 1), positives a_j + b_j (3.5 + N(0, 1)): one raw threshold
    must sit high for the wide columns, one standardised threshold need not."""
    y = np.repeat(np.arange(len(a)), per)
    e = rng.normal(size=(len(y), len(a)))
    e[np.arange(len(y)), y] += 3.5
    return a + b * e, y


def test_the_halves_split_every_class_evenly():
    y = np.repeat(np.arange(7), [1, 2, 3, 4, 5, 6, 9])
    a, b = halves(y, seed=5)
    assert len(np.intersect1d(a, b)) == 0 and len(a) + len(b) == len(y)
    assert abs(len(a) - len(b)) <= 1
    for j in range(7):
        assert abs((y[a] == j).sum() - (y[b] == j).sum()) <= 1


@pytest.mark.parametrize("target", [{"precision": P}, {"recall": 0.9}])
def test_the_norm_rule_equals_a_per_column_reference(target):
    rng = np.random.default_rng(0)
    z, y = heteroscedastic(rng, *columns(rng))
    d = z.shape[1]
    got = norm_thresholds(dense_chunks(z, 7), y, d, target, k=25)  # chunks that do not divide D
    np.testing.assert_allclose(got, reference_norm(z, y, target, k=25), rtol=1e-10, atol=1e-10)
    stored = np.array([e["threshold"] for e in calibrate(z, y, target, method={"name": "norm"})["per_class"]])
    np.testing.assert_allclose(stored, reference_norm(z, y, target).astype(np.float32), rtol=1e-6)


def test_the_norm_rule_keeps_its_precision_and_recalls_more_than_one_raw_threshold_on_fresh_data():
    """Fitted on one draw, judged on a second draw of the same columns: pooled precision near the
    target, and more recall than the global threshold fitted on the same draw."""
    rng = np.random.default_rng(1)
    a, b = columns(rng, 60)
    z, y = heteroscedastic(rng, a, b, per=60)
    fit = calibrate(z, y, {"precision": P}, method={"name": "norm"})
    t = np.array([e["threshold"] for e in fit["per_class"]])
    z2, y2 = heteroscedastic(rng, a, b, per=60)
    own = y2[:, None] == np.arange(60)

    def judged(th):
        match = z2 >= th
        return (match & own).sum() / match.sum(), (match & own).sum() / own.sum()

    precision, recall = judged(t)
    _, g_recall = judged(np.full(60, fit["global"]["threshold"]))
    assert abs(precision - P) < 0.006, precision
    assert recall > g_recall + 0.1, (recall, g_recall)


def test_the_norm_rule_edges():
    z = np.array([[5.0, 1.0, 0.3], [0.5, 2.0, 0.2], [0.2, 0.1, 4.0], [0.1, 0.4, 3.0]])
    y = np.array([0, 0, 0, 2])  # class 1 has no positive: it never matches
    t = norm_thresholds(dense_chunks(z, 3), y, 3, {"precision": P})
    assert t[1] > z[:, 1].max()
    assert t[0] == np.nextafter(np.float32(0.1), np.float32(np.inf))  # one negative: just above it
    y = np.array([0, 0, 0, 0])  # class 0 has no negative: from its lowest positive
    assert norm_thresholds(dense_chunks(z, 3), y, 3, {"precision": P})[0] == 0.1
    with pytest.raises(ValueError, match="at least 2 images"):
        norm_thresholds(dense_chunks(z[:1], 3), y[:1], 3, {"precision": P})
