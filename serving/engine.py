"""The inference engine: what each query computes (docs/api.md).

detect   embed once (batched with other requests), then ONE dot product per input with the
         class row W[j] of the memory-mapped head: the cost does not depend on D.
softmax  the honest baseline: all D logits per input, in ONE pass over the head per batch (a GEMM
         per class chunk, numpy BLAS over the mmap head, or full.onnx when it measured faster at
         warm-up), the softmax statistics streamed over the chunks (serving/head_scan.py).
topk     exact: the same pass keeping the k best; index: the faiss ClassIndex over the rows.
gallery  embed items and store them; search a class: its row and threshold against the gallery.

Every numeric step runs in the batcher's worker thread (a job's `reduce`), never on the loop.
"""
from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import orjson

from serving import head_scan, quantized_head
from serving.batcher import Batcher, Job, JobFailed
from serving.errors import ApiError, GalleryDown, InsufficientStorage, InvalidInput, NotFound
from serving.gallery import GalleryUnavailable, StorageFull
from serving.gallery.executor import GalleryExecutor
from serving.inputs import examples as read_examples
from serving.packed_head import PackedHead

log = logging.getLogger(__name__)

# A batch holding a pass over all D classes waits for batch-mates up to this share of the pass's
# measured time: the pass costs about the same for 1 input as for max_batch (it reads all of W).
SCAN_PATIENCE_SHARE = 0.05

# full.onnx and the packed head hold their own (packed) copy of the head in RAM; past this many
# weights (256 MB of float32) the softmax baseline only reads the memory-mapped rows.
ONNX_HEAD_MAX_VALUES = 64 * 1024 * 1024


def sigmoid(t: np.ndarray) -> np.ndarray:
    """σ(t) without overflow for any finite t."""
    return np.exp(-np.logaddexp(0.0, -t))


def finite_output(values: np.ndarray) -> np.ndarray:
    """The model's outputs, or 422 when they overflowed: finite float32 inputs far from the data the
    network saw can give inf / NaN embeddings or logits, which have no JSON number to answer with."""
    require_finite(np.isfinite(values))
    return values


def require_finite(finite: np.ndarray) -> None:
    """422 non_finite_output unless every entry of the mask is true."""
    if not finite.all():
        raise InvalidInput("the model's output for these inputs is not finite (inputs too large for the network)",
                           code="non_finite_output")


@dataclass
class ClassRef:
    id: int
    name: str


