"""Enrolled classes served beside the trained ones (issue 38; docs/api.md "Enroll a class").

`Enrolled` is an immutable snapshot of every enrolled class: rows E [n_e, d], biases, thresholds,
Platt a/b, names and slots (class id = D + slot; slots never reused, so no id moves when another
class is deleted). The engine reads `EnrolledClasses.snapshot` once per request and answers with
that snapshot alone: a write swaps in a new one (one reference assignment) and never waits for,
nor stalls, a request in flight.

Copy-on-write: a new slot (the common write) appends its row to the shared buffers, beyond every
older snapshot's view (`rows[:n]`), so an enrollment costs O(d), not O(n_e · d); a replaced or
deleted class rebuilds the buffers once.

`EnrolledClasses` keeps the snapshot in step with the store (serving/gallery/enrolled.py): after
each of its own writes (read-your-writes) and every `sync_s` seconds for the writes of other
processes (a second replica on the same SQLite file or PostgreSQL), by the store's seq counter.

Replicas (issue 48): a write answers from what it committed, never from a read-back another replica
can race; a delete by id retires exactly that slot in the store, whatever this snapshot says; a
stored row that cannot be served (unservable) is skipped and named at WARNING, never a refused
start or a follower stuck on it.
"""
from __future__ import annotations

import logging
import math
import re
import threading
from dataclasses import dataclass, field
from dataclasses import replace
from functools import cached_property
from typing import Callable, Optional

import numpy as np

from serving.bundle.negatives import read_negatives
from serving.core import enrollment, enrolled_report
from serving.core.lookalikes import EnrolledPairs, PairIndex
from serving.errors import Conflict, InvalidInput, NotFound
from serving.bundle.class_row import ClassRow
from serving.gallery.enrolled import (Changed, EnrolledStore, LimitReached,  # noqa: F401 (LimitReached: re-exported)
                                      ModelRecord, Written)

log = logging.getLogger(__name__)

_ID = re.compile(r"-?[0-9]{1,18}")  # a reference that reads as a class id (enrolled names never do: check_name)


class _Buffers:
    """Append-only storage several snapshots share; each reads only its first n entries."""

    def __init__(self, d: int, num_trained: int, capacity: int = 16):
        self.rows = np.zeros((capacity, d), dtype=np.float32)
        self.values = np.zeros((capacity, 5), dtype=np.float64)  # bias, threshold, platt_a, platt_b, examples
        self.slots = np.zeros(capacity, dtype=np.int64)
        self.names: list[str] = []
        self.info: list[dict] = []  # rule, created: per class, for listings
        self.pairs = PairIndex(num_trained)  # per class: the ids it names as look-alikes (serving/core/lookalikes.py)
        self.position: dict[str, int] = {}  # name -> position
        self.at_slot: dict[int, int] = {}  # slot -> position: these buffers' classes, and those about to be appended
        self.used = 0

    def extend(self, records: list[ClassRow]) -> None:
        """Append records, in slot order, each placed before any is appended: a class may name one of a
        later slot (one replaced since it was enrolled, or a replica's catch-up of both at once)."""
        records = sorted(records, key=lambda r: r.slot)
        self.at_slot.update((int(r.slot), self.used + i) for i, r in enumerate(records))
        for r in records:
            self.append(r)

    def append(self, rec: ClassRow) -> None:
        if self.used == len(self.slots):  # grow: a new array; older snapshots keep their views of the old one
            cap = 2 * len(self.slots)
            self.rows = _grown(self.rows, cap)
            self.values = _grown(self.values, cap)
            self.slots = _grown(self.slots, cap)
        i = self.used
        self.rows[i] = rec.row
        self.values[i] = (rec.bias, rec.threshold, rec.platt_a, rec.platt_b, rec.examples)
        self.slots[i] = rec.slot
        self.names.append(rec.name)
        self.info.append({"rule": rec.rule, "created": rec.created})
        self.at_slot.setdefault(int(rec.slot), i)
        self.pairs.append(rec.lookalikes, lambda c: self.at_slot.get(c - self.pairs.num_trained))
        self.position[rec.name] = i
        self.used += 1


def _grown(a: np.ndarray, cap: int) -> np.ndarray:
    out = np.zeros((cap,) + a.shape[1:], dtype=a.dtype)
    out[:len(a)] = a
    return out


