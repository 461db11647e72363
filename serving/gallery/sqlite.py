"""The embedded gallery: items (id, embedding h, metadata, input) in SQLite, for one process.

Durability: SQLite in WAL mode with ``synchronous=FULL``; ``upsert``/``delete`` return only
after COMMIT (the WAL is fsynced), and update the in-memory index (serving/gallery/range_search.py)
after the commit. The index is rebuilt from SQLite at start, so a kill -9 at any point loses
no acknowledged write. Several replicas share a gallery through PostgreSQL instead
(serving/gallery/postgres.py).
"""
from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path
from typing import Iterable

import numpy as np

from serving.gallery.base import GalleryBase, GalleryRecord, StorageFull, StoreUnavailable

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DB_NAME = "gallery.sqlite3"
_BATCH = 65_536
_SQL_VARS = 500  # ids per "IN (...)" query, well under SQLite's variable limit


# SQLite's primary result codes of a store that refuses writes for now, and their messages (an error
# raised without a code, e.g. by a test, is known by its message)
_NOT_NOW = {sqlite3.SQLITE_READONLY, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR,
            sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM}
_NOT_NOW_TEXT = ("readonly", "read-only", "locked", "disk i/o error", "unable to open", "busy")


def store_error(exc: BaseException) -> Exception | None:
    """StorageFull for a full disk or quota, StoreUnavailable for a store that refuses writes for now
    (read-only, locked past the timeout, an I/O error); None for anything else (a bug: a 500)."""
    if not isinstance(exc, sqlite3.OperationalError):
        return None
    code, text = getattr(exc, "sqlite_errorcode", None), str(exc).lower()
    primary = None if code is None else code & 0xFF
    if primary == sqlite3.SQLITE_FULL or "full" in text:
        return StorageFull(f"the gallery could not commit: {exc}")
    if primary in _NOT_NOW or any(t in text for t in _NOT_NOW_TEXT):
        return StoreUnavailable(f"the store does not accept writes now: {exc}")
    return None


def _rollback(db: sqlite3.Connection, exc: BaseException) -> None:
    """Undo the open transaction without masking `exc`: after some errors (SQLITE_FULL among them)
    SQLite has already rolled back, and a second ROLLBACK would raise an error of its own. A full or
    refusing store raises its own exception (store_error)."""
    if db.in_transaction:
        try:
            db.execute("ROLLBACK")
        except sqlite3.Error as rollback_exc:  # pragma: no cover - logged, the first error is the news
            log.warning("rollback after %r failed: %s", exc, rollback_exc)
    if (mapped := store_error(exc)) is not None:
        raise mapped from exc


