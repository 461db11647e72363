"""`slc experiment thresholds`: which threshold rule holds on a face no one calibrated on (issue 37).

The calibration split of the glyph sets holds two typefaces (a Ming serif and a bitmap face). Each
rule is fitted on one of them and judged on the other (hold one face out, both ways): a rule that
holds there is one that transfers, and the choice is made there, never on the test face. The test
face (a brush face) is then judged with every rule fitted on both calibration faces, for the
record. A third fit models users' shifts: the calibration images with a seeded stroke weight,
blur and contrast (trainer/augment.py `style`), pooled with the clean ones.

Rules (tools/experiments/calibration_study.py's method_thresholds): per_class (column j alone),
global (one threshold for all classes: PoLS's promise that single logits are comparable), and
shrink k=κ (per class pulled toward the global one by a pseudo-count κ).

Judged by what the detect route does at the thresholds: per-class mean recall and precision
(a class that never matches has precision 1), and the pooled precision (true matches over all
matches), which is not flattered by classes that never match.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tools.experiments.calibration_study import judge, method_thresholds
from tools.report import md_table, write_result

SHIFT_SEED = 12345


def _faces(dataset: str, split: str, n: int) -> tuple[np.ndarray, list[str]]:
    """(face id per row [n], face names) of a glyph split, from the rendered arrays' face index."""
    from trainer.data import glyphs

    path = glyphs.cache_dir(dataset)
    face = np.load(path / f"face_{split}.npy", allow_pickle=False)
    info = json.loads((path / "manifest.json").read_text())["splits"][split]["faces"]
    if len(face) != n:
        raise ValueError(f"{dataset} {split}: {len(face)} face ids for {n} rows")
    return face, [f"{f['family']} {f['style']}".strip() for f in info]


def _shifted(x: np.ndarray, image: dict) -> np.ndarray:
    """The images with a seeded style shift (stroke weight, blur, contrast), uint8 like x."""
    import torch

    from trainer.augment import Style

    style = Style(dark_background=image.get("background", "dark") == "dark")
    gen = torch.Generator().manual_seed(SHIFT_SEED)
    out = np.empty_like(np.asarray(x[:0]), shape=x.shape)
    for i in range(0, len(x), 4096):
        batch = torch.tensor(np.asarray(x[i:i + 4096], dtype=np.float32))
        out[i:i + 4096] = style(batch, gen).round().clamp(0, 255).to(torch.uint8).numpy()
    return out


def _rows(fit_z: np.ndarray, fit_y: np.ndarray, judge_z: np.ndarray, judge_y: np.ndarray, target: float,
          fitted: str, judged: str) -> list[dict]:
    return [{"fitted_on": fitted, "judged_on": judged, "method": name, **judge(judge_z, judge_y, t, target)}
            for name, t in method_thresholds(fit_z, fit_y, {"precision": target}).items()]


def study(run: Path, target: float = 0.99) -> dict:
    """Every rule x (held-out calibration face, test face) for one run."""
    from trainer.data import load_run_data
    from trainer.train import load_run, run_logits

    model, config, data_info = load_run(run)
    splits = load_run_data(data_info, progress=False)
    (x_cal, y_cal), (x_test, y_test) = splits.calibration, splits.test
    z_cal = run_logits(model, x_cal).astype(np.float64)  # [N, D]
    z_test = run_logits(model, x_test).astype(np.float64)
    face, names = _faces(data_info["dataset"], "calibration", len(y_cal))
    rows = []
    for k, held in enumerate(names):  # hold one calibration face out: fit on the others, judge on it
        fit, out = face != k, face == k
        rows += _rows(z_cal[fit], y_cal[fit], z_cal[out], y_cal[out], target, f"calibration minus {held}", held)
    rows += _rows(z_cal, y_cal, z_test, y_test, target, "calibration", "test")
    z_shift = run_logits(model, _shifted(x_cal, splits.image)).astype(np.float64)
    rows += _rows(np.concatenate([z_cal, z_shift]), np.concatenate([y_cal, y_cal]), z_test, y_test, target,
                  "calibration + shifted", "test")
    for k, held in enumerate(names):  # the shift's own transfer: clean + shifted of one face, judged on the other
        fit, out = face != k, face == k
        rows += _rows(np.concatenate([z_cal[fit], z_shift[fit]]), np.concatenate([y_cal[fit], y_cal[fit]]),
                      z_cal[out], y_cal[out], target, f"calibration + shifted minus {held}", held)
    return {"run": str(run), "loss": config["loss"], "dataset": data_info["dataset"], "target": target,
            "faces": names, "rows": rows}


def markdown(results: list[dict], command: str) -> str:
    lines = ["# Threshold rules on faces no one calibrated on", "", f"Command: `{command}`", "",
             "Each rule is fitted on one calibration face and judged on the other (the choice is made there), "
             "then fitted on both and judged on the test face (for the record). Detect's view: per-class mean "
             "recall and precision at the thresholds (a class with no match has precision 1), pooled precision "
             "(true matches over all matches). Methods: tools/experiments/threshold_transfer.py.", ""]
    for r in results:
        body = [[row["fitted_on"], row["judged_on"], row["method"], f"{row['mean_recall']:.3f}",
                 f"{row['mean_precision']:.3f}", f"{row['pooled_precision']:.3f}", f"{row['matches']:,}"]
                for row in r["rows"]]
        lines += [f"## {r['loss']} on {r['dataset']}, target precision {r['target']:g}: `{Path(r['run']).name}`", "",
                  md_table(["fitted on", "judged on", "rule", "mean recall", "mean precision", "pooled precision",
                            "matches"], body, "lllrrrr"), ""]
    return "\n".join(lines)


def write(results: list[dict], out: Path, command: str, stem: str) -> Path:
    return write_result(out, stem, lambda: markdown(results, command), results)[0]
