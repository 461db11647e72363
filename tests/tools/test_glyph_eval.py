"""tools/experiments/glyph_eval.py against dense float64 references: the streamed normalized-CE scores
against scipy's log_softmax, the user-view metrics against slc_metrics of the model's logits, the
detect rates against serving.calibration.calibrate on the dense logits."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax

from serving.calibration.estimator import calibrate
from trainer.data import load_dataset
from tools.experiments.glyph_eval import DETECT_TARGET, embed, evaluate, normalized_chunks
from trainer.metrics import slc_metrics
from trainer.train import TrainConfig, train
from trainer.runs import load_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = TrainConfig(dataset="digits", backbone="mlp", backbone_params={"hidden": 16}, loss="ce", epochs=2, lr=0.01)
    return train(cfg, tmp_path_factory.mktemp("run") / "run", progress=False)


@pytest.mark.parametrize("chunk", [1, 3, 512])
def test_normalized_chunks_are_log_softmax_over_all_classes(chunk):
    rng = np.random.default_rng(0)
    h, w, b = rng.normal(size=(20, 5)), rng.normal(size=(7, 5)), rng.normal(size=7)
    got = np.concatenate([z for _, z in normalized_chunks(h, w, b, chunk)()], axis=1)  # [20, 7]
    assert np.allclose(got, log_softmax(h @ w.T + b, axis=1), atol=1e-12)


def test_evaluate_matches_dense_references(run):
    splits = load_dataset("digits")
    x_view, y_view = splits.test[0][::-1].copy(), splits.test[1][::-1].copy()  # a "view": the test split reversed
    out = evaluate(run, splits, {"test_small": (x_view, y_view)}, normalized=True)
    model = load_run(run)[0]
    w, b = (p.detach().double().numpy() for p in (model.head.weight, model.head.bias))

    def logits(x):
        return embed(model, x) @ w.T + b  # [N, D] float64

    view = slc_metrics(logits(x_view), y_view)
    for key, value in view.items():
        assert out["views"]["test_small"][key] == pytest.approx(value, abs=1e-9), key
    norm = slc_metrics(log_softmax(logits(splits.test[0]), axis=1), splits.test[1])
    for key, value in norm.items():
        assert out["normalized"]["test"][key] == pytest.approx(value, abs=1e-9), key
    dense = calibrate(logits(splits.calibration[0]), splits.calibration[1], DETECT_TARGET,
                      logits(splits.test[0]), splits.test[1])
    assert out["detect"]["test"]["per_class_mean_recall"] == pytest.approx(dense["summary"]["test"]["per_class_mean_recall"])
    assert out["detect"]["test"]["calibration_recall"] == pytest.approx(dense["summary"]["per_class_mean_recall"])


def test_evaluate_is_computed_once(run):
    splits = load_dataset("digits")
    first = evaluate(run, splits, {}, normalized=False)
    (run / "glyph_eval.json").write_text((run / "glyph_eval.json").read_text().replace('"version": 1', '"version": 1, "seen": 1'))
    assert evaluate(run, splits, {}, normalized=False).get("seen") == 1 and "views" in first
