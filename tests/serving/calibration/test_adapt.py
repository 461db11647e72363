"""Row adaptation (serving/calibration/adapt.py) against independent truth: the moved rows from a per-class
float64 loop, the cross-fitted thresholds from dense per-column statistics and the dense estimator,
and on fresh draws of a known shift, the recall it buys at the precision it promises."""
from __future__ import annotations

import numpy as np
import pytest

from tests.serving.calibration.test_norm import column_stats
from serving.calibration import adapt as row_adapt
from serving.calibration.chunks import dense_chunks
from serving.calibration.counts import choose_thresholds
from serving.calibration.defaults import NORM_K
from serving.calibration.norm import halves, norm_thresholds

P = 0.99


def reference_rows(W: np.ndarray, h: np.ndarray, y: np.ndarray, beta: float) -> np.ndarray:
    """Class by class: w_j + beta |w_j| unit(mean of j's embeddings - mean of all)."""
    out = W.astype(np.float64).copy()
    m = h.astype(np.float64).mean(axis=0)
    for j in np.unique(y):
        diff = h[y == j].astype(np.float64).mean(axis=0) - m
        if np.linalg.norm(diff) > 0:
            out[j] += beta * np.linalg.norm(out[j]) * diff / np.linalg.norm(diff)
    return out


def reference_thresholds(h, y, W, b, beta, target, k=NORM_K) -> np.ndarray:
    """Each half standardised and scored under rows adapted on the other half; tau by the dense
    estimator on the pooled column; the mean tau on the statistics of all images under all-image rows."""
    n, D = len(y), len(W)
    taus = []
    for rows, other in zip(halves(y), halves(y)[::-1]):
        z = h @ reference_rows(W, h[other], y[other], beta).T + b  # [n, D]
        mu, sd = column_stats(z, y, other, max(2, round(k * len(other) / n)))
        s = (z[rows] - mu) / sd
        positive = y[rows][:, None] == np.arange(D)
        taus.append(choose_thresholds(s.reshape(-1, 1), positive.reshape(-1, 1), target)["threshold"][0])
    mu, sd = column_stats(h @ reference_rows(W, h, y, beta).T + b, y, np.arange(n), k)
    return mu + sd * np.mean(taus)


def shifted_face(rng, W: np.ndarray, per: int, offsets: np.ndarray, noise: float = 0.6):
    """Embeddings of a new face: class j at 2 unit(w_j) + its own offset v_j + noise, so its
    positives score against w_j by an amount that differs from class to class."""
    y = np.repeat(np.arange(len(W)), per)
    unit = W / np.linalg.norm(W, axis=1, keepdims=True)
    return 2.0 * unit[y] + offsets[y] + noise * rng.normal(size=(len(y), W.shape[1])), y


def test_rows_are_moved_as_the_per_class_loop_moves_them():
    rng = np.random.default_rng(0)
    W = rng.normal(size=(23, 8)).astype(np.float32)
    h = rng.normal(size=(40, 8))
    y = rng.choice([1, 4, 5, 11, 22], size=40)  # some classes have no image: their rows stay
    rows = row_adapt.adapt(W, h, y, 0.5)
    want = reference_rows(W, h, y, 0.5)
    for start, stop in ((0, 23), (0, 5), (5, 12), (20, 23), (3, 4)):
        np.testing.assert_allclose(rows[start:stop], want[start:stop], rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(23), y)
    np.testing.assert_array_equal(rows[0:23][untouched], W[untouched])
    with pytest.raises(IndexError):
        rows[0:10:2]


def test_the_thresholds_equal_a_dense_cross_fitted_reference():
    rng = np.random.default_rng(1)
    W = rng.normal(size=(30, 12))
    h, y = shifted_face(rng, W, 4, rng.normal(size=(30, 12)))
    b = rng.normal(scale=0.1, size=30)
    _, got = row_adapt.thresholds(h, y, W, b, 0.5, {"precision": P})  # rows kept as float32, as the bundle keeps them
    np.testing.assert_allclose(got, reference_thresholds(h, y, W, b, 0.5, {"precision": P}), rtol=1e-6, atol=1e-6)


def test_a_zero_step_is_the_plain_norm_rule():
    rng = np.random.default_rng(2)
    W = rng.normal(size=(25, 10)).astype(np.float32)
    h, y = shifted_face(rng, W, 3, rng.normal(size=(25, 10)))
    b = np.zeros(25)
    _, got = row_adapt.thresholds(h, y, W, b, 0.0, {"precision": P})
    np.testing.assert_allclose(got, norm_thresholds(dense_chunks(h @ W.T + b, 7), y, 25, {"precision": P}),
                               rtol=1e-12, atol=1e-12)


def test_the_step_chosen_recalls_the_most_across_the_halves():
    rng = np.random.default_rng(3)
    W = rng.normal(size=(30, 12))
    h, y = shifted_face(rng, W, 4, 1.5 * rng.normal(size=(30, 12)))
    b = np.zeros(30)
    beta, scores = row_adapt.choose_beta(h, y, W, b, {"precision": P}, betas=(0.0, 0.5, 1.0))
    assert [s["beta"] for s in scores] == [0.0, 0.5, 1.0]
    for s in scores:  # each candidate's halves, from the dense reference
        recalls = []
        for rows, other in zip(halves(y), halves(y)[::-1]):
            z = h @ reference_rows(W, h[other], y[other], s["beta"]).T + b
            mu, sd = column_stats(z, y, other, max(2, round(NORM_K * len(other) / len(y))))
            st = (z[rows] - mu) / sd
            positive = y[rows][:, None] == np.arange(30)
            recalls.append(choose_thresholds(st.reshape(-1, 1), positive.reshape(-1, 1), {"precision": P})["recall"][0])
        assert s["recall"] == pytest.approx(np.mean(recalls), abs=1e-12)
    assert beta == max(scores, key=lambda s: (s["recall"], -s["beta"]))["beta"]


def test_on_fresh_images_of_the_face_adapted_rows_recall_more_at_the_promised_precision():
    """2 images per class adapt the rows; 40 fresh images per class of the same face judge them."""
    rng = np.random.default_rng(4)
    D, d = 60, 32
    W = rng.normal(size=(D, d))
    offsets = 1.5 * rng.normal(size=(D, d)) / np.sqrt(d) * 3
    h_fit, y_fit = shifted_face(rng, W, 2, offsets)
    h_new, y_new = shifted_face(rng, W, 40, offsets)
    b = np.zeros(D)
    target = {"precision": P}
    plain = norm_thresholds(dense_chunks(h_fit @ W.T, 16), y_fit, D, target)
    rows, adapted = row_adapt.thresholds(h_fit, y_fit, W, b, 0.5, target)

    def judge(Wx, t):
        z = h_new @ np.asarray(Wx, np.float64).T  # [n, D]
        match = z >= t
        tp = match[np.arange(len(y_new)), y_new].sum()
        return tp / len(y_new), tp / max(match.sum(), 1)

    r0, p0 = judge(W, plain)
    r1, p1 = judge(rows[0:D], adapted)
    assert r1 > r0 + 0.1, (r0, r1)
    assert p1 >= P - 0.02, p1
