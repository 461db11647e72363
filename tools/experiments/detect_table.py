"""The per-loss detect table (issue 37 part 4; docs/results/glyphs3755-detect-per-loss.md) from the JSON
files `slc experiment thresholds` writes: for each (loss, augmentation, epochs) its runs' mean ± sample standard
deviation, over seeds, of detect at the rule `slc export` ships by default (serving/calibration/defaults.default_rule:
for a PoLS loss on images norm, fitted on the calibration images and their style-shifted copies; one
global threshold for a PoLS loss otherwise; per-class thresholds shrunk towards it with κ = 4 for the
others), judged on each held-out calibration face (fitted on the others), on its shifted copies and on
the test face (fitted on all), beside the runs' test accuracy and 1−AUPRC from their metrics.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tools.report import md_table, write_result

MEASURES = ("mean_recall", "mean_precision", "pooled_precision")


def default_rule(run: Path) -> tuple[str, bool]:
    """(rule as threshold_transfer names it, fitted with the style shift?) that `slc export` ships by
    default for a run."""
    from trainer import calibration_shift
    from serving.calibration.defaults import default_rule as default_method

    config = json.loads((Path(run) / "config.json").read_text())
    info = json.loads((Path(run) / "data.json").read_text())
    pols = bool(config.get("loss_pols", False))
    shift = calibration_shift.resolve("auto", pols, tuple(info["input_shape"]), info.get("image"))
    method = default_method(pols, shift)
    name = f"shrink k={method['kappa']:g}" if method["name"] == "shrink" else method["name"]
    return name, shift == "style"


def _row(study: dict, rule: tuple[str, bool], judged: str) -> dict:
    name, shifted = rule
    fit = "calibration + shifted" if shifted else "calibration"
    held = judged.removesuffix(" shifted")
    for row in study["rows"]:
        if row["method"] == name and row["judged_on"] == judged and row["fitted_on"] in (fit, f"{fit} minus {held}"):
            return row
    raise ValueError(f"{study['run']}: no row for rule {name!r} fitted on {fit!r} judged on {judged!r} "
                     f"(a study from before that row: run `slc experiment thresholds` again)")


def _stat(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "sd": float(a.std(ddof=1)) if len(a) > 1 else None, "n": len(a)}


def summarise(studies: list[dict]) -> list[dict]:
    """One entry per (loss, augment, epochs): seeds, rule, test accuracy / 1−AUPRC, and per judged face its measures."""
    groups: dict[tuple, list] = {}
    for study in studies:
        config = json.loads((Path(study["run"]) / "config.json").read_text())
        key = (study["loss"], config.get("augment", "none"), config.get("epochs"))
        groups.setdefault(key, []).append((study, config))
    out = []
    for (loss, augment, epochs), members in groups.items():
        rules = {default_rule(Path(s["run"])) for s, _ in members}
        if len(rules) != 1:
            raise ValueError(f"{loss}: runs with different default rules {sorted(rules)}")
        rule = rules.pop()
        names = list(members[0][0]["faces"])
        faces = names + [f"{f} shifted" for f in names] + ["test"]
        metrics = [json.loads((Path(s["run"]) / "metrics.json").read_text())["test"] for s, _ in members]
        label = rule[0] + (" (+ shifted)" if rule[1] else "")
        entry = {"loss": loss, "augment": augment, "epochs": epochs, "pols": bool(members[0][1].get("loss_pols", False)), "rule": label,
                 "runs": [s["run"] for s, _ in members], "accuracy": _stat([m["accuracy"] for m in metrics]),
                 "one_minus_auprc": _stat([1 - m["auprc"] for m in metrics]), "faces": {}}
        for face in faces:
            rows = [_row(s, rule, face) for s, _ in members]
            entry["faces"][face] = {k: _stat([r[k] for r in rows]) for k in MEASURES}
        out.append(entry)
    return sorted(out, key=lambda e: -e["faces"]["test"]["mean_recall"]["mean"])


def _fmt(stat: dict) -> str:
    return f"{stat['mean']:.3f}" + (f" ± {stat['sd']:.3f}" if stat["sd"] is not None else "")


def markdown(entries: list[dict], command: str) -> str:
    faces = list(entries[0]["faces"]) if entries else []
    head = ["loss", "augment", "epochs", "PoLS", "seeds", "threshold (auto)", "test acc", "test 1−AUPRC"]
    for face in faces:
        short = face.split()[0] if face != "test" else "test"
        short = ("UMing" if "UMing" in face else short) + (" shifted" if face.endswith(" shifted") else "")
        head += [f"{short}: recall", f"{short}: mean prec.", f"{short}: pooled prec."]
    body = []
    for e in entries:
        row = [e["loss"], e["augment"], str(e.get("epochs")), "yes" if e["pols"] else "no", str(len(e["runs"])),
               e["rule"].replace("shrink k=", "shrink κ="), _fmt(e["accuracy"]), _fmt(e["one_minus_auprc"])]
        for face in faces:
            row += [_fmt(e["faces"][face][k]) for k in MEASURES]
        body.append(row)
    lines = ["# Detect at the default threshold, per loss", "", f"Command: `{command}`", "",
             "Mean ± sample standard deviation over seeds; recall and precision are detect's at the rule "
             "`slc export` ships by default (\"+ shifted\": fitted on the calibration images and their "
             "style-shifted copies), judged on each held-out calibration face and on its shifted copies (fitted "
             "on the others) and on the test face (fitted on all). Sorted by test-face recall. "
             "(tools/experiments/detect_table.py)",
             "", md_table(head, body, "llrlrl" + "r" * (len(head) - 6)), ""]
    lines += [f"- `{run}`" for e in entries for run in e["runs"]]
    return "\n".join(lines) + "\n"


def write(entries: list[dict], out: Path, command: str, stem: str) -> Path:
    return write_result(out, stem, lambda: markdown(entries, command), entries)[0]
