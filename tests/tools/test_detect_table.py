"""The per-loss detect table (tools/experiments/detect_table.py): the default rule per loss as
`slc export` ships it, each (loss, augment) group's mean and sample deviation over its runs against
numpy on the same numbers, and the CLI's one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools.experiments.detect_table import default_rule, summarise

ROOT = Path(__file__).resolve().parents[2]
FACES = ["Face A", "Face B"]
RULES = ["global", "per_class", "shrink k=4", "norm"]
IMAGE = {"height": 8, "width": 8, "channels": 1, "layout": "CHW", "scale": 1.0, "background": "dark"}


def _study(tmp_path, name: str, loss: str, pols: bool, augment: str, seed: int, epochs: int = 2,
           images: bool = True) -> dict:
    run = tmp_path / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"loss": loss, "loss_pols": pols, "augment": augment, "seed": seed,
                                                 "epochs": epochs}))
    (run / "data.json").write_text(json.dumps({"input_shape": [1, 8, 8] if images else [64],
                                               "image": IMAGE if images else None}))
    rng = np.random.default_rng(seed + 10 * len(loss))
    (run / "metrics.json").write_text(json.dumps({"test": {"accuracy": float(rng.uniform(0.5, 0.9)),
                                                           "auprc": float(rng.uniform(0.5, 0.9))}}))
    rows = []
    for judged in FACES + [f"{f} shifted" for f in FACES] + ["test"]:
        held = judged.removesuffix(" shifted")
        for fit in ("calibration", "calibration + shifted"):
            fitted = fit if judged == "test" else f"{fit} minus {held}"
            rows.append({"fitted_on": f"2 per class of {held}", "judged_on": judged, "method": "norm",
                         "mean_recall": 9.0, "mean_precision": 9.0, "pooled_precision": 9.0, "matches": 1})  # never picked
            for rule in RULES:
                rows.append({"fitted_on": fitted, "judged_on": judged, "method": rule,
                             **{k: float(rng.uniform()) for k in ("mean_recall", "mean_precision", "pooled_precision")},
                             "matches": 5})
    return {"run": str(run), "loss": loss, "dataset": "glyphs", "target": 0.99, "faces": FACES, "rows": rows}


def _want(study: dict, face: str, rule: str, shifted: bool) -> float:
    fit = "calibration + shifted" if shifted else "calibration"
    held = face.removesuffix(" shifted")
    return [r["mean_recall"] for r in study["rows"] if r["judged_on"] == face and r["method"] == rule
            and r["fitted_on"] in (fit, f"{fit} minus {held}")][0]


def test_each_group_is_the_default_rule_averaged_over_its_seeds(tmp_path):
    studies = [_study(tmp_path, f"sn{s}", "self_norm", True, "none", s) for s in range(3)]
    studies += [_study(tmp_path, "ce0", "ce", False, "none", 0), _study(tmp_path, "el0", "self_norm", True, "elastic", 0),
                _study(tmp_path, "el1", "self_norm", True, "elastic", 1),
                _study(tmp_path, "flat0", "bce", True, "none", 0, images=False)]
    longer = _study(tmp_path, "el6", "self_norm", True, "elastic", 0, epochs=6)  # a longer run: a group of its own
    assert [(e["epochs"], e["runs"]) for e in summarise(studies + [longer]) if e["epochs"] == 6] == [(6, [longer["run"]])]
    entries = {(e["loss"], e["augment"]): e for e in summarise(studies)}
    assert set(entries) == {("self_norm", "none"), ("ce", "none"), ("self_norm", "elastic"), ("bce", "none")}
    rules = {("self_norm", "none"): ("norm", True), ("self_norm", "elastic"): ("norm", True),
             ("ce", "none"): ("shrink k=4", False), ("bce", "none"): ("global", False)}  # bce here: not images
    for (loss, augment), entry in entries.items():
        rule, shifted = rules[(loss, augment)]
        assert entry["rule"] == rule + (" (+ shifted)" if shifted else "")
        members = [s for s in studies if s["loss"] == loss
                   and json.loads((tmp_path / s["run"] / "config.json").read_text())["augment"] == augment]
        assert list(entry["faces"]) == FACES + [f"{f} shifted" for f in FACES] + ["test"]
        for face in entry["faces"]:
            want = np.array([_want(s, face, rule, shifted) for s in members])
            got = entry["faces"][face]["mean_recall"]
            assert got["mean"] == pytest.approx(want.mean()) and got["n"] == len(members)
            assert (got["sd"] is None) if len(members) == 1 else got["sd"] == pytest.approx(want.std(ddof=1))
    recalls = [e["faces"]["test"]["mean_recall"]["mean"] for e in summarise(studies)]
    assert recalls == sorted(recalls, reverse=True)


def test_the_rule_is_the_one_export_ships(tmp_path):
    from serving.calibration.defaults import default_rule as default_method

    images = _study(tmp_path, "a", "self_norm", True, "none", 0)
    flat = _study(tmp_path, "b", "self_norm", True, "none", 0, images=False)
    ce = _study(tmp_path, "c", "ce", False, "none", 0)
    assert default_rule(Path(images["run"])) == ("norm", True) and default_method(True, "style") == {"name": "norm"}
    assert default_rule(Path(flat["run"])) == ("global", False) and default_rule(Path(ce["run"])) == ("shrink k=4", False)


def test_a_study_from_before_the_shifted_rows_is_named(tmp_path):
    old = _study(tmp_path, "old", "self_norm", True, "none", 0)
    old["rows"] = [r for r in old["rows"] if not r["judged_on"].endswith(" shifted")]
    with pytest.raises(ValueError, match="run `slc experiment thresholds` again"):
        summarise([old])


def _slc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slc", *args], capture_output=True, text=True, cwd=ROOT)


def test_a_file_that_is_not_a_study_is_one_line(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    r = _slc("experiment", "detect-table", str(bad), "--out", str(tmp_path))
    assert r.returncode == 2 and "not the JSON of slc experiment thresholds" in r.stderr
    bad.write_text(json.dumps([{"run": str(tmp_path / "missing"), "loss": "ce", "rows": [], "faces": []}]))
    r = _slc("experiment", "detect-table", str(bad), "--out", str(tmp_path))
    assert r.returncode == 1 and "cannot summarise these studies" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
