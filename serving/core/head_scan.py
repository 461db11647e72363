"""Passes over every class of the head in chunks: softmax statistics, exact top-k, all logits.

The queries that need all D logits (softmax probability, exact top-k, the full logits) read the
whole head once per batch: one GEMM per chunk of class rows over every input of the batch that
needs it, so concurrent requests share one read of W and memory stays at [batch, chunk] instead
of [batch, D]. Each request keeps only what it answers with (an accumulator): for softmax the
running max and sum of exponentials (the online softmax of Milakov & Gimelshein, 2018), for
top-k the k best so far, for the full logits its own [n, D] output.
"""
from __future__ import annotations

import threading
from concurrent.futures import Executor
from typing import Callable, Iterable, Optional, Protocol

import numpy as np

# z = h @ w.T + b for one chunk: h [M, d], w [C, d] (a view of the head), b [C], written into out [M, C]
Gemm = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
# the same for classes start..stop-1 of a head the callable holds: (h, start, stop, out) -> out [M, C]
ChunkGemm = Callable[[np.ndarray, int, int, np.ndarray], np.ndarray]

CHUNK_VALUES = 2 * 1024 * 1024  # logits per chunk buffer (8 MiB of float32), whatever the batch
MIN_CHUNK_ROWS = 4096  # below this the GEMM per chunk gets too thin to run at full speed
FIRST_COLUMNS = 1024  # top-k: partitioned to seed the running k-th best; the rest is compared to it
THRESHOLD_MAX_K = 64  # above this k too many logits beat a k-th best seeded from the first columns
PAIR_MIN_CHUNKS = 8  # scan_two: chunks enough for two threads to share out, whatever the batch


class Accumulator(Protocol):
    def update(self, z: np.ndarray, start: int) -> None:
        """Take logits z [n, C] of classes start..start+C-1 (z may be overwritten)."""


