"""One image -> one input example, shared by the trainer (image files) and the server (image bodies):
one implementation, so a training image sent to the server gets exactly its offline logit.

Pillow and numpy only (no torch, no web framework). The spec is the manifest's `image`
(docs/bundle-format.md), for example

    {"height": 32, "width": 32, "channels": 1, "layout": "CHW", "scale": 1.0,
     "background": "dark", "resample": "lanczos"}

Before any decoder runs, the bytes are walked for work that no legitimate image asks for
(`check_structure`: JPEG segments and scans, PNG chunks), and refused as ImageTooComplex: a
progressive JPEG whose refinement scan is repeated thousands of times decodes for minutes, a PNG
of 700k empty chunks costs seconds of Python in Pillow's chunk reader.

Decoding: a JPEG much larger than the spec is decoded at a reduced scale (libjpeg's 1/2, 1/4,
1/8; `Image.draft`) still at least REDUCE_GAP times the spec's size. Preprocessing, in order:
EXIF orientation applied; 16-bit grey scaled to 8 bits (round(v / 257), by a table, a band of
rows at a time: no wide copy of the image); transparency
flattened onto the background colour (black for `dark`, white for `light` and `any`); converted to
grey (channels 1) or RGB (3); for a spec with `content_box` (grey only), cropped to the square
around what is drawn plus that margin (`crop_to_content`: a character filling a third of the
image or all of it, anywhere, gives the same crop; an image already at the spec's size whose square,
fainter strokes counted, lies within FRAMED_PIXELS of its edges is kept as it is, not resampled
again); resized to width × height when it differs (`resample`, after an integer box reduction
down to REDUCE_GAP times the size: Pillow's `reducing_gap`); for grey images of a `dark` (`light`)
background spec whose border is brighter (darker) than mid-grey, inverted, so dark-on-light
drawings and scans work too (`any`: never inverted); multiplied by `scale` (pixel values 0–255 ->
the training range); laid out as `layout` (`flat`, `CHW`, `HWC`, `HW`). A training image itself
(same size, border on the training side) goes through unchanged.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import BinaryIO, Iterable, Optional

import numpy as np

FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")  # the Pillow decoders ever tried
EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")  # image files of a dataset
MAX_PIXELS = 16_000_000  # decoded pixels of an image body; a larger one (or a decompression bomb) is refused
FILE_MAX_PIXELS = 89_478_485  # of an image file (Pillow's own decompression-bomb limit): camera photos pass
# What a file may decode to (width x height x bands x bytes per sample, after a JPEG's reduced-scale
# decode): 128 MiB is a 44-megapixel RGB or a 33-megapixel RGBA image; a small PNG of 9000x9000 RGBA
# (324 MiB decoded) is refused by its header. Bodies need no such bound: MAX_PIXELS keeps them under 128 MiB.
FILE_MAX_DECODED_BYTES = 128 << 20
CONTENT_PROBE = 256  # the content box is found on a copy at most this many pixels on a side
CONTENT_MIN_CONTRAST = 24  # an image whose pixels differ less from its border than this is blank
FRAMED_PIXELS = 2  # an image at the spec's size whose content box is this close to every edge: framed already
FRAMED_LEVEL = 1 / 3  # ... its box found counting fainter strokes as drawn (the crop's own box: half the peak)
REDUCE_GAP = 3  # large images are reduced cheaply to >= 3x the target size before resampling (10x faster
#                 on a 12-megapixel photo, a mean difference of 0.1 grey level: tests/serving/bundle/test_image.py)
# Structure limits (check_structure), far above what encoders write: libjpeg writes 6 (grey) to 18
# (CMYK) scans for a progressive JPEG, libpng one IDAT chunk per 8 KiB.
MAX_JPEG_SCANS = 100  # libjpeg-turbo's djpeg -maxscans idea: more scans than this is refused
SCANS_AT_MAX_PIXELS = 32  # and scans x pixels at most this many full scans of an image of max_pixels
MAX_JPEG_SEGMENTS = 1000  # markers with a length (APPn, COM, DHT, DQT, SOF, SOS ...)
MAX_PNG_CHUNKS = 10_000
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xff\xd0-\xd7]")  # a marker; skips stuffed 0xFF00, RSTn and fill bytes
_JPEG_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_JPEG_PROGRESSIVE = frozenset((0xC2, 0xC6, 0xCA, 0xCE))
_TO_8BIT = ((np.arange(65536, dtype=np.uint32) + 128) // 257).astype(np.uint8)  # == rint(v / 257): 257 is odd, no ties
_BAND_ROWS = 256  # rows of a 16-bit image converted at a time


class ImageTooLarge(ValueError):
    """More pixels than the limit."""


class UnsupportedImage(ValueError):
    """A pixel format the preprocessing does not take (32-bit integer or float samples)."""


class ImageTooComplex(ValueError):
    """More decoding work than any legitimate image needs (scans, segments, chunks): refused unread."""


def check_structure(data: bytes, max_pixels: int = MAX_PIXELS) -> None:
    """ImageTooComplex for a JPEG or PNG whose structure asks for pathological work, from its bytes
    alone (no decoder runs; a bounded walk, at most a few thousand steps). Other formats and
    malformed files pass: the decoder then answers for them."""
    if data[:2] == b"\xff\xd8":
        _check_jpeg(data, max_pixels)
    elif data[:8] == b"\x89PNG\r\n\x1a\n":
        _check_png(data)


def _check_jpeg(data: bytes, max_pixels: int) -> None:
    """Walk the markers to EOI (segments skipped by their length, entropy-coded data by a regex in C):
    count segments and scans; a scan costs about its image's pixels to decode, however few bytes it holds."""
    pos, segments, scans, pixels, progressive = 2, 0, 0, 0, False
    while (m := _JPEG_MARKER.search(data, pos)) is not None and m.end() + 2 <= len(data):
        marker = data[m.end() - 1]
        if marker == 0xD9:  # EOI
            break
        if marker in (0x01, 0xD8):  # TEM, SOI: no length
            pos = m.end()
            continue
        segments += 1
        if segments > MAX_JPEG_SEGMENTS:
            raise ImageTooComplex(f"the JPEG has more than {MAX_JPEG_SEGMENTS} segments")
        if marker in _JPEG_SOF and m.end() + 7 <= len(data):
            height, width = struct.unpack_from(">HH", data, m.end() + 3)
            pixels, progressive = width * height, marker in _JPEG_PROGRESSIVE
            if pixels > max_pixels:
                return  # too large anyway: check_header says so (413 image_too_large)
        elif marker == 0xDA:
            scans += 1
            budget = SCANS_AT_MAX_PIXELS * max_pixels
            if scans > MAX_JPEG_SCANS or (scans > 1 and scans * pixels > budget):
                kind = "progressive " if progressive else ""
                raise ImageTooComplex(f"the {kind}JPEG has more than {scans - 1} scans of {pixels:,} pixels; the "
                                      f"limit is {MAX_JPEG_SCANS} scans and {budget:,} scanned pixels")
        pos = m.end() + struct.unpack_from(">H", data, m.end())[0]


