"""The server's messages say what to do (issue 50, part 6): an image body that is not what it claims
says what its bytes look like and never a Python object address; a 415 names the accepted types and
the curl flags; an unknown class gets the nearest names or a case hint; every bundle logs a
ready-to-paste curl at start."""
from __future__ import annotations

import io
import logging
import re

import numpy as np
import pytest
from PIL import Image

from tests.serving.helpers import D, assert_envelope, make_settings, wait_ready

IMAGE = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 16.0 / 255.0, "background": "dark",
         "resample": "lanczos"}
ADDRESS = re.compile(r"0x[0-9a-f]{6,}")


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), 200, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def image_bundle(tmp_path_factory):
    from serving.bundle.synthetic import build_synthetic_bundle

    return build_synthetic_bundle(classes=4, dim=8, input_dim=64, seed=1, out=tmp_path_factory.mktemp("m") / "b",
                                  image=IMAGE)


@pytest.fixture
def image_client(image_bundle, tmp_path):
    from fastapi.testclient import TestClient

    from serving.http.app import create_app

    with TestClient(create_app(make_settings(image_bundle, tmp_path)), raise_server_exceptions=False) as client:
        wait_ready(client.get)
        yield client


def _post(client, body: bytes, content_type: str | None, path: str = "/v1/classes/1/detect"):
    headers = {} if content_type is None else {"content-type": content_type}
    return client.post(path, content=body, headers=headers)


def _message(response, status: int, code: str) -> str:
    message = assert_envelope(response, status, code)["error"]["message"]
    assert "\n" not in message and not ADDRESS.search(message), message
    return message


def test_a_png_labelled_jpeg_says_it_is_a_png(image_client):
    m = _message(_post(image_client, _png(), "image/jpeg"), 422, "invalid_image")
    assert m == ("the body is not a JPEG image: it looks like a PNG image; send it with -H 'Content-Type: image/png' "
                 "--data-binary @FILE")


def test_a_png_sent_with_curl_d_says_use_data_binary(image_client):
    stripped = _png().replace(b"\r", b"").replace(b"\n", b"")  # what curl -d @file sends
    m = _message(_post(image_client, stripped, "image/png"), 422, "invalid_image")
    assert "whose line breaks were removed (curl -d does that)" in m and "--data-binary @FILE" in m
    m = _message(_post(image_client, b"--b\r\nContent-Disposition: form-data; name=f\r\n\r\nx", "image/png"),
                 422, "invalid_image")
    assert "it looks like form data" in m and "--data-binary @FILE" in m


def test_a_png_without_its_content_type_gets_a_415_naming_image_png(image_client):
    for content_type in (None, "application/x-www-form-urlencoded"):
        m = _message(_post(image_client, _png(), content_type), 415, "unsupported_media_type")
        assert m.startswith("the body is a PNG image sent with "), m
        assert "-H 'Content-Type: image/png' --data-binary @FILE" in m and "application/json" in m


def test_curl_d_and_curl_f_on_a_query_route_say_use_data_binary(image_client):
    stripped = _png().replace(b"\r", b"").replace(b"\n", b"")  # curl -d @file: line breaks gone, its default type
    m = _message(_post(image_client, stripped, "application/x-www-form-urlencoded"), 415, "unsupported_media_type")
    assert m.startswith("the body is a PNG image whose line breaks were removed (curl -d does that), sent with "
                        "Content-Type application/x-www-form-urlencoded: send the file itself with --data-binary "
                        "@FILE and -H 'Content-Type: image/png'"), m
    r = image_client.post("/v1/classes/1/detect", files=[("image", ("a.png", _png(), "image/png"))])  # curl -F
    m = _message(r, 415, "unsupported_media_type")
    assert m.startswith("the body is form data (multipart, as curl -F sends), which only PUT /v1/classes/{name} and "
                        "POST /v1/classes/{name}/examples read: send the file itself with --data-binary @FILE"), m


def test_a_json_bundles_415_names_json_only(client):
    m = _message(client.post("/v1/classes/1/detect", content=b"a=1", headers={"content-type": "text/plain"}),
                 415, "unsupported_media_type")
    assert "Content-Type text/plain" in m and "application/json" in m and "image/png" not in m


