"""What `slc calibrate BUNDLE --data imagefolder:DIR | csv:FILE` does (the command: cli.py): a bundle's
thresholds chosen again on the user's own labelled images (docs/calibration.md).

numpy, onnxruntime and Pillow only (no torch, no scikit-learn), so it runs in a server-only install.
In order: the bundle checked (manifest, head, calibration) and the options resolved (target and
method default to the bundle's own); the files listed and every folder name matched to a class of
the bundle, one line naming the unknown ones before any image is decoded; each image decoded by the
server's own preprocessing (serving/bundle/image.py with the bundle's image spec) and embedded once
by the bundle's backbone.onnx under onnxruntime; the thresholds fitted by the export's estimator
(serving/calibration/estimator.py) on logits W·h + b of the head rows, class chunk by class chunk (never
[N, D]); classes without an image keep their previous entry; the bundle written with the new
calibration (serving/bundle/recalibration.py), verified before it replaces anything.

Images: DIR/CLASS/... (or a CSV path,label) are all used. With splits (DIR/{train,val,test}/CLASS or
a CSV split column) the thresholds are fitted on val (calibration) only, test is only measured,
train is left out (the model has seen it).
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from serving.calibration.estimator import calibrate_chunks
from serving.calibration.chunks import chunk_classes
from serving.calibration.defaults import RULE_DEFAULTS
from serving.bundle.recalibration import Source
from serving.calibration.rules import check_method

SHOW_UNKNOWN = 5  # unknown class names given in the one line
EMBED_BATCH = 64
DRAWS, LEVEL = 1000, 0.95  # bootstrap of the pooled precision and recall
CV = "cv"  # --threshold-method: the rule chosen by cross-validation on the user's images
DEFAULT_RULE = RULE_DEFAULTS["calibrate"]["name"]  # docs/calibration.md, "The norm rule"
DEFAULT_METHOD = RULE_DEFAULTS["not pols"]  # a bundle that names no rule
KEPT_RULE = ("a class with no image in the recalibration data keeps its entry of the calibration this one "
             "replaced (threshold, Platt parameters, rates), marked kept: true")


@dataclass
class Images:
    """The files to decode, by role: fitted on (`fit`) and only measured (`test`)."""

    root: Path
    fit: list  # of imagefiles.Entry
    test: list
    left_out: int  # train-split files, not used
    name: str = ""  # the --data folder or file as calibration.json records it (absolute)


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

    target = output_of(bundle, out, in_place, overwrite)
    source = open_source(bundle)
    opts = resolve_options(source.calibration, **given)
    images, h, y, h_test, y_test = read_images(source, data, opts)
    rows, cross, adaptation, kept = adapt_of(source, h, y, opts)
    h_fit, y_fit = (h, y) if kept is None else keep_union(h, y, kept)  # thresholds hold on the kept examples too
    cal, threshold = fit(source, h_fit, y_fit, h_test, y_test, opts, rows, cross,
                         present=np.bincount(y, minlength=len(source.weight)) > 0)
    weight = source.weight if rows is None else rows
    note = recalibration_note(images, y, y_test, len(threshold), adaptation)
    cal["recalibration"] = {**note, "kept_rule": KEPT_RULE,
                            "pooled": measure(h, y, h_test, y_test, weight, source.bias, threshold),
                            "previous_calibration": PREVIOUS}
    cal["support"] = support_of(h, y, weight, source.bias, opts)
    before = measure(h, y, h_test, y_test, source.weight, source.bias, previous_thresholds(source), rates_only=True)
    write(source, cal, target, note, rows, in_place, overwrite)
    return Outcome(source, target, images, opts, cal, note, before)


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
    if name == "tail" and "recall" in target:
        raise click.UsageError("--threshold-method tail needs a precision target: give --target-precision P")
    if kappa is None:
        kappa = old.get("kappa", DEFAULT_METHOD["kappa"]) if old.get("name") == "shrink" else DEFAULT_METHOD["kappa"]
    try:
        method = check_method({"name": name, "kappa": kappa})
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return Options(target, method, skip_bad, (step if step is not None else "auto") if adapt else None, keep)


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


def read_images(source: Source, data: str,
                opts: Options) -> tuple[Images, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The user's images listed and checked (UsageError before any decode, also when the rule cannot fit
    on so few), then embedded: (images, h [n, d], y [n], h_test, y_test) of the decodable files."""
    bundle, spec, skip_bad = source.path, source.manifest["image"], opts.skip_bad
    images, y_fit, y_test = list_images(data, source.manifest["classes"], skip_bad)
    if opts.method["name"] == "norm" and len(y_fit) < 2:
        raise click.UsageError(f"{data}: the norm rule needs at least 2 images to fit on; name another "
                               "--threshold-method (global, shrink, per_class)")
    h, kept = embed_files(bundle, spec, images.root, images.fit, skip_bad, f"embedding {len(images.fit):,} images")
    if len(kept) == 0:
        raise click.ClickException("no image decodes: nothing to fit thresholds on")
    if not images.test:
        return images, h, y_fit[kept], None, None
    h_test, kept_test = embed_files(bundle, spec, images.root, images.test, skip_bad,
                                    f"embedding {len(images.test):,} test images")
    return images, h, y_fit[kept], h_test, y_test[kept_test]


