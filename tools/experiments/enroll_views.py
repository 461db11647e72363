"""Does enrolling from geometric views of the examples help? Offline, on issue 50's small folder
(docs/results/small-folder-aims.md, "Views of the examples at enrollment: measured, not shipped").

Each of NAME's `shots` examples (drawn by seed, as `small_folder_aims enrolled` draws them) is
warped into `views` copies (a scale in [scale_min, 1.1], a shift within the room the scale leaves,
a rotation within ±5°: the trainer's `geometry` augmentation, on the decoded image) and the class
row is made by the server's own rules (serving/core/enrollment.py) from the examples plus their
views. Judged on NAME's other images, the run's test split and (with --fresh) a second rendering:
NAME's recall at its threshold, NAME's matches on other letters' images, and the best recall any
threshold could give the row (above every other letter's logit).

    python -m tools.experiments.enroll_views BUNDLE --run RUN --data DIR --name K --fresh DIR2 \
        [--views 0,8,32] [--scale-min 0.85] [--seeds 0,1,2] [--out JSON]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

ROTATE_DEGREES = 5.0  # as trainer/augment.py Geometry
SCALE_MAX = 1.1


def views(x: np.ndarray, n: int, seed: int, scale_min: float, scale_max: float = SCALE_MAX,
          rotate_degrees: float = ROTATE_DEGREES) -> np.ndarray:
    """x [C, H, W] decoded pixels -> [n, C, H, W]: each a seeded scale, shift (within the room the
    scale leaves) and rotation about the centre; outside the source, the median of its border."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    c, h, w = x.shape
    fill = float(np.median(np.concatenate([x[:, 0].ravel(), x[:, -1].ravel(), x[:, :, 0].ravel(), x[:, :, -1].ravel()])))
    out = np.empty((n, c, h, w), np.float32)
    for k in range(n):
        s, a = rng.uniform(scale_min, scale_max), math.radians(rotate_degrees) * rng.uniform(-1, 1)
        room = max(0.0, 1.0 - s)
        dx, dy = room * rng.uniform(-1, 1) * w / 2, room * rng.uniform(-1, 1) * h / 2
        ca, sa = math.cos(a) / s, math.sin(a) / s  # output pixel -> input pixel: the inverse warp
        ox, oy = -w / 2 - dx, -h / 2 - dy
        coeffs = (ca, -sa, ca * ox - sa * oy + w / 2, sa, ca, sa * ox + ca * oy + h / 2)
        for ch in range(c):
            img = Image.fromarray(np.ascontiguousarray(x[ch], np.float32), "F")
            out[k, ch] = np.asarray(img.transform((w, h), Image.AFFINE, coeffs, resample=Image.BILINEAR, fillcolor=fill))
    return out


def _embed(sess, x: np.ndarray) -> np.ndarray:
    return np.concatenate([sess.run(None, {"input": x[i:i + 256]})[0] for i in range(0, len(x), 256)]).astype(np.float64)


def _rows(bundle: Path, hp: np.ndarray, parts: dict) -> dict:
    """{rule: (row, bias, threshold)} of the two rules that use the calibration negatives."""
    from serving.core import enrollment as en

    row = en.standardised(hp, parts["stats"], parts["neg"], parts["hn"])
    t = en.negatives_threshold(row, hp, parts["hn"], parts["D"], parts["stats"].target_precision)
    fit = en.fitted(hp, parts["stats"], parts["neg"], parts["hn"], parts["D"])
    return {"standardised+negatives": (row, row.threshold if t is None else t),  # None: the global one, as the server
            "fitted+cv": (fit, fit.threshold)}


def _head_parts(bundle: Path) -> dict:
    from serving.core import enrollment as en

    cal = json.loads((bundle / "calibration.json").read_text())
    w = np.load(bundle / "head_weight.npy").astype(np.float64)
    b = np.load(bundle / "head_bias.npy").astype(np.float64)
    hn = np.load(bundle / "calibration_embeddings.npy").astype(np.float64)
    yn = np.load(bundle / "calibration_labels.npy")
    a, pb = (np.array([c["platt"][k] for c in cal["per_class"]]) for k in ("a", "b"))
    return {"hn": hn, "D": len(w), "stats": en.head_stats(w, b, a, pb, cal["global"]["threshold"], cal["target"]),
            "neg": en.negative_stats(w, b, hn, yn)}


def measure(bundle: Path, run: Path, data: Path, name: str, fresh: Path | None, shots: int, seeds: list[int],
            counts: list[int], scale_min: float) -> list[dict]:
    import onnxruntime as ort

    from serving.bundle.image import load_image_file
    from tools.experiments.small_folder_aims import folder_files, test_files

    spec = json.loads((bundle / "manifest.json").read_text())["image"]
    sess = ort.InferenceSession(str(bundle / "backbone.onnx"), providers=["CPUExecutionProvider"])
    load = lambda files: np.stack([load_image_file(f, spec) for f in files]).astype(np.float32)  # noqa: E731
    own = sorted((data / name).glob("*.png"))
    x_own = load(own)
    h_own = _embed(sess, x_own)
    others = {"held_out": _embed(sess, load([f for f, _ in test_files(run)]))}
    mine = {}
    if fresh:
        files = folder_files(fresh)
        h = _embed(sess, load([f for f, _ in files]))
        is_name = np.array([lab == name for _, lab in files])
        others["fresh"], mine["fresh"] = h[~is_name], h[is_name]
    parts, rows = _head_parts(bundle), []
    for seed in seeds:
        pick = sorted(np.random.default_rng(seed).choice(len(own), size=shots, replace=False).tolist())
        mine["held_out"] = h_own[[i for i in range(len(own)) if i not in pick]]
        for n in counts:
            hp = h_own[pick]
            if n:
                hp = np.concatenate([hp, _embed(sess, np.concatenate([views(x_own[i], n, 1000 * seed + i, scale_min)
                                                                      for i in pick]))])
            for rule, (row, t) in _rows(bundle, hp, parts).items():
                z = lambda h: h @ row.row.astype(np.float64) + row.bias  # noqa: E731
                r = {"draw": seed, "views": n, "rule": rule, "threshold": round(float(t), 3)}
                for key in mine:
                    zo = z(others[key])
                    r[key] = {"recall": round(float(np.mean(z(mine[key]) >= t)), 3),
                              "false_matches": int((zo >= t).sum()), "other_images": len(zo),
                              "best_any_threshold": round(float(np.mean(z(mine[key]) > zo.max())), 3)}
                rows.append(r)
                print(json.dumps(r), flush=True)
    return rows


def draw_arguments(description: str) -> argparse.ArgumentParser:
    """The options of an offline enrollment study on the small folder: the bundle of a run trained
    without NAME, the full folder, the fresh rendering, and the draws of NAME's examples."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("bundle", type=Path)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="the full folder: NAME's images under DATA/NAME")
    p.add_argument("--name", default="K")
    p.add_argument("--fresh", type=Path)
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", type=Path)
    return p


def main(argv: list[str] | None = None) -> None:
    p = draw_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--views", default="0,8,32")
    p.add_argument("--scale-min", type=float, default=0.85)
    a = p.parse_args(argv)
    rows = measure(a.bundle, a.run, a.data, a.name, a.fresh, a.shots, [int(s) for s in a.seeds.split(",")],
                   [int(v) for v in a.views.split(",")], a.scale_min)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
