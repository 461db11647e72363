"""`slc experiment thresholds`: which threshold rule holds on a face no one calibrated on (issue 37).

The calibration split of the glyph sets holds two typefaces (a Ming serif and a bitmap face). Each
rule is fitted on one of them and judged on the other (hold one face out, both ways): a rule that
holds there is one that transfers, and the choice is made there, never on the test face. The test
face (a brush face) is then judged with every rule fitted on both calibration faces, for the
record. A third fit models users' shifts: the calibration images with a seeded stroke weight,
blur and contrast (trainer/calibration_shift.py, as `slc export` draws it), pooled with the clean ones.

Rules (serving/calibration/'s estimators, as `slc export` uses them): per_class (column j alone),
global (one threshold for all classes: PoLS's promise that single logits are comparable), and
shrink k=κ (per class pulled toward the global one by a pseudo-count κ), tail (each column's
negative tail extrapolated) and norm (one threshold on logits standardised by each column's highest
negatives, serving/calibration/norm.py).

Judged by what the detect route does at the thresholds: per-class mean recall and precision
(a class that never matches has precision 1), and the pooled precision (true matches over all
matches), which is not flattered by classes that never match.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tools.report import md_table, write_result
from trainer.calibration_shift import SHIFT_SEED, style_shifted
from serving.calibration.norm import norm_thresholds
from serving.calibration.chunks import Logits, chunk_classes, dense_chunks
from serving.calibration.counts import PooledThreshold, class_counts, class_thresholds
from serving.calibration.rules import tail_thresholds

USER_IMAGES = 2  # per class, as in the user-calibration study (issue 37 part 6)
KAPPAS = (1.0, 4.0, 16.0)


def fit(z: np.ndarray, y: np.ndarray, target: dict) -> dict[str, np.ndarray]:
    """{rule: thresholds [D]} fitted on logits z [N, D] with labels y [N], class chunk by class chunk
    (serving/calibration/'s estimators: never an [N, D] temporary beyond the chunk's)."""
    num_classes = z.shape[1]
    pooled = PooledThreshold(z[np.arange(len(y)), y])
    parts = []
    logits = Logits(dense_chunks(z, chunk_classes(len(y), num_classes)), y, num_classes)
    for first, zc in logits:  # [N, c] float64
        positive = logits.positive(first, zc.shape[1])
        parts.append({**class_thresholds(zc, positive, target), "tail": tail_thresholds(zc, positive, target)})
        pooled.add(zc)
    per = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    g = float(pooled.choose(target)["threshold"][0])
    n = per["positives"].astype(np.float64)
    out = {"per_class": per["threshold"], "global": np.full(num_classes, g)}
    for kappa in KAPPAS:
        out[f"shrink k={kappa:g}"] = (n * per["threshold"] + kappa * g) / (n + kappa)
    out["tail"] = per["tail"]
    out["norm"] = norm_thresholds(dense_chunks(z, chunk_classes(len(y), num_classes)), y, num_classes, target)
    return out


def judge(z: np.ndarray, y: np.ndarray, thresholds: np.ndarray) -> dict:
    """Detect at `thresholds` [D] on logits z [N, D]: per-class mean recall and precision (a class with
    no match: precision 1), pooled precision over every decision, matches; and the top-1 accuracy of
    z (what softmax and top-k answer: moved rows change it, thresholds do not)."""
    num_classes = z.shape[1]
    logits = Logits(dense_chunks(z, chunk_classes(len(y), num_classes)), y, num_classes)
    (tp, matches, positives), = class_counts(logits, [thresholds])
    precision = np.where(matches > 0, tp / np.maximum(matches, 1), 1.0)
    recall = np.where(positives > 0, tp / np.maximum(positives, 1), 0.0)
    has = positives > 0  # classes the judged split holds
    return {"mean_recall": float(recall[has].mean()), "mean_precision": float(precision.mean()),
            "pooled_precision": float(tp.sum() / matches.sum()) if matches.sum() else 1.0,
            "matches": int(matches.sum()), "top1": float((z.argmax(axis=1) == y).mean()) if len(y) else 0.0}


def _faces(dataset: str, split: str, n: int) -> tuple[np.ndarray, list[str]]:
    """(face id per row [n], face names) of a glyph split, from the rendered arrays' face index."""
    from trainer.data import glyphs

    path = glyphs.cache_dir(dataset)
    face = np.load(path / f"face_{split}.npy", allow_pickle=False)
    info = json.loads((path / "manifest.json").read_text())["splits"][split]["faces"]
    if len(face) != n:
        raise ValueError(f"{dataset} {split}: {len(face)} face ids for {n} rows")
    return face, [f"{f['family']} {f['style']}".strip() for f in info]


