"""Row adaptation that does not forget (issue 50, part 4): `slc calibrate --adapt-rows` fitted against
the bundle's own calibration examples (calibration_embeddings.npy: the faces it was calibrated on at
export) as well as the user's images. numpy only.

Moving every row toward a new face's images (adapt.py) and setting thresholds on those images alone
lifts that face, but what the bundle recognised before can fall: the moved rows score the old faces'
positives lower and their negatives higher, and thresholds read off the new face never see it. Two
things keep it:

1. **Each row's step is bounded by what it costs the kept examples.** Row j moves by the largest of
   beta * KEEP_FRACTIONS at which no kept positive of class j that reached the bundle-side threshold
   falls below it: the column standardised, as the norm rule does, by its highest kept negatives
   under the moved row, against tau_keep, the norm rule's tau on the kept examples under the
   bundle's own rows at the target. A row that would forget is held back (to no move at all).
2. **The thresholds hold on both.** The norm rule runs on the user's images and the kept ones
   together (each column standardised by the highest negatives of both); tau is cross-fitted per
   set and the higher taken, so the target holds on the user's face and on the kept faces alike,
   not only pooled (norm.py `CrossFit` groups).

Cross-fitting as in adapt.py: the halves are dealt per set; each half is scored under rows adapted
on the other half's user images and bounded by the other half's kept examples.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serving.calibration.adapt import AdaptedRows, directions
from serving.calibration.chunks import Chunks, Logits, chunk_classes, head_chunks
from serving.calibration.defaults import BETAS, KEEP_EXAMPLES, KEEP_FRACTIONS, NORM_K
from serving.calibration.norm import CrossFit, cross_choices, halves, norm_thresholds, top_stats


@dataclass
class Kept:
    """The bundle's own calibration examples, as the fit keeps them."""

    h: np.ndarray  # [n, d] float64 embeddings (a seeded sample of at most KEEP_EXAMPLES)
    y: np.ndarray  # [n] int64 classes
    tau: float  # the norm rule's standardised threshold on them under the bundle's rows, at the target


def kept_examples(h: np.ndarray, y: np.ndarray, weight, bias, target: dict, limit: int = KEEP_EXAMPLES,
                  seed: int = 0) -> Kept:
    """The kept examples (a uniform seeded sample of at most `limit`) and their tau_keep."""
    y = np.asarray(y, dtype=np.int64)
    pick = np.sort(np.random.default_rng(seed).choice(len(y), limit, replace=False)) if len(y) > limit \
        else np.arange(len(y))
    hk, yk = np.asarray(h, dtype=np.float64)[pick], y[pick]
    record: dict = {}
    norm_thresholds(_chunks(hk, weight, bias, len(yk)), yk, len(weight), target, record=record)
    return Kept(hk, yk, float(np.mean([c["threshold"] for c in record["halves"]])))


def _chunks(h: np.ndarray, rows, bias, n: int) -> Chunks:
    return head_chunks(np.asarray(h, dtype=np.float64), rows, bias, chunk_classes(n, rows.shape[0]))


def _passing(z: np.ndarray, positive: np.ndarray, tau: float, k: int) -> np.ndarray:
    """[c] positives per column whose score, standardised by the column's k highest negatives, reaches tau."""
    mu, sd, _ = top_stats(z, positive, k)
    return (positive & ((z - mu) / sd >= tau)).sum(axis=0)


def row_steps(weight, bias, ids: np.ndarray, dirs: np.ndarray, beta: float, h: np.ndarray, y: np.ndarray,
              tau: float, k: int = NORM_K) -> np.ndarray:
    """[n] each row's step: the largest of beta * KEEP_FRACTIONS at which no kept example (h [m, d],
    y [m]) of its class that reached tau before falls below it (module docstring, 1)."""
    steps = np.zeros(len(ids))
    if beta == 0 or len(ids) == 0 or len(y) == 0:
        return steps
    h = np.asarray(h, dtype=np.float64)
    chunk = chunk_classes(4 * len(y), len(ids))  # a few [m, c] arrays live at once
    for lo in range(0, len(ids), chunk):
        sel = ids[lo:lo + chunk]
        w = np.asarray(weight[sel[0]:sel[-1] + 1], dtype=np.float64)[sel - sel[0]]  # [c, d] (slices: memmaps)
        z0 = h @ w.T + np.asarray(bias, dtype=np.float64)[sel]  # [m, c]
        g = (h @ np.asarray(dirs[lo:lo + chunk], dtype=np.float64).T) * np.linalg.norm(w, axis=1)  # [m, c]
        positive = y[:, None] == sel[None, :]
        before = _passing(z0, positive, tau, k)
        best = np.zeros(len(sel))
        for f in sorted(KEEP_FRACTIONS):  # the largest that keeps wins
            best = np.where(_passing(z0 + f * beta * g, positive, tau, k) >= before, f * beta, best)
        steps[lo:lo + chunk] = best
    return steps


