"""The norm rule: each class's logits standardised by its own negative tail, one threshold on the
standardised scale, chosen on scores the standardisation never saw.

Why: on a face the model separates poorly, the columns differ. A confusable class has high
negatives, a distinctive one low, so one raw threshold is too strict for most classes, and
per-class rules read off few positives (or extrapolate each tail alone, as the tail rule does) are
noisy or conservative. Standardising column j by the mean mu_j and spread sd_j of its NORM_K highest
negatives puts every column's negative tail on one scale; a single threshold tau there is then
chosen like the global one, over all D columns pooled. So each class gets its own threshold
t_j = mu_j + sd_j tau, while tau rests on every (example, class) pair (docs/calibration.md, "The
norm rule").

tau is cross-fitted: the examples are split in two halves (each class's images dealt in turn);
each half's scores are standardised with the other half's (mu, sd) and tau is chosen there, and the
two choices are averaged. Chosen on the same negatives that set (mu, sd), tau would see tails
lighter than fresh images have, and precision on new images would fall short of the target.
numpy only.
"""
from __future__ import annotations

import numpy as np

from serving.calibration.chunks import Chunks, Logits
from serving.calibration.counts import PooledThreshold, check_target
from serving.calibration.defaults import NORM_K

SEED = 0
MIN_SD = 1e-6  # a column whose top negatives are all equal keeps a finite scale


