"""Printed characters rendered from real fonts, split by typeface: calibration and test faces are
never seen in training (a split by augmentation alone is not a test).

`glyphs-latin`: Latin, Greek and Cyrillic letters and digits from the fonts matplotlib ships
(DejaVu, STIX): every machine has them, so tests and CI use it. `glyphs3755` / `glyphs6763`: the
level-1 / all Chinese characters of GB2312, from Debian's CJK font packages (Noto Sans/Serif SC,
Droid Sans Fallback, WQY Zen Hei and HanaMinA to train; AR PL UMing and Unifont to calibrate; the
brush-style AR PL UKai to test). Classes are the characters
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
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from serving.bundle import output, slc_home

log = logging.getLogger(__name__)

SIZE = 32
FONT_SIZE = 26
FORMAT_VERSION = 4  # bumped whenever rendering changes: cached arrays are rebuilt
CONTENT_MARGIN = 0.1  # glyphs3755/6763: every image cropped to its content box plus this margin per side
SPLITS = ("train", "calibration", "test")  # what the trainer reads; other splits are the test face as users send it


@dataclass(frozen=True)
class Face:
    """One typeface: a font file (relative to `root`, or absolute), the family to pick inside a
    .ttc collection, and the Debian package that ships it (None: it comes with a pip package)."""

    file: str
    family: str = ""
    package: str | None = None

    def path(self) -> Path:
        if self.package is None:
            import matplotlib

            return Path(matplotlib.get_data_path()) / "fonts" / "ttf" / self.file
        return Path(self.file)

    def index(self) -> int:
        """The face's index inside a collection (0 for a plain font file)."""
        if not self.family or self.path().suffix.lower() != ".ttc":
            return 0
        from fontTools.ttLib import TTCollection

        for i, font in enumerate(TTCollection(str(self.path()), lazy=True).fonts):
            if font["name"].getBestFamilyName() == self.family:
                return i
        raise LookupError(f"{self.path()} holds no face {self.family!r}")

    def load(self, size: int = 0):
        from PIL import ImageFont

        return ImageFont.truetype(str(self.path()), size or FONT_SIZE, index=self.index())

    def cmap(self) -> set[int]:
        from fontTools.ttLib import TTFont

        return set(TTFont(str(self.path()), fontNumber=self.index(), lazy=True).getBestCmap())


@dataclass(frozen=True)
class GlyphSet:
    """A glyph dataset: its characters and which faces go to which split."""

    name: str
    chars: str
    faces: dict[str, tuple[Face, ...]]  # split -> faces
    augment: dict[str, int]  # split -> renderings per (character, face)
    content_box: float | None = None  # crop every rendering to its content (serving/bundle/image.py), this margin
    raw: dict[str, str] = field(default_factory=dict)  # extra split -> "small" | "tight": as users send them

    def view(self, split: str) -> str:
        """How `split` is rendered: "content" (cropped to its content box), "small" or "tight" (raw
        images as a user sends them, for the serving path to crop), or "plain"."""
        return self.raw.get(split) or ("content" if self.content_box is not None else "plain")

    def all_faces(self) -> list[Face]:
        return [f for faces in self.faces.values() for f in faces]

    def missing(self) -> list[Face]:
        return [f for f in self.all_faces() if not f.path().is_file()]


def _latin() -> GlyphSet:
    latin = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    greek = "".join(chr(c) for c in range(0x391, 0x3AA) if c != 0x3A2) + "".join(chr(c) for c in range(0x3B1, 0x3CA))
    cyrillic = "".join(chr(c) for c in range(0x410, 0x450))
    files = {"train": ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
                       "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
                       "DejaVuSansMono-BoldOblique.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf"),
             "calibration": ("DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf", "STIXGeneralBol.ttf"),
             "test": ("STIXGeneral.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf")}
    return GlyphSet(name="glyphs-latin", chars=latin + greek + cyrillic,
                    faces={split: tuple(Face(f) for f in fs) for split, fs in files.items()},
                    augment={"train": 6, "calibration": 3, "test": 3})


def gb2312(level1_only: bool) -> str:
    """GB2312's Chinese characters in code order: level 1 (rows 16-55, 3,755) or all (rows 16-87, 6,763)."""
    out = []
    for b1 in range(0xB0, 0xD8 if level1_only else 0xF8):
        for b2 in range(0xA1, 0xFF):
            try:
                out.append(bytes([b1, b2]).decode("gb2312"))
            except UnicodeDecodeError:  # the few unassigned positions at the end of rows 55 and 87
                pass
    return "".join(out)