def _refuse_unknown(data: str, unknown: set[str], classes: list[str]) -> None:
    """One line naming the first few folder names that are not classes of the bundle, and a few of its classes."""
    if not unknown:
        return
    names = sorted(unknown)

    def few(items: list[str]) -> str:
        return ", ".join(map(repr, items[:SHOW_UNKNOWN])) + (", ..." if len(items) > SHOW_UNKNOWN else "")

    raise click.UsageError(f"{data}: {len(names)} class name(s) the bundle does not know: {few(names)} "
                           f"(its classes: {few(classes)})")


# ------------------------------------------------------------------------------ decoding, embedding
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


# ------------------------------------------------------------------------------ thresholds
def head_chunks(h: np.ndarray, weight: np.ndarray, bias: np.ndarray, chunk: int):
    """`Chunks` of logits W·h + b as the server's detect computes them (float64 of the float32 rows and
    embeddings): `chunk` classes at a time, never [N, D]."""
    from serving.calibration.chunks import head_chunks as chunks

    return chunks(np.asarray(h, dtype=np.float64), weight, bias, chunk)


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


def keep_union(h: np.ndarray, y: np.ndarray, kept) -> tuple[np.ndarray, np.ndarray]:
    """The user's images and the kept calibration examples as one fit set (keep.py)."""
    from serving.calibration.keep import union

    return union(h, y, kept)


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
    choice = None
    if opts.method["name"] == CV and np.bincount(y).max(initial=0) < 2:  # nothing to cross-validate on
        opts.method = check_method(old.get("method") or DEFAULT_METHOD)
        if opts.method["name"] == "tail" and "recall" in opts.target:
            opts.method = check_method(DEFAULT_METHOD)
        choice = {"by": "the bundle's rule (no class has 2 images to cross-validate on)",
                  "chosen": opts.method["name"], "candidates": []}
    elif opts.method["name"] == CV:
        from serving.calibration.choose import choose

        opts.method, choice = choose(lambda rows: head_chunks(h[rows], weight, bias, chunk), y, D, opts.target,
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


def per_image_counts(h: np.ndarray, y: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                     threshold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(true match [N] 0/1, false matches [N]) of each image at thresholds [D], as detect decides
    (logit >= threshold), over class chunks."""
    tp, fp = np.zeros(len(y), np.int64), np.zeros(len(y), np.int64)
    chunk = chunk_classes(len(y), len(weight))
    thr = np.where(np.isfinite(threshold), threshold, np.inf).astype(np.float64)
    for first, z in head_chunks(h, weight, bias, chunk)():  # z [N, c]
        match = z >= thr[first:first + z.shape[1]]  # [N, c]
        local = y - first
        mine = (local >= 0) & (local < z.shape[1])
        own = np.zeros(len(y), bool)
        own[mine] = match[np.flatnonzero(mine), local[mine]]
        tp += own
        fp += match.sum(axis=1) - own
    return tp, fp


def pooled(tp: np.ndarray, fp: np.ndarray, seed: int = 0) -> dict:
    """Precision and recall over all (image, class) pairs, with a bootstrap interval over images
    (DRAWS resamples, LEVEL): images are the independent units, an image's pairs are not."""
    n, rng = len(tp), np.random.default_rng(seed)
    block = max(1, (1 << 22) // max(n, 1))
    prec, rec = [], []
    for start in range(0, DRAWS, block):
        idx = rng.integers(0, n, (min(block, DRAWS - start), n))  # [b, n]
        t, f = tp[idx].sum(axis=1), fp[idx].sum(axis=1)
        prec.append(np.where(t + f > 0, t / np.maximum(t + f, 1), 1.0))
        rec.append(t / n)
    q = [(1 - LEVEL) / 2, (1 + LEVEL) / 2]
    t, f = int(tp.sum()), int(fp.sum())
    return {"images": n, "matches": t + f, "true_matches": t,
            "precision": t / (t + f) if t + f else 1.0, "precision_interval": np.quantile(np.concatenate(prec), q).tolist(),
            "recall": t / n, "recall_interval": np.quantile(np.concatenate(rec), q).tolist(),
            "interval": f"{LEVEL:.0%} bootstrap over images ({DRAWS} draws, seed {seed})"}


# ------------------------------------------------------------------------------ what the thresholds give
def previous_thresholds(source: Source) -> np.ndarray:
    """[D] float32 the bundle's thresholds before this recalibration (NaN where an entry had none)."""
    return np.array([np.nan if e.get("threshold") is None else e["threshold"]
                     for e in source.calibration["per_class"]], dtype=np.float32)


def measure(h: np.ndarray, y: np.ndarray, h_test, y_test, weight, bias: np.ndarray, threshold: np.ndarray,
            rates_only: bool = False) -> dict:
    """Pooled precision and recall at `threshold` [D] of rows `weight` [D, d], on the fit images and on the
    test images when there are some: with bootstrap intervals, or (rates_only) the two rates alone, the
    "before" of each summary line (a recall that fell reads as a regression without the precision it bought)."""
    def one(hh, yy) -> dict:
        tp, fp = per_image_counts(hh, yy, weight, bias, threshold)
        if not rates_only:
            return pooled(tp, fp)
        t, f = int(tp.sum()), int(fp.sum())
        return {"precision": t / (t + f) if t + f else 1.0, "recall": t / max(len(tp), 1)}

    report = {"fit": one(h, y)}
    if y_test is not None and len(y_test):
        report["test"] = one(h_test, y_test)
    return report


def support_of(h: np.ndarray, y: np.ndarray, weight, bias: np.ndarray, opts: Options) -> dict:
    """What the fit images can show at the rows the thresholds are for (support.py)."""
    from serving.calibration.support import support

    return support(head_chunks(h, weight, bias, chunk_classes(len(y), len(weight))), y, len(weight), opts.target)
