"""A user's own images as a dataset: `imagefolder:DIR` and `csv:FILE` (docs/datasets.md).

Every file is decoded by serving/bundle/image.py, the function the server applies to image
bodies, so a training image sent to a served bundle gets exactly its offline logit.

Loading, once per set of files: list the files; check every header (Pillow opens each file:
format, size, mode) before anything is decoded, so an unreadable file is one line naming it
(or, with skip_bad, counted and left out) instead of a traceback an hour into training; choose
the image spec (given, or the defaults of `default_spec`); split (the folders' or the CSV's, else
seeded and stratified 60/20/20); decode into one uint8 array [N, *input_shape], rows grouped by
split, under $SLC_HOME/data/images/<fingerprint>/. The splits returned are memory-mapped views of
it. A second load of unchanged files (same relative paths, sizes and modification times, same
requested spec and seed) finds the cache through a key file and reads no image.

The fingerprint identifies the data: a hash of every file's relative path, label, split and
content (sha256), and of the spec. Moving or copying the folder keeps it; changing a file
changes it (trainer/data/runs.py checks it when a run's data is loaded again).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from serving.bundle import atomic_write_text, output, slc_home
from serving.bundle.image import (FILE_MAX_DECODED_BYTES, FILE_MAX_PIXELS, FORMATS, check_decoded_bytes,
                                  check_header, decode_image, is_grey)
from serving.bundle.imagefolder import (SPLIT_ALIASES, Entry, absolute_name, check_files, check_name, one_line,  # noqa: F401
                                        dataset_path, is_image_dataset, list_entries, read_regular)
from serving.bundle.imagespec import LAYOUTS, check_image_spec, input_shape_of

if TYPE_CHECKING:
    from trainer.data import Splits

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # bumped whenever decoding or the cache layout changes
SPLITS = ("train", "calibration", "test")
SPEC_KEYS = ("height", "width", "channels", "layout", "scale", "background", "resample")
PARALLEL_MIN = 2048  # fewer files are read in this process (worker start-up costs more than it saves)
CHUNK = 256
SHOW_BAD = 3  # names given in the one line about unreadable files


# ------------------------------------------------------------------------------ listing the files


# ------------------------------------------------------------------------------ which files may be read


# ------------------------------------------------------------------------------ reading the files


def _scan_chunk(paths: list[str]) -> list[tuple[int, int, bool, str | None]]:
    """Worker: (width, height, grey, error) of each file from its header alone (no pixel decoded)."""
    from PIL import Image

    out = []
    for p in paths:
        data = None
        try:
            data = read_regular(p)
            with Image.open(io.BytesIO(data), formats=list(FORMATS)) as img:
                check_header(img, FILE_MAX_PIXELS)
                if img.format != "JPEG":  # a JPEG decodes at a reduced scale: checked when decoded
                    check_decoded_bytes(img, FILE_MAX_DECODED_BYTES)
                out.append((img.width, img.height, is_grey(img), None))
        except Exception as exc:  # noqa: BLE001 - any failure is this file's, reported by name
            out.append((0, 0, False, one_line(exc, data)))
    return out


def _decode_chunk(x_path: str, start: int, paths: list[str], spec: dict) -> list[tuple[str | None, str | None]]:
    """Worker: decode files into rows start.. of the uint8 array at x_path; (sha256, error) per file."""
    x = np.load(x_path, mmap_mode="r+", allow_pickle=False)
    out = []
    for i, p in enumerate(paths):
        data = None
        try:
            data = read_regular(p)
            x[start + i] = decode_image(io.BytesIO(data), spec, max_pixels=FILE_MAX_PIXELS,
                                        max_bytes=FILE_MAX_DECODED_BYTES)  # whole numbers 0..255
            out.append((hashlib.sha256(data).hexdigest(), None))
        except Exception as exc:  # noqa: BLE001 - any failure is this file's, reported by name
            out.append((None, one_line(exc, data)))
    x.flush()
    return out


def _run_chunks(fn, jobs: list[tuple], sizes: list[int], desc: str, progress: bool, workers: int | None) -> list:
    """fn(*job) for every job, results concatenated in job order; in worker processes when there are many."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm.auto import tqdm

    total = sum(sizes)
    workers = workers or min(os.cpu_count() or 1, 8)
    results: list = [None] * len(jobs)
    with tqdm(total=total, desc=desc, unit="img", disable=not progress, leave=False) as bar:
        if workers <= 1 or total < PARALLEL_MIN:
            for k, job in enumerate(jobs):
                results[k] = fn(*job)
                bar.update(sizes[k])
        else:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                futures = {pool.submit(fn, *job): k for k, job in enumerate(jobs)}
                for fut in as_completed(futures):
                    results[futures[fut]] = fut.result()
                    bar.update(sizes[futures[fut]])
    return [r for chunk in results for r in chunk]


