"""Every acknowledged gallery write survives kill -9 of the writer (a child process), then a restart.

Two writers: a plain Python process using Gallery (fast, only this module), and the real server
(`python -m slc serve BUNDLE --data-dir D`) written to over HTTP, SIGKILLed while writes are
still in flight.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from serving.gallery import Gallery

pytestmark = pytest.mark.integration  # real processes, sockets or files

ROOT = Path(__file__).resolve().parents[2]
DIM = 8

WRITER = textwrap.dedent("""
    import sys, numpy as np
    from serving.gallery import Gallery, GalleryRecord
    g = Gallery(sys.argv[1], "digest-a", %d)
    i = 0
    while True:  # writes until killed; a line is printed only after upsert returned
        h = np.zeros(%d, np.float32); h[0] = i; h[1] = 1.0
        g.upsert([GalleryRecord(f"item-{i}", h, {"i": i}, [i]), GalleryRecord(f"other-{i}", -h, None, [])])
        print(i, flush=True)
        i += 1
""" % (DIM, DIM))


def test_acknowledged_upserts_survive_sigkill(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    acked = []
    try:
        for line in proc.stdout:
            acked.append(int(line))
            if len(acked) >= 150:
                break
        os.kill(proc.pid, signal.SIGKILL)  # the writer is in the middle of its next upserts
    finally:
        proc.kill()
        proc.wait()
    assert len(acked) == 150
    g = Gallery(tmp_path, "digest-a", DIM)
    try:
        for i in acked:
            assert g.get(f"item-{i}") == {"id": f"item-{i}", "metadata": {"i": i}, "input": [i]}
            assert g.get(f"other-{i}") is not None
        # the rebuilt index holds each acknowledged embedding: logit of e_0 is i
        w = np.zeros(DIM, np.float32)
        w[0] = 1.0
        found = {id_: logit for id_, logit, _ in g.search(w, 0.0, 0.0, None) if id_.startswith("item-")}
        assert all(found[f"item-{i}"] == float(i) for i in acked)
        assert g.count() % 2 == 0  # each upsert call committed both of its items or neither
    finally:
        g.close()


# ------------------------------------------------------------------------------- real server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, dict | None]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None


def _start_server(bundle: Path, data_dir: Path, port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "SLC_HOME": str(data_dir.parent / "home")}
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, "-m", "slc", "serve", str(bundle), "--host", "127.0.0.1",
                             "--port", str(port), "--data-dir", str(data_dir), "--device", "cpu"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_ready(proc: subprocess.Popen, base: str, log_path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if _request("GET", base + "/v1/health/ready", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"server not ready in {timeout}s:\n{log_path.read_text()[-3000:]}")


@pytest.mark.slow
def test_server_acknowledged_items_survive_sigkill(tmp_path):
    from serving.bundle.synthetic import build_synthetic_bundle

    bundle = build_synthetic_bundle(classes=20, dim=DIM, input_dim=4, seed=0, out=tmp_path / "bundle")
    data_dir, port, log_path = tmp_path / "data", _free_port(), tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    proc = _start_server(bundle, data_dir, port, log_path)
    acked: dict[str, list[float]] = {}
    lock, stop = threading.Lock(), threading.Event()

    def writer(worker: int) -> None:
        rng = np.random.default_rng(worker)
        for i in range(10_000):
            if stop.is_set():
                return
            item = {"id": f"w{worker}-{i}", "input": rng.standard_normal(4).round(3).tolist(), "metadata": {"i": i}}
            try:
                status, _ = _request("POST", base + "/v1/gallery/items", {"items": [item]})
            except OSError:  # the server died under this request: not acknowledged
                return
            if status == 201:
                with lock:
                    acked[item["id"]] = item["input"]

    try:
        _wait_ready(proc, base, log_path)
        threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(acked) < 120 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)  # writers are still sending
        proc.wait()
        stop.set()
        for t in threads:
            t.join()
        assert len(acked) >= 120, log_path.read_text()[-3000:]

        proc = _start_server(bundle, data_dir, port, log_path)
        _wait_ready(proc, base, log_path)
        for id_, inp in acked.items():
            status, body = _request("GET", f"{base}/v1/gallery/items/{id_}")
            assert status == 200, (id_, body)
            assert body["id"] == id_ and body["input"] == inp
        status, body = _request("GET", base + "/v1/gallery")
        assert status == 200 and body["count"] >= len(acked)
        # the index was rebuilt from SQLite: a search with a threshold below every logit lists them all
        status, body = _request("POST", base + "/v1/classes/0/search", {"threshold": -1e30, "limit": 100_000})
        assert status == 200, body
        listed = {hit["id"] for hit in body["results"]}
        assert set(acked) <= listed
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