def _user_rows(z: np.ndarray, y: np.ndarray, target: float, face: str, embedded: tuple | None = None) -> list[dict]:
    """A user's recalibration on one face: USER_IMAGES images per class fitted (seeded), the rest of
    the face judged; every rule (norm is `slc calibrate`'s default), the one cv picks from those images,
    and with `embedded` (h [N, d], W, b) the rows adapted too (`slc calibrate --adapt-rows`)."""
    from serving.calibration import choose as threshold_cv

    pick = _per_class_sample(y, USER_IMAGES)
    fitted = f"{USER_IMAGES} per class of {face}"
    rules = fit(z[pick], y[pick], {"precision": target})
    rows = [{"fitted_on": fitted, "judged_on": f"the rest of {face}", "method": name,
             **judge(z[~pick], y[~pick], t)} for name, t in rules.items()]
    zf, yf = z[pick], y[pick]
    method, record = threshold_cv.choose(lambda r: dense_chunks(zf[r], chunk_classes(len(r), z.shape[1])), yf,
                                         z.shape[1], {"precision": target})
    name = f"shrink k={method['kappa']:g}" if method["name"] == "shrink" else method["name"]
    rows.append({**next(r for r in rows if r["method"] == name), "method": f"cv (chose {name})"})
    if embedded is not None:
        rows.append({"fitted_on": fitted, "judged_on": f"the rest of {face}", **_adapted(*embedded, y, pick, target)})
    return rows


def _adapted(h: np.ndarray, W: np.ndarray, b: np.ndarray, y: np.ndarray, pick: np.ndarray, target: float) -> dict:
    """`slc calibrate --adapt-rows` on the picked images (serving/calibration/adapt.py, the step chosen there),
    judged on the others with the moved rows."""
    from serving.calibration import adapt as row_adapt

    goal = {"precision": target}
    beta, _ = row_adapt.choose_beta(h[pick], y[pick], W, b, goal)
    rows, t = row_adapt.thresholds(h[pick], y[pick], W, b, beta, goal)
    z = (h[~pick].astype(np.float64) @ np.asarray(rows[0:len(W)], np.float64).T + b).astype(np.float32)  # [n, D]
    return {"method": f"norm, rows adapted (step {beta:g})", **judge(z, y[~pick], t)}


def _embeddings(model, x: np.ndarray, batch: int = 2048) -> np.ndarray:
    """Embeddings float32 [N, d] of raw inputs x, batch by batch."""
    import torch

    with torch.no_grad():
        return np.concatenate([model.embed(torch.tensor(np.asarray(x[i:i + batch], dtype=np.float32))).numpy()
                               for i in range(0, len(x), batch)])


def _per_class_sample(y: np.ndarray, k: int, seed: int = SHIFT_SEED) -> np.ndarray:
    """[N] bool: k examples of each class (all of a class with fewer), drawn with a seeded shuffle."""
    order = np.random.default_rng(seed).permutation(len(y))
    order = order[np.argsort(y[order], kind="stable")]
    rank = np.arange(len(y)) - np.searchsorted(y[order], y[order], side="left")
    pick = np.zeros(len(y), dtype=bool)
    pick[order[rank < k]] = True
    return pick


def _rows(fit_z: np.ndarray, fit_y: np.ndarray, judge_z: np.ndarray, judge_y: np.ndarray, target: float,
          fitted: str, judged: str) -> list[dict]:
    return [{"fitted_on": fitted, "judged_on": judged, "method": name, **judge(judge_z, judge_y, t)}
            for name, t in fit(fit_z, fit_y, {"precision": target}).items()]


