"""Training to convergence (issue 50 part 1, docs/training.md "Training to convergence"): with
--epochs left unset on small data the epochs are a budget, every epoch is validated, and the run
stops when the calibration accuracy has not improved for a patience, keeping the latest weights
within one calibration image of the best; its summary says whether it converged. On a small folder
of PNGs (render_folder): a run that stops by patience, checked against its own history.csv, and a
budget that runs out while the accuracy still rises, said in one line with what to raise. The
rule's sizes and the verdict are checked on numbers alone."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from trainer import defaults
from trainer.defaults import convergence, convergence_line, resolve_defaults
from trainer.train import TrainConfig, train
from tests.trainer.test_imagefolder import render_folder

pytestmark = pytest.mark.usefixtures("module_home")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return render_folder(tmp_path_factory.mktemp("pngs") / "letters")  # 10 classes x 8: 48 train, 16 calibration


def _cfg(folder: Path, **kw) -> TrainConfig:
    kw.setdefault("augment", "none")  # the stopping rules on plain batches (a small folder's default is geometry)
    return TrainConfig(dataset=f"imagefolder:{folder}", backbone="mlp", backbone_params={"hidden": 32},
                       loss="batch_ce", lr=0.01, seed=0, **kw)


def _validations(run: Path) -> list[dict]:
    with open(run / "history.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["kind"] == "epoch"]


def _config(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


@pytest.mark.parametrize("n, batch, epochs, patience", [(48, 16, 150, 34), (180, 16, 60, 10), (300, 32, 60, 12),
                                                        (1023, 64, 60, 10)])
def test_small_data_with_no_epochs_gets_a_budget_every_epoch_validated_and_a_patience(n, batch, epochs, patience):
    cfg, record = resolve_defaults(TrainConfig(dataset="x"), n)
    spe = n // batch
    assert (cfg.batch_size, cfg.epochs, cfg.val_every, cfg.patience, cfg.converge) == (batch, epochs, 1, patience, True)
    assert epochs == defaults.BUDGET_FACTOR * max(20, -(-150 // spe)) and patience == max(10, -(-100 // spe))
    assert record["stopping"] == "converge" and record["given"] == {}


def test_given_epochs_and_large_data_keep_the_fixed_recipe():
    for cfg, n in ((TrainConfig(dataset="x", epochs=30), 180), (TrainConfig(dataset="x"), 1024),
                   (TrainConfig(dataset="x"), 5000)):
        got, record = resolve_defaults(cfg, n)
        assert got.patience == 0 and not got.converge and record["stopping"] == "epochs"
    got, _ = resolve_defaults(TrainConfig(dataset="x", max_steps=100), 180)  # the user's step budget: 10 epochs
    assert (got.epochs, got.patience, got.converge) == (10, 10, True)
    got, _ = resolve_defaults(TrainConfig(dataset="x", patience=3), 180)
    assert got.patience == 3 and got.epochs == 60


def test_the_verdict():
    assert convergence([0.5, 0.9], 10, stopped_early=True)["by"] == "patience"
    rising = convergence([0.1, 0.3, 0.5, 0.6, 0.7, 0.8], 10, stopped_early=False)  # window 3: 0.5 -> 0.8
    assert rising == {"converged": False, "by": "budget", "window": 3, "validations": 6, "best_before_window": 0.5,
                      "best_in_window": 0.8}
    assert convergence([0.1, 0.9, 0.9, 0.8, 0.9, 0.9], 2, stopped_early=False)["converged"]
    assert convergence([0.1, 0.9, 0.9, 0.8, 0.9, 0.904], 2, stopped_early=False)["converged"]  # within 0.005
    assert convergence([0.9], 10, stopped_early=False) is None
    line = convergence_line(rising, 20, 60, converge=True)
    assert line.startswith("warning: not converged: calibration accuracy still improving when the budget ran out "
                           "(0.500 -> 0.800 in the last 3 of 6 validations); raise --max-steps (the budget: 60 steps)")
    assert "raise --epochs (now 20)" in convergence_line(rising, 20, 60, converge=False)


def test_a_converging_run_stops_by_patience_and_keeps_the_latest_weights_within_one_image_of_the_best(folder,
                                                                                                       tmp_path):
    run = train(_cfg(folder), tmp_path / "run", progress=False)
    config, rows = _config(run), _validations(run)
    acc = [float(r["cal_accuracy"]) for r in rows]
    n_cal = json.loads((run / "data.json").read_text())["sizes"]["calibration"]
    assert config["converge"] and config["stopped_early"] and config["step"] < config["steps"]
    first_best = acc.index(max(acc))
    assert len(acc) == first_best + 1 + config["patience"]  # stopped `patience` validations after the best
    kept = max(i for i, a in enumerate(acc) if a >= max(acc[:i + 1]) - 1 / n_cal - 1e-6)
    assert config["kept_weights"]["best_epoch"] == int(rows[kept]["epoch"]) and config["kept_weights"]["chosen"] == "best"
    assert config["convergence"] == {"converged": True, "by": "patience", "window": config["patience"],
                                     "validations": len(acc)}
    best, final = (torch.load(run / name, weights_only=True) for name in ("best.pt", "checkpoint.pt"))
    assert all(torch.equal(best[k], final[k]) for k in best)


def test_a_budget_that_runs_out_while_improving_says_not_converged_and_what_to_raise(folder, tmp_path, capsys):
    from slc.cli import main

    run = tmp_path / "short"
    main(["train", "--dataset", f"imagefolder:{folder}", "--backbone", "mlp", "--backbone-param", "hidden=32",
          "--max-steps", "12", "--augment", "none", "--out", str(run)])  # plain batches: still rising at 12 steps
    config = _config(run)
    assert config["converge"] and not config["stopped_early"] and config["step"] == 12
    assert config["convergence"]["converged"] is False and config["convergence"]["by"] == "budget"
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("warning: not converged: calibration accuracy still improving when the budget ran out")
    assert lines[-2].endswith("raise --max-steps (the budget: 12 steps) (docs/training.md)")
    assert lines[-1].startswith("warning: only 12 optimizer steps")  # and the step floor's warning
