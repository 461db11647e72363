"""The gallery's in-memory search structure, whatever store holds the items.

A class search asks for every item x with z_j(x) = W_j · h(x) + b_j >= threshold: a range search
by inner product of the query [W_j, b_j] with the item vectors [h, 1], kept in a faiss
``IndexIDMap(IndexFlatIP)`` (exact) whose int64 ids are the store's row numbers.

Exactness: faiss scores in float32 with rounding error. The radius handed to faiss is lowered
by a bound on that error (|err| <= (n+2)·2^-23·|q|·max|x|), then every candidate is re-scored
as a float64 dot product of the stored float32 vectors, rounded to float32 (the value
reported), and kept iff that logit >= threshold. So items exactly at the threshold are kept
and the reported logits are consistent with the decision.

Not thread-safe: the gallery holds its lock around every call.
"""
from __future__ import annotations

import numpy as np

_BATCH = 65_536


class VectorIndex:
    kind = "IndexIDMap(IndexFlatIP) exact, cpu"

    def __init__(self, embed_dim: int):
        self.embed_dim = int(embed_dim)
        self._index = None  # faiss's IndexIDMap(IndexFlatIP), made at the first add: an empty gallery never imports faiss
        self._max_norm = 0.0  # an upper bound of |[h, 1]| over indexed items, for the error margin

    @property
    def ntotal(self) -> int:
        return 0 if self._index is None else int(self._index.ntotal)

    def vector(self, embedding: np.ndarray) -> np.ndarray:
        """[h, 1] float32 [d + 1] of an embedding [d] (ValueError on a wrong shape)."""
        if embedding.shape != (self.embed_dim,):
            raise ValueError(f"embedding must have shape [{self.embed_dim}], got {list(embedding.shape)}")
        v = np.empty(self.embed_dim + 1, dtype=np.float32)
        v[:-1] = embedding
        v[-1] = 1.0
        return v

    def add(self, nums: np.ndarray, vecs: np.ndarray) -> None:
        """Add vectors [n, d + 1] under row numbers nums [n] (not already present)."""
        if len(nums) == 0:
            return
        if self._index is None:
            import faiss

            self._index = faiss.IndexIDMap(faiss.IndexFlatIP(self.embed_dim + 1))
        self._index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), np.asarray(nums, dtype=np.int64))
        norms = np.sqrt(np.einsum("ij,ij->i", vecs.astype(np.float64), vecs.astype(np.float64)))
        self._max_norm = max(self._max_norm, float(norms.max(initial=0.0)))

    def remove(self, nums) -> None:
        """Remove row numbers (absent ones are ignored). O(items in the index)."""
        nums = np.asarray(list(nums), dtype=np.int64)
        if len(nums) and self._index is not None:
            import faiss

            self._index.remove_ids(faiss.IDSelectorBatch(nums))

    def _vectors_at(self, positions: np.ndarray) -> np.ndarray:
        """Stored vectors [len(positions), d+1] at storage positions of the flat index (a view, no copy of all)."""
        import faiss

        flat = faiss.downcast_index(self._index.index)
        xb = faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)
        return xb[positions]

    def search(self, w: np.ndarray, b: float, threshold: float, limit: int | None,
               rivals: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(row numbers, float32 logits) of every item with w·h + b >= threshold, best first (ties by
        row number), at most `limit`. `rivals` (rows [r, d + 1] = [W_r, b_r], thresholds [r]): the class's
        look-alikes (serving/core/lookalikes.py); an item one of them passes by a larger margin is left out.
        ValueError on a NaN threshold, a negative limit, a non-finite row."""
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
        empty = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        if limit == 0 or self.ntotal == 0:
            return empty
        q64 = q.astype(np.float64)
        n = self.embed_dim + 1
        # faiss keeps scores > radius; its float32 score is within `err` of the exact one
        err = (n + 2) * 2.0**-23 * float(np.sqrt(q64 @ q64)) * self._max_norm
        radius = np.float32(max(threshold - err - 2.0**-22 * abs(threshold), -np.finfo(np.float32).max))
        radius = float(np.nextafter(radius, np.float32(-np.inf)))
        lims, _, positions = self._index.index.range_search(q[None, :], radius)
        positions = positions[lims[0]:lims[1]].astype(np.int64)
        exact = np.empty(len(positions), dtype=np.float64)  # [C] candidates, re-scored in chunks
        for start in range(0, len(positions), _BATCH):
            chunk = positions[start:start + _BATCH]
            exact[start:start + len(chunk)] = self._vectors_at(chunk).astype(np.float64) @ q64
        logits = exact.astype(np.float32)  # the value reported and decided on
        keep = logits.astype(np.float64) >= threshold
        positions, logits, exact = positions[keep], logits[keep], exact[keep]
        if rivals is not None and len(positions):  # margins in float64, as detect's
            keep = self._not_outscored(positions, np.maximum(exact - threshold, 0.0), *rivals)
            positions, logits = positions[keep], logits[keep]
        import faiss

        nums = faiss.vector_to_array(self._index.id_map)[positions]
        order = np.lexsort((nums, -logits))
        if limit is not None:
            order = order[:limit]
        return nums[order], logits[order]

    def _not_outscored(self, positions: np.ndarray, margin: np.ndarray, rows: np.ndarray,
                       thresholds: np.ndarray) -> np.ndarray:
        """bool [C]: no look-alike's margin (float64, rows [r, d + 1]) is above the item's own `margin` [C]
        (float64, at least 0: a look-alike that does not match takes nothing)."""
        keep = np.empty(len(positions), dtype=bool)
        q = np.asarray(rows, dtype=np.float64).T  # [d + 1, r]
        for start in range(0, len(positions), _BATCH):
            chunk = slice(start, start + _BATCH)
            theirs = self._vectors_at(positions[chunk]).astype(np.float64) @ q - thresholds  # [c, r]
            keep[chunk] = (theirs <= margin[chunk, None]).all(axis=1)
        return keep
