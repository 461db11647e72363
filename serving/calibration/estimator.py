"""calibration.json from a head's logits: per-class and global thresholds by a rule (rules.py), Platt
scaling (platt.py), and the rates they give, on the calibration split and, measured only, the test
split (docs/bundle-format.md). Bounded memory: the logits are read class chunk by class chunk
(chunks.py: [N, c] at a time, never [N, D]). numpy only.
"""
from __future__ import annotations

import math

import numpy as np

from serving.calibration.chunks import Chunks, Logits, chunk_classes, dense_chunks
from serving.calibration.counts import KERNEL_VALUES, PooledThreshold, check_target, class_thresholds, measured_rates
from serving.calibration.defaults import DEFAULT_TARGET
from serving.calibration.platt import fit_platt
from serving.calibration.rules import RULES, Fit, Rule, check_method


def _f(x) -> float:
    """A numpy number as a plain float, for JSON."""
    return float(x)


def per_class_pass(logits: Logits, target: dict, methods: tuple = (), platt: bool = True,
                   cross: list | None = None) -> Fit:
    """What every rule reads, in one pass (each class needs its own column only): each class's own cut,
    those of the `methods` that read one column at a time (under their names), Platt fits (platt_a,
    platt_b; unless not), and the pooled column's cut, counted on the way. `cross`: the norm rule's."""
    columns = [m for m in methods if type(RULES[m["name"]]).column is not Rule.column]
    pooled = PooledThreshold(logits.true)
    parts, a, b = [], [], []
    for first, z in logits:
        if not np.isfinite(z).all():
            raise ValueError("calibration logits contain NaN or inf")
        positive = logits.positive(first, z.shape[1])  # [N, c]
        group = max(1, KERNEL_VALUES // len(logits.y))
        for g in range(0, z.shape[1], group):
            part = class_thresholds(z[:, g:g + group], positive[:, g:g + group], target)
            for m in columns:
                part[m["name"]] = RULES[m["name"]].column(z[:, g:g + group], positive[:, g:g + group], target, m)
            parts.append(part)
            if platt:
                a_g, b_g = fit_platt(z[:, g:g + group], positive[:, g:g + group])
                a.append(a_g)
                b.append(b_g)
        pooled.add(z)
    per = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    if platt:
        per["platt_a"], per["platt_b"] = np.concatenate(a), np.concatenate(b)
    return Fit(per, pooled.choose(target), logits, target, cross)


def per_class_entries(per: dict, a: np.ndarray, b: np.ndarray, test: dict | None) -> list[dict]:
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


def global_entry(pooled: dict, test: dict | None) -> dict:
    entry = {
        "threshold": float(pooled["threshold"][0]),
        "precision": _f(pooled["precision"][0]),
        "recall": _f(pooled["recall"][0]),
        "reached": bool(pooled["reached"][0]),
    }
    if test is not None:
        entry["test"] = {"precision": _f(test["global"]["precision"][0]), "recall": _f(test["global"]["recall"][0])}
    return entry


def summary(per: dict, per_at_global: dict, test: dict | None, kind: str, value: float) -> dict:
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


def _with_method(per: dict, method: dict, threshold: np.ndarray, figures: dict, kind: str, value: float) -> dict:
    """The per-class entries of `method`: its thresholds and their calibration rates (per_class: as chosen)."""
    if method["name"] == "per_class":
        return per
    return {**per, "threshold": threshold, "precision": figures["precision"], "recall": figures["recall"],
            "reached": (figures[kind] >= value - 1e-12) & (per["positives"] > 0)}


def calibrate_chunks(cal: Chunks, y_cal: np.ndarray, num_classes: int, target: dict | None = None,
                     test: Chunks | None = None, y_test: np.ndarray | None = None, method: dict | None = None,
                     progress: bool = False, cross: list[Chunks] | None = None) -> dict:
    """calibration.json content from logits in class chunks (`Chunks`): [N, c] at a time, never [N, D].

    Three passes over `cal` (the true logits; thresholds, Platt and the pooled counts; the rates at
    the method's thresholds, which need the global one), two more for the norm rule (norm.py;
    seven with `cross`, the logits each half's tau is chosen on when a head was adapted on the other
    half: adapt.py), and one over `test`, which is only measured. Equal to the dense computation.
    """
    from tqdm.auto import tqdm

    target = dict(target or DEFAULT_TARGET)
    kind, value = check_target(target)
    method = check_method(method)
    rule = RULES[method["name"]]
    if rule.precision_only and kind != "precision":
        raise ValueError(f"the {rule.name} rule needs a precision target (--target-precision)")
    if cross is not None and not rule.cross_fitted:
        raise ValueError(f"cross-fitted logits go with the norm rule, not {rule.name}")
    passes = 3 + (rule.extra_passes if cross is None else 1 + 3 * len(cross)) + (test is not None)
    with tqdm(total=passes * num_classes, desc="calibration", unit="class", leave=False,
              disable=None if progress else True) as bar:
        logits = Logits(cal, y_cal, num_classes, bar).checked()
        fit = per_class_pass(logits, target, methods=(method,), cross=cross)
        threshold = rule.thresholds(fit, method)
        rates_cal = measured_rates(logits, threshold, fit.global_t)
        rates_test = None if test is None else measured_rates(Logits(test, y_test, num_classes, bar), threshold,
                                                              fit.global_t)
    per = _with_method(fit.per, method, threshold, rates_cal["per_class"], kind, value)
    out = {
        "target": {kind: value},
        "method": method,
        "decision": "match = logit >= threshold",
        "probability": "sigmoid(a * logit + b)",
        "split": "calibration",
        "examples": int(len(logits.y)),
        "global": global_entry(fit.pooled, rates_test),
        "per_class": per_class_entries(per, per["platt_a"], per["platt_b"], rates_test),
        # the global threshold read per class: how much does one number lose against D numbers?
        "summary": summary(per, rates_cal["per_class_at_global"], rates_test, kind, value),
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
    `method` says how the per-class thresholds are chosen (rules.METHODS; default: the defaults table's
    rule for a head trained without the PoLS).
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
