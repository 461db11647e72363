"""The rule that turns a few examples into a class row (issue 38): no protocol, no store, no state,
so that measurement can swap it for another (docs/api.md "Enroll a class").

The default where the bundle carries calibration negatives and a class has 2 examples or more,
`fitted` (issue 50, at the end of this module): the row is an L2-regularised logistic regression of
the examples against the negatives (numpy Newton steps, `logistic_fit`), its logits mapped onto a
typical trained class's scale on the negatives, with a threshold of its own chosen on cross-fitted
scores (each example scored by the regression fitted without it) at the bundle's target precision.
Measured: docs/results/small-folder-aims.md, "After: a row fitted against the calibration negatives".
Otherwise one of the rules below (`standardised` with negatives, `imprint` without).

Baseline, "imprinting" (Qi, Brown & Lowe 2018, "Low-shot learning with imprinted weights"):

  e_i   = h_i / |h_i|                       each example's embedding, normalised   [n, d]
  m     = mean_i e_i                         their mean                             [d]
  w     = s · m / |m|,  s = median_j |W_j|  the row: the mean's direction at the norm of a typical trained row
  b     = median_j b_j                       the bias of a typical trained class
  a, c  = median_j a_j, median_j c_j         Platt a / b of a typical trained class
  t     = the bundle's global threshold (calibration.json `global`): PoLS logits are comparable
          across classes, so one threshold serves a new class as it serves the trained ones;
          or, with threshold="negatives" and a bundle that carries calibration negatives
          (calibration_embeddings.npy), `negatives_threshold` below.

An example whose embedding has norm 0, a non-finite embedding, or a mean of norm 0 (examples
that cancel out) gives no direction: one 422 each (InvalidInput).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from serving.bundle.class_row import ClassRow
from serving.bundle.names import class_name_problem, shown
from serving.errors import InvalidInput

RULE = "imprint"  # the name the answers and the store carry
THRESHOLD_RULES = ("global", "negatives")
NORM_CHUNK = 65_536  # rows per chunk when the trained norms are measured (the head stays mapped)

# h [m, d] -> [m] float64 >= 0: on each input, the margin (logit - threshold) the new class must reach to be
# its match as the server decides: the largest margin of the look-alikes it is decided against, floored at 0
# (serving/core/lookalikes.py `exclude`: a match is kept unless a look-alike passes by more). The rules that
# choose a threshold on examples and negatives choose it on logit - rival(h), so that the precision they aim
# at is that of the decision the server makes, not of logit >= threshold alone.
Rival = Callable[[np.ndarray], np.ndarray]


def no_rival(h: np.ndarray) -> np.ndarray:
    """A class with no look-alike: logit >= threshold alone."""
    return np.zeros(len(h))


def check_name(name: str) -> str:
    """A name every route can address (serving/bundle/names.py `class_name_problem`, the rule fold
    shares); 422 invalid_class_name otherwise."""
    if problem := class_name_problem(name):
        what = f"the class name {shown(name)}" if type(name) is str and name else "the class name"
        raise InvalidInput(f"{what} {problem}", code="invalid_class_name")
    return name


@dataclass(frozen=True)
class HeadStats:
    """What the rule borrows from the trained head: medians over the D classes and the global threshold."""

    row_norm: float
    bias: float
    platt_a: float
    platt_b: float
    threshold: float
    target_precision: float  # calibration.json target (0.99 when it names none): the negatives rule aims at it


def head_stats(weight: np.ndarray, bias: np.ndarray, platt_a: np.ndarray, platt_b: np.ndarray,
               global_threshold: float, target: Optional[dict] = None) -> HeadStats:
    """The trained head's medians, the rows read in chunks (weight [D, d] may be memory-mapped)."""
    norms = np.concatenate([np.linalg.norm(np.asarray(weight[i:i + NORM_CHUNK], dtype=np.float64), axis=1)
                            for i in range(0, weight.shape[0], NORM_CHUNK)])  # [D]
    precision = (target or {}).get("precision", 0.99)
    return HeadStats(row_norm=float(np.median(norms)), bias=_median(bias), platt_a=_median(platt_a),
                     platt_b=_median(platt_b), threshold=float(global_threshold),
                     target_precision=float(precision) if isinstance(precision, (int, float)) else 0.99)


