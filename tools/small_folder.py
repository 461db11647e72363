"""A new user's small image folder: 12 letters x 24 PNGs (64x64, grey), four per face from six
DejaVu faces (Sans, Sans Bold, Sans Oblique, Serif, Serif Bold, Sans Mono), each drawn with a seeded
small shift, scale and rotation. The faces are matplotlib's copies (every training install has
them, so the folder is the same everywhere), else Debian's fonts-dejavu-core / -extra.

The folder of issue 37 part 5 (docs/results/small-folder.md): it measures whether `slc train`
with nothing but --dataset and --out learns on a few hundred images, and the test of that
(tests/trainer/test_small_folder.py) builds it the same way.

    python -m tools.small_folder DIR [--seed 0]        # render the folder
    python -m tools.small_folder DIR --issue50         # issue 50's: 10 letters x 30 PNGs, three DejaVu Sans faces
    python -m tools.small_folder DIR --top1 BUNDLE     # top-1 of every image of DIR by an exported bundle
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SYSTEM_FONTS = Path("/usr/share/fonts/truetype/dejavu")
FACES = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSerif.ttf",
         "DejaVuSerif-Bold.ttf", "DejaVuSansMono.ttf")
LETTERS = "ABCDEFGHJKMR"
PER_CLASS = 24
SIZE = 64
# issue 50's folder (docs/results/small-folder-defaults.md): 10 letters x 30 PNGs, the three DejaVu Sans faces
ISSUE50 = (LETTERS[:10], 30, FACES[:3])


def font_path(name: str) -> Path | None:
    """matplotlib's copy of a DejaVu face, else the system's; None when neither is there."""
    dirs = [SYSTEM_FONTS]
    try:
        import matplotlib

        dirs.insert(0, Path(matplotlib.get_data_path()) / "fonts" / "ttf")
    except ImportError:
        pass
    return next((d / name for d in dirs if (d / name).is_file()), None)


def missing_fonts() -> list[str]:
    """The faces this machine lacks."""
    return [f for f in FACES if font_path(f) is None]


def render_letter(font, char: str, rng: np.random.Generator):
    """One letter, dark on light, about a third of the image high, shifted by up to 6 px, scaled by
    0.85-1.15 and rotated by up to 6 degrees: the spread of a user's scanned or typed letters."""
    from PIL import Image, ImageDraw

    n = 3 * SIZE  # room for the largest crop, shifted
    big = Image.new("L", (n, n), 255)
    draw = ImageDraw.Draw(big)
    x0, y0, x1, y1 = draw.textbbox((0, 0), char, font=font)
    draw.text(((n - (x1 - x0)) / 2 - x0, (n - (y1 - y0)) / 2 - y0), char, fill=0, font=font)
    big = big.rotate(rng.uniform(-6, 6), resample=Image.BILINEAR, fillcolor=255)
    side = round(2 * SIZE / rng.uniform(0.85, 1.15))  # the letter's share of the image: its scale
    dx, dy = rng.integers(-6, 7, size=2) * side // SIZE  # up to 6 px in the 64 px image
    left, top = (n - side) // 2 - dx, (n - side) // 2 - dy
    canvas = big.crop((left, top, left + side, top + side))
    return canvas.resize((SIZE, SIZE), Image.LANCZOS)


def render(root: Path, seed: int = 0, letters: str = LETTERS, per_class: int = PER_CLASS,
           faces: tuple[str, ...] = FACES) -> Path:
    """root/LETTER/NN.png: per_class images of each letter, the faces taken in turn."""
    from PIL import ImageFont

    if missing := [f for f in faces if font_path(f) is None]:
        raise FileNotFoundError(f"missing fonts {', '.join(missing)}: pip install matplotlib, or apt-get install "
                                "fonts-dejavu-core fonts-dejavu-extra")
    fonts = [ImageFont.truetype(str(font_path(f)), 64) for f in faces]
    rng = np.random.default_rng(seed)
    root = Path(root)
    for c in letters:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            render_letter(fonts[i % len(fonts)], c, rng).save(root / c / f"{i:02d}.png")
    return root


def top1(bundle_dir: Path, root: Path) -> tuple[int, int]:
    """(right, total): the folder's images whose largest logit is their own class's, as the bundle
    computes it (its ONNX backbone on the server's preprocessing, then the head)."""
    import onnxruntime as ort

    from serving.bundle import load_bundle
    from serving.bundle.image import load_image_file

    bundle = load_bundle(bundle_dir)
    session = ort.InferenceSession(str(bundle.graph_path("backbone")), providers=["CPUExecutionProvider"])
    files = sorted(Path(root).glob("*/*.png"))
    x = np.stack([load_image_file(f, bundle.image) for f in files]).astype(np.float32)  # [N, C, H, W]
    h = session.run(None, {"input": x})[0].astype(np.float64)  # [N, d]
    pred = np.argmax(h @ np.asarray(bundle.weight, np.float64).T + np.asarray(bundle.bias, np.float64), axis=1)  # [N]
    classes = list(bundle.classes)
    want = np.array([classes.index(f.parent.name) for f in files])
    return int(np.sum(pred == want)), len(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top1", type=Path, metavar="BUNDLE", help="score the folder's images with BUNDLE instead")
    parser.add_argument("--issue50", action="store_true", help="issue 50's folder: 10 letters x 30 PNGs from the "
                        "three DejaVu Sans faces (Sans, Bold, Oblique)")
    args = parser.parse_args()
    if args.top1:
        right, total = top1(args.top1, args.dir)
        print(f"{args.top1}: top-1 right on {right} of {total} images of {args.dir}")
        return
    letters, per_class, faces = ISSUE50 if args.issue50 else (LETTERS, PER_CLASS, FACES)
    render(args.dir, args.seed, letters, per_class, faces)
    print(f"{args.dir}: {len(letters)} letters x {per_class} PNGs ({SIZE}x{SIZE}) from {len(faces)} DejaVu faces")


if __name__ == "__main__":
    main()