_NOTO = "/usr/share/fonts/opentype/noto/"
CJK_FACES = {
    "train": (Face(_NOTO + "NotoSansCJK-Regular.ttc", "Noto Sans CJK SC", "fonts-noto-cjk"),
              Face(_NOTO + "NotoSansCJK-Bold.ttc", "Noto Sans CJK SC", "fonts-noto-cjk"),
              Face(_NOTO + "NotoSerifCJK-Regular.ttc", "Noto Serif CJK SC", "fonts-noto-cjk"),
              Face(_NOTO + "NotoSerifCJK-Bold.ttc", "Noto Serif CJK SC", "fonts-noto-cjk"),
              Face("/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf", "", "fonts-droid-fallback"),
              Face("/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc", "WenQuanYi Zen Hei", "fonts-wqy-zenhei"),
              Face("/usr/share/fonts/truetype/hanazono/HanaMinA.ttf", "", "fonts-hanazono")),
    "calibration": (Face("/usr/share/fonts/truetype/arphic/uming.ttc", "AR PL UMing CN", "fonts-arphic-uming"),
                    Face("/usr/share/fonts/opentype/unifont/unifont.otf", "", "fonts-unifont")),
    "test": (Face("/usr/share/fonts/truetype/arphic/ukai.ttc", "AR PL UKai CN", "fonts-arphic-ukai"),),
}


def _gb2312(name: str, level1_only: bool) -> GlyphSet:
    faces = {**CJK_FACES, "test_small": CJK_FACES["test"], "test_tight": CJK_FACES["test"]}
    return GlyphSet(name=name, chars=gb2312(level1_only), faces=faces, content_box=CONTENT_MARGIN,
                    augment={"train": 8, "calibration": 4, "test": 8, "test_small": 8, "test_tight": 8},
                    raw={"test_small": "small", "test_tight": "tight"})


def _noto(kind: str, weight: str, region: str = "SC") -> Face:
    return Face(f"{_NOTO}Noto{kind}CJK-{weight}.ttc", f"Noto {kind} CJK {region}",
                "fonts-noto-cjk" if weight in ("Regular", "Bold") else "fonts-noto-cjk-extra")


_WQY = "/usr/share/fonts/truetype/wqy/"
# glyphs3755-wide's training faces: every variant of the allowed packages (issue 37) except the
# siblings of the calibration and test faces, so that both stay unseen: AR PL UKai's other regions
# and AR PL KaitiM GB (gkai00mp: pixel correlation 0.87 with the test face, 0.31-0.32 for every
# other face), AR PL UMing's other regions and AR PL SungtiL GB (gbsn00lp: 0.83 with UMing).
WIDE_TRAIN = tuple(
    [_noto("Sans", w) for w in ("Thin", "Light", "DemiLight", "Regular", "Medium", "Bold", "Black")]
    + [_noto("Serif", w) for w in ("ExtraLight", "Light", "Regular", "Medium", "SemiBold", "Bold", "Black")]
    + [_noto(kind, "Regular", region) for kind in ("Sans", "Serif") for region in ("JP", "KR", "TC", "HK")]
    + [Face(f"{_NOTO}NotoSansCJK-{w}.ttc", "Noto Sans Mono CJK SC", "fonts-noto-cjk") for w in ("Regular", "Bold")]
    + [Face(_WQY + "wqy-zenhei.ttc", "WenQuanYi Zen Hei", "fonts-wqy-zenhei"),
       Face(_WQY + "wqy-zenhei.ttc", "WenQuanYi Zen Hei Sharp", "fonts-wqy-zenhei"),
       Face(_WQY + "wqy-microhei.ttc", "WenQuanYi Micro Hei", "fonts-wqy-microhei")]
    + [f for f in CJK_FACES["train"] if "wqy" not in f.file and "Noto" not in f.file])  # Droid, HanaMinA


def _gb2312_wide() -> GlyphSet:
    """glyphs3755 with 29 training faces at 2 renderings each (about glyphs3755's 7 x 8 per class):
    the same characters, calibration and test faces."""
    base = _gb2312("glyphs3755-wide", True)
    return dataclasses.replace(base, faces={**base.faces, "train": WIDE_TRAIN}, augment={**base.augment, "train": 2})