def chunk_rows(batch: int, num_classes: int, values: int = CHUNK_VALUES) -> int:
    """Classes per chunk so that [batch, chunk] holds at most about `values` logits, the chunks of
    a pass about equal (no thin last chunk)."""
    rows = int(min(num_classes, max(MIN_CHUNK_ROWS, values // max(batch, 1))))
    chunks = -(-num_classes // rows)
    return max(min(rows, MIN_CHUNK_ROWS), -(-num_classes // chunks))


def pair_rows(batch: int, num_classes: int) -> int:
    """Classes per chunk of a scan_two pass: half a scan chunk's logits (two buffers), and at least
    PAIR_MIN_CHUNKS chunks, so that both threads have work even for a lone input."""
    return max(1, min(chunk_rows(batch, num_classes, CHUNK_VALUES // 2), -(-num_classes // PAIR_MIN_CHUNKS)))


def over_rows(gemm: Gemm, weight: np.ndarray, bias: np.ndarray) -> ChunkGemm:
    """A Gemm on the rows of weight / bias (views, no copy) as a ChunkGemm."""
    return lambda h, start, stop, out: gemm(h, weight[start:stop], bias[start:stop], out)


def numpy_gemm(h: np.ndarray, w: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The chunk's logits by numpy (OpenBLAS), written into `out`: W.T is a view of the mmap."""
    np.matmul(h, w.T, out=out)
    out += b
    return out


class OrtGemm:
    """The chunk's logits by onnxruntime's Gemm (MLAS), the head rows passed as an input (no copy):
    at small batches about twice as fast as numpy's OpenBLAS on two cores."""

    def __init__(self, embed_dim: int, threads: int = 1):
        from onnx import TensorProto, helper

        from serving.bundle.session import ort_session

        node = helper.make_node("Gemm", ["h", "w", "b"], ["z"], transB=1)
        graph = helper.make_graph([node], "head_chunk", [
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["M", embed_dim]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, ["C", embed_dim]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["C"])],
            [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["M", "C"])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8  # readable by every onnxruntime the project supports
        # no arena: it would keep a [batch, chunk] output block for good (a chunk is up to 8 MiB)
        self.session = ort_session(model.SerializeToString(), threads=threads, spin=False, arena=False)

    def __call__(self, h: np.ndarray, w: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Writes into `out` (C-contiguous): onnxruntime allocates nothing per chunk, so no 8 MiB
        blocks pile up in the allocator."""
        io = self.session.io_binding()
        io.bind_cpu_input("h", h)
        io.bind_cpu_input("w", np.ascontiguousarray(w))  # the mmap rows: already contiguous, no copy
        io.bind_cpu_input("b", np.ascontiguousarray(b))
        io.bind_output("z", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        self.session.run_with_iobinding(io)
        return out


# log-sum-exp per row of a chunk: z [n, C] float32 (may be overwritten), am [n] its argmax -> float64 [n]
LogSumExp = Callable[[np.ndarray, np.ndarray], np.ndarray]


def numpy_logsumexp(z: np.ndarray, am: np.ndarray) -> np.ndarray:
    """max + log(sum(exp(z - max))) by numpy: four passes over the chunk, z overwritten."""
    cmax = z[np.arange(len(z)), am]  # [n]
    z -= cmax[:, None]
    np.exp(z, out=z)
    return cmax + np.log(z.sum(axis=1).astype(np.float64))  # float32 pairwise sums per row


class OrtLogSumExp:
    """Per-row log-sum-exp by onnxruntime's LogSoftmax, written over z in place: MLAS takes the
    exponentials and their sum in one vectorised pass, half numpy's time on a chunk (the softmax
    statistics were an eighth of a softmax batch at D = 10^6). LogSoftmax at the argmax is
    -log(sum(exp(z - max))), so the log-sum-exp is the max minus that entry. A chunk of fewer
    than `min_values` logits goes to numpy instead: below about 2^15 values the session call costs
    more than numpy's passes (small heads, lone requests). One session serves several threads at
    once (the pass's two halves, the batcher's lanes)."""

    def __init__(self, threads: int = 1, min_values: int = 1 << 15):
        self.min_values = min_values
        from onnx import TensorProto, helper

        from serving.bundle.session import ort_session

        node = helper.make_node("LogSoftmax", ["z"], ["y"], axis=1)
        graph = helper.make_graph([node], "chunk_log_softmax",
                                  [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["M", "C"])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", "C"])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        self.session = ort_session(model.SerializeToString(), threads=threads, spin=False, arena=False)

    def __call__(self, z: np.ndarray, am: np.ndarray) -> np.ndarray:
        if z.size < self.min_values:
            return numpy_logsumexp(z, am)
        z = np.ascontiguousarray(z)  # rows of the chunk buffer: already contiguous, no copy
        rows = np.arange(len(z))
        cmax = z[rows, am].astype(np.float64)  # [n]
        io = self.session.io_binding()
        io.bind_cpu_input("z", z)
        io.bind_output("y", "cpu", 0, np.float32, list(z.shape), z.ctypes.data)  # in place: row by row
        self.session.run_with_iobinding(io)
        return cmax - z[rows, am]


def scan(weight: np.ndarray, bias: np.ndarray, h: np.ndarray, parts: Iterable[tuple[slice, Accumulator]],
         rows: int | None = None, gemm: Optional[Gemm] = None, buf: Optional[np.ndarray] = None,
         pool: Optional[Executor] = None) -> None:
    """Logits h @ W.T + b chunk by chunk; each accumulator gets its rows of every chunk.

    weight [D, d] (memory-mapped: only views are taken), bias [D], h [M, d] float32;
    parts: (rows of h, accumulator), rows disjoint; gemm: numpy_gemm unless given; buf: a flat
    float32 scratch array the caller keeps between calls (used when it holds M x rows values);
    pool: a one-thread executor that updates half of the accumulators while this thread does the
    other half (numpy lets go of the GIL on a chunk's rows: the softmax statistics, a third of the
    GEMM's time on one core, then use both cores as the GEMM does).
    """
    parts = list(parts)
    halves = _halves(parts) if pool is not None else None
    parts, halves, done = _merged(parts, halves)
    gemm = gemm or numpy_gemm
    h = np.ascontiguousarray(h, dtype=np.float32)
    num_classes = weight.shape[0]
    rows = rows or chunk_rows(h.shape[0], num_classes)
    if buf is None or buf.size < h.shape[0] * rows:
        buf = np.empty(h.shape[0] * rows, dtype=np.float32)  # reused by every chunk
    for start in range(0, num_classes, rows):
        stop = min(start + rows, num_classes)
        out = buf[:h.shape[0] * (stop - start)].reshape(h.shape[0], stop - start)  # [M, C], C-contiguous
        z = gemm(h, weight[start:stop], bias[start:stop], out)
        if halves is None:
            _update(parts, z, start)
        else:
            other = pool.submit(_update, halves[1], z, start)
            try:
                _update(halves[0], z, start)
            finally:  # the buffer is rewritten by the next chunk: never before the other half is done
                other.result()
    done()


def scan_two(num_classes: int, h: np.ndarray, parts: Iterable[tuple[slice, Accumulator]],
             gemms: tuple[ChunkGemm, ChunkGemm], bufs: tuple[np.ndarray, np.ndarray], pool: Executor,
             rows: int | None = None) -> None:
    """As `scan`, on two threads that each take the next chunk when done with their last one: this
    thread and the `pool` thread, each with its own one-thread GEMM and buffer. Two one-thread GEMMs
    side by side beat one GEMM split over two threads, and a thread the event loop preempts only
    slows itself down: the other takes the chunks it would have done (a GEMM split in two waits for
    its slower half). Chunks finish in any order; the softmax statistics are kept per thread and
    combined at the end, the other accumulators are updated under a lock.
    gemms: one per thread (over_rows(OrtGemm, ...)), or the same PackedHead twice (a session per
    chunk); bufs: flat float32 arrays of at least M x rows values each (rows: pair_rows unless given).
    Without a pool (one intra-op thread), this thread takes every chunk."""
    parts = list(parts)
    parts, _, done = _merged(parts, None)
    h = np.ascontiguousarray(h, dtype=np.float32)
    rows = rows or pair_rows(h.shape[0], num_classes)
    starts = iter(range(0, num_classes, rows))
    lock = threading.Lock()
    # softmax statistics: each thread keeps its own over the chunks it takes, folded together at the
    # end (no thread waits for the other's update); other accumulators are updated under the lock
    own = [[(sl, acc) for sl, acc in parts if type(acc) is SoftmaxStats]]
    own.append([(sl, acc.fresh()) for sl, acc in own[0]])
    locked = [(sl, acc) for sl, acc in parts if type(acc) is not SoftmaxStats]

    def work(gemm: ChunkGemm, buf: np.ndarray, mine: list) -> None:
        while True:
            with lock:
                start = next(starts, None)
            if start is None:
                return
            stop = min(start + rows, num_classes)
            out = buf[:h.shape[0] * (stop - start)].reshape(h.shape[0], stop - start)  # [M, C]
            z = gemm(h, start, stop, out)
            _update(mine, z, start)  # rows of its own: apart from the locked accumulators' rows
            if locked:
                with lock:
                    _update(locked, z, start)

    other = pool.submit(work, gemms[1], bufs[1], own[1]) if pool is not None else None
    try:
        work(gemms[0], bufs[0], own[0])
    finally:  # the buffers are the caller's to reuse: never before the other thread is done
        if other is not None:
            other.result()
    for (_, acc), (_, theirs) in zip(*own):
        acc.combine(theirs)
    done()


def _update(parts: list[tuple[slice, Accumulator]], z: np.ndarray, start: int) -> None:
    for sl, acc in parts:
        acc.update(z[sl], start)


def _halves(parts: list[tuple[slice, Accumulator]]) -> Optional[tuple[list, list]]:
    """The accumulators in two groups of about the same number of rows; None when there is one."""
    if len(parts) < 2:
        return None
    total = sum(sl.stop - sl.start for sl, _ in parts)
    seen, cut = 0, len(parts) - 1
    for i, (sl, _) in enumerate(parts[:-1]):
        seen += sl.stop - sl.start
        if 2 * seen >= total:
            cut = i + 1
            break
    return parts[:cut], parts[cut:]


def feed(z: np.ndarray, parts: Iterable[tuple[slice, Accumulator]], pool: Optional[Executor] = None) -> None:
    """Logits computed elsewhere (full.onnx) [M, D], as one chunk (`pool`: as in scan)."""
    parts = list(parts)
    halves = _halves(parts) if pool is not None else None
    parts, halves, done = _merged(parts, halves)
    if halves is None:
        _update(parts, z, 0)
    else:
        other = pool.submit(_update, halves[1], z, 0)
        try:
            _update(halves[0], z, 0)
        finally:
            other.result()
    done()


def _merged(parts: list, halves: Optional[tuple[list, list]]
            ) -> tuple[list, Optional[tuple[list, list]], Callable[[], None]]:
    """(parts, halves) with every run of adjacent SoftmaxStats (one request each, typically) in one
    accumulator over the run's rows: one set of numpy calls per chunk for the run instead of one per
    request. done() hands each request's accumulator its rows of the run's state after the pass."""
    runs: list[tuple[list, SoftmaxStats, int]] = []

    def merge(group: list) -> list:
        out, i = [], 0
        while i < len(group):
            k = i
            while (k + 1 < len(group) and _softmax_rows(group[i]) and _softmax_rows(group[k + 1])
                   and group[k + 1][0].start == group[k][0].stop
                   and group[k + 1][1].logsumexp is group[i][1].logsumexp):
                k += 1
            if k == i:
                out.append(group[i])
            else:
                run = group[i:k + 1]
                rows = slice(run[0][0].start, run[-1][0].stop)
                j = np.concatenate([np.broadcast_to(acc.j, (sl.stop - sl.start,)) for sl, acc in run])
                acc = SoftmaxStats(rows.stop - rows.start, j, run[0][1].logsumexp)
                out.append((rows, acc))
                runs.append((run, acc, rows.start))
            i = k + 1
        return out

    if halves is None:
        parts = merge(parts)
    else:
        halves = (merge(halves[0]), merge(halves[1]))
        parts = halves[0] + halves[1]

    def done() -> None:
        for run, acc, base in runs:
            for sl, own in run:
                own.take(acc, slice(sl.start - base, sl.stop - base))

    return parts, halves, done


def _softmax_rows(part: tuple[slice, Accumulator]) -> bool:
    sl, acc = part
    return type(acc) is SoftmaxStats and isinstance(sl.start, int) and isinstance(sl.stop, int) and sl.step in (None, 1)


class SoftmaxStats:
    """Per row: softmax probability of class j, its logit and whether it is the top-1, streamed."""

    def __init__(self, n: int, j: int | np.ndarray, logsumexp: LogSumExp = numpy_logsumexp):
        self.j = j if np.ndim(j) == 0 else np.asarray(j, dtype=np.int64)  # the class, or one per row [n]
        self.logsumexp = logsumexp
        self.m = np.full(n, -np.inf)  # running max, float64 [n]
        self.s = np.zeros(n)  # running sum of exp(z - m), float64 [n]
        self.zj = np.zeros(n)
        self.has_j = np.zeros(n, dtype=bool)  # rows whose class j was in a chunk this accumulator saw
        self.top = np.zeros(n, dtype=np.int64)
        self.finite = np.ones(n, dtype=bool)
        self.zmax: Optional[np.ndarray] = None  # the top logit when m is not the running max (a device pass sets
        # m to the whole row's log-sum-exp; the enrolled rows' chunk then compares its logits with zmax)

    def update(self, z: np.ndarray, start: int) -> None:
        n, c = z.shape
        if np.ndim(self.j) == 0:
            if start <= self.j < start + c:
                self.zj = z[:, self.j - start].astype(np.float64)
                self.has_j[:] = True
        else:
            rows = np.flatnonzero((self.j >= start) & (self.j < start + c))
            self.zj[rows] = z[rows, self.j[rows] - start]
            self.has_j[rows] = True
        am = z.argmax(axis=1)  # [n]; NaN counts as the max, so it shows in cmax
        cmax = z[np.arange(n), am].astype(np.float64)
        self.finite &= np.isfinite(cmax) & np.isfinite(z.min(axis=1))  # NaN, +inf show in the max; -inf in the min
        ref = self.m if self.zmax is None else self.zmax
        better = (cmax > ref) | ((cmax == ref) & (am + start < self.top))  # ties: the smaller id, in any chunk order
        self.top[better] = am[better] + start
        if self.zmax is not None:
            self.zmax = np.maximum(self.zmax, cmax)
        m_new = np.maximum(self.m, cmax)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # rows already marked not finite
            lse = self.logsumexp(z, am)  # [n] float64; z overwritten (the chunk buffer's rows of this job)
            self.s = self.s * np.exp(self.m - m_new) + np.exp(lse - m_new)
        self.m = m_new

    def fresh(self) -> "SoftmaxStats":
        """An empty accumulator for the same rows and classes (another thread's share of the chunks)."""
        return SoftmaxStats(len(self.m), self.j, self.logsumexp)

    def combine(self, other: "SoftmaxStats") -> None:
        """Fold in the statistics of the same rows over other chunks (the online softmax's merge)."""
        m_new = np.maximum(self.m, other.m)
        self.s = _rescaled(self.s, self.m, m_new) + _rescaled(other.s, other.m, m_new)
        better = (other.m > self.m) | ((other.m == self.m) & (other.top < self.top))  # ties: the smaller id
        self.top[better] = other.top[better]
        self.zj = np.where(other.has_j, other.zj, self.zj)
        self.has_j |= other.has_j
        self.finite &= other.finite
        self.m = m_new

    def take(self, other: "SoftmaxStats", rows: slice) -> None:
        """This accumulator's state from rows of one that accumulated for several requests."""
        for name in ("m", "s", "zj", "has_j", "top", "finite"):
            setattr(self, name, getattr(other, name)[rows].copy())

    def rescore(self, h: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> None:
        """After a pass on a quantized head: the logit of j exact (float64 on the float32 rows), so
        the probability is that exact logit over the pass's normaliser. h [n, d]."""
        j = np.broadcast_to(self.j, (len(h),))
        mine = j < len(weight)  # rows whose class is past the head (enrolled) keep the logit of their own chunk
        if not mine.all():
            zj = self.zj.copy()
            rows = np.flatnonzero(mine)
            zj[rows] = np.einsum("nd,nd->n", np.asarray(h[rows], dtype=np.float64),
                                 np.asarray(weight[j[rows]], dtype=np.float64)) + np.asarray(bias[j[rows]], dtype=np.float64)
            self.zj = zj
            return
        self.zj = np.einsum("nd,nd->n", np.asarray(h, dtype=np.float64), np.asarray(weight[j], dtype=np.float64)) \
            + np.asarray(bias[j], dtype=np.float64)

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(probability [n], logit of j [n], is_top1 [n]), all float64 / bool."""
        lse = self.m + np.log(self.s)
        return np.exp(self.zj - lse), self.zj, self.top == self.j


def _rescaled(s: np.ndarray, m_old: np.ndarray, m_new: np.ndarray) -> np.ndarray:
    """s, a sum of exp(z - m_old), as a sum of exp(z - m_new) (m_new >= m_old); nothing seen
    (m_old = -inf, s = 0) stays 0 whatever m_new."""
    with np.errstate(invalid="ignore", over="ignore"):
        return s * np.exp(np.where(np.isneginf(m_old), -np.inf, m_old - m_new))


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

    def rescore(self, h: np.ndarray, weight: np.ndarray, bias: np.ndarray, keep: int) -> None:
        """After a pass on a quantized head (k = keep + a few): the candidates' logits exact on the
        float32 rows, and the best `keep` of them kept. h [n, d]."""
        ids = np.maximum(self.ids, 0)  # [n, k]; -1 marks no candidate (scored -inf)
        rows = np.asarray(weight[ids.ravel()], dtype=np.float64).reshape(*ids.shape, -1)  # [n, k, d]
        z = np.einsum("nkd,nd->nk", rows, np.asarray(h, dtype=np.float64)) + np.asarray(bias[ids], dtype=np.float64)
        self.scores = np.where(self.ids >= 0, z, -np.inf).astype(np.float32)
        self.k = min(keep, self.k)
        if self.scores.shape[1] > self.k:
            self._merge(self.scores[:, :0], self.ids[:, :0])

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(logits [n, k] float32, ids [n, k] int64), best first; equal logits among the k by the
        smaller id (which of several classes tied at the k-th place is kept is not defined)."""
        if not len(self.scores):
            return self.scores, self.ids
        order = np.lexsort((self.ids, -self.scores), axis=1)
        return np.take_along_axis(self.scores, order, 1), np.take_along_axis(self.ids, order, 1)


class Shifted:
    """An accumulator fed the logits of rows appended past the head (the enrolled classes,
    serving/core/enrolled.py): chunk columns 0.. of those rows are classes `offset`.. of the accumulator."""

    def __init__(self, acc: Accumulator, offset: int):
        self.acc, self.offset = acc, offset

    def update(self, z: np.ndarray, start: int) -> None:
        self.acc.update(z, start + self.offset)


class AllLogits:
    """Per row: every logit, written chunk by chunk into the answer [n, D]."""

    def __init__(self, n: int, num_classes: int):
        self.out = np.empty((n, num_classes), dtype=np.float32)

    def update(self, z: np.ndarray, start: int) -> None:
        self.out[:, start:start + z.shape[1]] = z

    @property
    def finite(self) -> np.ndarray:
        return np.isfinite(self.out).all(axis=1)

    def result(self) -> np.ndarray:
        return self.out
