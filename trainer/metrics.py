"""Single-logit classification metrics (DESIGN.md §5), numpy only.

Each class j is a detection problem on its own column: scores[:, j] over all examples,
positives are labels == j. A threshold is a distinct score value; tied scores enter or
leave the positive side together (the same convention as scikit-learn).

Classes with no positive example in `labels` have no defined precision-recall curve and
are left out of the class averages.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np


COUNT_MAX_POSITIVES = 32  # up to this many positives per class, thresholds are counted by comparison


def _positive_rates(scores: np.ndarray, labels: np.ndarray, block: int = 2048):
    """Per class, precision and recall at each of its positives' scores, the only thresholds a
    class average needs (a threshold between two positives only adds negatives).

    scores [N, C]; labels [N] (a label outside 0..C-1 is no column's positive). Returns
    (precision [K, C], recall [K, C], valid [K, C], n_pos [C]) with K the largest number of
    positives of a class; row r of column c is the class's r-th positive, `valid` where it exists.
    At a positive's score s the threshold keeps every example with a score ≥ s: ties enter
    together, as in scikit-learn. Counting, not sorting: O(N·C·K) comparisons.
    """
    n, c = scores.shape
    mine = (labels >= 0) & (labels < c)
    rows, cls = np.flatnonzero(mine), labels[mine]
    n_pos = np.bincount(cls, minlength=c)  # [C]
    k = int(n_pos.max(initial=0))
    pos = np.full((max(k, 1), c), np.inf)  # [K, C] each class's positive scores, +inf padding
    order = np.lexsort((rows, cls))
    rank = np.arange(len(order)) - np.repeat(np.cumsum(n_pos) - n_pos, n_pos)  # position within its class
    pos[rank, cls[order]] = scores[rows[order], cls[order]]
    valid = np.isfinite(pos)  # [K, C]
    if k <= COUNT_MAX_POSITIVES:  # a few positives per class (many classes): compare
        kept = np.zeros(pos.shape, dtype=np.int64)  # [K, C] examples with a score ≥ the positive's
        for first in range(0, n, block):
            kept += (scores[first:first + block, None, :] >= pos[None]).sum(axis=0)
        tp = ((pos[None, :, :] >= pos[:, None, :]) & valid[None]).sum(axis=1)  # [K, C] positives scoring ≥ row r
    else:  # many positives per class (few classes): sort each column once
        kept, tp = np.zeros(pos.shape, dtype=np.int64), np.zeros(pos.shape, dtype=np.int64)
        for j in range(c):
            kept[:, j] = n - np.searchsorted(np.sort(scores[:, j]), pos[:, j], side="left")
            tp[:, j] = n_pos[j] - np.searchsorted(np.sort(pos[:n_pos[j], j]), pos[:, j], side="left")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(valid, tp / np.maximum(kept, 1), 0.0), np.where(valid, tp / n_pos, 0.0), valid, n_pos


def _class_figures(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, ...]:
    """(AP [C], P@R0.9 [C], P@R0.99 [C], n_pos [C]); AP NaN and P@R −inf for a class without positives.

    AP_c = Σ_thresholds (R_k − R_{k−1}) · P_k (scikit-learn's definition) = the mean over the
    class's positives of the precision at its score; P@R = the best precision among thresholds
    whose recall is at least R."""
    precision, recall, valid, n_pos = _positive_rates(scores, labels)
    with np.errstate(invalid="ignore", divide="ignore"):
        ap = precision.sum(axis=0) / n_pos
    at = [np.where(valid & (recall >= r - 1e-12), precision, -np.inf).max(axis=0) for r in (0.90, 0.99)]
    return ap, at[0], at[1], n_pos


def slc_metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """auprc, p_at_r90, p_at_r99 (class averages), accuracy, top5_accuracy of scores [N, C].

    Plain values (higher is better), not the paper's 1 − x.
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(np.int64)
    if scores.ndim != 2 or labels.shape != (scores.shape[0],):
        raise ValueError(f"need scores [N, C] and labels [N], got {scores.shape} and {labels.shape}")
    if not np.isfinite(scores).all():
        raise ValueError("scores contain NaN or inf")
    n, c = scores.shape
    if labels.min(initial=0) < 0 or labels.max(initial=0) >= c:
        raise ValueError(f"labels must lie in 0..{c - 1}")
    ap, p90, p99, n_pos = _class_figures(scores, labels)
    present = n_pos > 0
    # Stable ordering, so ties resolve to the lowest class id exactly as argmax does.
    ranked = np.argsort(-scores, axis=1, kind="stable")  # [N, C]
    top5 = (ranked[:, :5] == labels[:, None]).any(axis=1)
    return {
        "auprc": float(ap[present].mean()),
        "p_at_r90": float(p90[present].mean()),
        "p_at_r99": float(p99[present].mean()),
        "accuracy": float((ranked[:, 0] == labels).mean()),
        "top5_accuracy": float(top5.mean()),
    }


def per_class_average_precision(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """AP of every class [C] (NaN for classes with no positive)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(np.int64)
    return _class_figures(scores, labels)[0]


def pooled_separation(scores: np.ndarray, labels: np.ndarray) -> float:
    """Share of (true logit of example i, false logit of another example i') pairs with true > false.

    The PoLS asks for every true logit z_{i,y_i} to exceed every false logit z_{i',j}
    (j ≠ y_{i'}), across examples, so one threshold works for all; this is the share of
    cross-example pairs that already satisfy it (ties count as not separated). Pairs within
    one example (what accuracy is about) are excluded. O(NC log NC) by sorting.
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(np.int64)
    n, c = scores.shape
    if n < 2 or c < 2:
        raise ValueError("need at least 2 examples and 2 classes")
    rows = np.arange(n)
    true = scores[rows, labels]  # [N]
    is_false = np.ones((n, c), dtype=bool)
    is_false[rows, labels] = False
    false_sorted = np.sort(scores[is_false])  # [N*(C-1)]
    below_all = np.searchsorted(false_sorted, true, side="left")  # [N] false logits < true, any example
    below_own = ((scores < true[:, None]) & is_false).sum(axis=1)  # [N] the ones of the same example
    pairs = n * (n - 1) * (c - 1)
    return float((below_all - below_own).sum() / pairs)


# ----------------------------------------------------------------------------- streaming over class chunks
def _merge_top(vals: np.ndarray, ids: np.ndarray, z: np.ndarray, first_id: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (value, class id) per row of the running top-k and a chunk z [N, c] of classes
    first_id.. ; ties go to the lowest class id, as a stable argsort over all D columns does."""
    cand_v = np.concatenate([vals, z], axis=1)  # [N, k + c]
    cand_i = np.concatenate([ids, np.broadcast_to(np.arange(first_id, first_id + z.shape[1]), z.shape)], axis=1)
    order = np.lexsort((cand_i, -cand_v), axis=1)[:, :k]  # by value desc, then id asc
    return np.take_along_axis(cand_v, order, axis=1), np.take_along_axis(cand_i, order, axis=1)


def streaming_slc_metrics(chunks: Callable[[], Iterable[tuple[int, np.ndarray]]], labels: np.ndarray,
                          num_classes: int, separation: bool = True) -> dict[str, float]:
    """slc_metrics (+ the pooled separation) from scores in class chunks, never [N, D] at once.

    `chunks()` yields (first class id, scores [N, c] of classes first..first+c-1) in order, and is
    called twice when `separation` (which needs every true logit first). Equal to the dense
    computation (tests/trainer/test_metrics.py): each class's curve needs only its own column;
    accuracy and top-5 keep a running top-5 per example.
    """
    labels = np.asarray(labels).astype(np.int64)
    n = len(labels)
    ap, p90, p99, present = [], [], [], []
    top_v, top_i = np.full((n, 0), -np.inf), np.zeros((n, 0), dtype=np.int64)
    true = np.full(n, np.nan)  # [N] each example's own logit
    for first, z in chunks():
        z = np.asarray(z, dtype=np.float64)  # [N, c]
        if not np.isfinite(z).all():
            raise ValueError("scores contain NaN or inf")
        local = labels - first  # positives of this chunk are 0..c-1; others never match
        a, b, c, n_pos = _class_figures(z, local)
        ap.append(a)
        p90.append(b)
        p99.append(c)
        present.append(n_pos > 0)
        top_v, top_i = _merge_top(top_v, top_i, z, first, min(5, num_classes))
        mine = (local >= 0) & (local < z.shape[1])
        true[mine] = z[mine, local[mine]]
    if not ap:
        raise ValueError("no score chunks")
    ap, p90, p99, present = (np.concatenate(a) for a in (ap, p90, p99, present))
    out = {"auprc": float(ap[present].mean()), "p_at_r90": float(p90[present].mean()),
           "p_at_r99": float(p99[present].mean()), "accuracy": float((top_i[:, 0] == labels).mean()),
           "top5_accuracy": float((top_i == labels[:, None]).any(axis=1).mean())}
    if separation:
        out["separation"] = _streaming_separation(chunks(), labels, true, num_classes)
    return out


def _streaming_separation(chunks: Iterable[tuple[int, np.ndarray]], labels: np.ndarray, true: np.ndarray,
                          num_classes: int) -> float:
    """pooled_separation, chunk by chunk: false logits of other examples below each true logit."""
    n = len(labels)
    below = 0
    for first, z in chunks:
        z = np.asarray(z, dtype=np.float64)  # [N, c]
        is_false = (labels[:, None] - first) != np.arange(z.shape[1])[None, :]  # [N, c]
        below_all = np.searchsorted(np.sort(z[is_false]), true, side="left")  # [N] this chunk's false < true
        below_own = ((z < true[:, None]) & is_false).sum(axis=1)  # [N] of the same example
        below += int((below_all - below_own).sum())
    return float(below / (n * (n - 1) * (num_classes - 1)))
