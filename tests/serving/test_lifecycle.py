"""`slc serve` as a real process: SIGTERM drains in-flight requests and exits 0; a bundle whose
hashes do not match is never served and the process exits non-zero."""
from __future__ import annotations

import pytest

import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from tests.serving.helpers import assert_envelope, free_port, serve_process, wait_http_ready

pytestmark = pytest.mark.integration  # real processes, sockets or files

ROOT = Path(__file__).resolve().parents[2]


def _wait_queued(url: str, inputs: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=5).text
        if f"slc_queue_depth_inputs {float(inputs)}" in text:
            return
        time.sleep(0.02)
    raise AssertionError("requests never all reached the queue")


def test_sigterm_drains_in_flight_requests_and_exits_zero(bundle_path, tmp_path, offline):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A long batching delay keeps requests queued when the signal arrives.
    proc = serve_process(bundle_path, tmp_path, port, "--max-delay-ms", "3000", SLC_ADAPTIVE_DELAY="false")
    try:
        wait_http_ready(url, proc)
        x = np.random.default_rng(3).standard_normal((2, 12)).astype(np.float32)

        def call(j):
            return httpx.post(f"{url}/v1/classes/{j}/detect", json={"inputs": x.tolist()}, timeout=30)

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(call, j) for j in range(6)]
            _wait_queued(url, inputs=12)  # all 6 requests wait in the server's queue for the batch delay
            assert not any(f.done() for f in futures)
            proc.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert code == 0, log
    for j, r in enumerate(answers):
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([v["logit"] for v in r.json()["results"]], offline.logits(x)[:, j],
                                   rtol=1e-5, atol=1e-4)
    assert "draining" in log


def test_tampered_bundle_exits_non_zero(bundle_path, tmp_path):
    bad = tmp_path / "tampered"
    shutil.copytree(bundle_path, bad)
    raw = bytearray((bad / "head_weight.npy").read_bytes())
    raw[-3] ^= 0x10
    (bad / "head_weight.npy").write_bytes(bytes(raw))
    proc = serve_process(bad, tmp_path, free_port())
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert code != 0, log
    assert "head_weight.npy" in log and "sha256" in log


def test_draining_turns_readiness_503_while_queries_still_work(client):
    client.app.state.slc.start_draining()
    assert_envelope(client.get("/v1/health/ready"), 503, "not_ready")
    assert_envelope(client.get("/v2/health/ready"), 503, "not_ready")
    assert client.get("/v1/health/live").status_code == 200
    assert client.post("/v1/classes/1/detect", json={"inputs": [[0.0] * 12]}).status_code == 200
