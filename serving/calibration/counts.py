"""Choosing a threshold on scores: the cut with the best recall at a precision target (or the best
precision at a recall target), per column or pooled over all (example, class) pairs. numpy only.

Decision rule everywhere: `match = logit >= threshold`.
- target {"precision": p}: among thresholds whose precision reaches p, the one with the
  highest recall (ties: the higher precision); if none reaches p, the most precise one
  (ties: the higher recall), flagged `"reached": false`.
- target {"recall": r}: among thresholds whose recall reaches r, the most precise (ties: the
  higher recall); flagged if none does (only possible when the class has no positives).
Candidate thresholds are the observed logits themselves, at positions where the sorted
scores change (equal scores are accepted or rejected together). Conventions on empty sets
(written as numbers so calibration.json stays finite): precision with no match is 1.0 (no false
alarm); recall with no positive is 0.0. A class with no positive gets a threshold just above its
highest logit (it never matches there) and `"reached": false`.

Every rule's best cut is at a positive's score (below it, down to the next positive, only negatives
are added), so the positives' scores are the only candidates, each needing the count of scores at or
above it: for a class with few positives, a few compare passes instead of a sort (class_thresholds);
for the pooled column, the N true logits looked up in each chunk's sorted scores (PooledThreshold).
"""
from __future__ import annotations

import numpy as np

from serving.calibration.chunks import Logits

# the per-class kernels (thresholds, Platt) run on column groups [N, g] of about this many values:
# cache-sized, they run 2-3x faster than on a whole chunk (same results: each column is on its own)
KERNEL_VALUES = 1 << 17


# up to this many positives per class, class_thresholds counts at the positives' scores instead of sorting
FEW_POSITIVES = 16


def check_target(target: dict) -> tuple[str, float]:
    """(kind, value) of a target {"precision": p} or {"recall": r}; ValueError for anything else."""
    if not isinstance(target, dict) or len(target) != 1:
        raise ValueError(f"target must be {{'precision': p}} or {{'recall': r}}, got {target!r}")
    (kind, value), = target.items()
    if kind not in ("precision", "recall") or not (0.0 < float(value) <= 1.0):
        raise ValueError(f"target must be {{'precision': p}} or {{'recall': r}} with 0 < value <= 1, got {target!r}")
    return kind, float(value)


def choose_thresholds(scores: np.ndarray, positive: np.ndarray, target: dict) -> dict[str, np.ndarray]:
    """Per column of `scores` [N, C] (positives `positive` [N, C] bool), the calibrated threshold.

    Returns arrays [C]: threshold (float64), precision, recall, reached (bool), positives (int).
    Vectorised over columns: one sort of the [N, C] matrix.
    """
    kind, value = check_target(target)
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    n, c = scores.shape
    if n == 0:
        raise ValueError("no calibration examples")
    order = np.argsort(-scores, axis=0, kind="stable")  # [N, C], best first
    s_sorted = np.take_along_axis(scores, order, axis=0)  # [N, C]
    tp = np.cumsum(np.take_along_axis(positive, order, axis=0), axis=0)  # [N, C]: accepting the top k+1
    accepted = np.arange(1, n + 1, dtype=np.float64)[:, None]  # [N, 1]
    n_pos = tp[-1].copy()  # [C]; a copy, as a view would keep all of tp [N, C] alive in the result
    precision = tp / accepted  # [N, C]
    recall = tp / np.maximum(n_pos, 1)  # [N, C]; 0 when the class has no positive
    # a cut after row k is a real threshold only where the next score is strictly lower
    boundary = np.ones((n, c), dtype=bool)
    boundary[:-1] = s_sorted[:-1] > s_sorted[1:]

    primary, secondary = (precision, recall) if kind == "precision" else (recall, precision)
    feasible = boundary & (primary >= value - 1e-12)
    reached = feasible.any(axis=0) & (n_pos > 0)  # [C]
    # feasible: best secondary metric, then best primary; infeasible: best primary, then secondary
    first = np.where(reached[None, :], secondary, primary)
    second = np.where(reached[None, :], primary, secondary)
    pool = np.where(reached[None, :], feasible, boundary)
    first_m = np.where(pool, first, -np.inf)
    best_first = first_m.max(axis=0)  # [C]
    second_m = np.where(pool & (first_m == best_first[None, :]), second, -np.inf)
    k = second_m.argmax(axis=0)  # [C] row index of the chosen cut
    cols = np.arange(c)
    threshold = s_sorted[k, cols]
    prec, rec = precision[k, cols], recall[k, cols]
    # no positive at all: never match on calibration data
    none = n_pos == 0
    if none.any():
        top = s_sorted[0, none]
        # next float32 above the top score: thresholds are stored and compared as float32
        threshold[none] = np.nextafter(top.astype(np.float32), np.float32(np.inf))
        prec[none], rec[none] = 1.0, 0.0
    return {"threshold": threshold, "precision": prec, "recall": rec, "reached": reached, "positives": n_pos}


