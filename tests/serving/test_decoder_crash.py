"""A decode worker process that dies mid-decode (kill -9, the OOM killer) is the server's failure, not
the body's: the body is decoded once more on a fresh process, and a second death is 503
`decoder_crashed` with Retry-After; an image that fails to decode on its own stays 422.

The worker is killed while it holds the body, found without timing: the pools here start
tests/serving/stalling_worker.py (the server's worker with its decode wrapped), where a worker that
claims a ticket file writes busy-<pid> and waits, and the test kills that pid. The answers are
checked against serving.bundle.image.decode_image run here on the same bytes."""
from __future__ import annotations

import asyncio
import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from serving.bundle.image import decode_image
from serving.codecs import image_decoder
from serving.codecs.image_decoder import DecodePool
from serving.errors import Kind, SlcError
from serving.http.errors import http_headers, http_status
from tests.serving import stalling_worker
from tests.serving.helpers import alive, assert_envelope

pytestmark = pytest.mark.integration  # worker processes

SPEC = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 1.0, "background": "dark",
        "resample": "lanczos"}
WAIT_S = 60.0  # a guard against a hang, never a measured time


def _png() -> bytes:
    """A valid image whose example is not trivial: random grey, 40x48."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 48), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _offline(body: bytes) -> np.ndarray:
    """The truth: the bundle's decode function run in this process on the same bytes."""
    return decode_image(io.BytesIO(body), SPEC, formats=["PNG"])


@pytest.fixture
def stall(tmp_path, monkeypatch) -> Path:
    """The stalling worker's folder; set before any pool of the test starts its workers."""
    folder = tmp_path / "stall"
    folder.mkdir()
    monkeypatch.setattr(image_decoder, "WORKER_MODULE", stalling_worker.__name__)
    monkeypatch.setenv(stalling_worker.DECODE_STALL_ENV, str(folder))
    return folder


def _tickets(folder: Path, n: int) -> None:
    for i in range(n):
        (folder / f"ticket-{i}").touch()


def _left(folder: Path) -> int:
    return len(list(folder.glob("ticket-*")))