def _chunks(n: int) -> list[slice]:
    return [slice(i, min(i + CHUNK, n)) for i in range(0, n, CHUNK)]


def _refuse_bad(name: str, bad: list[tuple[str, str]], skip_bad: bool) -> None:
    """Unreadable files, unless skip_bad: one ValueError line naming the first."""
    if bad and not skip_bad:
        rel, why = bad[0]
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ValueError(f"{name}: cannot read {rel} ({why}){more}; fix or remove "
                         f"{'them' if more else 'it'}, or pass --skip-bad-images to leave unreadable files out")


def _warn_skipped(name: str, bad: list[str]) -> None:
    """The files left out (skip_bad): one warning line, the count and the first few names."""
    names = ", ".join(bad[:SHOW_BAD]) + (", ..." if len(bad) > SHOW_BAD else "")
    log.warning("%s: skipped %d unreadable image file%s (%s)", name, len(bad), "" if len(bad) == 1 else "s", names)


def scan(name: str, root: Path, entries: list[Entry], skip_bad: bool, progress: bool,
         workers: int | None = None) -> tuple[list[Entry], list[tuple[int, int, bool]], list[tuple[str, str]]]:
    """Every file's header checked: (readable entries, their (width, height, grey), the unreadable (rel, why))."""
    paths = [str(root / e.rel) for e in entries]
    jobs = [(paths[s],) for s in _chunks(len(paths))]
    found = _run_chunks(_scan_chunk, jobs, [len(j[0]) for j in jobs], f"checking {len(paths):,} images",
                        progress, workers)
    bad = [(e.rel, err) for e, (_, _, _, err) in zip(entries, found) if err is not None]
    _refuse_bad(name, bad, skip_bad)
    keep = [(e, f[:3]) for e, f in zip(entries, found) if f[3] is None]
    if not keep:
        raise ValueError(f"{name}: no readable image file")
    return [e for e, _ in keep], [f for _, f in keep], bad


# ------------------------------------------------------------------------------ geometry
def check_requested(image: dict | None) -> dict:
    """The keys a caller gave, checked; `height` alone means a square (so does `width`)."""
    image = dict(image or {})
    if unknown := sorted(set(image) - set(SPEC_KEYS)):
        raise ValueError(f"unknown image setting {', '.join(unknown)}; known: {', '.join(SPEC_KEYS)}")
    if "height" in image and "width" not in image:
        image["width"] = image["height"]
    if "width" in image and "height" not in image:
        image["height"] = image["width"]
    return image


def finish_spec(spec: dict, what: str) -> dict:
    """A complete spec checked against the input shape it gives (ValueError, one line)."""
    if spec.get("layout") not in LAYOUTS:
        raise ValueError(f"{what}: image layout must be one of {', '.join(LAYOUTS)}, not {spec.get('layout')!r}")
    try:
        spec = {**spec, "height": int(spec["height"]), "width": int(spec["width"]), "channels": int(spec["channels"]),
                "scale": float(spec["scale"])}
        problem = check_image_spec(spec, input_shape_of(spec))
    except (KeyError, TypeError, ValueError) as exc:
        problem = f"image spec needs whole-number height, width, channels ({exc})"
    if problem:
        raise ValueError(f"{what}: {problem}")
    return spec


def default_spec(sizes: list[tuple[int, int, bool]]) -> dict:
    """32x32 when the median image's longer side is at most 32 pixels, else 64x64; grey (1 channel)
    only when every image is grey (by its mode or palette); CHW; never inverted (background any)."""
    side = 32 if float(np.median([max(w, h) for w, h, _ in sizes])) <= 32 else 64
    channels = 1 if all(grey for _, _, grey in sizes) else 3
    return {"height": side, "width": side, "channels": channels, "layout": "CHW", "scale": 1.0,
            "background": "any", "resample": "lanczos"}


def resolve_spec(name: str, image: dict | None, sizes: list[tuple[int, int, bool]]) -> dict:
    requested = check_requested(image)
    if float(requested.get("scale", 1.0)) != 1.0:
        raise ValueError(f"{name}: image files are kept as 8-bit pixels, so scale must be 1 (the network "
                         "normalises its input itself)")
    return finish_spec({**default_spec(sizes), **requested}, name)


