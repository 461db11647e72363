"""The server's framed rule (serving/bundle/image.py, FRAMED_PIXELS), measured with it and without it
(FRAMED_PIXELS = 0, the crop before the rule) on a glyph bundle:

- round trip: a split's arrays sent back as PNG bodies; how many come back as the array, how far
  off the others are, and the bundle's top-1 on arrays and on what the server made of them;
- views: the calibration faces rendered as users send them (`small`: a third of the image,
  anywhere; `tight`: filling 90-100% of it), how many the rule keeps uncropped, top-1 either way.

    python -m tools.experiments.image_roundtrip BUNDLE [--split calibration] [--n 4000] [--name STEM]

numpy, Pillow and onnxruntime (the bundle's full.onnx): no torch, no server.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np

BATCH = 500
VIEW_CHARS = 300  # characters per calibration face and view, seeded


@contextmanager
def framed_rule(on: bool):
    """The server's preprocessing with the framed rule (as shipped) or without it (FRAMED_PIXELS 0)."""
    from serving.bundle import image

    with mock.patch.object(image, "FRAMED_PIXELS", image.FRAMED_PIXELS if on else 0):
        yield image.preprocess


def _top1(bundle: Path):
    import onnxruntime as ort

    session = ort.InferenceSession(str(bundle / "full.onnx"), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def top1(inputs: np.ndarray, y: np.ndarray) -> float:  # inputs [n, ...] as the graph takes them
        z = np.concatenate([session.run(None, {name: inputs[i:i + BATCH]})[0] for i in range(0, len(inputs), BATCH)])
        return float((z.argmax(axis=1) == y).mean())
    return top1


def _png(a: np.ndarray):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return Image.open(io.BytesIO(buf.getvalue()))


def roundtrip(bundle: Path, split: str, n: int, seed: int = 0) -> dict:
    """Per rule (on / off): identical share, mean absolute difference (grey levels), top-1 of the PNGs."""
    from trainer.data import glyphs

    manifest = json.loads((bundle / "manifest.json").read_text())
    spec, top1 = manifest["image"], _top1(bundle)
    x, y = glyphs.load_split(glyphs.cache_dir(manifest["dataset"]), split)  # [N, 1, H, W] uint8, [N]
    idx = np.sort(np.random.default_rng(seed).choice(len(x), min(n, len(x)), replace=False))
    scale = np.float32(spec.get("scale", 1.0))
    arrays = np.asarray(x[idx], dtype=np.float32) * scale  # [n, 1, H, W]
    out = {"split": split, "images": int(len(idx)), "seed": seed, "top1_arrays": top1(arrays, y[idx])}
    for on in (True, False):
        with framed_rule(on) as preprocess:
            back = np.stack([preprocess(_png(np.asarray(x[i]).reshape(x.shape[-2:])), spec) for i in idx])
        back = back.reshape(arrays.shape)  # [n, 1, H, W]
        out["on" if on else "off"] = {
            "identical": float((arrays == back).reshape(len(idx), -1).all(axis=1).mean()),
            "mean_abs_diff": float(np.abs(arrays - back).mean() / scale), "top1_png": top1(back, y[idx])}
    return out


def views(bundle: Path, seed: int = 0) -> list[dict]:
    """Per calibration face and view: the share the rule keeps uncropped, top-1 with and without it."""
    from trainer.data import glyphs

    manifest = json.loads((bundle / "manifest.json").read_text())
    spec, classes, top1 = manifest["image"], manifest["classes"], _top1(bundle)
    gs = glyphs.glyph_set(manifest["dataset"])
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(len(classes), min(VIEW_CHARS, len(classes)), replace=False))
    rows = []
    for view in ("small", "tight"):
        for face in gs.faces["calibration"]:
            font = face.load(glyphs.font_size(view))
            images = [glyphs.render(font, classes[c], rng, view=view) for c in ids]  # [32, 32] uint8 each
            made = {}
            for on in (True, False):
                with framed_rule(on) as preprocess:
                    made[on] = np.stack([preprocess(_png(a), spec) for a in images])
            kept = [np.array_equal(m[0], a.astype(np.float32) * np.float32(spec.get("scale", 1.0)))
                    for m, a in zip(made[True], images)]
            rows.append({"view": view, "face": f"{face.family or face.path().stem}", "images": len(images),
                         "kept": float(np.mean(kept)), "top1_on": top1(made[True], ids),
                         "top1_off": top1(made[False], ids)})
    return rows


def markdown(r: dict, command: str) -> str:
    t = r["roundtrip"]
    lines = ["# The framed rule: training images sent back, and images as users send them", "",
             f"Command: `{command}`  ", f"Bundle: `{r['bundle']}` ({r['dataset']}); tools/experiments/image_roundtrip.py.",
             "", f"**Round trip.** {t['images']:,} arrays of the {t['split']} split (seeded), each PNG-encoded and "
             "preprocessed as the server preprocesses an image body, against the array itself. Top-1 from the "
             f"arrays: {t['top1_arrays']:.4f}.", "",
             "| framed rule | identical | mean abs. difference (grey levels) | top-1 from the PNGs |",
             "|---|---:|---:|---:|"]
    lines += [f"| {name} | {t[k]['identical']:.3f} | {t[k]['mean_abs_diff']:.2f} | {t[k]['top1_png']:.4f} |"
              for k, name in (("off", "off (the crop before it)"), ("on", "on (shipped)"))]
    lines += ["", "**Views.** Characters of the calibration faces rendered as users send them (32×32): `small`, a "
              "third of the image anywhere in it; `tight`, filling 90–100% of it. Kept: left uncropped by the rule.",
              "", "| view | face | images | kept | top-1, rule on | top-1, rule off |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {v['view']} | {v['face']} | {v['images']} | {v['kept']:.3f} | {v['top1_on']:.3f} | {v['top1_off']:.3f} |"
              for v in r["views"]]
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.experiments.image_roundtrip", description=__doc__.split("\n")[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--split", default="calibration")
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--name", help="write docs/results/NAME.{md,json}")
    a = p.parse_args(argv)
    from trainer.data import glyphs

    manifest = json.loads((a.bundle / "manifest.json").read_text()) if (a.bundle / "manifest.json").is_file() else {}
    if "image" not in manifest or not str(manifest.get("dataset", "")).startswith("glyphs"):
        print(f"error: {a.bundle} is not a bundle of a glyph dataset", file=sys.stderr)
        return 2
    if not (glyphs.cache_dir(manifest["dataset"]) / f"x_{a.split}.npy").is_file():
        print(f"error: no rendered {a.split} split of {manifest['dataset']} under {glyphs.cache_dir(manifest['dataset'])} "
              f"(slc data glyphs renders it)", file=sys.stderr)
        return 2
    r = {"bundle": str(a.bundle), "dataset": manifest["dataset"], "roundtrip": roundtrip(a.bundle, a.split, a.n),
         "views": views(a.bundle)}
    t = r["roundtrip"]
    print(f"{t['images']:,} {a.split} arrays sent back: identical {t['off']['identical']:.3f} -> {t['on']['identical']:.3f}, "
          f"top-1 {t['off']['top1_png']:.4f} -> {t['on']['top1_png']:.4f} (arrays {t['top1_arrays']:.4f}); views kept "
          + ", ".join(f"{v['view']} {v['face']} {v['kept']:.3f}" for v in r["views"]))
    if a.name:
        from tools.report import write_result

        command = "python -m tools.experiments.image_roundtrip " + " ".join(argv if argv is not None else sys.argv[1:])
        print(write_result(Path("docs/results"), a.name, lambda: markdown(r, command), r)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
