"""A user's own images (trainer/data/imagefiles.py, docs/datasets.md): a folder of PNGs rendered
from glyphs-latin's fonts, loaded as `imagefolder:` and `csv:`, checked against an independent
enumeration of the files (every file once, its folder's label, its pixels as the server's
preprocessing reads them, a stratified split); split folders and a split column give exactly
those splits; the cache is found again without reading an image; unreadable files are one line
naming them or, skipped, one warning; a run's data that moved is one line, found again with
`override`; npz arrays of images get an image spec. The end-to-end test trains, exports and
serves the folder: every test PNG sent as an image body gets the exported model's offline logit.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from serving.bundle.image import load_image_file
from trainer.data import data_record, load_dataset, load_run_data
from trainer.data import imagefiles

pytestmark = pytest.mark.usefixtures("module_home")  # every cache of this module under a temporary SLC_HOME
CLASSES = "ABCDEFGHIJ"
PER_CLASS = 8


def render_folder(root: Path, classes: str = CLASSES, per_class: int = PER_CLASS) -> Path:
    """root/CLASS/i.png: 32x32 grey glyphs from two DejaVu faces, augmented (seeded)."""
    from trainer.data import glyphs

    fonts = [f.load() for f in glyphs.glyph_set("glyphs-latin").faces["train"][:2]]
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(glyphs.render(fonts[i % 2], c, rng)).save(root / c / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return render_folder(tmp_path_factory.mktemp("pngs") / "letters")


def _enumerate(root: Path) -> dict[str, str]:
    """Independent truth: relative path -> class folder, from a plain glob."""
    return {p.relative_to(root).as_posix(): p.parent.name for p in root.glob("*/*.png")}


def _per_split(splits) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {s: splits.split(s) for s in ("train", "calibration", "test")}


def test_imagefolder_rows_are_every_file_once_labelled_decoded_and_stratified(folder):
    s = load_dataset(f"imagefolder:{folder}", progress=False)
    truth = _enumerate(folder)
    assert s.classes == sorted(set(truth.values())) == sorted(os.listdir(folder))
    assert s.input_shape == (1, 32, 32) and s.image["channels"] == 1 and s.image["background"] == "any"
    rows = imagefiles.row_files(s)
    assert sorted(f for files in rows.values() for f in files) == sorted(truth)  # each file exactly once
    for name, (x, y) in _per_split(s).items():
        assert isinstance(x, np.memmap) and x.dtype == np.uint8 and len(x) == len(y) == len(rows[name])
        for xi, yi, rel in zip(x, y, rows[name]):
            assert s.classes[yi] == truth[rel]
            np.testing.assert_array_equal(xi, load_image_file(folder / rel, s.image).astype(np.uint8))
    counts = {n: np.bincount(y, minlength=len(CLASSES)) for n, (_, y) in _per_split(s).items()}
    assert [int(c.sum()) for c in counts.values()] == [48, 16, 16]
    assert np.all(counts["train"] >= 4) and np.all(counts["calibration"] >= 1) and np.all(counts["test"] >= 1)
    train = np.asarray(s.train[0], dtype=np.float64)
    assert float(s.mean) == pytest.approx(train.mean(), rel=1e-6) and float(s.std) == pytest.approx(train.std(), rel=1e-6)
    # the split is the one every other dataset gets: _stratified_split over the files in path order
    from trainer.data import _stratified_split

    paths = sorted(truth)
    labels = np.searchsorted(s.classes, [truth[p] for p in paths])
    for name, (idx, _) in zip(("train", "calibration", "test"), _stratified_split(np.arange(len(paths)), labels, 0)):
        assert rows[name] == [paths[i] for i in idx]


def test_split_folders_and_a_csv_give_the_same_data(folder, tmp_path):
    s = load_dataset(f"imagefolder:{folder}", progress=False)
    rows = imagefiles.row_files(s)
    split_dir = {"train": "train", "calibration": "val", "test": "test"}
    for name, files in rows.items():
        for rel in files:
            (tmp_path / "split" / split_dir[name] / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(folder / rel, tmp_path / "split" / split_dir[name] / rel)
    by_folder = load_dataset(f"imagefolder:{tmp_path / 'split'}", progress=False)
    assert {n: [f.split("/", 1)[1] for f in fs] for n, fs in imagefiles.row_files(by_folder).items()} == rows
    for name in rows:
        np.testing.assert_array_equal(by_folder.split(name)[0], s.split(name)[0])
        np.testing.assert_array_equal(by_folder.split(name)[1], s.split(name)[1])

    # a CSV next to the images, without a split column: the same files and labels, so the same data
    (folder / "labels.csv").write_text("path,label\n" + "".join(f"{rel},{lab}\n" for rel, lab in _enumerate(folder).items()))
    by_csv = load_dataset(f"csv:{folder / 'labels.csv'}", progress=False)
    assert by_csv.fingerprint == s.fingerprint and imagefiles.row_files(by_csv) == rows
    # with a split column (val = calibration) and other label names: those splits, classes sorted by name
    lines = [f"{tmp_path / 'split' / split_dir[n] / rel},letter {rel[0].lower()},{split_dir[n]}\n"
             for n, files in rows.items() for rel in files]
    (tmp_path / "split.csv").write_text("path,label,split\n" + "".join(reversed(lines)))
    with_split = load_dataset(f"csv:{tmp_path / 'split.csv'}", progress=False)
    assert with_split.classes == [f"letter {c.lower()}" for c in CLASSES]
    for name in rows:
        np.testing.assert_array_equal(with_split.split(name)[0], s.split(name)[0])
        np.testing.assert_array_equal(with_split.split(name)[1], s.split(name)[1])


def test_the_cache_is_found_again_without_reading_an_image(folder, tmp_path, monkeypatch):
    work = shutil.copytree(folder, tmp_path / "letters")  # copy2: the same modification times
    first = load_dataset(f"imagefolder:{work}", progress=False)

    def no_reading(*args, **kwargs):
        raise AssertionError("an image was read")

    monkeypatch.setattr(imagefiles, "_scan_chunk", no_reading)
    monkeypatch.setattr(imagefiles, "_decode_chunk", no_reading)
    again = load_dataset(f"imagefolder:{work}", progress=False)
    assert again.fingerprint == first.fingerprint
    monkeypatch.undo()
    os.utime(work / "A" / "0.png", ns=(0, 0))  # touched, same content: read again, same data
    assert load_dataset(f"imagefolder:{work}", progress=False).fingerprint == first.fingerprint
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(work / "A" / "0.png")  # changed: other data
    assert load_dataset(f"imagefolder:{work}", progress=False).fingerprint != first.fingerprint


def test_worker_processes_build_the_same_cache(folder, tmp_path, monkeypatch):
    serial = load_dataset(f"imagefolder:{folder}", progress=False)
    monkeypatch.setenv("SLC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(imagefiles, "PARALLEL_MIN", 1)
    monkeypatch.setattr(imagefiles, "CHUNK", 7)  # many chunks, finishing in any order
    parallel = imagefiles.load(f"imagefolder:{folder}", progress=False, workers=2)
    assert parallel.fingerprint == serial.fingerprint
    for name in ("train", "calibration", "test"):
        np.testing.assert_array_equal(parallel.split(name)[0], serial.split(name)[0])


def test_an_unreadable_file_says_what_it_holds_never_an_object_address(folder, tmp_path):
    """Issue 50: `cannot identify image file <_io.BytesIO object at 0x7fd2…>` said nothing to the user."""
    work = shutil.copytree(folder, tmp_path / "letters")
    (work / "C" / "3.png").write_bytes(b"<html><body>404 not found</body></html>")  # a download that failed
    with pytest.raises(ValueError) as err:
        load_dataset(f"imagefolder:{work}", progress=False)
    message = str(err.value)
    assert "C/3.png" in message and "(the file holds HTML or XML text)" in message, message
    assert "0x" not in message and "BytesIO" not in message


def test_unreadable_files_are_one_line_naming_them_or_skipped_with_one_warning(folder, tmp_path, caplog):
    work = shutil.copytree(folder, tmp_path / "letters")
    (work / "C" / "3.png").write_bytes(b"not a png at all")  # the header check finds it
    with pytest.raises(ValueError) as err:
        load_dataset(f"imagefolder:{work}", progress=False)
    assert "C/3.png" in str(err.value) and "--skip-bad-images" in str(err.value) and "\n" not in str(err.value)

    png = (work / "D" / "1.png").read_bytes()
    (work / "D" / "1.png").write_bytes(png[:len(png) // 2])  # a sound header, the pixels cut: found decoding
    with caplog.at_level(logging.WARNING, logger="trainer.data.imagefiles"):
        s = load_dataset(f"imagefolder:{work}", skip_bad=True, progress=False)
    assert sum(len(y) for _, y in _per_split(s).values()) == len(CLASSES) * PER_CLASS - 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 2 unreadable" in warnings[0]
    assert "C/3.png" in warnings[0] and "D/1.png" in warnings[0]
    skipped = {f for files in imagefiles.row_files(s).values() for f in files}
    assert "C/3.png" not in skipped and "D/1.png" not in skipped and len(skipped) == len(CLASSES) * PER_CLASS - 2
    with pytest.raises(ValueError, match="C/3.png"):  # the built cache does not hide them from a run without it
        load_dataset(f"imagefolder:{work}", progress=False)

    (work / "C" / "3.png").write_bytes(png)  # only the truncated file left: named by the decoding pass
    with pytest.raises(ValueError) as err:
        load_dataset(f"imagefolder:{work}", progress=False)
    assert "D/1.png" in str(err.value) and "\n" not in str(err.value)


def test_layout_mistakes_are_one_line(tmp_path):
    render_folder(tmp_path / "few", classes="AB", per_class=3)
    with pytest.raises(ValueError, match="at least 5 per class"):
        load_dataset(f"imagefolder:{tmp_path / 'few'}", progress=False)
    (tmp_path / "half" / "train" / "A").mkdir(parents=True)
    (tmp_path / "half" / "val").mkdir()
    with pytest.raises(ValueError, match="test missing"):
        load_dataset(f"imagefolder:{tmp_path / 'half'}", progress=False)
    with pytest.raises(ValueError, match="not found"):
        load_dataset(f"imagefolder:{tmp_path / 'nowhere'}", progress=False)
    (tmp_path / "bad.csv").write_text("file,class\na.png,x\n")
    with pytest.raises(ValueError, match="path,label"):
        load_dataset(f"csv:{tmp_path / 'bad.csv'}", progress=False)


def test_image_size_and_channels_can_be_given(folder):
    s = load_dataset(f"imagefolder:{folder}", image={"height": 24, "channels": 3}, progress=False)
    assert s.input_shape == (3, 24, 24) and s.image["width"] == 24
    rel = imagefiles.row_files(s)["test"][0]
    np.testing.assert_array_equal(s.test[0][0], load_image_file(folder / rel, s.image).astype(np.uint8))
    with pytest.raises(ValueError, match="scale"):
        load_dataset(f"imagefolder:{folder}", image={"scale": 0.5}, progress=False)
    with pytest.raises(ValueError, match="unknown image setting"):
        load_dataset(f"imagefolder:{folder}", image={"size": 24}, progress=False)


def _info(splits, name: str) -> dict:
    """A run's data.json as train.py writes it."""
    return {"dataset": name, "classes": splits.classes, "input_shape": list(splits.input_shape), **data_record(splits)}


