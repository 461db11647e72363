"""Passes over every class of the head in chunks: softmax statistics, exact top-k, all logits.

The queries that need all D logits (softmax probability, exact top-k, the full logits) read the
whole head once per batch: one GEMM per chunk of class rows over every input of the batch that
needs it, so concurrent requests share one read of W and memory stays at [batch, chunk] instead
of [batch, D]. Each request keeps only what it answers with (an accumulator): for softmax the
running max and sum of exponentials (the online softmax of Milakov & Gimelshein, 2018), for
top-k the k best so far, for the full logits its own [n, D] output.

With a second thread the class chunks are shared out as the threads ask for them: each thread
runs a one-thread GEMM on its chunk and updates its own copy of every accumulator while the
chunk's logits are still in its core's cache; the copies are merged at the end. No thread waits
for the other between chunks, so one slowed down by the event loop just takes fewer chunks.
"""
from __future__ import annotations

import itertools
from concurrent.futures import Executor
from pathlib import Path
from typing import Callable, Iterable, Optional, Protocol

import numpy as np

# z = h @ w.T + b for one chunk: h [M, d], w [C, d] (a view of the head), b [C], written into out [M, C]
Gemm = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]

CHUNK_VALUES = 512 * 1024  # logits per chunk (2 MiB of float32: a core's L2), whatever the batch
MIN_CHUNK_ROWS = 4096  # below this the GEMM per chunk gets too thin to run at full speed
MAX_CHUNK_ROWS = 16384  # a few inputs: still enough chunks for both threads
FIRST_COLUMNS = 1024  # top-k: partitioned to seed the running k-th best; the rest is compared to it
THRESHOLD_MAX_K = 64  # above this k too many logits beat a k-th best seeded from the first columns


class Accumulator(Protocol):
    def update(self, z: np.ndarray, start: int) -> None:
        """Take logits z [n, C] of classes start..start+C-1 (z may be overwritten)."""

    def fork(self) -> "Accumulator":
        """An empty accumulator for the same rows, for another thread's chunks."""

    def merge(self, other: "Accumulator") -> None:
        """Add what a fork took from its chunks (each chunk went to exactly one of the two)."""


