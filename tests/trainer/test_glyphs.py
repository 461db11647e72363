"""glyphs-latin (trainer/data/glyphs.py), built from the fonts matplotlib ships: splits by
typeface, classes are the characters, no two classes render alike, and rendering is seeded."""
from __future__ import annotations

from pathlib import Path

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
    gs = glyphs.glyph_set("glyphs-latin")
    chars = glyphs.distinct_chars(gs)
    for face in gs.faces["train"]:
        font = face.load()
        images = [glyphs.render(font, c).tobytes() for c in chars]
        assert len(set(images)) == len(images), face


def test_rendering_is_seeded(tmp_path):
    font = glyphs.glyph_set("glyphs-latin").faces["train"][0].load()
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
    assert s.train[0].dtype == np.uint8 and 0 < float(s.mean) < 255  # pixels stay uint8 (memory-mapped)
    x = np.asarray(arrays["train"][0], dtype=np.float64)
    assert float(s.mean) == pytest.approx(x.mean(), rel=1e-6) and float(s.std) == pytest.approx(x.std(), rel=1e-6)


# --- the GB2312 sets, from Debian's CJK fonts (skipped with the reason where they are not installed)


def test_gb2312_lists_are_the_standard_ones():
    level1, full = glyphs.gb2312(True), glyphs.gb2312(False)
    assert (len(level1), len(full)) == (3755, 6763)
    assert full.startswith(level1) and level1[:3] == "啊阿埃" and "永" in level1
    assert len(set(full)) == len(full)


def test_missing_cjk_fonts_name_the_debian_packages(monkeypatch):
    gs = glyphs.glyph_set("glyphs3755")
    monkeypatch.setattr(glyphs.Face, "path", lambda self: Path("/nonexistent") / Path(self.file).name)
    with pytest.raises(FileNotFoundError, match="apt-get install .*fonts-arphic-ukai.*fonts-noto-cjk"):
        glyphs.require_fonts(gs)


_CJK = glyphs.glyph_set("glyphs3755")


@pytest.mark.skipif(bool(_CJK.missing()), reason="the CJK font packages are not installed: apt-get install "
                    "fonts-noto-cjk fonts-droid-fallback fonts-wqy-zenhei fonts-hanazono fonts-arphic-uming "
                    "fonts-unifont fonts-arphic-ukai")
def test_every_cjk_face_covers_level_1_and_the_sc_face_is_picked():
    level1 = {ord(c) for c in glyphs.gb2312(True)}
    for face in _CJK.all_faces():
        assert level1 <= face.cmap(), face.file
        family = face.load().getname()[0]
        assert not face.family or family == face.family, (face.file, family)
    test_faces = {f.family for f in _CJK.faces["test"]}
    train_faces = {(f.file, f.family) for f in _CJK.faces["train"]}
    assert "AR PL UKai CN" in test_faces and not train_faces & {(f.file, f.family) for f in _CJK.all_faces()
                                                               if f not in _CJK.faces["train"]}


def test_the_arrays_do_not_depend_on_the_number_of_workers(tmp_path):
    """Each (split, face) block has its own seed: one worker or two render the same bytes."""
    one = glyphs.build("glyphs-latin", tmp_path / "one", progress=False, workers=1)
    two = glyphs.build("glyphs-latin", tmp_path / "two", progress=False, workers=2)
    for split in ("train", "calibration", "test"):
        for kind in ("x", "y", "face"):
            np.testing.assert_array_equal(np.load(one / f"{kind}_{split}.npy"), np.load(two / f"{kind}_{split}.npy"))
