"""Hostile bodies up to the size limit on a real server: each gets its error, and a health probe
sent while it is in flight is answered (the event loop is not held by per-value work)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tools.bench.hostile import KINDS, hostile_body
from tests.serving.helpers import INPUT_DIM, assert_envelope

pytestmark = pytest.mark.integration  # a real uvicorn

MB = 1 << 20


EXPECTED = {"strings": (422, "validation_error"), "objects": (422, "validation_error"),
            "flat_strings": (422, "too_many_inputs"), "nested": (422, "shape_mismatch"),
            "many_examples": (422, "shape_mismatch"), "one_huge_example": (422, "too_many_inputs"),
            "bools_in_numbers": (422, "validation_error"), "gallery_strings": (422, "validation_error")}


@pytest.fixture(scope="module")
def server(bundle_path, tmp_path_factory):
    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, uvicorn_in_thread

    with uvicorn_in_thread(create_app(make_settings(bundle_path, tmp_path_factory.mktemp("hostile")))) as url:
        yield url


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_body_is_refused_while_a_probe_is_answered(server, kind):
    path, body = hostile_body(kind, 7 * MB, INPUT_DIM)
    status, code = EXPECTED[kind]
    assert len(body) <= 8 * MB
    with ThreadPoolExecutor(2) as pool, httpx.Client(timeout=5.0) as probe:
        hostile = pool.submit(httpx.post, server + path, content=body,
                              headers={"Content-Type": "application/json"}, timeout=60)
        answered = [probe.get(server + "/v1/health/live").status_code]
        while not hostile.done():
            answered.append(probe.get(server + "/v1/health/live").status_code)  # a stalled loop -> ReadTimeout
        assert_envelope(hostile.result(), status, code)
    assert set(answered) == {200}