# ------------------------------------------------------------------------------ splits
def assign_splits(name: str, entries: list[Entry], seed: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(classes sorted by name, label id per entry, split id per entry: 0 train, 1 calibration, 2 test)."""
    from trainer.data import _stratified_split

    classes = sorted({e.label for e in entries})
    if len(classes) < 2:
        raise ValueError(f"{name}: one class only ({classes[0]!r}); 2 are needed")
    y = np.searchsorted(classes, [e.label for e in entries]).astype(np.int64)  # [N]
    if entries[0].split is not None:
        split = np.array([SPLITS.index(e.split) for e in entries], dtype=np.int64)
        if missing := [classes[c] for c in range(len(classes)) if not np.any((y == c) & (split == 0))]:
            raise ValueError(f"{name}: class {missing[0]!r}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}"
                             " has no training image")
        return classes, y, split
    counts = np.bincount(y, minlength=len(classes))
    smallest = int(np.argmin(counts))
    problem = f"{name}: class {classes[smallest]!r} has {counts[smallest]} image(s); a seeded, stratified " \
              "60/20/20 split needs at least 5 per class (or give train/val/test folders or a split column)"
    if counts[smallest] < 5:
        raise ValueError(problem)
    split = np.zeros(len(entries), dtype=np.int64)
    try:
        parts = _stratified_split(np.arange(len(entries)), y, seed)
    except ValueError:
        raise ValueError(problem) from None
    for k, (idx, _) in enumerate(parts):
        split[idx] = k
    return classes, y, split


# ------------------------------------------------------------------------------ the cache
def cache_root() -> Path:
    return slc_home() / "data" / "images"


def stat_key(root: Path, entries: list[Entry], image: dict | None, seed: int) -> str:
    """What finds a built cache without reading an image: paths, labels, given splits, and each file's
    size, modification and change times, device and inode; the requested spec and the split seed.
    A write to a file always moves its change time (st_ctime: set by the kernel, which no tool sets
    back, unlike the modification time), so a file rewritten with its old size and mtime misses the
    cache and is decoded and hashed again."""
    h = hashlib.sha256(json.dumps({"version": CACHE_VERSION, "seed": seed, "image": check_requested(image)},
                                  sort_keys=True).encode())
    for e in entries:
        st = os.stat(root / e.rel)
        h.update(json.dumps([e.rel, e.label, e.split, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev,
                             st.st_ino]).encode() + b"\n")
    return h.hexdigest()


def _fingerprint(spec: dict, rows: list[tuple[str, str, str, str]]) -> str:
    """sha256 of the spec and every (relative path, label, split, content sha256) in row order."""
    h = hashlib.sha256(json.dumps({"version": CACHE_VERSION, "image": spec}, sort_keys=True).encode())
    for row in rows:
        h.update(json.dumps(row).encode() + b"\n")
    return h.hexdigest()


def _cached(key: str) -> Path | None:
    """The cache directory a key file points to, if it is complete."""
    try:
        fp = json.loads((cache_root() / "keys" / f"{key}.json").read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        return None
    path = cache_root() / fp[:24]
    return path if (path / "meta.json").is_file() else None


def _remember(key: str, cache: Path) -> None:
    meta = json.loads((cache / "meta.json").read_text())
    atomic_write_text(cache_root() / "keys" / f"{key}.json", json.dumps({"fingerprint": meta["fingerprint"]}) + "\n")


def _compact(x: np.ndarray, keep: list[int]) -> None:
    """Rows `keep` (ascending) moved to the front, in order (files that failed to decode left out)."""
    for new, old in enumerate(keep):
        if new != old:
            x[new] = x[old]
    x.flush()


def _decode_all(name: str, stage: Path, root: Path, files: list[Entry], spec: dict, skip_bad: bool,
                progress: bool, workers: int | None) -> list[tuple[int, str]]:
    """Decode `files` into stage/x.npy in order; [(row, sha256)] of the decoded ones, at the front."""
    x = np.lib.format.open_memmap(stage / "x.npy", mode="w+", dtype=np.uint8, shape=(len(files), *input_shape_of(spec)))
    del x  # the workers open it themselves
    paths = [str(root / e.rel) for e in files]
    jobs = [(str(stage / "x.npy"), s.start, paths[s], spec) for s in _chunks(len(paths))]
    results = _run_chunks(_decode_chunk, jobs, [len(j[2]) for j in jobs], f"decoding {len(paths):,} images",
                          progress, workers)
    _refuse_bad(name, [(e.rel, err) for e, (_, err) in zip(files, results) if err is not None], skip_bad)
    done = [(k, sha) for k, (sha, _) in enumerate(results) if sha is not None]
    if len(done) < len(files):
        _compact(np.load(stage / "x.npy", mmap_mode="r+", allow_pickle=False), [k for k, _ in done])
    return done


def build(name: str, root: Path, entries: list[Entry], spec: dict, seed: int, skip_bad: bool, skipped: list[str],
          progress: bool = True, workers: int | None = None) -> Path:
    """Decode the readable files into a new cache directory (rows grouped by split); returns it."""
    from trainer.data import _pixel_stats

    classes, y, split = assign_splits(name, entries, seed)
    order = np.argsort(split, kind="stable")  # [N] rows: train, calibration, test; by path within each
    files = [entries[i] for i in order]
    stage = cache_root() / f".building-{os.getpid()}-{hashlib.sha256(os.urandom(8)).hexdigest()[:8]}"
    stage.mkdir(parents=True)
    try:
        done = _decode_all(name, stage, root, files, spec, skip_bad, progress, workers)
        rows = order[[k for k, _ in done]]
        fp = _fingerprint(spec, [(entries[i].rel, entries[i].label, SPLITS[split[i]], sha)
                                 for i, (_, sha) in zip(rows, done)])
        np.save(stage / "y.npy", y[rows])
        counts = np.bincount(split[rows], minlength=3)
        x = np.load(stage / "x.npy", mmap_mode="r", allow_pickle=False)
        mean, std = _pixel_stats(x[:counts[0]])
        decoded = {k for k, _ in done}
        meta = {"version": CACHE_VERSION, "fingerprint": fp, "dataset": absolute_name(name), "image": spec,
                "classes": classes, "rows": int(len(rows)), "splits": {s: int(c) for s, c in zip(SPLITS, counts)},
                "mean": mean, "std": std or 1.0,
                "skipped": skipped + [f.rel for k, f in enumerate(files) if k not in decoded],
                "files": [entries[i].rel for i in rows]}
        (stage / "meta.json").write_text(json.dumps(meta, ensure_ascii=False) + "\n")
        final = cache_root() / fp[:24]
        if not (final / "meta.json").is_file():  # else the same data is cached already (a moved folder)
            output.replace_cache(stage, final, "image cache")
        return final
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def from_cache(name: str, cache: Path, seed: int, skip_bad: bool) -> "Splits":
    """Splits as memory-mapped row ranges of a built cache (nothing copied into memory but the labels)."""
    from trainer.data import Splits

    meta = json.loads((cache / "meta.json").read_text())
    if meta["skipped"]:  # refused again without skip_bad, else said again (one line)
        _refuse_bad(name, [(rel, "unreadable when the cache was built") for rel in meta["skipped"]], skip_bad)
        _warn_skipped(name, meta["skipped"])
    x = np.load(cache / "x.npy", mmap_mode="r", allow_pickle=False)  # [N0 >= rows, *input_shape] uint8
    y = np.load(cache / "y.npy", allow_pickle=False)  # [rows] int64
    y.flags.writeable = False
    bounds = np.cumsum([0] + [meta["splits"][s] for s in SPLITS])
    parts = [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    spec = meta["image"]
    return Splits(train=parts[0], calibration=parts[1], test=parts[2], input_shape=input_shape_of(spec),
                  classes=list(meta["classes"]), mean=np.asarray(meta["mean"], dtype=np.float32),
                  std=np.asarray(meta["std"], dtype=np.float32), image=spec, fingerprint=meta["fingerprint"],
                  source={"dataset": absolute_name(name), "image": spec, "skip_bad": bool(skip_bad), "seed": seed})


def load(name: str, seed: int = 0, image: dict | None = None, skip_bad: bool = False, progress: bool = True,
         workers: int | None = None) -> "Splits":
    """The Splits of `imagefolder:DIR` / `csv:FILE`, built into the cache on first use (module doc)."""
    from filelock import FileLock

    root, entries = list_entries(name)
    entries, missing = check_files(name, root, entries)  # FIFOs, devices, missing files: never opened
    _refuse_bad(name, missing, skip_bad)
    if not entries:
        raise ValueError(f"{name}: no readable image file")
    key = stat_key(root, entries, image, seed)
    if cache := _cached(key):
        return from_cache(name, cache, seed, skip_bad)
    (cache_root() / "keys").mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_root() / "keys" / f"{key}.lock")):  # torchrun ranks: one builds, the others wait
        if cache := _cached(key):
            return from_cache(name, cache, seed, skip_bad)
        readable, sizes, bad = scan(name, root, entries, skip_bad, progress, workers)
        spec = resolve_spec(name, image, sizes)
        resolved_key = stat_key(root, entries, spec, seed)
        cache = _cached(resolved_key) or build(name, root, readable, spec, seed, skip_bad,
                                               [rel for rel, _ in missing + bad], progress, workers)
        _remember(key, cache)
        _remember(resolved_key, cache)
    return from_cache(name, cache, seed, skip_bad)


def row_files(splits: "Splits") -> dict[str, list[str]]:
    """The file of every row of each split of an image-file dataset (paths as listed), from its cache."""
    meta = json.loads((cache_root() / splits.fingerprint[:24] / "meta.json").read_text())
    bounds = np.cumsum([0] + [meta["splits"][s] for s in SPLITS])
    return {s: meta["files"][a:b] for s, a, b in zip(SPLITS, bounds[:-1], bounds[1:])}


output.register(output.Kind("image cache", lambda path: None))  # written once under its fingerprint, never replaced
