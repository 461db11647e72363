"""The rule that turns a few examples into a class row (issue 38): no protocol, no store, no state,
so that measurement can swap it for another (docs/api.md "Enroll a class").

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
from typing import Optional

import numpy as np

from serving.bundle.class_row import ClassRow
from serving.bundle.names import class_name_problem, shown
from serving.errors import InvalidInput

RULE = "imprint"  # the name the answers and the store carry
THRESHOLD_RULES = ("global", "negatives")
NORM_CHUNK = 65_536  # rows per chunk when the trained norms are measured (the head stays mapped)


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


def rejects_all(row: ClassRow, h: np.ndarray) -> bool:
    """Whether the row's threshold says no to every example h [n, d] the row was made from: then it is no
    threshold for this class (a small model's global threshold can sit above a new class's logits), and
    the negatives rule takes over where the bundle carries negatives."""
    z = np.asarray(h, dtype=np.float64) @ np.asarray(row.row, dtype=np.float64) + float(row.bias)  # [n]
    return bool(len(z)) and bool((z < row.threshold).all())


def negatives_threshold(row: ClassRow, h_pos: np.ndarray, h_neg: np.ndarray, num_trained: int,
                        target_precision: float) -> Optional[float]:
    """A per-class threshold from the bundle's calibration negatives h_neg [N, d] (embeddings of the
    calibration split, none of them of the new class) and the examples h_pos [n, d].

    The examples stand in for the class's positives, weighted so that together they count as an
    average class's share of the sample (N / D, the number of positives a trained class has there);
    the threshold is the lowest logit t at which the weighted precision TP(t) / (TP(t) + FP(t)) reaches
    the target. None when no t does (the caller keeps the global threshold). The examples built the
    row, so this precision is optimistic: a measurement, not this rule, says how far."""
    w, b = row.row.astype(np.float64), float(row.bias)
    z_pos = np.asarray(h_pos, dtype=np.float64) @ w + b  # [n]
    z_neg = np.asarray(h_neg, dtype=np.float64) @ w + b  # [N]
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
