"""`slc calibrate BUNDLE --data imagefolder:DIR` (serving/calibration/cli.py, docs/calibration.md) on a
small model trained and exported from PNG glyphs, recalibrated on PNGs of other typefaces for 8 of
its 10 classes. Checked against independent truth: the written thresholds equal serving/calibration/
run directly on embeddings computed apart from the command (an onnxruntime session of our own:
exactly; the run's torch module: within float tolerance), with the rule the cross-validation chose, the 2 classes without images keep their
previous entries exactly, `slc verify` accepts the bundle and catches a tampered calibration, an
unknown class is one line and exit 2 before any image is decoded, and a server on the new bundle
(or swapped in place through the admin route) answers detect with the new thresholds.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from serving.bundle.image import load_image_file
from slc.cli import main
from tests.trainer.test_imagefolder import render_folder

ROOT = Path(__file__).resolve().parents[3]
SEEN = "ABCDEFGH"  # classes with recalibration images; I and J have none
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("module_home")]  # trains, exports and serves a small model


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(run, bundle): an mlp trained on 10 glyph classes (80 PNGs) and exported at precision 0.9."""
    from trainer.export import export_bundle
    from trainer.train import TrainConfig, train

    root = tmp_path_factory.mktemp("trained")
    folder = render_folder(root / "letters")
    cfg = TrainConfig(dataset=f"imagefolder:{folder}", backbone="mlp", backbone_params={"hidden": 32},
                      loss="batch_ce", epochs=15, lr=0.003, batch_size=16, seed=0)
    run = train(cfg, root / "run", progress=False)
    return run, export_bundle(run, root / "bundle", target_precision=0.9)


