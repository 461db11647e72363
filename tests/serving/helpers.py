"""Helpers of the server tests (plain functions and classes; the fixtures in conftest.py use them):
the tiny synthetic bundle's sizes, the offline reference math the answers are checked against
(an independent onnxruntime session + the head rows in float64), settings, readiness waits,
real server processes, and the error-envelope check."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
D, DIM, INPUT_DIM = 50, 16, 12


class Offline:
    """The truth the server is checked against: its own ORT session and the head in float64."""

    def __init__(self, bundle):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        self.backbone = ort.InferenceSession(str(bundle.graph_path("backbone")), opts, providers=["CPUExecutionProvider"])
        self.single = ort.InferenceSession(str(bundle.graph_path("single")), opts, providers=["CPUExecutionProvider"])
        self.W = np.asarray(bundle.weight, dtype=np.float64)  # [D, d]
        self.b = np.asarray(bundle.bias, dtype=np.float64)  # [D]
        self.bundle = bundle

    def embed(self, x) -> np.ndarray:
        return self.backbone.run(None, {"input": np.asarray(x, np.float32)})[0]  # [N, d] float32

    def logits(self, x) -> np.ndarray:
        """All D logits in float64 [N, D]."""
        return self.embed(x).astype(np.float64) @ self.W.T + self.b

    def single_logit(self, x, ids) -> np.ndarray:
        return self.single.run(None, {"input": np.asarray(x, np.float32), "class_id": np.asarray(ids, np.int64)})[0]



def make_settings(bundle_path, tmp_path, **overrides):
    from serving.settings import Settings

    base = dict(bundle=bundle_path, data_dir=tmp_path / "data", home=tmp_path / "home", intra_op_threads=1,
                log_level="warning")
    base.update(overrides)
    return Settings(**base)


def synthetic_image_bundle(tmp_path_factory, name: str, spec: dict) -> Path:
    """A 20-class synthetic bundle (d = 8) that takes 8x8 images of `spec`: the image tests' shared bundle."""
    from serving.bundle.synthetic import build_synthetic_bundle

    return build_synthetic_bundle(classes=20, dim=8, input_dim=64, seed=1,
                                  out=tmp_path_factory.mktemp(name) / "bundle", image=spec)


@contextmanager
def client_starter(bundle: Path, tmp_path: Path):
    """`start(**settings)`: a ready TestClient of `bundle`, its settings on `.settings`; all closed on exit."""
    from contextlib import ExitStack

    from fastapi.testclient import TestClient

    from serving.http.app import create_app

    with ExitStack() as stack:
        def start(**overrides):
            settings = make_settings(bundle, tmp_path, **overrides)
            client = stack.enter_context(TestClient(create_app(settings)))
            wait_ready(client.get)
            client.settings = settings
            return client
        yield start


def wait_ready(get, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = get("/v1/health/ready")
        if r.status_code == 200:
            return
        time.sleep(0.02)
    raise AssertionError(f"server not ready after {timeout} s: {r.status_code} {r.text}")


def alive(pid: int) -> bool:
    """Whether process `pid` still exists."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_envelope(response, status: int, code: Optional[str] = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] and body["error"]["code"] == body["error"]["code"].lower()
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body


def wait_http_ready(url: str, proc: Optional[subprocess.Popen] = None, timeout: float = 60.0) -> None:
    """Poll GET /v1/health/ready until 200; fail early when the server process exits."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"server exited early ({proc.returncode}):\n{out}")
        try:
            if httpx.get(url + "/v1/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    if proc is not None:
        proc.kill()
    raise AssertionError(f"{url} not ready after {timeout} s")


def server_env(tmp_path: Path, **env_extra: str) -> dict:
    """A server process's environment: this one's, its own SLC_HOME, and the repository first on a
    PYTHONPATH that keeps this one's entries (a machine whose packages come from PYTHONPATH: without
    them `slc serve` exited at once on the first GPU machine, docs/results/gpu-serving.md)."""
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return dict(os.environ, SLC_HOME=str(tmp_path / "home"), SLC_INTRA_OP_THREADS="1", PYTHONPATH=path, **env_extra)


def serve_process(bundle: Path, tmp_path: Path, port: int, *flags: str, **env_extra: str) -> subprocess.Popen:
    """`python -m slc serve BUNDLE` as a real process (its own SLC_HOME and data dir under tmp_path)."""
    env = server_env(tmp_path, **env_extra)
    cmd = [sys.executable, "-m", "slc", "serve", str(bundle), "--port", str(port),
           "--data-dir", str(tmp_path / "data"), *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextmanager
def uvicorn_in_thread(app) -> Iterator[str]:
    """A real uvicorn serving `app` in a thread of this process; yields its base URL once ready."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, timeout=30)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def _postgres_bin(name: str) -> Optional[str]:
    import glob
    import shutil

    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def postgres_missing() -> Optional[str]:
    """Why a throwaway PostgreSQL cannot be started here (None if it can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install '.[postgres]')"
    if _postgres_bin("initdb") is None or _postgres_bin("pg_ctl") is None:
        return "PostgreSQL is not installed (apt-get install postgresql)"
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run PostgreSQL as"
    return None


@contextmanager
def throwaway_postgres() -> Iterator[tuple[str, callable]]:
    """A PostgreSQL cluster of its own in a fresh temporary directory, on a free loopback port;
    yields (url, stop) and removes it at the end. As root it runs as the 'postgres' user."""
    import shutil
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="slc-pg-"))
    data, port = home / "data", free_port()
    as_user: list[str] = []
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(home, "postgres")
    run = dict(check=True, capture_output=True, text=True)
    pg_ctl = _postgres_bin("pg_ctl")

    def stop() -> None:
        subprocess.run(as_user + [pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True)

    def start() -> None:
        options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1"
        subprocess.run(as_user + [pg_ctl, "-D", str(data), "-o", options, "-l", str(home / "pg.log"), "-w", "start"],
                       **run)

    stop.start = start  # type: ignore[attr-defined]  # a test can bring the database back
    try:
        subprocess.run(as_user + [_postgres_bin("initdb"), "-D", str(data), "-A", "trust", "-U", "slc", "--no-sync"],
                       **run)
        start()
        yield f"postgresql://slc@127.0.0.1:{port}/postgres", stop
    finally:
        stop()
        shutil.rmtree(home, ignore_errors=True)


def slc(*args: str) -> int:
    """`slc ARGS` in this process; its exit code."""
    from slc.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def json_mutations(seed: int, bodies: list[bytes], count: int):
    """Bodies with one to three random edits (a byte replaced by a JSON-ish one, deleted, or doubled)."""
    rng = np.random.default_rng(seed)
    alphabet = b'[]{},:"0123456789.eE+- \ntruefalsnl\\'
    for _ in range(count):
        b = bytearray(bodies[rng.integers(len(bodies))])
        for _ in range(rng.integers(1, 4)):
            i, op = int(rng.integers(len(b))), rng.integers(3)
            if op == 0:
                b[i] = alphabet[rng.integers(len(alphabet))]
            elif op == 1:
                del b[i]
            else:
                b.insert(i, b[i])
        yield bytes(b)


def quantized_bundle(folder: Path, classes: int, dim: int, seed: int) -> Path:
    """A synthetic bundle of `classes` x `dim` carrying its int8 and bf16 heads too."""
    from serving.bundle.heads import add_heads
    from serving.bundle.synthetic import build_synthetic_bundle

    out = folder / "b"
    build_synthetic_bundle(classes=classes, dim=dim, input_dim=INPUT_DIM, seed=seed, out=out)
    add_heads(out, ("int8", "bf16"))
    return out