def _median(values: np.ndarray) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(np.median(v)) if v.size else 0.0


def imprint(h: np.ndarray, stats: HeadStats) -> ClassRow:
    """The class row of examples with embeddings h [n, d] (module docstring); 422 when they give no direction."""
    h = np.asarray(h, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] < 1:
        raise InvalidInput("enrolling a class needs at least one example", code="no_examples")
    if not np.isfinite(h).all():
        raise InvalidInput("the model's embedding of these examples is not finite (inputs too large for the network)",
                           code="non_finite_output")
    norms = np.linalg.norm(h, axis=1)  # [n]
    if (zero := np.flatnonzero(norms == 0)).size:
        raise InvalidInput(f"example {int(zero[0])} has an embedding of norm 0: it gives the class no direction",
                           code="degenerate_examples")
    mean = (h / norms[:, None]).mean(axis=0)  # [d]
    size = float(np.linalg.norm(mean))
    if not size > 1e-12 or not math.isfinite(size):
        raise InvalidInput("the examples' normalised embeddings average to zero: they give the class no direction",
                           code="degenerate_examples")
    row = (stats.row_norm / size * mean).astype(np.float32)
    return ClassRow(row=row, bias=stats.bias, threshold=stats.threshold, platt_a=stats.platt_a,
                    platt_b=stats.platt_b, examples=int(h.shape[0]), rule="global")


def rejects_all(row: ClassRow, h: np.ndarray, rival: Rival = no_rival) -> bool:
    """Whether the row's threshold says no to every example h [n, d] the row was made from, as the server
    decides (`rival`): then it is no threshold for this class (a small model's global threshold can sit
    above a new class's logits), and the negatives rule takes over where the bundle carries negatives."""
    z = np.asarray(h, dtype=np.float64) @ np.asarray(row.row, dtype=np.float64) + float(row.bias)  # [n]
    return bool(len(z)) and bool((z - rival(h) < row.threshold).all())


def negatives_threshold(row: ClassRow, h_pos: np.ndarray, h_neg: np.ndarray, num_trained: int,
                        target_precision: float, rival: Rival = no_rival) -> Optional[float]:
    """A per-class threshold from the bundle's calibration negatives h_neg [N, d] (embeddings of the
    calibration split, none of them of the new class) and the examples h_pos [n, d].

    The examples stand in for the class's positives, weighted so that together they count as an
    average class's share of the sample (N / D, the number of positives a trained class has there);
    the threshold is the lowest logit t at which the weighted precision TP(t) / (TP(t) + FP(t)) reaches
    the target. None when no t does (the caller keeps the global threshold). The examples built the
    row, so this precision is optimistic: a measurement, not this rule, says how far. Logits are read
    as the server decides: less `rival`, what the class's look-alikes ask of it on each input."""
    w, b = row.row.astype(np.float64), float(row.bias)
    z_pos = np.asarray(h_pos, dtype=np.float64) @ w + b - rival(h_pos)  # [n]
    z_neg = np.asarray(h_neg, dtype=np.float64) @ w + b - rival(h_neg)  # [N]
    weight = max(len(z_neg) / max(num_trained, 1), 1.0) / len(z_pos)  # each example's share of a class
    candidates = np.unique(np.concatenate([z_pos, z_neg]))  # ascending
    neg_sorted = np.sort(z_neg)
    tp = weight * (len(z_pos) - np.searchsorted(np.sort(z_pos), candidates, side="left"))  # logits >= t
    fp = len(z_neg) - np.searchsorted(neg_sorted, candidates, side="left")
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = tp / (tp + fp)
    ok = np.flatnonzero((tp > 0) & (precision >= target_precision))
    if not ok.size:
        return None
    return float(candidates[ok[0]])


# ------------------------------------------------------------------ standardised imprinting (measured default)
STAT_CLASSES = 512  # trained classes sampled for the typical negative-logit distribution


@dataclass(frozen=True)
class NegativeStats:
    """What a new row is scaled to, from the bundle's calibration negatives: their mean embedding, and
    the median over trained classes of the mean, the spread and the far tail (tail_quantile) of a
    class's logits on images not of it."""

    mean: np.ndarray  # [d] float64
    logit_mean: float
    logit_std: float
    logit_tail: float = math.inf  # inf: no tail known, nothing is shifted
    tail_quantile: float = 1.0