def study(run: Path, target: float = 0.99) -> dict:
    """Every rule x (held-out calibration face, test face) for one run."""
    from trainer.data import load_run_data
    from trainer.runs import load_run, run_logits

    model, config, data_info = load_run(run)
    splits = load_run_data(data_info, progress=False)
    (x_cal, y_cal), (x_test, y_test) = splits.calibration, splits.test
    z_cal = run_logits(model, x_cal)  # [N, D] float32 (fit and judge widen chunk by chunk)
    z_test = run_logits(model, x_test)
    face, names = _faces(data_info["dataset"], "calibration", len(y_cal))
    rows = []
    for k, held in enumerate(names):  # hold one calibration face out: fit on the others, judge on it
        fit, out = face != k, face == k
        rows += _rows(z_cal[fit], y_cal[fit], z_cal[out], y_cal[out], target, f"calibration minus {held}", held)
    rows += _rows(z_cal, y_cal, z_test, y_test, target, "calibration", "test")
    z_shift = run_logits(model, style_shifted(x_cal, splits.image))
    rows += _rows(np.concatenate([z_cal, z_shift]), np.concatenate([y_cal, y_cal]), z_test, y_test, target,
                  "calibration + shifted", "test")
    for k, held in enumerate(names):  # the shift's own transfer: clean + shifted of one face, judged on the other
        fit, out = face != k, face == k
        fit_z, fit_y = np.concatenate([z_cal[fit], z_shift[fit]]), np.concatenate([y_cal[fit], y_cal[fit]])
        rows += _rows(fit_z, fit_y, z_cal[out], y_cal[out], target, f"calibration + shifted minus {held}", held)
        # a user's shift on a face no rule was fitted on: the held-out face's shifted copies
        rows += _rows(z_cal[fit], y_cal[fit], z_shift[out], y_cal[out], target, f"calibration minus {held}",
                      f"{held} shifted")
        rows += _rows(fit_z, fit_y, z_shift[out], y_cal[out], target, f"calibration + shifted minus {held}",
                      f"{held} shifted")
    head = (model.head.weight.detach().numpy().astype(np.float32), model.head.bias.detach().numpy().astype(np.float64))
    h_cal, h_test = _embeddings(model.eval(), x_cal), _embeddings(model.eval(), x_test)
    for k, held in enumerate(names):  # a user's recalibration, on each face
        rows += _user_rows(z_cal[face == k], y_cal[face == k], target, held, (h_cal[face == k], *head))
    rows += _user_rows(z_test, y_test, target, "test", (h_test, *head))
    return {"run": str(run), "loss": config["loss"], "dataset": data_info["dataset"], "target": target,
            "faces": names, "rows": rows}


def markdown(results: list[dict], command: str) -> str:
    lines = ["# Threshold rules on faces no one calibrated on", "", f"Command: `{command}`", "",
             "Each rule is fitted on one calibration face and judged on the other (the choice is made there), "
             "then fitted on both and judged on the test face (for the record). Detect's view: per-class mean "
             "recall and precision at the thresholds (a class with no match has precision 1), pooled precision "
             "(true matches over all matches); top-1: the judged images' top-1 accuracy under the rows judged "
             "(only adapted rows change it). Methods: tools/experiments/threshold_transfer.py.", ""]
    for r in results:
        body = [[row["fitted_on"], row["judged_on"], row["method"], f"{row['mean_recall']:.3f}",
                 f"{row['mean_precision']:.3f}", f"{row['pooled_precision']:.3f}", f"{row['matches']:,}",
                 f"{row['top1']:.3f}" if "top1" in row else "–"]
                for row in r["rows"]]
        lines += [f"## {r['loss']} on {r['dataset']}, target precision {r['target']:g}: `{Path(r['run']).name}`", "",
                  md_table(["fitted on", "judged on", "rule", "mean recall", "mean precision", "pooled precision",
                            "matches", "top-1"], body, "lllrrrrr"), ""]
    return "\n".join(lines)


def write(results: list[dict], out: Path, command: str, stem: str) -> Path:
    return write_result(out, stem, lambda: markdown(results, command), results)[0]
