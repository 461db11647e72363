"""What a calibration split can show (serving/calibration/support.py, docs/calibration.md): the
binomial tail and the Clopper-Pearson bounds against brute-force sums in exact rational arithmetic,
the zero-false-match closed form, and the support record against a brute-force scan of every
threshold of a small pooled column; the export's and `slc calibrate`'s one line on a tiny case."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from serving.calibration import support as S
from serving.calibration.chunks import dense_chunks


def brute_cdf(f: int, k: int, q) -> float:
    """P(X <= f), X ~ Binomial(k, q), the pmf summed term by term (exactly, for a Fraction q)."""
    return sum((math.comb(k, i) * q ** i * (1 - q) ** (k - i) for i in range(0, min(f, k) + 1)), 0 * q)


def brute_lower(x: int, n: int, confidence: float = 0.95, steps: int = 50) -> float:
    """The p where P(X >= x) = 1 - confidence, by bisection on the summed tail."""
    if x == 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if 1 - brute_cdf(x - 1, n, mid) > 1 - confidence else (mid, hi)
    return (lo + hi) / 2


@pytest.mark.parametrize("k", [1, 2, 7, 30, 61])
def test_the_binomial_tail_is_the_exact_sum(k):
    rng = np.random.default_rng(k)
    for q in (Fraction(1, 100), Fraction(1, 3), Fraction(9, 10), Fraction(int(rng.integers(1, 999)), 1000)):
        for f in range(-1, k + 2):
            assert S.binom_cdf(f, k, float(q)) == pytest.approx(float(brute_cdf(max(f, -1), k, q)) if f >= 0 else 0.0,
                                                                abs=1e-12), (f, k, q)


@pytest.mark.parametrize("x, n", [(1, 1), (5, 5), (29, 29), (59, 60), (40, 50), (3, 20), (0, 10), (120, 121)])
def test_the_lower_bound_is_the_brute_force_bisection(x, n):
    assert S.lower_bound(x, n) == pytest.approx(brute_lower(x, n), abs=1e-9)


def test_no_false_match_gives_the_closed_form_and_the_matches_needed():
    for k in (1, 29, 59, 60, 149, 299, 1000):
        assert S.lower_bound(k, k) == pytest.approx(0.05 ** (1 / k), abs=1e-12)
    assert [S.matches_needed(p) for p in (0.9, 0.95, 0.98, 0.99)] == [29, 59, 149, 299]
    for p in (0.9, 0.95, 0.98, 0.99):  # the fewest: one fewer does not show p
        m = S.matches_needed(p)
        assert S.lower_bound(m, m) >= p > S.lower_bound(m - 1, m - 1)


def test_the_bounds_agree_with_scipy_where_it_is_installed():
    stats = pytest.importorskip("scipy.stats")
    x, n = np.array([1, 7, 50, 300, 9000]), np.array([3, 7, 80, 310, 10000])
    np.testing.assert_allclose(S.lower_bound(x, n), stats.beta.ppf(0.05, x, n - x + 1), atol=1e-9)
    np.testing.assert_allclose(S.upper_bound(x, n), np.where(x < n, stats.beta.ppf(0.95, x + 1, np.maximum(n - x, 1)), 1),
                               atol=1e-9)
    lo, hi = S.interval(45, 60)
    assert (lo, hi) == pytest.approx((stats.beta.ppf(0.025, 45, 16), stats.beta.ppf(0.975, 46, 15)), abs=1e-9)


def _column(seed: int, n: int = 60, d: int = 10, sep: float = 2.5):
    """Logits [n, d] and labels of n images: the own class's logit shifted up by `sep`."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % d
    z = rng.standard_normal((n, d))
    z[np.arange(n), y] += sep
    return z, y


def brute_tradeoff(z: np.ndarray, y: np.ndarray, p: float) -> tuple[bool, float]:
    """(shown, recall): every distinct pooled score as a threshold, shown where the summed tail
    P(X >= tp | k matches, p) is at most 0.05 (the lower bound is then at least p)."""
    pos = np.zeros(z.shape, dtype=bool)
    pos[np.arange(len(y)), y] = True
    best = None
    for t in np.unique(z):
        match = z >= t
        tp, k = int((match & pos).sum()), int(match.sum())
        if tp >= p * k and 1 - brute_cdf(tp - 1, k, p) <= 0.05 and (best is None or tp > best):
            best = tp
    return best is not None, (best or 0) / len(y)


