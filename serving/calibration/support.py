"""What a calibration split can show: the precisions its images support with 95% confidence, and the
recall each gives (docs/calibration.md, "What the calibration images can show"). numpy only.

A threshold's precision on the calibration split is a count, k matches of which tp are true; with
few images, a high count ratio is weak evidence. The rule: precision p is *shown* at a threshold when
the one-sided Clopper-Pearson lower bound at 95% confidence on its precision, tp out of k, is at
least p. With no false match that bound is 0.05^(1/k), so showing p takes at least
ln(0.05) / ln(p) matches (299 for 0.99, 149 for 0.98, 59 for 0.95, 29 for 0.9), and n images, n
true pairs, can show at most 0.05^(1/n) whatever the thresholds. The figures are read off the
pooled column: one threshold over every (image, class) pair, as the global rule cuts it; a
per-class claim would need the same counts per class. Matches are counted as independent trials
(an image's D pairs are not quite: the same approximation as the cross-validated choice's).

The binomial tail is the regularized incomplete beta function, by its continued fraction (Lentz),
and each bound a bisection on it: no scipy in a server install.
"""
from __future__ import annotations

import math

import numpy as np

from serving.calibration.chunks import Chunks, Logits, chunk_classes, head_chunks
from serving.calibration.counts import PooledThreshold, check_target

CONFIDENCE = 0.95
PRECISIONS = (0.9, 0.95, 0.98, 0.99)  # the trade-off reported beside the target
USEFUL_RECALL = 0.5  # a target shown only below this recall is reported as not supported
_TINY, _EPS, _MAX_TERMS = 1e-300, 1e-15, 100_000


def _betacf(a: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The continued fraction of the incomplete beta function (Numerical Recipes' betacf), elementwise;
    it converges in O(sqrt(max(a, b))) terms for x < (a + 1) / (a + b + 2)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = np.ones_like(x)
    d = 1.0 - qab * x / qap
    d = 1.0 / np.where(np.abs(d) < _TINY, _TINY, d)
    h = d.copy()
    live = np.ones(x.shape, dtype=bool)
    for m in range(1, _MAX_TERMS):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / np.where(np.abs(d) < _TINY, _TINY, d)
            c = 1.0 + aa / c
            c = np.where(np.abs(c) < _TINY, _TINY, c)
            step = d * c
            h = np.where(live, h * step, h)
        live &= np.abs(step - 1.0) > _EPS
        if not live.any():
            return h
    raise ArithmeticError("the incomplete beta's continued fraction did not converge")  # pragma: no cover


_LGAMMA = np.vectorize(math.lgamma, otypes=[float])


def betainc(a, b, x) -> np.ndarray:
    """The regularized incomplete beta function I_x(a, b), a, b > 0, 0 <= x <= 1, elementwise."""
    a, b, x = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (a, b, x)))
    out = np.where(x >= 1.0, 1.0, 0.0)
    inside = (x > 0.0) & (x < 1.0)
    if not inside.any():
        return out
    a_, b_, x_ = a[inside], b[inside], x[inside]
    swap = x_ >= (a_ + 1.0) / (a_ + b_ + 2.0)  # the fraction converges on the other side: I_x(a,b) = 1 - I_{1-x}(b,a)
    a2, b2, x2 = np.where(swap, b_, a_), np.where(swap, a_, b_), np.where(swap, 1.0 - x_, x_)
    log_front = _LGAMMA(a2 + b2) - _LGAMMA(a2) - _LGAMMA(b2) + a2 * np.log(x2) + b2 * np.log1p(-x2)
    value = np.exp(log_front) * _betacf(a2, b2, x2) / a2
    out[inside] = np.clip(np.where(swap, 1.0 - value, value), 0.0, 1.0)
    return out


def binom_cdf(f, k, q) -> np.ndarray:
    """P(X <= f) for X ~ Binomial(k, q), elementwise: I_{1-q}(k - f, f + 1) for 0 <= f < k."""
    f, k, q = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (f, k, q)))
    out = np.where(f >= k, 1.0, 0.0)
    mid = (f >= 0) & (f < k)
    if mid.any():
        out[mid] = betainc(k[mid] - f[mid], f[mid] + 1.0, 1.0 - q[mid])
    return out