def chunk_rows(batch: int, num_classes: int, values: int = CHUNK_VALUES) -> int:
    """Classes per chunk so that [batch, chunk] holds about `values` logits (within the row bounds),
    the chunks of a pass about equal (no thin last chunk)."""
    rows = int(min(num_classes, MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, values // max(batch, 1))))
    chunks = -(-num_classes // rows)
    return -(-num_classes // chunks)


def numpy_gemm(h: np.ndarray, w: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The chunk's logits by numpy (OpenBLAS), written into `out`: W.T is a view of the mmap."""
    np.matmul(h, w.T, out=out)
    out += b
    return out


def _gemm_model(embed_dim: int, rows: int | str, initializers: list | None = None) -> bytes:
    """z = h @ w.T + b as an ONNX graph (Gemm); w and b are inputs unless given as initializers."""
    from onnx import TensorProto, helper

    tensors = [helper.make_tensor_value_info("w", TensorProto.FLOAT, [rows, embed_dim]),
               helper.make_tensor_value_info("b", TensorProto.FLOAT, [rows])]
    node = helper.make_node("Gemm", ["h", "w", "b"], ["z"], transB=1)
    graph = helper.make_graph([node], "head_chunk",
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["M", embed_dim])]
                              + ([] if initializers else tensors),
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["M", rows])],
                              initializer=initializers or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime the project supports
    return model.SerializeToString()


def _run_into(session, feeds: dict[str, np.ndarray], out: np.ndarray) -> np.ndarray:
    """Run a one-output session writing into `out` (C-contiguous): nothing allocated per chunk."""
    io = session.io_binding()
    for name, value in feeds.items():
        io.bind_cpu_input(name, value)
    io.bind_output("z", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
    session.run_with_iobinding(io)
    return out


class OrtGemm:
    """The chunk's logits by onnxruntime's Gemm (MLAS), the head rows passed as an input (no copy):
    at small batches about twice numpy's OpenBLAS on this machine (docs/results/scale.md)."""

    def __init__(self, embed_dim: int, threads: int = 1):
        from serving.bundle.session import ort_session

        # no arena: it would keep a [batch, chunk] output block for good
        self.session = ort_session(_gemm_model(embed_dim, "C"), threads=threads, spin=False, arena=False)

    def __call__(self, h: np.ndarray, w: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        # the mmap rows are already contiguous: no copy
        return _run_into(self.session, {"h": h, "w": np.ascontiguousarray(w), "b": np.ascontiguousarray(b)}, out)


class PackedHead:
    """The head in fixed chunks of `rows` classes, one one-thread onnxruntime session each, whose
    rows are the session's initializer: onnxruntime packs them once for its GEMM kernel (a second
    copy of the head, in RAM, as full.onnx holds), about 1.2x the speed of OrtGemm's rows-as-input.

    `weight_file`: the bundle's head_weight.npy; each chunk's rows are read from it as external data
    (nothing of the head is copied through Python)."""

    def __init__(self, weight_file: Path, weight: np.ndarray, bias: np.ndarray, rows: int):
        from onnx import numpy_helper

        from serving.bundle.graphs import external_tensor
        from serving.bundle.session import ort_session

        weight_file = Path(weight_file)
        self.rows, (num_classes, dim) = rows, weight.shape
        offset = int(getattr(weight, "offset", 0))  # past the .npy header (np.load's memmap knows it)
        self.sessions = []
        for start in range(0, num_classes, rows):
            stop = min(start + rows, num_classes)
            w = external_tensor("w", (stop - start, dim), weight_file.name, offset + start * dim * 4)
            b = numpy_helper.from_array(np.ascontiguousarray(bias[start:stop], dtype=np.float32), "b")
            self.sessions.append(ort_session(_gemm_model(dim, stop - start, [w, b]), threads=1, spin=False,
                                             arena=False, external_dir=weight_file.parent))

    def chunk(self, h: np.ndarray, start: int, out: np.ndarray) -> np.ndarray:
        """The logits of the chunk that starts at class `start` (a multiple of rows), into out."""
        return _run_into(self.sessions[start // self.rows], {"h": h}, out)


def scan(weight: np.ndarray, bias: np.ndarray, h: np.ndarray, parts: Iterable[tuple[slice, Accumulator]],
         rows: int | None = None, gemm: Optional[Gemm] = None, buf: Optional[list[np.ndarray]] = None,
         pool: Optional[Executor] = None, threads: int = 2, packed: Optional[PackedHead] = None) -> None:
    """Logits h @ W.T + b chunk by chunk; each accumulator gets its rows of every chunk.

    weight [D, d] (memory-mapped: only views are taken), bias [D], h [M, d] float32;
    parts: (rows of h, accumulator), rows disjoint; gemm: numpy_gemm unless given (with a pool, a
    GEMM that keeps to the calling thread); packed: the chunks' prepacked sessions instead of gemm
    (its own chunk rows); pool: an executor with threads - 1 workers, the pass's other threads
    (see the module docstring; without one the pass runs in the calling thread alone); buf: one
    flat float32 scratch array per thread, kept by the caller between calls (used when it holds
    M x rows values).
    """
    gemm = gemm or numpy_gemm
    h = np.ascontiguousarray(h, dtype=np.float32)
    num_classes = weight.shape[0]
    rows = packed.rows if packed is not None else rows or chunk_rows(h.shape[0], num_classes)
    need = h.shape[0] * min(rows, num_classes)
    threads = threads if pool is not None else 1
    scratch = [b if b is not None and b.size >= need else np.empty(need, dtype=np.float32)
               for b in (buf or [None] * threads)[:threads]]

    if packed is not None:
        def chunk(start: int, stop: int, out: np.ndarray) -> np.ndarray:
            return packed.chunk(h, start, out)
    else:
        def chunk(start: int, stop: int, out: np.ndarray) -> np.ndarray:
            return gemm(h, weight[start:stop], bias[start:stop], out)
    _pass(num_classes, h.shape[0], parts, chunk, rows, scratch, pool)


def feed(z: np.ndarray, parts: Iterable[tuple[slice, Accumulator]], pool: Optional[Executor] = None,
         threads: int = 2, rows: int | None = None) -> None:
    """Logits computed elsewhere (full.onnx) [M, D], read in column chunks (pool, threads: as in scan)."""
    _pass(z.shape[1], z.shape[0], parts, lambda start, stop, out: z[:, start:stop],
          rows or chunk_rows(z.shape[0], z.shape[1]), [None] * (threads if pool is not None else 1), pool)


def _pass(num_classes: int, m: int, parts: Iterable[tuple[slice, Accumulator]],
          chunk: Callable[[int, int, Optional[np.ndarray]], np.ndarray], rows: int,
          scratch: list[Optional[np.ndarray]], pool: Optional[Executor]) -> None:
    """Every chunk of `rows` classes once, to one of len(scratch) threads (this one and the pool's),
    its logits to that thread's accumulators; chunk(start, stop, out [m, stop - start] or None) ->
    the chunk's logits, written into `out` (a view of the thread's scratch array) when given."""
    parts, done = _merged(list(parts))
    count = -(-num_classes // rows)
    claim = itertools.count().__next__  # one call is atomic under the GIL: a chunk goes to one thread
    failed: list[BaseException] = []

    def work(own: list[tuple[slice, Accumulator]], buf: Optional[np.ndarray]) -> None:
        try:
            while not failed and (c := claim()) < count:
                start, stop = c * rows, min(c * rows + rows, num_classes)
                out = None if buf is None else buf[:m * (stop - start)].reshape(m, stop - start)
                z = chunk(start, stop, out)  # [m, C]
                for sl, acc in own:
                    acc.update(z[sl], start)
        except BaseException as exc:  # the other threads stop at their next chunk
            failed.append(exc)
            raise

    helpers = min(len(scratch), count) - 1
    forks = [[(sl, acc.fork()) for sl, acc in parts] for _ in range(helpers)]
    others = [pool.submit(work, own, buf) for own, buf in zip(forks, scratch[1:])]
    try:
        work(parts, scratch[0])
    finally:  # every thread is out of the buffers and accumulators before anything goes on
        errors = [e for e in (f.exception() for f in others) if e is not None]
    if errors:
        raise errors[0]
    for own in forks:
        for (_, acc), (_, mine) in zip(parts, own):
            acc.merge(mine)
    done()


def _merged(parts: list) -> tuple[list, Callable[[], None]]:
    """parts with every run of adjacent SoftmaxStats (one request each, typically) in one
    accumulator over the run's rows: one set of numpy calls per chunk for the run instead of one per
    request. done() hands each request's accumulator its rows of the run's state after the pass."""
    runs: list[tuple[list, SoftmaxStats, int]] = []
    out, i = [], 0
    while i < len(parts):
        k = i
        while (k + 1 < len(parts) and _softmax_rows(parts[i]) and _softmax_rows(parts[k + 1])
               and parts[k + 1][0].start == parts[k][0].stop):
            k += 1
        if k == i:
            out.append(parts[i])
        else:
            run = parts[i:k + 1]
            rows = slice(run[0][0].start, run[-1][0].stop)
            j = np.concatenate([np.broadcast_to(acc.j, (sl.stop - sl.start,)) for sl, acc in run])
            acc = SoftmaxStats(rows.stop - rows.start, j)
            out.append((rows, acc))
            runs.append((run, acc, rows.start))
        i = k + 1

    def done() -> None:
        for run, acc, base in runs:
            for sl, own in run:
                own.take(acc, slice(sl.start - base, sl.stop - base))

    return out, done


def _softmax_rows(part: tuple[slice, Accumulator]) -> bool:
    sl, acc = part
    return type(acc) is SoftmaxStats and isinstance(sl.start, int) and isinstance(sl.stop, int) and sl.step in (None, 1)


class SoftmaxStats:
    """Per row: softmax probability of class j, its logit and whether it is the top-1, streamed."""

    def __init__(self, n: int, j: int | np.ndarray):
        self.j = j if np.ndim(j) == 0 else np.asarray(j, dtype=np.int64)  # the class, or one per row [n]
        self.m = np.full(n, -np.inf)  # running max, float64 [n]
        self.s = np.zeros(n)  # running sum of exp(z - m), float64 [n]
        self.zj = np.zeros(n)
        self.top = np.zeros(n, dtype=np.int64)
        self.finite = np.ones(n, dtype=bool)

    def update(self, z: np.ndarray, start: int) -> None:
        n, c = z.shape
        if np.ndim(self.j) == 0:
            if start <= self.j < start + c:
                self.zj = z[:, self.j - start].astype(np.float64)
        else:
            rows = np.flatnonzero((self.j >= start) & (self.j < start + c))
            self.zj[rows] = z[rows, self.j[rows] - start]
        am = z.argmax(axis=1)  # [n]; NaN counts as the max, so it shows in cmax
        cmax = z[np.arange(n), am].astype(np.float64)
        self.finite &= np.isfinite(cmax) & np.isfinite(z.min(axis=1))  # NaN, +inf show in the max; -inf in the min
        better = cmax > self.m
        self.top[better] = am[better] + start
        m_new = np.maximum(self.m, cmax)
        with np.errstate(invalid="ignore", over="ignore"):  # rows already marked not finite
            z -= m_new.astype(np.float32)[:, None]
            np.exp(z, out=z)  # in place: the chunk buffer is this job's rows only
            self.s = self.s * np.exp(self.m - m_new) + z.sum(axis=1)  # float32 pairwise sum per chunk
        self.m = m_new

    def fork(self) -> "SoftmaxStats":
        return SoftmaxStats(len(self.m), self.j)

    def merge(self, other: "SoftmaxStats") -> None:
        """The state over both accumulators' chunks: top-1 is the smaller class id on a tie, as in
        one pass (each fork saw its chunks in class order)."""
        m = np.maximum(self.m, other.m)
        with np.errstate(invalid="ignore"):  # -inf - -inf: rows already marked not finite
            self.s = self.s * np.exp(self.m - m) + other.s * np.exp(other.m - m)
        self.top = np.where(other.m > self.m, other.top,
                            np.where(other.m == self.m, np.minimum(self.top, other.top), self.top))
        self.zj = self.zj + other.zj  # the chunk holding j went to one of the two; the other's is 0
        self.finite = self.finite & other.finite
        self.m = m

    def take(self, other: "SoftmaxStats", rows: slice) -> None:
        """This accumulator's state from rows of one that accumulated for several requests."""
        for name in ("m", "s", "zj", "top", "finite"):
            setattr(self, name, getattr(other, name)[rows].copy())

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(probability [n], logit of j [n], is_top1 [n]), all float64 / bool."""
        lse = self.m + np.log(self.s)
        return np.exp(self.zj - lse), self.zj, self.top == self.j


class TopK:
    """Per row: the k largest logits and their class ids, streamed."""

    def __init__(self, n: int, k: int):
        self.k = k
        self.scores = np.full((n, 0), -np.inf, dtype=np.float32)
        self.ids = np.zeros((n, 0), dtype=np.int64)
        self.finite = np.ones(n, dtype=bool)

    def update(self, z: np.ndarray, start: int) -> None:
        self.finite &= np.isfinite(z.max(axis=1)) & np.isfinite(z.min(axis=1))  # NaN, +inf in the max; -inf in the min
        if self.k > THRESHOLD_MAX_K:  # a large k: partition every chunk
            self._partition(z, start)
        elif self.scores.shape[1] < self.k:  # not k candidates yet: the k best of the chunk's first columns
            head = z[:, :max(self.k, FIRST_COLUMNS)]
            self._partition(head, start)
            if head.shape[1] < z.shape[1]:
                self.update(z[:, head.shape[1]:], start + head.shape[1])
        else:
            self._above_kth(z, start)

    def fork(self) -> "TopK":
        return TopK(len(self.finite), self.k)

    def merge(self, other: "TopK") -> None:
        self.finite = self.finite & other.finite
        if other.scores.shape[1]:
            self._merge(other.scores, other.ids)

    def _partition(self, z: np.ndarray, start: int) -> None:
        """Merge the k best of z [n, C] (argpartition: O(C) per row)."""
        kk = min(self.k, z.shape[1])
        part = np.argpartition(-z, kk - 1, axis=1)[:, :kk]  # [n, kk] unordered
        self._merge(np.take_along_axis(z, part, axis=1), part.astype(np.int64) + start)

    def _above_kth(self, z: np.ndarray, start: int) -> None:
        """Merge the logits of z [n, C] above each row's current k-th best: few once k candidates
        are known, so one comparison pass replaces a partition of the whole chunk."""
        flat = np.flatnonzero(z > self.scores.min(axis=1)[:, None])  # row-major: rows ascending
        if not flat.size:
            return
        r, c = np.divmod(flat, z.shape[1])
        counts = np.bincount(r, minlength=z.shape[0])
        pos = np.arange(r.size) - np.repeat(np.cumsum(counts) - counts, counts)  # place within its row
        scores = np.full((z.shape[0], counts.max()), -np.inf, dtype=np.float32)
        ids = np.full(scores.shape, -1, dtype=np.int64)
        scores[r, pos], ids[r, pos] = z[r, c], c + start
        self._merge(scores, ids)

    def _merge(self, scores: np.ndarray, ids: np.ndarray) -> None:
        scores = np.concatenate([self.scores, scores], axis=1)
        ids = np.concatenate([self.ids, ids], axis=1)
        keep = np.argpartition(-scores, min(self.k, scores.shape[1]) - 1, axis=1)[:, :self.k]
        self.scores = np.take_along_axis(scores, keep, axis=1)
        self.ids = np.take_along_axis(ids, keep, axis=1)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(logits [n, k] float32, ids [n, k] int64), best first; equal logits among the k by the
        smaller id (which of several classes tied at the k-th place is kept is not defined)."""
        if not len(self.scores):
            return self.scores, self.ids
        order = np.lexsort((self.ids, -self.scores), axis=1)
        return np.take_along_axis(self.scores, order, 1), np.take_along_axis(self.ids, order, 1)


class AllLogits:
    """Per row: every logit, written chunk by chunk into the answer [n, D]."""

    def __init__(self, n: int, num_classes: int):
        self.out = np.empty((n, num_classes), dtype=np.float32)

    def update(self, z: np.ndarray, start: int) -> None:
        self.out[:, start:start + z.shape[1]] = z

    def fork(self) -> "AllLogits":
        return self  # each thread writes its own chunks' columns

    def merge(self, other: "AllLogits") -> None:
        pass

    @property
    def finite(self) -> np.ndarray:
        return np.isfinite(self.out).all(axis=1)

    def result(self) -> np.ndarray:
        return self.out
