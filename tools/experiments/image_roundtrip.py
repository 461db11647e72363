"""A glyph split's arrays sent back as PNG bodies: does the server's preprocessing give the training
example back? For each sampled array: PNG-encoded, decoded and preprocessed as an image body
(serving/bundle/image.py), compared with the array; and the bundle's top-1 on both.

    python -m tools.experiments.image_roundtrip BUNDLE [--split calibration] [--n 4000] [--name STEM]

numpy, Pillow and onnxruntime (the bundle's full.onnx): no torch, no server.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np

BATCH = 500


def roundtrip(bundle: Path, split: str, n: int, seed: int = 0) -> dict:
    """Identical share, mean absolute difference (grey levels) and top-1 from arrays and from PNGs."""
    import onnxruntime as ort
    from PIL import Image

    from serving.bundle.image import preprocess
    from trainer.data import glyphs

    manifest = json.loads((bundle / "manifest.json").read_text())
    spec, dataset = manifest["image"], manifest["dataset"]
    x, y = glyphs.load_split(glyphs.cache_dir(dataset), split)  # [N, 1, H, W] uint8, [N]
    idx = np.sort(np.random.default_rng(seed).choice(len(x), min(n, len(x)), replace=False))
    scale = np.float32(spec.get("scale", 1.0))
    arrays = np.asarray(x[idx], dtype=np.float32) * scale  # [n, 1, H, W]
    sent = []
    for i in idx:
        buf = io.BytesIO()
        Image.fromarray(np.asarray(x[i]).reshape(x.shape[-2:])).save(buf, format="PNG")
        sent.append(preprocess(Image.open(io.BytesIO(buf.getvalue())), spec))
    back = np.stack(sent).reshape(arrays.shape)  # [n, 1, H, W]
    session = ort.InferenceSession(str(bundle / "full.onnx"), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def top1(inputs: np.ndarray) -> float:
        z = np.concatenate([session.run(None, {name: inputs[i:i + BATCH]})[0] for i in range(0, len(inputs), BATCH)])
        return float((z.argmax(axis=1) == y[idx]).mean())

    same = (arrays == back).reshape(len(idx), -1).all(axis=1)
    return {"bundle": str(bundle), "dataset": dataset, "split": split, "images": int(len(idx)), "seed": seed,
            "identical": float(same.mean()), "mean_abs_diff": float(np.abs(arrays - back).mean() / scale),
            "top1_arrays": top1(arrays), "top1_png": top1(back)}


def markdown(r: dict, command: str) -> str:
    return "\n".join([
        "# Training images sent back as PNG bodies", "", f"Command: `{command}`", "",
        f"{r['images']:,} arrays of {r['dataset']}'s {r['split']} split (seeded sample), each PNG-encoded and "
        "preprocessed as the server preprocesses an image body (serving/bundle/image.py), against the array "
        "itself; top-1 from the bundle's full.onnx on both.", "",
        "| identical | mean abs. difference (grey levels) | top-1 from arrays | top-1 from PNGs |", "|---:|---:|---:|---:|",
        f"| {r['identical']:.3f} | {r['mean_abs_diff']:.2f} | {r['top1_arrays']:.4f} | {r['top1_png']:.4f} |", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.experiments.image_roundtrip", description=__doc__.split("\n")[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--split", default="calibration")
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--name", help="write docs/results/NAME.{md,json}")
    a = p.parse_args(argv)
    if not (a.bundle / "manifest.json").is_file() or "image" not in json.loads((a.bundle / "manifest.json").read_text()):
        print(f"error: {a.bundle} is not a bundle of an image dataset", file=sys.stderr)
        return 2
    from trainer.data import glyphs

    dataset = json.loads((a.bundle / "manifest.json").read_text()).get("dataset")
    if not (glyphs.cache_dir(str(dataset)) / f"x_{a.split}.npy").is_file():
        print(f"error: no rendered {a.split} split of {dataset} under {glyphs.cache_dir(str(dataset))} "
              f"(slc train --dataset {dataset} renders it)", file=sys.stderr)
        return 2
    r = roundtrip(a.bundle, a.split, a.n)
    print(f"{r['images']:,} {r['split']} arrays: identical {r['identical']:.3f}, mean |diff| {r['mean_abs_diff']:.2f}, "
          f"top-1 {r['top1_arrays']:.4f} (arrays) / {r['top1_png']:.4f} (PNG)")
    if a.name:
        from tools.report import write_result

        command = "python -m tools.experiments.image_roundtrip " + " ".join(argv if argv is not None else sys.argv[1:])
        print(write_result(Path("docs/results"), a.name, lambda: markdown(r, command), r)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