GLYPH_SETS = {"glyphs-latin": _latin, "glyphs3755": lambda: _gb2312("glyphs3755", True),
              "glyphs3755-wide": _gb2312_wide, "glyphs6763": lambda: _gb2312("glyphs6763", False)}


def glyph_set(name: str) -> GlyphSet:
    if name not in GLYPH_SETS:
        raise KeyError(f"unknown glyph dataset {name!r}; known: {', '.join(GLYPH_SETS)}")
    return GLYPH_SETS[name]()


def require_fonts(gs: GlyphSet) -> None:
    """FileNotFoundError naming the Debian packages to install when a face is missing."""
    if missing := gs.missing():
        packages = sorted({f.package for f in missing if f.package})
        hint = f"; install them with: apt-get install {' '.join(packages)}" if packages else ""
        raise FileNotFoundError(f"{gs.name} needs fonts that are not installed ({', '.join(f.path().name for f in missing)})"
                                + hint)


def render(font, char: str, rng: np.random.Generator | None = None, view: str = "plain",
           margin: float = CONTENT_MARGIN) -> np.ndarray:
    """One character, white on black, uint8 [SIZE, SIZE]; augmented when rng. `view`: "plain"
    (centred, about a third of the image), "content" (cropped to its content box plus `margin`,
    as `serving/bundle/image.py` crops an image body), "small" (plain, anywhere in the image) or
    "tight" (filling the image)."""
    from PIL import Image, ImageDraw, ImageFilter

    n = 2 * SIZE * max(1, round(font.size / FONT_SIZE))  # the canvas: twice the image, more for a larger font
    canvas = Image.new("L", (n, n), 0)
    draw = ImageDraw.Draw(canvas)
    x0, y0, x1, y1 = draw.textbbox((0, 0), char, font=font)
    draw.text(((n - (x1 - x0)) / 2 - x0, (n - (y1 - y0)) / 2 - y0), char, fill=255, font=font)
    if rng is not None:
        angle, scale = rng.uniform(-8, 8), rng.uniform(0.9, 1.1)
        dx, dy = rng.uniform(-2, 2, size=2) * n / (2 * SIZE)
        canvas = canvas.rotate(angle, resample=Image.BILINEAR, center=(n // 2, n // 2), translate=(dx, dy))
        canvas = canvas.resize((round(n * scale),) * 2, Image.BILINEAR)
        off = (canvas.width - n) // 2
        canvas = canvas.crop((off, off, off + n, off + n))
        stroke = (0, 0, 1, 2)[rng.integers(0, 4)]  # as drawn (half the time), thicker, thinner
        if stroke:
            canvas = canvas.filter(ImageFilter.MaxFilter(3) if stroke == 1 else ImageFilter.MinFilter(3))
    canvas = _view(canvas, view, margin, rng)
    img = np.asarray(canvas.resize((SIZE, SIZE), Image.LANCZOS), dtype=np.float32)  # [SIZE, SIZE]
    if rng is not None:
        img = img * rng.uniform(0.75, 1.0) + rng.uniform(0, 30)  # contrast, background
        img = img + rng.normal(0, rng.uniform(0, 8), img.shape)  # noise
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def font_size(view: str) -> int:
    """The font size to render `view` at: twice for a content crop, which enlarges the glyph about
    twice (a third of the image -> most of it), so its strokes keep their detail; so does "tight"."""
    return 2 * FONT_SIZE if view in ("content", "tight") else FONT_SIZE


def _view(canvas, view: str, margin: float, rng: np.random.Generator | None):
    """The rendered canvas [2·SIZE]² as `view` asks (see `render`)."""
    from serving.bundle.image import crop_to_content

    if view == "content":
        return crop_to_content(canvas, margin)
    if view == "tight":  # the glyph fills 90-100% of the image's side, off-centre by what is left
        crop = crop_to_content(canvas, 0.0)
        side = round(crop.width / (rng.uniform(0.9, 1.0) if rng is not None else 0.95))
        left, top = rng.integers(0, side - crop.width + 1, size=2) if rng is not None else ((side - crop.width) // 2,) * 2
        return crop.crop((-int(left), -int(top), side - int(left), side - int(top)))
    if view == "small":  # the plain rendering moved anywhere the glyph stays inside
        shift = rng.integers(-canvas.width // 4, canvas.width // 4 + 1, size=2) if rng is not None else (0, 0)
        return canvas.rotate(0, translate=(int(shift[0]), int(shift[1])))
    if view != "plain":
        raise ValueError(f"unknown glyph view {view!r}")
    return canvas


def distinct_chars(gs: GlyphSet) -> str:
    """The characters every face has, minus those rendering identically to an earlier one in a training face."""
    cmaps = [f.cmap() for f in gs.all_faces()]
    chars = [c for c in gs.chars if all(ord(c) in cmap for cmap in cmaps)]
    train_fonts = [f.load(font_size(gs.view("train"))) for f in gs.faces["train"]]
    seen_per_face: list[dict] = [dict() for _ in train_fonts]
    keep = []
    for c in chars:
        images = [render(font, c, view=gs.view("train")).tobytes() for font in train_fonts]
        if any(img in seen for img, seen in zip(images, seen_per_face)):
            continue  # a homoglyph of an earlier class
        for img, seen in zip(images, seen_per_face):
            seen[img] = c
        keep.append(c)
    return "".join(keep)


def _face_info(face: Face) -> dict:
    family, style = face.load().getname()
    return {"file": face.path().name, "family": family, "style": style, "index": face.index(),
            "package": face.package or "matplotlib"}


def _render_face(face: Face, chars: str, augment: int, view: str, seed: np.random.SeedSequence, path: Path,
                 start: int) -> int:
    """Worker: render one face's block (every character, `augment` times) into rows start.. of x at `path`."""
    rng = np.random.default_rng(seed)
    font = face.load(font_size(view))
    x = np.load(path, mmap_mode="r+", allow_pickle=False)
    i = start
    for c in chars:
        for _ in range(augment):
            x[i, 0] = render(font, c, rng, view)
            i += 1
    x.flush()
    return i - start


def build(name: str, out: Path, seed: int = 0, progress: bool = True, workers: int | None = None) -> Path:
    """Render every split of glyph set `name` into `out` (written aside, then moved into place).

    One block of rows per (split, face), rendered in parallel processes, each with its own seed
    spawned from `seed`: the arrays are the same whatever the number of workers."""
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm.auto import tqdm

    gs = glyph_set(name)
    require_fonts(gs)
    chars = distinct_chars(gs)
    stage = out.with_name(out.name + ".building")
    stage.mkdir(parents=True, exist_ok=True)
    manifest = {"format_version": FORMAT_VERSION, "name": name, "seed": seed, "size": SIZE, "classes": list(chars),
                "content_box": gs.content_box, "splits": {}}
    jobs = []  # _render_face arguments: (face, chars, augment, view, seed, x path, first row)
    seeds = iter(np.random.SeedSequence(seed).spawn(len(gs.all_faces())))
    for split, faces in gs.faces.items():
        per_face = len(chars) * gs.augment[split]
        path = stage / f"x_{split}.npy"
        np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(per_face * len(faces), 1, SIZE, SIZE)).flush()
        np.save(stage / f"y_{split}.npy", np.tile(np.repeat(np.arange(len(chars)), gs.augment[split]), len(faces)))
        np.save(stage / f"face_{split}.npy", np.repeat(np.arange(len(faces), dtype=np.int16), per_face))
        jobs += [(f, chars, gs.augment[split], gs.view(split), next(seeds), path, fi * per_face) for fi, f in enumerate(faces)]
        manifest["splits"][split] = {"examples": per_face * len(faces), "faces": [_face_info(f) for f in faces],
                                     "renderings_per_face": gs.augment[split], "view": gs.view(split)}
    total = sum(info["examples"] for info in manifest["splits"].values())
    with tqdm(total=total, desc=f"rendering {name}", unit="img", disable=not progress) as bar, \
            ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        futures = [pool.submit(_render_face, *job) for job in jobs]
        for done in as_completed(futures):
            bar.update(done.result())
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return output.replace_cache(stage, out, "glyph set")


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
    return manifest, {s: load_split(path, s) for s in SPLITS}


def load_split(path: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(x uint8 [N, 1, 32, 32] memory-mapped, y [N]) of one split of the arrays at `path`."""
    return np.load(path / f"x_{split}.npy", mmap_mode="r", allow_pickle=False), \
        np.load(path / f"y_{split}.npy", allow_pickle=False)


def glyph_names(path: Path) -> set[str] | None:
    """The names of a rendered glyph set in `path` (its manifest's splits' arrays); None: not one."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        names = {"manifest.json"} | {f"{k}_{split}.npy" for split in manifest["splits"] for k in ("x", "y", "face")}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return names if manifest.get("format_version") == FORMAT_VERSION else None


output.register(output.Kind("glyph set", glyph_names))
