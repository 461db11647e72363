"""Row adaptation that does not forget (serving/calibration/keep.py) against independent truth: each
row's bounded step from a per-class float64 loop over candidate steps, the thresholds from dense
per-column statistics with tau chosen per set and the higher taken, and on fresh draws of two faces
(one the bundle was calibrated on, one the user brings) what each face keeps."""
from __future__ import annotations

import numpy as np
import pytest

from tests.serving.calibration.test_adapt import reference_rows
from tests.serving.calibration.test_norm import column_stats
from serving.calibration import adapt as row_adapt
from serving.calibration import keep
from serving.calibration.counts import choose_thresholds
from serving.calibration.defaults import KEEP_FRACTIONS, NORM_K
from serving.calibration.norm import halves

P = 0.99


def reference_steps(W, b, h, y, beta, kh, ky, tau, k) -> np.ndarray:
    """Class by class, candidate by candidate: the whole moved head's column, standardised by its k
    highest kept negatives (sorted), and the count of kept positives at or above tau."""
    D = len(W)
    ids = np.unique(y)
    out = []
    for j in ids:
        def passing(f):
            row = reference_rows(W, h, y, f * beta)[j]  # only row j matters for column j
            z = kh @ row + b[j]  # [m]
            neg = np.sort(z[ky != j])[::-1][:k]
            sd = neg.std() if len(neg) >= 2 else 1.0
            return int(np.sum((ky == j) & ((z - neg.mean()) / max(sd, 1e-6) >= tau)))
        before = passing(0.0)
        out.append(max(f for f in KEEP_FRACTIONS if passing(f) >= before) * beta)
    assert len(ids) <= D
    return np.array(out)


def two_faces(seed: int, D: int = 40, d: int = 48):
    """A head, and draws of two faces: the old one (the bundle's calibration face: positives along
    their own rows) and a new one, on which a third of the classes look like another class's old
    images. Moving such a row toward its new images makes it match that other class's old ones."""
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(D, d))
    unit = W / np.linalg.norm(W, axis=1, keepdims=True)
    other, confused = rng.permutation(D), rng.random(D) < 1 / 3

    def old(per):
        y = np.repeat(np.arange(D), per)
        return 3 * unit[y] + 0.15 * rng.normal(size=(len(y), d)), y

    def new(per):
        y = np.repeat(np.arange(D), per)
        v = np.where(confused[y, None], 2.5 * unit[other[y]], 0.0)
        return 1.2 * unit[y] + v + 0.15 * rng.normal(size=(len(y), d)), y

    return W, np.zeros(D), old, new, confused


def test_each_rows_step_equals_the_per_class_loop():
    rng = np.random.default_rng(0)
    W, b, old, new, _ = two_faces(0)
    kh, ky = old(3)
    h, y = new(2)
    b = rng.normal(scale=0.1, size=len(W))
    for tau in (-1.0, 2.0, 6.0):
        ids, dirs = row_adapt.directions(h, y)
        got = keep.row_steps(W, b, ids, dirs, 0.5, kh, ky, tau, k=7)
        np.testing.assert_allclose(got, reference_steps(W, b, h, y, 0.5, kh, ky, tau, 7), atol=1e-12)


def test_a_row_that_would_forget_is_held_back_and_the_others_move():
    W, b, old, new, confused = two_faces(1)
    kh, ky = old(5)
    h, y = new(2)
    kept = keep.kept_examples(kh, ky, W, b, {"precision": P})
    rows = keep.adapt(W, b, h, y, 1.0, kept.h, kept.y, kept.tau)
    steps = rows.steps.ravel()
    assert steps[~confused].mean() > 0.9, steps[~confused]
    assert steps[confused].mean() < steps[~confused].mean() - 0.3, (steps[confused], steps[~confused])
    # the moved rows are adapt.py's with each row's own step
    for j in range(len(W)):
        want = reference_rows(W, h[y == j], y[y == j], 0.0)[j]  # unmoved
        direction = h[y == j].mean(axis=0) - h.mean(axis=0)
        want = want + steps[j] * np.linalg.norm(W[j]) * direction / np.linalg.norm(direction)
        np.testing.assert_allclose(rows[j:j + 1][0], want, rtol=1e-5, atol=1e-5)