@dataclass(frozen=True)
class Enrolled:
    """The enrolled classes one request answers with (n of them, in slot order)."""

    num_trained: int
    n: int
    seq: int
    _buf: _Buffers = field(repr=False)

    @property
    def weight(self) -> np.ndarray:  # [n, d] float32
        return self._buf.rows[:self.n]

    @property
    def bias(self) -> np.ndarray:  # [n] float32
        return self._buf.values[:self.n, 0].astype(np.float32)

    @property
    def slots(self) -> np.ndarray:  # [n] int64, ascending
        return self._buf.slots[:self.n]

    @property
    def ids(self) -> np.ndarray:  # [n] int64: D + slot
        return self.num_trained + self.slots

    def name(self, pos: int) -> str:
        return self._buf.names[pos]

    @cached_property
    def trained_lookalikes(self) -> EnrolledPairs:
        """`lookalikes` without the pairs of two enrolled classes (SLC_LOOKALIKES=trained)."""
        return EnrolledPairs(self._buf.pairs, self.n, self.slots, enrolled=False)

    @cached_property
    def lookalikes(self) -> EnrolledPairs:
        """These classes' look-alike pairs (an enrolled id, the trained or enrolled id it names): a view,
        O(1) to make."""
        return EnrolledPairs(self._buf.pairs, self.n, self.slots)

    def lookalikes_of(self, pos: int) -> list[int]:
        """The look-alikes of the class at `pos` in this snapshot: the trained ids and served enrolled ids
        it names, and the enrolled classes that name it (the relation is symmetric)."""
        return self.lookalikes.of(int(self.num_trained + self.slots[pos])).tolist()

    def find(self, name: str) -> Optional[int]:
        """The position of the class `name`, or None."""
        pos = self._buf.position.get(name)
        return pos if pos is not None and pos < self.n and self._buf.names[pos] == name else None

    def position_of_id(self, class_id: int) -> Optional[int]:
        """The position of the class with id D + slot, or None."""
        slot = int(class_id) - self.num_trained
        slots = self.slots
        pos = int(np.searchsorted(slots, slot))
        return pos if pos < self.n and slots[pos] == slot else None

    def row(self, pos: int) -> tuple[np.ndarray, float, float, float, float, int]:
        """(row [d] float32, bias, threshold, platt_a, platt_b, examples) of the class at `pos`."""
        bias, threshold, pa, pb, examples = self._buf.values[pos]
        return self._buf.rows[pos], float(np.float32(bias)), float(threshold), float(pa), float(pb), int(examples)

    def values(self, column: int) -> np.ndarray:
        """[n] float64 of one column: 0 bias, 1 threshold, 2 platt_a, 3 platt_b, 4 examples."""
        return self._buf.values[:self.n, column]

    def ids_of_positions(self, positions: np.ndarray) -> np.ndarray:
        """Class ids of positions (any shape)."""
        return self.num_trained + self.slots[positions]

    def describe(self, pos: int) -> dict:
        row, bias, threshold, pa, pb, examples = self.row(pos)
        info = self._buf.info[pos]
        return _description(int(self.num_trained + self.slots[pos]), self.name(pos), row, bias, threshold, pa, pb,
                            examples, info["rule"], info["created"], self.lookalikes_of(pos))


def _description(class_id: int, name: str, row: np.ndarray, bias: float, threshold: float, pa: float, pb: float,
                 examples: int, rule: str, created: float, lookalikes: tuple[int, ...] = ()) -> dict:
    """A class as PUT and GET /v1/classes answer it (the bias as served: float32)."""
    return {"class_id": class_id, "class_name": name, "threshold": float(threshold), "bias": float(np.float32(bias)),
            "norm": float(np.linalg.norm(np.asarray(row, dtype=np.float32).astype(np.float64))),
            "platt": {"a": float(pa), "b": float(pb)}, "examples": int(examples), "rule": rule, "created": created,
            "lookalikes": [int(t) for t in lookalikes]}


def describe_record(num_trained: int, r: ClassRow) -> dict:
    return _description(num_trained + r.slot, r.name, r.row, r.bias, r.threshold, r.platt_a, r.platt_b, r.examples,
                        r.rule, r.created, r.lookalikes)


def empty_snapshot(num_trained: int, d: int) -> Enrolled:
    return Enrolled(num_trained, 0, 0, _Buffers(d, num_trained))


def _snapshot(num_trained: int, d: int, live: dict[int, ClassRow], seq: int) -> Enrolled:
    """A fresh snapshot (new buffers) of the live records {slot: record}."""
    buf = _Buffers(d, num_trained, max(16, len(live)))
    buf.extend(list(live.values()))
    return Enrolled(num_trained, buf.used, seq, buf)


