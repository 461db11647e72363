"""Property-based fuzzing of every operation in the OpenAPI schema: no answer is a 5xx, and every
non-2xx JSON answer is the error envelope."""
from __future__ import annotations


import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from serving.http.app import create_app  # noqa: E402
from serving.settings import Settings  # noqa: E402
from tests.serving.helpers import make_settings, uvicorn_in_thread  # noqa: E402

pytestmark = pytest.mark.integration  # real processes, sockets or files

# The schema does not depend on the bundle: an app that is never started gives it.
schema = schemathesis.openapi.from_dict(create_app(Settings(bundle="/nonexistent", home="/tmp/slc-unused")).openapi())


@pytest.fixture(scope="module")
def base_url(bundle_path, tmp_path_factory):
    with uvicorn_in_thread(create_app(make_settings(bundle_path, tmp_path_factory.mktemp("schemathesis")))) as url:
        yield url


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, base_url):
    response = case.call(base_url=base_url, timeout=30)
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
    content_type = response.headers.get("content-type") or [""]  # schemathesis: header -> list of values
    if response.status_code >= 400 and content_type[0].startswith("application/json"):
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
