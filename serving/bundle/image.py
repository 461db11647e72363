"""One image -> one input example, shared by the trainer (image files) and the server (image bodies):
one implementation, so a training image sent to the server gets exactly its offline logit.

Pillow and numpy only (no torch, no web framework). The spec is the manifest's `image`
(docs/bundle-format.md), for example

    {"height": 32, "width": 32, "channels": 1, "layout": "CHW", "scale": 1.0,
     "background": "dark", "resample": "lanczos"}

Decoding: a JPEG much larger than the spec is decoded at a reduced scale (libjpeg's 1/2, 1/4,
1/8; `Image.draft`) still at least REDUCE_GAP times the spec's size. Preprocessing, in order:
EXIF orientation applied; 16-bit grey scaled to 8 bits; transparency
flattened onto the background colour (black for `dark`, white for `light` and `any`); converted to
grey (channels 1) or RGB (3); resized to width × height when it differs (`resample`, after an
integer box reduction down to REDUCE_GAP times the size: Pillow's `reducing_gap`); for grey
images of a `dark` (`light`) background spec whose border is brighter (darker) than mid-grey,
inverted, so dark-on-light drawings and scans work too (`any`: never inverted); multiplied by
`scale` (pixel values 0–255 -> the training range); laid out as `layout` (`flat`, `CHW`, `HWC`,
`HW`). A training image itself (same size, border on the training side) goes through unchanged.
"""
from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Iterable

import numpy as np

FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")  # the Pillow decoders ever tried
EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")  # image files of a dataset
MAX_PIXELS = 16_000_000  # decoded pixels of an image body; a larger one (or a decompression bomb) is refused
FILE_MAX_PIXELS = 89_478_485  # of an image file (Pillow's own decompression-bomb limit): camera photos pass
REDUCE_GAP = 3  # large images are reduced cheaply to >= 3x the target size before resampling (10x faster
#                 on a 12-megapixel photo, a mean difference of 0.1 grey level: tests/serving/bundle/test_image.py)


class ImageTooLarge(ValueError):
    """More pixels than the limit."""


class UnsupportedImage(ValueError):
    """A pixel format the preprocessing does not take (32-bit integer or float samples)."""


def check_header(img, max_pixels: int = MAX_PIXELS) -> None:
    """ImageTooLarge / UnsupportedImage from what `Image.open` read (size, mode): no pixel is decoded."""
    if img.width * img.height > max_pixels:
        raise ImageTooLarge(f"the image has {img.width}x{img.height} pixels; the limit is {max_pixels:,}")
    if img.mode in ("I", "F") or img.mode.startswith("I;32"):
        raise UnsupportedImage(f"{img.mode} images (32-bit samples) are not supported; send 8 or 16 bits")


def open_image(fp: BinaryIO, formats: Iterable[str] = FORMATS, max_pixels: int = MAX_PIXELS, side: int = 0):
    """A decoded PIL image from an open binary file; the header is checked before any pixel is decoded.
    `side`: a JPEG may be decoded at a reduced scale keeping both sides >= side. Pillow's own errors
    (not an image, truncated, DecompressionBombError) pass through."""
    from PIL import Image

    img = Image.open(fp, formats=list(formats))
    check_header(img, max_pixels)
    if side and img.format == "JPEG":
        img.draft(img.mode, (side, side))  # a square: whatever the EXIF rotation, both sides stay >= side
    img.load()
    check_header(img, max_pixels)  # the mode a decoder settles on after loading
    return img


def decode_image(fp: BinaryIO, spec: dict, formats: Iterable[str] = FORMATS, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """One example float32 [*input shape of spec] from the bytes of an image (module doc)."""
    side = REDUCE_GAP * max(int(spec["height"]), int(spec["width"])) if REDUCE_GAP else 0
    return preprocess(open_image(fp, formats, max_pixels, side), spec)


def load_image_file(path: str | Path, spec: dict) -> np.ndarray:
    """One example float32 [*input shape of spec] from an image file, exactly as the server
    decodes the same bytes sent as an image body (files may be larger than bodies: FILE_MAX_PIXELS)."""
    with open(path, "rb") as f:
        return decode_image(f, spec, max_pixels=FILE_MAX_PIXELS)


def is_grey(img) -> bool:
    """Whether an opened (not necessarily loaded) image holds grey values only, by its mode and palette."""
    if img.mode in ("1", "L", "LA") or img.mode.startswith("I;16"):
        return True
    if img.mode in ("P", "PA") and img.palette is not None and img.palette.mode in ("RGB", "RGBA"):
        step = len(img.palette.mode)
        pal = np.frombuffer(bytes(img.palette.palette), dtype=np.uint8)
        pal = pal[: len(pal) // step * step].reshape(-1, step)  # [colours, 3|4]
        return bool(np.all(pal[:, 0] == pal[:, 1]) and np.all(pal[:, 1] == pal[:, 2]))
    return False


def _flatten_transparency(img, background: str):
    """RGBA / LA / PA / P-with-transparency composited onto the background colour; others unchanged."""
    from PIL import Image

    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        colour = (0, 0, 0, 255) if background == "dark" else (255, 255, 255, 255)
        img = Image.alpha_composite(Image.new("RGBA", rgba.size, colour), rgba)
    return img


def preprocess(img, spec: dict) -> np.ndarray:
    """A decoded PIL image -> float32 example laid out as the spec says (see the module doc)."""
    from PIL import Image, ImageOps

    h, w, c = int(spec["height"]), int(spec["width"]), int(spec["channels"])
    background = spec.get("background", "dark")
    img = ImageOps.exif_transpose(img)
    if img.mode.startswith("I;16"):  # 16-bit grey: scaled to 8 bits, not clipped at 255
        img = Image.fromarray(np.rint(np.asarray(img, dtype=np.float64) / 257.0).astype(np.uint8))
    img = _flatten_transparency(img, background).convert("L" if c == 1 else "RGB")
    if img.size != (w, h):
        method = {"lanczos": Image.LANCZOS, "bilinear": Image.BILINEAR, "nearest": Image.NEAREST}
        img = img.resize((w, h), method[spec.get("resample", "lanczos")], reducing_gap=REDUCE_GAP or None)
    a = np.asarray(img, dtype=np.float32)  # [h, w] or [h, w, 3]
    if c == 1 and background in ("dark", "light"):
        border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
        if (border.mean() > 127.5) == (background == "dark"):  # background opposite to training's: invert
            a = 255.0 - a
    a = a * np.float32(spec.get("scale", 1.0))
    layout = spec["layout"]
    if layout == "flat":
        return a.reshape(-1)
    if layout == "HW":
        return a.reshape(h, w)
    if layout == "CHW":
        return a.reshape(1, h, w) if c == 1 else np.ascontiguousarray(a.transpose(2, 0, 1))
    return a.reshape(h, w, c)