def halves(y: np.ndarray, seed: int = SEED) -> list[np.ndarray]:
    """Two row sets: the examples sorted by class (shuffled within, seeded) and dealt out in turn, so
    every class is split evenly (to one) and the halves differ in size by at most one."""
    y = np.asarray(y, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    order = order[np.argsort(y[order], kind="stable")]  # by class, shuffled within
    return [np.sort(order[h::2]) for h in (0, 1)]


def top_stats(z: np.ndarray, positive: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean [c], spread [c], count [c]) of each column's k highest negatives (fewer if it has fewer)."""
    n = z.shape[0]
    neg = np.where(positive, -np.inf, z)  # [n, c]
    kk = max(1, min(k, n))
    top = np.partition(neg, n - kk, axis=0)[n - kk:] if n else np.full((1, z.shape[1]), -np.inf)  # [kk, c]
    finite = np.isfinite(top)
    m = finite.sum(axis=0)  # [c]
    mu = np.where(finite, top, 0).sum(axis=0) / np.maximum(m, 1)
    var = np.where(finite, (top - mu) ** 2, 0).sum(axis=0) / np.maximum(m, 1)
    sd = np.where(m >= 2, np.maximum(np.sqrt(var), MIN_SD), 1.0)  # under 2 negatives: no spread to read
    return mu, sd, m


def _half_k(k: int, rows: int, n: int) -> int:
    return max(2, round(k * rows / max(n, 1)))


def _stats_pass(logits: Logits, row_sets: list[np.ndarray], k: int):
    """(mu, sd, count) [D] on all rows, and (mu, sd) [D] on each half's rows, plus the lowest positive and
    the highest score per column: one pass."""
    n = len(logits.y)
    full, parts, low, high = [], [[] for _ in row_sets], [], []
    for first, z in logits:
        positive = logits.positive(first, z.shape[1])  # [N, c]
        full.append(top_stats(z, positive, k))
        for part, rows in zip(parts, row_sets):
            part.append(top_stats(z[rows], positive[rows], _half_k(k, len(rows), n))[:2])
        low.append(np.where(positive, z, np.inf).min(axis=0))
        high.append(z.max(axis=0))
    cat = lambda items: tuple(np.concatenate(a) for a in zip(*items))  # noqa: E731
    return cat(full), [cat(p) for p in parts], np.concatenate(low), np.concatenate(high)


def _taus(logits: Logits, true: np.ndarray, row_sets: list[np.ndarray], other: list[tuple], target: dict,
          groups: np.ndarray | None = None) -> list[dict]:
    """Per half, the pooled choice (threshold, precision, recall) on its standardised scores, with
    (mu, sd) [D] of the other half: one pass. With `groups` [N], tau is chosen per group of each
    half and the half takes the highest (the target holds on every group, not only pooled)."""
    if groups is not None:
        return _group_taus(logits, true, row_sets, other, target, groups)
    y = logits.y
    pooled = [PooledThreshold((true[rows] - mu[y[rows]]) / sd[y[rows]])  # [n_h] standardised own logits
              for rows, (mu, sd) in zip(row_sets, other)]
    for first, z in logits:
        cols = slice(first, first + z.shape[1])
        for p, rows, (mu, sd) in zip(pooled, row_sets, other):
            p.add((z[rows] - mu[cols]) / sd[cols])  # [n_h, c]
    return [{key: float(v[0]) for key, v in p.choose(target).items() if key in ("threshold", "precision", "recall")}
            for p in pooled]


def _group_taus(logits: Logits, true: np.ndarray, row_sets: list[np.ndarray], other: list[tuple], target: dict,
                groups: np.ndarray) -> list[dict]:
    """_taus per (half, group), one pass; each half's threshold the highest of its groups', its recall
    that of group 0 (the user's images) there, its precision the lowest of its groups' own."""
    y = logits.y
    subsets, stats, owner = [], [], []
    for h, (rows, st) in enumerate(zip(row_sets, other)):
        for g in np.unique(groups[rows]):
            subsets.append(rows[groups[rows] == g])
            stats.append(st)
            owner.append(h)
    choices = _taus(logits, true, subsets, stats, target)
    out = []
    for h, (rows, (mu, sd)) in enumerate(zip(row_sets, other)):
        mine = [c for c, o in zip(choices, owner) if o == h]
        tau = max(c["threshold"] for c in mine)
        first = rows[groups[rows] == groups[rows].min()]
        own = (true[first] - mu[y[first]]) / sd[y[first]]  # [n_g] standardised
        out.append({"threshold": tau, "precision": min(c["precision"] for c in mine),
                    "recall": float(np.mean(own >= tau)) if len(own) else 0.0, "groups": mine})
    return out


def cross_choices(cross: list[Logits], parts: list[np.ndarray], k: int, target: dict,
                  groups: np.ndarray | None = None) -> list[dict]:
    """Half h's choice on the logits cross[h] (say, under a head adapted on the other half's images):
    (mu, sd) from the other half's rows there, h's rows scored there. Three passes per half."""
    out = []
    for h, logits in enumerate(cross):
        _, (other,), _, _ = _stats_pass(logits, [parts[1 - h]], k)
        out += _taus(logits, logits.true, [parts[h]], [other], target, groups)
    return out


class CrossFit(list):
    """A `cross` argument (per half, the Chunks its tau is chosen on) that also names the halves
    (`parts`, default halves(y)) and, optionally, `groups` [N] of the examples, tau chosen per group
    and the highest taken (keep.py: the user's images and the bundle's own)."""

    def __init__(self, chunks: list, parts: list[np.ndarray] | None = None, groups: np.ndarray | None = None):
        super().__init__(chunks)
        self.parts, self.groups = parts, groups


def norm_thresholds(chunks: Chunks, y: np.ndarray, num_classes: int, target: dict, bar=None,
                    k: int = NORM_K, cross: list[Chunks] | None = None, record: dict | None = None) -> np.ndarray:
    """thresholds() of the logits `chunks` of examples of classes y [N] over `num_classes` classes."""
    return thresholds(Logits(chunks, y, num_classes, bar), target, k, cross, record)


def thresholds(logits: Logits, target: dict, k: int = NORM_K, cross: list[Chunks] | None = None,
               record: dict | None = None) -> np.ndarray:
    """The norm rule's thresholds [D] (float64) from logits in class chunks: three passes (the true
    logits, unless read already; the column statistics; the cross-fitted tau). A class with no positive
    never matches (as everywhere); one with under 2 negatives matches above its highest negative, or from
    its lowest positive if it has none. `cross`: per half, the logits its tau is chosen on, where they are
    not `logits` (adapt.py: each half judged by a head the other half adapted; a CrossFit also names the
    halves and groups); `record`, if given, receives each half's choice."""
    check_target(target)
    y = logits.y
    parts = getattr(cross, "parts", None) or halves(y)
    if min(len(rows) for rows in parts) == 0:
        raise ValueError("the norm rule needs at least 2 images")
    true = logits.true
    (mu, sd, m), half_stats, low, high = _stats_pass(logits, parts, k)
    if cross is None:
        choices = _taus(logits, true, parts, half_stats[::-1], target)
    else:
        choices = cross_choices([Logits(c, y, logits.num_classes, logits.bar) for c in cross], parts, k, target,
                                getattr(cross, "groups", None))
    if record is not None:
        record["halves"] = choices
    tau = float(np.mean([c["threshold"] for c in choices]))
    t = mu + sd * tau
    t = np.where(m < 2, np.nextafter(mu.astype(np.float32), np.float32(np.inf)).astype(np.float64), t)
    t = np.where(m == 0, low, t)
    none = np.bincount(y, minlength=logits.num_classes) == 0
    t[none] = np.nextafter(high[none].astype(np.float32), np.float32(np.inf))
    return t
