"""Hostile image bodies (issue 30), one regression test per finding, the files crafted here:
a progressive JPEG whose last scan is repeated (scan bomb), a PNG of 700k empty chunks (chunk
flood), a 16-bit 4000x4000 PNG (memory), and a decode past its time budget. Each is refused (or
decoded) with the envelope while a valid image and the health probe still answer, and a decode
past its budget is stopped: its worker process killed and replaced. Real worker processes."""
from __future__ import annotations

import asyncio
import functools
import io
import os
import struct
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from serving.codecs import image_decoder
from tools.bench.hostile_images import chunk_flood_png, png_chunk, progressive_jpeg, sixteen_bit_png
from serving.bundle.image import (FILE_MAX_PIXELS, MAX_JPEG_SCANS, MAX_PNG_CHUNKS, SCANS_AT_MAX_PIXELS,
                                  ImageTooComplex, check_structure, decode_image)
from serving.errors import SlcError
from serving.http.errors import http_headers, http_status
from serving.codecs.image_decoder import DecodePool
from serving.codecs.images import decode
from tests.serving.helpers import alive, assert_envelope

pytestmark = pytest.mark.integration  # worker processes

SPEC = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 1.0, "background": "dark",
        "resample": "lanczos"}
MIB = 1 << 20


def _png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def _digit() -> np.ndarray:
    a = np.zeros((8, 8), np.uint8)
    a[1:7, 3:5] = 255
    return a


def _refusal(body: bytes, content_type: bytes) -> tuple[int, str]:
    with pytest.raises(SlcError) as err:
        decode(body, content_type, SPEC, (64,))
    return http_status(err.value), err.value.code


# ------------------------------------------------------------------ finding 1: progressive JPEG scan bomb
def test_a_progressive_jpeg_with_its_last_scan_repeated_is_refused_before_decoding():
    bomb = progressive_jpeg(4000, 5000)  # ~250 KB; decoding it takes minutes of one core
    assert bomb.count(b"\xff\xda") == 5000
    assert _refusal(bomb, b"image/jpeg") == (413, "image_too_complex")


@pytest.mark.parametrize("side,scans,refused", [
    (4000, SCANS_AT_MAX_PIXELS, False),  # full-size scans up to the budget pass
    (4000, SCANS_AT_MAX_PIXELS + 1, True),
    (64, MAX_JPEG_SCANS, False),  # small images: up to the scan limit
    (64, MAX_JPEG_SCANS + 1, True),
])
def test_jpeg_scans_are_limited_by_count_and_by_scanned_pixels(side, scans, refused):
    data = progressive_jpeg(side, scans)
    if refused:
        with pytest.raises(ImageTooComplex):
            check_structure(data)
    else:
        check_structure(data)


@pytest.mark.parametrize("mode", ["L", "RGB", "CMYK"])
@pytest.mark.parametrize("options", [{"progressive": True}, {"progressive": True, "optimize": True}, {}])
def test_what_pillow_writes_passes_the_structure_checks_and_decodes_as_before(mode, options):
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG", **options)
    check_structure(buf.getvalue())
    expected = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("L").resize((8, 8), Image.LANCZOS,
                                                                                      reducing_gap=3), np.float32)
    got = decode(buf.getvalue(), b"image/jpeg", {**SPEC, "background": "any"}, (64,))
    np.testing.assert_array_equal(got, expected.ravel())


def test_scans_inside_a_segment_are_not_counted():
    """An APP1 segment holding a whole scan-bomb JPEG (as an EXIF thumbnail would) is skipped by its length."""
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
    inner = progressive_jpeg(16, 500)
    app1 = b"\xff\xe1" + struct.pack(">H", len(inner) + 2) + inner
    data = buf.getvalue()[:2] + app1 + buf.getvalue()[2:]
    check_structure(data)
    assert decode(data, b"image/jpeg", SPEC, (64,)).shape == (64,)


def test_trainer_files_keep_the_scan_limit():
    with pytest.raises(ImageTooComplex):
        decode_image(io.BytesIO(progressive_jpeg(4000, 5000)), SPEC, max_pixels=FILE_MAX_PIXELS)


