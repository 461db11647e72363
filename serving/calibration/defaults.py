"""The one table of calibration defaults: what export, `slc calibrate` and enrollment use when the user
names nothing, and the parameters of each rule. Each row is the measured choice for the data that
context calibrates on (docs/calibration.md gives the measurements):

- export, a PoLS head with style-shifted copies of the calibration images (a PoLS loss on images):
  norm, which reads each class's widened negative tail ("Calibrating for shifted images");
- export, a PoLS head on clean data (not images, or `--calibration-shift none`): one global
  threshold, the logits of a PoLS head being comparable across classes;
- export, a PoLS head on images whose calibration split is too small for the norm rule (under
  NORM_MIN_NEGATIVES negatives in some class's column, shifted copies counted: its NORM_K highest are
  no tail), when neither the rule nor the shift is named: shrink (kappa 4) on the clean split, a few
  positives per class pulled toward the global cut (docs/results/small-folder-aims.md: there norm
  missed the target's precision, and one global cut fell to recall 0.26 on a model whose columns differ);
- export of a head trained without the PoLS, and `calibrate()` called with no rule: shrink (kappa 4),
  per-class thresholds pulled toward the global one;
- `slc calibrate` on a user's images: norm ("The norm rule": few images per class, a face unlike
  the training ones);
- enrollment: the row rule `auto` (standardised where the bundle carries calibration negatives, else
  imprint; `fitted`, with a cross-fitted threshold of its own, only when named: it raised a small
  folder's enrolled recall but gave away precision on glyphs3755; docs/api.md, "Enroll a class").
"""
from __future__ import annotations

DEFAULT_TARGET = {"precision": 0.99}
KAPPA = 4.0  # shrink: pseudo-count of the global threshold against a class's positives
TAIL_K = 20  # tail: the highest negatives per column its exponential is fitted to
NORM_K = 100  # norm: the highest negatives per column whose mean and spread standardise it
# norm, as export's automatic choice: the fewest negatives a class's column must hold (shifted copies
# counted) for its NORM_K highest, and each cross-fitting half's NORM_K / 2 highest of its half, to be
# at most a quarter of them: a tail, not the whole column
NORM_MIN_NEGATIVES = 4 * NORM_K

RULE_DEFAULTS = {
    "export pols style": {"name": "norm"},
    "export pols clean": {"name": "global"},
    "export small split": {"name": "shrink", "kappa": KAPPA},
    "not pols": {"name": "shrink", "kappa": KAPPA},
    "calibrate": {"name": "norm"},
}
ENROLL_RULE = "auto"  # SLC_ENROLL_RULE: imprint, standardised or fitted, chosen by the bundle (serving/core/enrollment.py)
ENROLL_THRESHOLD = "global"  # SLC_ENROLL_THRESHOLD: the bundle's global threshold for an enrolled class

BETAS = (0.25, 0.5, 1.0)  # --adapt-rows: the steps, in units of each row's length, the halves choose among
# --adapt-rows with the bundle's calibration examples kept (keep.py): at most this many of them (a seeded
# sample), and the fractions of the step a row may take, the largest that loses none of its kept positives
KEEP_EXAMPLES = 10_000
KEEP_FRACTIONS = (0.0, 0.25, 0.5, 1.0)

# the rules the cross-validated choice (`--threshold-method cv`) weighs, in its order
CV_CANDIDATES = ({"name": "global"}, {"name": "tail"}, {"name": "norm"}, {"name": "shrink", "kappa": KAPPA},
                 {"name": "per_class"})


def norm_has_tail(y, num_classes: int, copies: int = 1) -> bool:
    """Whether every class's column holds NORM_MIN_NEGATIVES negatives: the other classes' examples of
    `y` (labels [N]), each counted `copies` times (the shifted copies export calibrates on)."""
    import numpy as np

    counts = np.bincount(np.asarray(y, dtype=np.int64), minlength=num_classes)
    return bool(copies * (len(y) - counts.max(initial=0)) >= NORM_MIN_NEGATIVES)


def default_rule(pols: bool, shift: str = "none") -> dict:
    """export's rule when none is named: by the loss and whether it calibrates on shifted copies."""
    if not pols:
        return dict(RULE_DEFAULTS["not pols"])
    return dict(RULE_DEFAULTS["export pols style" if shift == "style" else "export pols clean"])