def _check_png(data: bytes) -> None:
    """Count the chunks (length and type headers only) up to IEND: Pillow reads each in Python."""
    pos, chunks, end = 8, 0, len(data) - 8
    while pos <= end:
        length, kind = struct.unpack_from(">I4s", data, pos)
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            raise ImageTooComplex(f"the PNG has more than {MAX_PNG_CHUNKS:,} chunks")
        if kind == b"IEND":
            break
        pos += 12 + length


def header_pixels(data: bytes) -> Optional[int]:
    """Width x height as a PNG, GIF, BMP, WEBP or JPEG header declares it, read from the bytes in a
    few steps (no decoder); None for other formats or a header not found where it should be."""
    try:
        if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
            w, h = struct.unpack_from(">II", data, 16)
        elif data[:6] in (b"GIF87a", b"GIF89a"):
            w, h = struct.unpack_from("<HH", data, 6)
        elif data[:2] == b"BM":
            w, h = struct.unpack_from("<HH" if struct.unpack_from("<I", data, 14)[0] == 12 else "<ii", data, 18)
        elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            w, h = _webp_size(data)
        elif data[:2] == b"\xff\xd8":
            w, h = _jpeg_size(data)
        else:
            return None
    except (struct.error, TypeError):
        return None
    return abs(w) * abs(h)