def test_a_runs_moved_data_is_one_line_and_found_again_with_override(folder, tmp_path):
    work = shutil.copytree(folder, tmp_path / "a")
    s = load_dataset(f"imagefolder:{work}", progress=False)
    info = _info(s, f"imagefolder:{work}")
    assert load_run_data(info).fingerprint == s.fingerprint
    work.rename(tmp_path / "b")
    with pytest.raises(ValueError) as err:
        load_run_data(info)
    msg = str(err.value)
    assert "\n" not in msg and f"imagefolder:{work}" in msg and "gone" in msg and "--data" in msg
    assert s.fingerprint[:12] in msg
    moved = load_run_data(info, override=f"imagefolder:{tmp_path / 'b'}")
    assert moved.fingerprint == s.fingerprint
    np.testing.assert_array_equal(moved.test[0], s.test[0])
    # copied without modification times: read again, the same content, the same data
    shutil.copytree(tmp_path / "b", tmp_path / "c", copy_function=shutil.copyfile)
    assert load_run_data(info, override=f"imagefolder:{tmp_path / 'c'}").fingerprint == s.fingerprint
    Image.fromarray(np.full((32, 32), 9, np.uint8)).save(tmp_path / "c" / "B" / "2.png")
    with pytest.raises(ValueError, match="not the data the run was trained on"):
        load_run_data(info, override=f"imagefolder:{tmp_path / 'c'}")
    old = {k: v for k, v in info.items() if k not in ("fingerprint", "source", "image")}  # a run from before
    old["dataset"] = f"imagefolder:{tmp_path / 'b'}"
    assert load_run_data(old).fingerprint == s.fingerprint


