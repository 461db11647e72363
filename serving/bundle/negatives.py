"""Calibration negatives (issue 38): a sample of the calibration split's embeddings with their
labels, optional in a bundle (older bundles have none). The server's per-class threshold of an
enrolled class (SLC_ENROLL_THRESHOLD=negatives) reads them: examples of the trained classes are
negatives of a new one.

  calibration_embeddings.npy   float32 [N, d]: backbone.onnx embeddings (as the server computes them)
  calibration_labels.npy       int64 [N]: their classes, 0..D-1
  manifest `negatives`         {embeddings, labels, count, split, sample}

Hashed in the manifest like every file; `check_negatives` is verify's check when they are present.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

EMBEDDINGS = "calibration_embeddings.npy"
LABELS = "calibration_labels.npy"
MAX_NEGATIVES = 20_000


def write_negatives(out: Path, h: np.ndarray, labels: np.ndarray, split: str = "calibration",
                    limit: int = MAX_NEGATIVES, seed: int = 0) -> dict:
    """A uniform sample (without replacement, seeded) of at most `limit` rows of h [N, d] and labels [N];
    the manifest's `negatives` entry."""
    n = len(h)
    pick = np.sort(np.random.default_rng(seed).choice(n, min(n, limit), replace=False)) if n > limit else np.arange(n)
    np.save(Path(out) / EMBEDDINGS, np.ascontiguousarray(np.asarray(h)[pick], dtype=np.float32))
    np.save(Path(out) / LABELS, np.asarray(labels)[pick].astype(np.int64))
    return {"embeddings": EMBEDDINGS, "labels": LABELS, "count": int(len(pick)), "split": split,
            "sample": f"uniform without replacement, seed {seed}, at most {limit}"}


def read_negatives(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(embeddings [N, d] float32, memory-mapped; labels [N] int64) of the bundle at `path`, or None
    when it carries none (an older bundle): the one place their file names are read."""
    path = Path(path)
    if not (path / EMBEDDINGS).is_file():
        return None
    return (np.load(path / EMBEDDINGS, mmap_mode="r", allow_pickle=False),
            np.load(path / LABELS, allow_pickle=False))


def check_negatives(path: Path, manifest: dict, deep: bool) -> list[str]:
    """Problems of the negatives a bundle lists (none when it has none): shapes, dtypes, labels in
    0..D-1, and with `deep` finite embeddings."""
    files = manifest.get("files") or {}
    if EMBEDDINGS not in files and LABELS not in files:
        return []
    if EMBEDDINGS not in files or LABELS not in files:
        return [f"{EMBEDDINGS} and {LABELS} go together: the manifest lists only one of them"]
    D, d = int(manifest["num_classes"]), int(manifest["embed_dim"])
    try:
        h = np.load(path / EMBEDDINGS, mmap_mode="r", allow_pickle=False)
        y = np.load(path / LABELS, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001
        return [f"{EMBEDDINGS}: cannot be read as .npy ({str(e)[:200]})"]
    if h.dtype != np.float32 or h.ndim != 2 or h.shape[1] != d:
        return [f"{EMBEDDINGS}: expected float32 [N, {d}], got {h.dtype} {list(h.shape)}"]
    if y.ndim != 1 or y.shape[0] != h.shape[0] or not np.issubdtype(y.dtype, np.integer):
        return [f"{LABELS}: expected integers [{h.shape[0]}], got {y.dtype} {list(y.shape)}"]
    if y.size and (int(y.min()) < 0 or int(y.max()) >= D):
        return [f"{LABELS}: labels must be class ids 0..{D - 1}"]
    if deep and not np.isfinite(h).all():
        return [f"{EMBEDDINGS}: holds NaN or infinite values"]
    return []