def _bisect(tail, lo: np.ndarray, hi: np.ndarray, level: float, iterations: int = 60) -> np.ndarray:
    """The p in [lo, hi] where the increasing `tail(p)` crosses `level`, elementwise."""
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        above = tail(mid) > level
        hi, lo = np.where(above, mid, hi), np.where(above, lo, mid)
    return 0.5 * (lo + hi)


def lower_bound(x, n, confidence: float = CONFIDENCE) -> np.ndarray:
    """The one-sided Clopper-Pearson lower bound on a proportion, x successes of n: the p at which
    P(X >= x) = 1 - confidence (0 when x = 0)."""
    x, n = np.broadcast_arrays(np.asarray(x, dtype=np.float64), np.asarray(n, dtype=np.float64))
    p = _bisect(lambda p: 1.0 - binom_cdf(x - 1.0, n, p), np.zeros(x.shape), np.ones(x.shape), 1.0 - confidence)
    return np.where(x <= 0, 0.0, p)


def upper_bound(x, n, confidence: float = CONFIDENCE) -> np.ndarray:
    """The one-sided Clopper-Pearson upper bound: the p at which P(X <= x) = 1 - confidence (1 when x = n)."""
    x, n = np.broadcast_arrays(np.asarray(x, dtype=np.float64), np.asarray(n, dtype=np.float64))
    p = _bisect(lambda p: -binom_cdf(x, n, p), np.zeros(x.shape), np.ones(x.shape), -(1.0 - confidence))
    return np.where(x >= n, 1.0, p)


def interval(x: int, n: int, confidence: float = CONFIDENCE) -> list[float]:
    """The two-sided Clopper-Pearson interval of x successes of n ([0, 1] when n = 0)."""
    if n <= 0:
        return [0.0, 1.0]
    one_sided = 1.0 - (1.0 - confidence) / 2
    return [float(lower_bound(x, n, one_sided)), float(upper_bound(x, n, one_sided))]


def matches_needed(p: float, confidence: float = CONFIDENCE) -> int:
    """The fewest matches, none false, whose lower bound reaches p: ln(1 - confidence) / ln(p)."""
    return math.ceil(math.log(1.0 - confidence) / math.log(p) - 1e-9)


def pooled_cuts(logits: Logits) -> dict[str, np.ndarray]:
    """Every candidate cut of the pooled column, highest threshold first: threshold, true matches
    (tp) and matches [K]; two passes over the chunks, O(N) memory (counts.PooledThreshold)."""
    pooled = PooledThreshold(logits.true)
    if not np.isfinite(pooled.true).all():
        raise ValueError("calibration logits contain NaN or inf")
    for _, z in logits:
        pooled.add(z)
    u, accepted = pooled.u[::-1], pooled.accepted[::-1]  # [K] descending
    tp = len(pooled.true) - np.searchsorted(pooled.true, u, side="left")
    return {"threshold": u, "tp": tp.astype(np.int64), "matches": accepted.astype(np.int64),
            "positives": len(logits.y)}


def _frontier(cuts: dict) -> np.ndarray:
    """The cuts worth a bound: the last before each new false match (the most true ones for as many false)."""
    false = cuts["matches"] - cuts["tp"]  # [K] non-decreasing
    return np.flatnonzero(np.append(false[1:] > false[:-1], True))


def _shown_cut(cuts: dict, idx: np.ndarray, p: float, confidence: float) -> int | None:
    """The frontier cut of highest recall whose lower bound on precision reaches p, or None."""
    tp, k = cuts["tp"][idx], cuts["matches"][idx]
    maybe = tp >= p * k  # the bound never exceeds the ratio
    if not maybe.any():
        return None
    ok = np.zeros(len(idx), dtype=bool)
    ok[maybe] = binom_cdf(k[maybe] - tp[maybe], k[maybe], 1.0 - p) <= 1.0 - confidence
    return int(idx[np.flatnonzero(ok)[-1]]) if ok.any() else None


def _most_shown(cuts: dict, idx: np.ndarray, confidence: float) -> float:
    """The highest lower bound on precision any threshold gives (0.05^(1/n) at most)."""
    tp, k = cuts["tp"][idx], cuts["matches"][idx]
    first = float(lower_bound(tp[0], k[0], confidence))  # the highest cut with no false match beyond it
    look = tp > first * k  # only a higher ratio can give a higher bound
    return max(first, float(lower_bound(tp[look], k[look], confidence).max(initial=0.0)))


