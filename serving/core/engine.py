"""The inference engine: what each query computes (docs/api.md).

detect   embed once (batched with other requests), then ONE dot product per input with the
         class row W[j] of the memory-mapped head: the cost does not depend on D.
softmax  the honest baseline: all D logits per input, in ONE pass over the head per batch (the
         strategy measured fastest at warm-up: serving/core/compute.py), the softmax statistics
         streamed over the chunks (serving/core/head_scan.py).
topk     exact: the same pass keeping the k best; index: the faiss ClassIndex over the rows.
gallery  embed items and store them; search a class: its row and threshold against the gallery.

Every numeric step runs in the batcher's worker thread (a job's `reduce`), never on the loop.
Inputs arrive decoded (serving/codecs/); errors are serving/errors.py's, protocol-free.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import orjson

from serving.core import head_scan
from serving.core.batcher import Batcher, Job, JobFailed
from serving.core.calibration import Thresholds, reload as reload_thresholds
from serving.core.compute import HeadPass
from serving.errors import GalleryDown, InsufficientStorage, InvalidInput, NotFound, SlcError
from serving.gallery import GalleryUnavailable, StorageFull
from serving.gallery.executor import GalleryExecutor

log = logging.getLogger(__name__)

# A batch holding a pass over all D classes waits for batch-mates up to this share of the pass's
# measured time: the pass costs about the same for 1 input as for max_batch (it reads all of W).
SCAN_PATIENCE_SHARE = 0.05


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
        self._bias = np.asarray(bundle.bias)
        # thresholds, Platt parameters, global fallback: one object, swapped whole (reload_calibration);
        # each query reads it once, so it decides with all old or all new values
        self.calibration = Thresholds.of_bundle(bundle)
        self._reload_lock = threading.Lock()
        self.head_pass = HeadPass(bundle, runtime, settings)  # the passes over all D classes
        # batches computed at once: a second lane only where there are threads to share (not on CUDA)
        lanes = settings.concurrent_batches if runtime.threads > 1 and not runtime.uses_cuda else 1
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
        self.head_pass.close()

    async def warm_up(self) -> None:
        """Touch every path once (ORT allocations, mmap pages) and choose the softmax head."""
        x = np.zeros((min(self.settings.max_batch, 8),) + self.input_shape, np.float32)
        pinned = None if self.settings.one_thread_max_batch == "auto" else self.settings.one_thread_max_batch
        small = await self.batcher.run_sync(lambda: self.runtime.choose_small_batches(pinned=pinned))
        await self.batcher.run_sync(self.runtime.embed, x[:1])
        await self.batcher.run_sync(self.runtime.embed, x)
        await self.batcher.run_sync(self.head_pass.choose)
        self.scan_patience = SCAN_PATIENCE_SHARE * self.softmax_timing.get(self.softmax_impl, 0.0)
        if small:
            log.info("backbone: one-thread session for batches of up to %d inputs (%s)", small,
                     "timed: faster than the pool there" if pinned is None else "SLC_ONE_THREAD_MAX_BATCH")
        log.info("full-softmax head: %s (least cost per input; best of 3 by batch size: %s)", self.softmax_impl,
                 {n: {k: f"{v * 1e3:.2f} ms" for k, v in t.items()} for n, t in self.head_pass.timing_by_batch.items()})
        if self.index is not None and not self.index.reads_every_row:  # an exact index is the pass: nothing to warm
            await self.batcher.run_sync(self.index.search, np.zeros((1, self.bundle.embed_dim), np.float32), 1)

    @property
    def softmax_impl(self) -> str:
        """The pass strategy chosen at warm-up (serving/core/compute.py)."""
        return self.head_pass.name

    @property
    def softmax_timing(self) -> dict[str, float]:
        return self.head_pass.timing

    # ------------------------------------------------------------------ batch compute (worker thread)
    def _compute(self, jobs: list[Job], shared: bool = False) -> list[Any]:
        """The batch's results, one per job. `shared`: a pass computes at the same time (this batch
        is backbone-only, serving/core/batcher.py), so the backbone runs on one thread."""
        xs = [j.x for j in jobs]
        x = xs[0] if len(xs) == 1 else np.concatenate(xs)  # [M, *input_shape]
        offsets = np.cumsum([0] + [j.n for j in jobs])
        scans = [i for i, j in enumerate(jobs) if j.kind == "logits"]
        need_h = self.head_pass.needs_embedding or len(scans) < len(jobs)
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
            except SlcError as exc:
                results.append(JobFailed(exc))
        return results

    def _scan_head(self, jobs: list[Job], scans: list[int], offsets: np.ndarray, x: np.ndarray,
                   h: Optional[np.ndarray]) -> dict[int, Any]:
        """ONE pass over the head for every job of the batch that needs all D logits (softmax, exact
        top-k, full logits), each into its own accumulator (serving/core/head_scan.py): one GEMM per class
        chunk, never a [batch, D] matrix unless a job answers with one."""
        if not scans:
            return {}
        rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in scans])
        accumulated, parts, start = {}, [], 0
        for i in scans:
            accumulated[i] = jobs[i].accumulator(jobs[i].n)
            parts.append((slice(start, start + jobs[i].n), accumulated[i]))
            start += jobs[i].n
        every = len(rows) == len(x)
        if self.head_pass.needs_embedding:
            self.head_pass.run(None, h if every else h[rows], parts)
        else:  # full.onnx embeds the inputs itself
            self.head_pass.run(x if every else x[rows], None, parts)
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

    def threshold_of(self, j: int) -> float:
        return self.calibration.of_class(j)

    async def reload_calibration(self, expect_sha256: Optional[str] = None) -> dict:
        """The calibration now in the served bundle's folder, checked against its manifest and the
        loaded model, swapped in whole (serving/core/calibration.py); what changed."""
        def work() -> dict:
            with self._reload_lock:  # two reloads at once: one after the other
                new, manifest, answer = reload_thresholds(self.bundle, self.calibration, expect_sha256)
                if answer["reloaded"]:
                    self.calibration = new  # the one step every later query sees
                    self._record(new, manifest)
                return answer

        return await asyncio.to_thread(work)

    def _record(self, new: Thresholds, manifest: dict) -> None:
        """The bundle's own fields follow the swap (GET /v1/model; the gallery and the class index keep
        the digest they were opened with: the backbone and head are unchanged)."""
        b = self.bundle
        b.manifest = {**manifest, "classes": b.classes}
        b.calibration, b.thresholds, b.platt_a, b.platt_b = new.calibration, new.threshold, new.platt_a, new.platt_b
        b.global_threshold, b.digest = new.global_threshold, new.digest

    def _timeout(self) -> float:
        return self.settings.request_timeout_s

    # ------------------------------------------------------------------ queries
    async def detect(self, cls: ClassRef, x: np.ndarray, threshold: Optional[float]) -> dict:
        j, cal = cls.id, self.calibration  # one calibration for the whole request
        thr = cal.of_class(j) if threshold is None else float(threshold)
        # [d] one row of the mmap head, as a plain float64 array: nothing of size D is touched
        w = np.array(self._weight[j], dtype=np.float64)
        b = float(self._bias[j])
        pa, pb = float(cal.platt_a[j]), float(cal.platt_b[j])

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
                                            accumulator=lambda n: head_scan.SoftmaxStats(n, j, self.head_pass.logsumexp), patience=self.scan_patience)
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
                                                accumulator=lambda n: head_scan.TopK(n, k + self.head_pass.topk_extra),
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
        thr = self.calibration.of_classes(ids)  # [N] threshold_of's rule

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
