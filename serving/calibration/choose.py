"""The threshold rule chosen by 2-fold cross-validation on the data it will be fitted on.

Why: which rule holds depends on the data. On faces the model fits well one global threshold
recalls the most at the target; on a face it separates poorly (a user's brush scans), the pooled
negatives force that threshold so high that it recalls almost nothing, and per-class thresholds
read off each column's negative tail (tail), or one threshold on logits standardised by each
column's negatives (norm), recall more at the same precision (docs/calibration.md, "The tail
rule", "The norm rule"). The user's own images say which case they are in.

Each class's examples are split in two folds (seeded); every candidate rule is fitted on one fold
and judged on the other, both ways, by what detect would do: pooled precision (true matches over
matches) and mean per-class recall. A rule is acceptable when its pooled precision (recall, for a
recall target) is within two binomial standard errors of the target; among those, the one with
the higher other figure wins; if none is, the one closest to the target. numpy only.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from serving.calibration.estimator import per_class_pass
from serving.calibration.chunks import Chunks, Logits
from serving.calibration.counts import check_target, class_counts
from serving.calibration.defaults import CV_CANDIDATES as CANDIDATES
from serving.calibration.rules import RULES, check_method

CV = "cv"  # the method name that asks for this choice (slc calibrate --threshold-method cv)
FOLDS = 2
SEED = 0


def folds(y: np.ndarray, seed: int = SEED) -> np.ndarray:
    """[N] fold of each example: each class's examples shuffled (seeded) and dealt out in turn."""
    y = np.asarray(y, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    order = order[np.argsort(y[order], kind="stable")]  # by class, shuffled within
    first = np.searchsorted(y[order], y[order], side="left")  # [N] where each example's class starts
    out = np.empty(len(y), dtype=np.int64)
    out[order] = (np.arange(len(y)) - first) % FOLDS
    return out


def fit_rules(logits: Logits, target: dict, methods) -> list[np.ndarray]:
    """Each method's thresholds [D] fitted on `logits`: two passes (two more for norm), no Platt fits."""
    fit = per_class_pass(logits, target, methods=tuple(methods), platt=False)
    return [RULES[m["name"]].thresholds(fit, m) for m in methods]


def choose(chunks_of: Callable[[np.ndarray], Chunks], y: np.ndarray, num_classes: int, target: dict,
           candidates=CANDIDATES, seed: int = SEED, progress: bool = False) -> tuple[dict, dict]:
    """(the chosen method, the record of every candidate's cross-validated figures).
    `chunks_of(rows)` gives the logits of those rows in class chunks."""
    from tqdm.auto import tqdm

    # per fold: fit (2, + the most any candidate adds: 2 for norm), judge (1)
    passes = 3 + max(RULES[m["name"]].extra_passes for m in candidates)
    with tqdm(total=passes * FOLDS * num_classes, desc="choosing the rule", unit="class", leave=False,
              disable=None if progress else True) as bar:
        return _choose(chunks_of, y, num_classes, target, candidates, seed, bar)


def choose_rule(method: dict, bundle_method: dict | None, chunks_of: Callable[[np.ndarray], Chunks], y: np.ndarray,
                num_classes: int, target: dict, progress: bool = False) -> tuple[dict, dict | None]:
    """(the rule to fit, the record of its choice or None): `method` itself, unless it is {"name": CV}:
    then the one cross-validation picks (choose), or where no class has 2 images to cross-validate on,
    the bundle's own rule `bundle_method` (the defaults table's when it names none, or names tail
    under a recall target)."""
    if method["name"] != CV:
        return method, None
    if np.bincount(y).max(initial=0) >= 2:
        return choose(chunks_of, y, num_classes, target, progress=progress)
    chosen = check_method(bundle_method)
    if RULES[chosen["name"]].precision_only and "recall" in target:
        chosen = check_method(None)
    return chosen, {"by": "the bundle's rule (no class has 2 images to cross-validate on)", "chosen": chosen["name"],
                    "candidates": []}


def _choose(chunks_of, y: np.ndarray, num_classes: int, target: dict, candidates, seed: int, bar) -> tuple[dict, dict]:
    kind, value = check_target(target)
    fold = folds(y, seed)
    fitted_on = min(int((fold != f).sum()) for f in range(FOLDS))  # the fewest images a fold is fitted on
    methods = [check_method(m) for m in candidates if (kind == "precision" or not RULES[m["name"]].precision_only)
               and RULES[m["name"]].min_images <= fitted_on]
    tp, matches, positives = (np.zeros((len(methods), num_classes)) for _ in range(3))
    for f in range(FOLDS):
        fit_rows, judge_rows = np.flatnonzero(fold != f), np.flatnonzero(fold == f)
        if len(fit_rows) == 0 or len(judge_rows) == 0:
            raise ValueError("cross-validation needs at least 2 images of some class")
        fitted = fit_rules(Logits(chunks_of(fit_rows), y[fit_rows], num_classes, bar), target, methods)
        for i, c in enumerate(class_counts(Logits(chunks_of(judge_rows), y[judge_rows], num_classes, bar), fitted)):
            tp[i] += c[0]
            matches[i] += c[1]
            positives[i] += c[2]
    rows = [_figures(m, tp[i], matches[i], positives[i], kind, value) for i, m in enumerate(methods)]
    best = _pick(rows)
    return methods[best], {"by": f"{FOLDS}-fold cross-validation on the fitted images (seed {seed})",
                           "chosen": rows[best]["method"], "candidates": rows}


def _figures(method: dict, tp: np.ndarray, matches: np.ndarray, positives: np.ndarray, kind: str,
             value: float) -> dict:
    has = positives > 0
    precision = float(tp.sum() / matches.sum()) if matches.sum() else 1.0
    recall = float((tp[has] / positives[has]).mean()) if has.any() else 0.0
    n = matches.sum() if kind == "precision" else positives.sum()
    primary = precision if kind == "precision" else float(tp.sum() / max(positives.sum(), 1))
    slack = 2 * math.sqrt(value * (1 - value) / max(n, 1))  # two binomial standard errors at the target
    return {"method": method["name"], "pooled_precision": precision, "mean_recall": recall,
            "matches": int(matches.sum()), "acceptable": bool(primary >= value - slack),
            "_primary": primary, "_secondary": recall if kind == "precision" else precision}


def _pick(rows: list[dict]) -> int:
    """The acceptable row with the best secondary figure, else the row with the best primary one."""
    ok = [i for i, r in enumerate(rows) if r["acceptable"]]
    best = max(ok, key=lambda i: rows[i]["_secondary"]) if ok else max(range(len(rows)), key=lambda i: rows[i]["_primary"])
    for r in rows:
        r.pop("_primary")
        r.pop("_secondary")
    return best