def reference_kept_thresholds(h, y, W, b, beta, target, kept, k=NORM_K) -> np.ndarray:
    """Dense: each half (dealt per set) standardised and scored under rows adapted on the other half's
    user images and bounded by its kept ones; tau per set by the dense estimator, the higher per half;
    the mean tau on the statistics of the union under all-image rows."""
    hu, yu = np.concatenate([h, kept.h]), np.concatenate([y, kept.y])
    n, D = len(yu), len(W)
    user, kp = halves(y), halves(kept.y)
    parts = [np.concatenate([u, len(y) + m]) for u, m in zip(user, kp)]
    group = np.repeat([0, 1], [len(y), len(kept.y)])
    taus = []
    for h_idx in (0, 1):
        u, m, rows = user[1 - h_idx], kp[1 - h_idx], parts[h_idx]
        kk = max(2, round(k * len(m) / len(kept.y)))
        steps = reference_steps(W, b, h[u], y[u], beta, kept.h[m], kept.y[m], kept.tau, kk)
        Wm = W.astype(np.float64).copy()
        for j, s in zip(np.unique(y[u]), steps):
            Wm[j] = reference_rows(W, h[u], y[u], s)[j]
        z = hu @ Wm.T + b
        mu, sd = column_stats(z, yu, parts[1 - h_idx], max(2, round(k * len(parts[1 - h_idx]) / n)))
        best = []
        for g in (0, 1):
            r = rows[group[rows] == g]
            s = (z[r] - mu) / sd
            positive = yu[r][:, None] == np.arange(D)
            best.append(choose_thresholds(s.reshape(-1, 1), positive.reshape(-1, 1), target)["threshold"][0])
        taus.append(max(best))
    Wm = W.astype(np.float64).copy()
    for j, s in zip(np.unique(y), reference_steps(W, b, h, y, beta, kept.h, kept.y, kept.tau, k)):
        Wm[j] = reference_rows(W, h, y, s)[j]
    mu, sd = column_stats(hu @ Wm.T + b, yu, np.arange(n), k)
    return mu + sd * np.mean(taus)


def test_the_thresholds_equal_a_dense_reference_with_tau_per_set():
    W, b, old, new, _ = two_faces(2, D=25, d=24)
    kh, ky = old(4)
    h, y = new(2)
    target = {"precision": P}
    kept = keep.kept_examples(kh, ky, W, b, target)
    _, got = keep.thresholds(h, y, W, b, 0.5, target, kept)
    np.testing.assert_allclose(got, reference_kept_thresholds(h, y, W, b, 0.5, target, kept), rtol=1e-6, atol=1e-6)


def test_kept_examples_are_a_seeded_sample_and_their_tau_the_norm_rules():
    W, b, old, _, _ = two_faces(3, D=20, d=16)
    kh, ky = old(6)
    a = keep.kept_examples(kh, ky, W, b, {"precision": P}, limit=50)
    again = keep.kept_examples(kh, ky, W, b, {"precision": P}, limit=50)
    assert len(a.y) == 50 and np.array_equal(a.y, again.y) and a.tau == again.tau
    whole = keep.kept_examples(kh, ky, W, b, {"precision": P})
    assert len(whole.y) == len(ky) and np.isfinite(whole.tau)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_on_fresh_draws_the_calibrated_face_keeps_what_plain_adaptation_loses(seed):
    """2 new-face images per class adapt the rows; 40 fresh images per class of each face judge them.
    The old face: plain adaptation (rows and thresholds from the new face alone) loses precision on it;
    kept, its precision holds at the target and it still recalls most of its images. (What the new face gains
    is not claimed here: on this draw a third of its classes look like others, and keeping costs it.)"""
    W, b, old, new, _ = two_faces(seed)
    kh, ky = old(5)
    h, y = new(2)
    h_old, y_old = old(40)
    target = {"precision": P}

    def judge(rows, t, hx, yx):
        z = hx @ np.asarray(rows[0:len(W)], np.float64).T + b
        match = z >= t
        tp = match[np.arange(len(yx)), yx].sum()
        return tp / len(yx), tp / max(match.sum(), 1)

    beta, _ = row_adapt.choose_beta(h, y, W, b, target)
    plain = row_adapt.thresholds(h, y, W, b, beta, target)
    kept = keep.kept_examples(kh, ky, W, b, target)
    beta_k, _ = keep.choose_beta(h, y, W, b, target, kept)
    held = keep.thresholds(h, y, W, b, beta_k, target, kept)
    (r0, p0), (r1, p1) = judge(*plain, h_old, y_old), judge(*held, h_old, y_old)
    assert p1 >= P - 0.005 and p1 > p0, (p0, p1)
    assert r1 >= 0.75, (r0, r1)  # plain recalls 0.70-0.88 here, at its lower precision