# ------------------------------------------------------------------------------ npz arrays
def _glyph_array(n: int = 60) -> tuple[np.ndarray, np.ndarray]:
    from trainer.data import glyphs

    font = glyphs.glyph_set("glyphs-latin").faces["train"][0].load()
    rng = np.random.default_rng(1)
    y = np.arange(n) % 3
    return np.stack([glyphs.render(font, "XYZ"[c], rng) for c in y]), y  # [n, 32, 32] white on black


def test_npz_image_arrays_get_an_image_spec_and_a_file_fingerprint(tmp_path):
    from serving.codecs.images import decode

    x, y = _glyph_array()
    cases = {"hw": (x, {"layout": "HW", "channels": 1, "background": "dark"}),
             "chw": (x[:, None], {"layout": "CHW", "channels": 1, "background": "dark"}),
             "hwc": (np.repeat(x[..., None], 3, axis=-1), {"layout": "HWC", "channels": 3, "background": "any"}),
             "inverted": (255 - x, {"layout": "HW", "channels": 1, "background": "light"})}
    for name, (arr, want) in cases.items():
        np.savez(tmp_path / f"{name}.npz", x=arr, y=y)
        s = load_dataset(f"npz:{tmp_path / name}.npz")
        assert {k: s.image[k] for k in want} == want and (s.image["height"], s.image["width"]) == (32, 32), name
        assert s.fingerprint == hashlib.sha256((tmp_path / f"{name}.npz").read_bytes()).hexdigest()
        if arr.ndim == 3:  # a training example sent as a PNG body is exactly itself
            example = np.asarray(s.test[0][0])
            png = tmp_path / "one.png"
            Image.fromarray(example.astype(np.uint8)).save(png)
            np.testing.assert_array_equal(decode(png.read_bytes(), b"image/png", s.image, s.input_shape), example)
    np.savez(tmp_path / "noise.npz", x=np.random.default_rng(0).random((60, 32, 32)), y=y)
    assert load_dataset(f"npz:{tmp_path / 'noise.npz'}").image is None  # not pixel values
    np.savez(tmp_path / "flat.npz", x=x.reshape(60, -1), y=y)
    assert load_dataset(f"npz:{tmp_path / 'flat.npz'}").image is None  # not image-shaped, unless told
    told = load_dataset(f"npz:{tmp_path / 'flat.npz'}", image={"height": 32, "width": 32})
    assert told.image["layout"] == "flat" and told.image["background"] == "dark"
    with pytest.raises(ValueError, match="shape"):
        load_dataset(f"npz:{tmp_path / 'flat.npz'}", image={"height": 30})


