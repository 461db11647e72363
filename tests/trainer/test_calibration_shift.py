"""Export's calibration on style-shifted copies (trainer/calibration_shift.py): when it applies, what it
draws, and that the exported thresholds are the estimator's on the clean and shifted logits pooled."""
from __future__ import annotations

import json

import numpy as np
import pytest

from serving.calibration.defaults import NORM_MIN_NEGATIVES, default_rule, norm_has_tail
import torch

from trainer import calibration_shift as shift
from trainer import export as export_mod

CHW = {"height": 16, "width": 16, "channels": 1, "layout": "CHW", "scale": 1.0, "background": "dark"}


def test_auto_shifts_a_pols_loss_on_images_only():
    assert shift.resolve("auto", True, (1, 16, 16), CHW) == "style"
    assert shift.resolve("auto", False, (1, 16, 16), CHW) == "none"  # ce keeps shrink on the clean split
    assert shift.resolve("auto", True, (64,), {**CHW, "layout": "flat"}) == "none"
    assert shift.resolve("auto", True, (8,), None) == "none"
    assert shift.resolve("none", True, (1, 16, 16), CHW) == "none"
    assert shift.resolve("style", False, (1, 16, 16), CHW) == "style"
    with pytest.raises(ValueError, match="needs an image dataset laid out"):
        shift.resolve("style", True, (64,), None)
    with pytest.raises(ValueError, match="unknown calibration shift"):
        shift.resolve("blur", True, (1, 16, 16), CHW)


def test_default_method_follows_the_shift():
    assert default_rule(True, "style") == {"name": "norm"}
    assert default_rule(True, "none") == {"name": "global"}
    assert default_rule(False, "style") == {"name": "shrink", "kappa": 4.0}


def test_norm_needs_a_tail_in_every_column():
    """A column's negatives are the other classes' examples (each shifted copy counted): counted by hand."""
    assert NORM_MIN_NEGATIVES == 400
    y = np.repeat(np.arange(10), 6)  # issue 50's calibration split: 60 images, 54 negatives a column
    assert not norm_has_tail(y, 10, copies=2)  # 108
    assert norm_has_tail(np.repeat(np.arange(10), 23), 10, copies=2)  # 2 x (230 - 23) = 414
    assert not norm_has_tail(np.repeat(np.arange(10), 22), 10, copies=2)  # 2 x 198 = 396
    assert norm_has_tail(np.repeat(np.arange(10), 45), 10)  # 450 - 45 = 405, no copies
    lopsided = np.concatenate([np.zeros(300, dtype=int), np.repeat(np.arange(1, 10), 20)])  # 480 images
    assert not norm_has_tail(lopsided, 10)  # class 0's column: 180 negatives
    assert norm_has_tail(lopsided, 10, copies=3)  # 540
    assert norm_has_tail(np.repeat(np.arange(3), 1000), 4000)  # columns of 2000, of 3000 for classes without examples
    assert not norm_has_tail(np.repeat(np.arange(2), [3000, 300]), 2)  # class 0's column: 300


def _glyph_like(n: int = 12, seed: int = 0) -> np.ndarray:
    """[n, 1, 16, 16] uint8: light bars on a dark background."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, 1, 16, 16), dtype=np.uint8)
    for i in range(n):
        r, c = rng.integers(3, 12, 2)
        x[i, 0, r:r + 3, 2:14] = 255
        x[i, 0, 2:14, c:c + 2] = 200
    return x


def test_shifted_copies_are_seeded_whole_pixels_of_the_same_shape():
    x = _glyph_like()
    a, b = shift.style_shifted(x, CHW), shift.style_shifted(x, CHW)
    assert a.shape == x.shape and a.dtype == x.dtype
    np.testing.assert_array_equal(a, b)  # seeded
    assert not np.array_equal(a, shift.style_shifted(x, CHW, seed=1))
    assert not np.array_equal(a, x)
    # in the input's units: pixel x scale, the pixel a whole number in 0..255
    scaled = x.astype(np.float32) * (16 / 255)
    s = shift.style_shifted(scaled, {**CHW, "scale": 16 / 255})
    pixels = s / (16 / 255)
    np.testing.assert_allclose(pixels, np.rint(pixels), atol=1e-3)
    assert pixels.min() >= -1e-3 and pixels.max() <= 255 + 1e-3
    np.testing.assert_allclose(pixels, a.astype(np.float32), atol=1e-3)  # the same draws whatever the scale


def test_shifted_copies_keep_each_image_mass_where_the_strokes_are():
    """Stroke weight, blur and contrast move ink by at most a pixel or two: above its background (which
    lower contrast lifts evenly), the shifted image's ink stays on or next to the drawn strokes."""
    x = _glyph_like(64)
    s = shift.style_shifted(x, CHW).astype(np.float64)
    s -= s.min(axis=(1, 2, 3), keepdims=True)  # the background lift
    near = torch.nn.functional.max_pool2d(torch.tensor(x, dtype=torch.float32), 7, 1, 3).numpy() > 0  # [n, 1, 16, 16]
    assert (s * near).sum() / s.sum() > 0.99


