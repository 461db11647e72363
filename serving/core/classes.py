"""The classes a model answers for, apart from the queries that score them: the trained ones (the
bundle's head rows and their calibration, reloaded whole) and the enrolled ones (the snapshot of the
store a request reads once). A request names its classes here (by name, id, or an enrolled class's)
and reads their rows and thresholds from one calibration and one snapshot."""
from __future__ import annotations

import asyncio
import difflib
import re
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from serving.bundle.names import IdNames, refused_character, shown
from serving.core.calibration import Thresholds, reload as reload_thresholds
from serving.core.enrolled import Enrolled, EnrolledClasses, empty_snapshot
from serving.core.enrollment import Rival, no_rival
from serving.core.lookalikes import EMPTY, Lookalikes
from serving.core.open_set import Decider, thresholds_of
from serving.errors import InvalidInput, NotFound, SlcError

SUGGEST_MAX = 5_000  # names an unknown one is compared with (difflib, on the event loop: bounded)


def unknown_class(ref: str, trained: Sequence, enrolled: list[str], num_classes: int) -> str:
    """The 404's one line: the names nearest to `ref` (difflib) or a few of them, and a case hint
    when a name differs from it in case only. Names "0".."D-1" (IdNames) are not listed: the id range says it."""
    names = list(enrolled) if isinstance(trained, IdNames) or len(trained) > SUGGEST_MAX else [*trained, *enrolled]
    folded = ref.casefold()
    same = [n for n in names if n.casefold() == folded]
    close = [n for n in difflib.get_close_matches(ref, names, n=4, cutoff=0.5) if n not in same]
    if same:
        hint = f"did you mean {' or '.join(map(repr, same[:3]))}? class names are case-sensitive"
    elif close:
        hint = f"nearest names: {', '.join(map(repr, close[:3]))}"
    elif names:
        hint = f"the names are {', '.join(map(repr, names[:5]))}{', …' if len(names) > 5 else ''}"
    else:
        hint = "the classes are named by their ids"
    return (f"unknown class {ref!r}: {hint} (a class name, an id 0..{num_classes - 1}, or an enrolled class's "
            "name or id)")


_DECIMAL_ID = re.compile(r"-?[0-9]{1,18}")  # a class path that reads as an id (serving/bundle/loader.py's rule)


@dataclass
class ClassRef:
    """A resolved class: trained (pos None) or enrolled (its position in `enrolled`, the snapshot it was found in)."""

    id: int
    name: str
    enrolled: Optional[Enrolled] = None
    pos: Optional[int] = None


