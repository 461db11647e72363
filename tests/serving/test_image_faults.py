"""Issue 48, part 5: the server's faults are 503, the body's are 4xx, and a body that can never be
accepted is 413 at once, never 429 "retry".

- A decode that runs out of memory is the server's want, not the image's: 503 `decoder_unavailable`
  with Retry-After, the worker replaced. Checked with a real worker whose address space is cut
  (prlimit, from outside: no hook in the product), on an image this process decodes fine.
- An image whose header declares more pixels than the limit is 413 `image_too_large` before it is
  queued or paced: with the decode queue full and the pace at one second per pixel, the first try
  answers 413 without Retry-After. Pillow reading the same header is the truth of what it declares."""
from __future__ import annotations

import io
import os
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from serving.codecs import image_decoder
from serving.codecs.images import decode
from serving.errors import SlcError
from serving.http.errors import http_headers, http_status
from tests.serving.helpers import assert_envelope
from tools.bench.hostile_images import png_chunk

SPEC = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 1.0, "background": "dark",
        "resample": "lanczos"}
MIB = 1 << 20


def _png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def _digit() -> bytes:
    a = np.zeros((8, 8), np.uint8)
    a[1:7, 3:5] = 255
    return _png(a)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height (8-bit grey), with one small IDAT: a header, no image."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + png_chunk(b"IEND"))


def _gif_header(width: int, height: int) -> bytes:
    """An 8x8 GIF whose logical screen is declared width x height."""
    buf = io.BytesIO()
    Image.new("L", (8, 8)).save(buf, "GIF")
    data = bytearray(buf.getvalue())
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


def _declared(body: bytes, monkeypatch) -> tuple[int, int]:
    """What Pillow reads from the header (its own bomb limit lifted: only the header is read)."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    return Image.open(io.BytesIO(body)).size


def _post(client, body: bytes, content_type: str = "image/png"):
    return client.post("/v1/classes/3/detect", content=body, headers={"content-type": content_type})


# ------------------------------------------------------------------ MemoryError: 503, in this process
def test_a_memory_error_while_decoding_is_503_with_retry_after_not_an_invalid_image(monkeypatch):
    from serving.codecs import images

    def short_of_memory(*_a, **_k):
        raise MemoryError()

    monkeypatch.setattr(images, "decode_body", short_of_memory)
    with pytest.raises(SlcError) as err:
        decode(_digit(), b"image/png", SPEC, (64,))
    assert (http_status(err.value), err.value.code, http_headers(err.value)) == (503, "decoder_unavailable",
                                                                                 {"Retry-After": "1"})


# ------------------------------------------------------------------ over HTTP, real worker processes
@pytest.fixture(scope="module")
def image_bundle(tmp_path_factory):
    from tests.serving.helpers import synthetic_image_bundle

    return synthetic_image_bundle(tmp_path_factory, "image-faults", SPEC)

# serve(**settings): tests/serving/conftest.py


def _vm_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


@pytest.mark.integration
def test_a_worker_short_of_memory_answers_503_with_retry_after_and_is_replaced(serve):
    resource = pytest.importorskip("resource")
    if not hasattr(resource, "prlimit") or not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux prlimit and /proc")
    client = serve(decode_workers=1)
    pool = image_decoder.current(client.settings)
    assert _post(client, _digit()).status_code == 200  # the worker has decoded once: its imports are done
    (pid,) = pool.pids()
    body = _png(np.full((3000, 3000, 3), 40, np.uint8))  # 9 Mpx RGB, within the limit: ~36 MB decoded
    assert decode(body, b"image/png", SPEC, (64,)).shape == (64,)  # the truth: a valid image, decodable here
    _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 8 * MIB, hard))  # 8 MiB more: not 36
    r = _post(client, body)
    assert_envelope(r, 503, "decoder_unavailable")
    assert r.headers.get("retry-after") == "1"
    deadline = time.monotonic() + 60
    while pool.pids() in ([pid], [None]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.pids()[0] not in (None, pid)  # a fresh process, not the one whose heap ran out
    assert _post(client, body).status_code == 200  # the same image, now that memory is there


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["png", "gif"])
def test_a_header_declaring_more_pixels_than_the_limit_is_413_at_once_never_429(serve, monkeypatch, kind):
    client = serve(decode_workers=1, decode_queue=0)
    pool = image_decoder.current(client.settings)
    body = _png_header(20000, 20000) if kind == "png" else _gif_header(20000, 20000)
    assert _declared(body, monkeypatch) == (20000, 20000)
    assert 20000 * 20000 > pool.max_pixels
    pool.pending = len(pool.workers)  # the decode queue full (SLC_DECODE_QUEUE=0): any queued body is 429
    pool.lanes.rate = 1.0  # and the pace at a second per pixel: any large body is paced off with 429
    try:
        r = _post(client, body, f"image/{kind}")
        assert "retry-after" not in r.headers
        assert f"{20000 * 20000:,}" in assert_envelope(r, 413, "image_too_large")["error"]["message"]
        assert pool.pending == len(pool.workers)  # never admitted
        assert_envelope(_post(client, _digit()), 429, "overloaded")  # what the full queue answers a decodable one
    finally:
        pool.pending, pool.lanes.rate = 0, image_decoder.RATE_PRIOR
    assert _post(client, _digit()).status_code == 200


@pytest.mark.integration
def test_the_header_rule_is_the_decoders_limit_exactly(serve):
    """At the limit a header is not refused by it (the worker decodes and finds no image data: 422);
    one pixel row more is 413, as the worker itself would answer after opening it."""
    from serving.bundle.image import MAX_PIXELS

    client = serve(decode_workers=1)
    side = 4000
    assert side * side == MAX_PIXELS
    assert_envelope(_post(client, _png_header(side, side)), 422, "invalid_image")
    assert_envelope(_post(client, _png_header(side, side + 1)), 413, "image_too_large")
