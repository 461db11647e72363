"""Image request bodies: the HTTP side (content types, 415 / 413 / 422 envelopes) of decoding an
image body into one example of the bundle's input shape.

The server decodes in worker processes under a time budget (serving/codecs/image_decoder.py); `decode`
here is the same work in the calling thread. The decoding and preprocessing themselves are
serving/bundle/image.py, the one implementation the trainer also uses on image files, so a
training image sent as a body gets exactly its offline logit. The manifest's `image` spec says how (docs/bundle-format.md).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from serving.bundle.image import MAX_PIXELS, preprocess
from serving.codecs.image_worker import decode_body, refusal
from serving.errors import InvalidInput, Kind, NotReady, PayloadTooLarge, SlcError, UnsupportedMediaType

__all__ = ["IMAGE_TYPES", "MAX_PIXELS", "refusal_error", "content_type_of", "decode", "image_format", "is_image",
           "preprocess", "unsupported_body"]

IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/bmp": "BMP",
               "image/webp": "WEBP", "image/tiff": "TIFF"}  # content type -> the one Pillow decoder tried


def content_type_of(scope) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower()
    return b""


def is_image(content_type: bytes) -> bool:
    return content_type.startswith(b"image/")


def image_format(content_type: bytes, spec: Optional[dict]) -> str:
    """The Pillow format to try for a body of this content type; 415 when the bundle or the type takes no image."""
    if spec is None:
        raise UnsupportedMediaType("this bundle's input is not an image: send JSON (Content-Type: application/json)")
    name = content_type.decode("latin-1")
    if name not in IMAGE_TYPES:
        raise UnsupportedMediaType(f"{name} is not a supported image type; send one of {', '.join(IMAGE_TYPES)}")
    return IMAGE_TYPES[name]


def unsupported_body(content_type: bytes, body: bytes, spec: Optional[dict], forms: bool = False) -> UnsupportedMediaType:
    """The 415 of a body of a type the route does not read: what was received (its type and what its
    first bytes look like), the types it takes (images only where the bundle's input is one;
    `forms`: multipart/form-data of enrollment) and the curl flags that send them; one line."""
    from serving.bundle.sniff import describe, image_type

    got = f"Content-Type {content_type.decode('latin-1')}" if content_type else "no Content-Type"
    takes = ["application/json (-H 'Content-Type: application/json' -d @BODY.json)"]
    if spec is not None:
        takes.append(f"an image ({', '.join(IMAGE_TYPES)}: -H 'Content-Type: image/png' --data-binary @IMAGE.png)")
        if forms:
            takes.append("several images as multipart/form-data (curl -F image=@a.png -F image=@b.png)")
    found, what = image_type(body), describe(body)
    send = "send the file itself with --data-binary @FILE and -H 'Content-Type: image/png'"
    if found is not None and spec is not None:
        lead = (f"the body is {what} sent with {got}: send it with -H 'Content-Type: {found}' "
                f"--data-binary @FILE")
    elif spec is not None and "line breaks were removed" in what:
        lead = f"the body is {what}, sent with {got}: {send}, which sends the bytes unchanged"
    elif spec is not None and what.startswith("form data") and not forms:
        lead = (f"the body is {what}, which only PUT /v1/classes/{{name}} and POST /v1/classes/{{name}}/examples "
                f"read: {send}")
    else:
        lead = f"the body ({what}) came with {got}"
    return UnsupportedMediaType(f"{lead}; this route takes {' or '.join(takes)}")


RETRY_AFTER_S = 1  # of a decode that failed for the server's want (memory): 503 + Retry-After


def refusal_error(kind: str, code: str, message: str) -> SlcError:
    """The error of a decoding refusal (serving/codecs/image_worker.py `refusal`)."""
    kind = Kind(kind)
    if kind is Kind.UNAVAILABLE:
        return NotReady(message, code=code, retry_after=RETRY_AFTER_S)
    cls = {Kind.TOO_LARGE: PayloadTooLarge, Kind.UNSUPPORTED_MEDIA: UnsupportedMediaType,
           Kind.INVALID: InvalidInput}.get(kind, SlcError)
    return cls(message, code=code, kind=kind)


def decode(body: bytes, content_type: bytes, spec: Optional[dict], input_shape: tuple[int, ...]) -> np.ndarray:
    """One example float32 [*input_shape] from an image body, decoded in this thread; 415 / 413 / 422
    (503 when the decoder ran out of memory) as the envelope. The server decodes in worker processes instead (serving/codecs/image_decoder.py)."""
    fmt = image_format(content_type, spec)
    try:
        return decode_body(body, fmt, spec)
    except Exception as exc:  # noqa: BLE001 - a decoder or EXIF failure is the image's fault, never a 500
        raise refusal_error(*refusal(exc, body, fmt)) from None