def _webp_size(data: bytes) -> tuple[int, int]:
    kind = data[12:16]
    if kind == b"VP8X":  # the canvas, 24-bit sizes minus one
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if kind == b"VP8L":  # 14-bit sizes minus one, after the signature byte
        bits = struct.unpack_from("<I", data, 21)[0]
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if kind == b"VP8 ":  # 14-bit sizes after the frame tag and start code
        w, h = struct.unpack_from("<HH", data, 26)
        return w & 0x3FFF, h & 0x3FFF
    raise TypeError(kind)


def _jpeg_size(data: bytes, segments: int = 64) -> tuple[int, int]:
    """From the SOF segment, looked for among the first `segments` markers."""
    pos = 2
    for _ in range(segments):
        m = _JPEG_MARKER.search(data, pos)
        if m is None:
            break
        marker = data[m.end() - 1]
        if marker in _JPEG_SOF:
            h, w = struct.unpack_from(">HH", data, m.end() + 3)
            return w, h
        pos = m.end() + (0 if marker in (0x01, 0xD8) else struct.unpack_from(">H", data, m.end())[0])
    raise TypeError("no SOF")


def check_header(img, max_pixels: int = MAX_PIXELS) -> None:
    """ImageTooLarge / UnsupportedImage from what `Image.open` read (size, mode): no pixel is decoded."""
    if img.width * img.height > max_pixels:
        raise ImageTooLarge(f"the image has {img.width}x{img.height} pixels; the limit is {max_pixels:,}")
    if img.mode in ("I", "F") or img.mode.startswith("I;32"):
        raise UnsupportedImage(f"{img.mode} images (32-bit samples) are not supported; send 8 or 16 bits")


def decoded_bytes(img) -> int:
    """Bytes the decoder's output of an opened image holds: width x height x bands x bytes per sample."""
    sample = 2 if img.mode.startswith("I;16") else 4 if img.mode in ("I", "F") else 1
    return img.width * img.height * len(img.getbands()) * sample


def check_decoded_bytes(img, max_bytes: Optional[int]) -> None:
    """ImageTooLarge when the opened image would decode to more than max_bytes (None: no bound)."""
    if max_bytes is not None and (n := decoded_bytes(img)) > max_bytes:
        raise ImageTooLarge(f"the image decodes to {n / 2**20:,.0f} MiB ({img.width}x{img.height} {img.mode}); "
                            f"the limit for an image file is {max_bytes / 2**20:,.0f} MiB")


def open_image(fp: BinaryIO, formats: Iterable[str] = FORMATS, max_pixels: int = MAX_PIXELS, side: int = 0,
               max_bytes: Optional[int] = None):
    """A decoded PIL image from an open binary file; the header is checked before any pixel is decoded.
    `side`: a JPEG may be decoded at a reduced scale keeping both sides >= side. `max_bytes`: what
    the decoder may produce (checked after the reduced scale is chosen, before decoding). ImageTooComplex
    before Pillow reads anything (check_structure). Pillow's own errors
    (not an image, truncated, DecompressionBombError) pass through."""
    from PIL import Image

    start = fp.tell()
    check_structure(fp.read(), max_pixels)
    fp.seek(start)
    img = Image.open(fp, formats=list(formats))
    check_header(img, max_pixels)
    if side and img.format == "JPEG":
        img.draft(img.mode, (side, side))  # a square: whatever the EXIF rotation, both sides stay >= side
    check_decoded_bytes(img, max_bytes)
    img.load()
    check_header(img, max_pixels)  # the mode a decoder settles on after loading
    return img


def decode_image(fp: BinaryIO, spec: dict, formats: Iterable[str] = FORMATS, max_pixels: int = MAX_PIXELS,
                 max_bytes: Optional[int] = None) -> np.ndarray:
    """One example float32 [*input shape of spec] from the bytes of an image (module doc)."""
    side = REDUCE_GAP * max(int(spec["height"]), int(spec["width"])) if REDUCE_GAP else 0
    return preprocess(open_image(fp, formats, max_pixels, side, max_bytes), spec)


