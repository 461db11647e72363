"""Image request bodies: the HTTP side (content types, 415 / 413 / 422 envelopes) of decoding an
image body into one example of the bundle's input shape.

The decoding and preprocessing themselves are serving/bundle/image.py, the one implementation
the trainer also uses on image files, so a training image sent as a body gets exactly its
offline logit. The manifest's `image` spec says how (docs/bundle-format.md).
"""
from __future__ import annotations

import io
from typing import Optional

import numpy as np

from serving.bundle.image import MAX_PIXELS, ImageTooLarge, UnsupportedImage, decode_image, preprocess
from serving.errors import InvalidInput, PayloadTooLarge
from serving.inputs import UnsupportedMediaType

__all__ = ["IMAGE_TYPES", "MAX_PIXELS", "content_type_of", "decode", "is_image", "preprocess"]

IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/bmp": "BMP",
               "image/webp": "WEBP", "image/tiff": "TIFF"}  # content type -> the one Pillow decoder tried


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
        return decode_image(io.BytesIO(body), spec, formats=[IMAGE_TYPES[content_type.decode("latin-1")]])
    except ImageTooLarge as exc:
        raise PayloadTooLarge(str(exc), code="image_too_large") from None
    except UnsupportedImage as exc:
        raise UnsupportedMediaType(str(exc)) from None
    except Image.DecompressionBombError as exc:  # Pillow's own guard, far above MAX_PIXELS
        raise PayloadTooLarge(f"the image is too large to decode ({exc})", code="image_too_large") from None
    except Exception as exc:  # noqa: BLE001 - any decoder or EXIF failure is the image's fault, never a 500
        raise InvalidInput(f"the body is not a decodable image ({type(exc).__name__}: {str(exc)[:120]})",
                           code="invalid_image") from None