@pytest.mark.parametrize("seed, sep", [(0, 2.5), (1, 4.0), (2, 6.0)])
def test_the_tradeoff_is_a_brute_force_scan_of_every_threshold(seed, sep):
    z, y = _column(seed, n=40, d=6, sep=sep)
    sup = S.support(dense_chunks(z, 4), y, 6, {"precision": 0.99}, precisions=(0.8, 0.9, 0.95))
    assert sup["images"] == 40 and sup["most_shown_precision"] <= 0.05 ** (1 / 40) + 1e-12
    for e in sup["tradeoff"]:
        shown, recall = brute_tradeoff(z, y, e["precision"])
        assert (e["shown"], e["recall"]) == (shown, pytest.approx(recall)), e
        if shown:
            assert e["precision_lower_bound"] >= e["precision"]
            lo, hi = e["recall_interval"]
            assert lo <= e["recall"] <= hi
    assert sup["tradeoff"][-1]["precision"] == 0.99 and not sup["tradeoff"][-1]["shown"]  # 40 < 299
    assert sup["target_supported"] is False


def test_perfectly_separated_images_show_the_closed_form_and_the_target_when_there_are_enough():
    z, y = _column(0, n=400, d=10, sep=50.0)
    sup = S.support(dense_chunks(z, 3), y, 10, {"precision": 0.99})
    assert sup["most_shown_precision"] == pytest.approx(0.05 ** (1 / 400))
    assert all(e["shown"] and e["recall"] == 1.0 and e["false_matches"] == 0 for e in sup["tradeoff"])
    assert sup["target_supported"] and sup["suggested_precision"] == 0.99
    assert S.support_line(sup, "x {p}") is None


def test_sixty_images_cannot_show_0_99_and_the_line_says_what_they_can():
    """The issue's case: about 60 calibration images of 10 classes, a target of 0.99."""
    z, y = _column(3, n=60, d=10, sep=6.0)
    sup = S.support(dense_chunks(z, 10), y, 10, {"precision": 0.99})
    by = {e["precision"]: e for e in sup["tradeoff"]}
    assert not by[0.99]["shown"] and not by[0.98]["shown"] and by[0.9]["shown"]
    assert sup["suggested_precision"] in (0.9, 0.95) and not sup["target_supported"]
    line = S.support_line(sup, "slc export RUN --out B --overwrite --target-precision {p}")
    assert line.startswith("warning: precision 0.99 is not shown by 60 calibration images at 95% confidence")
    assert "that takes 299 matches with no false one" in line
    unshown = ", ".join(f"{p:g}" for p in S.PRECISIONS if not by[p]["shown"])
    assert f"; {unshown} not shown (docs/calibration.md)" in line and unshown.endswith("0.98, 0.99")
    assert f"one threshold shows 0.9 at recall {by[0.9]['recall']:.2f} [" in line
    assert line.endswith(f"to choose: slc export RUN --out B --overwrite --target-precision {sup['suggested_precision']:g}")
    assert "\n" not in line


def test_images_that_show_no_target_say_so_once():
    """Too few images for any of the precisions: one clause naming them all, and no command to choose."""
    z, y = _column(5, n=12, d=10, sep=0.5)
    sup = S.support(dense_chunks(z, 10), y, 10, {"precision": 0.99})
    assert not any(e["shown"] for e in sup["tradeoff"]) and sup["suggested_precision"] is None
    line = S.support_line(sup, "x {p}")
    names = [f"{p:g}" for p in S.PRECISIONS]
    assert f"no threshold shows {', '.join(names[:-1])} or {names[-1]} (docs/calibration.md)" in line
    tail = line.split("; they show at most", 1)[1]
    assert "one threshold shows" not in tail and "not shown" not in tail and "x " not in tail
    assert line.endswith("more calibration images would show more")


def test_a_recall_target_is_recorded_without_a_line():
    z, y = _column(4)
    sup = S.support(dense_chunks(z, 10), y, 10, {"recall": 0.9})
    assert "target_supported" not in sup and S.support_line(sup, "{p}") is None
    assert [e["precision"] for e in sup["tradeoff"]] == list(S.PRECISIONS)
