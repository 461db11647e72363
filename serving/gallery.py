"""The durable retrieval gallery: items (id, embedding h, metadata, input) in SQLite, searched by logit.

A class search asks for every item x with z_j(x) = W_j · h(x) + b_j >= threshold. That is a
range search by inner product of the query [W_j, b_j] with the item vectors [h, 1], kept in a
faiss ``IndexIDMap(IndexFlatIP)`` (exact) whose int64 ids are the SQLite row numbers.

Durability: SQLite in WAL mode with ``synchronous=FULL``; ``upsert``/``delete`` return only
after COMMIT (the WAL is fsynced), and update the in-memory index after the commit. The index
is rebuilt from SQLite at start, so a kill -9 at any point loses no acknowledged write.

Bundle change: each row carries the digest of the bundle whose backbone made its embedding.
Rows of another digest are invisible (get, search, count skip them) until re-embedded from their
stored input with ``reembed(embed_fn)`` — which the app calls at start — or replaced by an
upsert of the same id; ``delete`` removes an id whatever its digest. Embeddings of different
backbones are never mixed in one search.

Exactness: faiss scores in float32 with rounding error. The radius handed to faiss is lowered
by a bound on that error (|err| <= (n+2)·2^-23·|q|·max|x|), then every candidate is re-scored
as a float64 dot product of the stored float32 vectors, rounded to float32 (the value
reported), and kept iff that logit >= threshold. So items exactly at the threshold are kept
and the reported logits are consistent with the decision.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import faiss
import numpy as np

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DB_NAME = "gallery.sqlite3"
_BATCH = 65_536
_SQL_VARS = 500  # ids per "IN (...)" query, well under SQLite's variable limit


class StorageFull(Exception):
    """A write could not be committed: the disk (or the gallery's quota) is full. Nothing was
    written; the gallery stays usable and writes succeed again once space returns."""


def _rollback(db: sqlite3.Connection, exc: BaseException) -> None:
    """Undo the open transaction without masking `exc`: after some errors (SQLITE_FULL among them)
    SQLite has already rolled back, and a second ROLLBACK would raise an error of its own."""
    if db.in_transaction:
        try:
            db.execute("ROLLBACK")
        except sqlite3.Error as rollback_exc:  # pragma: no cover - logged, the first error is the news
            log.warning("rollback after %r failed: %s", exc, rollback_exc)
    if isinstance(exc, sqlite3.OperationalError) and (
            getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "full" in str(exc).lower()):
        raise StorageFull(f"the gallery could not commit: {exc}") from exc


@dataclass
class GalleryRecord:
    id: str
    embedding: np.ndarray  # [d] float32: h(input) under the current bundle
    metadata: dict | None = None
    input: list = field(default_factory=list)


class Gallery:
    """Thread-safe: one SQLite connection and the faiss index behind one lock."""

    index_kind = "IndexIDMap(IndexFlatIP) exact, cpu"

    def __init__(self, data_dir: Path, bundle_digest: str, embed_dim: int, device: str = "auto",
                 max_bytes: int | None = None):
        # device is accepted for symmetry with ClassIndex; faiss GPU indexes have no range_search,
        # so the gallery index stays on CPU whatever is asked.
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.digest = str(bundle_digest)
        self.embed_dim = int(embed_dim)
        self.device = "cpu"
        self._lock = threading.RLock()
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
        self._closed = False
        self._rebuild()

    # ------------------------------------------------------------------------------ index
    def _rebuild(self) -> None:
        """The faiss index from the rows of this bundle's digest (at start: SQLite is the truth)."""
        t0 = time.perf_counter()
        self._index = faiss.IndexIDMap(faiss.IndexFlatIP(self.embed_dim + 1))
        self._max_norm = 0.0  # an upper bound of |[h, 1]| over indexed items, for the error margin
        cur = self._db.execute("SELECT num, embedding FROM items WHERE digest = ?", (self.digest,))
        while rows := cur.fetchmany(_BATCH):
            nums = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
            vecs = np.stack([self._vector(np.frombuffer(r[1], dtype="<f4")) for r in rows])
            self._add(nums, vecs)
        log.info("gallery: %d items indexed in %.2fs (%d of other bundles await re-embedding)",
                 self._index.ntotal, time.perf_counter() - t0, self.stale_count())

    def _vector(self, embedding: np.ndarray) -> np.ndarray:
        if embedding.shape != (self.embed_dim,):
            raise ValueError(f"embedding must have shape [{self.embed_dim}], got {list(embedding.shape)}")
        v = np.empty(self.embed_dim + 1, dtype=np.float32)
        v[:-1] = embedding
        v[-1] = 1.0
        return v

    def _add(self, nums: np.ndarray, vecs: np.ndarray) -> None:
        self._index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), nums)
        norms = np.sqrt(np.einsum("ij,ij->i", vecs.astype(np.float64), vecs.astype(np.float64)))
        self._max_norm = max(self._max_norm, float(norms.max(initial=0.0)))

    def _vectors_at(self, positions: np.ndarray) -> np.ndarray:
        """Stored vectors [len(positions), d+1] at storage positions of the flat index (a view, no copy of all)."""
        flat = faiss.downcast_index(self._index.index)
        xb = faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)
        return xb[positions]

    # ------------------------------------------------------------------------------ writes
    def upsert(self, items: list[GalleryRecord]) -> None:
        """Insert or replace items by id; returns once the transaction is durably committed."""
        latest: dict[str, GalleryRecord] = {}
        for item in items:  # the last record of an id in one call wins
            if not isinstance(item.id, str) or not item.id:
                raise ValueError("item id must be a non-empty string")
            latest[item.id] = item
        prepared = []
        for item in latest.values():
            emb = np.asarray(item.embedding, dtype=np.float32).reshape(-1)
            vec = self._vector(emb)
            if not np.isfinite(emb).all():
                raise ValueError(f"embedding of item {item.id!r} has NaN or inf")
            prepared.append((item, emb.astype("<f4").tobytes(), json.dumps(item.metadata, allow_nan=False),
                             json.dumps(item.input, allow_nan=False), vec))
        if not prepared:
            return
        with self._lock:
            self._check_open()
            now = time.time()
            nums, indexed = [], []
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for item, *_ in prepared:  # rows already in the faiss index (current digest) are replaced there
                    row = self._db.execute("SELECT num FROM items WHERE id = ? AND digest = ?", (item.id, self.digest)).fetchone()
                    if row is not None:
                        indexed.append(row[0])
                for item, blob, meta, inp, _ in prepared:
                    (num,) = self._db.execute(
                        """INSERT INTO items (id, digest, embedding, metadata, input, updated_at)
                           VALUES (?, ?, ?, ?, ?, ?)
                           ON CONFLICT(id) DO UPDATE SET digest = excluded.digest, embedding = excluded.embedding,
                               metadata = excluded.metadata, input = excluded.input, updated_at = excluded.updated_at
                           RETURNING num""", (item.id, self.digest, blob, meta, inp, now)).fetchone()
                    nums.append(num)
                self._db.execute("COMMIT")
            except BaseException as exc:
                _rollback(self._db, exc)
                raise
            if indexed:  # O(items in the index): only when replacing
                self._index.remove_ids(faiss.IDSelectorBatch(np.asarray(indexed, dtype=np.int64)))
            self._add(np.asarray(nums, dtype=np.int64), np.stack([p[4] for p in prepared]))

    def delete(self, id: str) -> bool:
        """Remove an item (of any bundle digest); True if it existed. Durable once it returns."""
        with self._lock:
            self._check_open()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("DELETE FROM items WHERE id = ? RETURNING num, digest", (id,)).fetchone()
                self._db.execute("COMMIT")
            except BaseException as exc:
                _rollback(self._db, exc)
                raise
            if row is None:
                return False
            if row[1] == self.digest:  # rows of other bundles are not in the index
                self._index.remove_ids(faiss.IDSelectorBatch(np.asarray([row[0]], dtype=np.int64)))
            return True

    # ------------------------------------------------------------------------------ reads
    def get(self, id: str) -> dict | None:
        with self._lock:
            self._check_open()
            row = self._db.execute("SELECT id, metadata, input FROM items WHERE id = ? AND digest = ?",
                                   (id, self.digest)).fetchone()
        if row is None:
            return None
        return {"id": row[0], "metadata": json.loads(row[1]), "input": json.loads(row[2])}

    def count(self) -> int:
        with self._lock:
            self._check_open()
            return int(self._index.ntotal)

    def search(self, w: np.ndarray, b: float, threshold: float, limit: int | None) -> list[tuple[str, float, dict | None]]:
        """Every item with logit w·h + b >= threshold, best first (ties by insertion order), at most ``limit``.

        Returns [(id, logit, metadata)]; logit is the float64 dot product rounded to float32.
        """
        threshold = float(threshold)
        if np.isnan(threshold):
            raise ValueError("threshold is NaN")
        if limit is not None and limit < 0:
            raise ValueError("limit must be >= 0")
        q = np.empty(self.embed_dim + 1, dtype=np.float32)  # [d + 1]
        q[:-1] = np.asarray(w, dtype=np.float32).reshape(-1)
        q[-1] = np.float32(b)
        if not np.isfinite(q).all():
            raise ValueError("class row has NaN or inf")
        if limit == 0:
            return []
        with self._lock:
            self._check_open()
            if self._index.ntotal == 0:
                return []
            q64 = q.astype(np.float64)
            n = self.embed_dim + 1
            # faiss keeps scores > radius; its float32 score is within `err` of the exact one
            err = (n + 2) * 2.0**-23 * float(np.sqrt(q64 @ q64)) * self._max_norm
            radius = np.float32(max(threshold - err - 2.0**-22 * abs(threshold), -np.finfo(np.float32).max))
            radius = float(np.nextafter(radius, np.float32(-np.inf)))
            lims, _, positions = self._index.index.range_search(q[None, :], radius)
            positions = positions[lims[0]:lims[1]].astype(np.int64)
            logits = np.empty(len(positions), dtype=np.float32)  # [C] candidates, re-scored in chunks
            for start in range(0, len(positions), _BATCH):
                chunk = positions[start:start + _BATCH]
                logits[start:start + len(chunk)] = self._vectors_at(chunk).astype(np.float64) @ q64
            keep = logits.astype(np.float64) >= threshold
            positions, logits = positions[keep], logits[keep]
            nums = faiss.vector_to_array(self._index.id_map)[positions]
            order = np.lexsort((nums, -logits))
            if limit is not None:
                order = order[:limit]
            nums, logits = nums[order], logits[order]
            meta = self._metadata_of(nums)
        return [(meta[int(k)][0], float(z), meta[int(k)][1]) for k, z in zip(nums, logits)]

    def _metadata_of(self, nums: Iterable[int]) -> dict[int, tuple[str, dict | None]]:
        out: dict[int, tuple[str, dict | None]] = {}
        nums = [int(k) for k in nums]
        for i in range(0, len(nums), _SQL_VARS):
            chunk = nums[i:i + _SQL_VARS]
            marks = ",".join("?" * len(chunk))
            for num, id_, meta in self._db.execute(f"SELECT num, id, metadata FROM items WHERE num IN ({marks})", chunk):
                out[num] = (id_, json.loads(meta))
        return out

    # ------------------------------------------------------------------------------ bundle change
    def stale_count(self) -> int:
        """Items embedded by another bundle, waiting for ``reembed``."""
        with self._lock:
            self._check_open()
            return int(self._db.execute("SELECT COUNT(*) FROM items WHERE digest != ?", (self.digest,)).fetchone()[0])

    def reembed(self, embed_fn: Callable[[list], np.ndarray], batch_size: int = 256) -> int:
        """Re-embed the items of other bundles from their stored inputs with this bundle's backbone.

        embed_fn(list of inputs) -> float32 [N, d]. Items whose input cannot be embedded (embed_fn
        raises ValueError) stay stale and are logged. Returns how many were re-embedded.
        """
        done, failed = 0, set()
        while True:
            with self._lock:
                self._check_open()
                rows = self._db.execute("SELECT id, metadata, input FROM items WHERE digest != ? ORDER BY num LIMIT ?",
                                        (self.digest, batch_size + len(failed))).fetchall()
            rows = [r for r in rows if r[0] not in failed][:batch_size]
            if not rows:
                return done
            inputs = [json.loads(r[2]) for r in rows]
            try:
                emb = np.asarray(embed_fn(inputs), dtype=np.float32).reshape(len(rows), self.embed_dim)
            except ValueError as exc:
                log.warning("gallery: cannot re-embed %d items (%s); they stay hidden", len(rows), exc)
                failed.update(r[0] for r in rows)
                continue
            self.upsert([GalleryRecord(r[0], e, json.loads(r[1]), inp) for r, e, inp in zip(rows, emb, inputs)])
            done += len(rows)

    # ------------------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("gallery is closed")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def __enter__(self) -> "Gallery":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