def tail_quantile(n: int) -> float:
    """The farthest quantile n negatives estimate: the second-largest value's (1 - 2/n; the largest
    alone is one image's noise). The global threshold sits beyond every quantile a sample of
    calibration images reaches, so the tail that matters is the farthest one measured."""
    return max(0.5, 1.0 - 2.0 / max(n, 1))


def negative_stats(weight: np.ndarray, bias: np.ndarray, h_neg: np.ndarray, y_neg: np.ndarray,
                   classes: int = STAT_CLASSES, seed: int = 0) -> NegativeStats:
    """NegativeStats over a seeded sample of the trained classes (weight [D, d] may be memory-mapped)."""
    h = np.asarray(h_neg, dtype=np.float64)  # [N, d]
    y = np.asarray(y_neg)
    pick = np.sort(np.random.default_rng(seed).choice(len(bias), size=min(classes, len(bias)), replace=False))
    z = h @ np.asarray(weight[pick], dtype=np.float64).T + np.asarray(bias[pick], dtype=np.float64)  # [N, C]
    other = y[:, None] != pick[None, :]  # [N, C]: images not of the class
    means = np.array([z[other[:, c], c].mean() for c in range(len(pick))])
    stds = np.array([z[other[:, c], c].std() for c in range(len(pick))])
    q = tail_quantile(len(h))
    tails = np.array([np.quantile(z[other[:, c], c], q) for c in range(len(pick))])
    return NegativeStats(h.mean(axis=0), float(np.median(means)), float(np.median(stds)),
                         float(np.median(tails)), q)


def standardised(h: np.ndarray, stats: HeadStats, neg: NegativeStats, h_neg: np.ndarray) -> ClassRow:
    """Imprinting about the negatives' mean, scaled to a trained class's logits: the direction is
    the mean of the examples' normalised embeddings *centred* on the negatives' mean (embeddings
    after a ReLU share a direction: uncentred, a new row scores every image high), and the scale and
    bias make the new class's logits on the negatives as a typical trained class's are there (their
    median mean and spread, then their far tail: the bias is lowered until the new class's
    tail_quantile on the negatives is no higher than a trained class's), so the bundle's global
    threshold means for it what it means for them."""
    centred = imprint(np.asarray(h, dtype=np.float64) - neg.mean, stats)  # direction only (norm set below)
    u = centred.row.astype(np.float64) / np.linalg.norm(centred.row)  # [d] unit
    p = (np.asarray(h_neg, dtype=np.float64) - neg.mean) @ u  # [N] the negatives along it
    spread = float(p.std())
    if not spread > 0:
        raise InvalidInput("the examples' direction does not separate anything in the model's space",
                           code="degenerate_examples")
    scale = neg.logit_std / spread
    row = scale * u  # [d]
    bias = neg.logit_mean - scale * float(p.mean()) - float(row @ neg.mean)
    # the far tail: a new class whose look-alikes are among the negatives scores them higher than a
    # trained class scores its own; lowered until its tail is a typical trained class's (never raised)
    tail = neg.logit_mean + scale * (float(np.quantile(p, neg.tail_quantile)) - float(p.mean()))
    bias -= max(0.0, tail - neg.logit_tail)
    return ClassRow(row=row.astype(np.float32), bias=bias, threshold=stats.threshold, platt_a=stats.platt_a,
                    platt_b=stats.platt_b, examples=centred.examples, rule="global")


# ------------------------------------------------------------------ a row fitted against the negatives (issue 50)
FIT_C = 1.0  # inverse L2 strength on the embeddings scaled to unit RMS norm (measured: docs/results/small-folder-aims.md)
FIT_NEGATIVES = 2048  # calibration negatives the row is fitted on at most (a seeded sample); the rest only score it
FIT_FOLDS = 10  # at most: the examples' cross-fitting folds (one per example up to this)
FIT_MIN_EXAMPLES = 2  # fewer: no example is left to judge a threshold on; the standardised row is made instead
NEWTON_STEPS = 50


