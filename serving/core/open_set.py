"""Open-set decisions over many classes at once (issue 51): the threshold each class decides with,
gathered for a top-k's entries or a set of named classes, by detect's rule (docs/api.md): the
class's calibrated threshold (serving/core/calibration.py's `Thresholds`, the object a calibration
reload swaps, so detect and these answers always decide with the same values), an enrolled class's
own threshold, or the request's `threshold` for every class; and between look-alikes, the larger margin
(serving/core/lookalikes.py). Protocol-free, numpy only."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from serving.core.calibration import Thresholds
from serving.core.enrolled import Enrolled
from serving.core.lookalikes import Lookalikes, exclude


def thresholds_of(cal: Thresholds, snap: Enrolled, ids: np.ndarray, threshold: Optional[float] = None) -> np.ndarray:
    """float64 thresholds of class ids (any shape; D + slot for enrolled ones; -1, no class: +inf)."""
    ids = np.asarray(ids, dtype=np.int64)
    if threshold is not None:
        return np.where(ids >= 0, float(threshold), np.inf)
    D = cal.threshold.shape[0]
    out = np.full(ids.shape, np.inf)
    trained = (ids >= 0) & (ids < D)
    out[trained] = cal.of_classes(ids[trained])
    enrolled = ids >= D
    if enrolled.any() and snap.n:
        pos = np.searchsorted(snap.slots, ids[enrolled] - D)  # the snapshot's slots ascend
        pos = np.minimum(pos, snap.n - 1)
        found = snap.slots[pos] == ids[enrolled] - D
        out[enrolled] = np.where(found, snap.values(1)[pos], np.inf)
    return out


def lowest_threshold(cal: Thresholds, snap: Enrolled, threshold: Optional[float] = None) -> float:
    """The least threshold any class decides with: a logit below it matches no class at all."""
    if threshold is not None:
        return float(threshold)
    low = cal.lowest
    return min(low, float(snap.values(1).min())) if snap.n else low


def complete_rows(logits: np.ndarray, ids: np.ndarray, lowest: float, every_class: bool) -> list[bool]:
    """Per row of an exact top-k (logits, ids [n, k], best first, id -1: no entry): whether every
    class that matches is among its entries. True when the k entries are every class, or when the
    last entry's logit is below the lowest threshold (every class past it scores no higher)."""
    if every_class:
        return [True] * len(logits)
    valid = ids >= 0
    last = np.where(valid.any(axis=1), np.where(valid, logits, np.inf).min(axis=1), -np.inf)
    return (last < lowest).tolist()


class Decider:
    """detect's rule for one request's entries: logit >= threshold and, between look-alikes, the larger
    margin. `margins_of(h, rivals [r]) -> [n, r]`: the inputs' margins against classes (rows read: r, not D)."""

    def __init__(self, pairs: Lookalikes, margins_of: Callable[[np.ndarray, np.ndarray], np.ndarray]):
        self.pairs, self._margins_of = pairs, margins_of

    @property
    def reads_embeddings(self) -> bool:
        """Whether deciding needs the inputs' embeddings (some class has a look-alike)."""
        return bool(self.pairs)

    def margins_of(self, h: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """classes [r] -> [n, r]: the margins of the inputs' embeddings h [n, d] (what `exclude` reads)."""
        return lambda classes: self._margins_of(h, classes)

    def touches(self, class_id: int) -> bool:
        """Whether the class has a look-alike (else its matches are logit >= threshold alone)."""
        return len(self.pairs.of(class_id)) > 0

    def __call__(self, h: Optional[np.ndarray], ids: np.ndarray, z: np.ndarray, thr: np.ndarray) -> np.ndarray:
        """match [n, k] of entries (class ids, float64 logits, thresholds [n, k]); h [n, d] the inputs'
        embeddings (read only when an entry's class has a look-alike)."""
        match = z >= thr
        if not self.pairs:
            return match
        return exclude(match, np.asarray(ids), self.pairs, self.margins_of(h))
