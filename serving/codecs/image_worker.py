"""A decode worker process (`python -m serving.codecs.image_worker READ_FD WRITE_FD`), started and killed by
serving/codecs/image_decoder.py: one image body at a time -> its example, or a refusal.

It imports Pillow, numpy and serving/bundle/image.py only (no web stack, never torch). Frames on
the two pipes (multiprocessing.connection's length-prefixed bytes), nothing pickled either way:
the server never unpickles what a process that just ran a decoder on hostile bytes sends.

    request:  JSON {"format", "spec", "max_pixels"} , the body's bytes
    answer:   JSON {"ok": true, "shape"}              , the example's float32 bytes
              JSON {"kind", "code", "message"}        , b""
"""
from __future__ import annotations

import json
import signal
import sys

import numpy as np

from serving.bundle.image import MAX_PIXELS, ImageTooComplex, ImageTooLarge, UnsupportedImage, decode_image

OUT_OF_MEMORY = "decoder_unavailable"  # the code of a decode that ran out of memory (503)


def refusal(exc: BaseException, body: bytes = b"", fmt: str = "") -> tuple[str, str, str]:
    """(kind, code, message) of the error for a decoding failure (serving/errors.py Kind values): the
    image's fault, except a MemoryError: the body passed the pixel limit, so the memory it lacked is
    the server's to have (503, retried later), not a reason to call the image invalid. An invalid
    body's message says what the bytes look like (serving/bundle/sniff.py), never an object address."""
    from PIL import Image

    from serving.bundle.sniff import not_an_image, plain

    if isinstance(exc, MemoryError):
        return ("unavailable", OUT_OF_MEMORY, "the image decoder ran out of memory on an image within the limits "
                "(a server-side shortage, not the image's fault); retry")
    if isinstance(exc, (ImageTooLarge, Image.DecompressionBombError)):
        return "too_large", "image_too_large", (str(exc) if isinstance(exc, ImageTooLarge)
                                        else f"the image is too large to decode ({exc})")
    if isinstance(exc, ImageTooComplex):
        return "too_large", "image_too_complex", f"{exc}: refused before decoding"
    if isinstance(exc, UnsupportedImage):
        return "unsupported_media", "unsupported_media_type", str(exc)
    if fmt:
        return "invalid", "invalid_image", not_an_image(body, fmt, str(exc)[:120])
    return "invalid", "invalid_image", f"the body is not a decodable image ({plain(str(exc))[:120]})"


def decode_body(body: bytes, fmt: str, spec: dict, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """One example float32 [*input shape of spec] from an image body in format `fmt` (a Pillow name)."""
    import io

    return decode_image(io.BytesIO(body), spec, formats=[fmt], max_pixels=max_pixels)


def _trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def serve(rd, wr) -> None:
    """Answer requests until the server closes its end of the pipe."""
    wr.send_bytes(b'{"ready": true}')
    while True:
        try:
            request = json.loads(rd.recv_bytes())
            body = rd.recv_bytes()
        except EOFError:
            return
        try:
            x = decode_body(body, request["format"], request["spec"], request["max_pixels"])
            answer, data = {"ok": True, "shape": list(x.shape)}, np.ascontiguousarray(x, np.float32)
        except Exception as exc:  # noqa: BLE001 - decoder errors are the image's; MemoryError the server's (refusal)
            (kind, code, message), data = refusal(exc, body, request["format"]), b""
            answer = {"kind": kind, "code": code, "message": message}
        del body
        wr.send_bytes(json.dumps(answer).encode())
        wr.send_bytes(data)  # the array's own buffer: no copy
        _trim()  # a 40 KB PNG can take 100 MB to decode: not kept resident between requests


def _die_with_the_server() -> None:
    """SIGKILL when the thread that started this process ends (Linux PR_SET_PDEATHSIG): a server killed
    with -9 leaves no decode running; its feeder threads live as long as the server's decoding does."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed pipe ends it after the decode in progress
        pass


def main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection

    from PIL import ImageFile

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops its workers
    _die_with_the_server()
    ImageFile.LOAD_TRUNCATED_IMAGES = False  # Pillow's default, kept: a truncated body is 422, never half an image
    rd, wr = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    serve(rd, wr)


if __name__ == "__main__":
    main(sys.argv[1:])
