"""Enrolling from image files (issue 50, part 3): several images in one multipart/form-data request,
decoded as image bodies are; examples added to an enrolled class; the refusals naming the part; and
`slc enroll` against a real `slc serve`. Rows are checked against the offline math (tests/serving/
helpers.py Offline: an independent onnxruntime session) and the documented imprinting rule."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from serving.codecs.images import preprocess
from tests.serving.helpers import Offline, assert_envelope, free_port, make_settings, wait_ready

IMAGE = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 16.0 / 255.0, "background": "dark",
         "resample": "lanczos"}


def _png(seed: int) -> bytes:
    a = np.zeros((8, 8), np.uint8)
    rng = np.random.default_rng(seed)
    a[rng.integers(0, 4):rng.integers(5, 8), rng.integers(0, 4):rng.integers(5, 8)] = 255
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def _tensor(png: bytes) -> np.ndarray:
    return preprocess(Image.open(io.BytesIO(png)), IMAGE)


def _files(*pngs: bytes, name: str = "image") -> list:
    return [(name, (f"{i}.png", p, "image/png")) for i, p in enumerate(pngs)]


def imprint(offline: Offline, x: np.ndarray) -> tuple[np.ndarray, float]:
    """docs/api.md "Enroll a class", imprint: the normalised mean of the normalised embeddings at the
    trained rows' median norm; the median trained bias."""
    h = offline.embed(x).astype(np.float64)
    m = (h / np.linalg.norm(h, axis=1, keepdims=True)).mean(axis=0)
    return np.median(np.linalg.norm(offline.W, axis=1)) * m / np.linalg.norm(m), float(np.median(offline.b))


@pytest.fixture(scope="module")
def image_bundle(tmp_path_factory):
    from tests.serving.helpers import synthetic_image_bundle

    return synthetic_image_bundle(tmp_path_factory, "forms", IMAGE)


@pytest.fixture(scope="module")
def offline(image_bundle):
    from serving.bundle import load_bundle

    return Offline(load_bundle(image_bundle))


@pytest.fixture
def make_client(image_bundle, tmp_path):
    from fastapi.testclient import TestClient

    from serving.http.app import create_app

    opened = []

    def factory(**overrides):
        client = TestClient(create_app(make_settings(image_bundle, tmp_path, **overrides)), raise_server_exceptions=False)
        client.__enter__()
        opened.append(client)
        wait_ready(client.get)
        return client

    yield factory
    for c in opened:
        c.__exit__(None, None, None)


