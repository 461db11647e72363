"""What `slc calibrate BUNDLE --data imagefolder:DIR | csv:FILE` does (the command: cli.py): a bundle's
thresholds chosen again on the user's own labelled images (docs/calibration.md).

numpy, onnxruntime and Pillow only (no torch, no scikit-learn), so it runs in a server-only install.
In order: the bundle checked (manifest, head, calibration) and the options resolved (target and
method default to the bundle's own); the images listed, matched to the bundle's classes, decoded and
embedded (images.py); the rows adapted (--adapt-rows: adapt.py, keep.py); the rule chosen (cv:
choose.py) and the thresholds fitted by the export's estimator (serving/calibration/estimator.py) on
logits W·h + b of the head rows, class chunk by class chunk (never [N, D]); classes without an image
keep their previous entry; what the new and the previous thresholds give on the images (measure.py)
and what the images can show (support.py); the bundle written with the new calibration
(serving/bundle/recalibration.py), verified before it replaces anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from serving.bundle.recalibration import Source
from serving.calibration.choose import CV, choose_rule
from serving.calibration.chunks import chunk_classes, head_chunks
from serving.calibration.defaults import RULE_DEFAULTS
from serving.calibration.estimator import calibrate_chunks
from serving.calibration.images import Images, read_images
from serving.calibration.measure import measure, previous_thresholds
from serving.calibration.rules import RULES, check_method
DEFAULT_RULE = RULE_DEFAULTS["calibrate"]["name"]  # docs/calibration.md, "The norm rule"
DEFAULT_METHOD = RULE_DEFAULTS["not pols"]  # a bundle that names no rule
KEPT_RULE = ("a class with no image in the recalibration data keeps its entry of the calibration this one "
             "replaced (threshold, Platt parameters, rates), marked kept: true")


@dataclass
class Options:
    target: dict
    method: dict
    skip_bad: bool
    adapt: float | str | None = None  # --adapt-rows: None (off), "auto" (step chosen) or the step
    keep: bool = True  # --adapt-rows: fitted against the bundle's calibration examples too, when it has them (keep.py)


@dataclass
class Outcome:
    """What one `slc calibrate` did, for its summary lines (cli.py)."""

    source: Source
    target: Path
    images: Images
    opts: Options
    cal: dict  # the calibration.json written
    note: dict
    before: dict  # pooled rates of the previous thresholds on the same images


# ------------------------------------------------------------------------------ the recipe
def run(bundle: Path, data: str, out: Path | None, in_place: bool, overwrite: bool, **given) -> Outcome:
    """`slc calibrate`, in order: the output checked, the bundle read, the options resolved (`given`:
    resolve_options' flags), the images listed and embedded, the rows adapted (--adapt-rows), the
    thresholds fitted, their rates measured, the bundle written and verified."""
    from serving.bundle.recalibration import PREVIOUS
    from serving.calibration.keep import union
    from serving.calibration.support import support

    target = output_of(bundle, out, in_place, overwrite)
    source = open_source(bundle)
    opts = resolve_options(source.calibration, **given)
    images, h, y, h_test, y_test = read_images(source, data, opts.skip_bad, opts.method["name"])
    rows, cross, adaptation, kept = adapt_of(source, h, y, opts)
    h_fit, y_fit = (h, y) if kept is None else union(h, y, kept)  # thresholds hold on the kept examples too
    cal, threshold = fit(source, h_fit, y_fit, h_test, y_test, opts, rows, cross,
                         present=np.bincount(y, minlength=len(source.weight)) > 0)
    weight = source.weight if rows is None else rows
    after = measure(h, y, h_test, y_test, weight, source.bias, threshold)
    before = measure(h, y, h_test, y_test, source.weight, source.bias, previous_thresholds(source.calibration),
                     rates_only=True)
    shown = support(head_chunks(h, weight, source.bias, chunk_classes(len(y), len(weight))), y, len(weight),
                    opts.target)  # what the fit images can show at the rows the thresholds are for
    note = recalibration_note(images, y, y_test, len(threshold), adaptation)
    cal.update(recalibration={**note, "kept_rule": KEPT_RULE, "pooled": after, "previous_calibration": PREVIOUS},
               support=shown)
    write(source, cal, target, note, rows, in_place, overwrite)
    return Outcome(source, target, images, opts, cal, note, before)


def write(source: Source, cal: dict, target: Path, note: dict, rows, in_place: bool, overwrite: bool) -> None:
    """The recalibrated bundle staged, verified and swapped in (serving/bundle/recalibration.py); one line if not."""
    from serving.bundle.recalibration import RecalibrationError, write_recalibrated

    try:
        write_recalibrated(source.path, cal, target, note, head=rows, in_place=in_place, overwrite=overwrite)
    except RecalibrationError as exc:
        raise click.ClickException(str(exc)) from None


def recalibration_note(images: Images, y: np.ndarray, y_test, num_classes: int, adaptation: dict | None) -> dict:
    """calibration.json's and the manifest's `recalibration` note: when, on what, which classes."""
    import datetime as _dt

    fitted = int(np.count_nonzero(np.bincount(y, minlength=num_classes)))
    note = {"created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "data": images.name,
            "images": len(y), "test_images": 0 if y_test is None else len(y_test),
            "classes_recalibrated": fitted, "classes_kept": num_classes - fitted}
    if adaptation is not None:
        note["adapted_rows"] = adaptation
    return note


# ------------------------------------------------------------------------------ before any decoding
def output_of(bundle: Path, out: Path | None, in_place: bool, overwrite: bool) -> Path:
    """Where to write: --out, or BUNDLE itself (its symlinks followed) with --in-place; one line for anything else."""
    from serving.bundle.recalibration import RecalibrationError, check_out

    if out is None and not in_place:
        raise click.UsageError("give --out NEW_BUNDLE, or --in-place to replace BUNDLE")
    if out is not None and in_place:
        raise click.UsageError("give --out or --in-place, not both")
    try:
        return check_out(bundle, bundle if in_place else out, in_place, overwrite)
    except RecalibrationError as exc:
        raise click.UsageError(str(exc)) from None


def open_source(bundle: Path) -> Source:
    """The bundle read once (serving/bundle/recalibration.py), if it loads and takes images; UsageError
    (one line) otherwise."""
    from serving.bundle.recalibration import read_source
    from serving.bundle.verify import inspect_bundle

    problems, _ = inspect_bundle(bundle, deep=False)
    if problems:
        raise click.UsageError(f"{bundle} does not load, so it is not recalibrated: {problems[0]}")
    source = read_source(bundle)
    if not isinstance(source.manifest.get("image"), dict):
        raise click.UsageError(f"{bundle} takes no images (its manifest has no image spec): recalibrate it "
                               "with slc export on its run instead")
    return source


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


# ------------------------------------------------------------------------------ thresholds
def head_rows(bundle: Path) -> tuple[np.ndarray, np.ndarray]:
    """(weight [D, d] memory-mapped, bias [D]) of the bundle's head."""
    return (np.load(bundle / "head_weight.npy", mmap_mode="r", allow_pickle=False),
            np.load(bundle / "head_bias.npy", allow_pickle=False))


def adapt_rows(weight, bias: np.ndarray, h: np.ndarray, y: np.ndarray, opts: Options, kept_source=None):
    """(the rows moved toward the images, the logits each half's tau is chosen on, the manifest's and
    calibration's `adaptation` note, the kept examples or None): adapt.py, the step chosen unless given;
    with `kept_source` (the bundle's calibration embeddings and labels) and opts.keep, keep.py."""
    from serving.calibration import adapt as row_adapt
    from serving.calibration import keep

    if len(y) < 2:
        raise click.UsageError("--adapt-rows needs at least 2 images")
    kept = None
    if opts.keep and kept_source is not None and len(kept_source[1]) >= 2:
        kept = keep.kept_examples(*kept_source, weight, bias, opts.target)
    candidates = []
    step = opts.adapt
    if step == "auto":
        step, candidates = (row_adapt.choose_beta(h, y, weight, bias, opts.target) if kept is None
                            else keep.choose_beta(h, y, weight, bias, opts.target, kept))
    note = {"step": float(step), "images": int(len(y)),
            "rule": "w_j + step * |w_j| * unit(mean of class j's images - mean of all images)",
            "step_choice": candidates or "given (--adapt-step)"}
    if kept is None:
        rows = row_adapt.adapt(weight, h, y, float(step))
        return rows, row_adapt.cross_chunks(h, y, weight, bias, float(step)), {**note, "classes": int(len(rows.ids))}, None
    rows = keep.adapt(weight, bias, h, y, float(step), kept.h, kept.y, kept.tau)
    moved = rows.steps.ravel() / max(float(step), 1e-300)
    note.update(classes=int(len(rows.ids)), kept={
        "examples": int(len(kept.y)), "tau": kept.tau,
        "rule": "each row's step the largest of step * (0, 1/4, 1/2, 1) losing none of its class's kept positives "
                "at the kept examples' norm threshold; thresholds on the union, tau the higher of the two sets'",
        "rows_full_step": int(np.sum(moved >= 1 - 1e-9)), "rows_held": int(np.sum(moved < 1e-9))})
    return rows, keep.cross_chunks(h, y, weight, bias, float(step), kept), note, kept


def adapt_of(source: Source, h: np.ndarray, y: np.ndarray, opts: Options):
    """(rows, cross-fitted logits, note, kept examples) with --adapt-rows; (None, None, None, None) without.
    The bundle's calibration embeddings are kept when it has them, unless --no-adapt-keep."""
    if opts.adapt is None:
        return None, None, None, None
    return adapt_rows(source.weight, source.bias, h, y, opts, source.negatives if opts.keep else None)


def fit(source: Source, h: np.ndarray, y: np.ndarray, h_test: np.ndarray | None,
        y_test: np.ndarray | None, opts: Options, weight=None, cross=None,
        present: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
    """calibration.json content from the estimator, kept entries restored for classes without an
    image; and the thresholds [D] the server will compare with (float32, as it stores them).
    `weight`: the rows to calibrate (default the bundle's); `cross`: calibrate_chunks' cross-fitted logits;
    `present` [D]: the classes recalibrated (default: those with an image in y)."""
    old, bias = source.calibration, source.bias
    weight = source.weight if weight is None else weight  # [D, d]
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
    if choice is not None:
        cal["method_choice"] = choice
    threshold = np.array([e["threshold"] for e in cal["per_class"]], dtype=np.float32)  # [D] as the server keeps it
    return cal, threshold
