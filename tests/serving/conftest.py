"""Fixtures of the server tests: a tiny synthetic bundle (D=50, d=16, 12 inputs), apps driven
in-process with their lifespan, a real uvicorn on a free port, and the offline reference math
(an independent onnxruntime session + the head rows in float64) the answers are checked against."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

D, DIM, INPUT_DIM = 50, 16, 12


@pytest.fixture(scope="session")
def bundle_path(tmp_path_factory) -> Path:
    from serving.bundle.synthetic import build_synthetic_bundle

    out = tmp_path_factory.mktemp("bundle") / "synthetic"
    build_synthetic_bundle(classes=D, dim=DIM, input_dim=INPUT_DIM, seed=0, out=out)
    return out


@pytest.fixture(scope="session")
def bundle(bundle_path):
    from serving.bundle import load_bundle

    return load_bundle(bundle_path)


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


@pytest.fixture(scope="session")
def offline(bundle) -> Offline:
    return Offline(bundle)


@pytest.fixture
def inputs():
    return np.random.default_rng(1).standard_normal((5, INPUT_DIM)).astype(np.float32)


def make_settings(bundle_path, tmp_path, **overrides):
    from serving.settings import Settings

    base = dict(bundle=bundle_path, data_dir=tmp_path / "data", home=tmp_path / "home", intra_op_threads=1,
                log_level="warning")
    base.update(overrides)
    return Settings(**base)


def wait_ready(get, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = get("/v1/health/ready")
        if r.status_code == 200:
            return
        time.sleep(0.02)
    raise AssertionError(f"server not ready after {timeout} s: {r.status_code} {r.text}")


@pytest.fixture
def app_factory(bundle_path, tmp_path):
    def factory(**overrides):
        from serving.app import create_app

        return create_app(make_settings(bundle_path, tmp_path, **overrides))

    return factory


@pytest.fixture
def client_factory(app_factory):
    """TestClient(app) with the lifespan running, waited until ready."""
    from fastapi.testclient import TestClient

    opened = []

    def factory(wait: bool = True, **overrides):
        client = TestClient(app_factory(**overrides), raise_server_exceptions=False)
        client.__enter__()
        opened.append(client)
        if wait:
            wait_ready(client.get)
        return client

    yield factory
    for c in opened:
        c.__exit__(None, None, None)


@pytest.fixture
def client(client_factory):
    return client_factory()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server(app_factory):
    """A real uvicorn (asyncio loop, h11/httptools) in a thread; yields its base URL."""
    import httpx
    import uvicorn

    servers = []

    def start(**overrides) -> str:
        port = free_port()
        app = app_factory(**overrides)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v1/health/ready", timeout=1).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError("live server did not become ready")

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=15)


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
