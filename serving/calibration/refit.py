"""The thresholds of `slc calibrate` (the recipe: recalibrate.py): the rule (cv: the one cross-validation
picks, choose.py), the export's estimator on the logits W·h + b of the rows being calibrated, class chunk
by class chunk (never [N, D]), and the previous entries of the classes without an image, kept, as are the
bundle's look-alike pairs (calibration.json `lookalikes`)."""
from __future__ import annotations

import numpy as np

from serving.calibration.choose import choose_rule
from serving.calibration.chunks import chunk_classes, head_chunks
from serving.calibration.estimator import calibrate_chunks
from serving.calibration.options import Options
from serving.core.lookalikes import DECISION_WITH_PAIRS

KEPT_RULE = ("a class with no image in the recalibration data keeps its entry of the calibration this one "
             "replaced (threshold, Platt parameters, rates), marked kept: true")


def fit(old: dict, weight, bias: np.ndarray, h: np.ndarray, y: np.ndarray, h_test: np.ndarray | None,
        y_test: np.ndarray | None, opts: Options, cross=None, present: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
    """(calibration.json content, the thresholds [D] the server will compare with: float32, as it stores
    them) for rows `weight` [D, d] and `bias` [D] on images h [n, d] of classes y [n]; `old`: the
    calibration replaced (its rule, for cv with too few images; its entries, kept); `cross`:
    calibrate_chunks' cross-fitted logits; `present` [D]: the classes recalibrated (default: those in y)."""
    D = len(weight)
    chunk = chunk_classes(max(len(y), 0 if y_test is None else len(y_test)), D)
    has_test = y_test is not None and len(y_test) > 0
    opts.method, choice = choose_rule(opts.method, old.get("method"),
                                      lambda rows: head_chunks(h[rows], weight, bias, chunk), y, D, opts.target,
                                      progress=True)
    cal = calibrate_chunks(head_chunks(h, weight, bias, chunk), y, D, opts.target,
                           head_chunks(h_test, weight, bias, chunk) if has_test else None,
                           y_test if has_test else None, method=opts.method, progress=True, cross=cross)
    present = np.bincount(y, minlength=D) > 0 if present is None else present  # [D]
    for j in np.flatnonzero(~present):
        cal["per_class"][j] = {**old["per_class"][j], "kept": True}
    cal["split"] = "recalibration"
    if "lookalikes" in old:  # the classes' look-alike pairs (`slc bundle fold`): thresholds change, pairs do not
        cal["lookalikes"], cal["decision"] = old["lookalikes"], DECISION_WITH_PAIRS
    if choice is not None:
        cal["method_choice"] = choice
    threshold = np.array([e["threshold"] for e in cal["per_class"]], dtype=np.float32)  # [D] as the server keeps it
    return cal, threshold
