"""`slc experiment glyphs` on glyphs-latin, two rows x two seeds: the table holds the means and
sample stds of the runs' own metrics, a second invocation trains nothing, and --report-only
reports cached runs and counts the others as pending."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tools.experiments.glyphs import GlyphPlan, glyph_experiment

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # four short trainings on glyphs-latin
ROWS = (("ce", 1.0), ("batch_ce", 0.5))


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("glyph-exp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLC_HOME", str(tmp / "home"))
        plan = GlyphPlan(dataset="glyphs-latin", seeds=(0, 1), epochs=1, lr=0.01, batch_size=256, width=4, embed=16, lrs=())
        first = glyph_experiment(plan, tmp / "out", tmp / "runs", "test", rows=ROWS)
        again = glyph_experiment(plan, tmp / "out2", tmp / "runs", "test", rows=ROWS)
        partial = glyph_experiment(GlyphPlan(**{**plan.__dict__, "seeds": (0, 1, 2)}), tmp / "out3", tmp / "runs",
                                   "test", rows=ROWS, train_missing=False)
    return first, again, partial, tmp


def test_rows_are_the_mean_and_sample_std_of_their_runs(done):
    first, _, _, _ = done
    for row in first["rows"]["test"]:
        runs = first["runs"][row["loss"]]
        values = [json.loads(open(f"{r}/metrics.json").read())["test"]["auprc"] for r in runs]
        assert row["auprc"] == pytest.approx(np.mean(values), abs=1e-12)
        assert row["auprc_std"] == pytest.approx(np.std(values, ddof=1), abs=1e-12)
    assert [r["loss"] for r in first["rows"]["test"]] == ["ce", "batch_ce (R=0.5)"]


def test_a_second_invocation_reuses_every_run(done):
    first, again, _, _ = done
    assert first["timing"]["runs_trained_now"] == 4 and again["timing"]["runs_trained_now"] == 0
    assert again["rows"] == first["rows"]


def test_report_only_counts_missing_seeds_as_pending(done):
    _, _, partial, tmp = done
    assert partial["pending"] == 2 and partial["timing"]["runs_trained_now"] == 0
    assert all(r["seeds_ok"] == 2 and r["seeds_pending"] == 1 for r in partial["rows"]["test"])
    assert "2 runs still pending" in (tmp / "out3" / "glyphs-latin.md").read_text()


def test_each_row_takes_the_grid_lr_with_the_best_calibration_accuracy(tmp_path, monkeypatch):
    """The paper's protocol: every grid point trained a short budget, the choice read from the
    runs' own calibration metrics (never the test face), and the full runs use it."""
    monkeypatch.setenv("SLC_HOME", str(tmp_path / "home"))
    plan = GlyphPlan(dataset="glyphs-latin", seeds=(0,), epochs=1, batch_size=128, width=4, embed=16,
                     lrs=(1e-4, 0.01), search_steps=4)
    res = glyph_experiment(plan, tmp_path / "out", tmp_path / "runs", "test", rows=(("ce", 1.0),))
    search = res["lr_search"]["ce"]
    grid_runs = {float(p.name.split("-lr")[1].split("-")[0]): p for p in (tmp_path / "runs").iterdir()
                 if json.loads((p / "config.json").read_text())["max_steps"] == 4}
    accuracy = {lr: json.loads((run / "metrics.json").read_text())["calibration"]["accuracy"]
                for lr, run in grid_runs.items()}
    assert set(accuracy) == {1e-4, 0.01}
    assert search["chosen"] == max(accuracy, key=accuracy.get)
    full = json.loads((Path(res["runs"]["ce"][0]) / "config.json").read_text())
    assert full["lr"] == search["chosen"] and full["max_steps"] == 0
