"""Hostile bodies up to the size limit on a real server: each gets its error, and a health probe
sent while it is in flight is answered (the event loop is not held by per-value work)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from tests.serving.helpers import INPUT_DIM, assert_envelope

pytestmark = pytest.mark.integration  # a real uvicorn

MB = 1 << 20


def _hostile(kind: str, size: int) -> tuple[str, bytes, int, str]:
    """(path, body of about `size` bytes, status, code)."""
    n = size // 6
    if kind == "strings":  # right shape, every value a long string
        long = "x" * (size // (200 * INPUT_DIM))
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [[long] * INPUT_DIM] * 200}), 422, "validation_error"
    if kind == "objects":  # right shape, every value a wide object
        obj = {f"k{i}": i for i in range(size // (200 * INPUT_DIM * 12))}
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [[obj] * INPUT_DIM] * 200}), 422, "validation_error"
    if kind == "flat_strings":  # one example of a million strings
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [["abcd"] * (size // 7)]}), 422, "shape_mismatch"
    if kind == "nested":
        return "/v1/topk", orjson.dumps({"inputs": [[[[0]]] * (n // 2)]}), 422, "shape_mismatch"
    if kind == "many_examples":
        return "/v1/classes/3/softmax", orjson.dumps({"inputs": [[0] * INPUT_DIM] * (size // (3 * INPUT_DIM))}), \
            422, "too_many_inputs"
    if kind == "one_huge_example":
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [[0.5] * (size // 4)]}), 422, "shape_mismatch"
    if kind == "bools_in_numbers":
        row = [0.5] * (INPUT_DIM - 1) + [True]
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [row] * 256}), 422, "validation_error"
    if kind == "gallery_strings":
        return "/v1/gallery/items", orjson.dumps({"items": [{"id": "a", "input": ["x"] * n}]}), 422, "shape_mismatch"
    raise KeyError(kind)


KINDS = ["strings", "objects", "flat_strings", "nested", "many_examples", "one_huge_example", "bools_in_numbers", "gallery_strings"]


@pytest.fixture(scope="module")
def server(bundle_path, tmp_path_factory):
    import threading

    import uvicorn

    from serving.app import create_app
    from tests.serving.helpers import free_port, make_settings, wait_http_ready

    app = create_app(make_settings(bundle_path, tmp_path_factory.mktemp("hostile"), intra_op_threads=1))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(url, timeout=30)
    yield url
    srv.should_exit = True
    thread.join(15)


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_body_is_refused_while_a_probe_is_answered(server, kind):
    path, body, status, code = _hostile(kind, 7 * MB)
    assert len(body) <= 8 * MB
    with ThreadPoolExecutor(2) as pool, httpx.Client(timeout=5.0) as probe:
        hostile = pool.submit(httpx.post, server + path, content=body,
                              headers={"Content-Type": "application/json"}, timeout=60)
        answered = [probe.get(server + "/v1/health/live").status_code]
        while not hostile.done():
            answered.append(probe.get(server + "/v1/health/live").status_code)  # a stalled loop -> ReadTimeout
        assert_envelope(hostile.result(), status, code)
    assert set(answered) == {200}
