"""Enrolled classes (issue 38) in the gallery's own store: SQLite in `data_dir` (WAL, synchronous=FULL)
or the PostgreSQL of `--gallery-url`, shared by every replica.

One row per slot: (digest, slot, name, row bytes, bias, threshold, Platt a/b, examples, rule,
created, seq, deleted); beside it, in `enrolled_examples`, the embeddings of the examples the row was
made from (float32 [n, d]), written in the same transaction: adding examples recomputes the row from
all of them, exactly as enrolling them at once would (readers that follow changes never read them);
in `enrolled_lookalikes`, its look-alikes (the class ids its examples resembled: trained ids, and
enrolled ids D + slot of this key's classes; a JSON list;
no row: none), written and deleted in the class's transaction and read with it by `changes` and `kept`.
A store made by an older slc gains that table when opened (every open runs the CREATE ... IF NOT EXISTS).
A write runs in one transaction that holds the writers' lock (SQLite's
BEGIN IMMEDIATE, PostgreSQL's advisory lock), draws the next `seq` of its bundle digest and, for a
new name, the next slot (slots are never reused: a deleted class keeps its row as a tombstone,
`deleted = 1`, its bytes dropped). It is answered only after COMMIT, so a kill -9 after the answer
loses nothing. A reader keeps the last seq it applied and asks for `changes(since)`: every row
whose seq is newer, tombstones included, in one statement (one snapshot); the cheap `seq()` tells
a poller whether there is anything to ask for.

Rows are keyed by the model they were computed for (the `digest` column holds the bundle's model
key, serving/bundle/format.py `model_key`: the backbone, the trained rows, the class names; not the
calibration), so a recalibration keeps them and another model reads none of them (they stay in the
store, served again when that model is). Each model that opened the store is recorded in
`enrolled_models` (name, path, backbone, head) so a server can say whose classes it does not serve.
Stores of an older slc keyed rows by the manifest's digest: serving/gallery/enrolled_models.py
re-keys those it can tie to the model.

A store that refuses writes (read-only, locked past the timeout, an I/O error) raises
StoreUnavailable; a full one StorageFull; nothing is written either way.
"""
from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from serving.bundle.class_row import ClassRow
from serving.gallery.base import GalleryUnavailable, StorageFull, StoreUnavailable
from serving.gallery.enrolled_models import ModelRecord, ModelTables, models_schema
from serving.gallery.sqlite import DB_NAME, _rollback, store_error

log = logging.getLogger(__name__)

_PG_LOCK_KEY = 0x51C6E2A0  # the advisory lock every enrolled-class writer takes (not the gallery's)

_COLUMNS = "slot, name, row, bias, threshold, platt_a, platt_b, examples, rule, created, seq, deleted"
_JOINED = ", ".join(f"c.{c}" for c in _COLUMNS.split(", ")) + ", l.ids"  # the class and its look-alikes
_WITH_LOOKALIKES = "enrolled_classes c LEFT JOIN enrolled_lookalikes l ON l.digest = c.digest AND l.slot = c.slot"


class LimitReached(Exception):
    """The bundle already has the configured number of enrolled classes; nothing was written."""


class Changed(Exception):
    """The class was written by another request since it was read (`put(expect_seq=…)`); nothing was written."""


@dataclass
class Kept:
    """What the store keeps of a live class's examples: its slot, the seq of its last write, the
    embeddings its row was made from ([n, d] float32; None for a class an older slc stored) and its
    look-alikes (class ids, sorted; () when none are stored or they cannot be read)."""

    slot: int
    seq: int
    embeddings: Optional[np.ndarray]
    lookalikes: tuple[int, ...] = ()


@dataclass
class Written:
    """What a write committed: the class's slot, whether it was new, the seq of the write, its time."""

    slot: int
    created: bool
    seq: int
    at: float = 0.0


def _number(value, what: str, problems: list[str]) -> float:
    """A stored REAL as float; NaN and a note in `problems` when it is NULL (SQLite's NaN) or no number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        problems.append(f"{what} is {value!r}")
        return float("nan")


def lookalike_ids(ids: Sequence[int]) -> tuple[int, ...]:
    """Look-alikes as the store keeps them: distinct class ids (ints >= 0), sorted; ValueError otherwise."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"look-alikes are a sequence of class ids, not {type(ids).__name__}")
    out = set()
    for i in ids:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or int(i) < 0:
            raise ValueError(f"a look-alike is a class id (an int >= 0), not {i!r}")
        out.add(int(i))
    return tuple(sorted(out))