def logistic_fit(x: np.ndarray, y: np.ndarray, c: float, sample_weight: Optional[np.ndarray] = None,
                 start: Optional[np.ndarray] = None, tol: float = 1e-10) -> np.ndarray:
    """L2-regularised binary logistic regression by Newton's method: the (w, b) [d + 1] minimising
    0.5 |w|^2 + c * sum_i s_i * log(1 + exp(-y_i (x_i . w + b))), y_i in {0, 1} (as +-1), the
    intercept b not penalised: scikit-learn's LogisticRegression(C=c) objective (lbfgs), solved exactly
    (tests/serving/test_enroll_fitted.py compares the two). x [n, d] float64."""
    x = np.asarray(x, dtype=np.float64)
    n, d = x.shape
    s = np.ones(n) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    sign = np.where(np.asarray(y) > 0, 1.0, -1.0)  # [n]
    xa = np.concatenate([x, np.ones((n, 1))], axis=1)  # [n, d + 1]
    reg = np.ones(d + 1)
    reg[-1] = 0.0  # the intercept is free

    def loss(theta: np.ndarray) -> float:
        m = sign * (xa @ theta)
        return 0.5 * float(reg @ theta ** 2) + c * float(s @ np.logaddexp(0.0, -m))

    theta = np.zeros(d + 1) if start is None else np.asarray(start, dtype=np.float64).copy()
    f = loss(theta)
    for _ in range(NEWTON_STEPS):
        m = sign * (xa @ theta)
        q = 0.5 * (1.0 - np.tanh(0.5 * m))  # sigma(-m), stable
        grad = reg * theta - c * (xa.T @ (s * sign * q))
        hess = (xa.T * (c * s * q * (1.0 - q))) @ xa
        hess[np.diag_indices_from(hess)] += reg + 1e-12
        step = np.linalg.solve(hess, grad)
        decrease = float(grad @ step)
        if decrease < tol * max(1.0, abs(f)):
            break
        t = 1.0
        while t > 1e-8:  # backtracking (Armijo): Newton's full step almost always passes
            g = loss(theta - t * step)
            if g <= f - 1e-4 * t * decrease:
                break
            t *= 0.5
        theta, f = theta - t * step, g
    return theta


def precision_threshold(z_pos: np.ndarray, z_neg: np.ndarray, num_trained: int,
                        target_precision: float) -> Optional[float]:
    """The lowest score t at which the examples' scores z_pos [n] against the negatives' z_neg [N]
    reach the target precision, the examples weighted as an average class's share of the N negatives
    (N / D positives in all, as `negatives_threshold`); placed halfway between that score and the
    next lower score of either kind, so that it sits in the gap rather than on one sample. None when
    no t reaches the target with an example at or above it."""
    z_pos, z_neg = np.asarray(z_pos, dtype=np.float64), np.asarray(z_neg, dtype=np.float64)
    weight = max(len(z_neg) / max(num_trained, 1), 1.0) / len(z_pos)
    candidates = np.unique(np.concatenate([z_pos, z_neg]))  # ascending
    tp = weight * (len(z_pos) - np.searchsorted(np.sort(z_pos), candidates, side="left"))
    fp = len(z_neg) - np.searchsorted(np.sort(z_neg), candidates, side="left")
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = tp / (tp + fp)
    ok = np.flatnonzero((tp > 0) & (precision >= target_precision))
    if not ok.size:
        return None
    i = int(ok[0])
    return float(candidates[i]) if i == 0 else 0.5 * float(candidates[i] + candidates[i - 1])