def _kill_stalled(folder: Path) -> int:
    """SIGKILL the next worker that holds a body (its busy-<pid> file); its pid."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for busy in folder.glob("busy-*"):
            pid = int(busy.name.removeprefix("busy-"))
            os.kill(pid, signal.SIGKILL)
            busy.unlink()
            return pid
        time.sleep(0.01)
    raise AssertionError(f"no decode worker claimed a ticket in {WAIT_S:g} s")


async def _pool(workers: int = 1) -> DecodePool:
    pool = DecodePool(workers, 4, WAIT_S).start()
    while not pool.is_ready():
        await asyncio.sleep(0.01)
    pool.wait_ready(0)
    return pool


async def _until(check) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, "still waiting"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ the pool
def test_a_worker_killed_mid_decode_is_replaced_and_the_body_decoded_on_the_fresh_one(stall):
    _tickets(stall, 1)
    body = _png()

    async def go():
        pool = await _pool()
        try:
            (first,) = pool.pids()
            task = asyncio.create_task(pool.decode(body, b"image/png", SPEC, (64,)))
            killed = await asyncio.to_thread(_kill_stalled, stall)
            got = await task
            truth = _offline(body)
            assert got.shape == truth.shape == (64,)
            np.testing.assert_array_equal(got, truth)
            assert killed == first and not alive(first) and pool.crashes == 1
            assert pool.pids()[0] not in (None, first) and _left(stall) == 0
        finally:
            pool.stop()
    asyncio.run(go())


def test_a_body_whose_decode_dies_twice_is_503_decoder_crashed_with_retry_after(stall):
    _tickets(stall, 2)
    body = _png()

    async def go():
        pool = await _pool()
        try:
            task = asyncio.create_task(pool.decode(body, b"image/png", SPEC, (64,)))
            killed = [await asyncio.to_thread(_kill_stalled, stall) for _ in range(2)]
            with pytest.raises(SlcError) as err:
                await task
            assert (err.value.kind, err.value.code, err.value.retry_after) == (Kind.UNAVAILABLE, "decoder_crashed", 1)
            assert (http_status(err.value), http_headers(err.value)) == (503, {"Retry-After": "1"})
            assert len(set(killed)) == 2 and not any(map(alive, killed)) and pool.crashes == 2
            np.testing.assert_array_equal(await pool.decode(body, b"image/png", SPEC, (64,)), _offline(body))
            assert pool.pids()[0] not in (None, *killed)  # a third process answered
        finally:
            pool.stop()
    asyncio.run(go())


def test_an_image_that_fails_to_decode_on_its_own_is_still_422_and_its_worker_kept(stall):
    truncated = _png()[:-40]  # the end of IDAT and IEND cut off
    with pytest.raises(Exception):
        _offline(truncated)  # the truth: it does not decode here either

    async def go():
        pool = await _pool()
        try:
            (first,) = pool.pids()
            with pytest.raises(SlcError) as err:
                await pool.decode(truncated, b"image/png", SPEC, (64,))
            assert (http_status(err.value), err.value.code) == (422, "invalid_image")
            assert pool.crashes == 0 and pool.pids() == [first] and alive(first)  # the worker answered it
        finally:
            pool.stop()
    asyncio.run(go())


def test_a_request_cancelled_mid_decode_is_not_retried(stall):
    _tickets(stall, 2)

    async def go():
        pool = await _pool()
        try:
            (first,) = pool.pids()
            task = asyncio.create_task(pool.decode(_png(), b"image/png", SPEC, (64,)))
            await _until(lambda: _left(stall) == 1)  # the worker holds the body
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            worker = pool.workers[0]
            await _until(lambda: worker.current is None and pool.pids()[0] not in (None, first))
            assert _left(stall) == 1 and pool.crashes == 0 and not alive(first)  # killed, not decoded again
        finally:
            pool.stop()
    asyncio.run(go())


def test_a_decode_cut_by_shutdown_is_503_not_ready_and_not_retried(stall):
    _tickets(stall, 2)

    async def go():
        pool = await _pool()
        task = asyncio.create_task(pool.decode(_png(), b"image/png", SPEC, (64,)))
        await _until(lambda: _left(stall) == 1)
        await asyncio.to_thread(pool.stop)
        with pytest.raises(SlcError) as err:
            await task
        assert (http_status(err.value), err.value.code) == (503, "not_ready")
        assert _left(stall) == 1 and pool.crashes == 0
    asyncio.run(go())


# ------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def image_bundle(tmp_path_factory):
    from tests.serving.helpers import synthetic_image_bundle

    return synthetic_image_bundle(tmp_path_factory, "crash-img", SPEC)


@pytest.fixture
def client(image_bundle, tmp_path, stall):
    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, wait_ready

    settings = make_settings(image_bundle, tmp_path, decode_budget_s=WAIT_S, request_timeout_s=WAIT_S)
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        c.pool = image_decoder.current(settings)
        yield c


def _post_while_killing(client, folder: Path, kills: int):
    """POST the image while `kills` workers are killed holding it; the response and the killed pids."""
    with ThreadPoolExecutor(1) as ex:
        response = ex.submit(client.post, "/v1/classes/3/detect", content=_png(), headers={"content-type": "image/png"})
        killed = [_kill_stalled(folder) for _ in range(kills)]
        return response.result(timeout=WAIT_S), killed


def test_over_http_one_crash_answers_as_the_offline_tensor(client, stall):
    _tickets(stall, 1)
    r, killed = _post_while_killing(client, stall, 1)
    by_json = client.post("/v1/classes/3/detect", json={"inputs": [_offline(_png()).tolist()]})
    assert r.status_code == 200, r.text
    assert r.json() == by_json.json() and client.pool.crashes == 1 and not alive(killed[0])


def test_over_http_two_crashes_are_503_decoder_crashed_with_retry_after(client, stall):
    _tickets(stall, 2)
    r, killed = _post_while_killing(client, stall, 2)
    assert_envelope(r, 503, "decoder_crashed")
    assert r.headers["retry-after"] == "1" and client.pool.crashes == 2
    assert 'slc_rejections_total{reason="decoder_crashed"} 1.0' in client.get("/metrics").text