def tradeoff_entry(cuts: dict, idx: np.ndarray, p: float, confidence: float) -> dict:
    """Precision p: shown or not, and at the cut of highest recall that shows it, its recall with an interval."""
    n = cuts["positives"]
    at = _shown_cut(cuts, idx, p, confidence)
    if at is None:
        return {"precision": p, "shown": False, "recall": 0.0, "matches_needed": matches_needed(p, confidence)}
    tp, k = int(cuts["tp"][at]), int(cuts["matches"][at])
    return {"precision": p, "shown": True, "recall": tp / n, "recall_interval": interval(tp, n, confidence),
            "threshold": float(cuts["threshold"][at]), "matches": k, "false_matches": k - tp,
            "precision_lower_bound": float(lower_bound(tp, k, confidence)),
            "matches_needed": matches_needed(p, confidence)}


def support(chunks: Chunks, y: np.ndarray, num_classes: int, target: dict, confidence: float = CONFIDENCE,
            precisions: tuple[float, ...] = PRECISIONS) -> dict:
    """calibration.json's `support`: what the images can show (the module's rule), the trade-off over
    `precisions` and the target's, and the highest of them shown at a useful recall."""
    kind, value = check_target(target)
    cuts = pooled_cuts(Logits(chunks, y, num_classes).checked())
    idx = _frontier(cuts)
    ps = sorted(set(precisions) | ({value} if kind == "precision" else set()))
    table = [tradeoff_entry(cuts, idx, p, confidence) for p in ps]
    useful = [e["precision"] for e in table if e["shown"] and e["recall"] >= USEFUL_RECALL]
    out = {"rule": "one-sided Clopper-Pearson lower bound on pooled precision (docs/calibration.md)",
           "confidence": confidence, "images": int(cuts["positives"]),
           "most_shown_precision": _most_shown(cuts, idx, confidence), "useful_recall": USEFUL_RECALL,
           "tradeoff": table, "suggested_precision": max(useful) if useful else None}
    if kind == "precision":
        mine = next(e for e in table if e["precision"] == value)
        out["target_precision"] = value
        out["target_supported"] = bool(mine["shown"] and mine["recall"] >= USEFUL_RECALL)
    return out


def head_support(h: np.ndarray, y: np.ndarray, weight, bias: np.ndarray, target: dict) -> dict:
    """`support` of images h [n, d] of classes y [n] at the rows weight [D, d], bias [D] (the logits W·h + b
    in class chunks): what they can show at the rows the thresholds are for."""
    return support(head_chunks(h, weight, bias, chunk_classes(len(y), len(weight))), y, len(weight), target)


def support_line(sup: dict, choose: str) -> str | None:
    """One line when the precision target is not shown at a useful recall: the trade-off and the command
    to choose another (`choose` holds {p}); None otherwise."""
    if sup.get("target_supported", True):
        return None
    target = sup["target_precision"]
    mine = next(e for e in sup["tradeoff"] if e["precision"] == target)
    why = (f"shown only at recall {mine['recall']:.2f}" if mine["shown"] else
           f"that takes {mine['matches_needed']:,} matches with no false one")
    shown = "; ".join(f"{e['precision']:g} at recall {e['recall']:.2f} [{e['recall_interval'][0]:.2f}, "
                      f"{e['recall_interval'][1]:.2f}]" for e in sup["tradeoff"] if e["shown"])
    unshown = [f"{e['precision']:g}" for e in sup["tradeoff"] if not e["shown"]]
    rows = (f"one threshold shows {shown}" + (f"; {', '.join(unshown)} not shown" if unshown else "") if shown
            else f"no threshold shows {', '.join(unshown[:-1])} or {unshown[-1]}" if len(unshown) > 1
            else f"no threshold shows {unshown[0]}")
    best = sup["suggested_precision"]
    pick = (f"to choose: {choose.format(p=f'{best:g}')}" if best else
            f"none at recall {sup['useful_recall']:g} or more: more calibration images would show more" if shown
            else "more calibration images would show more")
    return (f"warning: precision {target:g} is not shown by {sup['images']:,} calibration images at "
            f"{sup['confidence']:.0%} confidence ({why}; they show at most {sup['most_shown_precision']:.3f}); "
            f"{rows} (docs/calibration.md); {pick}")
