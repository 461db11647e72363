"""The inference engine: what each query computes (docs/api.md).

detect   embed once (batched with other requests), then ONE dot product per input with the
         class row W[j] of the memory-mapped head: the cost does not depend on D.
softmax  the honest baseline: all D logits per input, in ONE pass over the head per batch (the
         strategy measured fastest at warm-up: serving/core/compute.py), the softmax statistics
         streamed over the chunks (serving/core/head_scan.py).
topk     exact: the same pass keeping the k best; index: the faiss ClassIndex over the rows.
gallery  embed items and store them; search a class: its row and threshold against the gallery.
enroll   embed a new class's examples, its row by serving/core/enrollment.py's rule, stored and served
         beside the trained rows (serving/core/enrolled.py): every query above reads the enrolled
         snapshot it started with, the passes over all classes feed it one more chunk of logits.

Every numeric step runs in the batcher's worker thread (a job's `reduce`), never on the loop.
Inputs arrive decoded (serving/codecs/); errors are serving/errors.py's, protocol-free.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import orjson

from serving.core import head_scan, open_set
from serving.core.batcher import Batcher, Job, JobFailed
from serving.core.classes import ClassRef, ClassRegistry
from serving.core import head_precision
from serving.core.enrolled import Enrolled, EnrolledClasses, LimitReached, empty_snapshot
from serving.bundle.names import refused_character, shown
from serving.core.enrollment import check_name
from serving.errors import (Conflict, GalleryDown, InsufficientStorage, InvalidInput, NotFound, NotReady, SlcError,
                            StoreDown)
from serving.gallery import GalleryUnavailable, StorageFull, StoreUnavailable
from serving.gallery.executor import GalleryExecutor

log = logging.getLogger(__name__)

# A batch holding a pass over all D classes waits for batch-mates up to this share of the pass's
# measured time: the pass costs about the same for 1 input as for max_batch (it reads all of W).
SCAN_PATIENCE_SHARE = 0.05
# An enrollment answer's `matched_by`: each example's k best classes are judged (exact top-k, matches only);
# a look-alike further down than this is missed, which `matched_by_complete: false` says.
MATCHED_BY_K = 16



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



class Engine:
    def __init__(self, bundle, runtime, settings, index, gallery, metrics=None,
                 enrolled: Optional[EnrolledClasses] = None, *, batcher: Batcher, name: Optional[str] = None):
        """`batcher`: its backbone group's lane, shared with the other models of the same backbone
        (serving/core/backbones.py: this engine's jobs carry it as their owner; the group starts and stops
        the lane). `name`: the name it is served under (default the bundle's)."""
        self.bundle = bundle
        self.name = name or str(bundle.name)
        self.active = 0  # calls of this engine on their way through the batcher or the gallery (unload drains them)
        self.closed = False
        self.enrolled = enrolled
        self.classes = ClassRegistry(bundle, enrolled, settings)  # trained and enrolled: named, rows, thresholds
        self.runtime = runtime
        self.settings = settings
        self.index = index
        self.gallery = gallery
        self.input_shape = tuple(int(s) for s in bundle.input_shape)
        self.input_size = int(np.prod(self.input_shape))
        self.num_classes = int(bundle.num_classes)
        self.head_pass = head_precision.open_pass(bundle, runtime, settings)  # the passes over all D classes
        self.precision_choice: Optional[head_precision.PrecisionChoice] = None  # set at warm-up
        self.scan_patience = 0.0  # seconds a softmax / exact top-k batch waits for batch-mates (set at warm-up)
        # gallery calls and gallery bodies: a bounded executor of their own (serving/gallery/executor.py)
        self.gallery_pool = GalleryExecutor(settings.gallery_threads, settings.gallery_queue_size)
        self.batcher = batcher

    # ------------------------------------------------------------------ lifecycle
    async def stop(self) -> None:
        """Later calls: 503 (the lane is its group's to drain and stop)."""
        self.closed = True
        self.gallery_pool.shutdown()
        self.head_pass.close()

    async def _submit(self, x: np.ndarray, kind: str, reduce, **params):
        """A job of this engine into the batcher, under the request deadline (params: Batcher.submit's)."""
        if self.closed:
            raise NotReady(f"the model {self.name!r} was unloaded")
        self.active += 1
        try:
            return await self.batcher.submit(x, kind, reduce, self._timeout(), owner=self, **params)
        finally:
            self.active -= 1

    async def warm_up(self) -> None:
        """Touch every path once (ORT allocations, mmap pages) and choose the softmax head."""
        x = np.zeros((min(self.settings.max_batch, 8),) + self.input_shape, np.float32)
        pinned = None if self.settings.one_thread_max_batch == "auto" else self.settings.one_thread_max_batch
        small = await self.batcher.run_sync(lambda: self.runtime.choose_small_batches(pinned=pinned))
        await self.batcher.run_sync(self.runtime.embed, x[:1])
        await self.batcher.run_sync(self.runtime.embed, x)
        self.head_pass, self.precision_choice = await self.batcher.run_sync(
            lambda: head_precision.choose(self.head_pass, self.bundle, self.runtime, self.settings))
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
    def needs_embedding(self, jobs: list[Job]) -> bool:
        """Whether these jobs read the backbone's embeddings (not when every one is a pass by full.onnx)."""
        return self.head_pass.needs_embedding or any(j.kind != "logits" or _snapshot_of(j).n or j.embeddings
                                                      for j in jobs)

    def _compute(self, jobs: list[Job], shared: bool = False, h: Optional[np.ndarray] = None) -> list[Any]:
        """The batch's results, one per job. `shared`: a pass computes at the same time (this batch
        is backbone-only, serving/core/batcher.py), so the backbone runs on one thread. `h`: the jobs'
        embeddings [M, d] when the backbone already ran over them (a lane shared by several models)."""
        xs = [j.x for j in jobs]
        x = xs[0] if len(xs) == 1 else np.concatenate(xs)  # [M, *input_shape]
        offsets = np.cumsum([0] + [j.n for j in jobs])
        scans = [i for i, j in enumerate(jobs) if j.kind == "logits"]
        extra = [i for i in scans if _snapshot_of(jobs[i]).n]  # passes that go on over enrolled rows
        if h is None and self.needs_embedding(jobs):
            h = self.runtime.embed(x, one_thread=shared)  # [M, d]
        accumulated = self._scan_head(jobs, scans, offsets, x, h)
        self._scan_enrolled(jobs, extra, offsets, h, accumulated)
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
                if job.reduce is None:
                    results.append(rows)
                elif job.embeddings:
                    results.append(job.reduce(rows, h[offsets[i]:offsets[i + 1]]))
                else:
                    results.append(job.reduce(rows))
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

    def _scan_enrolled(self, jobs: list[Job], extra: list[int], offsets: np.ndarray, h: Optional[np.ndarray],
                       accumulated: dict[int, Any]) -> None:
        """After the pass over the D trained rows: the same accumulators fed the logits of the enrolled
        rows E [n_e, d] as classes D.., one chunked GEMM per snapshot (a job reads the snapshot it
        started with; head_scan.Shifted)."""
        by_snapshot: dict[int, list[int]] = {}
        for i in extra:
            by_snapshot.setdefault(id(_snapshot_of(jobs[i])), []).append(i)
        for group in by_snapshot.values():
            snap = _snapshot_of(jobs[group[0]])
            rows = np.concatenate([h[offsets[i]:offsets[i + 1]] for i in group])  # [m, d]
            parts, start = [], 0
            for i in group:
                parts.append((slice(start, start + jobs[i].n), head_scan.Shifted(accumulated[i], self.num_classes)))
                start += jobs[i].n
            head_scan.scan(snap.weight, snap.bias, rows, parts, gemm=self.head_pass.small_gemm)

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
        k = max(jobs[i].k for i in index_jobs)
        logits, ids = self.index.search(hq, k)  # [M', K] each
        if bad.any():
            logits = np.array(logits, dtype=np.float32)
            logits[bad] = np.nan  # its job's reduce answers 422 non_finite_output
        found, start = {}, 0
        for i in index_jobs:
            rows = slice(start, start + jobs[i].n)
            snap = jobs[i].snapshot
            found[i] = (logits[rows], ids[rows]) if snap is None or not snap.n else \
                _merge_enrolled(snap, hq[rows], logits[rows], ids[rows], jobs[i].k, self.head_pass.small_gemm)
            start += jobs[i].n
        return found

    # ------------------------------------------------------------------ inputs and classes
    def _timeout(self) -> float:
        return self.settings.request_timeout_s

    # ------------------------------------------------------------------ queries
    async def detect(self, cls: ClassRef, x: np.ndarray, threshold: Optional[float]) -> dict:
        snap, cal = cls.enrolled or self.classes.snapshot(), self.classes.calibration  # read once
        w, b, thr, pa, pb = self.classes.row_of(cls, cal)
        thr = thr if threshold is None else float(threshold)
        decide = self._decider(snap, cal, threshold)
        paired = decide.touches(cls.id)  # else the plain rule: no array beyond z

        def reduce(h: np.ndarray) -> list[dict]:  # h [n, d]
            z = finite_output(h.astype(np.float64) @ w + b)  # [n]
            p = sigmoid(pa * z + pb)
            m = z >= thr
            if paired:
                m = decide(h, np.full((len(z), 1), cls.id), z[:, None], np.full((len(z), 1), thr))[:, 0]
            return [{"logit": zi, "match": mi, "probability": pi}
                    for zi, mi, pi in zip(z.tolist(), m.tolist(), p.tolist())]

        results = await self._submit(x, "embed", reduce)
        return {"class_id": cls.id, "class_name": cls.name, "threshold": thr, "results": results}

    async def detect_set(self, refs: list[ClassRef], snap: Enrolled, x: np.ndarray, threshold: Optional[float]) -> dict:
        """detect for each of a few classes at once (issue 51): their C rows gathered (C, never D, rows
        read), one [n, d] x [d, C] product per request. A class named twice is computed once."""
        column: dict[int, int] = {}  # class id -> its column among the distinct classes
        distinct, inverse = [], []
        for r in refs:
            if r.id not in column:
                column[r.id] = len(distinct)
                distinct.append(r)
            inverse.append(column[r.id])
        cal = self.classes.calibration  # read once
        rows, b, thr, pa, pb = self.classes.gather(distinct, snap, cal)
        thr = thr if threshold is None else np.full(len(distinct), float(threshold))
        spread = (lambda a: a[..., inverse]) if len(distinct) < len(refs) else (lambda a: a)
        decide, ids = self._decider(snap, cal, threshold), np.array([r.id for r in distinct])

        def reduce(h: np.ndarray) -> list[list[dict]]:  # h [n, d]
            z = finite_output(h.astype(np.float64) @ rows.T + b)  # [n, C']
            p, m = sigmoid(pa * z + pb), decide(h, np.broadcast_to(ids, z.shape), z, np.broadcast_to(thr, z.shape))
            return [[{"logit": zi, "match": mi, "probability": pi} for zi, mi, pi in zip(zr, mr, pr)]
                    for zr, mr, pr in zip(spread(z).tolist(), spread(m).tolist(), spread(p).tolist())]

        results = await self._submit(x, "embed", reduce)
        classes = [{"class_id": r.id, "class_name": r.name, "threshold": t} for r, t in zip(refs, spread(thr).tolist())]
        return {"classes": classes, "results": results}

    async def softmax(self, cls: ClassRef, x: np.ndarray) -> dict:
        col, snap = self.classes.column(cls), cls.enrolled or self.classes.snapshot()

        def reduce(acc: head_scan.SoftmaxStats) -> list[dict]:  # streamed over all D + n_e logits
            require_finite(acc.finite)
            p, zj, top1 = acc.result()
            return [{"probability": pi, "logit": zi, "is_top1": ti}
                    for pi, zi, ti in zip(p.tolist(), zj.tolist(), top1.tolist())]

        results = await self._submit(
            x, "logits", reduce, patience=self.scan_patience, snapshot=snap,
            accumulator=lambda n: head_scan.SoftmaxStats(n, col, self.head_pass.logsumexp))
        return {"class_id": cls.id, "class_name": cls.name, "results": results}

    async def topk(self, x: np.ndarray, k: int, mode: str, threshold: Optional[float] = None,
                   matches_only: bool = False) -> dict:
        """The k best classes per input, each entry judged against its class's threshold (or `threshold`)
        as detect judges it: open-set recognition in one call (issue 51)."""
        snap, cal = self.classes.snapshot(), self.classes.calibration  # one snapshot, one calibration for the whole request
        total = self.num_classes + snap.n
        k = min(k, total)
        exact = mode == "exact" or self.index is None or self.index.kind in ("exact", "flat")
        lowest = open_set.lowest_threshold(cal, snap, threshold)

        decide = self._decider(snap, cal, threshold)

        def finish(logits: np.ndarray, ids: np.ndarray, h: Optional[np.ndarray]) -> tuple[list, list]:  # worker thread
            thr = open_set.thresholds_of(cal, snap, ids, threshold)
            complete = open_set.complete_rows(logits, ids, lowest, k >= total) if exact else [False] * len(ids)
            match = decide(h, ids, logits.astype(np.float64), thr)
            return self._topk_entries(snap, ids, logits, thr, match, matches_only), complete

        results, complete = await self.topk_arrays(x, k, mode, snap, finish, embeddings=decide.reads_embeddings)
        return {"k": k, "mode": mode, "results": results, "complete": complete}

    def _decider(self, snap: Enrolled, cal, threshold: Optional[float]) -> open_set.Decider:
        """detect's rule for a request's entries: logit >= threshold, and with look-alikes (serving/core/
        lookalikes.py) the larger margin of each pair. `snap`, `cal`: the request's, read once."""
        return self.classes.decider(snap, cal, threshold)

    def _topk_entries(self, snap: Enrolled, ids: np.ndarray, logits: np.ndarray, thr: np.ndarray,
                      match: np.ndarray, matches_only: bool) -> list[list[dict]]:
        """Per input the entries {class_id, class_name, logit, match, threshold} (ids: D + slot when
        enrolled; -1: none), only the matching ones with `matches_only`."""
        names, D = self.bundle.classes, self.num_classes
        return [[{"class_id": c, "class_name": str(names[c]) if c < D else snap.name(snap.position_of_id(c)),
                  "logit": v, "match": m, "threshold": t}
                 for c, v, m, t in zip(row_ids, row_z, row_m, row_t) if c >= 0 and (m or not matches_only)]
                for row_ids, row_z, row_m, row_t in zip(ids.tolist(), logits.tolist(), match.tolist(), thr.tolist())]

    async def topk_arrays(self, x: np.ndarray, k: int, mode: str, snap: Enrolled, finish=None,
                          embeddings: bool = False):
        """The k best (logits [n, k] float32, class ids [n, k]) per input, best first, by the pass over every
        row (exact) or the class index; `finish(logits, ids, h)` runs on them in the worker thread when
        given, h the inputs' embeddings [n, d] with `embeddings` (else None)."""
        finish = finish or (lambda logits, ids, h: (logits, ids))
        if mode == "exact" or self.index is None or self.index.reads_every_row:  # exact index: the same pass
            def reduce(acc: head_scan.TopK, h: Optional[np.ndarray] = None):  # streamed over all D + n_e logits
                require_finite(acc.finite)
                logits, cols = acc.result()
                return finish(logits[:, :k], _ids_of_columns(snap, cols[:, :k]), h)

            result = await self._submit(
                x, "logits", reduce, patience=self.scan_patience, snapshot=snap, embeddings=embeddings,
                accumulator=lambda n: head_scan.TopK(n, k + self.head_pass.topk_extra))
        else:
            def reduce(found: tuple[np.ndarray, np.ndarray], h: Optional[np.ndarray] = None):  # (logits, ids) [n, K >= k]
                logits, ids = found
                return finish(finite_output(logits[:, :k]), ids[:, :k], h)

            # _index_search: the whole batch with the largest k, then the enrolled rows of the job's snapshot
            result = await self._submit(x, "index", reduce, snapshot=snap, k=k, embeddings=embeddings)
        return result

    async def single_logits(self, x: np.ndarray, ids: np.ndarray, snap: Optional[Enrolled] = None,
                            threshold: Optional[float] = None) -> tuple[np.ndarray, np.ndarray]:
        """KServe `<name>`: input i scored against class ids[i] only -> (logit [N] float32, match [N] bool).
        ids: trained ids, or enrolled ids of `snap` (checked by the caller with class_exists); `threshold`:
        the request's, for every class (as detect's)."""
        snap = snap if snap is not None else self.classes.snapshot()
        cal = self.classes.calibration  # read once
        decide = self._decider(snap, cal, threshold)
        trained = ids < self.num_classes
        if trained.all():
            rows = self.classes.weight[ids].astype(np.float64)  # [N, d]: N rows of the head, not D
            b = self.classes.bias[ids].astype(np.float64)
            thr = cal.of_classes(ids)  # [N] threshold_of's rule
        else:
            rows, b, thr = self.classes.mixed_rows(ids, trained, snap, cal)
        thr = thr if threshold is None else np.full(len(ids), float(threshold))

        def reduce(h: np.ndarray):  # h [N, d]
            z = finite_output(np.vecdot(h.astype(np.float64), rows) + b)
            return z.astype(np.float32), decide(h, ids[:, None], z[:, None], thr[:, None])[:, 0]

        return await self._submit(x, "embed", reduce)

    async def all_logits(self, x: np.ndarray, snap: Optional[Enrolled] = None,
                         embeddings: bool = False) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """KServe `<name>-full`: (logits [N, D + n_e] float32, the enrolled classes' columns after the D
        trained ones, in id order, written chunk by chunk into the answer; with `embeddings` the inputs'
        h [N, d] too, else None). `snap`: the request's."""
        snap = snap if snap is not None else self.classes.snapshot()

        def reduce(acc: head_scan.AllLogits, h: Optional[np.ndarray] = None):
            require_finite(acc.finite)
            return acc.result(), None if h is None else np.array(h)

        return await self._submit(x, "logits", reduce, patience=self.scan_patience, snapshot=snap, embeddings=embeddings,
                                  accumulator=lambda n: head_scan.AllLogits(n, self.num_classes + snap.n))

    # ------------------------------------------------------------------ enrolled classes
    async def enroll(self, name: str, x: np.ndarray, add: bool = False) -> tuple[dict, bool]:
        """Create or replace the class `name` from the examples x [n, *input_shape], or with `add`, add
        them to its examples (the row made again from all of them): (its answer, created). Answered
        once the class is committed to the store and in this process's snapshot."""
        try:
            self.bundle.class_id(name)
            raise Conflict(f"{name!r} names a class of the bundle; an enrolled class needs a new name" if not add else
                           f"{name!r} is a class of the bundle (its row is trained); examples are added to enrolled "
                           "classes only", code="class_exists")
        except KeyError:
            pass
        check_name(name)
        if len(x) > self.settings.max_class_examples:
            raise InvalidInput(f"{len(x)} examples; a class is made from at most {self.settings.max_class_examples} "
                               "(SLC_MAX_CLASS_EXAMPLES)", code="too_many_examples")
        h, seen, found = await self._resembled(x, name)  # before the write: a refusal writes nothing
        try:
            if add:
                answer, created = await self._gallery(self.enrolled.add, name, h, found, 3, self.classes.rival)
            else:  # the rule (the first call measures the trained rows), its threshold for the pairs it will have
                row = await self._gallery(self.enrolled.compute, h, self.classes.rival(found))
                answer, created = await self._gallery(self.enrolled.put, name, row, h, None, found)
        except LimitReached as exc:
            raise InsufficientStorage(f"{exc}; delete an enrolled class or raise the limit", code="enrolled_limit") from None
        return {**answer, "lookalike_names": self._names(answer["lookalikes"]), **seen}, created

    def _names(self, ids) -> list:
        """The names of class ids, as this process serves them now (None: an id no longer served)."""
        snap = self.classes.snapshot()
        return [self.classes.name_of(c, snap) if c < self.num_classes or snap.position_of_id(c) is not None else None
                for c in ids]

    async def _resembled(self, x: np.ndarray, name: str) -> tuple[np.ndarray, dict, tuple[int, ...]]:
        """One exact top-k pass over the examples x (their embeddings come with it): (h [n, d], the answer's
        `matched_by` and `matched_by_complete`, the look-alikes to store). matched_by: the other classes
        whose own threshold says yes to some example, as they stand before this write. Look-alikes
        (serving/core/lookalikes.py): all of them, and each example's closest trained class and closest
        other enrolled class."""
        snap, cal = self.classes.snapshot(), self.classes.calibration
        total = self.num_classes + snap.n
        k, lowest, own = min(MATCHED_BY_K, total), open_set.lowest_threshold(cal, snap), snap.find(name)
        own = None if own is None else int(snap.ids_of_positions(own))

        def finish(logits: np.ndarray, ids: np.ndarray, h: np.ndarray):  # [n, k] each; h [n, d]
            thr = open_set.thresholds_of(cal, snap, ids, None)
            said_yes = (logits.astype(np.float64) >= thr) & (ids >= 0) & (ids != own)  # [n, k]
            complete = all(open_set.complete_rows(logits, ids, lowest, k >= total))
            D = self.num_classes
            closest = [[*row[(row >= 0) & (row < D)][:1], *row[(row >= D) & (row != own)][:1]]  # best trained, enrolled
                       for row in ids]  # ids [n, k] best first (-1: none)
            return np.array(h, dtype=np.float32), ids, thr, said_yes, complete, closest

        h, ids, thr, said_yes, complete, closest = await self.topk_arrays(x, k, "exact", snap, finish, embeddings=True)
        counts: dict[int, dict] = {}
        for c, t in zip(ids[said_yes].tolist(), thr[said_yes].tolist()):
            e = counts.setdefault(c, {"class_id": c, "class_name": self.classes.name_of(c, snap), "examples": 0,
                                      "threshold": t})
            e["examples"] += 1
        by = sorted(counts.values(), key=lambda e: (-e["examples"], e["class_id"]))
        found = set(counts) | {int(c) for row in closest for c in row}
        return h, {"matched_by": by, "matched_by_complete": complete}, tuple(sorted(found))

    async def unenroll(self, ref: str) -> int:
        """Delete an enrolled class by name or id; its id. Trained classes are part of the bundle: 409."""
        try:
            self.bundle.class_id(ref)
            raise Conflict(f"{ref!r} is a class of the bundle, which cannot be deleted (only enrolled classes can)",
                           code="trained_class")
        except KeyError:
            pass
        # by the store, not this snapshot (another replica's may be newer): an id deletes exactly its slot
        found = None if self.enrolled is None else await self._gallery(self.enrolled.delete, ref,
                                                                         nothing="nothing was deleted")
        if found is None and (bad := refused_character(ref)):  # no class can have it: the name is wrong
            raise InvalidInput(f"the class name {shown(ref)} holds {bad}, which no class name holds",
                               code="invalid_class_name")
        if found is None:  # no such live class: never enrolled, retired, or deleted meanwhile
            raise NotFound(f"unknown class {ref!r} (no live enrolled class has this name or id)", code="unknown_class")
        return found

    async def enrolled_classes(self) -> dict:
        """GET /v1/classes: the served ones, and what the store holds that is not served, and why."""
        snap = self.classes.snapshot()
        return {"count": snap.n, "limit": self.settings.max_enrolled_classes,
                "classes": [snap.describe(i) for i in range(snap.n)],
                "not_served": self.enrolled.not_served() if self.enrolled is not None else []}

    # ------------------------------------------------------------------ gallery
    async def off_loop(self, fn, *args):
        """fn(*args) on the gallery's own executor (parsing and serialising gallery bodies)."""
        return await self.gallery_pool.run(fn, *args)

    async def _gallery(self, method, *args, nothing: str = "nothing was written"):
        """gallery.<method>(*args) (or method(*args) when it is a function) on the gallery's executor;
        storage errors become the envelope's 507 / 503."""
        fn = getattr(self.gallery, method) if isinstance(method, str) else method
        if self.closed:
            raise NotReady(f"the model {self.name!r} was unloaded")
        self.active += 1
        try:
            return await self.gallery_pool.run(fn, *args)
        except StorageFull as exc:
            raise InsufficientStorage(f"{exc}; {nothing}, retry once space is freed") from None
        except StoreUnavailable as exc:
            raise StoreDown(f"{exc}; {nothing}; reads still answer, retry later") from None
        except GalleryUnavailable as exc:
            raise GalleryDown(f"{exc}; retry") from None
        finally:
            self.active -= 1

    async def gallery_upsert(self, items: list[dict], x: np.ndarray) -> list[str]:
        """Embed the items' inputs x [N, *input_shape] (checked: serving/codecs/gallery_bodies.py) and store them."""
        from serving.gallery import GalleryRecord

        h = await self._submit(x, "embed", lambda rows: finite_output(np.array(rows, np.float32)))
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
        snap, cal = cls.enrolled or self.classes.snapshot(), self.classes.calibration  # read once
        w64, b, thr, _, _ = self.classes.row_of(cls, cal)
        thr = thr if threshold is None else float(threshold)
        w = w64.astype(np.float32)  # [d]
        gallery = self.gallery
        rivals = None
        if len(others := self.classes.lookalikes(cal, snap).of(j)):  # its look-alikes: [W_r, b_r] [r, d + 1], t_r [r]
            rows, bias = self.classes.rows_of_ids(others, snap)
            rivals = (np.hstack([rows, bias[:, None]]), open_set.thresholds_of(cal, snap, others, threshold))

        def answer() -> bytes:
            hits = gallery.search_raw(w, b, thr, limit, rivals)
            head = orjson.dumps({"class_id": j, "class_name": cls.name, "threshold": thr})[:-1]
            results = b",".join(b"".join((b'{"id":', orjson.dumps(i), b',"logit":', orjson.dumps(z),
                                          b',"metadata":', m.encode(), b"}")) for i, z, m in hits)
            return b"".join((head, b',"results":[', results, b"]}"))

        return await self._gallery(answer)

    async def gallery_info(self) -> dict:
        gallery = self.gallery
        count = await self._gallery("count")
        return {"count": int(count), "index_kind": str(gallery.index_kind)}


_NONE = empty_snapshot(0, 0)


def _snapshot_of(job: Job) -> Enrolled:
    """The enrolled snapshot of a pass job (none for jobs that do not read one)."""
    return job.snapshot or _NONE


def _ids_of_columns(snap: Enrolled, cols: np.ndarray) -> np.ndarray:
    """Class ids of a pass's columns [n, k]: trained columns are ids, column D + i is the i-th enrolled class."""
    D = snap.num_trained
    if not snap.n or not (cols >= D).any():
        return cols
    return np.where(cols >= D, snap.ids_of_positions(np.clip(cols - D, 0, snap.n - 1)), cols)


def _merge_enrolled(snap: Enrolled, h: np.ndarray, logits: np.ndarray, ids: np.ndarray, k: int,
                    gemm: head_scan.Gemm | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The class index's top-K of the trained rows merged with an exact scan of the enrolled rows
    (n_e is small beside D; by `gemm`, HeadPass.small_gemm): h [m, d], logits / ids [m, K] -> [m, K']
    best first, float64 logits rounded."""
    from serving.core.class_index import exact_topk, rescore

    bad = ~np.isfinite(logits).all(axis=1)
    _, cand = exact_topk(snap.weight, snap.bias, h, min(k + 16, snap.n), gemm=gemm)  # positions [m, R]
    z = rescore(snap.weight, snap.bias, h, cand)  # [m, R] exact, float32
    all_z = np.concatenate([np.asarray(logits, dtype=np.float32), z], axis=1)
    all_ids = np.concatenate([ids, snap.ids_of_positions(cand)], axis=1)
    order = np.lexsort((all_ids, -all_z), axis=1)[:, :max(k, 1)]
    out_z, out_ids = np.take_along_axis(all_z, order, 1), np.take_along_axis(all_ids, order, 1)
    out_z[bad] = np.nan  # its job's reduce answers 422 non_finite_output
    return out_z, out_ids