def _stored_lookalikes(value) -> tuple[tuple[int, ...], Optional[str]]:
    """The stored `ids` of enrolled_lookalikes (NULL: none) as look-alikes, or () and why it cannot be read."""
    if value is None:
        return (), None
    try:
        ids = json.loads(value)
        if not isinstance(ids, list):
            raise ValueError("not a list")
        return lookalike_ids(ids), None
    except (TypeError, ValueError, RecursionError):  # bad JSON, bad bytes, not a list, an id that is no id
        shown = repr(value)
        return (), f"the stored look-alikes cannot be read: {shown[:80]}{'...' if len(shown) > 80 else ''}"


def _record(r: tuple) -> ClassRow:
    """One row of _COLUMNS (and the look-alikes' `ids`, when given) as a record, whatever its values:
    what cannot be read is named in `problem`. A tombstone has no look-alikes."""
    problems: list[str] = []
    lookalikes: tuple[int, ...] = ()
    if len(r) > 12 and not bool(r[11]):
        lookalikes, problem = _stored_lookalikes(r[12])
        if problem:
            problems.append(problem)
    row = None
    if r[2] is not None:
        blob = bytes(r[2])
        if len(blob) % 4:
            problems.append(f"the row has {len(blob)} bytes, not float32 values")
        else:
            row = np.frombuffer(blob, dtype="<f4").astype(np.float32)
    bias, threshold, pa, pb = (_number(r[i], k, problems) for i, k in
                               ((3, "bias"), (4, "threshold"), (5, "platt_a"), (6, "platt_b")))
    examples = _number(r[7], "examples", problems)
    if math.isinf(examples):  # NaN is noted already
        problems.append(f"examples is {examples}")
    return ClassRow(slot=int(r[0]), name=str(r[1]), row=row, bias=bias, threshold=threshold, platt_a=pa,
                          platt_b=pb, examples=int(examples) if math.isfinite(examples) else 0, rule=str(r[8]),
                          created=_number(r[9], "created", problems), seq=int(r[10]), deleted=bool(r[11]),
                          problem="; ".join(problems) or None, lookalikes=lookalikes)


