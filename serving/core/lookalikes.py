"""Look-alikes: pairs of classes of which an input matches only the one it passes by more (docs/api.md,
"Look-alikes"). Protocol-free, numpy only.

A class enrolled from a few examples is stored with its look-alikes: the classes whose detect said
yes to one of its examples, and each example's closest trained class and closest other enrolled
class (serving/core/engine.py, `enroll`). Without more, such a class goes on saying yes to the new
class's images. With the pair named, detect decides by margins m = z - t (logit minus the threshold
in effect): class j matches x when

    m_j(x) >= 0  and  m_j(x) >= m_r(x) for every look-alike r of j

(a tie matches both). A detect then reads 1 + |L(j)| rows, never D. Pairs come from the enrolled
classes of a snapshot (each enrolled id with the trained and served enrolled ids it names:
`PairIndex`, appended to as classes are enrolled) and from a folded bundle's calibration.json
(`lookalikes`: the same pairs, written by `slc bundle fold`); the relation is symmetric.
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterable

import numpy as np

NONE = np.zeros(0, dtype=np.int64)
DECISION_WITH_PAIRS = "match = logit >= threshold; of a lookalikes pair, the larger logit - threshold"  # calibration.json


class Lookalikes:
    """A symmetric relation over class ids: id -> its look-alikes' ids (sorted int64)."""

    def __init__(self, pairs: Iterable[tuple[int, int]] = ()):
        of: dict[int, set[int]] = {}
        for a, b in pairs:
            a, b = int(a), int(b)
            if a != b:
                of.setdefault(a, set()).add(b)
                of.setdefault(b, set()).add(a)
        self._of = {k: np.array(sorted(v), dtype=np.int64) for k, v in of.items()}
        self.keys = np.array(sorted(self._of), dtype=np.int64)  # every class that has a look-alike

    def __bool__(self) -> bool:
        return bool(self._of)

    def of(self, j: int) -> np.ndarray:
        """The look-alikes of class j (none: empty)."""
        return self._of.get(int(j), NONE)

    def has(self, ids: np.ndarray) -> np.ndarray:
        """bool mask of ids (any shape) that have a look-alike."""
        return np.isin(ids, self.keys)

    def pairs(self) -> list[list[int]]:
        """Each pair once, [smaller, larger], sorted."""
        return [[a, int(b)] for a in sorted(self._of) for b in self._of[a] if a < b]

    def merged(self, other):
        """This relation and another (a snapshot's `EnrolledPairs`) as one, built from neither."""
        if not other:
            return self
        if not self:
            return other
        return Union(self, other)


EMPTY = Lookalikes()