# ------------------------------------------------------------------ finding 2: PNG chunk flood
def test_a_png_of_700k_empty_chunks_is_refused_before_pillow_reads_them():
    flood = chunk_flood_png(8 * MIB - 1024)
    assert len(flood) <= 8 * MIB and (len(flood) - 100) // 12 > 690_000
    assert _refusal(flood, b"image/png") == (413, "image_too_complex")


def test_a_png_split_into_thousands_of_idat_chunks_decodes_as_the_plain_one():
    """Encoders may write many small IDAT chunks: up to MAX_PNG_CHUNKS pass and decode identically."""
    a = np.random.default_rng(2).integers(0, 256, (64, 64), dtype=np.uint8)
    plain = _png(a)
    start = plain.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", plain[start:start + 4])
    stream = plain[start + 8:start + 8 + length]
    pieces = np.array_split(np.frombuffer(stream, np.uint8), min(len(stream), MAX_PNG_CHUNKS - 3))
    split = plain[:start] + b"".join(png_chunk(b"IDAT", p.tobytes()) for p in pieces) + plain[start + 12 + length:]
    check_structure(split)
    np.testing.assert_array_equal(decode(split, b"image/png", SPEC, (64,)), decode(plain, b"image/png", SPEC, (64,)))


# ------------------------------------------------------------------ finding 3: 16-bit PNG amplification
def test_sixteen_bit_values_become_round_v_over_257_for_all_65536():
    v = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    spec = {"height": 256, "width": 256, "channels": 1, "layout": "HW", "scale": 1.0, "background": "any",
            "resample": "nearest"}
    got = decode(_png(v), b"image/png", spec, (256, 256))
    np.testing.assert_array_equal(got, np.rint(v.astype(np.float64) / 257.0).astype(np.float32))  # float64 truth


def test_a_16_bit_4000x4000_png_is_decoded_without_wide_copies():
    """The numpy memory of decoding 16 Mpx of 16-bit grey stays near one byte per pixel (float64 copies: 16)."""
    body = sixteen_bit_png(4000)
    assert len(body) < 64 * 1024
    tracemalloc.start()
    try:
        got = decode(body, b"image/png", {**SPEC, "background": "any"}, (64,))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, np.full(64, np.rint(40_000 / 257.0), np.float32))  # 156
    assert peak < 2 * 16_000_000, f"{peak / MIB:.0f} MiB traced"


# ------------------------------------------------------------------ the decode pool: budget, cancel, queue
def _run(coro):
    return asyncio.run(coro)


async def _ready(pool: DecodePool) -> DecodePool:
    while not pool.is_ready():
        await asyncio.sleep(0.01)
    pool.wait_ready(0)
    return pool


# Pools that take images up to Pillow's own decompression-bomb limit, so that a scan bomb passes the
# structure checks and decodes for seconds: 80 scans of 64 Mpx (5 s on a busy 2-core machine), ten
# times the BUDGET_S of the tests.
PILLOW_LIMIT = 2 * 89_478_485
BUDGET_S = 0.5


@functools.lru_cache(maxsize=1)
def _slow_jpeg() -> bytes:
    data = progressive_jpeg(8000, 80, "L")
    check_structure(data, PILLOW_LIMIT)
    return data


def test_a_decode_past_its_budget_is_killed_its_worker_replaced_and_the_next_image_decoded():
    async def go():
        pool = await _ready(DecodePool(1, 4, BUDGET_S, max_pixels=PILLOW_LIMIT).start())
        try:
            (before,) = pool.pids()
            with pytest.raises(SlcError) as err:
                await pool.decode(_slow_jpeg(), b"image/jpeg", SPEC, (64,))
            assert (http_status(err.value), err.value.code) == (422, "image_decode_timeout")
            assert not alive(before) and pool.kills == 1  # killed (and reaped), not left running
            got = await pool.decode(_png(_digit()), b"image/png", SPEC, (64,))
            np.testing.assert_array_equal(got, decode(_png(_digit()), b"image/png", SPEC, (64,)))
            assert pool.pids()[0] not in (None, before)
        finally:
            pool.stop()
    _run(go())


