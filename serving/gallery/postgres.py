"""A gallery shared by every replica: items in PostgreSQL, each replica's index kept in step.

`slc serve --gallery-url postgresql://…` (needs `pip install 'slc[postgres]'`: psycopg).

Every write takes one transaction-level advisory lock, so writes commit in the order of the
sequence numbers they draw: each upserted row gets `seq = nextval(...)`, each deleted row leaves
a tombstone (num, seq), and the transaction ends with NOTIFY. A replica keeps `last_seq` and
catches up with `SELECT … WHERE seq > last_seq` (rows of its bundle's digest are added to its
index, replaced rows re-added, tombstoned rows removed): right after each of its own writes
(read-your-writes), on every NOTIFY, and at least every `poll_s` seconds (a lost notification
only delays). A write is acknowledged after COMMIT (synchronous_commit as the server sets it,
on by default), so it survives kill -9 of any replica; a starting replica builds its index from
the table.

Tombstones older than a day are pruned by writers; a replica whose `last_seq` falls behind the
pruned range (away for a day) rebuilds its index from the table instead of catching up.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Iterable

import numpy as np

from serving.gallery.base import GalleryBase, GalleryRecord, GalleryUnavailable, StorageFull

log = logging.getLogger(__name__)

CHANNEL = "slc_gallery"
_LOCK_KEY = 0x51C6A11E  # the advisory lock every writer takes
_TOMBSTONE_DAYS = 1

_SCHEMA = [
    "CREATE SEQUENCE IF NOT EXISTS slc_gallery_seq",
    """CREATE TABLE IF NOT EXISTS slc_gallery_items (
           num BIGSERIAL PRIMARY KEY,       -- stable int64 id of the row in every replica's index
           id TEXT NOT NULL UNIQUE,
           digest TEXT NOT NULL,            -- bundle whose backbone computed the embedding
           embedding BYTEA NOT NULL,        -- float32 [d], little-endian
           metadata TEXT,                   -- JSON
           input TEXT,                      -- JSON: the raw input, kept for re-embedding
           updated_at DOUBLE PRECISION NOT NULL,
           seq BIGINT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS slc_gallery_items_seq ON slc_gallery_items(seq)",
    "CREATE INDEX IF NOT EXISTS slc_gallery_items_digest ON slc_gallery_items(digest)",
    """CREATE TABLE IF NOT EXISTS slc_gallery_tombstones (
           seq BIGINT PRIMARY KEY, num BIGINT NOT NULL, deleted_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS slc_gallery_pruned (one INT PRIMARY KEY DEFAULT 1, upto BIGINT NOT NULL)""",
]


def _psycopg():
    try:
        import psycopg
    except ImportError:  # pragma: no cover - depends on the install
        raise GalleryUnavailable("--gallery-url needs psycopg: pip install 'slc[postgres]'") from None
    return psycopg


