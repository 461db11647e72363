"""Thresholds and Platt scaling chosen on the calibration split (docs/bundle-format.md). numpy only.

Decision rule everywhere: `match = logit >= threshold`.

Threshold choice, per class j (column j of the logits, positives y == j) and globally
(all (example, class) pairs pooled into one column):
- target {"precision": p}: among thresholds whose precision reaches p, the one with the
  highest recall (ties: the higher precision); if none reaches p, the most precise one
  (ties: the higher recall), flagged `"reached": false`.
- target {"recall": r}: among thresholds whose recall reaches r, the most precise (ties: the
  higher recall); flagged if none does (only possible when the class has no positives).
Candidate thresholds are the observed logits themselves, at positions where the sorted
scores change (equal scores are accepted or rejected together).

Conventions on empty sets (written as numbers so calibration.json stays finite):
precision with no match is 1.0 (no false alarm); recall with no positive is 0.0.
A class with no positive in the calibration split gets a threshold just above its highest
logit (it never matches there) and `"reached": false`.

Platt scaling: probability = sigmoid(a * logit + b), (a, b) per class fitted by Newton's
method on the class's column vs y == j, with a tiny ridge so separable classes (common with
PoLS losses) still give finite (a, b).

Bounded memory: `calibrate_chunks` reads the logits class chunk by class chunk ([N, c] at a time,
never [N, D]), as trainer.metrics.streaming_slc_metrics does. Per-class thresholds, Platt fits and
rates need only their own column; the pooled global threshold is exact too (PooledThreshold).
Both use one fact: every rule's best cut is at a positive's score (below it, down to the next
positive, only negatives are added), so the positives' scores are the only candidates, each
needing the count of scores at or above it: for a class with few positives, a few compare passes
instead of a sort (class_thresholds); for the pooled column, the N true logits looked up in each
chunk's sorted scores. `calibrate` on a dense [N, D] matrix is the same computation over slices.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import numpy as np

DEFAULT_TARGET = {"precision": 0.99}
# How class j's threshold is chosen (per-class thresholds fit a class's few calibration images and carry
# worst to a typeface never seen; one global threshold carries best; shrink is between them):
# per_class (column j alone), global (one pooled threshold), or shrink: the per-class threshold
# pulled toward the global one by a pseudo-count kappa, (n_j t_j + kappa t_g) / (n_j + kappa).
# tail: column j's threshold read off the upper tail of its negatives (an exponential fitted to the
# TAIL_K highest), where the expected false matches keep the target precision: for classes with few
# positives, whose own scores say little (docs/calibration.md, "The tail rule"). norm: one threshold
# on the logits standardised by each column's NORM_K highest negatives, cross-fitted
# (trainer/threshold_norm.py; docs/calibration.md, "The norm rule").
METHODS = ("per_class", "global", "shrink", "tail", "norm")
DEFAULT_METHOD = {"name": "shrink", "kappa": 4.0}
TAIL_K = 20
NORM_K = 100  # the norm rule: the highest negatives per column whose mean and spread standardise it
PLATT_RIDGE = 1e-3  # on the standardised slope; a tiny prior, only matters when separable
# logits per class chunk: [N, c] float64 is 16 MiB; a pass holds a few such arrays (the pooled counts sort a copy)
CHUNK_VALUES = 2 * 1024 * 1024
# the per-class kernels (thresholds, Platt) run on column groups [N, g] of about this many values:
# cache-sized, they run 2-3x faster than on a whole chunk (same results: each column is on its own)
KERNEL_VALUES = 1 << 17
# up to this many positives per class, class_thresholds counts at the positives' scores instead of sorting
FEW_POSITIVES = 16

# () -> iterable of (first class id, logits [N, c] of classes first..first+c-1), in class order, covering 0..D-1;
# called once per pass (the contract of trainer.metrics.streaming_slc_metrics and head_chunks)
Chunks = Callable[[], Iterable[tuple[int, np.ndarray]]]


def _check_target(target: dict) -> tuple[str, float]:
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
    kind, value = _check_target(target)
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


def _counts_at(scores: np.ndarray, positive: np.ndarray, threshold: np.ndarray) -> tuple[np.ndarray, ...]:
    """(true matches, matches, positives) [C] per column of `scores` [N, C] at thresholds [C]."""
    match = np.asarray(scores) >= np.asarray(threshold)[None, :]  # [N, C]
    positive = np.asarray(positive, dtype=bool)
    return (match & positive).sum(axis=0), match.sum(axis=0), positive.sum(axis=0)


def _rates(tp, predicted, n_pos) -> dict[str, np.ndarray]:
    precision = np.where(predicted > 0, tp / np.maximum(predicted, 1), 1.0)
    recall = np.where(n_pos > 0, tp / np.maximum(n_pos, 1), 0.0)
    return {"precision": precision, "recall": recall, "positives": n_pos, "matches": predicted}


def rates_at(scores: np.ndarray, positive: np.ndarray, threshold: np.ndarray) -> dict[str, np.ndarray]:
    """Precision and recall per column of `scores` [N, C] at thresholds [C] (match = score >= t)."""
    return _rates(*_counts_at(scores, positive, threshold))


def _select(primary: np.ndarray, secondary: np.ndarray, valid: np.ndarray, value: float) -> tuple[np.ndarray, ...]:
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
    kind, value = _check_target(target)
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
    k, reached = _select(primary, secondary, valid, value)
    at = np.arange(c)
    threshold, prec, rec = cand[k, at], precision[k, at], recall[k, at]
    none = n_pos == 0
    if none.any():  # never match on calibration data: the next float32 above the top score
        threshold[none] = np.nextafter(scores[:, none].max(axis=0).astype(np.float32), np.float32(np.inf))
        prec[none], rec[none] = 1.0, 0.0
    return {"threshold": threshold, "precision": prec, "recall": rec, "reached": reached, "positives": n_pos}


def _platt_objective(z: np.ndarray, t: np.ndarray, a: np.ndarray, b: np.ndarray, lam_a: float,
                     lam_b: float) -> np.ndarray:
    """Negative penalised log-likelihood per column: what each Newton step must decrease."""
    u = a * z + b
    # -[t log σ(u) + (1-t) log(1-σ(u))] = softplus(u) - t u
    return (np.logaddexp(0.0, u) - t * u).sum(axis=0) + 0.5 * (lam_a * a * a + lam_b * b * b)


def _platt_newton_step(z: np.ndarray, t: np.ndarray, a_act: np.ndarray, b_act: np.ndarray, lam_a: float,
                       lam_b: float) -> tuple[np.ndarray, np.ndarray]:
    """(step_a, step_b) [A]: the full Newton step of each active column, by the closed-form 2x2
    solve (no per-column linear algebra call)."""
    u = a_act * z + b_act
    p = 0.5 * (1.0 + np.tanh(0.5 * u))  # stable sigmoid
    r = p - t  # [N, A]
    g_a = (r * z).sum(axis=0) + lam_a * a_act
    g_b = r.sum(axis=0) + lam_b * b_act
    w = p * (1 - p)
    h_aa = (w * z * z).sum(axis=0) + lam_a
    h_ab = (w * z).sum(axis=0)
    h_bb = w.sum(axis=0) + lam_b
    det = np.maximum(h_aa * h_bb - h_ab * h_ab, 1e-300)
    step_a = (h_bb * g_a - h_ab * g_b) / det
    step_b = (h_aa * g_b - h_ab * g_a) / det
    return step_a, step_b


def _platt_line_search(z: np.ndarray, t: np.ndarray, a_act: np.ndarray, b_act: np.ndarray, f_act: np.ndarray,
                       step_a: np.ndarray, step_b: np.ndarray, lam_a: float, lam_b: float):
    """(new_a, new_b, new_f) [A]: the Newton step, halved (up to 30 times) only in the columns
    where it did not decrease the objective, so every column's objective is monotone."""
    new_a, new_b = a_act - step_a, b_act - step_b
    new_f = _platt_objective(z, t, new_a, new_b, lam_a, lam_b)
    scale = np.ones(a_act.size)
    for _ in range(30):  # halve the step only where the objective did not decrease
        worse = np.flatnonzero(~(new_f <= f_act))
        if worse.size == 0:
            break
        scale[worse] *= 0.5
        new_a[worse] = a_act[worse] - scale[worse] * step_a[worse]
        new_b[worse] = b_act[worse] - scale[worse] * step_b[worse]
        new_f[worse] = _platt_objective(z[:, worse], t[:, worse], new_a[worse], new_b[worse], lam_a, lam_b)
    return new_a, new_b, new_f


