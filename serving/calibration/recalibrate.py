"""What `slc calibrate BUNDLE --data imagefolder:DIR | csv:FILE` does (the command: cli.py): a bundle's
thresholds chosen again on the user's own labelled images (docs/calibration.md).

numpy, onnxruntime and Pillow only (no torch, no scikit-learn), so it runs in a server-only install.
In order: the bundle checked (manifest, head, calibration) and the options resolved (target and
method default to the bundle's own); the images listed, matched to the bundle's classes, decoded and
embedded (images.py); the rows adapted (--adapt-rows: adapt.py, keep.py); the rule chosen (cv:
choose.py) and the thresholds fitted by the export's estimator (serving/calibration/estimator.py) on
logits W·h + b of the head rows, class chunk by class chunk (never [N, D]); classes without an image
keep their previous entry (and the bundle's look-alike pairs are kept); what the new and the previous
thresholds give on the images, as the server decides with those pairs (measure.py), and what the
images can show (support.py); the bundle written with the new calibration
(serving/bundle/recalibration.py), verified before it replaces anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.bundle.recalibration import PREVIOUS, Source, open_source, write_recalibrated
from serving.calibration.adapt_rows import adapt_of
from serving.calibration.images import Images, read_images
from serving.calibration.keep import union
from serving.calibration.measure import measure, previous_thresholds
from serving.calibration.options import Options, resolve_options
from serving.calibration.refit import KEPT_RULE, fit
from serving.calibration.support import head_support
from serving.core.lookalikes import from_calibration


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


def run(bundle: Path, data: str, out: Path | None, in_place: bool, overwrite: bool, **given) -> Outcome:
    """`slc calibrate`, in order, each stage in its own module: the bundle read and the output checked,
    the options resolved (`given`: resolve_options' flags), the images listed and embedded, the rows
    adapted (--adapt-rows), the thresholds fitted, what they and the previous ones give measured, the
    bundle written and verified. serving.bundle.recalibration's errors are the front's to word."""
    source = open_source(bundle, out, in_place, overwrite)
    opts = resolve_options(source.calibration, **given)
    images, h, y, h_test, y_test = read_images(source, data, opts.skip_bad, opts.method["name"])
    adapted = adapt_of(source.weight, source.bias, h, y, opts, source.negatives if opts.keep else None)
    weight = source.weight if adapted.rows is None else adapted.rows  # [D, d] the rows the thresholds are for
    note = {**images.note(y, y_test, len(weight)), **({"adapted_rows": adapted.note} if adapted.note else {})}
    h_fit, y_fit = (h, y) if adapted.kept is None else union(h, y, adapted.kept)  # thresholds hold on the kept too
    cal, threshold = fit(source.calibration, weight, source.bias, h_fit, y_fit, h_test, y_test, opts, adapted.cross,
                         present=np.bincount(y, minlength=len(weight)) > 0)
    pairs = from_calibration(source.calibration, len(weight))  # the server's look-alike exclusion, before and after
    after = measure(h, y, h_test, y_test, weight, source.bias, threshold, lookalikes=pairs)
    before = measure(h, y, h_test, y_test, source.weight, source.bias, previous_thresholds(source.calibration),
                     rates_only=True, lookalikes=pairs)
    cal.update(recalibration={**note, "kept_rule": KEPT_RULE, "pooled": after, "previous_calibration": PREVIOUS},
               support=head_support(h, y, weight, source.bias, opts.target))
    write_recalibrated(source.path, cal, source.target, note, head=adapted.rows, in_place=in_place, overwrite=overwrite)
    return Outcome(source, source.target, images, opts, cal, note, before)
