"""The transfer study's chunked fit and judge (tools/experiments/threshold_transfer.py) equal the dense
estimators of trainer/calibrate.py and a brute-force count."""
import numpy as np

from tools.experiments import threshold_transfer as tt
from trainer.calibrate import choose_thresholds


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
