"""Every registered loss learns at thousands of classes (issue 27; docs/losses.md, "Initial head").

2,000 classes of the synthetic `strokes` images (trainer/data/manyclass.py: no font needed), the
glyph backbone (resnet_glyph, small), a short budget (4 epochs of 3-4 images per class, 224 steps)
through the real `trainer.train.train`, Adam 3e-3 for every loss (3e-2 for smooth_topk; the hinge
losses with their many-class option, the exact hinge for the second half). With the head started
where each loss says (zero weights, the bias at the loss's constant optimum) every loss reaches at
least half of ce's calibration accuracy (top-k accuracy for a top-k loss) and 100x chance. With the
bias left at 0 and the default random head (the code before issue 27) bce, nce, lgl_inr and
spherical_softmax fail it (docs/results/many-class-losses.md has the numbers and the commands).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.losses import build_loss, list_losses, loss_class
from trainer.train import TrainConfig, train

# slow tier for now: it landed at the end of a session and has not yet had a clean-clone `make test`
# run of its own; issue 27 wants it in `make test` once it has
pytestmark = pytest.mark.slow

DATASET = "strokes:C=2000,n=6,size=16"
CLASSES = 2000
BACKBONE = {"width": 8, "embed": 128, "pool": 2}
RECIPE = {"epochs": 4, "batch_size": 128, "optimizer": "adam", "lr": 3e-3, "val_every": 0, "restore_best": False}
# docs/losses.md: the hinge losses at many classes take their smooth option, annealed to the exact
# hinge at half of training; smooth_topk's logits are divided by k·tau = 5, so a 10x larger step
SMOOTH_HINGE = {"loss_params": {"tau": 1.0, "anneal": 0.5}}
PER_LOSS = {"max_margin": SMOOTH_HINGE, "batch_max_margin": SMOOTH_HINGE, "smooth_topk": {"lr": 3e-2}}
SHARE_OF_CE = 0.5  # a loss must reach this share of ce's accuracy
MIN_OVER_CHANCE = 100  # and at least this many times chance
ZERO_HEAD_NEEDED = {"spherical_softmax"}  # far below the bar from a random head (docs/losses.md)


def top_k(loss: str) -> int:
    """The k a loss is judged on: its own k for a top-k loss (smooth_topk), else 1."""
    return int(getattr(build_loss(loss, CLASSES), "k", 1))


def accuracy(metrics: dict, k: int) -> float:
    return metrics["accuracy"] if k == 1 else metrics[f"top{k}_accuracy"]


class _Probe:
    """Records whether the trainer read the loss's initial_weight_scale and passed initial_bias a batch size."""

    def __init__(self, cls):
        self.read_scale, self.batch_sizes, scale, bias = False, [], cls.initial_weight_scale, cls.initial_bias
        probe = self

        def read(_self):
            probe.read_scale = True
            return scale

        def initial_bias(_self, num_classes, batch_size=None):
            probe.batch_sizes.append(batch_size)
            return bias(_self, num_classes, batch_size)

        self.patches = {"initial_weight_scale": property(read), "initial_bias": initial_bias}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Loss name -> (calibration metrics, probe) of its run, trained once per session."""
    cache: dict[str, tuple[dict, _Probe]] = {}

    def run(loss: str) -> tuple[dict, _Probe]:
        if loss not in cache:
            cls = loss_class(loss)
            probe = _Probe(cls)
            cfg = TrainConfig(dataset=DATASET, backbone="resnet_glyph", backbone_params=BACKBONE, loss=loss,
                              **{**RECIPE, **PER_LOSS.get(loss, {})})
            with pytest.MonkeyPatch.context() as mp:
                for name, value in probe.patches.items():
                    mp.setattr(cls, name, value)
                out = train(cfg, tmp_path_factory.mktemp(loss), progress=False)
            cache[loss] = json.loads((out / "metrics.json").read_text())["calibration"], probe
        return cache[loss]

    return run


@pytest.mark.parametrize("loss", [name for name in list_losses() if not name.startswith("_")])
def test_every_loss_leaves_chance_at_2000_classes(runs, loss):
    k = top_k(loss)
    ce = accuracy(runs("ce")[0], k)
    metrics, probe = runs(loss)
    got, chance = accuracy(metrics, k), k / CLASSES
    assert ce > 0.15, f"ce itself only reached {ce:.3f} top-{k} accuracy: the task or the recipe broke"
    passed = got >= MIN_OVER_CHANCE * chance and got >= SHARE_OF_CE * ce
    if not passed and loss in ZERO_HEAD_NEEDED and not probe.read_scale:
        pytest.xfail(f"{loss} needs a zero head and trainer.train does not apply initial_weight_scale yet")
    if not passed and loss == "lgl_inr" and not any(probe.batch_sizes):
        pytest.xfail("lgl_inr's bias needs the batch size, which trainer.train does not pass to initial_bias yet")
    assert got >= MIN_OVER_CHANCE * chance, f"{loss}: top-{k} accuracy {got:.4f}, chance {chance:.4f}"
    assert got >= SHARE_OF_CE * ce, f"{loss}: top-{k} accuracy {got:.4f} < {SHARE_OF_CE} x ce's {ce:.4f}"


# ---------------------------------------------------------------- the strokes data set itself
def test_strokes_are_seeded_distinct_and_split():
    from trainer.data import check_dataset_name, load_dataset, manyclass

    x, y = manyclass.generate(40, 5, 12, seed=3)
    x2, _ = manyclass.generate(40, 5, 12, seed=3)
    assert x.shape == (200, 1, 12, 12) and x.dtype == np.uint8 and np.array_equal(x, x2)
    assert not np.array_equal(x, manyclass.generate(40, 5, 12, seed=4)[0])
    assert np.array_equal(np.bincount(y), np.full(40, 5))
    shapes = manyclass.templates(500, np.random.default_rng(0))  # [500, 4, 2, 2]
    assert len({np.round(s, 6).tobytes() for s in shapes}) == 500  # every class its own stroke set
    splits = load_dataset("strokes:C=30,n=5,size=12")
    assert splits.num_classes == 30 and splits.input_shape == (1, 12, 12)
    assert [len(splits.split(s)[1]) for s in ("train", "calibration", "test")] == [90, 30, 30]
    for bad in ("strokes:C=1", "strokes:k=3", "strokes:C=x", "strokes:size=4"):
        with pytest.raises(ValueError):
            check_dataset_name(bad)
