"""Fixtures of the server tests: a tiny synthetic bundle (D=50, d=16, 12 inputs), apps driven
in-process with their lifespan, a real uvicorn on a free port, and the offline reference math
(an independent onnxruntime session + the head rows in float64) the answers are checked against."""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from tests.serving.helpers import D, DIM, INPUT_DIM, Offline, make_settings, uvicorn_in_thread, wait_ready


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


@pytest.fixture(scope="session")
def offline(bundle) -> Offline:
    return Offline(bundle)


@pytest.fixture
def inputs():
    return np.random.default_rng(1).standard_normal((5, INPUT_DIM)).astype(np.float32)


@pytest.fixture
def app_factory(bundle_path, tmp_path):
    def factory(**overrides):
        """The HTTP app over the core with its fronts (the gRPC one when grpc_port is given), as `slc serve` builds it."""
        from serving.main import build

        return build(make_settings(bundle_path, tmp_path, **overrides))[0]

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


@pytest.fixture
def live_server(app_factory):
    """A real uvicorn (asyncio loop, h11/httptools) in a thread; `start(**overrides)` gives its base URL."""
    with ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(uvicorn_in_thread(app_factory(**overrides)))


def pytest_collection_modifyitems(items):
    """A test on a real uvicorn (the live_server fixture) is an integration test."""
    for item in items:
        if "live_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def serve(image_bundle, tmp_path):
    """`serve(**settings)`: a ready TestClient of the module's `image_bundle`, its settings on `.settings`."""
    from tests.serving.helpers import client_starter

    with client_starter(image_bundle, tmp_path) as start:
        yield start
