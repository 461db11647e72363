"""Logits in class chunks: the one way calibration reads a head's D columns without [N, D] in memory.

A `Chunks` is a function of no arguments that yields (first class id, logits [N, c]) in class order,
covering classes 0..D-1; it is called once per pass, so a head is streamed as often as a rule needs.
A `Logits` is what calibration passes around: the chunks with the labels of their rows, the number of
classes and the progress bar, iterated one pass at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterable, Iterator

import numpy as np

# logits per class chunk: [N, c] float64 is 16 MiB; a pass holds a few such arrays (the pooled counts sort a copy)
CHUNK_VALUES = 2 * 1024 * 1024

# () -> iterable of (first class id, logits [N, c] of classes first..first+c-1), in class order, covering 0..D-1;
# called once per pass
Chunks = Callable[[], Iterable[tuple[int, np.ndarray]]]


def chunk_classes(n: int, num_classes: int, values: int = CHUNK_VALUES) -> int:
    """Classes per chunk so that a chunk's logits [n, c] hold about `values` numbers."""
    return int(max(1, min(num_classes, values // max(n, 1))))


def dense_chunks(logits: np.ndarray, chunk: int) -> Chunks:
    """`Chunks` of a dense logit matrix [N, D]: column slices, `chunk` classes at a time."""
    def gen():
        for first in range(0, logits.shape[1], chunk):
            yield first, logits[:, first:first + chunk]  # [N, c] view
    return gen


def head_chunks(h: np.ndarray, weight: np.ndarray, bias: np.ndarray, chunk: int = 1024) -> Chunks:
    """`Chunks` from embeddings h [N, d] and a head W [D, d], b [D]: logits of `chunk` classes at a time,
    in float64."""
    def gen():
        for first in range(0, weight.shape[0], chunk):
            w = np.asarray(weight[first:first + chunk], dtype=np.float64)  # [c, d]
            yield first, h @ w.T + np.asarray(bias[first:first + chunk], dtype=np.float64)  # [N, c]
    return gen


@dataclass(eq=False)
class Logits:
    """The logits being calibrated: where they come from (`chunks`), the labels y [N] of their rows, the
    number of classes D they must cover, and the progress bar each pass advances (or None).

    `for first, z in logits` is one pass: float64 [N, c] class chunks, checked to cover classes 0..D-1
    in order with N rows; `logits.true` is each row's own logit [N], read in one pass the first time."""

    chunks: Chunks
    y: np.ndarray
    num_classes: int
    bar: object = None

    def __post_init__(self):
        self.y = np.asarray(self.y, dtype=np.int64)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        expected, n, num_classes = 0, len(self.y), self.num_classes
        for first, z in self.chunks():
            z = np.asarray(z, dtype=np.float64)  # [N, c]
            if first != expected or z.ndim != 2 or z.shape[0] != n or first + z.shape[1] > num_classes:
                raise ValueError(f"class chunks must cover classes 0..{num_classes - 1} in order with {n} rows; "
                                 f"got shape {z.shape} at class {first}, expected class {expected}")
            yield first, z
            expected += z.shape[1]
            if self.bar is not None:
                self.bar.update(z.shape[1])
        if expected != num_classes:
            raise ValueError(f"class chunks ended at class {expected}, expected {num_classes}")

    @cached_property
    def true(self) -> np.ndarray:
        """Each row's own logit [N] (NaN for a label no chunk covered), from one pass."""
        true = np.full(len(self.y), np.nan)
        for first, z in self:
            local = self.y - first
            mine = (local >= 0) & (local < z.shape[1])
            true[mine] = z[mine, local[mine]]
        return true

    def positive(self, first: int, c: int) -> np.ndarray:
        """[N, c] bool: row i is of class first + k."""
        return (self.y - first)[:, None] == np.arange(c)[None, :]

    def checked(self) -> Logits:
        """These logits, their labels checked: int64 [N], N > 0, each a class 0..D-1 (ValueError else)."""
        y = self.y
        if y.ndim != 1 or len(y) == 0:
            raise ValueError("no calibration examples" if y.size == 0 else f"y_cal must be [N], got shape {y.shape}")
        if y.min() < 0 or y.max() >= self.num_classes:
            raise ValueError(f"labels outside 0..{self.num_classes - 1}")
        return self
