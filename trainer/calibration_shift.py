"""Shifted renderings of the calibration images, for `slc export` (issue 37).

A bundle's thresholds are chosen on the calibration split, printed faces the model fits almost
perfectly; a user's scans, photos or brush strokes make every logit lower and the highest negatives
higher. Export therefore calibrates on the calibration images *and* a seeded style-shifted copy of
each (trainer/augment.py `Style`: stroke weight, blur, contrast), rounded to whole pixels as a saved
image would be. The shifted copies widen each class's negative tail; the norm rule
(serving/calibration/norm.py) reads that tail per class, so the thresholds hold on faces unlike the
calibration ones (the choice and its measurements: docs/calibration.md, "Calibrating for shifted
images").
"""
from __future__ import annotations

import numpy as np

SHIFTS = ("auto", "style", "none")
SHIFT_SEED = 12345
BATCH = 4096


def applies(input_shape: tuple[int, ...], image: dict | None) -> bool:
    """Whether the style shift can be drawn on this dataset's examples: images laid out [C, H, W]."""
    return image is not None and len(input_shape) == 3 and image.get("layout", "CHW") == "CHW"


def resolve(name: str, pols: bool, input_shape: tuple[int, ...], image: dict | None) -> str:
    """"style" or "none". auto: style for a PoLS loss on images (whose default rule reads each class's
    tail), none otherwise. ValueError (one line) for style on examples that are not images."""
    if name not in SHIFTS:
        raise ValueError(f"unknown calibration shift {name!r}; known: {', '.join(SHIFTS)}")
    fits = applies(tuple(input_shape), image)
    if name == "auto":
        return "style" if pols and fits else "none"
    if name == "style" and not fits:
        raise ValueError(f"--calibration-shift style needs an image dataset laid out [C, H, W]; "
                         f"this one's examples are {tuple(input_shape)}")
    return name


def style_shifted(x: np.ndarray, image: dict, seed: int = SHIFT_SEED) -> np.ndarray:
    """x [N, C, H, W] inputs (pixel x the spec's `scale`) -> the same shape and dtype, each image with
    its own seeded stroke weight, blur and contrast, rounded to whole pixel values in [0, 255]."""
    import torch

    from trainer.augment import Style

    scale = float(image.get("scale", 1.0))
    style = Style(dark_background=image.get("background", "dark") == "dark")
    gen = torch.Generator().manual_seed(int(seed))
    out = np.empty(x.shape, dtype=np.asarray(x[:0]).dtype)
    for i in range(0, len(x), BATCH):
        pixels = torch.tensor(np.asarray(x[i:i + BATCH], dtype=np.float32) / scale)  # [b, C, H, W] in 0..255
        out[i:i + BATCH] = (style(pixels, gen).round().clamp(0, 255) * scale).numpy()
    return out


def record(name: str, images: int) -> dict | None:
    """calibration.json's `shift` entry (None without a shift)."""
    if name == "none":
        return None
    return {"name": name, "seed": SHIFT_SEED, "images": int(images),
            "what": "each calibration image again with a seeded stroke weight, blur and contrast"}


def with_clean_global(cal: dict, clean: dict, entry: dict) -> dict:
    """`cal` (fitted on the clean and shifted copies) with its `shift` entry, and its global threshold
    and the summary's global figures taken from `clean` (the clean split alone). The server uses the
    global threshold for enrolled classes, whose rows are scaled on the clean calibration negatives
    (docs/api.md "Enroll a class"); pooled over the shifted copies it is set by the most shifted
    negatives of all classes, far above what an enrolled class's positives reach."""
    out = dict(cal, shift=entry, **{"global": {**clean["global"], "fitted_on": "the calibration split alone"}})
    summary = dict(out["summary"])
    summary.update({k: v for k, v in clean["summary"].items() if k.startswith("global")})
    if "test" in summary and "test" in clean["summary"]:
        summary["test"] = {**summary["test"], **{k: v for k, v in clean["summary"]["test"].items()
                                                 if k.startswith("global")}}
    out["summary"] = summary
    return out