def _logits(client, name: str, x: np.ndarray) -> np.ndarray:
    r = client.post(f"/v1/classes/{name}/detect", json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    return np.array([e["logit"] for e in r.json()["results"]])


def test_several_files_give_the_row_of_their_decoded_images(make_client, offline):
    client = make_client()
    pngs = [_png(s) for s in range(3)]
    r = client.put("/v1/classes/M", files=_files(*pngs))
    assert r.status_code == 201, r.text
    assert r.json()["examples"] == 3 and r.json()["class_name"] == "M"
    x = np.stack([_tensor(p) for p in pngs])
    by_json = client.put("/v1/classes/J", json={"inputs": x.tolist()}).json()
    row, bias = imprint(offline, x)
    assert r.json()["norm"] == pytest.approx(np.linalg.norm(row), rel=1e-5)
    assert r.json()["bias"] == pytest.approx(by_json["bias"])
    probe = np.stack([_tensor(_png(s)) for s in range(10, 15)])
    want = offline.embed(probe).astype(np.float64) @ row + bias
    np.testing.assert_allclose(_logits(client, "M", probe), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_logits(client, "M", probe), _logits(client, "J", probe), rtol=1e-6, atol=1e-6)


def test_adding_examples_equals_enrolling_all_at_once(make_client):
    client = make_client()
    pngs = [_png(s) for s in range(20, 25)]
    assert client.put("/v1/classes/all", files=_files(*pngs)).status_code == 201
    assert client.put("/v1/classes/grown", files=_files(*pngs[:2])).json()["examples"] == 2
    one = client.post("/v1/classes/grown/examples", content=pngs[2], headers={"content-type": "image/png"})
    assert one.status_code == 200 and one.json()["examples"] == 3, one.text
    x = np.stack([_tensor(p) for p in pngs[3:]])
    two = client.post("/v1/classes/grown/examples", json={"inputs": x.tolist()})
    assert two.status_code == 200 and two.json()["examples"] == 5
    everything = client.get("/v1/classes").json()["classes"]
    a, g = (next(c for c in everything if c["class_name"] == n) for n in ("all", "grown"))
    assert g["class_id"] == one.json()["class_id"] and g["examples"] == a["examples"] == 5
    assert g["norm"] == pytest.approx(a["norm"], rel=1e-6) and g["bias"] == pytest.approx(a["bias"])
    probe = np.stack([_tensor(_png(s)) for s in range(30, 34)])
    np.testing.assert_allclose(_logits(client, "grown", probe), _logits(client, "all", probe), rtol=1e-6, atol=1e-6)
    replaced = client.put("/v1/classes/grown", files=_files(pngs[0]))  # a PUT replaces the examples too
    assert replaced.status_code == 200 and replaced.json()["examples"] == 1
    assert client.post("/v1/classes/grown/examples", files=_files(pngs[1])).json()["examples"] == 2


def test_adding_refusals(make_client, tmp_path):
    import sqlite3

    from serving.gallery.sqlite import DB_NAME

    client = make_client()
    png = _png(1)
    assert_envelope(client.post("/v1/classes/nobody/examples", files=_files(png)), 404, "unknown_class")
    assert_envelope(client.post("/v1/classes/3/examples", files=_files(png)), 409, "class_exists")
    assert client.put("/v1/classes/old", files=_files(png)).status_code == 201
    with sqlite3.connect(tmp_path / "data" / DB_NAME) as db:  # as an slc before issue 50 stored it: no examples
        db.execute("DELETE FROM enrolled_examples")
    body = assert_envelope(client.post("/v1/classes/old/examples", files=_files(png)), 409, "examples_not_kept")
    assert "enroll it again with all its examples (PUT)" in body["error"]["message"]
    small = make_client(max_class_examples=2)
    assert small.put("/v1/classes/k", files=_files(png, png)).status_code == 201
    body = assert_envelope(small.post("/v1/classes/k/examples", files=_files(png)), 422, "too_many_examples")
    assert "SLC_MAX_CLASS_EXAMPLES" in body["error"]["message"]


def test_a_part_that_is_no_image_is_named(make_client):
    client = make_client()
    files = _files(_png(1)) + [("image", ("notes.txt", b"hello, not an image", "text/plain"))]
    body = assert_envelope(client.put("/v1/classes/M", files=files), 415, "unsupported_media_type")
    assert body["error"]["message"].startswith("part 2 (image=notes.txt) is not an image"), body
    assert "text" in body["error"]["message"]
    files = _files(_png(1), b"\x89PNG\r\n\x1a\n broken")
    body = assert_envelope(client.put("/v1/classes/M", files=files), 422, "invalid_image")
    assert body["error"]["message"].startswith("part 2 (image=1.png): the PNG image is damaged"), body
    assert "0x" not in body["error"]["message"]
    assert client.get("/v1/classes").json()["count"] == 0  # nothing was written


def test_too_many_parts_and_empty_parts(make_client):
    client = make_client(max_inputs=2)
    body = assert_envelope(client.put("/v1/classes/M", files=_files(_png(1), _png(2), _png(3))), 422, "too_many_inputs")
    assert "more than 2 parts" in body["error"]["message"]
    body = assert_envelope(client.put("/v1/classes/M", files=_files(_png(1), b"")), 422, "empty_part")
    assert body["error"]["message"] == "part 2 (image=1.png) is empty: no bytes to decode"
    cut = assert_envelope(client.put("/v1/classes/M", content=b"--xyz\r\nContent-Disposition: form-data; name=a\r\n",
                                     headers={"content-type": "multipart/form-data; boundary=xyz"}), 400)
    assert cut["error"]["code"] == "malformed_multipart"


def test_a_json_bundle_refuses_files(client):
    r = client.put("/v1/classes/M", files=_files(_png(1)))
    assert "not an image" in assert_envelope(r, 415)["error"]["message"]


@pytest.mark.integration
def test_slc_enroll_against_a_running_server(image_bundle, tmp_path, capsys):
    import json

    import httpx

    from serving.bundle.recalibration import write_recalibrated
    from tests.serving.helpers import serve_process, slc, wait_http_ready

    cal = json.loads((image_bundle / "calibration.json").read_text())
    cal["per_class"][3]["threshold"] = -1e6  # a class that says yes to every image: a look-alike of anything
    bundle = write_recalibrated(image_bundle, cal, tmp_path / "lookalike", {"data": "test"})
    port = free_port()
    proc = serve_process(bundle, tmp_path, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc)
        paths = []
        for s in range(3):
            paths.append(tmp_path / f"{s}.png")
            paths[-1].write_bytes(_png(s))
        assert slc("enroll", url, "cat", *paths[:2]) == 0
        out = capsys.readouterr()
        assert out.out.strip().startswith("class cat: id 20, 2 examples (created)")
        # a warning line per other class that says yes to the images, as the server's own top-k judges them
        x = np.stack([_tensor(p.read_bytes()) for p in paths[:2]])
        top = httpx.post(url + "/v1/topk", json={"inputs": x.tolist(), "k": 16, "matches_only": True}).json()
        others = {e["class_name"] for row in top["results"] for e in row if e["class_name"] != "cat"}
        assert str(json.loads((bundle / "manifest.json").read_text())["classes"][3]) in others
        warned = [line for line in out.err.splitlines() if line.startswith("warning: class ")]
        assert sorted(line.split()[2] for line in warned) == sorted(others)
        stored = httpx.get(url + "/v1/classes").json()["classes"][0]["lookalikes"]
        names = json.loads((bundle / "manifest.json").read_text())["classes"]
        shown = [f"{names[i]} (id {i})" for i in stored[:10]]  # every look-alike by name, not only those that said yes
        plural = "es" if len(stored) > 1 else ""
        assert 3 in stored and f"look-alikes stored with cat: {len(stored)} class{plural} " \
            f"({', '.join(shown)}" in out.out
        assert slc("enroll", f"127.0.0.1:{port}", "cat", paths[2], "--add") == 0
        assert capsys.readouterr().out.strip().startswith("class cat: id 20, 3 examples (added 1)")
        assert httpx.get(url + "/v1/classes").json()["classes"][0]["examples"] == 3
        bad = tmp_path / "bad.png"
        bad.write_bytes(b"not a png at all")
        assert slc("enroll", url, "dog", paths[0], bad) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: 422 invalid_image: part 2 (image=bad.png) is not an image slc reads: it holds "
                              "text (Content-Type image/png)"), err
        assert len(err.splitlines()) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert slc("enroll", url, "cat", paths[0]) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot reach {url}/v1/classes/cat")