class PostgresGallery(GalleryBase):
    """Thread-safe: one connection for requests behind the lock, one listening for NOTIFY."""

    def __init__(self, url: str, bundle_digest: str, embed_dim: int, poll_s: float = 0.5):
        super().__init__(bundle_digest, embed_dim)
        psycopg = _psycopg()
        self._url, self._errors, self._operational = url, psycopg.errors, psycopg.OperationalError
        self._db = self._listener = None
        try:
            self._db = self._connect()
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))  # one replica creates the schema
                for statement in _SCHEMA:
                    self._db.execute(statement)
            self._listener = self._connect(listen=True)
            self.last_seq = 0
            self._rebuild()
        except psycopg.OperationalError as exc:
            for conn in (self._db, self._listener):
                if conn is not None:
                    conn.close()
            raise GalleryUnavailable(f"cannot reach the gallery database: {_first_line(exc)}") from None
        self._poll_s = float(poll_s)
        self._stop = threading.Event()
        self._follower = threading.Thread(target=self._follow, name="gallery-follower", daemon=True)
        self._follower.start()

    # ------------------------------------------------------------------------------ connections
    def _connect(self, listen: bool = False):
        """A connection with bounded waits: statements and lock waits end after 10 s (503, not a
        stall), TCP keepalives notice a dead peer."""
        import psycopg

        conn = psycopg.connect(self._url, autocommit=True, connect_timeout=10, keepalives=1, keepalives_idle=30,
                               options="-c statement_timeout=10000 -c lock_timeout=10000")
        if listen:
            conn.execute(f"LISTEN {CHANNEL}")
        return conn

    def _ensure_db(self) -> None:
        """After the database restarted (or the connection broke): reconnect, then rebuild the index
        from the table, since changes made meanwhile may have been missed. Under self._lock."""
        if not (self._db.closed or self._db.broken):
            return
        self._db.close()
        try:
            self._db = self._connect()
        except self._operational as exc:
            raise GalleryUnavailable(f"the gallery database is unavailable: {_first_line(exc)}") from None
        log.warning("gallery: reconnected to PostgreSQL; rebuilding the index")
        self._rebuild()

    # ------------------------------------------------------------------------------ keeping in step
    def _rebuild(self) -> None:
        """The index from every row of this bundle's digest; last_seq = the newest seq drawn. Under
        the writers' lock, so no write is half-way (drawn its seq, not yet committed). Built aside
        and swapped in only once complete: a failure leaves the old index and last_seq."""
        t0 = time.perf_counter()
        with self._lock:
            try:
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
                    (last_seq,) = self._db.execute(
                        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM slc_gallery_seq").fetchone()
                    rows = self._db.execute("SELECT num, digest, embedding, seq FROM slc_gallery_items WHERE digest = %s",
                                            (self.digest,)).fetchall()
            except self._operational as exc:
                raise GalleryUnavailable(f"the gallery database is unavailable: {_first_line(exc)}") from None
            index = type(self._index)(self.embed_dim)
            self._apply_rows(rows, index)
            self._index, self.last_seq = index, last_seq
        log.info("gallery: %d items indexed from PostgreSQL in %.2fs", self._index.ntotal, time.perf_counter() - t0)

    def _apply_rows(self, rows, index=None) -> None:
        """Rows (num, digest, embedding, seq) that are new or changed: into the index if ours."""
        index = self._index if index is None else index
        if not rows:
            return
        index.remove(r[0] for r in rows)
        mine = [r for r in rows if r[1] == self.digest]
        if mine:
            index.add(np.asarray([r[0] for r in mine], dtype=np.int64),
                      np.stack([index.vector(np.frombuffer(r[2], dtype="<f4")) for r in mine]))

    def catch_up(self) -> None:
        """Apply every change committed after last_seq (idempotent)."""
        with self._lock:
            self._check_open()
            self._ensure_db()
            pruned = self._read("SELECT upto FROM slc_gallery_pruned", ())
            if pruned and pruned[0][0] > self.last_seq:
                log.warning("gallery: this replica fell behind the pruned tombstones; rebuilding its index")
                self._rebuild()
                return
            changes = self._read(  # one statement, one snapshot: upserts and deletes seen together
                """SELECT num, digest, embedding, seq, FALSE FROM slc_gallery_items WHERE seq > %s
                   UNION ALL SELECT num, NULL, NULL, seq, TRUE FROM slc_gallery_tombstones WHERE seq > %s""",
                (self.last_seq, self.last_seq))
            self._apply_rows([c[:4] for c in changes if not c[4]])
            self._index.remove(c[0] for c in changes if c[4])
            self.last_seq = max([self.last_seq] + [c[3] for c in changes])

    def _follow(self) -> None:
        """Catch up on every NOTIFY and every poll_s seconds, until closed; reconnect when the
        database comes back (the catch-up then rebuilds the index)."""
        while not self._stop.is_set():
            try:
                if self._listener.closed or self._listener.broken:
                    self._listener.close()
                    self._listener = self._connect(listen=True)
                for _ in self._listener.notifies(timeout=self._poll_s, stop_after=1):
                    pass
                if not self._stop.is_set():
                    self.catch_up()
            except Exception as exc:  # the database went away: keep serving what is indexed, retry
                if self._stop.is_set():
                    return
                log.warning("gallery: cannot follow changes (%s); retrying", _first_line(exc))
                self._stop.wait(1.0)

    # ------------------------------------------------------------------------------ writes
    def _write(self, statements) -> None:
        """Run statements() in one locked transaction that ends with NOTIFY; map errors; then catch
        up (the write is durable already: a failed catch-up is left to the follower)."""
        self._ensure_db()
        try:
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
                statements()
                self._db.execute(f"NOTIFY {CHANNEL}")
        except self._errors.DiskFull as exc:
            raise StorageFull(f"the gallery could not commit: {exc}") from exc
        except self._operational as exc:  # includes statement and lock timeouts
            raise GalleryUnavailable(f"the gallery database is unavailable: {_first_line(exc)}") from exc
        try:
            self.catch_up()
        except GalleryUnavailable as exc:
            log.warning("gallery: committed, but catching up failed (%s); the follower will", exc)

    def upsert(self, items: list[GalleryRecord]) -> None:
        """Insert or replace items by id; returns once committed and in this replica's index."""
        prepared = self.prepare(items)
        if not prepared:
            return
        now = time.time()

        def statements():
            for p in prepared:
                self._db.execute(
                    """INSERT INTO slc_gallery_items (id, digest, embedding, metadata, input, updated_at, seq)
                       VALUES (%s, %s, %s, %s, %s, %s, nextval('slc_gallery_seq'))
                       ON CONFLICT (id) DO UPDATE SET digest = excluded.digest, embedding = excluded.embedding,
                           metadata = excluded.metadata, input = excluded.input, updated_at = excluded.updated_at,
                           seq = excluded.seq""",
                    (p.record.id, self.digest, p.blob, p.metadata, p.input, now))

        with self._lock:
            self._check_open()
            self._write(statements)

    def delete(self, id: str) -> bool:
        """Remove an item (of any bundle digest); True if it existed. Durable once it returns."""
        found = []

        def statements():
            row = self._db.execute("DELETE FROM slc_gallery_items WHERE id = %s RETURNING num", (id,)).fetchone()
            if row is not None:
                found.append(row[0])
                self._db.execute("""INSERT INTO slc_gallery_tombstones (seq, num, deleted_at)
                                    VALUES (nextval('slc_gallery_seq'), %s, %s)""", (row[0], time.time()))
            self._prune()

        if "\x00" in id:  # PostgreSQL text cannot hold NUL: no such item can exist
            return False
        with self._lock:
            self._check_open()
            self._write(statements)
        return bool(found)

    def _prune(self) -> None:
        """Drop tombstones older than a day and record how far (inside a write transaction)."""
        row = self._db.execute("""DELETE FROM slc_gallery_tombstones WHERE deleted_at < %s RETURNING seq""",
                               (time.time() - 86400 * _TOMBSTONE_DAYS,)).fetchall()
        if row:
            self._db.execute("""INSERT INTO slc_gallery_pruned (one, upto) VALUES (1, %s)
                                ON CONFLICT (one) DO UPDATE SET upto = GREATEST(slc_gallery_pruned.upto, excluded.upto)""",
                             (max(r[0] for r in row),))

    # ------------------------------------------------------------------------------ reads
    def _item_row(self, id: str) -> tuple[str, str | None, str | None] | None:
        if "\x00" in id:  # PostgreSQL text cannot hold NUL: no such item can exist
            return None
        with self._lock:
            self._check_open()
            row = self._read("SELECT id, metadata, input FROM slc_gallery_items WHERE id = %s AND digest = %s",
                             (id, self.digest))
        return tuple(row[0]) if row else None

    def _metadata_rows(self, nums: Iterable[int]) -> dict[int, tuple[str, str | None]]:
        rows = self._read("SELECT num, id, metadata FROM slc_gallery_items WHERE num = ANY(%s)", ([int(k) for k in nums],))
        return {num: (id_, meta) for num, id_, meta in rows}

    def stale_count(self) -> int:
        with self._lock:
            self._check_open()
            return int(self._read("SELECT COUNT(*) FROM slc_gallery_items WHERE digest != %s", (self.digest,))[0][0])

    def _stale_rows(self, limit: int) -> list[tuple[str, str, str]]:
        return self._read("SELECT id, metadata, input FROM slc_gallery_items WHERE digest != %s ORDER BY num LIMIT %s",
                          (self.digest, limit))

    def _read(self, query: str, params) -> list[tuple]:
        self._ensure_db()
        try:
            return self._db.execute(query, params).fetchall()
        except self._operational as exc:
            raise GalleryUnavailable(f"the gallery database is unavailable: {_first_line(exc)}") from exc

    # ------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._stop.set()
        self._follower.join(timeout=5)
        with self._lock:
            if not self._closed:
                self._closed = True
                self._listener.close()
                self._db.close()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
