"""The threshold rules, one implementation each behind one small interface, and their registry.

A rule turns what one calibration pass learned (each class's own cut, its positives, the pooled
global threshold) into D thresholds. per_class keeps each column's cut; global uses the pooled one;
shrink pulls each cut toward the global one by a pseudo-count kappa, (n_j t_j + kappa t_g) / (n_j + kappa);
tail reads each column's threshold off the upper tail of its negatives (an exponential fitted to the
TAIL_K highest, where the expected false matches keep the target precision); norm is one threshold on
the logits standardised by each column's NORM_K highest negatives, cross-fitted (norm.py).
Why each exists and when it wins: docs/calibration.md. numpy only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from serving.calibration.chunks import Logits
from serving.calibration.counts import check_target
from serving.calibration.defaults import KAPPA, NORM_K, RULE_DEFAULTS, TAIL_K


@dataclass
class Fit:
    """What a rule may read: the pass's per-class results and the logits, to stream again if it must."""

    per: dict  # per-class arrays [D]: threshold (the column's own cut), positives, each column rule's own, Platt
    pooled: dict  # the pooled column's choice (counts.PooledThreshold): threshold, precision, recall, reached [1]
    logits: Logits
    target: dict
    cross: Optional[list] = None  # norm: the logits each half is judged on, when rows were adapted

    @property
    def global_t(self) -> float:
        return float(self.pooled["threshold"][0])


class Rule:
    """One threshold rule. `column`: thresholds [C] of a block of columns, computed in the per-class
    pass (None: the rule needs no such pass); `thresholds`: the D thresholds, as the server stores them."""

    name = ""
    precision_only = False  # a recall target has no meaning for it
    min_images = 1  # the fewest examples it can fit on
    cross_fitted = False  # takes `cross`: per half, the logits of a head adapted on the other half
    extra_passes = 0  # passes over the logits beyond the per-class ones

    def params(self, method: dict) -> dict:
        return {"name": self.name}

    def column(self, scores: np.ndarray, positive: np.ndarray, target: dict, method: dict) -> Optional[np.ndarray]:
        return None

    def thresholds(self, fit: Fit, method: dict) -> np.ndarray:
        raise NotImplementedError


RULES: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    RULES[rule.name] = rule
    return rule


def stored(threshold: np.ndarray) -> np.ndarray:
    """Thresholds as stored and compared by the server: float32, read back as float64."""
    return np.asarray(threshold).astype(np.float32).astype(np.float64)


class PerClass(Rule):
    name = "per_class"

    def thresholds(self, fit: Fit, method: dict) -> np.ndarray:
        return fit.per["threshold"]  # as chosen


class Global(Rule):
    name = "global"

    def thresholds(self, fit: Fit, method: dict) -> np.ndarray:
        return stored(np.full(len(fit.per["positives"]), fit.global_t))


class Shrink(Rule):
    name = "shrink"

    def params(self, method: dict) -> dict:
        kappa = float(method.get("kappa", KAPPA))
        if not (kappa > 0 and math.isfinite(kappa)):
            raise ValueError(f"shrink needs kappa > 0, got {kappa}")
        return {"name": "shrink", "kappa": kappa}

    def thresholds(self, fit: Fit, method: dict) -> np.ndarray:
        n, kappa = fit.per["positives"].astype(np.float64), method["kappa"]
        return stored((n * fit.per["threshold"] + kappa * fit.global_t) / (n + kappa))


class Tail(Rule):
    name = "tail"
    precision_only = True

    def params(self, method: dict) -> dict:
        return {"name": "tail", "k": TAIL_K}

    def column(self, scores: np.ndarray, positive: np.ndarray, target: dict, method: dict) -> np.ndarray:
        return tail_thresholds(scores, positive, target, method.get("k", TAIL_K))

    def thresholds(self, fit: Fit, method: dict) -> np.ndarray:
        return stored(fit.per["tail"])


class Norm(Rule):
    name = "norm"
    min_images = 2  # two halves, each standardised by the other
    cross_fitted = True
    extra_passes = 2  # the true logits are the per-class pass's

    def params(self, method: dict) -> dict:
        return {"name": "norm", "k": NORM_K}

    def thresholds(self, fit: Fit, method: dict) -> np.ndarray:
        from serving.calibration import norm

        if "norm" not in fit.per:
            fit.per["norm"] = norm.thresholds(fit.logits, fit.target, cross=fit.cross)
        return stored(fit.per["norm"])


for _rule in (PerClass(), Global(), Shrink(), Tail(), Norm()):
    register(_rule)
METHODS = tuple(RULES)  # per_class, global, shrink, tail, norm


def check_method(method: dict | None) -> dict:
    """The rule's full parameters (`method` None: the table's default for a head without the PoLS)."""
    method = dict(method or RULE_DEFAULTS["not pols"])
    if method.get("name") not in RULES:
        raise ValueError(f"threshold method must be one of {', '.join(METHODS)}, got {method.get('name')!r}")
    return RULES[method["name"]].params(method)


def tail_thresholds(scores: np.ndarray, positive: np.ndarray, target: dict, k: int = TAIL_K) -> np.ndarray:
    """Per column of `scores` [N, C], the tail rule's threshold [C] for a precision target p.

    Column j's negatives above u (the lowest of its k highest) are taken as exponential with mean
    excess beta (their mean excess over u), so E[negatives >= t] = k exp(-(t - u) / beta). t is where
    that equals the false matches precision p allows if all n_j positives match: n_j (1 - p) / p,
    i.e. t = u + beta ln(k p / (n_j (1 - p))). A class with no positive never matches (as in
    choose_thresholds); one with under 2 negatives matches above its highest negative.
    """
    kind, p = check_target(target)
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