@pytest.mark.parametrize("rule", ["standardised", "fitted"])
def test_adding_is_exact_under_the_rules_that_need_every_example(tmp_path, rule):
    """The rules that need every example (centred directions and each example's logit for the
    threshold; the fitted regression and its cross-fitted threshold) give the same class whether its
    examples came in one PUT or a PUT and two adds (the first class deleted before the second is made:
    a served look-alike changes the threshold, which is chosen for the decision made with it)."""
    from fastapi.testclient import TestClient

    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.http.app import create_app

    path = build_synthetic_bundle(classes=30, dim=16, input_dim=12, seed=0, out=tmp_path / "neg", negatives=300)
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((1, 12)) + 0.05 * rng.standard_normal((6, 12))).astype(np.float32)
    with TestClient(create_app(make_settings(path, tmp_path, enroll_threshold="negatives", enroll_rule=rule))) as client:
        wait_ready(client.get)
        once = client.put("/v1/classes/once", json={"inputs": x.tolist()}).json()
        z_once = _logits(client, "once", probe := rng.standard_normal((5, 12)).astype(np.float32))
        assert client.delete("/v1/classes/once").status_code == 204
        client.put("/v1/classes/grown", json={"inputs": x[:2].tolist()})
        client.post("/v1/classes/grown/examples", json={"inputs": x[2:4].tolist()})
        grown = client.post("/v1/classes/grown/examples", json={"inputs": x[4:].tolist()}).json()
        z_grown = _logits(client, "grown", probe)
    assert once["rule"] == grown["rule"] and once["rule"].startswith(f"{rule}+")
    assert grown["examples"] == once["examples"] == 6 and grown["lookalikes"] == once["lookalikes"]
    for key in ("threshold", "bias", "norm"):
        assert grown[key] == pytest.approx(once[key], rel=1e-6, abs=1e-6), key
    np.testing.assert_allclose(z_grown, z_once, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)])
def test_the_store_keeps_the_examples_with_the_class_and_refuses_a_stale_add(kind, tmp_path):
    """What adding relies on, in both stores: the embeddings written in the class's transaction, read
    back exactly, replaced by a PUT, dropped by a delete; a write expecting an older seq is refused."""
    from contextlib import ExitStack

    from serving.gallery.enrolled import Changed, open_enrolled_store
    from tests.serving.helpers import postgres_missing, throwaway_postgres

    with ExitStack() as stack:
        url = None
        if kind == "postgres":
            if (why := postgres_missing()) is not None:
                pytest.skip(why)
            url, _ = stack.enter_context(throwaway_postgres())
        store = open_enrolled_store(url, tmp_path / "data", "key")
        stack.callback(store.close)
        h = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
        row = np.ones(4, np.float32)
        store.put("c", row, 0.0, 1.0, 1.0, 0.0, 3, "imprint+global", 10, embeddings=h)
        kept = store.kept("c")
        np.testing.assert_array_equal(kept.embeddings, h)
        with pytest.raises(Changed):
            store.put("c", row, 0.0, 1.0, 1.0, 0.0, 4, "imprint+global", 10, embeddings=h, expect_seq=kept.seq - 1)
        store.put("c", row, 0.0, 1.0, 1.0, 0.0, 1, "imprint+global", 10, embeddings=h[:1], expect_seq=kept.seq)
        assert store.kept("c").embeddings.shape == (1, 4) and store.kept("c").seq == kept.seq + 1
        store.put("c", row, 0.0, 1.0, 1.0, 0.0, 1, "imprint+global", 10)  # a row stored without its examples
        assert store.kept("c").embeddings is None
        store.delete("c")
        assert store.kept("c") is None and store.kept("nobody") is None
