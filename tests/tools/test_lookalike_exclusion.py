"""tools/experiments/lookalike_exclusion.py's rule against a brute-force reading of its docstring,
input by input and class by class."""
import numpy as np

from tools.experiments.lookalike_exclusion import exclusive, figures, lookalikes


def _brute(z, t, zk, tk, near):
    n, D = z.shape
    match, match_k = np.zeros((n, D), bool), np.zeros(n, bool)
    for i in range(n):
        k_yes = zk[i] >= tk
        for c in range(D):
            yes = z[i, c] >= t[c]
            if c in near and yes and k_yes and zk[i] - tk > z[i, c] - t[c]:
                yes = False  # K matches it by a larger margin
            match[i, c] = yes
        match_k[i] = k_yes and not any(z[i, c] >= t[c] and z[i, c] - t[c] > zk[i] - tk for c in near)
    return match, match_k


def test_the_exclusion_is_the_docstrings_rule():
    rng = np.random.default_rng(0)
    for trial in range(30):
        n, D = 40, 6
        z, t = rng.normal(size=(n, D)), rng.normal(scale=0.5, size=D)
        zk, tk = rng.normal(size=n), float(rng.normal(scale=0.5))
        z[0, 1], zk[0] = t[1] + 0.3, tk + 0.3  # an equal margin: neither excludes the other
        near = np.sort(rng.choice(D, size=trial % 4, replace=False)).astype(np.int64)
        got = exclusive(z.copy(), t, zk, tk, near)
        want = _brute(z, t, zk, tk, set(near.tolist()))
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    m, mk = exclusive(z.copy(), t, zk, tk, np.zeros(0, np.int64))  # no look-alike: plain thresholds
    np.testing.assert_array_equal(m, z >= t)
    np.testing.assert_array_equal(mk, zk >= tk)


def test_lookalikes_are_the_matching_and_the_closest_classes():
    t = np.array([0.0, 1.0, 5.0, 2.0])
    z = np.array([[-1.0, 1.5, 0.0, 0.0],   # matches class 1; closest: 1 (0.5)
                  [-0.5, 0.0, 4.9, -3.0]])  # matches none; closest: 2 (-0.1, above -0.5, -1, -5)
    assert lookalikes(z, t, closest=False).tolist() == [1]
    assert lookalikes(z, t, closest=True).tolist() == [1, 2]


def test_figures_count_what_a_loop_counts():
    rng = np.random.default_rng(1)
    n, D = 60, 5
    z, t, zk, tk = rng.normal(size=(n, D)), np.zeros(D), rng.normal(size=n), 0.2
    y = rng.integers(-1, D, size=n)
    near = np.array([0, 3])
    f = figures(z.copy(), t, zk, tk, near, y)
    match, match_k = _brute(z, t, zk, tk, {0, 3})
    k = y < 0
    assert f["k_recall"] == round(match_k[k].mean(), 3) and f["k_false_matches"] == match_k[~k].sum()
    assert f["claims_on_k"] == match[k].sum()
    assert f["trained_recall"] == round(np.mean([match[i, y[i]] for i in range(n) if y[i] >= 0]), 3)
    true = match_k[k].sum() + sum(match[i, y[i]] for i in range(n) if y[i] >= 0)
    assert f["pooled_precision"] == round(true / (match.sum() + match_k.sum()), 3)
