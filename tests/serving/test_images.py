"""Image request bodies (serving/codecs/images.py): a training image sent as PNG becomes exactly its
training tensor (mnist5k, glyphs-latin: the spec export records); dark-on-light and transparent
drawings become the same tensor as light-on-dark ones; over HTTP an image body is answered as
the JSON body of its tensor; bad images get the envelope (415 / 413 / 422), never a 500."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from serving.codecs.images import decode, preprocess
from serving.errors import SlcError
from serving.http.errors import http_status
from tests.serving.helpers import assert_envelope

IMAGE = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 16.0 / 255.0, "background": "dark",
         "resample": "lanczos"}


def _png(array: np.ndarray, mode: str = "L") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.asarray(array, dtype=np.uint8), mode).save(buf, format="PNG")
    return buf.getvalue()


def test_mnist_training_images_sent_as_png_are_their_training_tensors():
    from trainer.data import image_spec, load_dataset

    spec = image_spec("mnist5k")
    x, _ = load_dataset("mnist5k").test
    for example in x[:20]:  # [784] values 0..255
        got = decode(_png(example.reshape(28, 28)), b"image/png", spec, (784,))
        np.testing.assert_array_equal(got, example.astype(np.float32))


def test_glyph_training_images_sent_as_png_are_their_training_tensors():
    from trainer.data import image_spec, load_dataset

    splits = load_dataset("glyphs-latin")
    spec = image_spec("glyphs-latin")
    x, _ = splits.test
    for example in x[:20]:  # [1, 32, 32] uint8
        got = decode(_png(np.asarray(example)[0]), b"image/png", spec, tuple(splits.input_shape))
        np.testing.assert_array_equal(got, np.asarray(example, dtype=np.float32))


def _digit() -> np.ndarray:
    a = np.zeros((8, 8), np.uint8)
    a[1:7, 3:5] = 255  # a bright stroke on black, as training images are
    return a


def test_dark_on_light_drawings_are_inverted_to_the_training_polarity():
    light_on_dark = preprocess(Image.fromarray(_digit()), IMAGE)
    dark_on_light = preprocess(Image.fromarray(255 - _digit()), IMAGE)
    np.testing.assert_array_equal(dark_on_light, light_on_dark)


def test_transparent_drawings_are_flattened_onto_the_training_background():
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., 3] = _digit()  # white strokes where alpha is set, transparent elsewhere
    rgba[..., :3] = 255
    np.testing.assert_array_equal(preprocess(Image.fromarray(rgba, "RGBA"), IMAGE),
                                  preprocess(Image.fromarray(_digit()), IMAGE))


def test_other_sizes_are_resized_and_colour_becomes_grey():
    """A 2x nearest-upscaled grey digit as RGB, read with resample=nearest, is the digit itself."""
    rgb = np.stack([np.kron(_digit(), np.ones((2, 2), np.uint8))] * 3, axis=-1)  # [16, 16, 3]
    spec = {**IMAGE, "resample": "nearest"}
    got = preprocess(Image.fromarray(rgb, "RGB"), spec)
    np.testing.assert_array_equal(got, preprocess(Image.fromarray(_digit()), spec))


# ---------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def image_bundle(tmp_path_factory):
    from tests.serving.helpers import synthetic_image_bundle

    return synthetic_image_bundle(tmp_path_factory, "img", IMAGE)


@pytest.fixture
def image_client(image_bundle, tmp_path):
    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, wait_ready

    app = create_app(make_settings(image_bundle, tmp_path))
    with TestClient(app) as client:
        wait_ready(client.get)
        yield client


def _post_png(client, path, body: bytes, content_type="image/png", **params):
    return client.post(path, content=body, headers={"content-type": content_type}, params=params)


def test_detect_on_an_image_equals_detect_on_its_tensor(image_client):
    tensor = preprocess(Image.fromarray(_digit()), IMAGE)
    by_image = _post_png(image_client, "/v1/classes/3/detect", _png(_digit()), threshold=0.1)
    by_json = image_client.post("/v1/classes/3/detect", json={"inputs": [tensor.tolist()], "threshold": 0.1})
    assert by_image.status_code == 200, by_image.text
    assert by_image.json() == by_json.json()


def test_softmax_and_topk_take_images_with_their_parameters_in_the_query(image_client):
    tensor = preprocess(Image.fromarray(_digit()), IMAGE).tolist()
    assert _post_png(image_client, "/v1/classes/3/softmax", _png(_digit())).json() == \
        image_client.post("/v1/classes/3/softmax", json={"inputs": [tensor]}).json()
    top = _post_png(image_client, "/v1/topk", _png(_digit()), k=3)
    assert top.status_code == 200 and top.json() == image_client.post("/v1/topk", json={"inputs": [tensor], "k": 3}).json()


def test_model_info_shows_how_images_are_read(image_client):
    assert image_client.get("/v1/model").json()["image"] == IMAGE


def test_bytes_that_are_no_image_are_422(image_client):
    r = _post_png(image_client, "/v1/classes/3/detect", b"\x89PNG\r\n\x1a\nnot really")
    assert_envelope(r, 422, "invalid_image")


def test_an_image_type_that_is_not_supported_is_415(image_client):
    r = _post_png(image_client, "/v1/classes/3/detect", b"<svg/>", content_type="image/svg+xml")
    assert_envelope(r, 415)


def test_an_image_of_too_many_pixels_is_413(image_client):
    buf = io.BytesIO()
    Image.new("L", (5000, 4000)).save(buf, format="PNG")  # 20 Mpx, a few KB compressed
    r = _post_png(image_client, "/v1/classes/3/detect", buf.getvalue())
    assert_envelope(r, 413, "image_too_large")


def test_an_unknown_query_parameter_is_422(image_client):
    r = _post_png(image_client, "/v1/classes/3/detect", _png(_digit()), thershold=0.1)
    assert_envelope(r, 422, "validation_error")


def test_a_bundle_without_an_image_spec_refuses_images_with_415(client):
    r = _post_png(client, "/v1/classes/3/detect", _png(_digit()))
    assert "not an image" in assert_envelope(r, 415)["error"]["message"]


def test_a_gallery_item_put_as_an_image_is_stored_as_its_tensor_and_found(image_client):
    tensor = preprocess(Image.fromarray(_digit()), IMAGE)
    r = image_client.put("/v1/gallery/items/digit-1", content=_png(_digit()), headers={"content-type": "image/png"},
                         params={"metadata": '{"drawn": "by hand"}'})
    assert r.status_code == 201 and r.json() == {"upserted": 1, "ids": ["digit-1"]}
    item = image_client.get("/v1/gallery/items/digit-1").json()
    assert item["metadata"] == {"drawn": "by hand"}
    np.testing.assert_array_equal(np.asarray(item["input"], np.float32), tensor)
    hits = image_client.post("/v1/classes/3/search", json={"threshold": -1e30}).json()["results"]
    assert [h["id"] for h in hits] == ["digit-1"]


def test_a_gallery_item_put_as_json_equals_the_post_form(image_client):
    tensor = preprocess(Image.fromarray(_digit()), IMAGE).tolist()
    assert image_client.put("/v1/gallery/items/a", json={"input": tensor}).status_code == 201
    assert image_client.post("/v1/gallery/items", json={"items": [{"id": "b", "input": tensor}]}).status_code == 201
    hits = {h["id"]: h["logit"] for h in image_client.post("/v1/classes/5/search", json={"threshold": -1e30}).json()["results"]}
    assert hits["a"] == hits["b"]


def test_gallery_put_with_metadata_that_is_not_an_object_is_422(image_client):
    r = image_client.put("/v1/gallery/items/x", content=_png(_digit()), headers={"content-type": "image/png"},
                         params={"metadata": "[1, 2]"})
    assert_envelope(r, 422, "validation_error")


def test_sixteen_bit_grey_is_scaled_not_clipped():
    ramp = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)  # 0 .. 63,000
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, format="PNG")  # uint16 -> mode I;16
    got = decode(buf.getvalue(), b"image/png", IMAGE, (64,))
    np.testing.assert_array_equal(got, (np.rint(ramp / 257.0) * np.float32(16 / 255)).astype(np.float32).ravel())


def test_a_body_in_another_format_than_declared_is_422():
    buf = io.BytesIO()
    Image.fromarray(_digit()).save(buf, format="BMP")
    with pytest.raises(Exception) as err:
        decode(buf.getvalue(), b"image/png", IMAGE, (64,))
    assert getattr(err.value, "code", None) == "invalid_image"


@pytest.mark.parametrize("mode", ["LAB", "CMYK", "RGBA", "P", "1"])
def test_every_pillow_mode_either_decodes_or_is_a_4xx(mode):
    img = Image.new(mode, (8, 8))
    buf = io.BytesIO()
    img.save(buf, format="TIFF")
    try:
        got = decode(buf.getvalue(), b"image/tiff", IMAGE, (64,))
        assert got.shape == (64,) and np.isfinite(got).all()
    except SlcError as exc:
        assert http_status(exc) in (413, 415, 422), exc


def test_gallery_ids_with_nul_are_refused_with_422(image_client):
    tensor = preprocess(Image.fromarray(_digit()), IMAGE).tolist()
    r = image_client.post("/v1/gallery/items", json={"items": [{"id": "a\u0000b", "input": tensor}]})
    assert_envelope(r, 422, "validation_error")
    assert_envelope(image_client.put("/v1/gallery/items/a%00b", json={"input": tensor}), 422, "validation_error")
