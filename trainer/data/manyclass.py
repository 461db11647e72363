"""`strokes`: a synthetic many-class image set, glyph-like and cheap (tests/trainer/test_many_classes.py).

Each class is a random "character": 2-4 straight strokes between points of a 5 × 5 anchor grid
(strokes share anchors, so classes overlap in parts as real characters do). Every example renders
its class's strokes with its own random affine jitter (rotation, scale, shift), stroke width,
contrast and pixel noise, anti-aliased by distance to the segments, white on black, uint8
[N, 1, S, S]. No font is needed: it runs on any machine, with thousands of classes.

Name: `strokes` or `strokes:C=2000,n=10,size=16` (classes, renderings per class, image side);
the stratified 60/20/20 split of trainer.data gives each split its share of the renderings.
"""
from __future__ import annotations

import functools

import numpy as np

DEFAULTS = {"C": 2000, "n": 10, "size": 16}
GRID = 5  # anchors per side
MARGIN = 0.18  # anchors span [MARGIN, 1 − MARGIN] of the image


def parse(name: str) -> dict:
    """`strokes` or `strokes:C=..,n=..,size=..` -> keyword arguments (ValueError on a bad one)."""
    params = dict(DEFAULTS)
    _, _, spec = name.partition(":")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in params:
            raise ValueError(f"bad strokes parameter {item!r} in {name!r}; known: C, n, size")
        try:
            params[key] = int(value)
        except ValueError:
            raise ValueError(f"strokes parameter {key} must be an integer, got {value!r}") from None
    if params["C"] < 2 or params["n"] < 5 or params["size"] < 8:
        raise ValueError(f"strokes needs C >= 2, n >= 5 (per class), size >= 8; got {params}")
    return params


def templates(C: int, rng: np.random.Generator) -> np.ndarray:
    """Stroke endpoints of every class, [C, 4, 2, 2] in [0, 1] (class, stroke, end, xy); classes with
    fewer than 4 strokes repeat their last one. Distinct stroke sets per class (redrawn on a clash)."""
    anchors = np.stack(np.meshgrid(np.linspace(MARGIN, 1 - MARGIN, GRID), np.linspace(MARGIN, 1 - MARGIN, GRID)),
                       -1).reshape(-1, 2)  # [25, 2]
    pairs = np.array([(a, b) for a in range(len(anchors)) for b in range(a + 1, len(anchors))])  # [300, 2]
    seen: set[tuple] = set()
    out = np.empty((C, 4, 2, 2))
    c = 0
    while c < C:
        k = int(rng.integers(2, 5))
        chosen = tuple(sorted(rng.choice(len(pairs), size=k, replace=False).tolist()))
        if chosen in seen:
            continue
        seen.add(chosen)
        strokes = anchors[pairs[list(chosen)]]  # [k, 2, 2]
        out[c] = np.concatenate([strokes, np.repeat(strokes[-1:], 4 - k, 0)])
        c += 1
    return out


def render(strokes: np.ndarray, size: int, rng: np.random.Generator, chunk: int = 4096) -> np.ndarray:
    """Augmented renderings of strokes [N, 4, 2, 2] -> uint8 [N, 1, size, size]."""
    out = np.empty((len(strokes), 1, size, size), dtype=np.uint8)
    centre = ((np.arange(size) + 0.5) / size).astype(np.float32)
    pixels = np.stack(np.meshgrid(centre, centre), -1).reshape(-1, 2)  # [P, 2] (x, y)
    for s in range(0, len(strokes), chunk):
        seg = strokes[s:s + chunk].astype(np.float32) - 0.5  # [n, 4, 2, 2] about the centre
        n = len(seg)
        angle = np.deg2rad(rng.uniform(-10, 10, n))
        scale = rng.uniform(0.85, 1.1, n)
        rot = np.stack([np.cos(angle), -np.sin(angle), np.sin(angle), np.cos(angle)], -1).reshape(n, 1, 1, 2, 2).astype(np.float32)
        seg = (rot @ seg[..., None])[..., 0] * scale[:, None, None, None].astype(np.float32)  # [n, 4, 2, 2]
        seg = seg + 0.5 + rng.uniform(-1.5, 1.5, (n, 1, 1, 2)).astype(np.float32) / size
        a, b = seg[:, None, :, 0], seg[:, None, :, 1]  # [n, 1, 4, 2] segment ends
        p = pixels[None, :, None, :]  # [1, P, 1, 2]
        ab = b - a
        t = np.clip(((p - a) * ab).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-12), 0, 1)  # [n, P, 4]
        gap = p - (a + t[..., None] * ab)  # [n, P, 4, 2]
        dist = np.sqrt((gap * gap).sum(-1).min(-1)) * size  # [n, P] in pixels
        width = rng.uniform(0.6, 1.4, (n, 1))  # half-width in pixels
        ink = np.clip(width + 0.5 - dist, 0, 1)  # anti-aliased coverage
        img = ink * rng.uniform(180, 255, (n, 1)) + rng.uniform(0, 30, (n, 1))
        img = img + rng.normal(0, 1, img.shape) * rng.uniform(0, 12, (n, 1))
        out[s:s + chunk, 0] = np.clip(np.rint(img), 0, 255).astype(np.uint8).reshape(n, size, size)
    return out


@functools.lru_cache(maxsize=4)
def generate(C: int, n: int, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(x uint8 [C·n, 1, size, size], y int64 [C·n]): n renderings of each of C classes, seeded.
    Cached per process (read-only arrays): every run of a test session renders them once."""
    rng = np.random.default_rng(seed)
    shapes = templates(C, rng)  # [C, 4, 2, 2]
    y = np.repeat(np.arange(C), n)
    x = render(shapes[y], size, rng)
    x.flags.writeable = y.flags.writeable = False
    return x, y
