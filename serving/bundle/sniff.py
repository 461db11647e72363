"""What the first bytes of a body or a file are, in words: so that a refusal says what was received
(a PNG sent as form data, a PNG whose line breaks `curl -d` removed, a JPEG labelled image/png,
HTML saved under .png) instead of a decoder's `cannot identify image file <_io.BytesIO object at 0x…>`.
Shared by the server's 415 / 422 answers and the trainer's file errors; by magic bytes only, nothing decoded."""
from __future__ import annotations

import re

# magic bytes -> (content type, name); checked in order on the first bytes
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png", "PNG"), (b"\xff\xd8\xff", "image/jpeg", "JPEG"),
          (b"GIF87a", "image/gif", "GIF"), (b"GIF89a", "image/gif", "GIF"), (b"BM", "image/bmp", "BMP"),
          (b"II*\x00", "image/tiff", "TIFF"), (b"MM\x00*", "image/tiff", "TIFF"))
NAMES = {t: n for _, t, n in _MAGIC} | {"image/webp": "WebP"}
_ADDRESS = re.compile(r"\s*<[^<>]*\bat 0x[0-9a-fA-F]+>")  # a Python object's repr: `<_io.BytesIO object at 0x7f…>`


def image_type(data: bytes) -> str | None:
    """The content type of an image by its magic bytes (image/png, image/jpeg, …), or None."""
    head = bytes(data[:16])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    for magic, content_type, _ in _MAGIC:
        if head.startswith(magic):
            return content_type
    return None


def describe(data: bytes) -> str:
    """The bytes' kind in a few words: "a PNG image", "form data (multipart)", "JSON", "empty"."""
    head = bytes(data[:64])
    if not head:
        return "nothing (an empty body)"
    if (found := image_type(head)) is not None:
        return f"a {NAMES[found]} image"
    if head.startswith(b"\x89PNG"):  # the signature's CR LF gone: curl -d / --data strips line breaks
        return "a PNG image whose line breaks were removed (curl -d does that)"
    text = head.lstrip()
    if text.startswith(b"--") and b"\r\n" in head:
        return "form data (multipart, as curl -F sends)"
    if text[:1] in (b"{", b"["):
        return "JSON"
    if text[:1] == b"<":
        return "HTML or XML text"
    if re.fullmatch(rb"[\w.%+\-]+=[^\s]*(&.*)?", head.split(b"\n", 1)[0]):
        return "url-encoded form data (key=value, as curl -d sends)"
    if all(32 <= c < 127 or c in (9, 10, 13) for c in head):
        return "text"
    return "binary data that is no image format slc reads"


def plain(message: str) -> str:
    """A library's message without Python object addresses (they say nothing to the sender)."""
    return _ADDRESS.sub("", message).strip()


def not_an_image(data: bytes, fmt: str, detail: str = "") -> str:
    """Why bytes that should be a `fmt` image (a Pillow name: PNG, JPEG…) are not, and what to send
    instead: one line, never an object address."""
    found = image_type(data)
    if found is not None and NAMES[found] != fmt:
        return (f"the body is not a {fmt} image: it looks like {describe(data)}; send it with "
                f"-H 'Content-Type: {found}' --data-binary @FILE")
    if found is not None:  # the right magic, a broken rest
        return f"the {fmt} image is damaged or cut short ({plain(detail) or 'it does not decode'})"
    what = describe(data)
    if what.startswith("form data"):
        how = ("send the file itself with --data-binary @FILE (curl -F is for PUT /v1/classes/{name} and "
               "POST /v1/classes/{name}/examples only)")
    else:
        how = "send the file's bytes unchanged with --data-binary @FILE"
    return f"the body is not a {fmt} image: it looks like {what}; {how}"