def load_image_file(path: str | Path, spec: dict) -> np.ndarray:
    """One example float32 [*input shape of spec] from an image file, exactly as the server
    decodes the same bytes sent as an image body (files may be larger than bodies: FILE_MAX_PIXELS)."""
    with open(path, "rb") as f:
        return decode_image(f, spec, max_pixels=FILE_MAX_PIXELS, max_bytes=FILE_MAX_DECODED_BYTES)


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


def _sixteen_to_eight_bits(img):
    """An I;16 image -> L of round(v / 257), through a table, _BAND_ROWS rows at a time: one byte per
    pixel more than the image itself (a float64 copy was 16 bytes per pixel: 256 MB at 16 Mpx)."""
    from PIL import Image

    out = np.empty((img.height, img.width), np.uint8)  # [h, w]
    for top in range(0, img.height, _BAND_ROWS):
        bottom = min(top + _BAND_ROWS, img.height)
        out[top:bottom] = _TO_8BIT[np.asarray(img.crop((0, top, img.width, bottom)))]  # uint16 band -> uint8
    return Image.fromarray(out)


def content_box(grey: np.ndarray, margin: float, level: float = 0.5) -> tuple[float, float, float, float, int] | None:
    """The square around what is drawn on grey [H, W] uint8, `margin` of its side added on each
    side: (left, top, right, bottom, background level), or None for a blank image. The background is
    the border's median; what differs from it by more than `level` of the largest difference (half)
    is drawn, light on dark or dark on light alike."""
    a = grey.astype(np.int16)  # [H, W]
    bg = int(np.median(np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])))
    d = np.abs(a - bg)  # [H, W]
    peak = int(d.max())
    if peak < CONTENT_MIN_CONTRAST:
        return None
    drawn = d > peak * level  # [H, W]
    rows, cols = np.flatnonzero(drawn.any(1)), np.flatnonzero(drawn.any(0))
    top, bottom, left, right = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    side = max(bottom - top, right - left) * (1 + 2 * margin)
    cy, cx = (top + bottom) / 2, (left + right) / 2
    return cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2, bg


def crop_to_content(img, margin: float, framed_within: float = 0.0):
    """A grey PIL image cropped to its content box (`content_box`), padded with its background
    where the square leaves the image: wherever a character sits and whatever its size, the same
    crop. The trainer's glyph renderings and the server's image bodies both go through here.
    An image whose box (fainter strokes counted: FRAMED_LEVEL) lies within `framed_within` pixels of
    each of its edges is framed already and returned as it is: cropping it again would only
    resample it (a training image sent back)."""
    from PIL import Image

    small = img if max(img.size) <= CONTENT_PROBE else img.reduce(-(-max(img.size) // CONTENT_PROBE))
    box = content_box(np.asarray(small), margin)
    if box is None:
        return img
    fx, fy = img.width / small.width, img.height / small.height
    if framed_within:
        faint = content_box(np.asarray(small), margin, FRAMED_LEVEL)
        if all(abs(v * f - e) <= framed_within for v, f, e in zip(faint[:4], (fx, fy, fx, fy), (0, 0) + img.size)):
            return img
    left, top, right, bottom = (round(v * f) for v, f in zip(box[:4], (fx, fy, fx, fy)))
    side = max(right - left, bottom - top, 1)
    out = Image.new("L", (side, side), box[4])
    out.paste(img.crop((max(left, 0), max(top, 0), min(left + side, img.width), min(top + side, img.height))),
              (max(-left, 0), max(-top, 0)))
    return out


def preprocess(img, spec: dict) -> np.ndarray:
    """A decoded PIL image -> float32 example laid out as the spec says (see the module doc)."""
    from PIL import Image, ImageOps

    h, w, c = int(spec["height"]), int(spec["width"]), int(spec["channels"])
    background = spec.get("background", "dark")
    img = ImageOps.exif_transpose(img)
    if img.mode.startswith("I;16"):  # 16-bit grey: scaled to 8 bits, not clipped at 255
        img = _sixteen_to_eight_bits(img)
    img = _flatten_transparency(img, background).convert("L" if c == 1 else "RGB")
    if c == 1 and spec.get("content_box") is not None:  # at the spec's size, a crop would resample it
        img = crop_to_content(img, float(spec["content_box"]), FRAMED_PIXELS if img.size == (w, h) else 0.0)
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