def _schema(blob: str, real: str, integer: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS enrolled_classes (
               digest TEXT NOT NULL,            -- the model key (older stores: the bundle's manifest digest)
               slot {integer} NOT NULL,          -- class id = D + slot; never reused within a key
               name TEXT NOT NULL,
               row {blob},                       -- float32 [d], little-endian; NULL once deleted
               bias {real}, threshold {real}, platt_a {real}, platt_b {real},
               examples {integer}, rule TEXT,
               created {real} NOT NULL,
               seq {integer} NOT NULL,           -- the write that last changed this slot
               deleted {integer} NOT NULL DEFAULT 0,
               PRIMARY KEY (digest, slot))""",
        "CREATE UNIQUE INDEX IF NOT EXISTS enrolled_live_name ON enrolled_classes(digest, name) WHERE deleted = 0",
        "CREATE INDEX IF NOT EXISTS enrolled_seq ON enrolled_classes(digest, seq)",
        f"""CREATE TABLE IF NOT EXISTS enrolled_examples (
               digest TEXT NOT NULL, slot {integer} NOT NULL,
               dim {integer} NOT NULL,
               embeddings {blob} NOT NULL,       -- float32 [examples, dim], little-endian: what the row was made from
               PRIMARY KEY (digest, slot))""",
        f"""CREATE TABLE IF NOT EXISTS enrolled_lookalikes (
               digest TEXT NOT NULL, slot {integer} NOT NULL,
               ids TEXT NOT NULL,                -- JSON list of class ids, sorted, distinct; no row: none
               PRIMARY KEY (digest, slot))""",
        f"""CREATE TABLE IF NOT EXISTS enrolled_state (
               digest TEXT PRIMARY KEY, next_slot {integer} NOT NULL, seq {integer} NOT NULL, live {integer} NOT NULL)""",
        *models_schema(real, integer),
    ]


class EnrolledStore(ModelTables):
    """The statements, shared by both databases; subclasses open the connection and the transaction."""

    mark = "?"  # the driver's placeholder

    def __init__(self, key: str):
        self.key = str(key)  # the model key (module docstring); `digest` in the tables
        self._lock = threading.Lock()  # one connection, one statement at a time

    @property
    def digest(self) -> str:  # the name the tables and older callers use
        return self.key

    def _sql(self, text: str) -> str:
        return text.replace("?", self.mark)

    @contextmanager
    def _write(self) -> Iterator[object]:
        raise NotImplementedError

    def _read(self, query: str, params: tuple) -> list[tuple]:
        raise NotImplementedError

    # ------------------------------------------------------------------ writes
    def _state(self, db) -> tuple[int, int, int]:
        """(next_slot, seq, live) of this digest, inside a write transaction."""
        row = db.execute(self._sql("SELECT next_slot, seq, live FROM enrolled_state WHERE digest = ?"),
                         (self.key,)).fetchone()
        if row is None:
            db.execute(self._sql("INSERT INTO enrolled_state (digest, next_slot, seq, live) VALUES (?, 0, 0, 0)"),
                       (self.key,))
            return 0, 0, 0
        return int(row[0]), int(row[1]), int(row[2])

    def put(self, name: str, row: np.ndarray, bias: float, threshold: float, platt_a: float, platt_b: float,
            examples: int, rule: str, limit: int, embeddings: Optional[np.ndarray] = None,
            expect_seq: Optional[int] = None, lookalikes: Sequence[int] = ()) -> Written:
        """Create or replace the class `name` (a replaced class keeps its slot), with the examples'
        `embeddings` [n, d] it was made from (kept so that examples can be added exactly) and its
        `lookalikes` (class ids, kept sorted and distinct; they replace the stored ones); durable
        once it returns. LimitReached when creating would pass `limit` live classes; Changed when
        `expect_seq` is given and the class is no longer at that write (added to meanwhile); ValueError,
        before anything is written, when a look-alike is not an int >= 0."""
        ids = lookalike_ids(lookalikes)
        blob = np.asarray(row, dtype="<f4").tobytes()
        now = time.time()
        values = (blob, float(bias), float(threshold), float(platt_a), float(platt_b), int(examples), rule, now)
        with self._write() as db:
            next_slot, seq, live = self._state(db)
            found = db.execute(self._sql("SELECT slot, seq FROM enrolled_classes WHERE digest = ? AND name = ? AND deleted = 0"),
                               (self.key, name)).fetchone()
            if expect_seq is not None and (found is None or int(found[1]) != expect_seq):
                raise Changed(name)
            seq += 1
            if found is not None:
                slot = int(found[0])
                db.execute(self._sql("""UPDATE enrolled_classes SET row = ?, bias = ?, threshold = ?, platt_a = ?,
                                        platt_b = ?, examples = ?, rule = ?, created = ?, seq = ?
                                        WHERE digest = ? AND slot = ?"""), (*values, seq, self.key, slot))
            else:
                if live >= limit:
                    raise LimitReached(f"{live} enrolled classes already, the limit (SLC_MAX_ENROLLED_CLASSES) is {limit}")
                slot, next_slot, live = next_slot, next_slot + 1, live + 1
                db.execute(self._sql(f"""INSERT INTO enrolled_classes (digest, {_COLUMNS})
                                         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)"""),
                           (self.key, slot, name, *values, seq))
            db.execute(self._sql("UPDATE enrolled_state SET next_slot = ?, seq = ?, live = ? WHERE digest = ?"),
                       (next_slot, seq, live, self.key))
            self._keep(db, slot, embeddings)
            self._note(db, slot, ids)
        return Written(slot=slot, created=found is None, seq=seq, at=now)

    def _keep(self, db, slot: int, embeddings: Optional[np.ndarray]) -> None:
        """The examples' embeddings of `slot`, replacing what was kept (none: nothing kept)."""
        db.execute(self._sql("DELETE FROM enrolled_examples WHERE digest = ? AND slot = ?"), (self.key, slot))
        if embeddings is not None:
            h = np.asarray(embeddings, dtype="<f4")
            db.execute(self._sql("INSERT INTO enrolled_examples (digest, slot, dim, embeddings) VALUES (?, ?, ?, ?)"),
                       (self.key, slot, int(h.shape[1]), h.tobytes()))

    def _note(self, db, slot: int, ids: tuple[int, ...]) -> None:
        """The look-alikes of `slot`, replacing what was stored (none: no row)."""
        db.execute(self._sql("DELETE FROM enrolled_lookalikes WHERE digest = ? AND slot = ?"), (self.key, slot))
        if ids:
            db.execute(self._sql("INSERT INTO enrolled_lookalikes (digest, slot, ids) VALUES (?, ?, ?)"),
                       (self.key, slot, json.dumps(list(ids), separators=(",", ":"))))

    def kept(self, name: str) -> Optional[Kept]:
        """The live class `name`'s slot, seq, kept embeddings and look-alikes; None when no class is live
        under it. Look-alikes that cannot be read are () here (the class's record names them)."""
        rows = self._read(self._sql(f"""SELECT c.slot, c.seq, e.dim, e.embeddings, l.ids FROM {_WITH_LOOKALIKES}
                                        LEFT JOIN enrolled_examples e ON e.digest = c.digest AND e.slot = c.slot
                                        WHERE c.digest = ? AND c.name = ? AND c.deleted = 0"""), (self.key, name))
        if not rows:
            return None
        slot, seq, dim, blob, ids = rows[0]
        h = None
        if blob is not None and dim and len(blob) % (4 * int(dim)) == 0:
            h = np.frombuffer(bytes(blob), dtype="<f4").reshape(-1, int(dim)).astype(np.float32)
        lookalikes, problem = _stored_lookalikes(ids)
        if problem:
            log.warning("enrolled class %r: %s; taken as none", name, problem)
        return Kept(int(slot), int(seq), h, lookalikes)

    def delete(self, name: str) -> Optional[Written]:
        """Delete the class live under `name` now: its slot (a tombstone now), or None when there is none."""
        return self._retire("name = ?", name)

    def delete_slot(self, slot: int) -> Optional[Written]:
        """Delete exactly the class of `slot` (id D + slot), or None when that slot is retired or was
        never used: never another class of the same name (a replica's snapshot may be behind)."""
        return self._retire("slot = ?", int(slot))

    def _retire(self, where: str, value) -> Optional[Written]:
        with self._write() as db:
            found = db.execute(self._sql(f"SELECT slot FROM enrolled_classes WHERE digest = ? AND {where} AND deleted = 0"),
                               (self.key, value)).fetchone()
            if found is None:
                return None
            next_slot, seq, live = self._state(db)
            db.execute(self._sql("""UPDATE enrolled_classes SET deleted = 1, row = NULL, seq = ?
                                    WHERE digest = ? AND slot = ?"""), (seq + 1, self.key, int(found[0])))
            db.execute(self._sql("UPDATE enrolled_state SET seq = ?, live = ? WHERE digest = ?"),
                       (seq + 1, live - 1, self.key))
            self._keep(db, int(found[0]), None)
            self._note(db, int(found[0]), ())
        return Written(slot=int(found[0]), created=False, seq=seq + 1, at=time.time())

    # ------------------------------------------------------------------ reads
    def seq(self) -> int:
        """The seq of this digest's last write (0: none): what a poller compares with what it applied."""
        rows = self._read(self._sql("SELECT seq FROM enrolled_state WHERE digest = ?"), (self.key,))
        return int(rows[0][0]) if rows else 0

    def other_bundles(self) -> int:
        """Live classes stored for other models (not served by this one)."""
        rows = self._read(self._sql("SELECT COUNT(*) FROM enrolled_classes WHERE digest != ? AND deleted = 0"),
                          (self.key,))
        return int(rows[0][0])

    def changes(self, since: int = 0) -> list[ClassRow]:
        """Every slot written after seq `since` (tombstones included), in seq order, with its look-alikes;
        a row whose values cannot be read comes with its `problem` (never an exception: one bad row must
        not stop a reader)."""
        rows = self._read(self._sql(f"SELECT {_JOINED} FROM {_WITH_LOOKALIKES} WHERE c.digest = ? AND c.seq > ? "
                                    "ORDER BY c.seq"), (self.key, int(since)))
        return [_record(r) for r in rows]

    def close(self) -> None:
        raise NotImplementedError


class SqliteEnrolledStore(EnrolledStore):
    """In the gallery's SQLite file (its own connection; WAL lets both work side by side)."""

    def __init__(self, data_dir: Path, key: str, max_bytes: Optional[int] = None):
        super().__init__(key)
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(Path(data_dir) / DB_NAME, isolation_level=None, check_same_thread=False, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        if max_bytes is not None:  # the gallery's quota holds for the file as a whole
            page = self._db.execute("PRAGMA page_size").fetchone()[0]
            self._db.execute(f"PRAGMA max_page_count={max(1, int(max_bytes) // page)}")
        with self._write() as db:
            for statement in _schema("BLOB", "REAL", "INTEGER"):
                db.execute(statement)

    @contextmanager
    def _write(self):
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")  # the writers' lock, across processes (may time out)
                yield self._db
                self._db.execute("COMMIT")
            except BaseException as exc:
                _rollback(self._db, exc)  # StorageFull / StoreUnavailable for a full or refusing store
                raise

    def _read(self, query: str, params: tuple) -> list[tuple]:
        with self._lock:
            try:
                return self._db.execute(query, params).fetchall()
            except sqlite3.OperationalError as exc:
                if (mapped := store_error(exc)) is not None:
                    raise mapped from exc
                raise

    def close(self) -> None:
        with self._lock:
            self._db.close()


class PostgresEnrolledStore(EnrolledStore):
    """In the gallery's PostgreSQL, shared by every replica."""

    mark = "%s"

    def __init__(self, url: str, key: str):
        super().__init__(key)
        try:
            import psycopg
        except ImportError:  # pragma: no cover - depends on the install
            raise GalleryUnavailable("--gallery-url needs psycopg: pip install 'slc[postgres]'") from None
        self._url, self._psycopg = url, psycopg
        self._db = None
        try:
            self._db = self._connect()
            with self._write() as db:
                for statement in _schema("BYTEA", "DOUBLE PRECISION", "BIGINT"):
                    db.execute(statement)
        except psycopg.OperationalError as exc:
            if self._db is not None:
                self._db.close()
            raise GalleryUnavailable(f"cannot reach the gallery database: {str(exc).strip().splitlines()[0]}") from None

    def _connect(self):
        return self._psycopg.connect(self._url, autocommit=True, connect_timeout=10, keepalives=1, keepalives_idle=30,
                                     options="-c statement_timeout=10000 -c lock_timeout=10000")

    def _ensure(self) -> None:
        if self._db.closed or self._db.broken:
            self._db.close()
            try:
                self._db = self._connect()
            except self._psycopg.OperationalError as exc:
                raise GalleryUnavailable(f"the gallery database is unavailable: {str(exc).strip().splitlines()[0]}") from None

    @contextmanager
    def _write(self):
        with self._lock:
            self._ensure()
            try:
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_LOCK_KEY,))
                    yield self._db
            except self._psycopg.errors.DiskFull as exc:
                raise StorageFull(f"the gallery could not commit: {exc}") from exc
            except self._refusals() as exc:
                raise StoreUnavailable(f"the store does not accept writes now: {_first_line(exc)}") from exc
            except self._psycopg.OperationalError as exc:
                raise GalleryUnavailable(f"the gallery database is unavailable: {_first_line(exc)}") from exc

    def _refusals(self) -> tuple[type, ...]:
        """PostgreSQL's "not now": a read-only transaction or server (a standby), a lock or statement
        past its timeout, a deadlock."""
        e = self._psycopg.errors
        return (e.ReadOnlySqlTransaction, e.LockNotAvailable, e.QueryCanceled, e.DeadlockDetected,
                e.SerializationFailure)

    def _read(self, query: str, params: tuple) -> list[tuple]:
        with self._lock:
            self._ensure()
            try:
                return self._db.execute(query, params).fetchall()
            except self._psycopg.OperationalError as exc:
                raise GalleryUnavailable(f"the gallery database is unavailable: {_first_line(exc)}") from exc

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def open_enrolled_store(url: Optional[str], data_dir: Path, key: str,
                        max_bytes: Optional[int] = None) -> EnrolledStore:
    """PostgreSQL when `url` is given, else the SQLite file of the gallery under `data_dir`."""
    if url:
        return PostgresEnrolledStore(url, key)
    return SqliteEnrolledStore(data_dir, key, max_bytes)


def open_for_bundle(url: Optional[str], data_dir: Path, bundle,
                    max_bytes: Optional[int] = None) -> tuple[EnrolledStore, ModelRecord, list]:
    """The store keyed by the bundle's model, the model recorded, and the classes an older slc kept under
    this manifest's digest, or the one before its last recalibration, re-keyed to it (ModelTables.register);
    (store, model, what was re-keyed). A store that refuses the write still opens, for reading."""
    from serving.bundle.recalibration import previous_digests

    model = ModelRecord.of_bundle(bundle, seen=time.time())
    store = open_enrolled_store(url, data_dir, model.key, max_bytes)
    try:  # the previous digest is rebuilt only when some key may be an older slc's (a large manifest costs seconds)
        legacy = [bundle.digest, *previous_digests(Path(bundle.path), bundle.digest)] if store.unrecorded() else []
        adopted = store.register(model, legacy)
    except (StoreUnavailable, StorageFull) as exc:
        log.warning("enrolled classes: the store refuses writes (%s); the model is not recorded and classes kept "
                    "under an older key are not re-keyed this time", _first_line(exc))
        adopted = []
    except BaseException:
        store.close()
        raise
    return store, model, adopted
