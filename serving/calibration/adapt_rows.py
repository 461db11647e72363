"""`slc calibrate --adapt-rows` as one stage of the recipe (recalibrate.py): the rows moved toward the
user's images (adapt.py), against the bundle's own calibration examples as well when it carries them
(keep.py, unless --no-adapt-keep), the step chosen unless given; and the note that says what moved."""
from __future__ import annotations

from dataclasses import dataclass

import click
import numpy as np

from serving.calibration import adapt, keep
from serving.calibration.options import Options

RULE = "w_j + step * |w_j| * unit(mean of class j's images - mean of all images)"
KEPT_RULE = ("each row's step the largest of step * (0, 1/4, 1/2, 1) losing none of its class's kept positives "
             "at the kept examples' norm threshold; thresholds on the union, tau the higher of the two sets'")


@dataclass
class Adapted:
    """What the stage gives the rest of the recipe; all None without --adapt-rows."""

    rows: object = None  # the new head rows [D, d] (adapt.AdaptedRows: sliced like an array)
    cross: object = None  # the logits each half's tau is chosen on (calibrate_chunks' `cross`)
    note: dict | None = None  # the manifest's and calibration's `adapted_rows`
    kept: object = None  # keep.Kept: the bundle's calibration examples the thresholds must hold on too


def adapt_of(weight, bias: np.ndarray, h: np.ndarray, y: np.ndarray, opts: Options, negatives=None) -> Adapted:
    """The stage (module docstring); `negatives`: the bundle's calibration embeddings and labels, or None."""
    if opts.adapt is None:
        return Adapted()
    if len(y) < 2:
        raise click.UsageError("--adapt-rows needs at least 2 images")
    kept = None
    if opts.keep and negatives is not None and len(negatives[1]) >= 2:
        kept = keep.kept_examples(*negatives, weight, bias, opts.target)
    candidates, step = [], opts.adapt
    if step == "auto":
        step, candidates = (adapt.choose_beta(h, y, weight, bias, opts.target) if kept is None
                            else keep.choose_beta(h, y, weight, bias, opts.target, kept))
    step = float(step)
    note = {"step": step, "images": int(len(y)), "rule": RULE, "step_choice": candidates or "given (--adapt-step)"}
    if kept is None:
        rows = adapt.adapt(weight, h, y, step)
        return Adapted(rows, adapt.cross_chunks(h, y, weight, bias, step), {**note, "classes": int(len(rows.ids))})
    rows = keep.adapt(weight, bias, h, y, step, kept.h, kept.y, kept.tau)
    moved = rows.steps.ravel() / max(step, 1e-300)
    note.update(classes=int(len(rows.ids)), kept={
        "examples": int(len(kept.y)), "tau": kept.tau, "rule": KEPT_RULE,
        "rows_full_step": int(np.sum(moved >= 1 - 1e-9)), "rows_held": int(np.sum(moved < 1e-9))})
    return Adapted(rows, keep.cross_chunks(h, y, weight, bias, step, kept), note, kept)
