"""What a small calibration split can show, said by `slc export` and `slc calibrate` (issue 50 part 2,
docs/calibration.md "What the calibration images can show"): on a tiny model of 10 glyph classes
(16 calibration images), the export's default target 0.99 cannot be shown, so both commands print
one line with the trade-off and the command that chooses another target; calibration.json's
`support` equals serving/calibration/support.py on logits computed apart from the export (our own
onnxruntime session), the thresholds are those of the export without it, and `slc verify` accepts
the bundle."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from serving.bundle import load_bundle, verify_bundle
from serving.calibration.chunks import dense_chunks
from serving.calibration.support import support
from slc.cli import main
from tests.trainer.test_imagefolder import render_folder

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("module_home")]  # trains and exports a small model


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from trainer.train import TrainConfig, train

    root = tmp_path_factory.mktemp("support")
    cfg = TrainConfig(dataset=f"imagefolder:{render_folder(root / 'letters')}", backbone="mlp",
                      backbone_params={"hidden": 32}, loss="batch_ce", epochs=8, lr=0.003, batch_size=16, seed=0)
    return train(cfg, root / "run", progress=False)


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_export_says_the_target_cannot_be_shown_and_records_what_can(run, tmp_path, capsys):
    bundle = tmp_path / "bundle"
    main(["export", str(run), "--out", str(bundle)])
    line = _last_line(capsys)
    assert line.startswith("warning: precision 0.99 is not shown by 16 calibration images at 95% confidence")
    sup = json.loads((bundle / "calibration.json").read_text())["support"]
    assert sup["most_shown_precision"] <= 0.05 ** (1 / 16) + 1e-12  # 0.829: 16 true pairs at most
    assert f"(that takes 299 matches with no false one; they show at most {sup['most_shown_precision']:.3f})" in line
    assert sup["images"] == 16 and sup["target_supported"] is False
    if sup["suggested_precision"]:
        assert line.endswith(f"to choose: slc export {run} --out {bundle} --overwrite --target-precision "
                             f"{sup['suggested_precision']:g}")
    else:
        assert line.endswith("more calibration images would show more")
    assert verify_bundle(bundle) == []
    # the same figures from logits of our own: backbone.onnx on the calibration split, the head in float64
    import onnxruntime as ort

    from trainer.data import load_run_data

    b = load_bundle(bundle)
    x, y = load_run_data(json.loads((run / "data.json").read_text())).calibration
    sess = ort.InferenceSession(str(bundle / "backbone.onnx"), providers=["CPUExecutionProvider"])
    h = sess.run(None, {"input": np.asarray(x, dtype=np.float32)})[0].astype(np.float64)
    z = h @ np.asarray(b.weight, np.float64).T + np.asarray(b.bias, np.float64)  # [16, 10]
    want = support(dense_chunks(z, 10), y, 10, {"precision": 0.99})
    assert [e["shown"] for e in sup["tradeoff"]] == [e["shown"] for e in want["tradeoff"]]
    np.testing.assert_allclose([e["recall"] for e in sup["tradeoff"]], [e["recall"] for e in want["tradeoff"]])
    assert sup["most_shown_precision"] == pytest.approx(want["most_shown_precision"], abs=1e-9)


def test_calibrate_says_it_for_its_images_with_its_own_command(run, tmp_path, capsys):
    bundle, out = tmp_path / "bundle", tmp_path / "mine-bundle"
    main(["export", str(run), "--out", str(bundle), "--target-precision", "0.9"])
    capsys.readouterr()
    mine = render_folder(tmp_path / "mine", per_class=3)  # 30 images of the bundle's classes
    main(["calibrate", str(bundle), "--data", f"imagefolder:{mine}", "--out", str(out), "--target-precision", "0.99"])
    line = _last_line(capsys)
    assert line.startswith("warning: precision 0.99 is not shown by 30 calibration images at 95% confidence")
    sup = json.loads((out / "calibration.json").read_text())["support"]
    assert sup["images"] == 30 and sup["target_precision"] == 0.99
    if sup["suggested_precision"]:
        assert line.endswith(f"to choose: slc calibrate {bundle} --data imagefolder:{mine} --out {out} --overwrite "
                             f"--target-precision {sup['suggested_precision']:g}")
    assert verify_bundle(out) == []
