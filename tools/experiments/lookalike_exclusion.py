"""Would excluding an enrolled class's look-alikes stop trained classes from claiming its images?
Offline, on issue 50's small folder (docs/results/small-folder-aims.md, "look-alikes excluded
(offline)"; the rule the server now applies: serving/core/lookalikes.py).

What is left of the enrolled aim there: a trained class (A, or C) whose detect says yes to many
images of the letter K enrolled later, so pooled precision falls below 0.98 while K itself is
recalled. The server already names such classes when K is enrolled (`matched_by`). The rule
measured here uses them:

- K's look-alikes L: the trained classes whose detect says yes to one of K's examples, and (with
  `closest`) each example's closest trained class, the one with the largest z_c - t_c;
- an input matches a class c of L unless K matches it too, by a larger margin
  (z_K - t_K > z_c - t_c); K matches unless a class of L does, by a larger margin.

A detect on c then reads 1 + |L| rows, not D. K's row and threshold are the server's `fitted`
rule's (serving/core/enrollment.py), from the same draws as `small_folder_aims enrolled`.

    python -m tools.experiments.lookalike_exclusion BUNDLE --run RUN --data DIR --name K --fresh DIR2 \
        [--seeds 0,1,2] [--shots 5] [--out JSON]
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RULES = ("none", "matched", "matched+closest")


def lookalikes(z_examples: np.ndarray, t: np.ndarray, closest: bool) -> np.ndarray:
    """Ascending trained class ids: those matching one of the examples (z_examples [n, D] against
    t [D]), and with `closest` each example's largest z_c - t_c."""
    found = np.flatnonzero((z_examples >= t).any(axis=0))
    if closest:
        found = np.union1d(found, np.argmax(z_examples - t, axis=1))
    return found.astype(np.int64)


def exclusive(z: np.ndarray, t: np.ndarray, zk: np.ndarray, tk: float, near: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(matches [n, D] of the trained classes, matches [n] of K) with the exclusion between K and the
    classes `near` (module docstring); z [n, D] trained logits, zk [n] K's logits."""
    match, match_k = z >= t, zk >= tk
    if len(near):
        margin, margin_k = z[:, near] - t[near], zk - tk  # [n, L], [n]
        near_match = match[:, near]
        match[:, near] = near_match & ~(match_k[:, None] & (margin_k[:, None] > margin))
        match_k = match_k & ~(near_match & (margin > margin_k[:, None])).any(axis=1)
    return match, match_k


def figures(z: np.ndarray, t: np.ndarray, zk: np.ndarray, tk: float, near: np.ndarray, y: np.ndarray) -> dict:
    """Over images with labels y (trained class id, -1: K): K's recall, its false matches, the trained
    classes' matches on K's images, the trained classes' recall, and pooled precision over every match."""
    match, match_k = exclusive(z, t, zk, tk, near)
    is_k, rows = y < 0, np.flatnonzero(y >= 0)
    own = match[rows, y[rows]]
    true, every = int(match_k[is_k].sum() + own.sum()), int(match.sum() + match_k.sum())
    return {"k_recall": round(float(match_k[is_k].mean()), 3), "k_false_matches": int(match_k[~is_k].sum()),
            "claims_on_k": int(match[is_k].sum()), "trained_recall": round(float(own.mean()), 3),
            "pooled_precision": round(true / every, 3) if every else 1.0, "matches": every}


def _sets(bundle: Path, run: Path, data: Path, name: str, fresh: Path | None):
    """(NAME's embeddings [m, d] in file order; {set: (embeddings, labels: trained ids, -1 for NAME)})."""
    import onnxruntime as ort

    from serving.bundle.image import load_image_file
    from tools.experiments.enroll_views import _embed
    from tools.experiments.small_folder_aims import bundle_classes, folder_files, test_files

    spec = json.loads((bundle / "manifest.json").read_text())["image"]
    sess = ort.InferenceSession(str(bundle / "backbone.onnx"), providers=["CPUExecutionProvider"])
    classes = bundle_classes(bundle)

    def embed(files: list[tuple[Path, str]]) -> tuple[np.ndarray, np.ndarray]:
        x = np.stack([load_image_file(f, spec) for f, _ in files]).astype(np.float32)
        return _embed(sess, x), np.array([classes.index(lab) if lab != name else -1 for _, lab in files])

    own, _ = embed([(p, name) for p in sorted((data / name).glob("*.png"))])
    sets = {"held_out": embed(test_files(run))}
    if fresh:
        sets["fresh"] = embed(folder_files(fresh))
    return own, sets


def measure(bundle: Path, run: Path, data: Path, name: str, fresh: Path | None, shots: int, seeds: list[int]) -> list[dict]:
    """Per draw and rule, the figures of the held-out images (K's others and the run's test split) and
    the fresh ones; `aim`: held-out K recall >= 0.8 at held-out pooled precision >= 0.98."""
    from serving.core import enrollment as en
    from tools.experiments.enroll_views import _head_parts
    from tools.experiments.small_folder_aims import bundle_classes

    w = np.load(bundle / "head_weight.npy").astype(np.float64)  # [D, d]
    b = np.load(bundle / "head_bias.npy").astype(np.float64)
    t = np.array([c["threshold"] for c in json.loads((bundle / "calibration.json").read_text())["per_class"]])
    parts, (own, sets) = _head_parts(bundle), _sets(bundle, run, data, name, fresh)
    rows = []
    for seed in seeds:
        pick = sorted(np.random.default_rng(seed).choice(len(own), size=shots, replace=False).tolist())
        row = en.fitted(own[pick], parts["stats"], parts["neg"], parts["hn"], parts["D"])
        wk, bk, tk = row.row.astype(np.float64), float(row.bias), float(row.threshold)
        rest = own[[i for i in range(len(own)) if i not in pick]]
        for rule in RULES:
            near = np.zeros(0, np.int64) if rule == "none" else lookalikes(own[pick] @ w.T + b, t, rule != "matched")
            r = {"draw": seed, "rule": rule, "lookalikes": [bundle_classes(bundle)[j] for j in near]}
            for key, (h, y) in sets.items():
                h_all = np.concatenate([rest, h]) if key == "held_out" else h
                y_all = np.concatenate([np.full(len(rest), -1), y]) if key == "held_out" else y
                r[key] = figures(h_all @ w.T + b, t, h_all @ wk + bk, tk, near, y_all)
            r["aim"] = r["held_out"]["k_recall"] >= 0.8 and r["held_out"]["pooled_precision"] >= 0.98
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    from tools.experiments.enroll_views import draw_arguments

    p = draw_arguments(__doc__.split("\n\n")[0])
    a = p.parse_args(argv)
    rows = measure(a.bundle, a.run, a.data, a.name, a.fresh, a.shots, [int(s) for s in a.seeds.split(",")])
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
