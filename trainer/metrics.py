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


def _per_class_curves(scores: np.ndarray, labels: np.ndarray):
    """Per class, cumulative counts at every position of the descending score order.

    Returns (tp [N, C], predicted [N, 1], group_end [N, C], n_pos [C]); column c of each
    refers to class c's own ordering. `group_end[k, c]` is True where position k is the last
    of its run of tied scores, i.e. where a threshold can stop.
    """
    n, c = scores.shape
    order = np.argsort(-scores, axis=0, kind="stable")  # [N, C] row indices, best first
    sorted_scores = np.take_along_axis(scores, order, axis=0)  # [N, C]
    positive = labels[order] == np.arange(c)[None, :]  # [N, C]
    tp = np.cumsum(positive, axis=0)  # [N, C]
    predicted = np.arange(1, n + 1)[:, None]  # [N, 1] examples above-or-at the threshold
    group_end = np.ones((n, c), dtype=bool)
    group_end[:-1] = sorted_scores[:-1] != sorted_scores[1:]
    return positive, tp, predicted, group_end, tp[-1]


def _average_precision(positive, tp, predicted, group_end, n_pos) -> np.ndarray:
    """AP_c = Σ_thresholds (R_k − R_{k−1}) · P_k, scikit-learn's definition. -> [C]

    Every positive raises recall by 1/n_pos at the threshold that closes its tie group, so
    AP = mean over positives of the precision at the end of the positive's tie group.
    """
    n = tp.shape[0]
    precision = tp / predicted  # [N, C]
    # Index of the end of each position's tie group: the next group_end at or after it.
    end_index = np.where(group_end, np.arange(n)[:, None], n)  # [N, C]
    end_index = np.minimum.accumulate(end_index[::-1], axis=0)[::-1]  # [N, C]
    precision_at_group_end = np.take_along_axis(precision, end_index, axis=0)  # [N, C]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(positive, precision_at_group_end, 0.0).sum(axis=0) / n_pos  # [C]


def _precision_at_recall(tp, predicted, group_end, n_pos, min_recall: float) -> np.ndarray:
    """Highest precision among thresholds whose recall is ≥ min_recall. -> [C]"""
    with np.errstate(invalid="ignore", divide="ignore"):
        recall = tp / n_pos  # [N, C]
    precision = tp / predicted  # [N, C]
    allowed = group_end & (recall >= min_recall - 1e-12)  # [N, C]
    return np.where(allowed, precision, -np.inf).max(axis=0)  # [C]; -inf only when n_pos == 0


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
    positive, tp, predicted, group_end, n_pos = _per_class_curves(scores, labels)
    present = n_pos > 0
    ap = _average_precision(positive, tp, predicted, group_end, n_pos)
    p90 = _precision_at_recall(tp, predicted, group_end, n_pos, 0.90)
    p99 = _precision_at_recall(tp, predicted, group_end, n_pos, 0.99)
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
    positive, tp, predicted, group_end, n_pos = _per_class_curves(scores, labels)
    return _average_precision(positive, tp, predicted, group_end, n_pos)


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
        positive, tp, predicted, group_end, n_pos = _per_class_curves(z, local)
        ap.append(_average_precision(positive, tp, predicted, group_end, n_pos))
        p90.append(_precision_at_recall(tp, predicted, group_end, n_pos, 0.90))
        p99.append(_precision_at_recall(tp, predicted, group_end, n_pos, 0.99))
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


def head_chunks(h: np.ndarray, weight: np.ndarray, bias: np.ndarray, chunk: int = 1024):
    """`chunks` for streaming_slc_metrics from embeddings h [N, d] and a head W [D, d], b [D]:
    logits of `chunk` classes at a time."""
    def gen():
        for first in range(0, weight.shape[0], chunk):
            w = np.asarray(weight[first:first + chunk], dtype=np.float64)  # [c, d]
            yield first, h @ w.T + np.asarray(bias[first:first + chunk], dtype=np.float64)  # [N, c]
    return gen
