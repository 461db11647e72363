"""Which model a store's enrolled classes belong to (issue 48): the `enrolled_models` table, the
re-keying of classes an older slc stored under a manifest digest, and the classes of other keys.

Enrolled classes are keyed by the model key (serving/bundle/format.py `model_key`: backbone, trained
rows, class names), which a recalibration keeps. Each model that opens the store records itself
(name, path, manifest digest, backbone and head hashes, D, d, when), so a server can say whose
classes it does not serve and whether they were made for its own backbone with another head.

An older slc keyed them by the sha256 of manifest.json, which every recalibration changes. A key
that is not in `enrolled_models` is such a digest. `register` re-keys to the model the classes of
the digests it is given, the ones known to be of this model: the manifest being served, and the one
before its last recalibration when that can be rebuilt (serving/bundle/recalibration.py
`previous_digests`). Into an empty key they move as they are (ids kept), with their kept examples and
look-alikes; into a key that already holds classes they are appended under new slots with their
look-alikes (not their examples: the slc that keyed by digest kept none), and where both hold a live
class of one name the later enrollment wins, as a PUT would have (its look-alikes too). Nothing else
is ever re-keyed: a digest that cannot be tied to the model stays, and is reported.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

SAMPLE = 100  # classes listed by name per key a server does not serve

_CLASS_COLUMNS = "slot, name, row, bias, threshold, platt_a, platt_b, examples, rule, created"
_MODEL_COLUMNS = "model_key, name, path, digest, backbone, head, classes, dim, seen"
_KEYED = ("enrolled_classes", "enrolled_state", "enrolled_examples", "enrolled_lookalikes")  # tables keyed by digest


def models_schema(real: str, integer: str) -> list[str]:
    return [f"""CREATE TABLE IF NOT EXISTS enrolled_models (
                   model_key TEXT PRIMARY KEY,   -- serving/bundle/format.py model_key
                   name TEXT NOT NULL, path TEXT NOT NULL,
                   digest TEXT NOT NULL,         -- sha256 of manifest.json when last opened
                   backbone TEXT NOT NULL,       -- sha256 of backbone.onnx
                   head TEXT NOT NULL,           -- sha256 of head_weight.npy and of head_bias.npy
                   classes {integer} NOT NULL, dim {integer} NOT NULL,
                   seen {real} NOT NULL)"""]


@dataclass(frozen=True)
class ModelRecord:
    """A model as the store records it."""

    key: str
    name: str
    path: str
    digest: str
    backbone: str
    head: str
    classes: int
    dim: int
    seen: float = 0.0

    @classmethod
    def of_bundle(cls, bundle, seen: float = 0.0) -> "ModelRecord":
        from serving.bundle.format import model_key

        files = bundle.manifest["files"]
        head = f"{files['head_weight.npy']['sha256']}:{files['head_bias.npy']['sha256']}"
        return cls(key=model_key(bundle.manifest, bundle.classes), name=str(bundle.name),
                   path=str(Path(bundle.path).resolve()), digest=str(bundle.digest),
                   backbone=str(files["backbone.onnx"]["sha256"]), head=head, classes=int(bundle.num_classes),
                   dim=int(bundle.embed_dim), seen=seen)

    def describe(self) -> dict:
        return {"key": self.key, "name": self.name, "path": self.path, "digest": self.digest,
                "backbone_sha256": self.backbone, "classes": self.classes, "seen": self.seen}


@dataclass
class Adopted:
    """What `register` did with the classes of one legacy digest."""

    digest: str
    moved: int  # classes re-keyed (or appended) to the model
    renumbered: bool  # appended under new slots (ids changed), because the model already held classes
    replaced: list[str] = field(default_factory=list)  # names whose later enrollment replaced the model's
    dropped: list[str] = field(default_factory=list)  # names the model had enrolled later: the older row went


class ModelTables:
    """The statements of the models table, mixed into EnrolledStore (its _write, _read, _sql, _state, key)."""

    def register(self, model: ModelRecord, legacy: Sequence[str] = ()) -> list[Adopted]:
        """Record `model` (this store's key) and re-key to it the classes stored under the `legacy`
        manifest digests (module docstring), in one transaction; what was re-keyed."""
        if model.key != self.key:
            raise ValueError("a store registers the model of its own key")
        with self._write() as db:
            db.execute(self._sql(f"""INSERT INTO enrolled_models ({_MODEL_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                                     ON CONFLICT (model_key) DO UPDATE SET name = excluded.name, path = excluded.path,
                                     digest = excluded.digest, seen = excluded.seen"""),
                       (model.key, model.name, model.path, model.digest, model.backbone, model.head, model.classes,
                        model.dim, model.seen))
            return [a for d in dict.fromkeys(legacy) if (a := self._adopt(db, d, model.classes)) is not None]

    def _adopt(self, db, legacy: str, num_trained: int) -> Optional[Adopted]:
        one = self._sql("SELECT {} FROM {} WHERE {} = ?")
        if legacy == self.key or db.execute(one.format(1, "enrolled_models", "model_key"), (legacy,)).fetchone():
            return None  # a model key, never a legacy digest
        old = db.execute(one.format("live", "enrolled_state", "digest"), (legacy,)).fetchone()
        if old is None:
            return None
        if db.execute(one.format(1, "enrolled_state", "digest"), (self.key,)).fetchone() is None:
            for table in _KEYED:  # slots, seqs, tombstones as they are
                db.execute(self._sql(f"UPDATE {table} SET digest = ? WHERE digest = ?"), (self.key, legacy))
            return Adopted(legacy, moved=int(old[0]), renumbered=False)
        return self._merge(db, legacy, num_trained)

    def _merge(self, db, legacy: str, num_trained: int) -> Adopted:
        """The live classes of `legacy` appended to this key's (new slots); of two live classes of one
        name the later enrollment stays, in the slot this key gave it. Look-alikes move with their
        classes: an enrolled one (id D + slot) to its class's slot here, or left out with it."""
        rows = db.execute(self._sql(f"SELECT {_CLASS_COLUMNS} FROM enrolled_classes WHERE digest = ? AND deleted = 0 "
                                    "ORDER BY slot"), (legacy,)).fetchall()
        lookalikes = {int(s): ids for s, ids in db.execute(self._sql("SELECT slot, ids FROM enrolled_lookalikes "
                                                                     "WHERE digest = ?"), (legacy,)).fetchall()}
        next_slot, seq, live = self._state(db)
        done = Adopted(legacy, moved=0, renumbered=True)
        moved: dict[int, int] = {}  # legacy slot -> slot here, of the classes carried over
        for r in rows:
            mine = db.execute(self._sql("SELECT slot, created FROM enrolled_classes WHERE digest = ? AND name = ? "
                                        "AND deleted = 0"), (self.key, r[1])).fetchone()
            seq += 1
            if mine is None:
                slot = next_slot
                db.execute(self._sql(f"""INSERT INTO enrolled_classes (digest, {_CLASS_COLUMNS}, seq, deleted)
                                         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)"""),
                           (self.key, next_slot, *r[1:], seq))
                next_slot, live, done.moved = next_slot + 1, live + 1, done.moved + 1
            elif float(r[9]) > float(mine[1]):
                slot = int(mine[0])
                db.execute(self._sql("""UPDATE enrolled_classes SET row = ?, bias = ?, threshold = ?, platt_a = ?,
                                        platt_b = ?, examples = ?, rule = ?, created = ?, seq = ?
                                        WHERE digest = ? AND slot = ?"""), (*r[2:], seq, self.key, slot))
                for table in ("enrolled_examples", "enrolled_lookalikes"):  # this key's, not the legacy row's
                    db.execute(self._sql(f"DELETE FROM {table} WHERE digest = ? AND slot = ?"), (self.key, slot))
                done.replaced.append(str(r[1]))
            else:
                done.dropped.append(str(r[1]))
                continue
            moved[int(r[0])] = slot
        for old, slot in moved.items():  # the legacy class's look-alikes, to its slot here
            if (ids := _moved_lookalikes(lookalikes.get(old), moved, num_trained)) is not None:
                db.execute(self._sql("INSERT INTO enrolled_lookalikes (digest, slot, ids) VALUES (?, ?, ?)"),
                           (self.key, slot, ids))
        db.execute(self._sql("UPDATE enrolled_state SET next_slot = ?, seq = ?, live = ? WHERE digest = ?"),
                   (next_slot, seq, live, self.key))
        for table in _KEYED:
            db.execute(self._sql(f"DELETE FROM {table} WHERE digest = ?"), (legacy,))
        return done

    def unrecorded(self) -> list[str]:
        """Keys holding classes that no model recorded: an older slc's manifest digests (what register may adopt)."""
        rows = self._read(self._sql("""SELECT digest FROM enrolled_state WHERE digest != ? AND live > 0
                                       AND digest NOT IN (SELECT model_key FROM enrolled_models)"""), (self.key,))
        return [str(r[0]) for r in rows]

    def models(self) -> dict[str, ModelRecord]:
        """Every model that opened the store, by key."""
        rows = self._read(self._sql(f"SELECT {_MODEL_COLUMNS} FROM enrolled_models"), ())
        return {str(r[0]): ModelRecord(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5]), int(r[6]),
                                       int(r[7]), float(r[8])) for r in rows}

    def elsewhere(self, sample: int = SAMPLE) -> dict[str, tuple[int, list[tuple[int, str, float]]]]:
        """The live classes of every other key: {key: (count, the first `sample` as (slot, name, created))}."""
        counts = self._read(self._sql("SELECT digest, COUNT(*) FROM enrolled_classes WHERE digest != ? AND deleted = 0 "
                                      "GROUP BY digest ORDER BY digest"), (self.key,))
        rows = self._read(self._sql("""SELECT digest, slot, name, created FROM (
                                           SELECT digest, slot, name, created,
                                                  ROW_NUMBER() OVER (PARTITION BY digest ORDER BY slot) AS k
                                           FROM enrolled_classes WHERE digest != ? AND deleted = 0) ranked
                                       WHERE k <= ? ORDER BY digest, slot"""), (self.key, int(sample)))
        out = {str(k): (int(n), []) for k, n in counts}
        for key, slot, name, created in rows:
            out[str(key)][1].append((int(slot), str(name), float(created)))
        return out


def _moved_lookalikes(stored, moved: dict[int, int], D: int) -> Optional[str]:
    """A legacy class's stored look-alikes (a JSON list) with each enrolled id D + slot renumbered to its
    class's slot here (left out when its class was not carried over); as stored (unreadable ones too,
    for the reader to report) when there is nothing to renumber; None: no row."""
    if stored is None:
        return None
    try:
        ids = json.loads(stored)
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return stored
    except (TypeError, ValueError, RecursionError):
        return stored
    out = sorted({i if i < D else D + moved[i - D] for i in ids if i < D or i - D in moved})
    return json.dumps(out, separators=(",", ":")) if out else None
