"""Calibration: thresholds on a head's logits, one package for export, `slc calibrate` and the server.

numpy only (no torch), so a server-only install recalibrates too. Modules:
chunks (logits in class chunks, the one way a head's D columns are read) · counts (the cut that meets a
target, per column and pooled) · platt (probabilities) · rules (per_class, global, shrink, tail, norm: one
interface, one registry) · norm (the norm rule's estimator) · estimator (calibration.json) · choose (the rule
chosen by cross-validation) · adapt (head rows moved toward a user's images) · support (what the calibration images can show) ·
defaults (the one table of defaults) · recalibrate + images + measure + cli (`slc calibrate`).
"""
from serving.calibration.estimator import calibrate, calibrate_chunks, per_class_pass
from serving.calibration.chunks import Chunks, chunk_classes, dense_chunks, head_chunks
from serving.calibration.counts import check_target, choose_thresholds, class_thresholds, rates_at
from serving.calibration.defaults import DEFAULT_TARGET, RULE_DEFAULTS, default_rule
from serving.calibration.platt import fit_platt
from serving.calibration.rules import METHODS, RULES, check_method, tail_thresholds

__all__ = [
    "DEFAULT_TARGET", "METHODS", "RULES", "RULE_DEFAULTS", "Chunks", "calibrate", "calibrate_chunks", "check_method",
    "check_target", "choose_thresholds", "chunk_classes", "class_thresholds", "default_rule", "dense_chunks",
    "fit_platt", "head_chunks", "per_class_pass", "rates_at", "tail_thresholds",
]