def render(root: Path, classes: str = SEEN, per_class: int = 6, split: str = "") -> Path:
    """root/[split/]CLASS/i.png from the calibration typefaces (never trained on), seeded."""
    from trainer.data import glyphs

    fonts = [f.load() for f in glyphs.glyph_set("glyphs-latin").faces["calibration"][:2]]
    rng = np.random.default_rng(len(split) + 1)
    for c in classes:
        (root / split / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(glyphs.render(fonts[i % 2], c, rng)).save(root / split / c / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("recal") / "mine")


@pytest.fixture(scope="module")
def recalibrated(trained, images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "bundle"
    main(["calibrate", str(trained[1]), "--data", f"imagefolder:{images}", "--out", str(out)])
    return out


def files_and_labels(folder: Path, classes: list[str]) -> tuple[list[Path], np.ndarray]:
    """Independent listing: every PNG under folder/CLASS, its class id in the bundle."""
    paths = sorted(folder.glob("*/*.png"))
    return paths, np.array([classes.index(p.parent.name) for p in paths])


def cal_of(bundle: Path) -> dict:
    return json.loads((bundle / "calibration.json").read_text())


def decisions(bundle: Path) -> dict:
    """What a server decides with: the thresholds, Platt parameters and the global threshold."""
    cal = cal_of(bundle)
    return {"global": cal["global"]["threshold"],
            "per_class": [(e["threshold"], e["platt"]["a"], e["platt"]["b"]) for e in cal["per_class"]]}


def test_the_new_bundle_verifies_keeps_the_previous_calibration_and_tampering_is_caught(trained, recalibrated,
                                                                                      capsys, tmp_path):
    from serving.bundle import verify_bundle

    source = trained[1]
    assert verify_bundle(recalibrated) == []
    assert (recalibrated / "calibration.previous.json").read_bytes() == (source / "calibration.json").read_bytes()
    manifest = json.loads((recalibrated / "manifest.json").read_text())
    assert manifest["files"]["calibration.previous.json"]["sha256"] == hashlib.sha256(
        (source / "calibration.json").read_bytes()).hexdigest()
    assert manifest["recalibration"]["images"] == 6 * len(SEEN) and manifest["recalibration"]["classes_kept"] == 2
    main(["verify", str(recalibrated)])
    assert capsys.readouterr().out.startswith("OK ")
    tampered = Path(shutil.copytree(recalibrated, tmp_path / "tampered"))
    cal = cal_of(tampered)
    cal["per_class"][0]["threshold"] -= 1.0
    (tampered / "calibration.json").write_text(json.dumps(cal, indent=1) + "\n")
    problems = verify_bundle(tampered)
    assert any(p.startswith(("calibration.json: sha256", "calibration.json: size")) for p in problems), problems
    with pytest.raises(SystemExit) as exit_:
        main(["verify", str(tampered)])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and ("FAIL calibration.json: sha256" in err or "FAIL calibration.json: size" in err)


def test_the_thresholds_are_the_estimators_on_independently_computed_embeddings(trained, images, recalibrated):
    """Truth 1: our own onnxruntime session on load_image_file arrays -> serving.calibration.calibrate:
    equal. Truth 2: the run's torch module -> the same estimator: equal within float tolerance.
    Classes I, J (no image): the previous entry, untouched."""
    import onnxruntime as ort
    import torch

    from serving.bundle import load_bundle
    from serving.calibration.estimator import calibrate
    from trainer.runs import load_run

    run, source = trained
    b, old, new = load_bundle(source), cal_of(source), cal_of(recalibrated)
    paths, y = files_and_labels(images, list(b.classes))
    x = np.stack([load_image_file(p, b.image) for p in paths])  # [N, 1, 32, 32]
    W, bias = np.asarray(b.weight, np.float64), np.asarray(b.bias, np.float64)
    sess = ort.InferenceSession(str(source / "backbone.onnx"), providers=["CPUExecutionProvider"])
    h_ort = sess.run(None, {"input": x})[0]
    with torch.no_grad():
        h_torch = load_run(run)[0].embed(torch.from_numpy(x)).numpy()
    seen = np.array([c in SEEN for c in b.classes])
    got = np.array([e["threshold"] for e in new["per_class"]])
    for h, exact in ((h_ort, True), (h_torch, False)):
        want = calibrate(h.astype(np.float64) @ W.T + bias, y, old["target"], method=new["method"])
        ref = np.array([e["threshold"] for e in want["per_class"]])
        if exact:
            np.testing.assert_array_equal(got[seen], ref[seen])
            assert new["global"]["threshold"] == want["global"]["threshold"]
        else:
            np.testing.assert_allclose(got[seen], ref[seen], rtol=1e-4, atol=1e-4)
    for j in np.flatnonzero(~seen):
        assert new["per_class"][j] == {**old["per_class"][j], "kept": True}
    assert new["target"] == old["target"] and new["examples"] == len(y)
    # the default --threshold-method norm (checked against a per-column reference in test_threshold_norm.py)
    assert new["method"] == {"name": "norm", "k": 100} and "method_choice" not in new


def test_an_unknown_class_is_one_line_and_exit_2_before_any_image_is_decoded(trained, tmp_path, capsys, monkeypatch):
    import serving.bundle.image

    folder = render(tmp_path / "mine", classes="ABZ", per_class=1)
    (folder / "zz").mkdir()
    Image.new("L", (32, 32)).save(folder / "zz" / "0.png")
    monkeypatch.setattr(serving.bundle.image, "decode_image", lambda *a, **k: pytest.fail("an image was decoded"))
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", str(trained[1]), "--data", f"imagefolder:{folder}", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "'Z', 'zz'" in err and "does not know" in err
    assert not (tmp_path / "out").exists()


def test_the_norm_rule_on_a_single_image_is_one_line_and_exit_2(trained, tmp_path, capsys):
    folder = render(tmp_path / "one", classes="A", per_class=1)
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", str(trained[1]), "--data", f"imagefolder:{folder}", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "at least 2 images" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--out", "{bundle}"], "pass --in-place"),
    ([], "give --out NEW_BUNDLE, or --in-place"),
    (["--out", "{tmp}/b", "--in-place"], "not both"),
    (["--out", "{tmp}/notes"], "is not a bundle written by slc"),
    (["--in-place", "--target-precision", "0.9", "--target-recall", "0.5"], "not both"),
])
def test_output_mistakes_are_one_line_and_exit_2(trained, images, tmp_path, capsys, argv, needle):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    args = [a.format(bundle=trained[1], tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", str(trained[1]), "--data", f"imagefolder:{images}", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_in_place_through_a_symlink_replaces_the_real_bundle_keeps_the_link_and_the_users_files(trained, images,
                                                                                             tmp_path, capsys):
    """The bundle reached through a symlink: the link stays a link, the real folder gets the new calibration
    (the old one kept as calibration.previous.json), a user's file in it stays, nothing is left beside it."""
    from serving.bundle import verify_bundle

    real = tmp_path / "real"
    shutil.copytree(trained[1], real)
    (real / "notes.txt").write_text("mine")
    old = (real / "calibration.json").read_bytes()
    (tmp_path / "link").symlink_to(real)
    main(["calibrate", str(tmp_path / "link"), "--data", f"imagefolder:{images}", "--in-place"])
    capsys.readouterr()
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == str(real)
    assert (real / "calibration.previous.json").read_bytes() == old != (real / "calibration.json").read_bytes()
    assert (real / "notes.txt").read_text() == "mine" and verify_bundle(real) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_with_split_folders_val_is_fitted_test_measured_train_left_out(trained, tmp_path, capsys):
    folder = tmp_path / "splits"
    for split, n in (("train", 2), ("val", 3), ("test", 2)):
        render(folder, per_class=n, split=split)
    main(["calibrate", str(trained[1]), "--data", f"imagefolder:{folder}", "--out", str(tmp_path / "b"),
          "--threshold-method", "cv"])
    out = capsys.readouterr().out
    cal = cal_of(tmp_path / "b")
    assert cal["examples"] == 3 * len(SEEN) and cal["test_examples"] == 2 * len(SEEN)
    # cv: the rule written is the one its record chose (the choice itself is checked against a brute-force
    # cross-validation in tests/serving/calibration/test_choose.py)
    assert cal["method"]["name"] == cal["method_choice"]["chosen"] and len(cal["method_choice"]["candidates"]) == 5
    assert cal["recalibration"]["pooled"]["test"]["images"] == 2 * len(SEEN)
    assert "16 train-split images left out" in out and "on the test images" in out


def test_a_server_on_the_new_bundle_and_one_swapped_in_place_decide_with_the_new_thresholds(
        trained, images, recalibrated, tmp_path):
    """match == (logit >= new threshold) with the logit computed offline (tests/serving/helpers.Offline);
    the in-place swap answers with the old thresholds until the admin route reloads them."""
    from fastapi.testclient import TestClient

    from serving.bundle import load_bundle
    from serving.http.app import create_app
    from tests.serving.helpers import Offline, assert_envelope, make_settings, wait_ready

    b = load_bundle(recalibrated)
    paths, _ = files_and_labels(images, list(b.classes))
    x = np.stack([load_image_file(p, b.image) for p in paths])
    z = Offline(b).logits(x)  # [N, D] float64
    new = np.array([e["threshold"] for e in cal_of(recalibrated)["per_class"]], np.float32)
    old = np.array([e["threshold"] for e in cal_of(trained[1])["per_class"]], np.float32)
    live = Path(shutil.copytree(trained[1], tmp_path / "live"))

    def check(client, thresholds):
        for j in range(b.num_classes):
            got = client.post(f"/v1/classes/{j}/detect", json={"inputs": x.reshape(len(x), -1).tolist()}).json()
            assert got["threshold"] == float(thresholds[j])
            assert [r["match"] for r in got["results"]] == (z[:, j] >= float(thresholds[j])).tolist()

    with TestClient(create_app(make_settings(recalibrated, tmp_path / "a", max_inputs=64))) as client:
        wait_ready(client.get)
        check(client, new)
    with TestClient(create_app(make_settings(live, tmp_path / "b", max_inputs=64, api_key="k"))) as client:
        wait_ready(client.get)
        main(["calibrate", str(live), "--data", f"imagefolder:{images}", "--in-place"])
        assert decisions(live) == decisions(recalibrated)
        check(client, old)
        assert_envelope(client.post("/v1/admin/reload-calibration"), 401, "unauthorized")
        check(client, old)
        r = client.post("/v1/admin/reload-calibration", headers={"authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["reloaded"] is True, r.text
        check(client, new)
    assert not (new == old).all()


def test_it_runs_where_torch_and_scikit_learn_cannot_be_imported(trained, images, recalibrated, tmp_path):
    blocker = tmp_path / "blocker"
    for name in ("torch", "sklearn"):
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(f"raise ModuleNotFoundError('no {name} here', name='{name}')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), str(ROOT)]))
    run = subprocess.run([sys.executable, "-m", "slc", "calibrate", str(trained[1]), "--data", f"imagefolder:{images}",
                          "--out", str(tmp_path / "b")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert "recalibrated 8 classes, kept 2, 48 images" in run.stdout
    assert decisions(tmp_path / "b") == decisions(recalibrated)  # as in this process, where torch is importable


def test_with_one_image_per_class_the_bundles_rule_is_kept_and_said(trained, tmp_path, capsys):
    """Nothing to cross-validate on: cv keeps the bundle's own rule, says so in the
    summary and in calibration.json, and the thresholds are that rule's on these images."""
    import onnxruntime as ort

    from serving.bundle import load_bundle
    from serving.calibration.estimator import calibrate

    folder = render(tmp_path / "one", per_class=1)
    out = tmp_path / "out"
    main(["calibrate", str(trained[1]), "--data", f"imagefolder:{folder}", "--out", str(out), "--threshold-method", "cv"])
    printed = capsys.readouterr().out
    old, new = cal_of(trained[1]), cal_of(out)
    assert new["method"] == old["method"] and new["method_choice"]["candidates"] == []
    assert "no class has 2 images" in printed
    b = load_bundle(out)
    paths, y = files_and_labels(folder, list(b.classes))
    x = np.stack([load_image_file(p, b.image) for p in paths])
    h = ort.InferenceSession(str(out / "backbone.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    want = calibrate(h.astype(np.float64) @ np.asarray(b.weight, np.float64).T + np.asarray(b.bias, np.float64), y,
                     old["target"], method=old["method"])
    seen = np.array([c in SEEN for c in b.classes])
    got = np.array([e["threshold"] for e in new["per_class"]])
    np.testing.assert_array_equal(got[seen], np.array([e["threshold"] for e in want["per_class"]])[seen])


def test_adapted_rows_are_written_with_the_graphs_that_read_them_and_served(trained, images, tmp_path, capsys):
    """--adapt-rows: the new rows equal the per-class reference on onnxruntime embeddings of the files
    (classes without an image keep theirs), the thresholds the dense cross-fitted reference, full.onnx
    gives h·W' + b, the bundle verifies, and a served detect answers with the moved row's logit."""
    from urllib.parse import quote

    from fastapi.testclient import TestClient

    from serving.bundle import load_bundle, ort_session, verify_bundle
    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, wait_ready
    from tests.serving.calibration.test_adapt import reference_rows, reference_thresholds

    source, out = trained[1], tmp_path / "adapted"
    main(["calibrate", str(source), "--data", f"imagefolder:{images}", "--out", str(out), "--adapt-rows",
          "--adapt-step", "0.5", "--no-adapt-keep"])
    assert f"rows of {len(SEEN)} classes moved toward their images, step 0.5" in capsys.readouterr().out
    assert verify_bundle(out) == []
    b0, b1 = load_bundle(source), load_bundle(out)
    paths, y = files_and_labels(images, list(b0.classes))
    x = np.stack([load_image_file(p, b0.image) for p in paths])  # [N, 1, 32, 32]
    h = ort_session(source / "backbone.onnx").run(None, {"input": x})[0].astype(np.float64)
    W0, bias = np.asarray(b0.weight, np.float64), np.asarray(b0.bias, np.float64)
    rows = reference_rows(W0, h, y, 0.5)
    np.testing.assert_allclose(np.asarray(b1.weight, np.float64), rows, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(b1.bias), np.asarray(b0.bias))
    seen = np.array([c in SEEN for c in b0.classes])
    np.testing.assert_array_equal(np.asarray(b1.weight)[~seen], np.asarray(b0.weight)[~seen])
    old, new = cal_of(source), cal_of(out)
    want = reference_thresholds(h, y, W0, bias, 0.5, old["target"])
    got = np.array([e["threshold"] for e in new["per_class"]])
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-5, atol=1e-5)
    assert all(new["per_class"][j] == {**old["per_class"][j], "kept": True} for j in np.flatnonzero(~seen))
    note = json.loads((out / "manifest.json").read_text())["recalibration"]["adapted_rows"]
    assert note["step"] == 0.5 and note["classes"] == len(SEEN) and note["images"] == len(y)
    logits = h @ rows.T + bias  # [N, D]
    full = ort_session(out / "full.onnx").run(None, {"input": x})[0]
    np.testing.assert_allclose(full, logits, rtol=1e-4, atol=1e-4)
    app = create_app(make_settings(out, tmp_path / "serve", max_inputs=64))
    with TestClient(app) as client:
        wait_ready(client.get)
        for i in (0, len(y) // 2, len(y) - 1):
            r = client.post(f"/v1/classes/{quote(b0.classes[y[i]], safe='')}/detect", content=paths[i].read_bytes(),
                            headers={"content-type": "image/png"})
            assert r.status_code == 200, r.text
            assert r.json()["results"][0]["logit"] == pytest.approx(logits[i, y[i]], rel=1e-4, abs=1e-4)


def test_adapted_rows_keep_the_bundles_calibration_examples_by_default(trained, images, tmp_path, capsys):
    """--adapt-rows on a bundle with calibration embeddings: the rows and thresholds are keep.py's on
    onnxruntime embeddings of the files and the bundle's own examples; classes without an image keep theirs."""
    from serving.bundle import load_bundle, ort_session
    from serving.bundle.negatives import read_negatives
    from serving.calibration import keep

    source, out = trained[1], tmp_path / "kept"
    assert read_negatives(source) is not None
    main(["calibrate", str(source), "--data", f"imagefolder:{images}", "--out", str(out), "--adapt-rows",
          "--adapt-step", "0.5"])
    assert "of the bundle's calibration examples kept" in capsys.readouterr().out
    b0, b1 = load_bundle(source), load_bundle(out)
    paths, y = files_and_labels(images, list(b0.classes))
    x = np.stack([load_image_file(p, b0.image) for p in paths])
    h = ort_session(source / "backbone.onnx").run(None, {"input": x})[0]
    old, new = cal_of(source), cal_of(out)
    kept = keep.kept_examples(*read_negatives(source), b0.weight, b0.bias, old["target"])
    rows, want = keep.thresholds(h, y, b0.weight, b0.bias, 0.5, old["target"], kept)
    np.testing.assert_allclose(np.asarray(b1.weight), rows[0:len(b0.classes)], rtol=1e-6, atol=1e-6)
    seen = np.array([c in SEEN for c in b0.classes])
    got = np.array([e["threshold"] for e in new["per_class"]])
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-5, atol=1e-5)
    assert all(new["per_class"][j] == {**old["per_class"][j], "kept": True} for j in np.flatnonzero(~seen))
    note = json.loads((out / "manifest.json").read_text())["recalibration"]["adapted_rows"]
    assert note["kept"]["examples"] == len(kept.y) and note["kept"]["tau"] == pytest.approx(kept.tau)


@pytest.mark.parametrize("args, message", [
    (["--adapt-step", "0.5"], "--adapt-step goes with --adapt-rows"),
    (["--adapt-rows", "--threshold-method", "cv"], "--adapt-rows sets the norm rule's thresholds"),
])
def test_adapt_options_out_of_place_are_one_line_before_any_image_is_read(trained, images, tmp_path, capsys, args,
                                                                        message):
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", str(trained[1]), "--data", f"imagefolder:{images}", "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_a_running_server_refuses_to_reload_adapted_rows_and_keeps_answering_as_before(trained, images, tmp_path,
                                                                                     capsys):
    """--adapt-rows --in-place under a running server: the summary says restart; the reload route answers
    409 bundle_changed; detect keeps the logits and thresholds it had."""
    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from tests.serving.helpers import assert_envelope, make_settings, wait_ready

    live = Path(shutil.copytree(trained[1], tmp_path / "live"))
    body = {"inputs": np.zeros((1, 32 * 32)).tolist()}
    with TestClient(create_app(make_settings(live, tmp_path / "s", max_inputs=64, api_key="k"))) as client:
        wait_ready(client.get)
        before = client.post("/v1/classes/0/detect", json=body).json()
        main(["calibrate", str(live), "--data", f"imagefolder:{images}", "--in-place", "--adapt-rows"])
        assert "restart the servers on it" in capsys.readouterr().out
        r = client.post("/v1/admin/reload-calibration", headers={"authorization": "Bearer k"})
        assert_envelope(r, 409, "bundle_changed")
        assert client.post("/v1/classes/0/detect", json=body).json() == before


def test_adapted_rows_requantize_the_heads_a_bundle_had(trained, images, tmp_path):
    """A bundle with int8 and bf16 heads: after --adapt-rows both are the quantization of the moved rows
    (serving/bundle/quantize.py's own functions on the new float32 rows), and the bundle verifies."""
    from serving.bundle import verify_bundle
    from serving.bundle.quantize import bf16_bits, int8_rows

    source = Path(shutil.copytree(trained[1], tmp_path / "q"))
    main(["bundle", "quantize", str(source), "--precision", "int8,bf16"])
    out = tmp_path / "adapted"
    main(["calibrate", str(source), "--data", f"imagefolder:{images}", "--out", str(out), "--adapt-rows"])
    assert verify_bundle(out) == []
    heads = json.loads((out / "manifest.json").read_text())["heads"]
    new = np.load(out / "head_weight.npy")
    assert not np.array_equal(new, np.load(source / "head_weight.npy"))
    q, scale = int8_rows(new)
    np.testing.assert_array_equal(np.load(out / heads["int8"]["weight"]), q)
    np.testing.assert_array_equal(np.load(out / heads["int8"]["scale"]), scale)
    np.testing.assert_array_equal(np.load(out / heads["bf16"]["weight"]), bf16_bits(new))


def test_the_user_calibration_study_measures_over_http_what_offline_math_gives(trained, images, tmp_path):
    """tools/experiments/user_calibration.measure, PNG bodies through a served bundle, against the
    logits computed offline (tests/serving/helpers.Offline) at the bundle's thresholds: recall, the
    pooled and per-class mean precision (all 10 classes are within its top 20)."""
    import csv

    from fastapi.testclient import TestClient

    from serving.bundle import load_bundle
    from serving.http.app import create_app
    from tests.serving.helpers import Offline, make_settings, wait_ready
    from tools.experiments.user_calibration import measure

    b = load_bundle(trained[1])
    paths, y = files_and_labels(images, list(b.classes))
    listing = tmp_path / "listing.csv"  # absolute paths: read as listing.parent / path
    with open(listing, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "split"])
        w.writerows([str(p), p.parent.name, "test" if i % 3 else "val"]
                    for i, p in enumerate(paths))
    test = np.arange(len(paths)) % 3 > 0
    z = Offline(b).logits(np.stack([load_image_file(p, b.image) for p in paths]))[test]  # [n, D]
    t = np.array([e["threshold"] for e in cal_of(trained[1])["per_class"]], np.float32)
    match = z >= t[None, :]  # [n, D]
    true = match & (y[test][:, None] == np.arange(b.num_classes)[None, :])
    per_class = [tp / m if m else 1.0 for tp, m in zip(true.sum(0), match.sum(0))]
    with TestClient(create_app(make_settings(trained[1], tmp_path / "s", max_inputs=64))) as client:
        wait_ready(client.get)
        got = measure(client, trained[1], listing)
    assert got["images"] == test.sum() and got["recall"] == true.any(1).mean()
    assert got["matches"] == match.sum() and got["true_matches"] == true.sum() > 0
    assert got["precision"] == pytest.approx(true.sum() / match.sum())
    assert got["mean_precision"] == pytest.approx(np.mean(per_class)) and got["unsure_images"] == 0
    assert got["matches"] > got["true_matches"]  # the exported thresholds let false matches through: both precisions tested


def test_the_summary_prints_precision_and_recall_before_and_after(trained, images, tmp_path, capsys):
    """Issue 50: "recall 0.267" alone read like a regression when precision went from 0.667 to 0.970.
    Both figures before → after, against detect's rule applied offline to our own embeddings."""
    import onnxruntime as ort

    from serving.bundle import load_bundle

    source = trained[1]
    main(["calibrate", str(source), "--data", f"imagefolder:{images}", "--out", str(tmp_path / "b")])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("on the images the thresholds"))
    b = load_bundle(source)
    paths, y = files_and_labels(images, list(b.classes))
    x = np.stack([load_image_file(p, b.image) for p in paths])
    h = ort.InferenceSession(str(source / "backbone.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    z = h.astype(np.float64) @ np.asarray(b.weight, np.float64).T + np.asarray(b.bias, np.float64)  # [N, D]

    def rates(cal: dict) -> tuple[float, float]:
        match = z >= np.array([e["threshold"] for e in cal["per_class"]], np.float32).astype(np.float64)
        tp = match[np.arange(len(y)), y]
        return tp.sum() / max(match.sum(), 1), tp.mean()

    (p0, r0), (p1, r1) = rates(cal_of(source)), rates(cal_of(tmp_path / "b"))
    assert f"precision {p0:.3f} → {p1:.3f} [" in line and f"recall {r0:.3f} → {r1:.3f} [" in line, line
    assert line.endswith("; before: the previous thresholds)")