class Gallery(GalleryBase):
    """Thread-safe: one SQLite connection and the index behind one lock."""

    def __init__(self, data_dir: Path, bundle_digest: str, embed_dim: int, max_bytes: int | None = None):
        super().__init__(bundle_digest, embed_dim)
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.data_dir / DB_NAME, isolation_level=None, check_same_thread=False,
                                   timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        if max_bytes is not None:  # a quota: past it a write fails like a full disk (StorageFull)
            page = self._db.execute("PRAGMA page_size").fetchone()[0]
            self._db.execute(f"PRAGMA max_page_count={max(1, int(max_bytes) // page)}")
        self._db.execute(
            """CREATE TABLE IF NOT EXISTS items (
                   num INTEGER PRIMARY KEY,          -- stable int64 id of the row in the faiss index
                   id TEXT NOT NULL UNIQUE,
                   digest TEXT NOT NULL,             -- bundle whose backbone computed the embedding
                   embedding BLOB NOT NULL,          -- float32 [d], little-endian
                   metadata TEXT,                    -- JSON
                   input TEXT,                       -- JSON: the raw input, kept for re-embedding
                   updated_at REAL NOT NULL)""")
        self._db.execute("CREATE INDEX IF NOT EXISTS items_digest ON items(digest)")
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self._rebuild()

    # ------------------------------------------------------------------------------ index
    def _rebuild(self) -> None:
        """The index from the rows of this bundle's digest (at start: SQLite is the truth)."""
        t0 = time.perf_counter()
        cur = self._db.execute("SELECT num, embedding FROM items WHERE digest = ?", (self.digest,))
        while rows := cur.fetchmany(_BATCH):
            nums = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
            vecs = np.stack([self._index.vector(np.frombuffer(r[1], dtype="<f4")) for r in rows])
            self._index.add(nums, vecs)
        log.info("gallery: %d items indexed in %.2fs (%d of other bundles await re-embedding)",
                 self._index.ntotal, time.perf_counter() - t0, self.stale_count())

    # ------------------------------------------------------------------------------ writes
    def upsert(self, items: list[GalleryRecord]) -> None:
        """Insert or replace items by id; returns once the transaction is durably committed."""
        prepared = self.prepare(items)
        if not prepared:
            return
        with self._lock:
            self._check_open()
            now = time.time()
            nums, indexed = [], []
            try:
                self._db.execute("BEGIN IMMEDIATE")  # inside: a lock held past the timeout fails here
                for p in prepared:  # rows already in the index (current digest) are replaced there
                    row = self._db.execute("SELECT num FROM items WHERE id = ? AND digest = ?",
                                           (p.record.id, self.digest)).fetchone()
                    if row is not None:
                        indexed.append(row[0])
                for p in prepared:
                    (num,) = self._db.execute(
                        """INSERT INTO items (id, digest, embedding, metadata, input, updated_at)
                           VALUES (?, ?, ?, ?, ?, ?)
                           ON CONFLICT(id) DO UPDATE SET digest = excluded.digest, embedding = excluded.embedding,
                               metadata = excluded.metadata, input = excluded.input, updated_at = excluded.updated_at
                           RETURNING num""", (p.record.id, self.digest, p.blob, p.metadata, p.input, now)).fetchone()
                    nums.append(num)
                self._db.execute("COMMIT")
            except BaseException as exc:
                _rollback(self._db, exc)
                raise
            self._index.remove(indexed)  # O(items in the index): only when replacing
            self._index.add(np.asarray(nums, dtype=np.int64), np.stack([p.vector for p in prepared]))

    def delete(self, id: str) -> bool:
        """Remove an item (of any bundle digest); True if it existed. Durable once it returns."""
        with self._lock:
            self._check_open()
            try:
                self._db.execute("BEGIN IMMEDIATE")
                row = self._db.execute("DELETE FROM items WHERE id = ? RETURNING num, digest", (id,)).fetchone()
                self._db.execute("COMMIT")
            except BaseException as exc:
                _rollback(self._db, exc)
                raise
            if row is None:
                return False
            if row[1] == self.digest:  # rows of other bundles are not in the index
                self._index.remove([row[0]])
            return True

    # ------------------------------------------------------------------------------ reads
    def _item_row(self, id: str) -> tuple[str, str | None, str | None] | None:
        with self._lock:
            self._check_open()
            return self._db.execute("SELECT id, metadata, input FROM items WHERE id = ? AND digest = ?",
                                    (id, self.digest)).fetchone()

    def _metadata_rows(self, nums: Iterable[int]) -> dict[int, tuple[str, str | None]]:
        out: dict[int, tuple[str, str | None]] = {}
        nums = [int(k) for k in nums]
        for i in range(0, len(nums), _SQL_VARS):
            chunk = nums[i:i + _SQL_VARS]
            marks = ",".join("?" * len(chunk))
            for num, id_, meta in self._db.execute(f"SELECT num, id, metadata FROM items WHERE num IN ({marks})", chunk):
                out[num] = (id_, meta)
        return out

    # ------------------------------------------------------------------------------ bundle change
    def stale_count(self) -> int:
        """Items embedded by another bundle, waiting for ``reembed``."""
        with self._lock:
            self._check_open()
            return int(self._db.execute("SELECT COUNT(*) FROM items WHERE digest != ?", (self.digest,)).fetchone()[0])

    def _stale_rows(self, limit: int) -> list[tuple[str, str, str]]:
        return self._db.execute("SELECT id, metadata, input FROM items WHERE digest != ? ORDER BY num LIMIT ?",
                                (self.digest, limit)).fetchall()

    # ------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()
