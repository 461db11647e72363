"""The manifest's `image` key: how a bundle's input is made from an image (docs/bundle-format.md).
Checked by verify; applied by serving/bundle/image.py (the server's image bodies and the trainer's
image files)."""
from __future__ import annotations

from typing import Optional

import numpy as np

LAYOUTS = ("flat", "CHW", "HWC", "HW")  # HW: grey only, an input of shape [height, width]
RESAMPLE = ("lanczos", "bilinear", "nearest")
BACKGROUNDS = ("dark", "light", "any")  # any: the images may have any background, never inverted


def input_shape_of(spec: dict) -> tuple[int, ...]:
    """The input shape a (valid) spec gives."""
    h, w, c = int(spec["height"]), int(spec["width"]), int(spec["channels"])
    return {"flat": (h * w * c,), "CHW": (c, h, w), "HWC": (h, w, c), "HW": (h, w)}[spec["layout"]]


def check_image_spec(spec: dict, input_shape: tuple[int, ...]) -> Optional[str]:
    """What is wrong with a manifest's `image` spec for this input shape (None if nothing)."""
    try:
        h, w, c = int(spec["height"]), int(spec["width"]), int(spec["channels"])
        layout, scale = spec["layout"], float(spec.get("scale", 1.0))
    except (KeyError, TypeError, ValueError) as exc:
        return f"image spec needs height, width, channels, layout ({exc})"
    if min(h, w) < 1 or c not in (1, 3) or layout not in LAYOUTS or not np.isfinite(scale) \
            or (layout == "HW" and c != 1):
        return f"image spec out of range: {spec}"
    if spec.get("background", "dark") not in BACKGROUNDS or spec.get("resample", "lanczos") not in RESAMPLE:
        return f"image spec: background must be one of {BACKGROUNDS}, resample one of {RESAMPLE}"
    box = spec.get("content_box")
    if box is not None and (isinstance(box, bool) or not isinstance(box, (int, float)) or not 0 <= box <= 1 or c != 1):
        return f"image spec: content_box must be a margin between 0 and 1 on a grey (channels 1) image, got {box!r}"
    want = input_shape_of(spec)
    if tuple(input_shape) != want:
        return f"image spec ({layout} {h}x{w}x{c}) does not give the input shape {list(input_shape)}"
    return None