def counts_at(scores: np.ndarray, positive: np.ndarray, threshold: np.ndarray) -> tuple[np.ndarray, ...]:
    """(true matches, matches, positives) [C] per column of `scores` [N, C] at thresholds [C]."""
    match = np.asarray(scores) >= np.asarray(threshold)[None, :]  # [N, C]
    positive = np.asarray(positive, dtype=bool)
    return (match & positive).sum(axis=0), match.sum(axis=0), positive.sum(axis=0)


def rates(tp, predicted, n_pos) -> dict[str, np.ndarray]:
    precision = np.where(predicted > 0, tp / np.maximum(predicted, 1), 1.0)
    recall = np.where(n_pos > 0, tp / np.maximum(n_pos, 1), 0.0)
    return {"precision": precision, "recall": recall, "positives": n_pos, "matches": predicted}


def class_counts(logits: Logits, thresholds: list[np.ndarray]) -> list[tuple]:
    """(true matches, matches, positives) [D] per class at each set of thresholds [D], in one pass."""
    parts: list[list] = [[] for _ in thresholds]
    for first, z in logits:
        positive = logits.positive(first, z.shape[1])  # [N, c]
        for part, t in zip(parts, thresholds):
            part.append(counts_at(z, positive, t[first:first + z.shape[1]]))
    return [tuple(map(np.concatenate, zip(*part))) for part in parts]


def measured_rates(logits: Logits, thresholds: np.ndarray, global_t: float) -> dict:
    """Rates at per-class thresholds [D] and at one global threshold, per class and pooled, in one pass."""
    at_t, at_g = class_counts(logits, [thresholds, np.full(logits.num_classes, global_t)])
    return {
        "per_class": rates(*at_t),
        "global": rates(*(np.array([c.sum()]) for c in at_g)),  # the pooled pairs: sums over classes
        "per_class_at_global": rates(*at_g),
        "examples": int(len(logits.y)),
    }


def rates_at(scores: np.ndarray, positive: np.ndarray, threshold: np.ndarray) -> dict[str, np.ndarray]:
    """Precision and recall per column of `scores` [N, C] at thresholds [C] (match = score >= t)."""
    return rates(*counts_at(scores, positive, threshold))


def select_cut(primary: np.ndarray, secondary: np.ndarray, valid: np.ndarray, value: float) -> tuple[np.ndarray, ...]:
    """choose_thresholds' rule over candidate cuts [K, C] (`valid` ones only): (row k [C], reached [C])."""
    feasible = valid & (primary >= value - 1e-12)
    reached = feasible.any(axis=0)  # [C]
    # feasible: best secondary metric, then best primary; infeasible: best primary, then secondary
    first = np.where(reached[None, :], secondary, primary)
    second = np.where(reached[None, :], primary, secondary)
    pool = np.where(reached[None, :], feasible, valid)
    first_m = np.where(pool, first, -np.inf)
    second_m = np.where(pool & (first_m == first_m.max(axis=0)[None, :]), second, -np.inf)
    return second_m.argmax(axis=0), reached


