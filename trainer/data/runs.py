"""What a run records of its data, and loading that data again (docs/datasets.md "Moved data").

Every Splits carries
- `image`: how an image becomes one example (the bundle's `image`), or None. Built-in image
  datasets have theirs (`image_spec`); image files have the spec they were decoded with; `npz:`
  arrays get one inferred from their shape and values (`array_image_spec`) or given;
- `fingerprint`: a sha256 identifying the data. Built-in: of its name, format version and split
  seed; `npz:` the file's sha256; image files: of every file's path, label, split and content;
- `source`: how to load it again, {"dataset" (absolute paths), "image", "skip_bad", "seed"}.

`load_run_data` reloads a run's data from its data.json and refuses, in one line, data that has
gone or changed, pointing at `--data NEW` for data that has moved.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from trainer.data import Splits, check_dataset_name, image_spec, load_dataset
from trainer.data.imagefiles import check_requested, dataset_path, finish_spec, is_image_dataset
from serving.bundle.imagespec import input_shape_of

DARK_BORDER, LIGHT_BORDER = 120.0, 135.0  # border means clear of the server's 127.5 inversion line
MIN_SIDE = 8  # the smallest image side inferred from an array's shape
OVERRIDE_FLAG = "--data"  # how the CLI points a command at a run's moved data


def _builtin_version(name: str) -> int:
    if name.startswith("glyphs"):
        from trainer.data.glyphs import FORMAT_VERSION

        return FORMAT_VERSION
    return 1


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _grid(shape: tuple[int, ...]) -> dict | None:
    """Image geometry read off an example's shape: [H, W], [1|3, H, W] or [H, W, 1|3], sides >= MIN_SIDE."""
    if len(shape) == 2 and min(shape) >= MIN_SIDE:
        return {"height": shape[0], "width": shape[1], "channels": 1, "layout": "HW"}
    if len(shape) == 3 and shape[0] in (1, 3) and min(shape[1:]) >= MIN_SIDE:
        return {"height": shape[1], "width": shape[2], "channels": shape[0], "layout": "CHW"}
    if len(shape) == 3 and shape[2] in (1, 3) and min(shape[:2]) >= MIN_SIDE:
        return {"height": shape[0], "width": shape[1], "channels": shape[2], "layout": "HWC"}
    return None


def _chunks(xs: list[np.ndarray], rows: int = 4096):
    for x in xs:
        for i in range(0, len(x), rows):
            yield np.asarray(x[i:i + rows], dtype=np.float64)


def _pixel_valued(xs: list[np.ndarray], scale: float) -> bool:
    """Whether x / scale are whole numbers 0..255, not all 0 or 1 (a mask is not an image)."""
    top = 0.0
    for block in _chunks(xs):
        v = block / scale
        if not (np.all(v >= 0) and np.all(v <= 255) and np.all(v == np.rint(v))):
            return False
        top = max(top, float(v.max(initial=0.0)))
    return top > 1


def _background(xs: list[np.ndarray], spec: dict) -> str:
    """`dark` if every grey image's border is dark, `light` if every one is light, else `any`:
    the server's inversion then never touches a training image."""
    if spec["channels"] != 1:
        return "any"
    h, w, scale = spec["height"], spec["width"], spec["scale"]
    low, high = np.inf, -np.inf
    for block in _chunks(xs):
        g = block.reshape(len(block), h, w) / scale  # [n, h, w] pixels (channels 1: every layout reshapes so)
        border = np.concatenate([g[:, 0], g[:, -1], g[:, :, 0], g[:, :, -1]], axis=1).mean(axis=1)  # [n]
        low, high = min(low, float(border.min(initial=np.inf))), max(high, float(border.max(initial=-np.inf)))
    return "dark" if high <= DARK_BORDER else "light" if low >= LIGHT_BORDER else "any"


