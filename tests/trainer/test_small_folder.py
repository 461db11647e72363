"""Defaults that learn on a small folder (issue 37 part 5, docs/training.md "Defaults on small data").

A new user's folder, 12 letters x 24 PNGs of six DejaVu faces (tools/small_folder.py), trained by
`slc train --dataset imagefolder:DIR --out RUN` and nothing else: the rule of trainer/defaults.py
resolves the batch, the epochs (below 1,024 examples a budget the run stops within by patience:
issue 50, tests/trainer/test_convergence.py), the validation cadence and the patience from the
training split's size, config.json records it, the run learns and says it converged. Explicit
--batch-size / --epochs are kept as given, and a run too short to converge says so in one line.
The rule itself is checked on sizes alone, including digits' (which it must leave at batch 128,
20 epochs, no patience).

The accuracy bound is 0.85, not the issue's 0.9: measured (docs/results/small-folder.md), this
run gives 0.914 on one torch thread (53 of the 58 test images) and 0.897 on two; other seeds and
folders gave 0.897-0.931. 0.9 is one image from failing, so the bound keeps 3-4 images of margin
for other CPUs' rounding, and is still far above the old defaults' 0.57 and 0.67 (20 steps).
Trained to convergence (issue 50) the run gives 0.931 (54 of 58), stopped by patience after 300
of its 600 budget steps: about 260 s on one busy thread, where the 200 fixed steps took 80-100 s.
Since an image folder is augmented by default (geometry, the whole budget: docs/results/small-folder-aims.md)
the default run takes 10-15 minutes on a busy core: it is `slow`; the same run with --augment none
(patience) stays in the quick suite.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tools.small_folder import missing_fonts, render
from trainer import defaults
from trainer.defaults import resolve_defaults, short_run_warning
from trainer.train import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(bool(missing_fonts()), reason=f"DejaVu fonts missing: {missing_fonts()}")


def _docs_rule(n: int) -> tuple[int, int, int, int]:
    """(batch, epochs, val_every, patience) as docs/training.md states the rule, written out
    independently: below 1,024 examples the epochs are a budget of 3 times, every epoch validated,
    a patience of 10 validations and at least 100 steps ("Training to convergence")."""
    batch = next(b for b in (128, 64, 32, 16) if n // b >= 8 or b == 16)
    batch = min(batch, n)
    epochs = max(20, math.ceil(150 / (n // batch)))
    if n < 1024:
        return batch, 3 * epochs, 1, max(10, math.ceil(100 / (n // batch)))
    val_every = math.ceil(epochs / 20)
    return batch, math.ceil(epochs / val_every) * val_every, val_every, 0


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("home")
    return {**os.environ, "SLC_HOME": str(home), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("pngs") / "letters", seed=0)


def _train(env: dict, folder: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "slc", "train", "--dataset", f"imagefolder:{folder}", *args,
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def _read(run: Path, name: str) -> dict:
    return json.loads((run / name).read_text())


def _check_default_run(env: dict, folder: Path, run: Path, *args: str) -> None:
    """Test accuracy >= 0.85, the batch, budget, patience and augmentation the docs' rule gives for the
    training split's size (augmented: the whole budget), recorded as the rule's, no warning in the output."""
    r = _train(env, folder, run, *args)
    config, sizes = _read(run, "config.json"), _read(run, "data.json")["sizes"]
    batch, epochs, val_every, patience = _docs_rule(sizes["train"])
    augment = "none" if args else "geometry"  # an image folder trained to convergence: geometry by default
    patience = 0 if augment != "none" else patience
    assert (config["batch_size"], config["epochs"], config["val_every"], config["patience"], config["augment"]) == \
        (batch, epochs, val_every, patience, augment)
    assert config["steps"] == epochs * (sizes["train"] // batch) >= defaults.MIN_STEPS
    by_rule = {"batch_size": batch, "epochs": epochs, "val_every": val_every, "patience": patience, "augment": augment}
    given = {"augment": "none"} if args else {}
    assert config["defaults"]["by_rule"] == {k: v for k, v in by_rule.items() if k not in given}
    assert config["defaults"]["given"] == given and config["defaults"]["n_train"] == sizes["train"]
    assert _read(run, "metrics.json")["test"]["accuracy"] >= 0.85  # measured 0.914-0.931: the module docstring
    assert "warning" not in r.stdout + r.stderr, r.stdout
    assert config["convergence"]["converged"] and "\nconverged: " in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_defaults_learn_a_small_folder_and_say_what_they_chose(env, folder, tmp_path):
    """Nothing but --dataset and --out: geometry augmentation and the whole budget of 600 steps (10-15
    minutes on one busy core: make test-all)."""
    _check_default_run(env, folder, tmp_path / "run")


def test_unaugmented_the_defaults_stop_by_patience(env, folder, tmp_path):
    """--augment none (the default before issue 50's margin): patience 10, stopped before the budget."""
    _check_default_run(env, folder, tmp_path / "run", "--augment", "none")


def test_explicit_batch_and_epochs_are_kept_and_a_short_run_is_warned(env, folder, tmp_path):
    """--batch-size 128 --epochs 2 (the old default batch, a few epochs): exactly those, one step an
    epoch as before the rule, recorded as given; the summary's last line says the run is too short."""
    run = tmp_path / "short"
    r = _train(env, folder, run, "--batch-size", "128", "--epochs", "2")
    config, n = _read(run, "config.json"), _read(run, "data.json")["sizes"]["train"]
    assert (config["batch_size"], config["epochs"], config["steps"]) == (128, 2, 2 * (n // 128))
    assert config["defaults"]["given"] == {"batch_size": 128, "epochs": 2}
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"warning: only {config['steps']} optimizer steps"), r.stdout


@pytest.mark.parametrize("n", [20, 72, 172, 300, 1023, 1024, 5000])
def test_the_rule_is_what_the_docs_say(n):
    cfg, record = resolve_defaults(TrainConfig(dataset="x"), n)
    assert (cfg.batch_size, cfg.epochs, cfg.val_every, cfg.patience) == _docs_rule(n)
    assert record["given"] == {} and set(record["by_rule"]) == {"batch_size", "epochs", "val_every", "patience",
                                                                "augment"}


def test_digits_keeps_batch_128_and_20_epochs():
    """The built-in dataset with about a thousand training examples: what it did before the rule."""
    from trainer.data import load_dataset

    cfg, _ = resolve_defaults(TrainConfig(dataset="digits"), len(load_dataset("digits").train[1]))
    assert (cfg.batch_size, cfg.epochs, cfg.val_every, cfg.patience, cfg.converge) == (128, 20, 1, 0, False)


def test_a_small_image_folder_trained_to_convergence_is_augmented_by_default():
    """geometry (scale, shift, rotation) for imagefolder:DIR under the small-data rule (docs/training.md,
    "Defaults on small data"; measured: docs/results/small-folder-aims.md); nothing else changes:
    built-in datasets, other data, a run of given epochs and 1,024 examples or more keep none, and a
    given --augment wins."""
    folder = TrainConfig(dataset="imagefolder:/some/dir")
    cfg, record = resolve_defaults(folder, 180)
    assert cfg.augment == defaults.SMALL_FOLDER_AUGMENT == "geometry" and record["by_rule"]["augment"] == "geometry"
    assert (cfg.batch_size, cfg.epochs, cfg.val_every, cfg.patience, cfg.converge) == (16, 60, 1, 0, True)  # whole budget
    cfg, record = resolve_defaults(replace(folder, patience=10), 180)  # a given patience still stops it
    assert (cfg.augment, cfg.patience) == ("geometry", 10) and record["given"] == {"patience": 10}
    cfg, _ = resolve_defaults(replace(folder, augment="none"), 180)  # not augmented: patience as before
    assert cfg.patience == 10
    for given, n in ((replace(folder, epochs=30), 180), (folder, 1024), (folder, 5000),
                     (TrainConfig(dataset="digits"), 1078), (TrainConfig(dataset="glyphs-latin"), 180),
                     (TrainConfig(dataset="csv:/some/file.csv"), 180), (TrainConfig(dataset="x"), 180)):
        cfg, record = resolve_defaults(given, n)
        assert cfg.augment == "none" and record["by_rule"]["augment"] == "none", (given.dataset, given.epochs, n)
    for augment in ("none", "elastic"):
        cfg, record = resolve_defaults(replace(folder, augment=augment), 180)
        assert cfg.augment == augment and record["given"]["augment"] == augment and "augment" not in record["by_rule"]


def test_given_values_win_and_a_budget_turns_the_step_floor_off():
    base = TrainConfig(dataset="x")
    cfg, record = resolve_defaults(replace(base, batch_size=128, epochs=2, val_every=1), 172)
    assert (cfg.batch_size, cfg.epochs, cfg.val_every) == (128, 2, 1)
    assert record["by_rule"] == {"patience": 0, "augment": "none"}
    cfg, _ = resolve_defaults(replace(base, batch_size=128, epochs=None, val_every=None), 5000)  # past 20 epochs
    assert (cfg.batch_size, cfg.epochs, cfg.val_every) == (128, 20, 1)
    cfg, _ = resolve_defaults(replace(base, batch_size=128), 172)  # one step an epoch: a budget of 3 x 150 epochs
    assert cfg.batch_size == 128 and cfg.val_every == 1 and cfg.epochs == 450 and cfg.patience == 100
    cfg, _ = resolve_defaults(replace(base, batch_size=128, epochs=150), 172)  # epochs given: validated 20 times
    assert cfg.val_every == 8 and cfg.epochs == 150 and cfg.patience == 0
    cfg, _ = resolve_defaults(replace(base, max_steps=40), 172)  # the budget in steps
    assert (cfg.batch_size, cfg.epochs) == (16, 4)
    cfg, _ = resolve_defaults(base, 172, world=16)  # every rank gets 2 examples
    assert cfg.batch_size == 32


def test_short_run_warning_criterion():
    assert short_run_warning(defaults.MIN_STEPS - 1, [0.9] * 10).startswith("warning: only 149 optimizer steps")
    assert short_run_warning(defaults.MIN_STEPS - 1, [0.5], stopped_early=True) is None
    assert short_run_warning(200, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9]).startswith("warning: calibration accuracy")
    assert short_run_warning(200, [0.1, 0.5, 0.8, 0.85, 0.88, 0.9, 0.9, 0.92]) is None  # +0.04 at the end
    assert short_run_warning(200, [0.1, 0.9]) is None  # too few validations to say