def adapt(weight, bias, h: np.ndarray, y: np.ndarray, beta: float, kh: np.ndarray, ky: np.ndarray, tau: float,
          k: int = NORM_K) -> AdaptedRows:
    """adapt.adapt's rows, each step bounded by the kept examples kh [m, d], ky [m]."""
    ids, dirs = directions(h, y)
    return AdaptedRows(weight, ids, dirs, beta, row_steps(weight, bias, ids, dirs, beta, kh, ky, tau, k))


def union(h: np.ndarray, y: np.ndarray, kept: Kept) -> tuple[np.ndarray, np.ndarray]:
    """(the user's images then the kept ones [n + m, d] float64, their classes [n + m])."""
    return (np.concatenate([np.asarray(h, dtype=np.float64), kept.h]),
            np.concatenate([np.asarray(y, dtype=np.int64), kept.y]))


def cross_chunks(h: np.ndarray, y: np.ndarray, weight, bias, beta: float, kept: Kept) -> CrossFit:
    """Per half (dealt per set), the logits of all the union's examples under the rows adapted on the
    other half's user images, bounded by the other half's kept examples; with the halves and groups
    (0: the user's images, 1: the kept ones) the norm rule chooses tau on."""
    y = np.asarray(y, dtype=np.int64)
    h_all, _ = union(h, y, kept)
    user, keep = halves(y), halves(kept.y)
    chunks = []
    for u, m in zip(user[::-1], keep[::-1]):
        k = max(2, round(NORM_K * len(m) / max(len(kept.y), 1)))
        rows = adapt(weight, bias, h[u], y[u], beta, kept.h[m], kept.y[m], kept.tau, k)
        chunks.append(_chunks(h_all, rows, bias, len(h_all)))
    parts = [np.concatenate([u, len(y) + m]) for u, m in zip(user, keep)]
    return CrossFit(chunks, parts, np.repeat([0, 1], [len(y), len(kept.y)]))


def thresholds(h: np.ndarray, y: np.ndarray, weight, bias, beta: float, target: dict, kept: Kept, bar=None,
               record: dict | None = None) -> tuple[AdaptedRows, np.ndarray]:
    """(the rows adapted on all the user's images, bounded by all kept examples; the norm rule's
    thresholds [D] for them on the union, tau the higher of the two sets' cross-fitted choices)."""
    rows = adapt(weight, bias, h, y, beta, kept.h, kept.y, kept.tau)
    h_all, y_all = union(h, y, kept)
    t = norm_thresholds(_chunks(h_all, rows, bias, len(y_all)), y_all, rows.shape[0], target, bar,
                        cross=cross_chunks(h, y, weight, bias, beta, kept), record=record)
    return rows, t


def choose_beta(h: np.ndarray, y: np.ndarray, weight, bias, target: dict, kept: Kept, bar=None,
                betas: tuple[float, ...] = BETAS) -> tuple[float, list[dict]]:
    """(beta, every candidate's halves' mean recall of the user's images and lowest set precision at
    their cross-fitted tau): the most recall wins (ties: the smaller step)."""
    _, y_all = union(h, y, kept)
    scores = []
    for beta in betas:
        cross = cross_chunks(h, y, weight, bias, beta, kept)
        halves_ = cross_choices([Logits(c, y_all, len(weight), bar) for c in cross], cross.parts, NORM_K, target,
                                cross.groups)
        scores.append({"beta": float(beta), "recall": float(np.mean([c["recall"] for c in halves_])),
                       "precision": float(np.mean([c["precision"] for c in halves_]))})
    best = max(scores, key=lambda s: (round(s["recall"], 9), -s["beta"]))
    return best["beta"], scores
