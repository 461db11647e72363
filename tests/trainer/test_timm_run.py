"""A pretrained-style timm backbone end to end on a user's RGB images: trained through the recipe,
exported, and the bundle's graphs on the decoded files equal the trained torch model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a timm export takes about a minute on 2 cores


def _rgb_folder(root: Path, classes: int = 4, per_class: int = 10) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        colour = rng.integers(0, 255, 3)
        for i in range(per_class):
            pixels = np.clip(colour + rng.normal(0, 25, (40, 48, 3)), 0, 255).astype(np.uint8)
            (root / f"class{c}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels, "RGB").save(root / f"class{c}" / f"{i}.png")
    return root


def test_timm_backbone_trains_on_rgb_files_and_exports_their_logits(tmp_path, monkeypatch):
    import onnxruntime as ort

    from serving.bundle.image import load_image_file
    from trainer.export import export_bundle
    from trainer.train import TrainConfig, train
    from trainer.runs import load_run

    monkeypatch.setenv("SLC_HOME", str(tmp_path / "home"))
    folder = _rgb_folder(tmp_path / "photos")
    cfg = TrainConfig(dataset=f"imagefolder:{folder}", backbone="timm:test_efficientnet", loss="ce", epochs=1,
                      batch_size=8, lr=1e-3, image={"height": 32, "width": 32})
    run = train(cfg, tmp_path / "run", progress=False)
    data = json.loads((run / "data.json").read_text())
    assert data["image"]["channels"] == 3 and np.asarray(data["mean"]).shape == (3, 1, 1)
    bundle = export_bundle(run, tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["image"]["channels"] == 3

    model, _, _ = load_run(run)
    files = sorted(folder.glob("class*/*.png"))[:6]
    x = np.stack([load_image_file(f, manifest["image"]) for f in files])  # [6, 3, 32, 32]
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    got = ort.InferenceSession(str(bundle / "full.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