class ClassRegistry:
    """One model's classes: `calibration` (thresholds, Platt parameters, global fallback) is one object
    swapped whole by a reload, and `snapshot()` the enrolled classes now; a query reads each once, so it
    decides with all old or all new values."""

    def __init__(self, bundle, enrolled: Optional[EnrolledClasses], settings):
        self.bundle, self.enrolled, self.settings = bundle, enrolled, settings
        self.num_classes = int(bundle.num_classes)
        # the per-class arrays as plain ndarray views (the head stays mapped): indexing a np.memmap
        # runs Python code per access, and detect reads five of them per request
        self.weight = np.asarray(bundle.weight)
        self.bias = np.asarray(bundle.bias)
        self.calibration = Thresholds.of_bundle(bundle)
        self._reload_lock = threading.Lock()
        self._no_enrolled = empty_snapshot(self.num_classes, int(bundle.embed_dim))

    def snapshot(self) -> Enrolled:
        """The enrolled classes a request answers with (read once per request)."""
        return self.enrolled.snapshot if self.enrolled is not None else self._no_enrolled

    def resolve_class(self, ref: str, snap: Optional[Enrolled] = None) -> ClassRef:
        """A class name from the manifest, else an integer id (Bundle.class_id's rule), else an enrolled
        class's name or id (D + slot); NotFound otherwise. `snap`: the request's enrolled snapshot."""
        snap = snap if snap is not None else self.snapshot()
        try:
            j = self.bundle.class_id(ref)
            return ClassRef(j, str(self.bundle.classes[j]))
        except KeyError:
            pass
        pos = snap.find(ref) if snap.n else None
        if pos is None and snap.n and _DECIMAL_ID.fullmatch(ref):
            pos = snap.position_of_id(int(ref))
        if pos is None and (bad := refused_character(ref)):  # no class can have it: the name is wrong, not unknown
            raise InvalidInput(f"the class name {shown(ref)} holds {bad}, which no class name holds",
                               code="invalid_class_name")
        if pos is None:
            enrolled = [snap.name(i) for i in range(min(snap.n, SUGGEST_MAX))]
            raise NotFound(unknown_class(ref, self.bundle.classes, enrolled, self.num_classes), code="unknown_class")
        return ClassRef(int(snap.ids_of_positions(pos)), snap.name(pos), snap, pos)

    def resolve_id(self, class_id: int, snap: Enrolled) -> ClassRef:
        """A class named by its integer id (a JSON number: never read as a name): trained 0..D-1, or an
        enrolled class's D + slot; NotFound otherwise."""
        if 0 <= class_id < self.num_classes:
            return ClassRef(class_id, str(self.bundle.classes[class_id]))
        pos = snap.position_of_id(class_id) if snap.n and class_id >= self.num_classes else None
        if pos is None:
            raise NotFound(f"unknown class id {class_id} (ids are 0..{self.num_classes - 1}, and D + slot of the "
                           f"{snap.n} enrolled classes)", code="unknown_class")
        return ClassRef(class_id, snap.name(pos), snap, pos)

    def resolve_classes(self, refs: list) -> tuple[list[ClassRef], Enrolled]:
        """Classes named by a request (strings as in a path, integers as ids), all from ONE snapshot."""
        snap = self.snapshot()
        return [self.resolve_id(r, snap) if type(r) is int else self.resolve_class(r, snap) for r in refs], snap

    def name_of(self, class_id: int, snap: Enrolled) -> str:
        """The name of a trained id, or of an enrolled id of `snap`."""
        if class_id < self.num_classes:
            return str(self.bundle.classes[class_id])
        return snap.name(snap.position_of_id(class_id))

    def threshold_of(self, j: int) -> float:
        return self.calibration.of_class(j)

    async def reload_calibration(self, expect_sha256: Optional[str] = None) -> dict:
        """The calibration now in the served bundle's folder, checked against its manifest and the
        loaded model, swapped in whole (serving/core/calibration.py); what changed."""
        def work() -> dict:
            with self._reload_lock:  # two reloads at once: one after the other
                new, manifest, answer = reload_thresholds(self.bundle, self.calibration, expect_sha256)
                if answer["reloaded"]:
                    self.calibration = new  # the one step every later query sees
                    self._record(new, manifest)
                return answer

        return await asyncio.to_thread(work)

    def _record(self, new: Thresholds, manifest: dict) -> None:
        """The bundle's own fields follow the swap (GET /v1/model; the gallery and the class index keep
        the digest they were opened with: the backbone and head are unchanged)."""
        b = self.bundle
        b.manifest = {**manifest, "classes": b.classes}
        b.calibration, b.thresholds, b.platt_a, b.platt_b = new.calibration, new.threshold, new.platt_a, new.platt_b
        b.global_threshold, b.digest = new.global_threshold, new.digest

    def row_of(self, cls: ClassRef, cal: Optional[Thresholds] = None) -> tuple[np.ndarray, float, float, float, float]:
        """(row [d] float64, bias, threshold, platt a, platt b) of a trained or enrolled class."""
        if cls.enrolled is not None:
            w, b, thr, pa, pb, _ = cls.enrolled.row(cls.pos)
            return np.array(w, dtype=np.float64), b, thr, pa, pb
        j, cal = cls.id, cal or self.calibration  # one calibration for the whole request (the caller's)
        # [d] one row of the mmap head, as a plain float64 array: nothing of size D is touched
        return (np.array(self.weight[j], dtype=np.float64), float(self.bias[j]), cal.of_class(j),
                float(cal.platt_a[j]), float(cal.platt_b[j]))

    def column(self, cls: ClassRef) -> int:
        """The class's column in a pass: its id when trained, D + its position among the enrolled ones."""
        return cls.id if cls.enrolled is None else self.num_classes + cls.pos

    def gather(self, refs: list[ClassRef], snap: Enrolled, cal: Optional[Thresholds] = None) -> tuple[np.ndarray, ...]:
        """(rows [C, d], bias, threshold, platt a, platt b [C]) float64 of C classes: trained rows from the
        mapped head (C of them read, never D), enrolled ones from `snap`; the values detect reads."""
        cal = cal or self.calibration
        trained = [i for i, r in enumerate(refs) if r.enrolled is None]
        if len(trained) == len(refs):  # the usual request: one fancy index per array
            j = np.array([r.id for r in refs], dtype=np.int64)
            return (self.weight[j].astype(np.float64), self.bias[j].astype(np.float64), cal.of_classes(j),
                    cal.platt_a[j].astype(np.float64), cal.platt_b[j].astype(np.float64))
        n = len(refs)
        rows, b, thr, pa, pb = np.empty((n, self.bundle.embed_dim)), np.empty(n), np.empty(n), np.empty(n), np.empty(n)
        t, j = np.array(trained, dtype=np.int64), np.array([refs[i].id for i in trained], dtype=np.int64)
        rows[t], b[t], thr[t], pa[t], pb[t] = (self.weight[j], self.bias[j], cal.of_classes(j), cal.platt_a[j],
                                               cal.platt_b[j])
        e = np.array([i for i, r in enumerate(refs) if r.enrolled is not None], dtype=np.int64)
        q = np.array([refs[i].pos for i in e], dtype=np.int64)
        rows[e], b[e] = snap.weight[q], snap.bias[q]
        thr[e], pa[e], pb[e] = snap.values(1)[q], snap.values(2)[q], snap.values(3)[q]
        return rows, b, thr, pa, pb

    def class_exists(self, class_id: int, snap: Enrolled) -> bool:
        """Whether `class_id` names a trained class or an enrolled one of `snap`."""
        return 0 <= class_id < self.num_classes or (class_id >= self.num_classes and snap.position_of_id(class_id) is not None)

    def mixed_rows(self, ids: np.ndarray, trained: np.ndarray, snap: Enrolled,
                   cal: Optional[Thresholds] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows [N, d], bias [N], threshold [N]) float64 for ids of trained and enrolled classes."""
        rows = np.empty((len(ids), self.bundle.embed_dim))
        b, thr = np.empty(len(ids)), np.empty(len(ids))
        t = np.flatnonzero(trained)
        rows[t], b[t], thr[t] = self.weight[ids[t]], self.bias[ids[t]], (cal or self.calibration).of_classes(ids[t])
        e = np.flatnonzero(~trained)
        pos = np.array([snap.position_of_id(int(c)) for c in ids[e]], dtype=np.int64)
        rows[e], b[e], thr[e] = snap.weight[pos], snap.bias[pos], snap.values(1)[pos]
        return rows, b, thr

    def rival(self, ids) -> Rival:
        """What a class enrolled now with the look-alikes `ids` must reach on an input to be its match
        (serving/core/enrollment.py `Rival`): the largest margin there of those the server will decide it
        against (served ones; trained ones only under SLC_LOOKALIKES=trained, none under off), floored at 0."""
        mode, snap, cal = self.settings.lookalikes, self.snapshot(), self.calibration
        keep = [int(c) for c in ids if self.class_exists(int(c), snap) and (mode == "exclusive" or c < self.num_classes)]
        if mode == "off" or not keep:
            return no_rival
        rivals = np.array(sorted(set(keep)), dtype=np.int64)
        return lambda h: np.maximum(self.margins(np.asarray(h), rivals, snap, cal, None), 0.0).max(axis=1)

    def lookalikes(self, cal: Thresholds, snap: Enrolled) -> Lookalikes:
        """The look-alike pairs a request decides with: the bundle's and the enrolled classes' (none under
        SLC_LOOKALIKES=off; no pair of two enrolled classes under trained)."""
        if self.settings.lookalikes == "off":
            return EMPTY
        return cal.lookalikes.merged(snap.trained_lookalikes if self.settings.lookalikes == "trained" else snap.lookalikes)

    def decider(self, snap: Enrolled, cal: Thresholds, threshold: Optional[float]) -> Decider:
        """detect's rule for a request (its snapshot, calibration and `threshold`, read once)."""
        return Decider(self.lookalikes(cal, snap), lambda h, ids: self.margins(h, ids, snap, cal, threshold))

    def margins(self, h: np.ndarray, ids: np.ndarray, snap: Enrolled, cal: Thresholds,
                threshold: Optional[float]) -> np.ndarray:
        """[n, r] float64 logit - threshold of embeddings h [n, d] against classes ids [r] (trained or
        enrolled in `snap`): r rows read, never D."""
        rows, b = self.rows_of_ids(ids, snap)
        return h.astype(np.float64) @ rows.T + b - thresholds_of(cal, snap, ids, threshold)

    def rows_of_ids(self, ids: np.ndarray, snap: Enrolled) -> tuple[np.ndarray, np.ndarray]:
        """(rows [r, d], bias [r]) float64 of class ids [r], trained or enrolled in `snap`."""
        ids = np.asarray(ids, dtype=np.int64)
        trained = ids < self.num_classes
        rows, b = np.empty((len(ids), self.bundle.embed_dim)), np.empty(len(ids))
        rows[trained], b[trained] = self.weight[ids[trained]], self.bias[ids[trained]]
        e = np.flatnonzero(~trained)
        pos = np.array([snap.position_of_id(int(c)) for c in ids[e]], dtype=np.int64)
        rows[e], b[e] = snap.weight[pos], snap.bias[pos]
        return rows, b

    def _enroll_rule(self) -> str:
        try:
            return self.enrolled.rule() if self.enrolled is not None else "imprint"
        except SlcError as exc:
            return f"unavailable: {exc.message}"

    def enrolled_info(self) -> dict:
        """GET /v1/model's `classes`: trained and enrolled counts, and how enrollment works here."""
        snap = self.snapshot()
        return {"trained": self.num_classes, "enrolled": snap.n, "total": self.num_classes + snap.n,
                "enrolled_limit": self.settings.max_enrolled_classes, "enroll_rule": self._enroll_rule(),
                "enroll_threshold": self.settings.enroll_threshold, "sync_s": self.settings.enrolled_sync_s}
