"""`slc calibrate`: the command (what it does: recalibrate.py). numpy, onnxruntime and Pillow only."""
from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path

import click
import numpy as np

from serving.bundle.cliopts import POSITIVE, bundle_dir, guarded, out_dir, slc_command
from serving.calibration.recalibrate import (CV, DEFAULT_RULE, KEPT_RULE, Images, Options, adapt_rows, fit,
                                              head_rows, open_source, per_image_counts, pooled, read_images,
                                              resolve_options)
from serving.calibration.keep import union
from serving.calibration.rules import METHODS


# ------------------------------------------------------------------------------ the command
def _data(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from serving.bundle.imagefolder import check_name, is_image_dataset

    if not is_image_dataset(value):
        raise click.BadParameter(f"expected imagefolder:DIR or csv:FILE, got {value!r}", ctx, param)
    try:
        check_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


def _output(bundle: Path, out: Path | None, in_place: bool, overwrite: bool) -> Path:
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


def _claimed(params: dict) -> Path | None:
    """The folder `slc calibrate` writes, for its guard (the usage lines come first, from _output)."""
    out, bundle = params.get("out"), params.get("bundle")
    if params.get("in_place") and out is None:
        return bundle
    if params.get("in_place") or out is None or Path(out).resolve() == Path(bundle).resolve():
        return None  # _output's line says what to do
    return out


def _report(bundle: Path, h: np.ndarray, y: np.ndarray, h_test, y_test, threshold: np.ndarray, weight=None) -> dict:
    """Pooled precision and recall with intervals at the new thresholds (and rows, when adapted): on
    the fit images, and on the test images when there are some."""
    bundle_weight, bias = head_rows(bundle)
    weight = bundle_weight if weight is None else weight
    report = {"fit": pooled(*per_image_counts(h, y, weight, bias, threshold))}
    if y_test is not None and len(y_test):
        report["test"] = pooled(*per_image_counts(h_test, y_test, weight, bias, threshold))
    return report


def _before(bundle: Path, old: dict, h: np.ndarray, y: np.ndarray, h_test, y_test) -> dict:
    """Pooled precision and recall of the bundle's previous thresholds and rows on the same images:
    the "before" of each summary line (a recall that fell reads as a regression without the precision
    it bought)."""
    weight, bias = head_rows(bundle)
    threshold = np.array([np.nan if e.get("threshold") is None else e["threshold"] for e in old["per_class"]],
                         dtype=np.float32)
    out = {"fit": _rates(*per_image_counts(h, y, weight, bias, threshold))}
    if y_test is not None and len(y_test):
        out["test"] = _rates(*per_image_counts(h_test, y_test, weight, bias, threshold))
    return out


def _rates(tp: np.ndarray, fp: np.ndarray) -> dict:
    t, f = int(tp.sum()), int(fp.sum())
    return {"precision": t / (t + f) if t + f else 1.0, "recall": t / max(len(tp), 1)}


def _line(what: str, r: dict, before: dict | None = None) -> str:
    """One summary line: precision and recall (before → after when the previous figures are given)."""
    (pl, ph), (rl, rh) = r["precision_interval"], r["recall_interval"]
    was = {k: f"{before[k]:.3f} → " if before else "" for k in ("precision", "recall")}
    return (f"{what}: precision {was['precision']}{r['precision']:.3f} [{pl:.3f}, {ph:.3f}], recall "
            f"{was['recall']}{r['recall']:.3f} [{rl:.3f}, {rh:.3f}] ({r['images']:,} images, {r['matches']:,} "
            f"matches; {r['interval']}{'; before: the previous thresholds' if before else ''})")


@click.command("calibrate")
@click.argument("bundle", type=click.Path(path_type=Path), callback=bundle_dir)
@click.option("--data", required=True, callback=_data,
              help="imagefolder:DIR or csv:FILE: labelled images whose folder names (label column) are class names "
                   "of the bundle; with train/val/test splits, fitted on val, measured on test (docs/calibration.md)")
@click.option("--out", type=click.Path(path_type=Path), callback=out_dir,
              help="the recalibrated bundle to write: a new folder, or with --overwrite a bundle it replaces "
              "(not BUNDLE itself)")
@click.option("--in-place", is_flag=True, help="replace BUNDLE itself, in one atomic swap (a running server then "
              "takes the new thresholds with POST /v1/admin/reload-calibration)")
@click.option("--target-precision", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="[default: the bundle's target]")
@click.option("--target-recall", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="a recall target instead of a precision one")
@click.option("--threshold-method", type=click.Choice((CV,) + METHODS), default=DEFAULT_RULE, show_default=True,
              help="norm: one threshold on logits standardised by each class's highest negatives; cv: the rule "
              "(global, tail, norm, shrink, per_class) that recalls the most at the target in a 2-fold "
              "cross-validation on the images")
@click.option("--kappa", type=POSITIVE, help="shrink's pseudo-count [default: the bundle's, else 4]")
@click.option("--skip-bad-images", is_flag=True, help="leave out files that cannot be read or decoded (one warning)")
@click.option("--adapt-rows", is_flag=True, help="also move each class's head row toward its images (a new head: "
              "restart servers on the bundle), then the norm rule's thresholds for the moved rows "
              "(docs/calibration.md, \"Adapting the rows\")")
@click.option("--adapt-step", type=POSITIVE, help="the step, in units of each row's length "
              "[default: chosen among 0.25, 0.5, 1 by cross-fitting on the images]")
@click.option("--adapt-keep/--no-adapt-keep", default=True, show_default=True,
              help="with --adapt-rows: fit against the bundle's own calibration examples too (calibration_embeddings"
              ".npy, when it has them): each row's step bounded by what it costs them, the thresholds holding on "
              "them (docs/calibration.md, \"Adapting without forgetting\")")
@guarded("bundle", inputs=("bundle",), in_place="in_place", target=_claimed)
def calibrate(bundle: Path, data: str, out: Path | None, overwrite: bool, in_place: bool,
              target_precision: float | None,
              target_recall: float | None, threshold_method: str | None, kappa: float | None,
              skip_bad_images: bool, adapt_rows: bool, adapt_step: float | None, adapt_keep: bool) -> None:
    """Choose BUNDLE's thresholds again on your own labelled images; writes a bundle that slc verify accepts."""
    from serving.bundle.recalibration import PREVIOUS, RecalibrationError, write_recalibrated
    t0 = time.perf_counter()
    target = _output(bundle, out, in_place, overwrite)
    manifest, old = open_source(bundle)
    opts = resolve_options(old, target_precision, target_recall, threshold_method, kappa, skip_bad_images,
                           adapt_rows, adapt_step, adapt_keep)
    images, h, y, h_test, y_test = read_images(bundle, manifest["image"], data, manifest["classes"], skip_bad_images,
                                               opts.method["name"])
    rows, cross, adaptation, kept = adapt_rows_of(bundle, h, y, opts)
    h_fit, y_fit = (h, y) if kept is None else union(h, y, kept)  # the thresholds hold on the kept examples too
    try:
        cal, threshold = fit(bundle, old, h_fit, y_fit, h_test, y_test, opts, rows, cross,
                             present=np.bincount(y, minlength=int(manifest["num_classes"])) > 0)
    except ValueError as exc:  # the estimator refusing these data (say, non-finite logits): one line
        raise click.ClickException(f"{bundle}: {exc}") from None
    report = _report(bundle, h, y, h_test, y_test, threshold, rows)
    before = _before(bundle, old, h, y, h_test, y_test)
    D, fitted = len(threshold), int(np.count_nonzero(np.bincount(y, minlength=len(threshold))))
    note = {"created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "data": images.name,
            "images": len(y), "test_images": 0 if y_test is None else len(y_test),
            "classes_recalibrated": fitted, "classes_kept": D - fitted}
    if adaptation is not None:
        note["adapted_rows"] = adaptation
    cal["recalibration"] = {**note, "kept_rule": KEPT_RULE, "pooled": report, "previous_calibration": PREVIOUS}
    cal["support"] = _support(bundle, h, y, rows, opts)
    try:
        write_recalibrated(bundle, cal, target, note, head=rows, in_place=in_place, overwrite=overwrite)
    except RecalibrationError as exc:
        raise click.ClickException(str(exc)) from None
    _summary(bundle, target, data, images, note, opts, report, time.perf_counter() - t0, cal.get("method_choice"),
             before)
    _support_echo(cal["support"], bundle, data, out, in_place)


def _support(bundle: Path, h: np.ndarray, y: np.ndarray, rows, opts: Options) -> dict:
    """What the fit images can show at the rows the thresholds are for (serving/calibration/support.py)."""
    from serving.calibration.chunks import chunk_classes
    from serving.calibration.recalibrate import head_chunks
    from serving.calibration.support import support

    weight, bias = head_rows(bundle)
    weight = weight if rows is None else rows
    return support(head_chunks(h, weight, bias, chunk_classes(len(y), len(weight))), y, len(weight), opts.target)


def _support_echo(sup: dict, bundle: Path, data: str, out: Path | None, in_place: bool) -> None:
    """The one line when the images cannot show the target, with the command that chooses another."""
    from serving.calibration.support import support_line

    where = "--in-place" if in_place else f"--out {out} --overwrite"
    if line := support_line(sup, f"{slc_command()} calibrate {bundle} --data {data} {where} --target-precision {{p}}"):
        click.echo(line)


def adapt_rows_of(bundle: Path, h: np.ndarray, y: np.ndarray, opts: Options):
    """(rows, cross-fitted logits, note, kept examples) with --adapt-rows; (None, None, None, None) without.
    The bundle's calibration embeddings are kept when it has them, unless --no-adapt-keep."""
    from serving.bundle.negatives import read_negatives

    if opts.adapt is None:
        return None, None, None, None
    weight, bias = head_rows(bundle)
    return adapt_rows(weight, bias, h, y, opts, read_negatives(bundle) if opts.keep else None)


def _summary(bundle: Path, target: Path, data: str, images: Images, note: dict, opts: Options, report: dict,
             seconds: float, choice: dict | None = None, before: dict | None = None) -> None:
    import hashlib

    sha = hashlib.sha256((target / "calibration.json").read_bytes()).hexdigest()
    method = opts.method["name"] + (f" (kappa {opts.method['kappa']:g})" if "kappa" in opts.method else "")
    (kind, value), = opts.target.items()
    if images.left_out:
        click.echo(f"{data}: {images.left_out:,} train-split images left out (the model has seen them)")
    if note["classes_kept"]:
        click.echo(f"{note['classes_kept']:,} of the bundle's classes have no image: their previous thresholds "
                   "are kept (calibration.json marks them kept: true)")
    click.echo(f"target {kind} {value:g}, method {method}, pooled over classes")
    if choice is not None:
        click.echo(f"method chosen by {choice['by']}" + (": " if choice["candidates"] else "") + "; ".join(
            f"{r['method']} recall {r['mean_recall']:.3f} at precision {r['pooled_precision']:.3f}"
            + ("" if r["acceptable"] else " (short of the target)") for r in choice["candidates"]))
    before = before or {}
    click.echo(_line("on the images the thresholds were chosen on (optimistic)", report["fit"], before.get("fit")))
    if "test" in report:
        click.echo(_line("on the test images (unseen by the choice)", report["test"], before.get("test")))
    if "adapted_rows" in note:
        a = note["adapted_rows"]
        click.echo(f"rows of {a['classes']:,} classes moved toward their images, step {a['step']:g}"
                   + ("" if isinstance(a["step_choice"], str) else " (chosen: " + "; ".join(
                       f"{c['beta']:g} recalls {c['recall']:.3f}" for c in a["step_choice"]) + ", cross-fitted)")
                   + ("" if "kept" not in a else f"; {a['kept']['examples']:,} of the bundle's calibration examples "
                      f"kept: {a['kept']['rows_full_step']:,} rows took the full step, {a['kept']['rows_held']:,} "
                      "were held back entirely"))
    restart = ("POST /v1/admin/reload-calibration (or restart) to a server on it" if target.resolve() == bundle.resolve()
               else f"{slc_command()} serve {target}")
    if "adapted_rows" in note and target.resolve() == bundle.resolve():
        restart = "restart the servers on it (a new head: the reload route takes thresholds only)"
    click.echo(f"recalibrated {note['classes_recalibrated']:,} classes, kept {note['classes_kept']:,}, "
               f"{note['images'] + note['test_images']:,} images, {seconds:.1f} s -> {target} verified "
               f"(calibration.json sha256 {sha}; previous in calibration.previous.json); next: {restart}")
