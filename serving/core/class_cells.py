"""IVF cells that hold class ids only: candidates are scored exactly from the memory-mapped head.

The class index (serving/core/class_index.py) cuts the classes into cells and probes a few cells per query.
With ``codes="none"`` (its default) a cell is just the sorted list of its class ids: a search
gathers the probed cells' rows from the head, which the server maps anyway, and scores them
exactly (W_j · h + b_j). The index then adds 4 bytes per class and its probe vectors to the
server's memory, not a second (compressed) copy of the rows; the price is a gather of
nprobe x (D / nlist) scattered rows per query instead of a scan of their codes.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

FORMAT = 1
BLOCK = 8  # queries that share one gather of their probed cells' rows (a server batch is about this big)
# multiply-adds per GEMM call: below OpenBLAS's bound for splitting a GEMM over its threads, which
# then spin between calls on the core the event loop and the second block need
PIECE_MACS = 1 << 17


class HeadLists:
    """Cells of class ids; probe [nlist, d + 1] float32 are the cells' probe vectors ([mean W, s·max b])."""

    def __init__(self, probe: np.ndarray, offsets: np.ndarray, ids: np.ndarray, bias_scale: float):
        self.probe = np.ascontiguousarray(probe, dtype=np.float32)  # [nlist, d + 1]
        self.offsets = np.asarray(offsets, dtype=np.int64)  # [nlist + 1]: cell c is ids[offsets[c]:offsets[c + 1]]
        self.ids = np.asarray(ids, dtype=np.int32)  # [D], ascending within a cell (memory order of the head)
        self.bias_scale = float(bias_scale)
        self.nprobe = 1
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_assignment(cls, assign: np.ndarray, probe: np.ndarray, bias_scale: float) -> "HeadLists":
        """assign [D]: the cell of each class."""
        nlist = probe.shape[0]
        order = np.argsort(assign, kind="stable").astype(np.int32)  # ids grouped by cell, ascending within it
        offsets = np.concatenate([[0], np.cumsum(np.bincount(assign, minlength=nlist))])
        return cls(probe, offsets, order, bias_scale)

    @property
    def nlist(self) -> int:
        return self.probe.shape[0]

    @property
    def nbytes(self) -> int:
        return self.probe.nbytes + self.offsets.nbytes + self.ids.nbytes

    def save(self, path: str | Path) -> None:
        with open(path, "wb") as f:  # a file object: np.savez would append .npz to a bare name
            np.savez(f, format=np.int64(FORMAT), probe=self.probe, offsets=self.offsets, ids=self.ids,
                     bias_scale=np.float64(self.bias_scale))

    @classmethod
    def load(cls, path: str | Path, num_classes: int, embed_dim: int) -> "HeadLists":
        with np.load(path, allow_pickle=False) as z:
            if int(z["format"]) != FORMAT:
                raise ValueError(f"head lists format {int(z['format'])}, expected {FORMAT}")
            lists = cls(z["probe"], z["offsets"], z["ids"], float(z["bias_scale"]))
        ok = (lists.probe.shape[1] == embed_dim + 1 and len(lists.ids) == num_classes
              and len(lists.offsets) == lists.nlist + 1 and lists.offsets[0] == 0 and lists.offsets[-1] == num_classes
              and np.all(np.diff(lists.offsets) >= 0) and lists.ids.min(initial=0) >= 0
              and lists.ids.max(initial=0) < num_classes)
        if not ok:
            raise ValueError("head lists do not match the head")
        return lists

    def cells(self, h: np.ndarray) -> np.ndarray:
        """The nprobe cells of best optimistic logit [h, 1/s] · probe per query: [N, nprobe]."""
        q = np.empty((h.shape[0], h.shape[1] + 1), dtype=np.float32)  # [N, d + 1]
        q[:, :-1] = h
        q[:, -1] = 1.0 / self.bias_scale
        scores = one_thread_matmul(self.probe, q.T).T  # [N, nlist]
        n = min(self.nprobe, self.nlist)
        if n == self.nlist:
            return np.broadcast_to(np.arange(n), (h.shape[0], n))
        return np.argpartition(-scores, n - 1, axis=1)[:, :n]

    def search(self, weight: np.ndarray, bias: np.ndarray, h: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
        """The r best classes of the probed cells per query, scored exactly in float32.

        weight [D, d] (memory-mapped), bias [D], h [N, d] float32 -> (logits [N, r] float32,
        ids [N, r] int64), unordered; -inf / -1 where the probed cells hold fewer than r classes.
        Queries go in blocks of BLOCK that share one gather of their cells' rows; on more than one
        core, every other block runs on a second thread (numpy lets go of the GIL in the gather
        and the GEMM, the scattered reads of the rows being most of the time).
        """
        weight, bias = np.asarray(weight), np.asarray(bias)  # plain views of the mapping: no memmap wrappers per gather
        logits = np.full((h.shape[0], r), -np.inf, dtype=np.float32)
        ids = np.full((h.shape[0], r), -1, dtype=np.int64)
        cells = self.cells(h)
        blocks = [slice(i, min(i + BLOCK, h.shape[0])) for i in range(0, h.shape[0], BLOCK)]

        def run(part: list[slice]) -> None:
            for b in part:
                self._search_block(weight, bias, h[b], cells[b], logits[b], ids[b])

        pool = self._helper() if len(blocks) > 1 else None
        if pool is None:
            run(blocks)
        else:
            other = pool.submit(run, blocks[1::2])
            try:
                run(blocks[0::2])
            finally:
                other.result()
        return logits, ids

    def _search_block(self, weight: np.ndarray, bias: np.ndarray, h: np.ndarray, cells: np.ndarray,
                      logits: np.ndarray, ids: np.ndarray) -> None:
        """h [n, d], cells [n, nprobe]: writes each query's best into logits / ids [n, r]."""
        uniq = np.unique(cells)  # [U] the block's cells, each gathered once
        bounds = np.concatenate([[0], np.cumsum(self.offsets[uniq + 1] - self.offsets[uniq])])  # [U + 1] in cand
        cand = np.concatenate([self.ids[self.offsets[c]:self.offsets[c + 1]] for c in uniq])  # [S]
        z = one_thread_matmul(weight, h.T, rows=cand)  # [S, n]; never a [S, d] copy of the rows
        z += bias[cand][:, None]
        r = logits.shape[1]
        for i, where in enumerate(np.searchsorted(uniq, cells)):  # where: positions in uniq of query i's cells
            rows = np.concatenate([np.arange(bounds[u], bounds[u + 1]) for u in where])  # [C]
            zi, ci = z[rows, i], cand[rows]
            n = min(r, len(rows))
            if n < len(rows):
                best = np.argpartition(-zi, n - 1)[:n]
                zi, ci = zi[best], ci[best]
            logits[i, :n], ids[i, :n] = zi, ci

    def _helper(self) -> ThreadPoolExecutor | None:
        if (os.cpu_count() or 1) < 2:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="slc-index")
        return self._pool


def one_thread_matmul(a: np.ndarray, b: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """a[rows] @ b ([M, K] x [K, N] -> [M, N] float32) in pieces of at most PIECE_MACS multiply-adds,
    each too small for BLAS to split over its threads (see PIECE_MACS); rows: a gather of a's rows
    (None: all of them), done piece by piece."""
    m = a.shape[0] if rows is None else len(rows)
    out = np.empty((m, b.shape[1]), dtype=np.float32)
    step = max(16, PIECE_MACS // max(1, b.shape[0] * b.shape[1]))
    for start in range(0, m, step):
        stop = min(start + step, m)
        piece = a[start:stop] if rows is None else a[rows[start:stop]]
        np.matmul(piece, b, out=out[start:stop])
    return out
