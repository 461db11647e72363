"""Printed characters rendered from real fonts, split by typeface: calibration and test faces are
never seen in training (a split by augmentation alone is not a test).

`glyphs-latin`: Latin, Greek and Cyrillic letters and digits from the fonts matplotlib ships
(DejaVu, STIX): every machine has them, so tests and CI use it. Classes are the characters
themselves; a character that renders pixel-identical to an earlier class in some training face
(Latin A, Greek Α, Cyrillic А) is left out, since no model could tell them apart.

Each (character, face) is rendered at 32×32 and augmented with a seeded generator: small affine
jitter, stroke thickness, blur, contrast and noise. Arrays are cached as .npy under
$SLC_HOME/data/glyphs/NAME with a manifest of every face used; `slc data glyphs NAME` builds them,
and loading a dataset by name builds it when missing.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.bundle import replace_dir, slc_home

log = logging.getLogger(__name__)

SIZE = 32
FONT_SIZE = 26
FORMAT_VERSION = 1


@dataclass(frozen=True)
class GlyphSet:
    """A glyph dataset: its characters and which faces go to which split."""

    name: str
    chars: str
    faces: dict[str, tuple[str, ...]]  # split -> font files
    augment: dict[str, int]  # split -> renderings per (character, face)

    def font_dir(self) -> Path:
        import matplotlib

        return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def _latin() -> GlyphSet:
    latin = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    greek = "".join(chr(c) for c in range(0x391, 0x3AA) if c != 0x3A2) + "".join(chr(c) for c in range(0x3B1, 0x3CA))
    cyrillic = "".join(chr(c) for c in range(0x410, 0x450))
    return GlyphSet(
        name="glyphs-latin", chars=latin + greek + cyrillic,
        faces={"train": ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
                         "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
                         "DejaVuSansMono-BoldOblique.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf"),
               "calibration": ("DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf", "STIXGeneralBol.ttf"),
               "test": ("STIXGeneral.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf")},
        augment={"train": 6, "calibration": 3, "test": 3})


GLYPH_SETS = {"glyphs-latin": _latin}


def glyph_set(name: str) -> GlyphSet:
    if name not in GLYPH_SETS:
        raise KeyError(f"unknown glyph dataset {name!r}; known: {', '.join(GLYPH_SETS)}")
    return GLYPH_SETS[name]()


def has_glyph(font_path: Path, char: str) -> bool:
    from matplotlib.ft2font import FT2Font

    return FT2Font(str(font_path)).get_char_index(ord(char)) != 0


def render(font, char: str, rng: np.random.Generator | None = None) -> np.ndarray:
    """One character centred in SIZE×SIZE, white on black, uint8 [SIZE, SIZE]; augmented when rng."""
    from PIL import Image, ImageDraw, ImageFilter

    canvas = Image.new("L", (2 * SIZE, 2 * SIZE), 0)
    draw = ImageDraw.Draw(canvas)
    x0, y0, x1, y1 = draw.textbbox((0, 0), char, font=font)
    draw.text(((2 * SIZE - (x1 - x0)) / 2 - x0, (2 * SIZE - (y1 - y0)) / 2 - y0), char, fill=255, font=font)
    if rng is not None:
        angle, scale = rng.uniform(-8, 8), rng.uniform(0.9, 1.1)
        dx, dy = rng.uniform(-2, 2, size=2)
        canvas = canvas.rotate(angle, resample=Image.BILINEAR, center=(SIZE, SIZE), translate=(dx, dy))
        canvas = canvas.resize((round(2 * SIZE * scale),) * 2, Image.BILINEAR)
        off = (canvas.width - 2 * SIZE) // 2
        canvas = canvas.crop((off, off, off + 2 * SIZE, off + 2 * SIZE))
        stroke = rng.integers(0, 3)  # 0: as drawn, 1: thicker, 2: thinner
        if stroke:
            canvas = canvas.filter(ImageFilter.MaxFilter(3) if stroke == 1 else ImageFilter.MinFilter(3))
    img = np.asarray(canvas.resize((SIZE, SIZE), Image.LANCZOS), dtype=np.float32)  # [SIZE, SIZE]
    if rng is not None:
        img = img * rng.uniform(0.6, 1.0) + rng.uniform(0, 40)  # contrast, background
        img = img + rng.normal(0, rng.uniform(0, 12), img.shape)  # noise
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def distinct_chars(gs: GlyphSet) -> str:
    """The characters every face has, minus those rendering identically to an earlier one in a training face."""
    from PIL import ImageFont

    fonts = [gs.font_dir() / f for faces in gs.faces.values() for f in faces]
    chars = [c for c in gs.chars if all(has_glyph(f, c) for f in fonts)]
    train_fonts = [ImageFont.truetype(str(gs.font_dir() / f), FONT_SIZE) for f in gs.faces["train"]]
    seen_per_face: list[dict] = [dict() for _ in train_fonts]
    keep = []
    for c in chars:
        images = [render(font, c).tobytes() for font in train_fonts]
        if any(img in seen for img, seen in zip(images, seen_per_face)):
            continue  # a homoglyph of an earlier class
        for img, seen in zip(images, seen_per_face):
            seen[img] = c
        keep.append(c)
    return "".join(keep)


def _face_info(path: Path) -> dict:
    from PIL import ImageFont

    family, style = ImageFont.truetype(str(path), FONT_SIZE).getname()
    return {"file": path.name, "family": family, "style": style}


def build(name: str, out: Path, seed: int = 0, progress: bool = True) -> Path:
    """Render every split of glyph set `name` into `out` (written aside, then moved into place)."""
    from PIL import ImageFont
    from tqdm.auto import tqdm

    gs = glyph_set(name)
    missing = [f for faces in gs.faces.values() for f in faces if not (gs.font_dir() / f).is_file()]
    if missing:
        raise FileNotFoundError(f"fonts missing for {name}: {', '.join(missing)}")
    chars = distinct_chars(gs)
    stage = out.with_name(out.name + ".building")
    stage.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    manifest = {"format_version": FORMAT_VERSION, "name": name, "seed": seed, "size": SIZE, "classes": list(chars),
                "splits": {}}
    total = sum(len(chars) * len(faces) * gs.augment[split] for split, faces in gs.faces.items())
    bar = tqdm(total=total, desc=f"rendering {name}", unit="img", disable=not progress)
    for split, faces in gs.faces.items():
        n = len(chars) * len(faces) * gs.augment[split]
        x = np.lib.format.open_memmap(stage / f"x_{split}.npy", mode="w+", dtype=np.uint8, shape=(n, 1, SIZE, SIZE))
        y, face = np.empty(n, np.int64), np.empty(n, np.int16)
        i = 0
        for fi, f in enumerate(faces):
            font = ImageFont.truetype(str(gs.font_dir() / f), FONT_SIZE)
            for ci, c in enumerate(chars):
                for _ in range(gs.augment[split]):
                    x[i, 0] = render(font, c, rng)
                    y[i], face[i] = ci, fi
                    i += 1
                bar.update(gs.augment[split])
        x.flush()
        del x
        np.save(stage / f"y_{split}.npy", y)
        np.save(stage / f"face_{split}.npy", face)
        manifest["splits"][split] = {"examples": n, "faces": [_face_info(gs.font_dir() / f) for f in faces],
                                     "renderings_per_face": gs.augment[split]}
    bar.close()
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return replace_dir(stage, out)


def cache_dir(name: str) -> Path:
    return slc_home() / "data" / "glyphs" / name


def load(name: str, progress: bool = True) -> tuple[dict, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(manifest, {split: (x uint8 [N, 1, 32, 32] memory-mapped, y [N])}), built first when missing."""
    path = cache_dir(name)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file() or json.loads(manifest_path.read_text()).get("format_version") != FORMAT_VERSION:
        log.info("building %s under %s (once)", name, path)
        build(name, path, progress=progress)
    manifest = json.loads(manifest_path.read_text())
    splits = {s: (np.load(path / f"x_{s}.npy", mmap_mode="r", allow_pickle=False),
                  np.load(path / f"y_{s}.npy", allow_pickle=False)) for s in ("train", "calibration", "test")}
    return manifest, splits
