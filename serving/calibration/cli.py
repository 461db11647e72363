"""`slc calibrate`: the command (what it does: recalibrate.py). numpy, onnxruntime and Pillow only."""
from __future__ import annotations

import time
from pathlib import Path

import click

from serving.bundle.cliopts import POSITIVE, bundle_dir, guarded, out_dir, slc_command
from serving.calibration.choose import CV
from serving.calibration.options import DEFAULT_RULE
from serving.calibration.recalibrate import Outcome, run
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


def _claimed(params: dict) -> Path | None:
    """The folder `slc calibrate` writes, for its guard (the usage lines come first, from _output)."""
    out, bundle = params.get("out"), params.get("bundle")
    if params.get("in_place") and out is None:
        return bundle
    if params.get("in_place") or out is None or Path(out).resolve() == Path(bundle).resolve():
        return None  # _output's line says what to do
    return out


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
    from serving.bundle.recalibration import RecalibrationError, SourceRefused

    if out is None and not in_place:
        raise click.UsageError("give --out NEW_BUNDLE, or --in-place to replace BUNDLE")
    if out is not None and in_place:
        raise click.UsageError("give --out or --in-place, not both")
    t0 = time.perf_counter()
    try:
        outcome = run(bundle, data, out, in_place, overwrite, target_precision=target_precision,
                      target_recall=target_recall, method_name=threshold_method, kappa=kappa,
                      skip_bad=skip_bad_images, adapt=adapt_rows, step=adapt_step, keep=adapt_keep)
    except SourceRefused as exc:  # before any work: a usage line
        raise click.UsageError(str(exc)) from None
    except RecalibrationError as exc:
        raise click.ClickException(str(exc)) from None
    _summary(outcome, data, time.perf_counter() - t0)
    _support_echo(outcome.cal["support"], bundle, data, out, in_place)


def _support_echo(sup: dict, bundle: Path, data: str, out: Path | None, in_place: bool) -> None:
    """The one line when the images cannot show the target, with the command that chooses another."""
    from serving.calibration.support import support_line

    where = "--in-place" if in_place else f"--out {out} --overwrite"
    if line := support_line(sup, f"{slc_command()} calibrate {bundle} --data {data} {where} --target-precision {{p}}"):
        click.echo(line)


def _summary(outcome: Outcome, data: str, seconds: float) -> None:
    """The command's closing lines: what was left out and kept, the rule, before -> after, what to run next."""
    import hashlib

    bundle, target, images, opts, note = outcome.source.path, outcome.target, outcome.images, outcome.opts, outcome.note
    report, choice, before = outcome.cal["recalibration"]["pooled"], outcome.cal.get("method_choice"), outcome.before

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
