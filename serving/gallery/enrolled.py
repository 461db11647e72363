"""Enrolled classes (issue 38) in the gallery's own store: SQLite in `data_dir` (WAL, synchronous=FULL)
or the PostgreSQL of `--gallery-url`, shared by every replica.

One row per slot: (digest, slot, name, row bytes, bias, threshold, Platt a/b, examples, rule,
created, seq, deleted). A write runs in one transaction that holds the writers' lock (SQLite's
BEGIN IMMEDIATE, PostgreSQL's advisory lock), draws the next `seq` of its bundle digest and, for a
new name, the next slot (slots are never reused: a deleted class keeps its row as a tombstone,
`deleted = 1`, its bytes dropped). It is answered only after COMMIT, so a kill -9 after the answer
loses nothing. A reader keeps the last seq it applied and asks for `changes(since)`: every row
whose seq is newer, tombstones included, in one statement (one snapshot); the cheap `seq()` tells
a poller whether there is anything to ask for.

Rows belong to the digest of the bundle they were computed for: another bundle reads none of them
(they stay in the store, served again when that bundle is).
"""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from serving.gallery.base import GalleryUnavailable, StorageFull
from serving.gallery.sqlite import DB_NAME, _rollback

log = logging.getLogger(__name__)

_PG_LOCK_KEY = 0x51C6E2A0  # the advisory lock every enrolled-class writer takes (not the gallery's)

_COLUMNS = "slot, name, row, bias, threshold, platt_a, platt_b, examples, rule, created, seq, deleted"


class LimitReached(Exception):
    """The bundle already has the configured number of enrolled classes; nothing was written."""


@dataclass
class EnrolledRecord:
    """One stored slot: a live class, or a tombstone (deleted, row None)."""

    slot: int
    name: str
    row: Optional[np.ndarray]  # [d] float32
    bias: float
    threshold: float
    platt_a: float
    platt_b: float
    examples: int
    rule: str
    created: float
    seq: int
    deleted: bool


@dataclass
class Written:
    """What a put did: the class's slot, whether it was new, and the seq of the write."""

    slot: int
    created: bool
    seq: int