class Engine:
    def __init__(self, bundle, runtime, settings, index, gallery, metrics=None):
        self.bundle = bundle
        self.runtime = runtime
        self.settings = settings
        self.index = index
        self.gallery = gallery
        self.input_shape = tuple(int(s) for s in bundle.input_shape)
        self.input_size = int(np.prod(self.input_shape))
        self.num_classes = int(bundle.num_classes)
        # the per-class arrays as plain ndarray views (the head stays mapped): indexing a np.memmap
        # runs Python code per access, and detect reads five of them per request
        self._weight = np.asarray(bundle.weight)
        self._bias, self._thresholds = np.asarray(bundle.bias), np.asarray(bundle.thresholds)
        self._thresholds_finite = bool(np.isfinite(self._thresholds).all())  # else a class falls back to the global one
        self._platt_a, self._platt_b = np.asarray(bundle.platt_a), np.asarray(bundle.platt_b)
        self.softmax_impl = "numpy" if settings.softmax_impl == "auto" else settings.softmax_impl
        self._ort_gemm = head_scan.OrtGemm(int(bundle.embed_dim), threads=runtime.threads)
        self._logsumexp = head_scan.OrtLogSumExp()  # the softmax statistics of a chunk (MLAS)
        # batches computed at once: a second lane only where there are threads to share (not on CUDA)
        lanes = settings.concurrent_batches if runtime.threads > 1 and not runtime.uses_cuda else 1
        self._scan_buf: Optional[np.ndarray] = None  # the pass's chunk buffer, kept: no 8 MiB malloc per batch
        # a second thread for the pass's per-request statistics (the GEMM already uses intra_op_threads)
        self._scan_pool = ThreadPoolExecutor(1, thread_name_prefix="slc-scan") if runtime.threads > 1 else None
        # softmax_impl ort_pair: two one-thread GEMMs (this thread and the pool's) taking class chunks in turn
        self._ort_pair = (tuple(head_scan.over_rows(head_scan.OrtGemm(int(bundle.embed_dim), threads=1),
                                                    bundle.weight, bundle.bias) for _ in range(2))
                          if self._scan_pool is not None else None)
        self._packed: Optional[PackedHead] = None  # softmax_impl packed_pair: the same, rows pre-packed (built at warm-up)
        self._pair_bufs: Optional[tuple[np.ndarray, np.ndarray]] = None
        if self.softmax_impl in ("ort_pair", "packed_pair") and self._ort_pair is None:
            raise ValueError(f"softmax_impl={self.softmax_impl} needs two or more intra-op threads (SLC_INTRA_OP_THREADS)")
        self.head_precision = settings.head_precision
        if self.head_precision != "float32" and self.head_precision not in bundle.heads:
            raise ValueError(f"head_precision={self.head_precision}: the bundle has no {self.head_precision} head "
                             f"(add one with: slc bundle quantize {bundle.path} --precision {self.head_precision})")
        self._quantized: Optional[Any] = None  # Int8Head / Bf16Head (serving/quantized_head.py), built at warm-up
        # a quantized pass keeps a few more top-k candidates, re-scored exactly (TopK.rescore)
        self._topk_extra = quantized_head.TOPK_EXTRA if self.head_precision != "float32" else 0
        self.softmax_timing: dict[str, float] = {}
        self.scan_patience = 0.0  # seconds a softmax / exact top-k batch waits for batch-mates (set at warm-up)
        # gallery calls and gallery bodies: a bounded executor of their own (serving/gallery/executor.py)
        self.gallery_pool = GalleryExecutor(settings.gallery_threads, settings.gallery_queue_size)
        self.batcher = Batcher(self._compute, max_batch=settings.max_batch, max_delay_ms=settings.max_delay_ms,
                               queue_size=settings.queue_size, metrics=metrics, inline_max_s=settings.inline_max_ms / 1000,
                               in_flight=(lambda: metrics.in_flight) if metrics is not None and settings.adaptive_delay else None,
                               lanes=lanes)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()
        self.gallery_pool.shutdown()
        if self._scan_pool is not None:
            self._scan_pool.shutdown(wait=True)

    async def warm_up(self) -> None:
        """Touch every path once (ORT allocations, mmap pages) and choose the softmax head."""
        x = np.zeros((min(self.settings.max_batch, 8),) + self.input_shape, np.float32)
        small = await self.batcher.run_sync(self.runtime.choose_small_batches)
        await self.batcher.run_sync(self.runtime.embed, x[:1])
        await self.batcher.run_sync(self.runtime.embed, x)
        self.softmax_impl, self.softmax_timing = await self.batcher.run_sync(self._choose_softmax_impl)
        self.scan_patience = SCAN_PATIENCE_SHARE * self.softmax_timing.get(self.softmax_impl, 0.0)
        if small:
            log.info("backbone: one-thread session for batches of up to %d inputs (faster than the pool there)", small)
        log.info("full-softmax head: %s (best of 3, batch %d: %s)", self.softmax_impl,
                 self.settings.max_batch, {k: f"{v * 1e3:.2f} ms" for k, v in self.softmax_timing.items()})
        if self.index is not None and not self.index.reads_every_row:  # an exact index is the pass: nothing to warm
            await self.batcher.run_sync(self.index.search, np.zeros((1, self.bundle.embed_dim), np.float32), 1)

    def _quantized_head(self):
        """The int8 or bf16 ChunkGemm of the head (built once)."""
        if self._quantized is None:
            head = self.bundle.heads[self.head_precision]
            if self.head_precision == "int8":
                rows = quantized_head.int8_rows(self.num_classes, head_scan.pair_rows(self.settings.max_batch, self.num_classes))
                self._quantized = quantized_head.Int8Head(head["weight"], head["scale"], self.bundle.bias, rows)
            else:
                self._quantized = quantized_head.Bf16Head(head["weight"], self.bundle.bias)
        return self._quantized

    def _quantized_rows(self, m: int) -> int:
        q = self._quantized_head()
        return q.rows if self.head_precision == "int8" else head_scan.pair_rows(m, self.num_classes)

    def _choose_softmax_impl(self) -> tuple[str, dict[str, float]]:
        """Time a softmax batch through each path the settings allow; keep the fastest (or time only
        the path the settings name, or the quantized head's: its time sets the batch's patience)."""
        n = self.settings.max_batch
        x = np.random.default_rng(0).standard_normal((n,) + self.input_shape).astype(np.float32)
        timings = {}
        for name, fn in self._softmax_paths(x):
            try:
                if name == "packed_pair" and self._packed is None:
                    self._packed = PackedHead(self.bundle.weight, self.bundle.bias,
                                              head_scan.pair_rows(self.settings.max_batch, self.num_classes))
                fn()  # first call pays loading and page faults
                best = math.inf
                for _ in range(3):
                    t0 = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t0)
                timings[name] = best
            except Exception as exc:  # e.g. no full.onnx in a bundle: numpy always works
                if self.head_precision != "float32":
                    raise
                log.warning("softmax path %s unavailable: %s", name, exc)
        if not timings:
            raise RuntimeError(f"softmax_impl={self.settings.softmax_impl}: that path cannot run on this bundle")
        best = min(timings, key=timings.get)
        if best != "onnx":
            self.runtime.drop_full()
        if best != "packed_pair":
            self._packed = None  # its packed copy of the head
        if best not in ("ort_pair", "packed_pair") and self.head_precision == "float32":
            self._pair_bufs = None
        return best, timings

    def _softmax_paths(self, x: np.ndarray) -> list[tuple[str, Any]]:
        """(name, one softmax batch over x) of every path the settings and the bundle allow."""
        def per_input():  # one request per input, as under load
            return [(slice(i, i + 1), head_scan.SoftmaxStats(1, 0, self._logsumexp)) for i in range(len(x))]

        def scan_path(gemm):
            return lambda: head_scan.scan(self.bundle.weight, self.bundle.bias, self.runtime.embed(x), per_input(),
                                          gemm=gemm, pool=self._scan_pool)

        def pair_path(impl):
            return lambda: self._scan_head_pair(self.runtime.embed(x), per_input(), impl)

        if self.head_precision != "float32":  # the passes read the quantized head: nothing to choose
            return [(self.head_precision, lambda: self._scan_quantized(self.runtime.embed(x), per_input()))]
        paths = [("numpy", scan_path(head_scan.numpy_gemm)), ("ort", scan_path(self._ort_gemm))]
        if self._ort_pair is not None:
            paths.append(("ort_pair", pair_path("ort_pair")))
        fits_twice = self.num_classes * self.bundle.embed_dim <= ONNX_HEAD_MAX_VALUES
        if self.settings.softmax_impl == "onnx" or (self.settings.softmax_impl == "auto" and fits_twice):
            paths.append(("onnx", lambda: head_scan.feed(self.runtime.full_logits(x), per_input(), pool=self._scan_pool)))
        if self._ort_pair is not None and (self.settings.softmax_impl == "packed_pair" or
                                           (self.settings.softmax_impl == "auto" and fits_twice)):
            paths.append(("packed_pair", pair_path("packed_pair")))
        if self.settings.softmax_impl != "auto":
            return [p for p in paths if p[0] == self.settings.softmax_impl]
        if len(paths) == 2:
            log.info("full-softmax head: numpy over the mmap rows (D*d = %d: full.onnx would hold a second copy)",
                     self.num_classes * self.bundle.embed_dim)
        return paths

    # ------------------------------------------------------------------ batch compute (worker thread)
    def _compute(self, jobs: list[Job], shared: bool = False) -> list[Any]:
        """The batch's results, one per job. `shared`: a pass computes at the same time (this batch
        is backbone-only, serving/batcher.py), so the backbone runs on one thread."""
        xs = [j.x for j in jobs]
        x = xs[0] if len(xs) == 1 else np.concatenate(xs)  # [M, *input_shape]
        offsets = np.cumsum([0] + [j.n for j in jobs])
        scans = [i for i, j in enumerate(jobs) if j.kind == "logits"]
        need_h = self.softmax_impl != "onnx" or len(scans) < len(jobs)
        h = self.runtime.embed(x, one_thread=shared) if need_h else None  # [M, d]
        accumulated = self._scan_head(jobs, scans, offsets, x, h)
        found = self._index_search(jobs, offsets, h)
        results = []
        for i, job in enumerate(jobs):
            if job.kind == "logits":
                rows = accumulated[i]
            elif job.kind == "index":
                rows = found[i]
            else:
                rows = h[offsets[i]:offsets[i + 1]]
            try:  # one job's refusal (e.g. non_finite_output) is its own: its batch-mates are answered
                results.append(job.reduce(rows) if job.reduce is not None else rows)
            except ApiError as exc:
                results.append(JobFailed(exc))
        return results

    def _gemm(self) -> head_scan.Gemm:
        """The chunk GEMM chosen at warm-up: onnxruntime's (ort) or numpy's."""
        return self._ort_gemm if self.softmax_impl == "ort" else head_scan.numpy_gemm

    def _chunk_buffer(self, m: int) -> np.ndarray:
        """The flat scratch array of the pass for m inputs, grown when needed and then kept (passes
        run one at a time: the batcher never starts one beside another)."""
        need = m * head_scan.chunk_rows(m, self.num_classes)
        if self._scan_buf is None or self._scan_buf.size < need:
            self._scan_buf = np.empty(need, dtype=np.float32)
        return self._scan_buf

    def _pair_rows(self, m: int, impl: str) -> int:
        """Classes per chunk of a two-thread pass over m inputs: the packed head's own chunks, or pair_rows."""
        return self._packed.rows if impl == "packed_pair" else head_scan.pair_rows(m, self.num_classes)

    def _pair_buffers(self, m: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The two chunk buffers of a two-thread pass for m inputs (one chunk each), grown when needed."""
        need = m * rows
        if self._pair_bufs is None or self._pair_bufs[0].size < need:
            self._pair_bufs = (np.empty(need, dtype=np.float32), np.empty(need, dtype=np.float32))
        return self._pair_bufs

    def _scan_head_pair(self, h: np.ndarray, parts: list, impl: str) -> None:
        """The pass on two threads taking chunks in turn: one-thread GEMMs over the mapped rows
        (ort_pair) or the packed head's chunk sessions (packed_pair)."""
        if impl == "packed_pair" and len(h) > self.settings.max_batch:
            impl = "ort_pair"  # a lone job above max_batch: chunks of max_batch x rows would grow with it
        gemms = (self._packed, self._packed) if impl == "packed_pair" else self._ort_pair
        rows = self._pair_rows(len(h), impl)
        head_scan.scan_two(self.num_classes, h, parts, gemms, self._pair_buffers(len(h), rows), self._scan_pool, rows)

    def _scan_quantized(self, h: np.ndarray, parts: list) -> None:
        """The pass on the quantized head (both threads when there are two), then each answer
        finished on the float32 rows: the top-k's candidates and the softmax's own logit re-scored."""
        rows = self._quantized_rows(len(h))
        gemm = self._quantized_head()
        head_scan.scan_two(self.num_classes, h, parts, (gemm, gemm), self._pair_buffers(len(h), rows), self._scan_pool, rows)
        for sl, acc in parts:
            if isinstance(acc, head_scan.TopK):
                acc.rescore(h[sl], self._weight, self._bias, keep=acc.k - quantized_head.TOPK_EXTRA)
            elif isinstance(acc, head_scan.SoftmaxStats):
                acc.rescore(h[sl], self._weight, self._bias)

    def _scan_head(self, jobs: list[Job], scans: list[int], offsets: np.ndarray, x: np.ndarray,
                   h: Optional[np.ndarray]) -> dict[int, Any]:
        """ONE pass over the head for every job of the batch that needs all D logits (softmax, exact
        top-k, full logits), each into its own accumulator (serving/head_scan.py): one GEMM per class
        chunk, never a [batch, D] matrix unless a job answers with one."""
        if not scans:
            return {}
        rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in scans])
        accumulated, parts, start = {}, [], 0
        for i in scans:
            accumulated[i] = jobs[i].accumulator(jobs[i].n)
            parts.append((slice(start, start + jobs[i].n), accumulated[i]))
            start += jobs[i].n
        hq = h if self.softmax_impl == "onnx" or len(rows) == len(h) else h[rows]
        if self.head_precision != "float32":
            self._scan_quantized(hq, parts)
        elif self.softmax_impl in ("ort_pair", "packed_pair"):
            self._scan_head_pair(hq, parts, self.softmax_impl)
        elif self.softmax_impl != "onnx":
            head_scan.scan(self.bundle.weight, self.bundle.bias, hq, parts,
                           gemm=self._gemm(), buf=self._chunk_buffer(len(rows)), pool=self._scan_pool)
        else:
            head_scan.feed(self.runtime.full_logits(x if len(rows) == len(x) else x[rows]), parts, pool=self._scan_pool)
        return accumulated

    def _index_search(self, jobs: list[Job], offsets: np.ndarray, h: Optional[np.ndarray]) -> dict[int, tuple]:
        """ONE class-index search over the embeddings of every "index" job in the batch, split per job.

        Searching per request would repeat the per-call cost (list scans, or a pass over all of
        W when the index is exact) once per request instead of once per batch. Each job's reduce
        carries its k; the batch is searched with the largest and each job gets (logits [n, K],
        ids [n, K]) with K >= its k, best first.
        """
        index_jobs = [i for i, j in enumerate(jobs) if j.kind == "index"]
        if not index_jobs:
            return {}
        rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in index_jobs])
        hq = np.array(h if len(rows) == len(h) else h[rows], dtype=np.float32)  # [M', d], our copy
        bad = ~np.isfinite(hq).all(axis=1)  # an overflowed embedding must not take its batch down with it
        hq[bad] = 0.0
        k = max(int(getattr(jobs[i].reduce, "k", 1)) for i in index_jobs)
        logits, ids = self.index.search(hq, k)  # [M', K] each
        if bad.any():
            logits = np.array(logits, dtype=np.float32)
            logits[bad] = np.nan  # its job's reduce answers 422 non_finite_output
        found, start = {}, 0
        for i in index_jobs:
            found[i] = (logits[start:start + jobs[i].n], ids[start:start + jobs[i].n])
            start += jobs[i].n
        return found

    # ------------------------------------------------------------------ inputs and classes
    def resolve_class(self, ref: str) -> ClassRef:
        """A class name from the manifest, else an integer id (Bundle.class_id's rule); NotFound otherwise."""
        try:
            j = self.bundle.class_id(ref)
        except KeyError:
            raise NotFound(f"unknown class {ref!r} (a class name, or an id 0..{self.num_classes - 1})",
                           code="unknown_class") from None
        return ClassRef(j, str(self.bundle.classes[j]))

    async def image_batch(self, body: bytes, content_type: bytes) -> np.ndarray:
        """One example [1, *input_shape] from an image body (decoded by a worker process, under a time budget)."""
        from serving import image_decoder

        x = await image_decoder.decode(self.settings, body, content_type, self.bundle.image, self.input_shape)
        return x[None].astype(np.float32, copy=False)

    def to_batch(self, inputs: Any, what: str = "inputs", bools_possible: bool = True) -> np.ndarray:
        """Examples (each nested like the input shape, or flat) -> float32 [N, *input_shape], strictly
        and with bounds checked first (serving/inputs.py); `bools_possible=False` when the raw body
        holds no JSON boolean (saves the walk that looks for one)."""
        return read_examples(inputs, self.input_shape, self.settings.max_inputs, bools_possible, what)

    def threshold_of(self, j: int) -> float:
        t = float(self._thresholds[j])
        return t if math.isfinite(t) else float(self.bundle.global_threshold)

    def _timeout(self) -> float:
        return self.settings.request_timeout_s

    # ------------------------------------------------------------------ queries
    async def detect(self, cls: ClassRef, x: np.ndarray, threshold: Optional[float]) -> dict:
        j = cls.id
        thr = self.threshold_of(j) if threshold is None else float(threshold)
        # [d] one row of the mmap head, as a plain float64 array: nothing of size D is touched
        w = np.array(self._weight[j], dtype=np.float64)
        b = float(self._bias[j])
        pa, pb = float(self._platt_a[j]), float(self._platt_b[j])

        def reduce(h: np.ndarray) -> list[dict]:  # h [n, d]
            z = finite_output(h.astype(np.float64) @ w + b)  # [n]
            p = sigmoid(pa * z + pb)
            return [{"logit": zi, "match": zi >= thr, "probability": pi} for zi, pi in zip(z.tolist(), p.tolist())]

        results = await self.batcher.submit(x, "embed", reduce, self._timeout())
        return {"class_id": j, "class_name": cls.name, "threshold": thr, "results": results}

    async def softmax(self, cls: ClassRef, x: np.ndarray) -> dict:
        j = cls.id

        def reduce(acc: head_scan.SoftmaxStats) -> list[dict]:  # streamed over all D logits
            require_finite(acc.finite)
            p, zj, top1 = acc.result()
            return [{"probability": pi, "logit": zi, "is_top1": ti}
                    for pi, zi, ti in zip(p.tolist(), zj.tolist(), top1.tolist())]

        results = await self.batcher.submit(x, "logits", reduce, self._timeout(),
                                            accumulator=lambda n: head_scan.SoftmaxStats(n, j, self._logsumexp), patience=self.scan_patience)
        return {"class_id": j, "class_name": cls.name, "results": results}

    async def topk(self, x: np.ndarray, k: int, mode: str) -> dict:
        k = min(k, self.num_classes)
        names = self.bundle.classes

        def entries(ids: np.ndarray, logits: np.ndarray) -> list[list[dict]]:
            return [[{"class_id": int(c), "class_name": str(names[c]), "logit": float(v)}
                     for c, v in zip(row_ids, row_z) if c >= 0] for row_ids, row_z in zip(ids, logits)]

        if mode == "exact" or self.index is None or self.index.reads_every_row:  # exact index: the same pass
            def reduce(acc: head_scan.TopK):  # streamed over all D logits
                require_finite(acc.finite)
                logits, ids = acc.result()
                return entries(ids, logits)

            results = await self.batcher.submit(x, "logits", reduce, self._timeout(),
                                                accumulator=lambda n: head_scan.TopK(n, k + self._topk_extra),
                                                patience=self.scan_patience)
        else:
            def reduce(found: tuple[np.ndarray, np.ndarray]):  # this job's (logits, ids) [n, K >= k] of the batch search
                logits, ids = found
                return entries(ids[:, :k], finite_output(logits[:, :k]))

            reduce.k = k  # _index_search searches the whole batch with the largest k
            results = await self.batcher.submit(x, "index", reduce, self._timeout())
        return {"k": k, "mode": mode, "results": results}

    async def single_logits(self, x: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """KServe `<name>`: input i scored against class ids[i] only -> (logit [N] float32, match [N] bool)."""
        rows = self._weight[ids].astype(np.float64)  # [N, d]: N rows of the head, not D
        b = self._bias[ids].astype(np.float64)
        thr = self._thresholds[ids].astype(np.float64)
        if not self._thresholds_finite:
            thr[~np.isfinite(thr)] = float(self.bundle.global_threshold)  # threshold_of's rule

        def reduce(h: np.ndarray):  # h [N, d]
            z = finite_output(np.vecdot(h.astype(np.float64), rows) + b)
            return z.astype(np.float32), z >= thr

        return await self.batcher.submit(x, "embed", reduce, self._timeout())

    async def all_logits(self, x: np.ndarray) -> np.ndarray:
        """KServe `<name>-full`: logits [N, D] float32, written chunk by chunk into the answer."""
        def reduce(acc: head_scan.AllLogits) -> np.ndarray:
            require_finite(acc.finite)
            return acc.result()

        return await self.batcher.submit(x, "logits", reduce, self._timeout(),
                                         accumulator=lambda n: head_scan.AllLogits(n, self.num_classes),
                                         patience=self.scan_patience)

    # ------------------------------------------------------------------ gallery
    async def off_loop(self, fn, *args):
        """fn(*args) on the gallery's own executor (parsing and serialising gallery bodies)."""
        return await self.gallery_pool.run(fn, *args)

    async def _gallery(self, method, *args, nothing: str = "nothing was written"):
        """gallery.<method>(*args) (or method(*args) when it is a function) on the gallery's executor;
        storage errors become the envelope's 507 / 503."""
        fn = getattr(self.gallery, method) if isinstance(method, str) else method
        try:
            return await self.gallery_pool.run(fn, *args)
        except StorageFull as exc:
            raise InsufficientStorage(f"{exc}; {nothing}, retry once space is freed") from None
        except GalleryUnavailable as exc:
            raise GalleryDown(f"{exc}; retry") from None

    async def gallery_upsert(self, items: list[dict], x: np.ndarray) -> list[str]:
        """Embed the items' inputs x [N, *input_shape] (checked: serving/gallery/bodies.py) and store them."""
        from serving.gallery import GalleryRecord

        h = await self.batcher.submit(x, "embed", lambda rows: finite_output(np.array(rows, np.float32)), self._timeout())
        records = [GalleryRecord(id=it["id"], embedding=h[i], metadata=it.get("metadata"), input=it["input"],
                                 metadata_json=it.get("metadata_json")) for i, it in enumerate(items)]
        await self._gallery("upsert", records)
        return [it["id"] for it in items]

    async def gallery_get(self, item_id: str) -> bytes:
        """The item's JSON answer {id, metadata, input}, spliced from its stored texts off the loop."""
        item = await self._gallery("get_json", item_id)
        if item is None:
            raise NotFound(f"no gallery item {item_id!r}", code="unknown_item")
        return item

    async def gallery_delete(self, item_id: str) -> None:
        if not await self._gallery("delete", item_id, nothing="nothing was deleted"):  # a delete writes too
            raise NotFound(f"no gallery item {item_id!r}", code="unknown_item")

    async def gallery_search(self, cls: ClassRef, threshold: Optional[float], limit: Optional[int]) -> bytes:
        """The search's JSON answer, built off the loop from the items' stored metadata texts."""
        j = cls.id
        thr = self.threshold_of(j) if threshold is None else float(threshold)
        w = np.array(self._weight[j], dtype=np.float32)  # [d]
        gallery = self.gallery

        def answer() -> bytes:
            hits = gallery.search_raw(w, float(self._bias[j]), thr, limit)
            head = orjson.dumps({"class_id": j, "class_name": cls.name, "threshold": thr})[:-1]
            results = b",".join(b"".join((b'{"id":', orjson.dumps(i), b',"logit":', orjson.dumps(z),
                                          b',"metadata":', m.encode(), b"}")) for i, z, m in hits)
            return b"".join((head, b',"results":[', results, b"]}"))

        return await self._gallery(answer)

    async def gallery_info(self) -> dict:
        gallery = self.gallery
        count = await self._gallery("count")
        return {"count": int(count), "index_kind": str(gallery.index_kind)}