def test_the_enrollment_415_names_forms_too(image_client):
    m = _message(image_client.put("/v1/classes/new", content=b"hello", headers={"content-type": "text/plain"}),
                 415, "unsupported_media_type")
    assert "multipart/form-data (curl -F image=@a.png -F image=@b.png)" in m


def test_an_unknown_class_lists_the_nearest_names_and_a_case_hint(tmp_path):
    from fastapi.testclient import TestClient

    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.http.app import create_app

    bundle = build_synthetic_bundle(classes=4, dim=4, input_dim=3, seed=0, out=tmp_path / "letters")
    body = {"inputs": [[0.0, 0.0, 0.0]]}
    with TestClient(create_app(make_settings(bundle, tmp_path))) as client:
        wait_ready(client.get)
        client.put("/v1/classes/Apple", json=body)
        client.put("/v1/classes/Banana", json=body)
        m = _message(client.post("/v1/classes/apple/detect", json=body), 404, "unknown_class")
        assert m.startswith("unknown class 'apple': did you mean 'Apple'? class names are case-sensitive"), m
        m = _message(client.post("/v1/classes/Banan/detect", json=body), 404, "unknown_class")
        assert m.startswith("unknown class 'Banan': nearest names: 'Banana'"), m
        m = _message(client.post("/v1/classes/Z/detect", json=body), 404, "unknown_class")
        assert m.startswith("unknown class 'Z': the names are 'Apple', 'Banana'"), m
        assert "an id 0..3" in m


def test_unknown_class_names_from_the_bundle():
    from serving.core.classes import unknown_class

    letters = [chr(c) for c in range(ord("A"), ord("Z"))]  # A..Y
    assert unknown_class("Z", letters, [], 25).startswith("unknown class 'Z': the names are 'A', 'B', 'C', 'D', 'E', …")
    assert unknown_class("a", letters, [], 25).startswith("unknown class 'a': did you mean 'A'? class names are "
                                                          "case-sensitive")


@pytest.mark.parametrize("image", [False, True])
def test_every_bundle_logs_a_ready_to_paste_curl(tmp_path, caplog, image):
    from fastapi.testclient import TestClient

    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.http.app import create_app

    bundle = build_synthetic_bundle(classes=3, dim=4, input_dim=64 if image else 3, seed=0, out=tmp_path / "b",
                                    image=IMAGE if image else None)
    with caplog.at_level(logging.INFO, logger="serving.core.lifecycle"):
        with TestClient(create_app(make_settings(bundle, tmp_path, host="0.0.0.0", port=8123, allow_open_writes=True))) as client:
            wait_ready(client.get)
    hints = [r.getMessage() for r in caplog.records if "curl" in r.getMessage()]
    assert len(hints) == 1, hints
    url = "curl -s -X POST http://127.0.0.1:8123/v1/classes/0/detect"
    if image:
        assert hints[0] == f"is this image of class 0?  {url} -H 'Content-Type: image/png' --data-binary @IMAGE.png"
    else:
        import json

        head, body = hints[0].split(" -d ", 1)
        assert head == f"is this input of class 0?  {url} -H 'Content-Type: application/json'"
        with np.load(bundle / "samples.npz") as s:
            np.testing.assert_allclose(json.loads(body.strip("'"))["inputs"][0], s["input"][0], atol=1e-6)


def test_a_large_json_input_gets_zeros_built_by_python(tmp_path):
    import subprocess

    from serving.bundle import load_bundle
    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.default_model import bundle_curl_hint

    bundle = load_bundle(build_synthetic_bundle(classes=D, dim=4, input_dim=40, seed=0, out=tmp_path / "b"))
    hint = bundle_curl_hint(bundle, "127.0.0.1", 8000)
    body = hint.split(" -d ", 1)[1]
    echoed = subprocess.run(["bash", "-c", f"echo {body}"], capture_output=True, text=True, check=True).stdout
    import json

    assert json.loads(echoed) == {"inputs": [[0.0] * 40]}