@pytest.mark.integration
def test_export_calibrates_a_pols_image_run_on_clean_and_shifted_copies(tmp_path, monkeypatch, capsys):
    """Export of a PoLS run on images with the style shift: norm thresholds equal to the dense estimator
    on the torch model's logits of the calibration split and its shifted copy pooled; `none` gives the
    clean split's global threshold, and so does the default on a split too small for the norm rule
    (this one: 16 images); style on examples that are not images is one line."""
    from slc.cli import main
    from tests.trainer.test_imagefolder import render_folder
    from serving.calibration.estimator import calibrate
    from trainer.data import load_run_data
    from trainer.train import TrainConfig, train
    from trainer.runs import load_run, run_logits

    monkeypatch.setenv("SLC_HOME", str(tmp_path / "home"))
    folder = render_folder(tmp_path / "letters")
    cfg = TrainConfig(dataset=f"imagefolder:{folder}", backbone="mlp", backbone_params={"hidden": 32},
                      loss="batch_ce", epochs=3, lr=0.003, batch_size=16, seed=0)
    run = train(cfg, tmp_path / "run", progress=False)
    net, _, info = load_run(run)
    splits = load_run_data(info, progress=False)
    x, y = splits.calibration
    both = np.concatenate([run_logits(net, x), run_logits(net, shift.style_shifted(x, splits.image))]).astype(np.float64)
    yy = np.concatenate([y, y])

    bundle = export_mod.export_bundle(run, tmp_path / "b", target_precision=0.9, shift="style")
    cal = json.loads((bundle / "calibration.json").read_text())
    assert cal["method"]["name"] == "norm" and cal["examples"] == 2 * len(y) and "default_rule" not in cal
    assert cal["shift"] == {"name": "style", "seed": shift.SHIFT_SEED, "images": len(y), "what": cal["shift"]["what"]}
    want = calibrate(both, yy, {"precision": 0.9}, method=cal["method"])
    np.testing.assert_allclose([e["threshold"] for e in cal["per_class"]],
                               [e["threshold"] for e in want["per_class"]], rtol=1e-4, atol=1e-4)
    # the global threshold (enrolled classes use it) is the clean split's, not the pooled shifted one's
    clean = calibrate(run_logits(net, x).astype(np.float64), y, {"precision": 0.9}, method={"name": "global"})
    assert cal["global"]["threshold"] == pytest.approx(clean["global"]["threshold"], rel=1e-4, abs=1e-4)
    assert abs(want["global"]["threshold"] - clean["global"]["threshold"]) > 1e-3  # the two differ here
    assert cal["global"]["fitted_on"] == "the calibration split alone"
    assert cal["summary"]["global_threshold_per_class_mean_recall"] == pytest.approx(
        clean["summary"]["global_threshold_per_class_mean_recall"], abs=1e-6)

    asked = export_mod.export_bundle(run, tmp_path / "g", target_precision=0.9, method={"name": "global"})
    cal = json.loads((asked / "calibration.json").read_text())  # global asked for: pooled over both copies
    assert cal["shift"]["images"] == len(y) and "fitted_on" not in cal["global"]
    assert cal["global"]["threshold"] == pytest.approx(want["global"]["threshold"], rel=1e-4, abs=1e-4)

    plain = export_mod.export_bundle(run, tmp_path / "p", target_precision=0.9, shift="none")
    cal = json.loads((plain / "calibration.json").read_text())
    assert cal["method"] == {"name": "global"} and "shift" not in cal and cal["examples"] == len(y)
    want = calibrate(run_logits(net, x).astype(np.float64), y, {"precision": 0.9}, method={"name": "global"})
    assert cal["global"]["threshold"] == pytest.approx(want["global"]["threshold"], rel=1e-4, abs=1e-4)

    small = export_mod.export_bundle(run, tmp_path / "a", target_precision=0.9)  # rule and shift chosen by export
    auto = json.loads((small / "calibration.json").read_text())
    fewest = 2 * (len(y) - np.bincount(y).max())  # the largest class's column, shifted copies counted
    assert fewest < NORM_MIN_NEGATIVES
    assert auto["method"] == {"name": "shrink", "kappa": 4.0} and "shift" not in auto and auto["examples"] == len(y)
    assert auto["default_rule"]["rule"] == auto["method"] and auto["default_rule"]["why"].startswith(f"{fewest} negatives")
    want = calibrate(run_logits(net, x).astype(np.float64), y, {"precision": 0.9}, method=auto["method"])
    np.testing.assert_allclose([e["threshold"] for e in auto["per_class"]],
                               [e["threshold"] for e in want["per_class"]], rtol=1e-4, atol=1e-4)
    assert auto["global"]["threshold"] == pytest.approx(cal["global"]["threshold"], rel=1e-6)  # enrolled classes'

    digits = train(TrainConfig(dataset="digits", backbone="linear", loss="batch_ce", epochs=1, lr=0.01),
                   tmp_path / "digits", progress=False)
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(digits), "--out", str(tmp_path / "d"), "--calibration-shift", "style"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "needs an image dataset laid out" in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and not (tmp_path / "d").exists()
