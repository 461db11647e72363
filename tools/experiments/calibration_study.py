"""`slc experiment calibration`: thresholds when each class has a handful of calibration positives.

Three ways to choose class j's threshold on the calibration split (serving/calibration/ picks
each one at the target):
- per_class: from column j alone (n_j positives: 4 per class on glyphs3755);
- global: one threshold for every class, from all (example, class) pairs pooled;
- shrink(κ): t_j = (n_j · t_j^class + κ · t^global) / (n_j + κ), the per-class threshold pulled
  toward the global one by a pseudo-count κ, as empirical-Bayes estimators of a per-group
  quantity borrow strength from the pooled one when a group has few observations (Efron &
  Morris 1975). κ = 0 is per_class, κ → ∞ global.

Each is judged on the held-out test faces: per-class precision and recall at the chosen
thresholds, their means, the mean of the worst decile of per-class precision, and the share of
classes reaching the target. A class with no match on the test split has precision 1 (no false
alarm), as in serving/calibration/.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.report import md_table, write_result
from serving.calibration.counts import choose_thresholds, rates_at

KAPPAS = (1.0, 2.0, 4.0, 8.0, 16.0)


def method_thresholds(logits: np.ndarray, labels: np.ndarray, target: dict) -> dict[str, np.ndarray]:
    """{method name: thresholds [D]} chosen on (logits [N, D], labels [N])."""
    num_classes = logits.shape[1]
    positive = labels[:, None] == np.arange(num_classes)[None, :]  # [N, D]
    per = choose_thresholds(logits, positive, target)
    pooled = float(choose_thresholds(logits.reshape(-1, 1), positive.reshape(-1, 1), target)["threshold"][0])
    n = per["positives"].astype(np.float64)  # [D]
    out = {"per_class": per["threshold"], "global": np.full(num_classes, pooled)}
    for kappa in KAPPAS:
        out[f"shrink k={kappa:g}"] = (n * per["threshold"] + kappa * pooled) / (n + kappa)
    return out


def judge(logits: np.ndarray, labels: np.ndarray, thresholds: np.ndarray, target_value: float) -> dict:
    """Per-class precision / recall on a held-out split at the thresholds, summarised."""
    positive = labels[:, None] == np.arange(logits.shape[1])[None, :]
    rates = rates_at(logits, positive, thresholds)
    precision, recall = rates["precision"], rates["recall"]
    worst = np.sort(precision)[: max(1, len(precision) // 10)]
    tp = (rates["precision"] * rates["matches"]).sum()  # true matches, summed over classes
    matches = int(rates["matches"].sum())
    return {"mean_precision": float(precision.mean()), "worst_decile_precision": float(worst.mean()),
            "classes_reaching_target": float((precision >= target_value - 1e-12).mean()),
            "mean_recall": float(recall.mean()),
            # not fooled by classes that never match (precision 1 by convention): all decisions pooled
            "pooled_precision": float(tp / matches) if matches else 1.0, "matches": matches}


def study(run: Path, targets: tuple[float, ...] = (0.99, 0.9)) -> dict:
    """Every method × precision target for one run: chosen on calibration, judged on test."""
    from trainer.data import load_run_data
    from trainer.runs import load_run, run_logits

    model, config, data_info = load_run(run)
    splits = load_run_data(data_info)
    (x_cal, y_cal), (x_test, y_test) = splits.calibration, splits.test
    z_cal, z_test = run_logits(model, x_cal).astype(np.float64), run_logits(model, x_test).astype(np.float64)
    rows = {}
    for p in targets:
        for name, t in method_thresholds(z_cal, y_cal, {"precision": p}).items():
            rows[f"{p:g}/{name}"] = {"target": p, "method": name, **judge(z_test, y_test, t, p)}
    return {"run": str(run), "loss": config["loss"], "pols": bool(config.get("loss_pols")),
            "dataset": data_info["dataset"], "calibration_examples": int(len(y_cal)),
            "test_examples": int(len(y_test)), "classes": int(z_cal.shape[1]), "rows": rows}


def markdown(results: list[dict], command: str) -> str:
    first = results[0]
    lines = [f"# Calibration with few positives: {first['dataset']}", "", f"Command: `{command}`", "",
             f"Thresholds chosen on the calibration split ({first['calibration_examples']:,} images, about "
             f"{first['calibration_examples'] // first['classes']} positives per class, typefaces unseen in training), "
             f"judged on the test split ({first['test_examples']:,} images of another unseen typeface, about "
             f"{first['test_examples'] // first['classes']} positives per class). Per-class precision and recall at "
             "each class's threshold; 'worst decile' is the mean precision of the 10 % of classes with the lowest "
             "precision; 'reaching' is the share of classes at or above the target. A class that never matches has "
             "precision 1 by convention, which flatters strict thresholds: 'pooled precision' (true matches over all "
             "matches, every class together) and 'matches' (of N × D decisions) are not fooled by it. "
             "Methods: tools/experiments/calibration_study.py.",
             ""]
    for r in results:
        rows = [[f"{row['target']:g}", row["method"],
                 *(f"{row[k]:.3f}" for k in ("mean_precision", "worst_decile_precision", "classes_reaching_target",
                                             "mean_recall", "pooled_precision")), f"{row['matches']:,}"]
                for row in r["rows"].values()]
        lines += [f"## {r['loss']} ({'PoLS' if r['pols'] else 'not PoLS'}): `{Path(r['run']).name}`", "",
                  md_table(["target", "method", "mean precision", "worst-decile precision", "classes reaching",
                            "mean recall", "pooled precision", "matches"], rows, "rlrrrrrr"), ""]
    return "\n".join(lines)


def write(results: list[dict], out: Path, command: str) -> Path:
    """OUT/calibration-<dataset>.{json,md}; the markdown's path."""
    return write_result(out, f"calibration-{results[0]['dataset']}", lambda: markdown(results, command), results)[0]
