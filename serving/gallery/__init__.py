"""The durable retrieval gallery: items (id, embedding h, metadata, input) searched by logit.

`Gallery` keeps them in SQLite for one process (the default); `PostgresGallery` keeps them in a
PostgreSQL shared by every replica (`slc serve --gallery-url postgresql://…`). Both search the
same in-memory index (serving/gallery/range_search.py); `open_gallery` picks one from the settings.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from serving.gallery.base import GalleryBase, GalleryRecord, GalleryUnavailable, StorageFull, StoreUnavailable
from serving.gallery.sqlite import DB_NAME, Gallery

__all__ = ["DB_NAME", "Gallery", "GalleryBase", "GalleryRecord", "GalleryUnavailable", "StorageFull", "StoreUnavailable",
           "open_gallery"]


def open_gallery(url: Optional[str], data_dir: Path, bundle_digest: str, embed_dim: int,
                 max_bytes: Optional[int] = None) -> GalleryBase:
    """PostgreSQL when `url` is given (postgresql://…), else SQLite under `data_dir`."""
    if url:
        from serving.gallery.postgres import PostgresGallery

        return PostgresGallery(url, bundle_digest, embed_dim)
    return Gallery(data_dir, bundle_digest, embed_dim, max_bytes)