def test_a_moved_npz_is_one_line_and_found_again(tmp_path):
    x, y = _glyph_array()
    np.savez(tmp_path / "a.npz", x=x, y=y)
    s = load_dataset(f"npz:{tmp_path / 'a.npz'}")
    info = _info(s, f"npz:{tmp_path / 'a.npz'}")
    (tmp_path / "a.npz").rename(tmp_path / "b.npz")
    with pytest.raises(ValueError, match="is gone.*--data"):
        load_run_data(info)
    assert load_run_data(info, override=f"npz:{tmp_path / 'b.npz'}").fingerprint == s.fingerprint
    np.savez(tmp_path / "c.npz", x=x[::-1], y=y[::-1])
    with pytest.raises(ValueError, match="not the data"):
        load_run_data(info, override=f"npz:{tmp_path / 'c.npz'}")


def test_built_in_datasets_record_their_spec_and_load_again():
    from trainer.data import image_spec

    s = load_dataset("digits")
    assert s.image == image_spec("digits") and s.source["dataset"] == "digits" and len(s.fingerprint) == 64
    assert load_run_data(_info(s, "digits")).fingerprint == s.fingerprint
    assert load_dataset("synthetic").image is None


# ------------------------------------------------------------------------------ end to end
@pytest.mark.integration
def test_a_trained_exported_served_folder_answers_each_test_png_with_its_offline_logit(folder, tmp_path):
    """slc train on imagefolder:, slc export, the server: each test file POSTed as an image/png body
    to detect of its class gets the logit of the exported backbone (onnxruntime) + head in float64
    and of the trained torch model, on load_image_file(path), within 1e-4."""
    from urllib.parse import quote

    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from serving.bundle import load_bundle
    from tests.serving.helpers import Offline, make_settings, wait_ready
    from trainer.export import export_bundle
    from trainer.train import TrainConfig, train
    from trainer.runs import load_run, run_logits

    name = f"imagefolder:{folder}"
    cfg = TrainConfig(dataset=name, backbone="resnet_glyph", backbone_params={"width": 8}, loss="batch_ce",
                      epochs=2, lr=0.01, batch_size=16, seed=0)
    run = train(cfg, tmp_path / "run", progress=False)
    bundle = export_bundle(run, tmp_path / "bundle", target_precision=0.9)
    splits = load_dataset(name, progress=False)
    assert load_bundle(bundle).image == splits.image
    files = imagefiles.row_files(splits)["test"]
    x = np.stack([load_image_file(folder / rel, splits.image) for rel in files])  # [n, 1, 32, 32]
    labels = [splits.classes.index(rel.split("/")[0]) for rel in files]
    offline = Offline(load_bundle(bundle)).logits(x)[np.arange(len(files)), labels]  # [n] float64
    torch_logits = run_logits(load_run(run)[0], x)[np.arange(len(files)), labels]  # [n]
    np.testing.assert_allclose(torch_logits, offline, rtol=1e-4, atol=1e-4)
    app = create_app(make_settings(bundle, tmp_path, max_inputs=64))
    with TestClient(app) as client:
        wait_ready(client.get)
        for rel, j, want in zip(files, labels, offline):
            r = client.post(f"/v1/classes/{quote(splits.classes[j], safe='')}/detect",
                            content=(folder / rel).read_bytes(), headers={"content-type": "image/png"})
            assert r.status_code == 200, r.text
            assert r.json()["class_id"] == j
            assert r.json()["results"][0]["logit"] == pytest.approx(want, rel=1e-4, abs=1e-4), rel