def test_a_cancelled_decode_kills_its_worker():
    """A request whose deadline passes (or whose client leaves) mid-decode stops the decode too."""
    async def go():
        pool = await _ready(DecodePool(1, 4, 60.0, max_pixels=PILLOW_LIMIT).start())
        try:
            (before,) = pool.pids()
            task = asyncio.create_task(pool.decode(_slow_jpeg(), b"image/jpeg", SPEC, (64,)))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            got = await pool.decode(_png(_digit()), b"image/png", SPEC, (64,))  # served by the replacement
            assert got.shape == (64,) and not alive(before) and pool.pids()[0] != before
        finally:
            pool.stop()
    _run(go())


def test_a_worker_that_died_while_idle_is_replaced_before_the_next_image():
    async def go():
        pool = await _ready(DecodePool(1, 4, 5.0).start())
        try:
            (before,) = pool.pids()
            os.kill(before, 9)
            await asyncio.sleep(0.1)
            assert (await pool.decode(_png(_digit()), b"image/png", SPEC, (64,))).shape == (64,)
            assert pool.crashes == 0
        finally:
            pool.stop()
    _run(go())


def test_bodies_beyond_the_decode_queue_get_429():
    async def go():
        pool = await _ready(DecodePool(1, 0, 60.0, max_pixels=PILLOW_LIMIT).start())
        try:
            busy = asyncio.create_task(pool.decode(_slow_jpeg(), b"image/jpeg", SPEC, (64,)))
            await asyncio.sleep(0.05)
            with pytest.raises(SlcError) as err:
                await pool.decode(_png(_digit()), b"image/png", SPEC, (64,))
            assert (http_status(err.value), err.value.code, http_headers(err.value)) == (429, "overloaded", {"Retry-After": "1"})
            busy.cancel()
        finally:
            pool.stop()
    _run(go())


def test_small_images_do_not_wait_behind_large_ones():
    """Two workers, three slow large bodies: one worker stays free for small images, answered at once."""
    async def go():
        pool = await _ready(DecodePool(2, 8, 60.0, max_pixels=PILLOW_LIMIT).start())
        try:
            slow = [asyncio.create_task(pool.decode(_slow_jpeg(), b"image/jpeg", SPEC, (64,))) for _ in range(3)]
            await asyncio.sleep(0.05)
            for _ in range(3):
                assert (await pool.decode(_png(_digit()), b"image/png", SPEC, (64,))).shape == (64,)
            assert not any(t.done() for t in slow)  # the large ones still decoding or waiting
            for t in slow:
                t.cancel()
            await asyncio.gather(*slow, return_exceptions=True)
        finally:
            pool.stop()
    _run(go())


def test_a_large_image_that_would_start_after_the_deadline_is_429_at_once():
    async def go():
        pool = await _ready(DecodePool(2, 8, 5.0, deadline_s=10.0).start())
        try:
            pool.lanes.rate = 9.5e-6  # large images recently took 9.5 µs per pixel
            big = _png(np.zeros((1100, 1000), np.uint8))  # 1.1 Mpx, 10.45 s at that pace: 2.45 s past 0.8 x 10 s
            with pytest.raises(SlcError) as err:
                await pool.decode(big, b"image/png", SPEC, (64,))
            assert (http_status(err.value), err.value.code, http_headers(err.value)) == (429, "overloaded", {"Retry-After": "3"})
            assert (await pool.decode(_png(_digit()), b"image/png", SPEC, (64,))).shape == (64,)  # small: admitted
        finally:
            pool.stop()
    _run(go())


@pytest.mark.parametrize("fmt,options", [("PNG", {}), ("GIF", {}), ("BMP", {}), ("WEBP", {}), ("WEBP", {"lossless": True}),
                                         ("JPEG", {}), ("JPEG", {"progressive": True})])
def test_header_pixels_are_what_pillow_reads(fmt, options):
    from serving.bundle.image import header_pixels

    for w, h in ((37, 21), (1025, 1024), (3, 4000)):
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (10, 200, 30)).save(buf, fmt, **options)
        width, height = Image.open(io.BytesIO(buf.getvalue())).size  # the truth: Pillow's own header parse
        assert header_pixels(buf.getvalue()) == width * height
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "TIFF")
    assert header_pixels(buf.getvalue()) is None  # unknown: treated as large


