"""What every gallery store shares: the record, the errors, validation of writes, search through
the in-memory index, and re-embedding after a bundle change.

Bundle change: each row carries the digest of the bundle whose backbone made its embedding.
Rows of another digest are invisible (get, search, count skip them) until re-embedded from their
stored input with ``reembed(embed_fn)`` (the app calls it at start) or replaced by an upsert of
the same id; ``delete`` removes an id whatever its digest. Embeddings of different backbones are
never mixed in one search.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np
import orjson

from serving.gallery.range_search import VectorIndex

log = logging.getLogger(__name__)


class StorageFull(Exception):
    """A write could not be committed: the disk (or the gallery's quota) is full. Nothing was
    written; the gallery stays usable and writes succeed again once space returns."""


class GalleryUnavailable(Exception):
    """The gallery's database cannot be reached (a shared PostgreSQL that is down)."""


class StoreUnavailable(Exception):
    """The store refuses writes for now (a read-only file or database, locked past its timeout, an
    I/O error): nothing was written, reads go on, a later retry may succeed (503 store_unavailable)."""


@dataclass
class GalleryRecord:
    id: str
    embedding: np.ndarray  # [d] float32: h(input) under the current bundle
    metadata: dict | None = None
    input: list = field(default_factory=list)
    metadata_json: Optional[bytes] = None  # the metadata already serialised and checked (serving/codecs/gallery_bodies.py)


@dataclass
class Prepared:
    """A validated write: the record, its stored forms and its index vector [d + 1]."""

    record: GalleryRecord
    blob: bytes
    metadata: str
    input: str
    vector: np.ndarray


class GalleryBase:
    """Search, validation and re-embedding over a store; subclasses hold the rows."""

    def __init__(self, bundle_digest: str, embed_dim: int):
        self.digest = str(bundle_digest)
        self.embed_dim = int(embed_dim)
        self.device = "cpu"  # faiss GPU indexes have no range_search: the gallery stays on CPU
        self._lock = threading.RLock()
        self._index = VectorIndex(self.embed_dim)
        self._closed = False

    @property
    def index_kind(self) -> str:
        return self._index.kind

    def prepare(self, items: list[GalleryRecord]) -> list[Prepared]:
        """Validated writes, the last record of an id in one call winning. ValueError if invalid."""
        latest: dict[str, GalleryRecord] = {}
        for item in items:
            if not isinstance(item.id, str) or not item.id:
                raise ValueError("item id must be a non-empty string")
            latest[item.id] = item
        prepared = []
        for item in latest.values():
            emb = np.asarray(item.embedding, dtype=np.float32).reshape(-1)
            vec = self._index.vector(emb)
            if not np.isfinite(emb).all():
                raise ValueError(f"embedding of item {item.id!r} has NaN or inf")
            prepared.append(Prepared(item, emb.astype("<f4").tobytes(), _json_text(item.metadata, item.metadata_json),
                                     _json_text(item.input), vec))
        return prepared

    def count(self) -> int:
        with self._lock:
            self._check_open()
            return self._index.ntotal

    def search(self, w: np.ndarray, b: float, threshold: float, limit: int | None,
               rivals: tuple[np.ndarray, np.ndarray] | None = None) -> list[tuple[str, float, dict | None]]:
        """Every item with logit w·h + b >= threshold, best first (ties by insertion order), at most ``limit``;
        with `rivals` (the class's look-alikes: VectorIndex.search), only those no look-alike passes by more.

        Returns [(id, logit, metadata)]; logit is the float64 dot product rounded to float32.
        """
        return [(i, z, json.loads(m)) for i, z, m in self.search_raw(w, b, threshold, limit, rivals)]

    def search_raw(self, w: np.ndarray, b: float, threshold: float, limit: int | None,
                   rivals: tuple[np.ndarray, np.ndarray] | None = None) -> list[tuple[str, float, str]]:
        """`search`, each item's metadata as its stored JSON text (nothing parsed)."""
        with self._lock:
            self._check_open()
            nums, logits = self._index.search(w, b, threshold, limit, rivals)
            meta = self._metadata_rows(nums) if len(nums) else {}
        return [(meta[int(k)][0], float(z), meta[int(k)][1] or "null") for k, z in zip(nums, logits) if int(k) in meta]

    def get(self, id: str) -> dict | None:
        """{id, metadata, input} of an item of this bundle, or None."""
        row = self._item_row(id)
        if row is None:
            return None
        return {"id": row[0], "metadata": json.loads(row[1] or "null"), "input": json.loads(row[2] or "null")}

    def get_json(self, id: str) -> bytes | None:
        """`get` as the JSON bytes of the answer, spliced from the stored JSON texts (nothing parsed)."""
        row = self._item_row(id)
        if row is None:
            return None
        return b"".join((b'{"id":', orjson.dumps(row[0]), b',"metadata":', (row[1] or "null").encode(),
                         b',"input":', (row[2] or "null").encode(), b"}"))

    def reembed(self, embed_fn: Callable[[list], np.ndarray], batch_size: int = 256) -> int:
        """Re-embed the items of other bundles from their stored inputs with this bundle's backbone.

        embed_fn(list of inputs) -> float32 [N, d]. Items whose input cannot be embedded (embed_fn
        raises ValueError) stay stale and are logged. Returns how many were re-embedded.
        """
        done, failed = 0, set()
        while True:
            with self._lock:
                self._check_open()
                rows = self._stale_rows(batch_size + len(failed))
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

    # what a store provides
    def upsert(self, items: list[GalleryRecord]) -> None:
        raise NotImplementedError

    def _metadata_rows(self, nums: Iterable[int]) -> dict[int, tuple[str, Optional[str]]]:
        """{row number: (id, metadata JSON text)} of the rows that exist. Under self._lock."""
        raise NotImplementedError

    def _item_row(self, id: str) -> Optional[tuple[str, Optional[str], Optional[str]]]:
        """(id, metadata JSON, input JSON) of the item of this bundle's digest, or None."""
        raise NotImplementedError

    def _stale_rows(self, limit: int) -> list[tuple[str, str, str]]:
        """(id, metadata JSON, input JSON) of up to `limit` rows of other digests, oldest first."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("gallery is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


def _json_text(value, serialised: Optional[bytes] = None) -> str:
    """The stored JSON text of a value (orjson: compact, several times faster than json on large inputs);
    ValueError for what JSON cannot hold. (orjson writes NaN as null: the routes refuse non-finite
    numbers before anything reaches the gallery.)"""
    if serialised is None:
        try:
            serialised = orjson.dumps(value)
        except orjson.JSONEncodeError as exc:
            raise ValueError(f"not JSON-serialisable: {exc}") from None
    return serialised.decode()