def fitted(h: np.ndarray, stats: HeadStats, neg: NegativeStats, h_neg: np.ndarray, num_trained: int,
           c: float = FIT_C, max_negatives: int = FIT_NEGATIVES, seed: int = 0, rival: Rival = no_rival) -> ClassRow:
    """A row fitted to the examples h [n, d] (n >= FIT_MIN_EXAMPLES) against the bundle's calibration
    negatives h_neg [N, d], with a threshold of its own (docs/api.md "Enroll a class"):

    1. direction: L2-regularised logistic regression (`logistic_fit`, C = c, classes balanced: the n
       examples weigh as much as the negatives together) on the embeddings divided by the negatives'
       RMS norm (so that c does not depend on the model's embedding scale); at most max_negatives
       negatives (a seeded sample) are fitted on;
    2. threshold: cross-fitted. The examples and the fitted negatives are split into min(n, FIT_FOLDS)
       folds; each fold's examples and negatives are scored by the regression fitted on the other
       folds, negatives never fitted on by the full regression; the score threshold is
       `precision_threshold` on those scores at the bundle's target precision (a threshold judged on
       examples the row was not fitted on), or, when none reaches it (no out-of-fold example scores
       above every negative), just above the highest negative score; each score less what `rival`
       asks there (in score units), so that the precision is that of the server's decision;
    3. scale: the full regression's scores mapped linearly so that its logits on all N negatives have
       a typical trained class's mean and spread there (`NegativeStats`), like `standardised`'s; the
       threshold mapped with them.

    ClassRow.rule is "cv" (the threshold's origin). 422 as `imprint` for examples with no direction."""
    imprint(h, stats)  # the same refusals (no example, non-finite, norm 0, cancelling out)
    h = np.asarray(h, dtype=np.float64)
    h_neg = np.asarray(h_neg, dtype=np.float64)
    n, big_n = len(h), len(h_neg)
    if n < FIT_MIN_EXAMPLES or big_n < 2:
        raise InvalidInput(f"a fitted row needs at least {FIT_MIN_EXAMPLES} examples and 2 negatives",
                           code="no_examples")
    scale = math.sqrt(float(np.mean(np.einsum("ij,ij->i", h_neg, h_neg)))) or 1.0
    rng = np.random.default_rng(seed)
    order = rng.permutation(big_n)
    fit_idx, rest_idx = np.sort(order[:max_negatives]), np.sort(order[max_negatives:])
    xp, xn = h / scale, h_neg[fit_idx] / scale

    def fit(pos: np.ndarray, negs: np.ndarray, start=None) -> np.ndarray:
        x = np.concatenate([pos, negs])
        y = np.r_[np.ones(len(pos)), np.zeros(len(negs))]
        total = len(x)
        sw = np.r_[np.full(len(pos), total / (2.0 * len(pos))), np.full(len(negs), total / (2.0 * len(negs)))]
        return logistic_fit(x, y, c, sw, start)

    full = fit(xp, xn)
    folds = min(n, FIT_FOLDS)
    pos_fold = np.arange(n) % folds
    neg_fold = rng.permutation(len(xn)) % folds
    z_pos, z_neg = np.empty(n), np.empty(len(xn))
    for k in range(folds):
        theta = fit(xp[pos_fold != k], xn[neg_fold != k], start=full)
        z_pos[pos_fold == k] = xp[pos_fold == k] @ theta[:-1] + theta[-1]
        z_neg[neg_fold == k] = xn[neg_fold == k] @ theta[:-1] + theta[-1]
    if rest_idx.size:
        z_neg = np.concatenate([z_neg, h_neg[rest_idx] / scale @ full[:-1] + full[-1]])
    p = h_neg / scale @ full[:-1] + full[-1]  # [N] the full regression's scores of every negative
    spread = float(p.std())
    if not spread > 0:
        raise InvalidInput("the examples' direction does not separate anything in the model's space",
                           code="degenerate_examples")
    a = neg.logit_std / spread  # logit = a * score + b0, a > 0: a margin m in logits is m / a in scores
    b0 = neg.logit_mean - a * float(p.mean())
    z_pos = z_pos - rival(h) / a
    z_neg = z_neg - rival(h_neg[np.concatenate([fit_idx, rest_idx])]) / a  # z_neg's order: fitted, then the rest
    t = precision_threshold(z_pos, z_neg, num_trained, stats.target_precision)
    if t is None:  # no out-of-fold example clears every negative: the threshold just above them all
        t = float(np.nextafter(z_neg.max(), np.inf))
    row = (a / scale) * full[:-1]  # logit = a * score + b0 = row . h + bias
    bias = a * full[-1] + b0
    return ClassRow(row=row.astype(np.float32), bias=float(bias), threshold=float(a * t + b0),
                    platt_a=stats.platt_a, platt_b=stats.platt_b, examples=n, rule="cv")