def test_decode_workers_never_load_torch():
    async def go():
        pool = await _ready(DecodePool(1, 4, 5.0).start())
        try:
            await pool.decode(_png(_digit()), b"image/png", SPEC, (64,))
            maps = open(f"/proc/{pool.pids()[0]}/maps").read()
            assert "torch" not in maps and "PIL" in maps
        finally:
            pool.stop()
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc")
    _run(go())


# ------------------------------------------------------------------ over HTTP, with the attack in flight
@pytest.fixture(scope="module")
def image_bundle(tmp_path_factory):
    from tests.serving.helpers import synthetic_image_bundle

    return synthetic_image_bundle(tmp_path_factory, "hostile-img", SPEC)

# serve(**settings): tests/serving/conftest.py


def _attack(client, body: bytes, content_type: str, copies: int):
    """`copies` hostile bodies at once; while they are in flight, a valid image and the health probe."""
    def post(data, ctype):
        return client.post("/v1/classes/3/detect", content=data, headers={"content-type": ctype})

    with ThreadPoolExecutor(copies + 2) as ex:
        hostile = [ex.submit(post, body, content_type) for _ in range(copies)]
        valid = ex.submit(post, _png(_digit()), "image/png")
        health = ex.submit(client.get, "/v1/health/live")
        return ([f.result(timeout=300) for f in hostile], valid.result(timeout=300), health.result(timeout=300))


def test_six_scan_bombs_at_once_are_413_while_a_valid_image_and_the_probe_answer(serve):
    client = serve()
    hostile, valid, health = _attack(client, progressive_jpeg(4000, 5000), "image/jpeg", 6)
    for r in hostile:
        assert_envelope(r, 413, "image_too_complex")
    assert valid.status_code == 200 and health.status_code == 200


def test_six_chunk_floods_at_once_are_413_while_a_valid_image_and_the_probe_answer(serve):
    client = serve()
    hostile, valid, health = _attack(client, chunk_flood_png(8 * MIB - 1024), "image/png", 6)
    for r in hostile:
        assert_envelope(r, 413, "image_too_complex")
    assert valid.status_code == 200 and health.status_code == 200


def test_a_16_bit_4000x4000_png_answers_like_its_tensor(serve):
    client = serve()
    body = sixteen_bit_png(4000)
    tensor = decode(body, b"image/png", SPEC, (64,))
    by_image = client.post("/v1/classes/3/detect", content=body, headers={"content-type": "image/png"})
    by_json = client.post("/v1/classes/3/detect", json={"inputs": [tensor.tolist()]})
    assert by_image.status_code == 200, by_image.text
    assert by_image.json() == by_json.json()


def test_an_image_past_the_budget_is_422_its_worker_replaced_while_others_answer(serve, monkeypatch):
    monkeypatch.setattr(image_decoder, "_new_pool", lambda s: DecodePool(2, 8, BUDGET_S, max_pixels=PILLOW_LIMIT))
    client = serve()
    pool = image_decoder.current(client.settings)
    before = set(pool.pids())
    hostile, valid, health = _attack(client, _slow_jpeg(), "image/jpeg", 1)
    assert f"{BUDGET_S:g} s" in assert_envelope(hostile[0], 422, "image_decode_timeout")["error"]["message"]
    assert valid.status_code == 200 and health.status_code == 200
    killed = before - set(pool.pids())
    assert len(killed) == 1 and not any(alive(p) for p in killed) and pool.kills == 1


def test_decode_workers_start_with_the_server_and_stop_with_it(image_bundle, tmp_path):
    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, wait_ready

    settings = make_settings(image_bundle, tmp_path, decode_workers=3)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        pids = image_decoder.current(settings).pids()  # started before readiness, before any image
        assert len(pids) == 3 and all(p is not None and alive(p) for p in pids)
    assert image_decoder.current(settings) is None
    assert not any(alive(p) for p in pids)


def test_a_bundle_without_images_starts_no_decode_worker(client):
    assert image_decoder.current(client.app.state.slc.settings) is None
