"""The transfer study's chunked fit and judge (tools/experiments/threshold_transfer.py) equal the dense
estimators of serving/calibration/ and a brute-force count."""
import numpy as np
import pytest

from tools.experiments import threshold_transfer as tt
from serving.calibration.counts import choose_thresholds


def test_chunked_fit_and_judge_equal_dense_math(monkeypatch):
    monkeypatch.setattr(tt, "chunk_classes", lambda n, d: 7)  # many chunks, a ragged last one
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(30), 4)  # [120]: 4 positives per class, like the calibration faces
    z = rng.standard_normal((120, 30)).astype(np.float32)
    z[np.arange(120), y] += 2.5
    target = {"precision": 0.9}
    got = tt.fit(z, y, target)
    positive = y[:, None] == np.arange(30)[None, :]
    dense = choose_thresholds(z.astype(np.float64), positive, target)
    np.testing.assert_array_equal(got["per_class"], dense["threshold"])
    pooled = float(choose_thresholds(z.reshape(-1, 1).astype(np.float64), positive.reshape(-1, 1), target)["threshold"][0])
    assert (got["global"] == pooled).all()
    n = positive.sum(axis=0)
    np.testing.assert_allclose(got["shrink k=4"], (n * dense["threshold"] + 4 * pooled) / (n + 4))
    t = got["shrink k=4"]
    j = tt.judge(z, y, t)
    match = z >= t[None, :]
    tp, m = (match & positive).sum(axis=0), match.sum(axis=0)
    assert j["matches"] == m.sum() and np.isclose(j["pooled_precision"], tp.sum() / m.sum())
    assert np.isclose(j["mean_recall"], np.mean(tp / 4))
    assert np.isclose(j["mean_precision"], np.mean([a / b if b else 1.0 for a, b in zip(tp, m)]))
    assert j["top1"] == np.mean([max(range(30), key=lambda c: row[c]) == label for row, label in zip(z, y)])
    from tests.serving.calibration.test_choose import reference_tail

    np.testing.assert_allclose(got["tail"], reference_tail(z.astype(np.float64), y, 0.9), rtol=1e-12)
    from tests.serving.calibration.test_norm import reference_norm

    np.testing.assert_allclose(got["norm"], reference_norm(z.astype(np.float64), y, target), rtol=1e-10)


def test_the_user_rows_fit_on_two_per_class_and_judge_the_rest():
    """Brute force: the sample holds 2 examples of each class; each rule's row is judge() on the
    complement at fit() on the sample; the cv row repeats the row of the rule it names."""
    rng = np.random.default_rng(1)
    y = np.repeat(np.arange(40), 6)
    z = rng.standard_normal((240, 40)).astype(np.float32)
    z[np.arange(240), y] += 3
    pick = tt._per_class_sample(y, 2)
    assert (np.bincount(y[pick], minlength=40) == 2).all()
    rows = tt._user_rows(z, y, 0.9, "F")
    rules = tt.fit(z[pick], y[pick], {"precision": 0.9})
    for row in rows[:-1]:
        assert {k: row[k] for k in ("mean_recall", "mean_precision", "pooled_precision", "matches", "top1")} == \
            tt.judge(z[~pick], y[~pick], rules[row["method"]])
    cv = rows[-1]
    chosen = cv["method"].removeprefix("cv (chose ").removesuffix(")")
    assert {**next(r for r in rows if r["method"] == chosen), "method": cv["method"]} == cv


def test_the_adapted_user_row_moves_the_rows_and_judges_the_rest_with_them():
    """With embeddings: one more row, the rows moved and thresholds set as the dense references do
    (tests/serving/calibration/test_adapt.py) at the step chosen, judged on the complement under the moved rows."""
    from tests.serving.calibration.test_adapt import reference_rows, reference_thresholds, shifted_face
    from serving.calibration import adapt as row_adapt

    rng = np.random.default_rng(2)
    W = rng.normal(size=(30, 12)).astype(np.float32)
    h, y = shifted_face(rng, W, 6, rng.normal(size=(30, 12)))
    b = np.zeros(30)
    z = (h @ W.T + b).astype(np.float32)
    rows = tt._user_rows(z, y, 0.9, "F", (h, W, b))
    assert len(rows) == len(tt._user_rows(z, y, 0.9, "F")) + 1
    pick = tt._per_class_sample(y, 2)
    beta, _ = row_adapt.choose_beta(h[pick], y[pick], W, b, {"precision": 0.9})
    assert rows[-1]["method"] == f"norm, rows adapted (step {beta:g})"
    moved = reference_rows(W, h[pick], y[pick], beta)
    t = reference_thresholds(h[pick], y[pick], W.astype(np.float64), b, beta, {"precision": 0.9})
    want = tt.judge((h[~pick] @ moved.T + b).astype(np.float32), y[~pick], t)
    assert rows[-1]["mean_recall"] == pytest.approx(want["mean_recall"], abs=0.02)
    assert rows[-1]["pooled_precision"] == pytest.approx(want["pooled_precision"], abs=0.02)
    top1 = np.mean([np.argmax(h[i] @ moved.T + b) == y[i] for i in np.flatnonzero(~pick)])  # float64, one by one
    assert rows[-1]["top1"] == pytest.approx(top1, abs=0.01)
    assert rows[0]["top1"] == np.mean(np.argmax(z[~pick], axis=1) == y[~pick])  # thresholds alone: the rows as they were