def array_image_spec(name: str, splits: Splits, image: dict | None) -> dict | None:
    """The image spec of an array dataset: inferred when its examples are image-shaped and pixel-valued
    (docs/datasets.md), the given keys taking precedence; None for arrays that are not images."""
    requested = check_requested(image)
    shape = tuple(splits.input_shape)
    grid = _grid(shape)
    xs = [splits.train[0], splits.calibration[0], splits.test[0]]
    scale = float(requested.get("scale", 1.0))
    if not requested and (grid is None or not _pixel_valued(xs, scale)):
        return None
    fallback = {"channels": 1, "layout": {1: "flat", 2: "HW"}.get(len(shape), "CHW")}
    spec = finish_spec({"scale": 1.0, "resample": "lanczos", "background": "any", **(grid or fallback), **requested},
                       name)
    if input_shape_of(spec) != shape:
        raise ValueError(f"{name}: the image settings give examples of shape {list(input_shape_of(spec))}, "
                         f"the arrays hold {list(shape)}")
    if "background" not in requested and _pixel_valued(xs, spec["scale"]):
        spec["background"] = _background(xs, spec)
    return spec


def with_provenance(name: str, seed: int, splits: Splits, image: dict | None) -> Splits:
    """A built-in or npz: dataset's Splits with its image spec, fingerprint and source."""
    if name.startswith("npz:"):
        path = Path(name[4:]).expanduser().resolve()
        spec = array_image_spec(name, splits, image)
        return dataclasses.replace(splits, image=spec, fingerprint=file_sha256(path),
                                   source={"dataset": f"npz:{path}", "image": spec, "seed": seed})
    if image:
        raise ValueError(f"{name} has fixed image geometry; image settings apply to imagefolder:, csv: and npz: data")
    ident = json.dumps({"dataset": name, "version": _builtin_version(name), "seed": seed}, sort_keys=True)
    return dataclasses.replace(splits, image=image_spec(name), fingerprint=hashlib.sha256(ident.encode()).hexdigest(),
                               source={"dataset": name, "image": None, "seed": seed})


def data_record(splits: Splits) -> dict:
    """What a run's data.json needs to load its data again (merge into it)."""
    return {"image": splits.image, "fingerprint": splits.fingerprint, "source": splits.source}


def _has_files(name: str) -> bool:
    return not (is_image_dataset(name) or name.startswith("npz:")) or dataset_path(name).exists()


def load_run_data(data_info: dict, override: str | None = None, progress: bool = True) -> Splits:
    """The Splits a run was trained on (its data.json), from `override` when the data has moved;
    ValueError, one line, when the data is gone, changed, or not the run's. Old runs (no
    fingerprint in data.json) load by dataset name, unchecked."""
    source = data_info.get("source") or {}
    trained = source.get("dataset") or data_info["dataset"]
    fp = data_info.get("fingerprint") or ""
    on = f" (trained on fingerprint {fp[:12]}…)" if fp else ""
    if override is None and not _has_files(trained):
        raise ValueError(f"the run's data {trained} is gone{on}; pass {OVERRIDE_FLAG} NEW to point at its new place")
    name = override or trained
    if override is not None:
        check_dataset_name(override)
    splits = load_dataset(name, seed=int(source.get("seed", 0)), image=source.get("image"),
                          skip_bad=bool(source.get("skip_bad", False)), progress=progress)
    if fp and splits.fingerprint != fp:
        hint = "" if override else f"; pass {OVERRIDE_FLAG} NEW to point at the data it was trained on"
        raise ValueError(f"{name} is not the data the run was trained on (fingerprint {splits.fingerprint[:12]}…, "
                         f"trained on {fp[:12]}…){hint}")
    if list(splits.classes) != [str(c) for c in data_info["classes"]] \
            or list(splits.input_shape) != list(data_info["input_shape"]):
        raise ValueError(f"{name} does not have the run's classes and input shape ({len(data_info['classes'])} classes "
                         f"of {list(data_info['input_shape'])}; it has {splits.num_classes} of {list(splits.input_shape)})")
    return splits