def _schema(blob: str, real: str, integer: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS enrolled_classes (
               digest TEXT NOT NULL,            -- bundle whose backbone and head the row belongs to
               slot {integer} NOT NULL,          -- class id = D + slot; never reused within a digest
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
        f"""CREATE TABLE IF NOT EXISTS enrolled_state (
               digest TEXT PRIMARY KEY, next_slot {integer} NOT NULL, seq {integer} NOT NULL, live {integer} NOT NULL)""",
    ]


class EnrolledStore:
    """The statements, shared by both databases; subclasses open the connection and the transaction."""

    mark = "?"  # the driver's placeholder

    def __init__(self, digest: str):
        self.digest = str(digest)
        self._lock = threading.Lock()  # one connection, one statement at a time

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
                         (self.digest,)).fetchone()
        if row is None:
            db.execute(self._sql("INSERT INTO enrolled_state (digest, next_slot, seq, live) VALUES (?, 0, 0, 0)"),
                       (self.digest,))
            return 0, 0, 0
        return int(row[0]), int(row[1]), int(row[2])

    def put(self, name: str, row: np.ndarray, bias: float, threshold: float, platt_a: float, platt_b: float,
            examples: int, rule: str, limit: int) -> Written:
        """Create or replace the class `name` (a replaced class keeps its slot); durable once it returns.
        LimitReached when creating would pass `limit` live classes."""
        blob = np.asarray(row, dtype="<f4").tobytes()
        values = (blob, float(bias), float(threshold), float(platt_a), float(platt_b), int(examples), rule, time.time())
        with self._write() as db:
            next_slot, seq, live = self._state(db)
            found = db.execute(self._sql("SELECT slot FROM enrolled_classes WHERE digest = ? AND name = ? AND deleted = 0"),
                               (self.digest, name)).fetchone()
            seq += 1
            if found is not None:
                slot = int(found[0])
                db.execute(self._sql("""UPDATE enrolled_classes SET row = ?, bias = ?, threshold = ?, platt_a = ?,
                                        platt_b = ?, examples = ?, rule = ?, created = ?, seq = ?
                                        WHERE digest = ? AND slot = ?"""), (*values, seq, self.digest, slot))
            else:
                if live >= limit:
                    raise LimitReached(f"{live} enrolled classes already, the limit (SLC_MAX_ENROLLED_CLASSES) is {limit}")
                slot, next_slot, live = next_slot, next_slot + 1, live + 1
                db.execute(self._sql(f"""INSERT INTO enrolled_classes (digest, {_COLUMNS})
                                         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)"""),
                           (self.digest, slot, name, *values, seq))
            db.execute(self._sql("UPDATE enrolled_state SET next_slot = ?, seq = ?, live = ? WHERE digest = ?"),
                       (next_slot, seq, live, self.digest))
        return Written(slot=slot, created=found is None, seq=seq)

    def delete(self, name: str) -> Optional[int]:
        """Delete the live class `name`: its slot (a tombstone now), or None when there is none."""
        with self._write() as db:
            found = db.execute(self._sql("SELECT slot FROM enrolled_classes WHERE digest = ? AND name = ? AND deleted = 0"),
                               (self.digest, name)).fetchone()
            if found is None:
                return None
            next_slot, seq, live = self._state(db)
            db.execute(self._sql("""UPDATE enrolled_classes SET deleted = 1, row = NULL, seq = ?
                                    WHERE digest = ? AND slot = ?"""), (seq + 1, self.digest, int(found[0])))
            db.execute(self._sql("UPDATE enrolled_state SET seq = ?, live = ? WHERE digest = ?"),
                       (seq + 1, live - 1, self.digest))
        return int(found[0])

    # ------------------------------------------------------------------ reads
    def seq(self) -> int:
        """The seq of this digest's last write (0: none): what a poller compares with what it applied."""
        rows = self._read(self._sql("SELECT seq FROM enrolled_state WHERE digest = ?"), (self.digest,))
        return int(rows[0][0]) if rows else 0

    def other_bundles(self) -> int:
        """Live classes stored for other bundle digests (not served by this one)."""
        rows = self._read(self._sql("SELECT COUNT(*) FROM enrolled_classes WHERE digest != ? AND deleted = 0"),
                          (self.digest,))
        return int(rows[0][0])

    def changes(self, since: int = 0) -> list[EnrolledRecord]:
        """Every slot written after seq `since` (tombstones included), in seq order."""
        rows = self._read(self._sql(f"SELECT {_COLUMNS} FROM enrolled_classes WHERE digest = ? AND seq > ? ORDER BY seq"),
                          (self.digest, int(since)))
        return [EnrolledRecord(slot=int(r[0]), name=str(r[1]),
                               row=None if r[2] is None else np.frombuffer(bytes(r[2]), dtype="<f4").astype(np.float32),
                               bias=float(r[3]), threshold=float(r[4]), platt_a=float(r[5]), platt_b=float(r[6]),
                               examples=int(r[7]), rule=str(r[8]), created=float(r[9]), seq=int(r[10]),
                               deleted=bool(r[11])) for r in rows]

    def close(self) -> None:
        raise NotImplementedError


class SqliteEnrolledStore(EnrolledStore):
    """In the gallery's SQLite file (its own connection; WAL lets both work side by side)."""

    def __init__(self, data_dir: Path, digest: str, max_bytes: Optional[int] = None):
        super().__init__(digest)
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
            self._db.execute("BEGIN IMMEDIATE")  # the writers' lock, across processes
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException as exc:
                _rollback(self._db, exc)  # StorageFull for a full disk or quota
                raise

    def _read(self, query: str, params: tuple) -> list[tuple]:
        with self._lock:
            return self._db.execute(query, params).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()


class PostgresEnrolledStore(EnrolledStore):
    """In the gallery's PostgreSQL, shared by every replica."""

    mark = "%s"

    def __init__(self, url: str, digest: str):
        super().__init__(digest)
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
            except self._psycopg.OperationalError as exc:
                raise GalleryUnavailable(f"the gallery database is unavailable: {str(exc).strip().splitlines()[0]}") from exc

    def _read(self, query: str, params: tuple) -> list[tuple]:
        with self._lock:
            self._ensure()
            try:
                return self._db.execute(query, params).fetchall()
            except self._psycopg.OperationalError as exc:
                raise GalleryUnavailable(f"the gallery database is unavailable: {str(exc).strip().splitlines()[0]}") from exc

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()


def open_enrolled_store(url: Optional[str], data_dir: Path, digest: str,
                        max_bytes: Optional[int] = None) -> EnrolledStore:
    """PostgreSQL when `url` is given, else the SQLite file of the gallery under `data_dir`."""
    if url:
        return PostgresEnrolledStore(url, digest)
    return SqliteEnrolledStore(data_dir, digest, max_bytes)
