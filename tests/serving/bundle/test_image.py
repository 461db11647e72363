"""The shared image preprocessing (serving/bundle/image.py): an image file read by the trainer
(`load_image_file`) and the same bytes sent to the server as a body (`serving.codecs.images.decode`)
give byte-identical arrays, for every format, mode and spec the two meet (grey, RGB, RGBA,
16-bit, palette, EXIF-rotated, resized); background `any` never inverts; the `HW` layout;
and check_image_spec accepts what the preprocessing can do and nothing else."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from serving.bundle.image import is_grey, load_image_file, preprocess
from serving.bundle.imagespec import check_image_spec, input_shape_of
from serving.codecs.images import decode

CONTENT_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".gif": "image/gif", ".bmp": "image/bmp",
                 ".webp": "image/webp", ".tif": "image/tiff"}
SPECS = {
    "grey CHW any": {"height": 32, "width": 32, "channels": 1, "layout": "CHW", "scale": 1.0, "background": "any",
                     "resample": "lanczos"},
    "RGB HWC dark": {"height": 24, "width": 20, "channels": 3, "layout": "HWC", "scale": 1.0, "background": "dark",
                     "resample": "bilinear"},
    "grey flat light": {"height": 16, "width": 16, "channels": 1, "layout": "flat", "scale": 1 / 255,
                        "background": "light", "resample": "nearest"},
    "grey HW dark": {"height": 28, "width": 28, "channels": 1, "layout": "HW", "scale": 1.0, "background": "dark",
                     "resample": "lanczos"},
}


def _picture(h: int = 30, w: int = 40) -> np.ndarray:
    """A smooth RGB test picture uint8 [h, w, 3] (gradients, a bright square)."""
    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 255 // (h + w)], axis=-1).astype(np.uint8)
    rgb[h // 4:h // 2, w // 4:w // 2] = 250
    return rgb


def _files(tmp_path) -> list:
    """One file per format and mode the preprocessing must handle."""
    rgb = _picture()
    grey = rgb[..., 0]
    rgba = np.concatenate([rgb, (np.arange(40, dtype=np.uint8) * 6)[None, :, None].repeat(30, 0)], axis=-1)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° on display
    images = {
        "grey.png": (Image.fromarray(grey), {}), "rgb.png": (Image.fromarray(rgb), {}),
        "rgba.png": (Image.fromarray(rgba, "RGBA"), {}),
        "deep.png": (Image.fromarray(grey.astype(np.uint16) * 257), {}),  # 16-bit grey
        "palette.gif": (Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE), {}),
        "rotated.jpg": (Image.fromarray(rgb), {"exif": exif, "quality": 90}),
        "photo.bmp": (Image.fromarray(rgb), {}), "photo.webp": (Image.fromarray(rgb), {"lossless": True}),
        "photo.tif": (Image.fromarray(rgb), {}),
    }
    out = []
    for name, (img, options) in images.items():
        img.save(tmp_path / name, **options)
        out.append(tmp_path / name)
    return out


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_an_image_file_and_the_same_bytes_as_a_body_give_identical_arrays(tmp_path, spec_name):
    spec = SPECS[spec_name]
    for path in _files(tmp_path):
        offline = load_image_file(path, spec)
        served = decode(path.read_bytes(), CONTENT_TYPES[path.suffix].encode(), spec, input_shape_of(spec))
        assert offline.dtype == served.dtype == np.float32 and offline.shape == input_shape_of(spec)
        assert offline.tobytes() == served.tobytes(), path.name


def test_exif_orientation_is_applied(tmp_path):
    rgb = _picture()
    exif = Image.Exif()
    exif[0x0112] = 3  # rotated 180° on display
    Image.fromarray(rgb).save(tmp_path / "upside-down.png", exif=exif)
    spec = {**SPECS["RGB HWC dark"], "height": 30, "width": 40}
    np.testing.assert_array_equal(load_image_file(tmp_path / "upside-down.png", spec), rgb[::-1, ::-1].astype(np.float32))


def test_background_any_never_inverts_and_dark_does():
    drawing = np.full((32, 32), 250, np.uint8)  # dark strokes on white paper
    drawing[8:24, 14:18] = 10
    spec = SPECS["grey CHW any"]
    np.testing.assert_array_equal(preprocess(Image.fromarray(drawing), spec)[0], drawing.astype(np.float32))
    np.testing.assert_array_equal(preprocess(Image.fromarray(drawing), {**spec, "background": "dark"})[0],
                                  255 - drawing.astype(np.float32))


def test_transparency_is_flattened_onto_white_for_any_and_black_for_dark():
    rgba = np.zeros((8, 8, 4), np.uint8)  # fully transparent
    spec = {**SPECS["grey CHW any"], "height": 8, "width": 8}
    assert np.all(preprocess(Image.fromarray(rgba, "RGBA"), spec) == 255)
    assert np.all(preprocess(Image.fromarray(rgba, "RGBA"), {**spec, "background": "dark"}) == 0)


def test_grey_is_read_from_mode_and_palette(tmp_path):
    grey_palette = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)).convert("P")
    colour_palette = Image.fromarray(_picture(8, 8)).convert("P", palette=Image.Palette.ADAPTIVE)
    for img, want in ((grey_palette, True), (colour_palette, False), (Image.new("L", (4, 4)), True),
                      (Image.new("RGB", (4, 4)), False), (Image.new("I;16", (4, 4)), True)):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        assert is_grey(Image.open(io.BytesIO(buf.getvalue()))) is want, img.mode


def test_check_image_spec_takes_any_and_hw_and_refuses_what_preprocess_cannot_do():
    hw = SPECS["grey HW dark"]
    assert check_image_spec(hw, (28, 28)) is None
    assert check_image_spec(SPECS["grey CHW any"], (1, 32, 32)) is None
    assert "out of range" in check_image_spec({**hw, "channels": 3}, (28, 28))
    assert "background" in check_image_spec({**hw, "background": "grey"}, (28, 28))
    assert "input shape" in check_image_spec(hw, (1, 28, 28))


@pytest.mark.parametrize("box, ok", [(0.1, True), (0, True), (1, True), (-0.1, False), (1.5, False), ("0.1", False),
                                     (True, False)])
def test_check_image_spec_takes_a_content_box_margin_in_0_1_on_grey_only(box, ok):
    hw = {**SPECS["grey HW dark"], "content_box": box}
    assert (check_image_spec(hw, (28, 28)) is None) is ok
    rgb = {**SPECS["grey CHW any"], "channels": 3, "content_box": 0.1}
    assert "content_box" in check_image_spec(rgb, (3, 32, 32))


def test_image_files_may_be_larger_than_image_bodies(tmp_path):
    """A 17.5-megapixel file is training data; the same bytes as a body are 413 (MAX_PIXELS)."""
    from serving.bundle.image import MAX_PIXELS
    from serving.errors import PayloadTooLarge

    Image.new("L", (5000, 3500), 0).save(tmp_path / "big.png")
    assert 5000 * 3500 > MAX_PIXELS
    spec = SPECS["grey CHW any"]
    assert load_image_file(tmp_path / "big.png", spec).shape == (1, 32, 32)
    with pytest.raises(PayloadTooLarge):
        decode((tmp_path / "big.png").read_bytes(), b"image/png", spec, input_shape_of(spec))


def test_a_large_photo_is_decoded_reduced_the_same_both_ways_and_close_to_a_full_decode(tmp_path):
    """A 2400x1800 JPEG (EXIF-rotated) to 64x64: libjpeg's reduced decode and the box reduction
    (REDUCE_GAP) give the file and the body the same array, within a grey level on average of
    the plain reference (full decode, rotation, one Lanczos resize)."""
    from PIL import ImageOps

    yy, xx = np.mgrid[0:1800, 0:2400]
    rgb = np.stack([(xx // 9) % 256, (yy // 7) % 256, ((xx + yy) // 13) % 256], axis=-1).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(rgb).save(tmp_path / "photo.jpg", quality=92, exif=exif)
    spec = {"height": 64, "width": 64, "channels": 3, "layout": "HWC", "scale": 1.0, "background": "any",
            "resample": "lanczos"}
    offline = load_image_file(tmp_path / "photo.jpg", spec)
    served = decode((tmp_path / "photo.jpg").read_bytes(), b"image/jpeg", spec, (64, 64, 3))
    assert offline.tobytes() == served.tobytes()
    full = ImageOps.exif_transpose(Image.open(tmp_path / "photo.jpg")).convert("RGB")
    reference = np.asarray(full.resize((64, 64), Image.LANCZOS), dtype=np.float32)
    assert np.abs(offline - reference).mean() < 1.0
