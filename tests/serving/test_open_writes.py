"""No write open by accident (issue 30): with no SLC_API_KEY, a server on a host other machines can
reach refuses every gallery write with 403 and a message saying how to set a key; SLC_ALLOW_OPEN_WRITES
(--allow-open-writes) opens them on purpose; a key guards them as before; loopback stays open for a
first run. Reads and queries are never affected."""
from __future__ import annotations

import subprocess

import httpx
import pytest

from serving.settings import Settings, is_loopback
from tests.serving.helpers import INPUT_DIM, assert_envelope, free_port, serve_process, wait_http_ready

GOOD = [0.25] * INPUT_DIM
ITEM = {"items": [{"id": "a", "input": GOOD}]}


def _writes(c, headers=None) -> list:
    """The three write routes, in order: POST items, PUT one item, DELETE it."""
    return [c.post("/v1/gallery/items", json=ITEM, headers=headers),
            c.put("/v1/gallery/items/b", json={"input": GOOD}, headers=headers),
            c.delete("/v1/gallery/items/a", headers=headers)]


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True),
                                           ("::1", True), ("[::1]", True), ("0.0.0.0", False), ("::", False),
                                           ("192.168.1.5", False), ("10.0.0.1", False), ("slc.example.com", False)])
def test_only_loopback_hosts_count_as_private(host, loopback):
    assert is_loopback(host) is loopback
    assert Settings(host=host).open_writes_refused() is not loopback
    assert not Settings(host=host, allow_open_writes=True).open_writes_refused()
    assert not Settings(host=host, api_key="k").open_writes_refused()


def test_writes_without_a_key_on_a_reachable_host_are_403_saying_how_to_set_one(client_factory):
    c = client_factory(host="0.0.0.0")
    for r in _writes(c):
        message = assert_envelope(r, 403, "writes_need_api_key")["error"]["message"]
        assert "SLC_API_KEY" in message and "--allow-open-writes" in message and "0.0.0.0" in message
    assert c.get("/v1/gallery").json()["count"] == 0  # nothing was written
    assert c.get("/v1/gallery/items/a").status_code == 404  # reads and queries answer as ever
    assert c.post("/v1/classes/3/detect", json={"inputs": [GOOD]}).status_code == 200
    assert c.post("/v1/classes/3/search", json={}).status_code == 200


def test_open_writes_on_purpose(client_factory):
    c = client_factory(host="0.0.0.0", allow_open_writes=True)
    assert [r.status_code for r in _writes(c)] == [201, 201, 204]


def test_a_key_guards_writes_on_any_host(client_factory):
    c = client_factory(host="0.0.0.0", api_key="s3cret")
    assert [assert_envelope(r, 401, "unauthorized") and r.status_code for r in _writes(c)] == [401] * 3
    assert [r.status_code for r in _writes(c, {"Authorization": "Bearer s3cret"})] == [201, 201, 204]


def test_loopback_stays_open_for_a_first_run(client_factory):
    c = client_factory()  # host 127.0.0.1, no key: `make serve`
    assert [r.status_code for r in _writes(c)] == [201, 201, 204]


@pytest.mark.integration
def test_slc_serve_on_every_address_without_a_key_warns_and_refuses_writes(bundle_path, tmp_path):
    port = free_port()
    proc = serve_process(bundle_path, tmp_path, port, "--host", "0.0.0.0", SLC_LOG_LEVEL="warning")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc)
        r = httpx.post(f"{url}/v1/gallery/items", json=ITEM, timeout=30)
        assert_envelope(r, 403, "writes_need_api_key")
        assert httpx.post(f"{url}/v1/classes/3/detect", json={"inputs": [GOOD]}, timeout=30).status_code == 200
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert "warning: gallery writes are refused" in out and "SLC_API_KEY" in out
