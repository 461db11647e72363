"""Image request bodies: decode (Pillow) and preprocess exactly as the bundle's training data was
made, into one example of the bundle's input shape.

A bundle whose input is an image records how in its manifest (`image`, docs/bundle-format.md):

    {"height": 32, "width": 32, "channels": 1, "layout": "CHW", "scale": 1.0,
     "background": "dark", "resample": "lanczos"}

Preprocessing, in order: EXIF orientation applied; transparency flattened onto the background
colour; converted to grey (channels 1) or RGB (3); resized to width × height when it differs
(`resample`); for grey images whose border is brighter than mid-grey while training images are
light-on-dark (`background: dark`), inverted, so dark-on-light drawings and scans work too;
multiplied by `scale` (pixel values 0–255 → the training range); laid out as `layout` (`flat`,
`CHW`, `HWC`). A training image itself (same size, dark border) goes through unchanged.
"""
from __future__ import annotations

import io
from typing import Optional

import numpy as np

from serving.errors import InvalidInput, PayloadTooLarge
from serving.inputs import UnsupportedMediaType

IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/bmp": "BMP",
               "image/webp": "WEBP", "image/tiff": "TIFF"}  # content type -> the one Pillow decoder tried
MAX_PIXELS = 16_000_000  # decoded pixels; a larger image (or a decompression bomb) is refused


def content_type_of(scope) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower()
    return b""


def is_image(content_type: bytes) -> bool:
    return content_type.startswith(b"image/")


def decode(body: bytes, content_type: bytes, spec: Optional[dict], input_shape: tuple[int, ...]) -> np.ndarray:
    """One example float32 [*input_shape] from an image body; 415 / 413 / 422 as the envelope."""
    if spec is None:
        raise UnsupportedMediaType("this bundle's input is not an image: send JSON (Content-Type: application/json)")
    if content_type.decode("latin-1") not in IMAGE_TYPES:
        raise UnsupportedMediaType(f"{content_type.decode('latin-1')} is not a supported image type; "
                                   f"send one of {', '.join(IMAGE_TYPES)}")
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(body), formats=[IMAGE_TYPES[content_type.decode("latin-1")]])
        if img.width * img.height > MAX_PIXELS:
            raise PayloadTooLarge(f"the image has {img.width}x{img.height} pixels; the limit is {MAX_PIXELS:,}",
                                  code="image_too_large")
        img.load()
        if img.mode in ("I", "F") or img.mode.startswith("I;32"):
            raise UnsupportedMediaType(f"{img.mode} images (32-bit samples) are not supported; send 8 or 16 bits")
        return preprocess(img, spec)
    except (PayloadTooLarge, UnsupportedMediaType):
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own guard, far above MAX_PIXELS
        raise PayloadTooLarge(f"the image is too large to decode ({exc})", code="image_too_large") from None
    except Exception as exc:  # noqa: BLE001 - any decoder or EXIF failure is the image's fault, never a 500
        raise InvalidInput(f"the body is not a decodable image ({type(exc).__name__}: {str(exc)[:120]})",
                           code="invalid_image") from None


def preprocess(img, spec: dict) -> np.ndarray:
    """A decoded PIL image -> float32 example laid out as the spec says (see the module doc)."""
    from PIL import Image, ImageOps

    h, w, c = int(spec["height"]), int(spec["width"]), int(spec["channels"])
    dark = spec.get("background", "dark") == "dark"
    img = ImageOps.exif_transpose(img)
    if img.mode.startswith("I;16"):  # 16-bit grey: scaled to 8 bits, not clipped at 255
        img = Image.fromarray(np.rint(np.asarray(img, dtype=np.float64) / 257.0).astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, (0, 0, 0, 255) if dark else (255, 255, 255, 255))
        img = Image.alpha_composite(flat, rgba)
    img = img.convert("L" if c == 1 else "RGB")
    if img.size != (w, h):
        method = {"lanczos": Image.LANCZOS, "bilinear": Image.BILINEAR, "nearest": Image.NEAREST}
        img = img.resize((w, h), method[spec.get("resample", "lanczos")])
    a = np.asarray(img, dtype=np.float32)  # [h, w] or [h, w, 3]
    if c == 1:
        border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
        if (border.mean() > 127.5) == dark:  # background opposite to training's: invert
            a = 255.0 - a
    a = a * np.float32(spec.get("scale", 1.0))
    if spec["layout"] == "flat":
        return a.reshape(-1)
    if spec["layout"] == "CHW":
        return a.reshape(1, h, w) if c == 1 else np.ascontiguousarray(a.transpose(2, 0, 1))
    return a.reshape(h, w, c)
