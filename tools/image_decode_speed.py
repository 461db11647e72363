"""Decode speed of imagefolder: 40 synthetic 12-megapixel JPEGs and 3,000 64x64 PNGs, first load in one process
(docs/results/image-decoding.md). `--before`: without REDUCE_GAP (every pixel decoded, one Lanczos resize)."""
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

tmp = Path(tempfile.mkdtemp())
os.environ["SLC_HOME"] = str(tmp / "home")
import serving.bundle.image  # noqa: E402
from trainer.data import imagefiles  # noqa: E402

if "--before" in sys.argv:  # the decoding before REDUCE_GAP: every pixel decoded, one Lanczos resize
    serving.bundle.image.REDUCE_GAP = 0

rng = np.random.default_rng(0)
yy, xx = np.mgrid[0:3000, 0:4000]
base = np.stack([(xx // 16) % 256, (yy // 12) % 256, ((xx + yy) // 20) % 256], -1).astype(np.int16)
for c in "ab":
    (tmp / "photos" / c).mkdir(parents=True)
    for i in range(20):
        img = np.clip(base + rng.integers(-20, 20, (1, 1, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(tmp / "photos" / c / f"{i}.jpg", quality=90)
for c in range(20):
    (tmp / "small" / str(c)).mkdir(parents=True)
    for i in range(150):
        Image.fromarray(rng.integers(0, 256, (64, 64), dtype=np.uint8)).save(tmp / "small" / str(c) / f"{i}.png")
for name, n in (("photos", 40), ("small", 3000)):
    t = time.perf_counter()
    s = imagefiles.load(f"imagefolder:{tmp / name}", progress=False, workers=1)
    first = time.perf_counter() - t
    t = time.perf_counter()
    imagefiles.load(f"imagefolder:{tmp / name}", progress=False)
    again = time.perf_counter() - t
    print(f"{name}: {n} files -> {s.input_shape}: first load {first:.2f} s ({n / first:.0f} img/s), cached {again:.3f} s")
shutil.rmtree(tmp)