class EnrolledClasses:
    """The snapshot, the store behind it, and the rule's borrowed statistics of the trained head."""

    def __init__(self, store: EnrolledStore, bundle, settings, model: Optional[ModelRecord] = None):
        self.store, self.bundle, self.settings = store, bundle, settings
        self.num_trained, self.embed_dim = int(bundle.num_classes), int(bundle.embed_dim)
        self.model = model or ModelRecord.of_bundle(bundle)
        self._live: dict[int, ClassRow] = {}  # slot -> record (the truth the snapshot is built from)
        self.skipped: dict[int, tuple[str, str]] = {}  # slot -> (name, why): stored rows that cannot be served
        self.snapshot = empty_snapshot(self.num_trained, self.embed_dim)
        self._lock = threading.Lock()  # catch-ups and writes of this process, one at a time
        self._stats: Optional[enrollment.HeadStats] = None
        self._negatives: Optional[np.ndarray] = None
        self._negative_labels: Optional[np.ndarray] = None
        self._neg_stats: Optional[enrollment.NegativeStats] = None
        self._stop = threading.Event()
        self._follower: Optional[threading.Thread] = None
        self.catch_up()
        self.elsewhere = enrolled_report.groups(store, self.model, settings, self._is_trained)  # other keys', once

    # ------------------------------------------------------------------ keeping in step
    def catch_up(self) -> None:
        """Apply every write committed after the snapshot's seq (idempotent), then swap the snapshot."""
        with self._lock:
            records = self.store.changes(self.snapshot.seq)
            if records:
                self._apply(records, max(r.seq for r in records))

    def _apply(self, records: list[ClassRow], seq: Optional[int] = None) -> None:
        """Records as the store holds them now; the snapshot's seq advanced to `seq` (None: kept, for
        this process's own write shown before a catch-up confirms it). New slots are appended to the
        shared buffers when that is all they are; otherwise a rebuild. Under the lock."""
        old = self.snapshot
        last_slot = int(old.slots[-1]) if old.n else -1
        why = {r.slot: None if r.deleted else self._unservable(r) for r in records}
        fresh = [r for r in records if not r.deleted and why[r.slot] is None and r.slot not in self._live]
        appends_only = (len(fresh) == len(records) and old.n == old._buf.used and all(r.slot > last_slot for r in fresh))
        skipped = dict(self.skipped)  # replaced whole: GET /v1/classes reads it without the lock
        for r in records:
            skipped.pop(r.slot, None)
            if r.deleted or why[r.slot] is not None:
                self._live.pop(r.slot, None)
            else:
                self._live[r.slot] = r
            if why[r.slot] is not None:
                skipped[r.slot] = (r.name, why[r.slot])
                log.warning("enrolled class %r (id %d) is stored but not served: %s. Replace it (PUT /v1/classes/"
                            "{name}) or delete it by id (DELETE /v1/classes/%d)", r.name, self.num_trained + r.slot,
                            why[r.slot], self.num_trained + r.slot)
        self.skipped = skipped
        seq = old.seq if seq is None else max(old.seq, seq)
        if appends_only:
            old._buf.extend(fresh)
            self.snapshot = Enrolled(self.num_trained, old._buf.used, seq, old._buf)
        else:
            self.snapshot = _snapshot(self.num_trained, self.embed_dim, self._live, seq)

    def _unservable(self, r: ClassRow) -> Optional[str]:
        return r.unservable(self.embed_dim, self._is_trained)

    def _is_trained(self, name: str) -> bool:
        try:
            self.bundle.class_id(name)
            return True
        except KeyError:
            return False

    def start_following(self) -> None:
        """Poll the store every sync_s seconds for other processes' writes (a daemon thread)."""
        if self._follower is None:
            self._follower = threading.Thread(target=self._follow, name="enrolled-follower", daemon=True)
            self._follower.start()

    def _follow(self) -> None:
        while not self._stop.wait(self.settings.enrolled_sync_s):
            try:
                if self.store.seq() != self.snapshot.seq:
                    self.catch_up()
            except Exception as exc:  # noqa: BLE001 - a store away for a while: keep serving the snapshot, retry
                log.warning("enrolled classes: cannot follow the store (%s); retrying", str(exc).splitlines()[0][:200])

    def close(self) -> None:
        self._stop.set()
        if self._follower is not None:
            self._follower.join(timeout=5)
        self.store.close()

    # ------------------------------------------------------------------ the rule's inputs
    def stats(self) -> enrollment.HeadStats:
        """The trained head's medians (computed once: a pass over the rows)."""
        if self._stats is None:
            b = self.bundle
            self._stats = enrollment.head_stats(b.weight, b.bias, b.platt_a, b.platt_b, b.global_threshold,
                                                b.calibration.get("target"))
        return self._stats

    def negatives(self) -> Optional[np.ndarray]:
        """The bundle's calibration negatives [N, d] (serving/bundle/negatives.py), or None without them."""
        if self._negatives is None:
            if (found := read_negatives(self.bundle.path)) is None:
                return None
            self._negatives, self._negative_labels = found
        return self._negatives

    def rule(self, examples: Optional[int] = None) -> str:
        """The row rule in use: SLC_ENROLL_RULE, `auto` resolved by whether the bundle carries negatives
        (standardised) or not (imprint); `fitted` only when named, for classes of at least
        enrollment.FIT_MIN_EXAMPLES `examples`. `examples` None: the rule of a class of several examples."""
        wanted = self.settings.enroll_rule
        if wanted == "auto":  # fitted is asked for by name: on glyphs3755 it gave away precision (small-folder-aims.md)
            return "imprint" if self.negatives() is None else "standardised"
        if wanted in ("standardised", "fitted") and self.negatives() is None:
            raise InvalidInput(f"SLC_ENROLL_RULE={wanted} needs a bundle with calibration negatives "
                               "(re-export it: slc export writes calibration_embeddings.npy)", code="no_negatives")
        if wanted == "fitted" and examples is not None and examples < enrollment.FIT_MIN_EXAMPLES:
            raise InvalidInput(f"SLC_ENROLL_RULE=fitted needs at least {enrollment.FIT_MIN_EXAMPLES} examples of a "
                               "class: its threshold is judged on examples its row was not fitted on",
                               code="too_few_examples")
        return wanted

    def negative_stats(self) -> enrollment.NegativeStats:
        """The trained head's logits on the negatives (computed once, over a sample of classes)."""
        if self._neg_stats is None:
            self._neg_stats = enrollment.negative_stats(self.bundle.weight, self.bundle.bias, self.negatives(),
                                                        self._negative_labels)
        return self._neg_stats

    def compute(self, h: np.ndarray, rival: enrollment.Rival = enrollment.no_rival) -> ClassRow:
        """The rule (serving/core/enrollment.py) on the examples' embeddings h [n, d]; a threshold it
        chooses is chosen for the decision the server makes with the class's look-alikes (`rival`)."""
        stats = self.stats()
        rule = self.rule(len(h))
        if rule == "fitted":  # a threshold of its own, cross-fitted on the examples against the negatives
            return enrollment.fitted(h, stats, self.negative_stats(), np.asarray(self.negatives()), self.num_trained,
                                     rival=rival)
        if rule == "standardised":
            row = enrollment.standardised(h, stats, self.negative_stats(), np.asarray(self.negatives()))
        else:
            row = enrollment.imprint(h, stats)
        wanted = self.settings.enroll_threshold == "negatives" or enrollment.rejects_all(row, h, rival)
        if wanted and (neg := self.negatives()) is not None:
            t = enrollment.negatives_threshold(row, h, np.asarray(neg, dtype=np.float32), self.num_trained,
                                               stats.target_precision, rival)
            if t is not None:
                row = replace(row, threshold=t, rule="negatives")
        return row

    # ------------------------------------------------------------------ writes (blocking: the gallery's executor)
    def put(self, name: str, row: ClassRow, h: Optional[np.ndarray] = None,
            expect_seq: Optional[int] = None, lookalikes: tuple[int, ...] = ()) -> tuple[dict, bool]:
        """Store the class with the embeddings h [n, d] its row was made from (kept for adding) and its
        look-alikes (class ids); (its description, created), from what was committed: never read back,
        since another replica may have replaced or deleted it by then. `expect_seq`: store.Changed unless
        the class is still at it."""
        values = (row.bias, row.threshold, row.platt_a, row.platt_b)
        if not (np.isfinite(row.row).all() and all(math.isfinite(v) for v in values)):
            raise InvalidInput("the class's row, bias, threshold or Platt values are not finite; nothing was written",
                               code="non_finite_output")
        rule = f"{self.rule(row.examples)}+{row.rule}"
        with self._lock:
            written = self.store.put(name, row.row, row.bias, row.threshold, row.platt_a, row.platt_b, row.examples,
                                     rule, self.settings.max_enrolled_classes, embeddings=h, expect_seq=expect_seq,
                                     lookalikes=lookalikes)
            own = replace(row, row=np.asarray(row.row, dtype="<f4").astype(np.float32), bias=float(row.bias),
                          threshold=float(row.threshold), platt_a=float(row.platt_a), platt_b=float(row.platt_b),
                          examples=int(row.examples), rule=rule, name=name, slot=written.slot, created=written.at,
                          seq=written.seq, deleted=False, lookalikes=tuple(lookalikes))
            self._settle(own)
        return describe_record(self.num_trained, own), written.created

    def add(self, name: str, h: np.ndarray, lookalikes: tuple[int, ...] = (), tries: int = 3,
            rival_of: Callable[[tuple[int, ...]], enrollment.Rival] = lambda ids: enrollment.no_rival) -> tuple[dict, bool]:
        """Add the examples h [n, d] to the live class `name`: its row made again by the rule from the
        kept embeddings and these, so exactly the row of enrolling all of them at once; its look-alikes
        the kept ones and these examples' (`rival_of(ids)`: what they ask of it, for its threshold).
        Written only if no other write reached the class meanwhile (else read again, `tries` times in all)."""
        for _ in range(tries):
            kept = self.store.kept(name)
            if kept is None:
                raise NotFound(f"no enrolled class {name!r} to add examples to: create it first with "
                               f"PUT /v1/classes/{{name}}", code="unknown_class")
            if kept.embeddings is None or kept.embeddings.shape[1] != self.embed_dim:
                raise Conflict(f"{name!r} was enrolled by an older slc, which kept its row but not its examples' "
                               "embeddings: enroll it again with all its examples (PUT)", code="examples_not_kept")
            total = len(kept.embeddings) + len(h)
            if total > self.settings.max_class_examples:
                raise InvalidInput(f"{name!r} would have {total} examples; the limit is {self.settings.max_class_examples} "
                                   "(SLC_MAX_CLASS_EXAMPLES)", code="too_many_examples")
            every = np.concatenate([kept.embeddings, np.asarray(h, dtype=np.float32)])
            alike = tuple(sorted({*kept.lookalikes, *lookalikes}))
            try:
                return self.put(name, self.compute(every, rival_of(alike)), every, expect_seq=kept.seq,
                                lookalikes=alike)
            except Changed:
                continue
        raise Conflict(f"{name!r} kept changing while examples were added ({tries} tries); retry",
                       code="class_changed")

    def delete(self, ref: str) -> Optional[int]:
        """Delete in the store the class `ref` names: an id (D + slot) exactly that slot, a name whatever
        class is live under it now. Its id, or None when there is no such live class (retired, never
        used, or deleted meanwhile by another request or replica)."""
        with self._lock:
            if _ID.fullmatch(ref):
                slot = int(ref) - self.num_trained
                written = self.store.delete_slot(slot) if slot >= 0 else None
            else:
                written = self.store.delete(ref)
            if written is not None:
                self._settle(_tombstone(written))
        return None if written is None else self.num_trained + written.slot

    def _settle(self, own: ClassRow) -> None:
        """After a committed write of this process (under the lock): catch up with the store, or, when
        that read fails, show the write alone so that it is served at once; the follower confirms it."""
        try:
            records = self.store.changes(self.snapshot.seq)
            if records:
                self._apply(records, max(r.seq for r in records))
            return
        except Exception as exc:  # noqa: BLE001 - the write is committed: its answer must not become an error
            log.warning("enrolled classes: a write committed (seq %d) but reading the store back failed (%s); "
                        "the follower retries", own.seq, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        known = self._live.get(own.slot)
        if own.seq > self.snapshot.seq and (known is None or known.seq < own.seq):
            self._apply([own])

    def listing(self) -> list[dict]:
        snap = self.snapshot
        return [snap.describe(i) for i in range(snap.n)]

    def not_served(self) -> list[dict]:
        """GET /v1/classes `not_served`: the classes of other keys (enrolled_report) and the stored rows
        of this model that cannot be served, each group with why and what to do."""
        snap = self.snapshot
        groups = [enrolled_report.mark_reenrolled(g, lambda n: snap.find(n) is not None) for g in self.elsewhere]
        if skipped := self.skipped:
            groups.append(enrolled_report.unservable_group(self.num_trained, skipped))
        return groups


def _tombstone(written: Written) -> ClassRow:
    """A deletion this process committed, as the record the store now holds."""
    return ClassRow(slot=written.slot, name="", row=None, bias=0.0, threshold=0.0, platt_a=0.0, platt_b=0.0,
                    examples=0, rule="", created=written.at, seq=written.seq, deleted=True)
