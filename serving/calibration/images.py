"""`slc calibrate`'s images (the recipe: recalibrate.py): the files of `--data imagefolder:DIR | csv:FILE`
listed by role and every folder name matched to a class of the bundle (one line naming the unknown ones
before any image is decoded), then each image decoded by the server's own preprocessing
(serving/bundle/image.py with the bundle's image spec) and embedded once by the bundle's backbone.onnx
under onnxruntime.

With splits (DIR/{train,val,test}/CLASS or a CSV split column) the thresholds are fitted on val
(calibration) only, test is only measured, train is left out (the model has seen it); without, all
images are fitted on.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from serving.bundle.recalibration import Source
from serving.calibration.rules import RULES

SHOW_UNKNOWN = 5  # unknown class names given in the one line
EMBED_BATCH = 64


@dataclass
class Images:
    """The files to decode, by role: fitted on (`fit`) and only measured (`test`)."""

    root: Path
    fit: list  # of imagefiles.Entry
    test: list
    left_out: int  # train-split files, not used
    name: str = ""  # the --data folder or file as calibration.json records it (absolute)

    def note(self, y: np.ndarray, y_test, num_classes: int) -> dict:
        """calibration.json's and the manifest's `recalibration` note: when, on what, which classes."""
        import datetime as _dt

        fitted = int(np.count_nonzero(np.bincount(y, minlength=num_classes)))
        return {"created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "data": self.name,
                "images": len(y), "test_images": 0 if y_test is None else len(y_test),
                "classes_recalibrated": fitted, "classes_kept": num_classes - fitted}


def list_images(data: str, classes: list[str], skip_bad: bool) -> tuple[Images, np.ndarray, np.ndarray]:
    """The files and their class ids in the bundle (fit, test); UsageError naming the first unknown
    folder names or the unusable files, before any image is decoded."""
    from serving.bundle import imagefolder as imagefiles

    try:
        root, entries = imagefiles.list_entries(data)
        entries, bad = imagefiles.check_files(data, root, entries)
        name = imagefiles.absolute_name(data)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        if not skip_bad:
            raise click.UsageError(f"{data}: cannot read {bad[0][0]} ({bad[0][1]}){more}; fix or remove it, "
                                   "or pass --skip-bad-images")
        click.echo(f"warning: skipped {bad[0][0]} ({bad[0][1]}){more}: cannot be read", err=True)
    index = {name: j for j, name in enumerate(classes)}
    _refuse_unknown(data, {e.label for e in entries} - index.keys(), classes)
    split = entries[0].split is not None if entries else False
    fit = [e for e in entries if (e.split == "calibration" if split else True)]
    test = [e for e in entries if split and e.split == "test"]
    if not fit:
        raise click.UsageError(f"{data}: no image to fit thresholds on"
                               + (" (the val/calibration split is empty)" if split else ""))
    fit_ids, test_ids = (np.array([index[e.label] for e in es], dtype=np.int64) for es in (fit, test))
    return Images(root, fit, test, len(entries) - len(fit) - len(test), name), fit_ids, test_ids


def read_images(source: Source, data: str, skip_bad: bool,
                rule: str) -> tuple[Images, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The user's images listed and checked (UsageError before any decode, also when `rule`, the threshold
    method, cannot fit on so few), then embedded: (images, h [n, d] float64 of the backbone's float32,
    y [n], h_test, y_test) of the decodable files."""
    bundle, spec = source.path, source.manifest["image"]
    images, y_fit, y_test = list_images(data, source.manifest["classes"], skip_bad)
    if rule in RULES and len(y_fit) < RULES[rule].min_images:
        raise click.UsageError(f"{data}: the {rule} rule needs at least {RULES[rule].min_images} images to fit on; "
                               "name another --threshold-method (global, shrink, per_class)")
    h, kept = embed_files(bundle, spec, images.root, images.fit, skip_bad, f"embedding {len(images.fit):,} images")
    if len(kept) == 0:
        raise click.ClickException("no image decodes: nothing to fit thresholds on")
    if not images.test:
        return images, h.astype(np.float64), y_fit[kept], None, None
    h_test, kept_test = embed_files(bundle, spec, images.root, images.test, skip_bad,
                                    f"embedding {len(images.test):,} test images")
    return images, h.astype(np.float64), y_fit[kept], h_test.astype(np.float64), y_test[kept_test]


def _refuse_unknown(data: str, unknown: set[str], classes: list[str]) -> None:
    """One line naming the first few folder names that are not classes of the bundle, and a few of its classes."""
    if not unknown:
        return
    names = sorted(unknown)

    def few(items: list[str]) -> str:
        return ", ".join(map(repr, items[:SHOW_UNKNOWN])) + (", ..." if len(items) > SHOW_UNKNOWN else "")

    raise click.UsageError(f"{data}: {len(names)} class name(s) the bundle does not know: {few(names)} "
                           f"(its classes: {few(classes)})")


def embed_files(bundle: Path, spec: dict, root: Path, entries: list, skip_bad: bool,
                desc: str) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings [n, d] float32 of the decodable files, their positions in `entries`): each file
    decoded as the server decodes an image body, then backbone.onnx in batches. ClickException
    naming the first file that does not decode, unless skip_bad."""
    from tqdm.auto import tqdm

    from serving.bundle import ort_session
    from serving.bundle.image import FILE_MAX_DECODED_BYTES, FILE_MAX_PIXELS, decode_image
    from serving.bundle.imagefolder import read_regular

    sess = ort_session(bundle / "backbone.onnx", threads=os.cpu_count() or 1)
    out, kept, batch, bad = [], [], [], []
    with tqdm(total=len(entries), desc=desc, unit="img", leave=False) as bar:
        for k, e in enumerate(entries):
            try:
                data = read_regular(root / e.rel)
                batch.append(decode_image(io.BytesIO(data), spec, max_pixels=FILE_MAX_PIXELS,
                                          max_bytes=FILE_MAX_DECODED_BYTES))
                kept.append(k)
            except Exception as exc:  # noqa: BLE001 - any failure is this file's, reported by name
                bad.append(f"{e.rel} ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})")
            if len(batch) == EMBED_BATCH or (k == len(entries) - 1 and batch):
                out.append(sess.run(None, {"input": np.stack(batch).astype(np.float32, copy=False)})[0])
                batch = []
            bar.update(1)
    if bad and not skip_bad:
        raise click.ClickException(f"cannot decode {bad[0]}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}; "
                                   "fix or remove it, or pass --skip-bad-images")
    if bad:
        click.echo(f"warning: skipped {len(bad)} image(s) that do not decode, e.g. {bad[0]}", err=True)
    d = sess.get_outputs()[0].shape[-1]
    h = np.concatenate(out) if out else np.zeros((0, d if isinstance(d, int) else 0), np.float32)
    return h, np.asarray(kept, dtype=np.int64)
