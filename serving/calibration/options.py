"""`slc calibrate`'s options resolved against the bundle (the recipe: recalibrate.py): the target (the
bundle's unless given), the rule (the defaults table's, `cv` for the one cross-validation picks) with
its parameters, and what --adapt-rows asks for; one line for any combination that cannot be honoured."""
from __future__ import annotations

from dataclasses import dataclass

import click

from serving.calibration.choose import CV
from serving.calibration.defaults import RULE_DEFAULTS
from serving.calibration.rules import RULES, check_method

DEFAULT_RULE = RULE_DEFAULTS["calibrate"]["name"]  # docs/calibration.md, "The norm rule"
DEFAULT_METHOD = RULE_DEFAULTS["not pols"]  # a bundle that names no rule


@dataclass
class Options:
    target: dict
    method: dict
    skip_bad: bool
    adapt: float | str | None = None  # --adapt-rows: None (off), "auto" (step chosen) or the step
    keep: bool = True  # --adapt-rows: fitted against the bundle's calibration examples too, when it has them (keep.py)


def resolve_options(calibration: dict, target_precision: float | None = None, target_recall: float | None = None,
                    method_name: str | None = None, kappa: float | None = None, skip_bad: bool = False,
                    adapt: bool = False, step: float | None = None, keep: bool = True) -> Options:
    """The bundle's target unless given; the method given (its kappa the bundle's, for shrink), else the
    norm rule (norm.py); cv: chosen by cross-validation on the images (choose.py).
    adapt: the rows moved toward the images too (adapt.py), by `step` or a chosen one; `keep`: against
    the bundle's own calibration examples too (keep.py)."""
    if target_precision is not None and target_recall is not None:
        raise click.UsageError("give --target-precision or --target-recall, not both")
    if step is not None and not adapt:
        raise click.UsageError("--adapt-step goes with --adapt-rows")
    if adapt and (method_name or DEFAULT_RULE) != "norm":
        raise click.UsageError("--adapt-rows sets the norm rule's thresholds for the moved rows: "
                               "leave out --threshold-method (or give norm)")
    target = ({"precision": target_precision} if target_precision is not None else
              {"recall": target_recall} if target_recall is not None else dict(calibration.get("target") or {}))
    if list(target) not in (["precision"], ["recall"]):
        raise click.UsageError(f"the bundle's target {target} is not a precision or recall: give --target-precision P")
    old = calibration.get("method") or DEFAULT_METHOD
    name = method_name or DEFAULT_RULE
    if kappa is not None and name != "shrink":
        raise click.UsageError("--kappa goes with --threshold-method shrink")
    if name == CV:
        return Options(target, {"name": CV}, skip_bad)
    if name in RULES and RULES[name].precision_only and "recall" in target:
        raise click.UsageError(f"--threshold-method {name} needs a precision target: give --target-precision P")
    if kappa is None:
        kappa = old.get("kappa", DEFAULT_METHOD["kappa"]) if old.get("name") == "shrink" else DEFAULT_METHOD["kappa"]
    try:
        method = check_method({"name": name, "kappa": kappa})
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return Options(target, method, skip_bad, (step if step is not None else "auto") if adapt else None, keep)
