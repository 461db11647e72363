"""What a bundle's thresholds give on `slc calibrate`'s images (the recipe: recalibrate.py): each image's
true match and false matches as detect decides them (logit >= threshold, class chunk by class chunk,
and with the bundle's look-alike pairs, the server's exclusion: of two look-alikes an image matches only
the one whose margin logit - threshold is larger, a tie both: serving/core/lookalikes.py), pooled
precision and recall over (image, class) pairs with a bootstrap interval over images, on the images
fitted on and the test images; before and after a recalibration. numpy only.
"""
from __future__ import annotations

import numpy as np

from serving.calibration.chunks import CHUNK_VALUES, chunk_classes, head_chunks
from serving.core.lookalikes import EMPTY, Lookalikes, outmatched

DRAWS, LEVEL = 1000, 0.95  # bootstrap of the pooled precision and recall


def per_image_counts(h: np.ndarray, y: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                     threshold: np.ndarray, lookalikes: Lookalikes = EMPTY) -> tuple[np.ndarray, np.ndarray]:
    """(true match [N] 0/1, false matches [N]) of each image at thresholds [D], as detect decides
    (logit >= threshold, and with `lookalikes`, no match of a class whose look-alike the image passes
    by more: outmatched), over class chunks."""
    tp, fp = np.zeros(len(y), np.int64), np.zeros(len(y), np.int64)
    chunk = chunk_classes(len(y), len(weight))
    thr = np.where(np.isfinite(threshold), threshold, np.inf).astype(np.float64)
    h = np.asarray(h, dtype=np.float64)
    keys, lost = outmatched(h, weight, bias, thr, lookalikes, CHUNK_VALUES)
    for first, z in head_chunks(h, weight, bias, chunk)():  # z [N, c]
        match = z >= thr[first:first + z.shape[1]]  # [N, c]
        lo, hi = np.searchsorted(keys, [first, first + z.shape[1]])
        if hi > lo:
            match[:, keys[lo:hi] - first] &= ~lost[:, lo:hi]
        local = y - first
        mine = (local >= 0) & (local < z.shape[1])
        own = np.zeros(len(y), bool)
        own[mine] = match[np.flatnonzero(mine), local[mine]]
        tp += own
        fp += match.sum(axis=1) - own
    return tp, fp


def pooled(tp: np.ndarray, fp: np.ndarray, seed: int = 0) -> dict:
    """Precision and recall over all (image, class) pairs, with a bootstrap interval over images
    (DRAWS resamples, LEVEL): images are the independent units, an image's pairs are not."""
    n, rng = len(tp), np.random.default_rng(seed)
    block = max(1, (1 << 22) // max(n, 1))
    prec, rec = [], []
    for start in range(0, DRAWS, block):
        idx = rng.integers(0, n, (min(block, DRAWS - start), n))  # [b, n]
        t, f = tp[idx].sum(axis=1), fp[idx].sum(axis=1)
        prec.append(np.where(t + f > 0, t / np.maximum(t + f, 1), 1.0))
        rec.append(t / n)
    q = [(1 - LEVEL) / 2, (1 + LEVEL) / 2]
    t, f = int(tp.sum()), int(fp.sum())
    return {"images": n, "matches": t + f, "true_matches": t,
            "precision": t / (t + f) if t + f else 1.0, "precision_interval": np.quantile(np.concatenate(prec), q).tolist(),
            "recall": t / n, "recall_interval": np.quantile(np.concatenate(rec), q).tolist(),
            "interval": f"{LEVEL:.0%} bootstrap over images ({DRAWS} draws, seed {seed})"}


def previous_thresholds(calibration: dict) -> np.ndarray:
    """[D] float32 the thresholds of a bundle's `calibration` (NaN where an entry had none)."""
    return np.array([np.nan if e.get("threshold") is None else e["threshold"]
                     for e in calibration["per_class"]], dtype=np.float32)


def measure(h: np.ndarray, y: np.ndarray, h_test, y_test, weight, bias: np.ndarray, threshold: np.ndarray,
            rates_only: bool = False, lookalikes: Lookalikes = EMPTY) -> dict:
    """Pooled precision and recall at `threshold` [D] of rows `weight` [D, d] (with the bundle's
    `lookalikes` applied, as the server decides), on the fit images and on the test images when there
    are some: with bootstrap intervals, or (rates_only) the two rates alone, the "before" of each
    summary line (a recall that fell reads as a regression without the precision it bought)."""
    def one(hh, yy) -> dict:
        tp, fp = per_image_counts(hh, yy, weight, bias, threshold, lookalikes)
        if not rates_only:
            return pooled(tp, fp)
        t, f = int(tp.sum()), int(fp.sum())
        return {"precision": t / (t + f) if t + f else 1.0, "recall": t / max(len(tp), 1)}

    report = {"fit": one(h, y)}
    if y_test is not None and len(y_test):
        report["test"] = one(h_test, y_test)
    return report
