"""Hostile gallery traffic (issue 30): metadata of millions of values refused before it is parsed,
metadata bounded per item after the parse, gallery work on its own bounded executor (a frozen
database slows only gallery routes: detect and image bodies still answer, the gallery answers 429
once its queue is full), reads answered as stored without a parse, and every id that can be
written can be read and deleted (control characters refused on write)."""
from __future__ import annotations

import io
import json
import random
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import numpy as np
import orjson
import pytest

from tests.serving.helpers import INPUT_DIM, assert_envelope

GOOD = [0.25] * INPUT_DIM


def _item(id_: str, metadata=None) -> dict:
    return {"id": id_, "input": GOOD, "metadata": metadata}


def _answers(url: str) -> None:
    """A health probe and a detect request complete with 200 (generous timeouts: no timing asserted)."""
    assert httpx.get(f"{url}/v1/health/live", timeout=60).status_code == 200
    r = httpx.post(f"{url}/v1/classes/3/detect", json={"inputs": [GOOD]}, timeout=60)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ metadata bounded
def test_metadata_of_millions_of_values_is_refused_before_it_is_parsed(client, monkeypatch):
    """An 8 MiB array of 4.19 M zeros: refused on the raw bytes' count, the parser never called."""
    from serving.codecs.strict_json import orjson as parser

    body = orjson.dumps({"items": [_item("z", {"z": [0] * 4_190_000})]})
    assert len(body) < 8 * 1024 * 1024
    calls = []
    real = parser.loads
    monkeypatch.setattr(parser, "loads", lambda b: (calls.append(len(b)), real(b))[1])
    r = client.post("/v1/gallery/items", content=body, headers={"content-type": "application/json"})
    message = assert_envelope(r, 422, "too_many_inputs")["error"]["message"]
    assert "SLC_MAX_METADATA_VALUES" in message and not any(n == len(body) for n in calls)


def test_metadata_past_its_value_count_is_refused_when_the_raw_count_cannot_tell(client_factory):
    """max_metadata_values=100: 1000 metadata values pass the raw count (room for 256 items' inputs),
    and are refused per item after the parse."""
    c = client_factory(max_metadata_values=100)
    body = orjson.dumps({"items": [_item("m", {"v": list(range(1000))}), _item("pad", {"s": "x" * 70_000})]})
    r = c.post("/v1/gallery/items", content=body, headers={"content-type": "application/json"})
    assert "more than 100 values" in assert_envelope(r, 422, "metadata_too_large")["error"]["message"]
    assert c.get("/v1/gallery").json()["count"] == 0


def test_metadata_past_its_byte_limit_is_refused(client_factory):
    c = client_factory(max_metadata_bytes=1000)
    assert c.post("/v1/gallery/items", json={"items": [_item("ok", {"s": "x" * 900})]}).status_code == 201
    r = c.post("/v1/gallery/items", json={"items": [_item("big", {"s": "x" * 1000})]})
    assert "SLC_MAX_METADATA_BYTES" in assert_envelope(r, 422, "metadata_too_large")["error"]["message"]
    r = c.put("/v1/gallery/items/big", json={"input": GOOD, "metadata": {"s": "x" * 1000}})
    assert_envelope(r, 422, "metadata_too_large")


@pytest.mark.integration
def test_metadata_attacks_leave_health_and_detect_answering(live_server):
    """Four 8 MiB metadata writes at once, then eight reads of the largest item allowed: health and
    detect answer while they run, and every write and read gets its answer."""
    url = live_server()
    hostile = orjson.dumps({"items": [_item("z", {"z": [0] * 4_190_000})]})
    big = {"v": [0.5] * 100_000}  # within every limit: ~0.5 MB of metadata
    assert httpx.post(f"{url}/v1/gallery/items", json={"items": [_item("big", big)]}, timeout=60).status_code == 201
    with ThreadPoolExecutor(12) as pool:
        writes = [pool.submit(httpx.post, f"{url}/v1/gallery/items", content=hostile, timeout=120,
                              headers={"content-type": "application/json"}) for _ in range(4)]
        reads = [pool.submit(httpx.get, f"{url}/v1/gallery/items/big", timeout=120) for _ in range(8)]
        _answers(url)
        assert [w.result().status_code for w in writes] == [422] * 4
        assert all(r.result().status_code == 200 and r.result().json()["metadata"] == big for r in reads)
    _answers(url)


# ------------------------------------------------------------------ reads answered as stored
METADATA = [{"a": 1, "b": [1.5, -2, None, True, "é \u2603 \"q\" \\ /"], "n": 2**53 - 1, "f": 0.1, "e": 1e20,
             "deep": {"x": {"y": [[], {}]}}}, None, {}]


@pytest.mark.parametrize("metadata", METADATA)
def test_reads_answer_the_metadata_and_input_as_written(client, metadata):
    assert client.post("/v1/gallery/items", json={"items": [_item("r", metadata)]}).status_code == 201
    got = client.get("/v1/gallery/items/r")
    assert got.headers["content-type"] == "application/json"
    assert got.json() == {"id": "r", "metadata": metadata, "input": GOOD}
    found = client.post("/v1/classes/3/search", json={"threshold": -1e30}).json()
    assert found["results"] == [{"id": "r", "logit": found["results"][0]["logit"], "metadata": metadata}]


def test_rows_written_by_earlier_versions_are_read_as_before(client):
    """Rows stored with json.dumps (spaces, ASCII escapes) are answered as the same JSON."""
    assert client.post("/v1/gallery/items", json={"items": [_item("old")]}).status_code == 201
    db = sqlite3.connect(client.app.state.slc.settings.data_dir / "gallery.sqlite3")
    meta = {"k": ["é", 1, {"z": None}]}
    db.execute("UPDATE items SET metadata = ?, input = ? WHERE id = 'old'", (json.dumps(meta), json.dumps(GOOD)))
    db.commit()
    db.close()
    assert client.get("/v1/gallery/items/old").json() == {"id": "old", "metadata": meta, "input": GOOD}


