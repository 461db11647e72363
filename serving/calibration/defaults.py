"""The one table of calibration defaults: what export, `slc calibrate` and enrollment use when the user
names nothing, and the parameters of each rule. Each row is the measured choice for the data that
context calibrates on (docs/calibration.md gives the measurements):

- export, a PoLS head with style-shifted copies of the calibration images (a PoLS loss on images):
  norm, which reads each class's widened negative tail ("Calibrating for shifted images");
- export, a PoLS head on clean data (not images, or `--calibration-shift none`): one global
  threshold, the logits of a PoLS head being comparable across classes;
- export of a head trained without the PoLS, and `calibrate()` called with no rule: shrink (kappa 4),
  per-class thresholds pulled toward the global one;
- `slc calibrate` on a user's images: norm ("The norm rule": few images per class, a face unlike
  the training ones);
- enrollment: the row rule `auto` and the bundle's global threshold (docs/api.md, "Enroll a class").
"""
from __future__ import annotations

DEFAULT_TARGET = {"precision": 0.99}
KAPPA = 4.0  # shrink: pseudo-count of the global threshold against a class's positives
TAIL_K = 20  # tail: the highest negatives per column its exponential is fitted to
NORM_K = 100  # norm: the highest negatives per column whose mean and spread standardise it

RULE_DEFAULTS = {
    "export pols style": {"name": "norm"},
    "export pols clean": {"name": "global"},
    "not pols": {"name": "shrink", "kappa": KAPPA},
    "calibrate": {"name": "norm"},
}
ENROLL_RULE = "auto"  # SLC_ENROLL_RULE: imprint or standardised, chosen by the bundle (serving/core/enrollment.py)
ENROLL_THRESHOLD = "global"  # SLC_ENROLL_THRESHOLD: the bundle's global threshold for an enrolled class

BETAS = (0.25, 0.5, 1.0)  # --adapt-rows: the steps, in units of each row's length, the halves choose among
# --adapt-rows with the bundle's calibration examples kept (keep.py): at most this many of them (a seeded
# sample), and the fractions of the step a row may take, the largest that loses none of its kept positives
KEEP_EXAMPLES = 10_000
KEEP_FRACTIONS = (0.0, 0.25, 0.5, 1.0)

# the rules the cross-validated choice (`--threshold-method cv`) weighs, in its order
CV_CANDIDATES = ({"name": "global"}, {"name": "tail"}, {"name": "norm"}, {"name": "shrink", "kappa": KAPPA},
                 {"name": "per_class"})


def default_rule(pols: bool, shift: str = "none") -> dict:
    """export's rule when none is named: by the loss and whether it calibrates on shifted copies."""
    if not pols:
        return dict(RULE_DEFAULTS["not pols"])
    return dict(RULE_DEFAULTS["export pols style" if shift == "style" else "export pols clean"])
