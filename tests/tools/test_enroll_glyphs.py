"""The enrollment study's arithmetic (tools/experiments/enroll_glyphs.py) against a brute-force count
of every (image, class) decision."""
import numpy as np

from tools.experiments.enroll_glyphs import decisions, nearest_example, summary


def test_decisions_and_summary_equal_a_brute_force_count():
    rng = np.random.default_rng(0)
    h, w, b = rng.standard_normal((300, 8)), rng.standard_normal((12, 8)), rng.standard_normal(12)
    labels = rng.integers(-1, 12, size=300)  # -1: a class the head does not hold
    thr = rng.standard_normal(12) + 1.0
    d = decisions(h, labels, w, b, thr)
    z = h @ w.T + b
    hit = z >= thr
    for c in range(12):
        assert d["matches"][c] == hit[:, c].sum()
        assert d["tp"][c] == (hit[:, c] & (labels == c)).sum()
    assert (d["top1"] == z.argmax(axis=1)).all()
    s = summary(d, labels, np.arange(6))
    tp = np.array([(hit[:, c] & (labels == c)).sum() for c in range(6)])
    m = hit[:, :6].sum(axis=0)
    pos = np.array([(labels == c).sum() for c in range(6)])
    assert np.isclose(s["recall"], np.mean(tp / pos))
    assert np.isclose(s["precision"], np.mean([t / k if k else 1.0 for t, k in zip(tp, m)]))
    assert np.isclose(s["pooled_precision"], tp.sum() / m.sum()) and s["false_matches"] == m.sum() - tp.sum()
    mine = np.isin(labels, np.arange(6))
    assert np.isclose(s["top1"], np.mean(z.argmax(axis=1)[mine] == labels[mine]))


def test_nearest_example_is_the_largest_cosine():
    rng = np.random.default_rng(1)
    items, q = rng.standard_normal((20, 5)), rng.standard_normal((50, 5))
    y_items, y_q = rng.integers(0, 4, 20), rng.integers(0, 4, 50)
    cos = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (items / np.linalg.norm(items, axis=1, keepdims=True)).T
    assert np.isclose(nearest_example(q, y_q, items, y_items), np.mean(y_items[cos.argmax(axis=1)] == y_q))
