"""Row adaptation (`slc calibrate --adapt-rows`): each class's head row moved toward the user's own
images of it, then the norm rule's thresholds for the moved rows.

Why: on a face unlike the training ones, a class's positives score low against its row, and no
threshold read off 2 positives per class can tell which classes those are (docs/calibration.md,
"Adapting the rows"). The user's images say where the class's embeddings now lie:

    w'_j = w_j + beta · |w_j| · unit(m_j − m),   m_j: the mean embedding of class j's images,
                                                 m: the mean over all the images given,

a step toward the class's own direction, in units of the row's length (so the step means the same
for every class), centred so that what all the images share (the face's style) moves no row. A
class without an image keeps its row. The bias is kept.

The thresholds are the norm rule's (norm.py), with tau cross-fitted through the
adaptation: each half of the images is standardised and scored under rows adapted on the *other*
half, so no image judges a row it moved. beta is chosen the same way: the candidate whose halves
recall the most at the target (ties: the smaller step). numpy only.
"""
from __future__ import annotations

import numpy as np

from serving.calibration.chunks import Chunks, Logits, chunk_classes, head_chunks
from serving.calibration.defaults import BETAS, NORM_K
from serving.calibration.norm import cross_choices, halves, norm_thresholds


class AdaptedRows:
    """The head W [D, d] with the rows of `ids` moved by beta · |w_j| · dirs: read by slices as a
    numpy array would be (float32), never materialised whole. `steps` [n], when given, is each
    row's own step instead of beta (keep.py bounds them)."""

    def __init__(self, weight, ids: np.ndarray, dirs: np.ndarray, beta: float, steps: np.ndarray | None = None):
        self.weight, self.beta = weight, float(beta)
        self.ids = np.asarray(ids, dtype=np.int64)  # [n] ascending
        self.dirs = np.asarray(dirs, dtype=np.float32)  # [n, d] unit vectors
        self.steps = None if steps is None else np.asarray(steps, dtype=np.float64).reshape(-1, 1)  # [n, 1]
        self.shape = tuple(weight.shape)
        self.dtype = np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise IndexError("AdaptedRows takes contiguous slices")
        w = np.array(self.weight[start:stop], dtype=np.float32)  # [c, d] a copy
        lo, hi = np.searchsorted(self.ids, [start, stop])
        local = self.ids[lo:hi] - start
        norms = np.linalg.norm(w[local].astype(np.float64), axis=1, keepdims=True)  # [n_c, 1]
        step = self.beta if self.steps is None else self.steps[lo:hi]
        w[local] = (w[local] + step * norms * self.dirs[lo:hi]).astype(np.float32)
        return w


def directions(h: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(class ids [n] ascending, unit directions [n, d]) of the classes with images: each class's mean
    embedding minus the mean of all, normalised (a zero difference gives a zero direction)."""
    h = np.asarray(h, dtype=np.float64)
    ids, inverse = np.unique(np.asarray(y, dtype=np.int64), return_inverse=True)
    means = np.zeros((len(ids), h.shape[1]))
    np.add.at(means, inverse, h)
    means /= np.bincount(inverse, minlength=len(ids))[:, None]
    diff = means - h.mean(axis=0)  # [n, d]
    norm = np.linalg.norm(diff, axis=1, keepdims=True)
    return ids, np.where(norm > 0, diff / np.maximum(norm, 1e-300), 0.0)


def adapt(weight, h: np.ndarray, y: np.ndarray, beta: float) -> AdaptedRows:
    return AdaptedRows(weight, *directions(h, y), beta)


def _chunks(h: np.ndarray, rows, bias, n: int) -> Chunks:
    return head_chunks(np.asarray(h, dtype=np.float64), rows, bias, chunk_classes(n, rows.shape[0]))


def cross_chunks(h: np.ndarray, y: np.ndarray, weight, bias, beta: float) -> list[Chunks]:
    """Per half of the images (threshold_norm.halves), the logits of all images under the rows
    adapted on the other half: what that half's tau is chosen on."""
    y = np.asarray(y, dtype=np.int64)
    return [_chunks(h, adapt(weight, h[other], y[other], beta), bias, len(y)) for other in halves(y)[::-1]]


def thresholds(h: np.ndarray, y: np.ndarray, weight, bias, beta: float, target: dict, bar=None,
               record: dict | None = None) -> tuple[AdaptedRows, np.ndarray]:
    """(the rows adapted on all images, the norm rule's thresholds [D] for them), tau cross-fitted
    through the adaptation (module docstring)."""
    y = np.asarray(y, dtype=np.int64)
    rows = adapt(weight, h, y, beta)
    t = norm_thresholds(_chunks(h, rows, bias, len(y)), y, rows.shape[0], target, bar,
                        cross=cross_chunks(h, y, weight, bias, beta), record=record)
    return rows, t


def choose_beta(h: np.ndarray, y: np.ndarray, weight, bias, target: dict, bar=None,
                betas: tuple[float, ...] = BETAS) -> tuple[float, list[dict]]:
    """(beta, every candidate's halves' mean recall and precision at their cross-fitted tau)."""
    y = np.asarray(y, dtype=np.int64)
    parts = halves(y)
    scores = []
    for beta in betas:
        cross = [Logits(c, y, len(weight), bar) for c in cross_chunks(h, y, weight, bias, beta)]
        halves_ = cross_choices(cross, parts, NORM_K, target)
        scores.append({"beta": float(beta), "recall": float(np.mean([c["recall"] for c in halves_])),
                       "precision": float(np.mean([c["precision"] for c in halves_]))})
    best = max(scores, key=lambda s: (round(s["recall"], 9), -s["beta"]))
    return best["beta"], scores