# ------------------------------------------------------------------ ids
ALPHABET = list("abcXYZ019 -_.~!$&'()*+,;=:@/%?#[]{}<>\"\\|^`") + ["é", "ß", "中", "\u2603", "😀", "\u200b", "\ufeff"]


def _random_ids(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    ids = ["/", "..", ".", "a/../b", "%2F", "a%20b", "?x=1", "#frag", " lead", "trail ", "a//b", "x" * 256]
    ids += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 20))) for _ in range(n)]
    return ids


def _path(item_id: str) -> str:
    """The item's URL path, every byte but letters and digits percent-encoded (dots too: clients
    resolve the path segments "." and ".." before sending)."""
    return "/v1/gallery/items/" + quote(item_id, safe="").replace(".", "%2E")


@pytest.mark.integration
def test_every_id_that_can_be_written_can_be_read_and_deleted(live_server):
    """Over real HTTP (Starlette's TestClient decodes a path twice: %252F would reach the app as /)."""
    client = httpx.Client(base_url=live_server(), timeout=30)
    for k, item_id in enumerate(_random_ids(150)):
        path = _path(item_id)
        if k % 2:
            assert client.post("/v1/gallery/items", json={"items": [_item(item_id, {"k": k})]}).status_code == 201
        else:
            assert client.put(path, json={"input": GOOD, "metadata": {"k": k}}).status_code == 201, item_id
        got = client.get(path)
        assert got.status_code == 200 and got.json()["id"] == item_id and got.json()["metadata"] == {"k": k}, item_id
        assert client.delete(path).status_code == 204, item_id
        assert client.get(path).status_code == 404, item_id


@pytest.mark.parametrize("char", ["\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85", "\x9f"])
def test_ids_with_control_characters_are_refused_on_write(client, char):
    item_id = f"a{char}b"
    r = client.post("/v1/gallery/items", json={"items": [_item(item_id)]})
    assert "control characters" in assert_envelope(r, 422, "validation_error")["error"]["message"]
    r = client.put(_path(item_id), json={"input": GOOD})  # (a newline ends the route's path pattern: 404)
    assert_envelope(r, 404 if char == "\n" else 422, "not_found" if char == "\n" else "validation_error")
    assert client.get("/v1/gallery").json()["count"] == 0


# ------------------------------------------------------------------ a frozen gallery
IMAGE = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 16.0 / 255.0, "background": "dark",
         "resample": "lanczos"}


class FrozenGallery:
    """A stand-in gallery whose every call blocks until released, as calls to a frozen PostgreSQL do."""

    index_kind = "frozen"

    def __init__(self, real):
        self.real, self.release, self.entered = real, threading.Event(), []

    def __getattr__(self, name):
        method = getattr(self.real, name)

        def blocked(*args, **kwargs):
            self.entered.append(name)
            self.release.wait(120)
            return method(*args, **kwargs)

        return blocked


@pytest.fixture(scope="module")
def image_bundle(tmp_path_factory):
    from tests.serving.helpers import synthetic_image_bundle

    return synthetic_image_bundle(tmp_path_factory, "img", IMAGE)


def _png() -> bytes:
    from PIL import Image

    a = np.zeros((8, 8), np.uint8)
    a[1:7, 3:5] = 255
    buf = io.BytesIO()
    Image.fromarray(a, "L").save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.integration
def test_a_frozen_gallery_slows_only_gallery_routes(image_bundle, tmp_path):
    """Eight gallery calls stuck in the database (more than the default thread pool's six threads,
    which image decoding used to share with them): detect, image detect and health answer; gallery
    calls past the queue get 429 with Retry-After; once the database answers, so do they."""
    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, uvicorn_in_thread

    app = create_app(make_settings(image_bundle, tmp_path, gallery_threads=2, gallery_queue_size=4))
    with uvicorn_in_thread(app) as url:
        engine = app.state.slc.engine
        frozen = FrozenGallery(engine.gallery)
        engine.gallery = frozen
        with ThreadPoolExecutor(8) as pool:
            stuck = [pool.submit(httpx.get, f"{url}/v1/gallery", timeout=120) for _ in range(4)]
            deadline = time.monotonic() + 60
            while engine.gallery_pool.pending < 4 and time.monotonic() < deadline:  # the queue is full
                time.sleep(0.05)
            stuck += [pool.submit(httpx.post, f"{url}/v1/classes/3/search", json={}, timeout=120) for _ in range(4)]
            try:
                busy = [f.result() for f in stuck[4:]]  # past the queue of 4: answered at once
                for r in busy:
                    assert_envelope(r, 429, "gallery_busy")
                    assert r.headers["retry-after"] == "1"
                assert httpx.get(f"{url}/v1/health/live", timeout=60).status_code == 200
                r = httpx.post(f"{url}/v1/classes/3/detect", json={"inputs": [[0.5] * 64]}, timeout=60)
                assert r.status_code == 200, r.text
                r = httpx.post(f"{url}/v1/classes/3/detect", content=_png(), headers={"content-type": "image/png"},
                               timeout=60)
                assert r.status_code == 200, r.text
                assert not any(f.done() for f in stuck[:4])  # the stuck ones are still waiting for the database
            finally:
                frozen.release.set()
            assert all(f.result().status_code == 200 for f in stuck[:4])
        engine.gallery = frozen.real