def _platt_newton(z_all: np.ndarray, t_fit: np.ndarray, a: np.ndarray, b: np.ndarray, lam_a: float,
                  lam_b: float, iters: int) -> None:
    """Newton iterations on all columns at once, updating a and b [F] in place; a column leaves
    the active set once a step no longer improves it (or improves it by < 1e-10 relative)."""
    active = np.arange(a.size)
    f = _platt_objective(z_all, t_fit, a, b, lam_a, lam_b)
    for _ in range(iters):
        z, t = z_all[:, active], t_fit[:, active]
        a_act, b_act, f_act = a[active], b[active], f[active]
        step_a, step_b = _platt_newton_step(z, t, a_act, b_act, lam_a, lam_b)
        new_a, new_b, new_f = _platt_line_search(z, t, a_act, b_act, f_act, step_a, step_b, lam_a, lam_b)
        improved = new_f <= f_act
        a[active] = np.where(improved, new_a, a_act)
        b[active] = np.where(improved, new_b, b_act)
        f[active] = np.where(improved, new_f, f_act)
        done = ~improved | (f_act - new_f <= 1e-10 * (1 + np.abs(f_act)))
        active = active[~done]
        if active.size == 0:
            break


def fit_platt(scores: np.ndarray, positive: np.ndarray, ridge: float = PLATT_RIDGE, iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Per column: (a, b) maximising sum log-likelihood of sigmoid(a * s + b) for `positive`.

    Newton on standardised scores (so the ridge and the start do not depend on the logit
    scale), all columns at once with closed-form 2x2 solves and step halving; converged
    columns leave the active set. The ridge penalises 0.5 * ridge * (a'^2 + 1e-3 * b'^2) on
    the standardised parameters. A column with no positive (or no negative) has no slope to
    fit: a = 0 and b = the smoothed log-odds of its base rate.
    """
    s = np.asarray(scores, dtype=np.float64)
    t_all = np.asarray(positive, dtype=np.float64)
    n, c = s.shape
    n_pos = t_all.sum(axis=0)
    a_out = np.zeros(c)
    b_out = np.log((n_pos + 0.5) / (n - n_pos + 0.5))  # the answer for degenerate columns
    fit = np.flatnonzero((n_pos > 0) & (n_pos < n))
    if fit.size == 0:
        return a_out, b_out
    mu = s[:, fit].mean(axis=0)
    sd = s[:, fit].std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    z_all = (s[:, fit] - mu) / sd  # [N, F]
    t_fit = t_all[:, fit]
    a = np.zeros(fit.size)
    b = b_out[fit].copy()  # start at the base rate
    _platt_newton(z_all, t_fit, a, b, ridge, ridge * 1e-3, iters)
    # back to raw logits: a' (s - mu) / sd + b'
    a_out[fit] = a / sd
    b_out[fit] = b - a * mu / sd
    return a_out, b_out


def _f(x) -> float:
    return float(x)


def chunk_classes(n: int, num_classes: int, values: int = CHUNK_VALUES) -> int:
    """Classes per chunk so that a chunk's logits [n, c] hold about `values` numbers."""
    return int(max(1, min(num_classes, values // max(n, 1))))


def dense_chunks(logits: np.ndarray, chunk: int) -> Chunks:
    """`Chunks` of a dense logit matrix [N, D]: column slices, `chunk` classes at a time."""
    def gen():
        for first in range(0, logits.shape[1], chunk):
            yield first, logits[:, first:first + chunk]  # [N, c] view
    return gen


def _each_chunk(chunks: Chunks, y: np.ndarray, num_classes: int, bar=None):
    """One pass over the chunks as float64 [N, c], checked to cover classes 0..D-1 in order."""
    expected = 0
    for first, z in chunks():
        z = np.asarray(z, dtype=np.float64)  # [N, c]
        if first != expected or z.ndim != 2 or z.shape[0] != len(y) or first + z.shape[1] > num_classes:
            raise ValueError(f"class chunks must cover classes 0..{num_classes - 1} in order with {len(y)} rows; "
                             f"got shape {z.shape} at class {first}, expected class {expected}")
        yield first, z
        expected += z.shape[1]
        if bar is not None:
            bar.update(z.shape[1])
    if expected != num_classes:
        raise ValueError(f"class chunks ended at class {expected}, expected {num_classes}")


def _chunk_positive(y: np.ndarray, first: int, c: int) -> np.ndarray:
    return (y - first)[:, None] == np.arange(c)[None, :]  # [N, c]: example i is of class first + k



def tail_thresholds(scores: np.ndarray, positive: np.ndarray, target: dict, k: int = TAIL_K) -> np.ndarray:
    """Per column of `scores` [N, C], the tail rule's threshold [C] for a precision target p.

    Column j's negatives above u (the lowest of its k highest) are taken as exponential with mean
    excess beta (their mean excess over u), so E[negatives >= t] = k exp(-(t - u) / beta). t is where
    that equals the false matches precision p allows if all n_j positives match: n_j (1 - p) / p,
    i.e. t = u + beta ln(k p / (n_j (1 - p))). A class with no positive never matches (as in
    choose_thresholds); one with under 2 negatives matches above its highest negative.
    """
    kind, p = _check_target(target)
    if kind != "precision":
        raise ValueError("the tail rule needs a precision target (--target-precision)")
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    n, c = scores.shape
    n_pos = positive.sum(axis=0)  # [C]
    neg = np.where(positive, -np.inf, scores)  # [N, C]
    kk = min(k, n)
    top = np.partition(neg, n - kk, axis=0)[n - kk:] if kk else np.full((1, c), -np.inf)  # [kk, C] the highest
    finite = np.isfinite(top)
    m = finite.sum(axis=0)  # [C] negatives among them
    u = np.where(finite, top, np.inf).min(axis=0)  # [C]
    beta = np.where(finite, top - np.where(m > 0, u, 0)[None, :], 0).sum(axis=0) / np.maximum(m, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = u + beta * np.log(m * p / (np.maximum(n_pos, 1) * (1 - p)))
    top_neg = np.where(finite, top, -np.inf).max(axis=0)  # [C]
    above = np.nextafter(top_neg.astype(np.float32), np.float32(np.inf)).astype(np.float64)
    t = np.where((m < 2) | ~np.isfinite(t), above, t)  # few negatives, or p = 1: above every negative
    t = np.where(m == 0, np.where(positive, scores, np.inf).min(axis=0), t)  # no negative: the lowest positive
    none = n_pos == 0
    t[none] = np.nextafter(scores[:, none].max(axis=0).astype(np.float32), np.float32(np.inf)) if n else np.inf
    return t

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
        kind, value = _check_target(target)
        n = len(self.true)
        u, accepted = self.u[::-1], self.accepted[::-1]  # [K] descending, as the dense sort runs
        tp = n - np.searchsorted(self.true, u, side="left")  # [K] true logits >= u[k]
        if (accepted < tp).any():
            raise RuntimeError("the class chunks gave different logits on two passes")
        precision, recall = tp / accepted, tp / max(n, 1)  # [K]
        primary, secondary = (precision, recall) if kind == "precision" else (recall, precision)
        (k,), reached = _select(primary[:, None], secondary[:, None], np.ones((len(u), 1), dtype=bool), value)
        return {"threshold": u[k:k + 1], "precision": precision[k:k + 1], "recall": recall[k:k + 1],
                "reached": reached, "positives": np.array([n])}


def _true_logits(chunks: Chunks, y: np.ndarray, num_classes: int, bar=None) -> np.ndarray:
    """Each example's own logit [N], from one pass over the chunks."""
    true = np.full(len(y), np.nan)
    for first, z in _each_chunk(chunks, y, num_classes, bar):
        local = y - first
        mine = (local >= 0) & (local < z.shape[1])
        true[mine] = z[mine, local[mine]]
    return true


def _per_class_pass(chunks: Chunks, y: np.ndarray, num_classes: int, target: dict, pooled: PooledThreshold,
                    bar=None, tail: bool = False, platt: bool = True) -> tuple[dict, np.ndarray, np.ndarray]:
    """Per-class thresholds (the tail rule's too if asked) and Platt fits (unless not) chunk by chunk
    (each needs its own column only); the pooled counts on the way."""
    parts, a, b = [], [], []
    for first, z in _each_chunk(chunks, y, num_classes, bar):
        if not np.isfinite(z).all():
            raise ValueError("calibration logits contain NaN or inf")
        positive = _chunk_positive(y, first, z.shape[1])  # [N, c]
        group = max(1, KERNEL_VALUES // len(y))
        for g in range(0, z.shape[1], group):
            part = class_thresholds(z[:, g:g + group], positive[:, g:g + group], target)
            if tail:
                part["tail"] = tail_thresholds(z[:, g:g + group], positive[:, g:g + group], target)
            parts.append(part)
            if platt:
                a_g, b_g = fit_platt(z[:, g:g + group], positive[:, g:g + group])
                a.append(a_g)
                b.append(b_g)
        pooled.add(z)
    per = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    return per, np.concatenate(a or [np.zeros(0)]), np.concatenate(b or [np.zeros(0)])


def _counts_pass(chunks: Chunks, y: np.ndarray, num_classes: int, thresholds: np.ndarray, global_t: float,
                 bar=None) -> tuple[tuple, tuple]:
    """(true matches, matches, positives) [D] per class at `thresholds` [D] and at the global threshold."""
    at_t, at_g = [], []
    for first, z in _each_chunk(chunks, y, num_classes, bar):
        positive = _chunk_positive(y, first, z.shape[1])  # [N, c]
        at_t.append(_counts_at(z, positive, thresholds[first:first + z.shape[1]]))
        at_g.append(_counts_at(z, positive, np.full(z.shape[1], global_t)))
    return tuple(map(np.concatenate, zip(*at_t))), tuple(map(np.concatenate, zip(*at_g)))


def _test_rates(chunks: Chunks, y_test, num_classes: int, per_thresholds: np.ndarray, global_t: float,
                bar=None) -> dict:
    """Rates on the test split at the thresholds chosen on the calibration split (measured only)."""
    y_test = np.asarray(y_test, dtype=np.int64)  # [N']
    at_t, at_g = _counts_pass(chunks, y_test, num_classes, per_thresholds, global_t, bar)
    return {
        "per_class": _rates(*at_t),
        "global": _rates(*(np.array([c.sum()]) for c in at_g)),  # the pooled pairs: sums over classes
        "per_class_at_global": _rates(*at_g),
        "examples": int(len(y_test)),
    }


def _per_class_entries(per: dict, a: np.ndarray, b: np.ndarray, test: dict | None) -> list[dict]:
    entries = []
    for j in range(len(per["threshold"])):
        entry = {
            "class_id": j,
            "threshold": _f(per["threshold"][j]),
            "precision": _f(per["precision"][j]),
            "recall": _f(per["recall"][j]),
            "reached": bool(per["reached"][j]),
            "positives": int(per["positives"][j]),
            "platt": {"a": _f(a[j]), "b": _f(b[j])},
        }
        if test is not None:
            t = test["per_class"]
            entry["test"] = {"precision": _f(t["precision"][j]), "recall": _f(t["recall"][j]),
                             "positives": int(t["positives"][j])}
        entries.append(entry)
    return entries


def _global_entry(pooled: dict, test: dict | None) -> dict:
    entry = {
        "threshold": float(pooled["threshold"][0]),
        "precision": _f(pooled["precision"][0]),
        "recall": _f(pooled["recall"][0]),
        "reached": bool(pooled["reached"][0]),
    }
    if test is not None:
        entry["test"] = {"precision": _f(test["global"]["precision"][0]), "recall": _f(test["global"]["recall"][0])}
    return entry


def _summary(per: dict, per_at_global: dict, test: dict | None, kind: str, value: float) -> dict:
    """Means over classes, and how one global threshold compares with D per-class ones."""
    summary = {
        "classes": len(per["threshold"]),
        "classes_reached": int(per["reached"].sum()),
        "per_class_mean_precision": _f(per["precision"].mean()),
        "per_class_mean_recall": _f(per["recall"].mean()),
        "global_threshold_per_class_mean_precision": _f(per_at_global["precision"].mean()),
        "global_threshold_per_class_mean_recall": _f(per_at_global["recall"].mean()),
    }
    if test is not None:
        achieved = test["per_class"][kind]
        summary["test"] = {
            # how far the calibrated thresholds fall short of the target on unseen data
            f"mean_{kind}_shortfall": _f(np.maximum(0.0, value - achieved).mean()),
            "classes_reaching_target": int((achieved >= value - 1e-12).sum()),
            "per_class_mean_precision": _f(test["per_class"]["precision"].mean()),
            "per_class_mean_recall": _f(test["per_class"]["recall"].mean()),
            "global_precision": _f(test["global"]["precision"][0]),
            "global_recall": _f(test["global"]["recall"][0]),
            "global_threshold_per_class_mean_precision": _f(test["per_class_at_global"]["precision"].mean()),
            "global_threshold_per_class_mean_recall": _f(test["per_class_at_global"]["recall"].mean()),
            f"global_threshold_mean_{kind}_shortfall": _f(np.maximum(0.0, value - test["per_class_at_global"][kind]).mean()),
        }
    return summary


def check_method(method: dict | None) -> dict:
    method = dict(method or DEFAULT_METHOD)
    if method.get("name") not in METHODS:
        raise ValueError(f"threshold method must be one of {', '.join(METHODS)}, got {method.get('name')!r}")
    if method["name"] == "shrink":
        kappa = float(method.get("kappa", DEFAULT_METHOD["kappa"]))
        if not (kappa > 0 and math.isfinite(kappa)):
            raise ValueError(f"shrink needs kappa > 0, got {kappa}")
        return {"name": "shrink", "kappa": kappa}
    if method["name"] == "tail":
        return {"name": "tail", "k": TAIL_K}
    if method["name"] == "norm":
        return {"name": "norm", "k": NORM_K}
    return {"name": method["name"]}


def _method_thresholds(per: dict, global_t: float, method: dict) -> np.ndarray:
    """Per-class thresholds [D] of `method`: per_class as chosen, others as stored by the server (float32)."""
    if method["name"] == "per_class":
        return per["threshold"]
    n = per["positives"].astype(np.float64)
    if method["name"] in ("tail", "norm"):
        threshold = per[method["name"]]
    elif method["name"] == "global":
        threshold = np.full(len(n), global_t)
    else:
        threshold = (n * per["threshold"] + method["kappa"] * global_t) / (n + method["kappa"])
    return threshold.astype(np.float32).astype(np.float64)  # as stored and compared by the server


def _with_method(per: dict, method: dict, threshold: np.ndarray, rates: dict, kind: str, value: float) -> dict:
    """The per-class entries of `method`: its thresholds and their calibration rates (per_class: as chosen)."""
    if method["name"] == "per_class":
        return per
    return {**per, "threshold": threshold, "precision": rates["precision"], "recall": rates["recall"],
            "reached": (rates[kind] >= value - 1e-12) & (per["positives"] > 0)}


def _labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    y = np.asarray(y, dtype=np.int64)
    if y.ndim != 1 or len(y) == 0:
        raise ValueError("no calibration examples" if y.size == 0 else f"y_cal must be [N], got shape {y.shape}")
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels outside 0..{num_classes - 1}")
    return y


def calibrate_chunks(cal: Chunks, y_cal: np.ndarray, num_classes: int, target: dict | None = None,
                     test: Chunks | None = None, y_test: np.ndarray | None = None, method: dict | None = None,
                     progress: bool = False, cross: list[Chunks] | None = None) -> dict:
    """calibration.json content from logits in class chunks (`Chunks`): [N, c] at a time, never [N, D].

    Three passes over `cal` (the true logits; thresholds, Platt and the pooled counts; the rates at
    the method's thresholds, which need the global one), three more for the norm rule
    (trainer/threshold_norm.py; eight with `cross`, the logits each half's tau is chosen on when a
    head was adapted on the other half: trainer/row_adapt.py), and one over `test`, which is only
    measured. Equal to the dense computation (tests/trainer/test_calibrate.py).
    """
    from tqdm.auto import tqdm

    target = dict(target or DEFAULT_TARGET)
    kind, value = _check_target(target)
    method = check_method(method)
    if method["name"] == "tail" and kind != "precision":
        raise ValueError("the tail rule needs a precision target (--target-precision)")
    y_cal = _labels(y_cal, num_classes)
    norm = method["name"] == "norm"
    if cross is not None and not norm:
        raise ValueError("cross-fitted logits go with the norm rule")
    passes = 3 + (3 if cross is None else 8) * norm + (test is not None)
    with tqdm(total=passes * num_classes, desc="calibration", unit="class", leave=False,
              disable=None if progress else True) as bar:
        pooled = PooledThreshold(_true_logits(cal, y_cal, num_classes, bar))
        per, a, b = _per_class_pass(cal, y_cal, num_classes, target, pooled, bar, tail=method["name"] == "tail")
        if norm:
            from trainer.threshold_norm import norm_thresholds
            per["norm"] = norm_thresholds(cal, y_cal, num_classes, target, bar, cross=cross)
        global_entry = pooled.choose(target)
        global_t = float(global_entry["threshold"][0])
        threshold = _method_thresholds(per, global_t, method)
        at_t, at_g = _counts_pass(cal, y_cal, num_classes, threshold, global_t, bar)
        per = _with_method(per, method, threshold, _rates(*at_t), kind, value)
        rates_test = None if test is None else _test_rates(test, y_test, num_classes, per["threshold"], global_t, bar)
    out = {
        "target": {kind: value},
        "method": method,
        "decision": "match = logit >= threshold",
        "probability": "sigmoid(a * logit + b)",
        "split": "calibration",
        "examples": int(len(y_cal)),
        "global": _global_entry(global_entry, rates_test),
        "per_class": _per_class_entries(per, a, b, rates_test),
        # the global threshold read per class: how much does one number lose against D numbers?
        "summary": _summary(per, _rates(*at_g), rates_test, kind, value),
    }
    if rates_test is not None:
        out["test_examples"] = rates_test["examples"]
    _assert_finite(out)
    return out


def calibrate(
    logits_cal: np.ndarray,
    y_cal: np.ndarray,
    target: dict | None = None,
    logits_test: np.ndarray | None = None,
    y_test: np.ndarray | None = None,
    method: dict | None = None,
    chunk: int | None = None,
) -> dict:
    """calibration.json content: global and per-class thresholds, Platt (a, b), and the rates.

    logits_cal [N, D], y_cal [N]; the test split (if given) is only measured, never used to choose.
    `method` says how the per-class thresholds are chosen (METHODS; default DEFAULT_METHOD).
    calibrate_chunks over `chunk` columns at a time (default: chunk_classes), so the float64 work
    arrays stay [N, chunk] whatever D.
    """
    logits_cal = np.asarray(logits_cal)
    if logits_cal.ndim != 2:
        raise ValueError(f"logits_cal must be [N, D], got shape {logits_cal.shape}")
    n, num_classes = logits_cal.shape
    if np.shape(y_cal) != (n,):
        raise ValueError(f"y_cal must have shape ({n},), got {np.shape(y_cal)}")
    chunk = chunk or chunk_classes(n, num_classes)
    test = None if logits_test is None else dense_chunks(np.asarray(logits_test), chunk)
    return calibrate_chunks(dense_chunks(logits_cal, chunk), y_cal, num_classes, target, test, y_test, method)


def _assert_finite(obj, where: str = "calibration") -> None:
    """calibration.json must be strict JSON: no NaN or inf anywhere."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _assert_finite(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _assert_finite(v, f"{where}[{i}]")
    elif isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"non-finite value at {where}: {obj}")
