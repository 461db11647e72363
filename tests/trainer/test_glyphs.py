"""glyphs-latin (trainer/data/glyphs.py), built from the fonts matplotlib ships: splits by
typeface, classes are the characters, no two classes render alike, and rendering is seeded."""
from __future__ import annotations

import numpy as np
import pytest

from trainer.data import glyphs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLC_HOME", str(home))
        manifest, arrays = glyphs.load("glyphs-latin", progress=False)
    return home, manifest, arrays


def test_calibration_and_test_faces_are_never_seen_in_training(built):
    _, manifest, _ = built
    files = {split: {f["file"] for f in info["faces"]} for split, info in manifest["splits"].items()}
    assert not files["train"] & (files["calibration"] | files["test"])
    assert not files["calibration"] & files["test"]
    assert all(f["family"] and f["style"] for info in manifest["splits"].values() for f in info["faces"])


def test_every_split_holds_every_class_and_its_counts(built):
    _, manifest, arrays = built
    classes = manifest["classes"]
    assert len(classes) > 100 and len(set(classes)) == len(classes) and all(len(c) == 1 for c in classes)
    for split, (x, y) in arrays.items():
        info = manifest["splits"][split]
        assert x.shape == (info["examples"], 1, glyphs.SIZE, glyphs.SIZE) and x.dtype == np.uint8
        counts = np.bincount(y, minlength=len(classes))
        assert (counts == len(info["faces"]) * info["renderings_per_face"]).all()


def test_homoglyphs_are_left_out(built):
    """Latin A, Greek Alpha and Cyrillic A render alike: only the first is a class."""
    _, manifest, _ = built
    classes = set(manifest["classes"])
    assert "A" in classes and "\u0391" not in classes and "\u0410" not in classes
    assert "\u03a9" in classes and "\u0416" in classes  # Omega and Zhe look like nothing else


def test_no_two_classes_render_alike_in_any_training_face():
    from PIL import ImageFont

    gs = glyphs.glyph_set("glyphs-latin")
    chars = glyphs.distinct_chars(gs)
    for face in gs.faces["train"]:
        font = ImageFont.truetype(str(gs.font_dir() / face), glyphs.FONT_SIZE)
        images = [glyphs.render(font, c).tobytes() for c in chars]
        assert len(set(images)) == len(images), face


def test_rendering_is_seeded(tmp_path):
    from PIL import ImageFont

    gs = glyphs.glyph_set("glyphs-latin")
    font = ImageFont.truetype(str(gs.font_dir() / gs.faces["train"][0]), glyphs.FONT_SIZE)
    a = [glyphs.render(font, "g", np.random.default_rng(5)) for _ in range(3)]
    b = [glyphs.render(font, "g", np.random.default_rng(5)) for _ in range(3)]
    c = glyphs.render(font, "g", np.random.default_rng(6))
    assert all(np.array_equal(u, v) for u, v in zip(a, b)) and not np.array_equal(a[0], c)


def test_load_dataset_gives_face_splits(built, monkeypatch):
    from trainer.data import _glyph_splits

    home, manifest, arrays = built
    monkeypatch.setenv("SLC_HOME", str(home))
    _glyph_splits.cache_clear()
    s = _glyph_splits("glyphs-latin")
    assert s.classes == manifest["classes"] and s.input_shape == (1, 32, 32)
    np.testing.assert_array_equal(s.test[1], arrays["test"][1])
    assert s.train[0].dtype == np.float32 and 0 < float(s.mean) < 255