class Union:
    """Two relations read as one (a folded bundle's pairs and the enrolled classes')."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __bool__(self) -> bool:
        return bool(self.a) or bool(self.b)

    def of(self, j: int) -> np.ndarray:
        return np.union1d(self.a.of(j), self.b.of(j))

    def has(self, ids: np.ndarray) -> np.ndarray:
        return self.a.has(ids) | self.b.has(ids)


class PairIndex:
    """The enrolled classes' look-alikes, append-only like the snapshot buffers that hold it
    (serving/core/enrolled.py): position p (an enrolled class, in slot order) with the ids it names
    (trained ids, and enrolled ids of classes in the same buffers), and each named id's positions. An
    enrollment appends in O(its look-alikes), never O(n_e); each snapshot reads it through
    `EnrolledPairs`, its first n positions only."""

    def __init__(self, num_trained: int):
        self.num_trained = int(num_trained)
        self.lists: list[np.ndarray] = []  # per position: the ids it names, sorted
        self.count = np.zeros(16, dtype=np.int32)  # per position: how many
        self.named = np.zeros(16, dtype=bool)  # per position: some position names this enrolled class
        self.by_id: dict[int, list[int]] = {}  # named id -> the positions naming it, ascending
        self.flag: np.ndarray | None = None  # [D] bool: some position names this trained id (made at the first)

    def append(self, ids: Iterable[int], position_of: Callable[[int], int | None] = lambda _: None) -> None:
        """The next position, naming `ids`: trained ids of this model, and enrolled ids that
        `position_of` places in these buffers (an enrolled class deleted meanwhile, or of no snapshot of
        them, is left out; so is the class itself)."""
        p, D = len(self.lists), self.num_trained
        named = {}
        for i in ids:
            i = int(i)
            q = None if i < D else position_of(i)
            if 0 <= i < D or (q is not None and q != p):
                named[i] = q
        kept = np.array(sorted(named), dtype=np.int64)
        self.count, self.named = _room(self.count, p + 1), _room(self.named, 1 + max([p, *[q for q in named.values()
                                                                                          if q is not None]]))
        self.count[p] = len(kept)
        for i, q in named.items():
            self.by_id.setdefault(i, []).append(p)
            if q is not None:
                self.named[q] = True
        if (trained := kept[kept < D]).size:
            if self.flag is None:
                self.flag = np.zeros(D, dtype=bool)
            self.flag[trained] = True
        self.lists.append(kept)


def _room(a: np.ndarray, size: int) -> np.ndarray:
    """`a`, or a new array twice as long with it copied first when it is shorter than `size`: readers of
    the old one see one or the other, never a half-written array."""
    if size <= len(a):
        return a
    grown = np.zeros(max(size, 2 * len(a)), dtype=a.dtype)
    grown[:len(a)] = a
    return grown


class EnrolledPairs:
    """A snapshot's look-alike relation: the PairIndex's first n positions, slots [n] ascending; with
    `enrolled` False, its pairs of an enrolled and a trained class only (SLC_LOOKALIKES=trained)."""

    def __init__(self, index: PairIndex, n: int, slots: np.ndarray, enrolled: bool = True):
        self.index, self.n, self.slots, self.D, self.enrolled = index, n, slots, index.num_trained, enrolled
        self._any = bool(index.count[:n].any()) if n else False

    def __bool__(self) -> bool:
        return self._any

    def of(self, j: int) -> np.ndarray:
        """The look-alikes of class j in this snapshot: those its enrolled class names, and the
        enrolled classes of this snapshot that name it."""
        j = int(j)
        own = NONE
        if j >= self.D:
            pos = int(np.searchsorted(self.slots, j - self.D))
            if pos >= self.n or self.slots[pos] != j - self.D:
                return NONE
            own = self.index.lists[pos]
            if not self.enrolled:
                return own[own < self.D]
        positions = self.index.by_id.get(j)
        seen = positions[:bisect.bisect_left(positions, self.n)] if positions else ()  # those of this snapshot
        if not len(seen):
            return own
        naming = self.D + self.slots[seen]
        return naming if not len(own) else np.union1d(own, naming)

    def has(self, ids: np.ndarray) -> np.ndarray:
        """bool mask of ids (any shape) that may have a look-alike here: a trained or enrolled id that some
        enrolled class names (possibly one of a later snapshot: `of` then gives none), an enrolled id of
        this snapshot that names one."""
        ids = np.asarray(ids)
        out = np.zeros(ids.shape, dtype=bool)
        if not self._any:
            return out
        trained = (ids >= 0) & (ids < self.D)
        if self.index.flag is not None:
            out[trained] = self.index.flag[ids[trained]]
        enrolled = ids >= self.D
        if enrolled.any():
            slot = ids[enrolled] - self.D
            pos = np.minimum(np.searchsorted(self.slots, slot), self.n - 1)
            count, named = self.index.count, self.index.named
            out[enrolled] = (self.slots[pos] == slot) & ((count[pos] > 0) | (named[pos] & self.enrolled))
        return out


def exclude(match: np.ndarray, ids: np.ndarray, lookalikes, margins_of: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """The entries' matches with look-alikes applied.

    match, ids [n, k]: entry (i, c) of input i (bool, class id); margins_of(classes [r]) -> [n, r]
    float64: every input's margin z - t against those classes, all from one computation (the entries'
    own margins too: a pass's float32 logit beside a float64 rival would split a tie). An entry keeps
    its match unless one of its class's look-alikes has a margin above both its own and 0 (a look-alike
    that matches by more). Only the rows of matching entries' classes and their look-alikes are read.
    """
    if not lookalikes:
        return match
    candidates = match & lookalikes.has(ids)  # [n, k]
    if not candidates.any():
        return match
    classes = np.unique(ids[candidates])
    rivals = {int(c): lookalikes.of(c) for c in classes}
    if not any(len(r) for r in rivals.values()):
        return match
    every = np.unique(np.concatenate([classes, *rivals.values()]))  # [r]: the classes and their look-alikes
    margin = np.asarray(margins_of(every), dtype=np.float64)  # [n, r]
    out = np.array(match, dtype=bool, copy=True)
    for i, e in zip(*np.nonzero(candidates)):
        c = int(ids[i, e])
        own = max(float(margin[i, np.searchsorted(every, c)]), 0.0)
        if (margin[i, np.searchsorted(every, rivals[c])] > own).any():
            out[i, e] = False
    return out


def outmatched(h: np.ndarray, weight, bias: np.ndarray, thr: np.ndarray,
               lookalikes: Lookalikes, block_values: int = 1 << 21) -> tuple[np.ndarray, np.ndarray]:
    """`exclude` for every class of a head at once (slc calibrate's figures): (keys [K]: the classes
    0..D-1 with a look-alike, lost [N, K] bool: embedding h[i]'s margin z - t on class keys[k] is below
    that of one of its look-alikes). Only the K rows of classes in a pair are read (the relation is
    symmetric: every look-alike is a key too), their margins in blocks of about `block_values` numbers."""
    D = len(thr)
    keys = lookalikes.keys[lookalikes.keys < D]
    n = len(h)
    if not len(keys):
        return keys, np.zeros((n, 0), dtype=bool)
    rivals = [lookalikes.of(c) for c in keys]
    rivals = [np.searchsorted(keys, r[r < D]) for r in rivals]  # each key's look-alikes as columns of keys
    has = np.array([len(r) > 0 for r in rivals])
    flat = np.concatenate([r for r in rivals if len(r)])
    starts = np.cumsum([0] + [len(r) for r in rivals if len(r)])[:-1]
    w = np.concatenate([np.asarray(weight[k:k + 1], dtype=np.float64) for k in keys.tolist()])  # [K, d]
    b = np.asarray(bias, dtype=np.float64)[keys] - thr[keys]  # [K]
    lost = np.zeros((n, len(keys)), dtype=bool)
    step = max(1, block_values // max(len(keys) + len(flat), 1))
    for i in range(0, n, step):
        m = np.asarray(h[i:i + step], dtype=np.float64) @ w.T + b  # [n_i, K] margins
        best = np.maximum.reduceat(m[:, flat], starts, axis=1)  # [n_i, K'] each key's highest look-alike margin
        lost[i:i + step, has] = best > m[:, has]
    return keys, lost


def from_calibration(calibration: dict, num_classes: int) -> Lookalikes:
    """A bundle's pairs (calibration.json `lookalikes.pairs`, checked: serving/bundle/calibration.py)."""
    pairs = ((calibration or {}).get("lookalikes") or {}).get("pairs") or []
    return Lookalikes((a, b) for a, b in pairs if 0 <= a < num_classes and 0 <= b < num_classes)