def class_thresholds(scores: np.ndarray, positive: np.ndarray, target: dict) -> dict[str, np.ndarray]:
    """choose_thresholds' answer [C], without sorting the columns when classes have few positives.

    Every rule picks a cut at a positive's score (between two positive scores, lowering the
    threshold adds only negatives: the same recall, a lower precision), so with at most m
    positives per class the candidates are those m scores per column, each needing the count of
    the column's scores at or above it: m compare passes over [N, C] instead of a sort.
    """
    kind, value = check_target(target)
    positive = np.asarray(positive, dtype=bool)
    n_pos = positive.sum(axis=0)  # [C]
    m = int(n_pos.max(initial=0))
    if m > FEW_POSITIVES or len(positive) == 0:
        return choose_thresholds(scores, positive, target)
    scores = np.asarray(scores, dtype=np.float64)  # [N, C]
    c = scores.shape[1]
    rows, cols = np.nonzero(positive)  # [P]
    vals = scores[rows, cols]
    order = np.lexsort((-vals, cols))  # by class, best first
    cols, vals = cols[order], vals[order]
    cand = np.full((max(m, 1), c), -np.inf)  # [m, C] each class's positive scores, best first
    cand[np.arange(len(cols)) - np.searchsorted(cols, cols), cols] = vals
    valid = np.arange(len(cand))[:, None] < n_pos[None, :]  # [m, C]
    accepted = np.stack([(scores >= row[None, :]).sum(axis=0) for row in cand])  # [m, C] scores >= candidate
    tp = ((cand[None, :, :] >= cand[:, None, :]) & valid[None, :, :]).sum(axis=1)  # [m, C] positives >= candidate
    precision = tp / np.maximum(accepted, 1)  # [m, C]; accepted >= tp >= 1 where valid
    recall = tp / np.maximum(n_pos, 1)[None, :]
    primary, secondary = (precision, recall) if kind == "precision" else (recall, precision)
    k, reached = select_cut(primary, secondary, valid, value)
    at = np.arange(c)
    threshold, prec, rec = cand[k, at], precision[k, at], recall[k, at]
    none = n_pos == 0
    if none.any():  # never match on calibration data: the next float32 above the top score
        threshold[none] = np.nextafter(scores[:, none].max(axis=0).astype(np.float32), np.float32(np.inf))
        prec[none], rec[none] = 1.0, 0.0
    return {"threshold": threshold, "precision": prec, "recall": rec, "reached": reached, "positives": n_pos}


class PooledThreshold:
    """The global threshold over all N·D (example, class) pairs pooled into one column, exactly as
    choose_thresholds would choose it on that column, in O(N) memory from class chunks.

    Every rule picks a cut at a positive's score: between two positive scores, lowering the
    threshold only adds negatives (the same recall, a lower precision). So the candidates are the
    distinct true logits u, each needing TP(u) (true logits >= u) and A(u) (all scores >= u, which
    `add` counts chunk by chunk: the chunk's scores sorted, the candidates looked up in them).
    """

    def __init__(self, true: np.ndarray):  # [N] each example's own logit
        self.true = np.sort(np.asarray(true, dtype=np.float64))
        self.u = np.unique(self.true)  # [K] ascending
        self.accepted = np.zeros(len(self.u), dtype=np.int64)  # [K] scores >= u[k] so far

    def add(self, z: np.ndarray) -> None:
        """Count the scores z [N, c] of one class chunk."""
        s = np.sort(z[z >= self.u[0]])  # [M <= N·c] a score below every candidate is never counted
        self.accepted += len(s) - np.searchsorted(s, self.u, side="left")

    def choose(self, target: dict) -> dict[str, np.ndarray]:
        """choose_thresholds' answer for the pooled column: arrays [1]."""
        kind, value = check_target(target)
        n = len(self.true)
        u, accepted = self.u[::-1], self.accepted[::-1]  # [K] descending, as the dense sort runs
        tp = n - np.searchsorted(self.true, u, side="left")  # [K] true logits >= u[k]
        if (accepted < tp).any():
            raise RuntimeError("the class chunks gave different logits on two passes")
        precision, recall = tp / accepted, tp / max(n, 1)  # [K]
        primary, secondary = (precision, recall) if kind == "precision" else (recall, precision)
        (k,), reached = select_cut(primary[:, None], secondary[:, None], np.ones((len(u), 1), dtype=bool), value)
        return {"threshold": u[k:k + 1], "precision": precision[k:k + 1], "recall": recall[k:k + 1],
                "reached": reached, "positives": np.array([n])}
