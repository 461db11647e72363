"""The chain on glyphs-latin, measured through HTTP: train → export → serve, then the test split
sent to the server. Top-1 from /v1/topk equals the run's offline accuracy; for every class,
detect's matches over the whole test split give exactly the per-class test precision and
recall that export computed offline at the same thresholds; and the test images sent as PNG
are answered as their tensors."""
from __future__ import annotations

import io
import json
from urllib.parse import quote

import numpy as np
import pytest
from PIL import Image

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # about a minute of training, then 280 requests


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, wait_ready
    from trainer.data import load_dataset
    from trainer.export import export_bundle
    from trainer.train import TrainConfig, train

    tmp = tmp_path_factory.mktemp("glyphs-served")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLC_HOME", str(tmp / "home"))
        cfg = TrainConfig(dataset="glyphs-latin", backbone="resnet_glyph", backbone_params={"width": 4, "embed": 32},
                          loss="batch_ce", epochs=2, lr=0.01, batch_size=128, seed=0)
        run = train(cfg, tmp / "run", progress=False)
        bundle = export_bundle(run, tmp / "bundle", target_precision=0.9)
        splits = load_dataset("glyphs-latin")
    app = create_app(make_settings(bundle, tmp, max_inputs=512))
    with TestClient(app) as client:
        wait_ready(client.get)
        yield client, run, bundle, splits


def test_top1_over_http_is_the_offline_accuracy(served):
    client, run, _, splits = served
    x, y = splits.test
    top1 = []
    for i in range(0, len(y), 256):
        r = client.post("/v1/topk", json={"inputs": np.asarray(x[i:i + 256], np.float32).tolist(), "k": 1})
        assert r.status_code == 200, r.text
        top1 += [row[0]["class_id"] for row in r.json()["results"]]
    offline = json.loads((run / "metrics.json").read_text())["test"]["accuracy"]
    assert abs(np.mean(np.array(top1) == y) - offline) < 1e-12


def test_detect_over_http_gives_the_offline_per_class_test_precision_and_recall(served):
    """Exact for every class whose test logits keep clear of its threshold (torch, which export
    measured with, and onnxruntime, which serves, differ in the last float32 bits); the few
    classes with a logit within 1e-4 of the threshold may flip that one decision."""
    from trainer.runs import load_run, run_logits

    client, run, bundle, splits = served
    x, y = splits.test
    inputs = np.asarray(x, np.float32).tolist()
    per_class = json.loads((bundle / "calibration.json").read_text())["per_class"]
    names = json.loads((bundle / "manifest.json").read_text())["classes"]  # the characters; "0" is not id 0
    offline = run_logits(load_run(run)[0], x).astype(np.float64)  # [N, D] torch
    borderline, checked = [], 0
    for j, entry in enumerate(per_class):
        match, logits = [], []
        for i in range(0, len(y), 256):
            r = client.post(f"/v1/classes/{quote(names[j], safe='')}/detect", json={"inputs": inputs[i:i + 256]})
            assert r.json()["class_id"] == j
            match += [res["match"] for res in r.json()["results"]]
            logits += [res["logit"] for res in r.json()["results"]]
        np.testing.assert_allclose(logits, offline[:, j], rtol=1e-4, atol=1e-4)
        if np.any(np.abs(offline[:, j] - entry["threshold"]) <= 1e-4 * max(1.0, abs(entry["threshold"]))):
            borderline.append(j)
            continue
        match, positive = np.array(match), y == j
        tp = int((match & positive).sum())
        precision = tp / match.sum() if match.any() else 1.0
        recall = tp / positive.sum() if positive.any() else 0.0
        assert (precision, recall) == pytest.approx((entry["test"]["precision"], entry["test"]["recall"]), abs=1e-12), j
        checked += 1
    assert len(borderline) <= 0.1 * len(per_class) and checked > 0, borderline


def test_test_images_sent_as_png_are_answered_as_their_tensors(served):
    client, _, _, splits = served
    x, _ = splits.test
    for example in x[:5]:
        buf = io.BytesIO()
        Image.fromarray(np.asarray(example)[0]).save(buf, format="PNG")
        by_image = client.post("/v1/classes/A/detect", content=buf.getvalue(), headers={"content-type": "image/png"})
        by_json = client.post("/v1/classes/A/detect", json={"inputs": [np.asarray(example, np.float32).tolist()]})
        assert by_image.json() == by_json.json()
