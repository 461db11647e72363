"""Dynamic batching: concurrent requests coalesce into one backbone call.

A request's inputs wait in a bounded queue (counted in inputs) until either `max_batch`
inputs are waiting or the oldest has waited `max_delay_ms`; then the batch runs in a worker
thread, so the event loop never blocks on onnxruntime or BLAS (except for a batch that only
needs the backbone and whose measured cost is under `inline_max_s`: it runs on the loop, as the
hop to the thread and back costs the loop more than such a batch). A full queue refuses at once
(Overloaded -> 429 + Retry-After; models sharing the queue each keep a reserve of it, `_room`, and
batches take their jobs in turn, `_take_in_turn`);
a request whose deadline passes while it waits is answered
504 and never computed, and one that gives up leaves the queue at once. A batch is handed to its
worker thread as soon as it is taken, before the loop answers the batch that just finished; and
while a pass computes, a full batch of passes waiting behind it is handed to the same worker at
once, which starts it the moment the pass ends, without a word from the loop.

Up to `lanes` batches compute at once, each in a worker thread of its own. Backbone-only jobs
(detect, v2 single logits) are batched apart from passes over the head and index searches, and
start beside a running pass instead of waiting for it (a pass at D = 10^6 takes a third of a
second); such a batch is told so (`compute(jobs, shared=True)`) and uses one thread. Passes and
index searches still compute one at a time, with every thread: two one-thread passes side by
side were no faster on two cores and held a second set of buffers.

What a batch computes is given by `compute(jobs, shared) -> list[result]`: the engine runs
the backbone once over all inputs and then each job's own (cheap) head step, so the batcher
stays ignorant of models.
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from serving.errors import DeadlineExceeded, Overloaded

log = logging.getLogger(__name__)

INLINE_PROBE_EVERY = 32  # worker batches of one size between two measurements of it on the loop
INLINE_PROBE_SPAN = 4.0  # only sizes whose cost is within this factor of the inline bound are probed


@dataclass
class JobFailed:
    """compute's result for one job that failed on its own (its error is that request's answer)."""

    error: Exception


@dataclass(eq=False)  # a job is itself (its queue is searched by identity)
class Job:
    """One request's share of a batch: inputs x [n, ...], its kind, its parameters and what to do with its rows."""

    x: np.ndarray
    kind: str  # "embed" (rows of h), "logits" (a pass over all D classes) or "index" (class-index top-k)
    reduce: Optional[Callable[[Any], Any]] = None  # runs in the worker thread on this job's rows (or accumulator)
    accumulator: Optional[Callable[[int], Any]] = None  # kind "logits": what the pass fills for this job's n rows
    snapshot: Any = None  # the enrolled classes the request started with (passes and index searches read them)
    k: int = 1  # kind "index": how many classes the request asks for
    embeddings: bool = False  # kinds "logits" / "index": reduce(rows, h) with the inputs' embeddings h [n, d] too
    owner: Any = None  # the model (engine) whose head this job is for, on a backbone lane shared by several
    patience: float = 0.0  # seconds it may wait for batch-mates (beyond max_delay) while others are on their way
    deadline: float = math.inf  # loop.time()
    enqueued: float = 0.0
    future: Optional[asyncio.Future] = field(default=None, repr=False)
    taken: bool = False  # left the queue (into a batch, or dropped there)

    @property
    def embed(self) -> bool:
        """Backbone-only: batched apart from passes and index searches when there are two lanes."""
        return self.kind == "embed"

    @property
    def n(self) -> int:
        return int(self.x.shape[0])


class Worker:
    """One thread that runs calls in order: a SimpleQueue in, `call_soon_threadsafe` out. The hop is
    paid on every batch; this one costs the event loop about half of a ThreadPoolExecutor's future chain."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, fn, args))
        return future

    def shutdown(self) -> None:
        self._calls.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, future, fn, args = call
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # the caller's to handle, as an executor would pass it on
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop closed while this ran: nobody waits for it
                pass


def _settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    if future.done():  # cancelled: its request gave up
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Batcher:
    def __init__(self, compute: Callable[[list[Job]], list[Any]], *, max_batch: int = 64, max_delay_ms: float = 2.0,
                 queue_size: int = 1024, metrics=None, in_flight: Optional[Callable[[], int]] = None,
                 inline_max_s: float = 0.0, lanes: int = 1):
        self.compute = compute
        self.inline_max_s = inline_max_s
        self._embed_cost: dict[int, float] = {}  # batch size -> seconds of a backbone-only batch (moving average)
        self._inline_cost: dict[int, float] = {}  # the same, measured on the event loop only
        self._probes: dict[int, int] = {}  # batch size -> worker batches since its last inline probe
        # Requests inside the HTTP layer (serving/core/metrics.py). When every one of them already
        # holds a job here, nobody is on the way to join the batch and waiting would only add
        # latency, so the batch goes at once; None: always wait up to max_delay.
        self.in_flight = in_flight
        self._held = 0  # jobs queued or computing
        self.max_batch = max_batch
        self.max_delay = max_delay_ms / 1000.0
        self.queue_size = queue_size
        self.metrics = metrics
        self._jobs: deque[Job] = deque()
        self._pending_inputs = 0
        # models whose jobs share this queue (BackboneGroup sets it): above 1, each keeps a reserve of the
        # queue that the others cannot take (_room)
        self.sharers = 1
        self._owned: dict[int, int] = {}  # id(job.owner) -> its inputs in the queue
        self._queued = {True: 0, False: 0}  # backbone-only or not -> inputs in the queue (for Retry-After)
        self._wakeup: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._stopping = False
        # One worker thread per lane: a batch alone uses ORT's intra-op pool (every core); one
        # computing beside another is told to use one thread.
        self.lanes = max(1, int(lanes))
        self._workers = [Worker("slc-batch" + (f"-{i}" if i else "")) for i in range(self.lanes)]
        self._worker = self._workers[0]  # warm-up and calibration calls (run_sync)
        self._busy: dict[int, bool] = {}  # lane computing a batch now -> whether it is backbone-only
        self._staged: set[int] = set()  # lanes whose worker holds a next pass behind the one computing
        self._computing: set[asyncio.Task] = set()
        # for Retry-After (moving averages): inputs/s of backbone-only batches, whose cost grows with their
        # size, and seconds per batch of the others, a pass over the head costing the same for 1 input or 64
        self._embed_rate = 0.0
        self._pass_seconds = 0.0
        self._peak, self._peak_since = 0, -math.inf  # most requests in the server at once, this second

    # ---- lifecycle
    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="slc-batcher")

    async def stop(self) -> None:
        """Finish what is queued, then stop the loop and the worker thread."""
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            await self._task
        if self._computing:
            await asyncio.gather(*self._computing, return_exceptions=True)
        for worker in self._workers:
            worker.shutdown()

    @property
    def pending_inputs(self) -> int:
        return self._pending_inputs

    def run_sync(self, fn: Callable, *args) -> "asyncio.Future":
        """Run fn in the batch worker thread (warm-up, calibration of the softmax path)."""
        return self._worker.run(fn, *args)

    # ---- request side
    async def submit(self, x: np.ndarray, kind: str = "embed", reduce=None, timeout: Optional[float] = None,
                     accumulator=None, patience: float = 0.0, snapshot=None, k: int = 1, owner=None,
                     embeddings: bool = False) -> Any:
        """Queue x [n, ...]; returns reduce(rows) (or the rows). Raises Overloaded, or DeadlineExceeded
        when the job is still queued `timeout` s from now. The caller bounds its own wait (the
        routes' request deadline): a timer per request here would be paid twice."""
        if self._task is None or self._stopping:
            from serving.errors import NotReady

            raise NotReady("the server is shutting down")
        n = int(x.shape[0])
        if self._pending_inputs > 0 and self._pending_inputs + n > self._room(owner):
            raise Overloaded(f"queue full ({self._pending_inputs} inputs waiting, limit {self._room(owner)} "
                             f"for this model of {self.queue_size}); retry later", retry_after=self._retry_after())
        loop = asyncio.get_running_loop()
        now = loop.time()
        job = Job(x=x, kind=kind, reduce=reduce, accumulator=accumulator, patience=patience, enqueued=now,
                  snapshot=snapshot, k=k, owner=owner, embeddings=embeddings,
                  deadline=now + timeout if timeout is not None else math.inf, future=loop.create_future())
        self._jobs.append(job)
        self._note_concurrency(now)
        self._held += 1
        self._count(job, +1)
        self._gauge()
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:  # the request gave up (its deadline): out of the queue now
            if not job.taken:
                self._jobs.remove(job)
                self._left_queue(job)
                self._gauge()
                self._wakeup.set()  # a batch may be waiting on its behalf
            raise
        finally:
            self._held -= 1

    def _count(self, job: Job, sign: int) -> None:
        self._pending_inputs += sign * job.n
        self._queued[job.embed] += sign * job.n
        key = id(job.owner)
        left = self._owned.get(key, 0) + sign * job.n
        if left:
            self._owned[key] = left
        else:
            self._owned.pop(key, None)

    def reserve(self) -> int:
        """Inputs of the queue each model sharing it keeps for itself: none for one model; with several, so
        many that one model flooding the lane leaves every other one room (queue_size / (2 * sharers))."""
        return self.queue_size // (2 * self.sharers) if self.sharers > 1 else 0

    def _room(self, owner: Any) -> int:
        """How full the queue may be after `owner`'s job joins it: the queue less the part of the other
        models' reserves that they do not use now (one model: the whole queue)."""
        reserve = self.reserve()
        if not reserve:
            return self.queue_size
        mine = id(owner)
        used = sum(min(reserve, q) for key, q in self._owned.items() if key != mine)  # the others' reserves in use
        return self.queue_size - max(0, reserve * (self.sharers - 1) - used)

    def _left_queue(self, job: Job) -> None:
        job.taken = True
        self._count(job, -1)

    def _others_on_the_way(self) -> bool:
        return self.in_flight is None or self.in_flight() > self._held

    def _note_concurrency(self, now: float) -> None:
        """Keep the most requests seen inside the server at once over the last second."""
        if self.in_flight is None:
            return
        if now - self._peak_since > 1.0:
            self._peak, self._peak_since = 0, now
        self._peak = max(self._peak, self.in_flight())

    def _expected_requests(self, now: float) -> int:
        """How many requests a patient batch waits for: the recent peak of concurrent requests (1 for a
        lone client: no wait), at most what fits in a batch."""
        if self.in_flight is None or now - self._peak_since > 2.0:
            return 1
        return min(self._peak, self.max_batch)

    def _may_share(self, job: Job) -> bool:
        """Whether `job` may compute beside the batches computing now: a backbone-only one beside passes
        and index searches (beside another backbone-only batch it waits and joins the next, larger one);
        a pass or an index search never (each uses every thread)."""
        return job.embed and not any(self._busy.values())

    def _retry_after(self) -> int:
        """Seconds until the queue is worked off: the backbone-only inputs at their rate, plus a full batch's
        time for every max_batch of the other inputs (a pass over the head and a backbone batch differ a
        hundredfold at large D). What is not measured yet counts 1 s."""
        embed, other = self._queued[True], self._queued[False]
        seconds = (embed / self._embed_rate if self._embed_rate > 0 else 1.0) if embed else 0.0
        if other:
            seconds += math.ceil(other / self.max_batch) * (self._pass_seconds or 1.0)
        return max(1, math.ceil(seconds))

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._pending_inputs)

    # ---- batch loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._jobs:
                if self._stopping:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            if self._busy and (len(self._busy) >= self.lanes or self._first(True) is None):
                if self._stage_next_pass(loop):
                    continue
                self._wakeup.clear()  # set again by a new job or a lane that is done
                await self._wakeup.wait()
                continue
            if not await self._wait_for_batch_mates(loop, bool(self._busy)):
                continue  # the job it waited for gave up: the next one waits on its own terms
            shared = bool(self._busy)
            batch, size = self._take(shared)
            if not batch:
                continue
            if self._inline(batch, size):
                try:
                    results, elapsed = self._timed_compute(batch, shared)
                except Exception as exc:  # a bug in compute: fail these requests (500), keep serving
                    self._fail(batch, size, exc)
                    continue
                self._note_inline_cost(size, elapsed)
                self._deliver(batch, size, results, elapsed)
                continue
            lane = min(set(range(self.lanes)) - self._busy.keys())
            self._busy[lane] = all(job.embed for job in batch)
            self._hand_over(loop, lane, batch, size, shared)

    def _hand_over(self, loop, lane: int, batch: list[Job], size: int, shared: bool) -> None:
        """Into the lane's worker now: a task's first step would wait behind every callback already
        ready on the loop (after a pass, the answers of all its requests) and leave the worker idle."""
        computed = self._workers[lane].run(self._timed_compute, batch, shared)
        task = loop.create_task(self._finish_on(lane, batch, size, computed))
        self._computing.add(task)
        task.add_done_callback(self._computing.discard)

    def _stage_next_pass(self, loop) -> bool:
        """While a lane computes a pass and a full batch that may follow it waits (max_batch inputs of
        passes and index searches, or of anything with one lane), take that batch and queue it in the
        lane's worker behind the pass: the worker starts it the moment the pass ends. Otherwise the
        end of the pass reaches the batcher only some loop iterations later, behind the answers of
        the pass's requests and the new requests they bring: milliseconds of an idle worker per pass.
        One batch is staged per lane at most; a staged batch computes with every thread."""
        lane = next((i for i, embed in self._busy.items() if not embed and i not in self._staged), None)
        if lane is None:
            return False
        first = next((job for job in self._jobs if self.lanes == 1 or not job.embed), None)
        waiting = self._pending_inputs if self.lanes == 1 else self._queued[False]
        if first is None or waiting < self.max_batch:
            return False
        batch, size = self._take(first=first)
        if not batch:
            return True  # only expired or cancelled jobs: look again
        self._staged.add(lane)
        self._hand_over(loop, lane, batch, size, shared=False)
        return True

    def _first(self, shared: bool) -> Optional[Job]:
        """The job the next batch starts with: the oldest, or beside another batch the oldest that may
        compute beside it (None: none may)."""
        if not shared:
            return self._jobs[0] if self._jobs else None
        return next((job for job in self._jobs if self._may_share(job)), None)

    def _joins(self, first: Job, job: Job) -> bool:
        """Whether `job` may join the batch that starts with `first`. With one lane, any job. With
        more, backbone-only jobs are batched apart from passes and index searches, so that a detect
        never waits for a pass over the head."""
        return self.lanes == 1 or job.embed == first.embed

    async def _finish_on(self, lane: int, batch: list[Job], size: int, computed: asyncio.Future) -> None:
        try:
            results, elapsed = await computed
        except Exception as exc:  # a bug in compute: fail these requests (500), keep serving
            self._fail(batch, size, exc)
            return
        finally:
            if lane in self._staged:  # the batch staged behind this one computes now: the lane stays busy
                self._staged.discard(lane)
            else:
                self._busy.pop(lane, None)
            self._wakeup.set()  # the run loop may wait for a free lane
        self._deliver(batch, size, results, elapsed)

    def _fail(self, batch: list[Job], size: int, exc: Exception) -> None:
        log.error("batch of %d inputs failed", size, exc_info=exc)
        for job in batch:
            if not job.future.done():
                job.future.set_exception(exc)

    def _deliver(self, batch: list[Job], size: int, results: list[Any], elapsed: float) -> None:
        self._note_cost(batch, size, elapsed)
        for job, result in zip(batch, results):
            if not job.future.done():
                if isinstance(result, JobFailed):
                    job.future.set_exception(result.error)
                else:
                    job.future.set_result(result)

    def _timed_compute(self, batch: list[Job], shared: bool) -> tuple[list[Any], float]:
        started = time.perf_counter()
        results = self.compute(batch, shared)
        return results, time.perf_counter() - started

    def _inline(self, batch: list[Job], size: int) -> bool:
        """Compute on the event loop itself when the batch is backbone-only and its measured cost is
        under `inline_max_s`: the hop to the worker and back costs the loop more than such a batch,
        and the loop would sit idle meanwhile. Never a pass over the head or an index search."""
        if self.inline_max_s <= 0 or not all(job.embed for job in batch):
            return False
        cost = self._inline_cost.get(size, self._embed_cost.get(size))
        if cost is None:  # never measured: the worker measures it
            return False
        if cost <= self.inline_max_s:
            return True
        # measured on the worker while the loop took the other core, a cost can read above the bound
        # and would never be measured on the loop again: once in INLINE_PROBE_EVERY batches of that
        # size, a batch not far above the bound is computed on the loop to measure it there
        self._probes[size] = self._probes.get(size, 0) + 1
        if cost <= INLINE_PROBE_SPAN * self.inline_max_s and self._probes[size] >= INLINE_PROBE_EVERY:
            self._probes[size] = 0
            return True
        return False

    def _note_inline_cost(self, size: int, elapsed: float) -> None:
        old = self._inline_cost.get(size)
        self._inline_cost[size] = elapsed if old is None else 0.8 * old + 0.2 * elapsed

    def _note_cost(self, batch: list[Job], size: int, elapsed: float) -> None:
        embed = all(job.embed for job in batch)
        if elapsed > 0:
            if embed:
                rate = size / elapsed
                self._embed_rate = rate if self._embed_rate == 0 else 0.8 * self._embed_rate + 0.2 * rate
            else:
                old = self._pass_seconds
                self._pass_seconds = elapsed if old == 0 else 0.8 * old + 0.2 * elapsed
        if embed:
            old = self._embed_cost.get(size)
            self._embed_cost[size] = elapsed if old is None else 0.8 * old + 0.2 * elapsed
        if self.metrics is not None:
            self.metrics.batch_size.observe(size)
            self.metrics.batch_requests.observe(len(batch))
            self.metrics.batch_seconds.observe(elapsed)

    async def _wait_for_batch_mates(self, loop, shared: bool = False) -> bool:
        """Wait for more inputs until the batch is full or the oldest input's delay is used up.

        A costly job (a pass over all D classes: the same cost for 1 input or 64) waits up to its
        patience from now, when the worker is free, for as many requests as were recently in the
        server at once: the clients answered by the last batch are about to send again, though none
        has arrived yet; without the wait their requests split over two batches for good.
        """
        first = self._first(shared)
        if first is None:
            return True
        flush_at = first.enqueued + self.max_delay
        expected = self._expected_requests(loop.time()) if first.patience else 1
        if expected > 1:
            flush_at = max(flush_at, loop.time() + first.patience)

        def keep_waiting() -> bool:
            # every queued job counts, those of the other kind too: they wait behind this one, so
            # enough of them end its wait (it leaves with fewer mates rather than holding them up)
            if self._pending_inputs >= self.max_batch or self._stopping or first.taken:
                return False
            return len(self._jobs) < expected if expected > 1 else self._others_on_the_way()

        while keep_waiting():
            remaining = flush_at - loop.time()
            if remaining <= 0:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                break
        return not first.taken

    def _take(self, shared: bool = False, first: Optional[Job] = None) -> tuple[list[Job], int]:
        """Pop the jobs of the next batch, up to max_batch inputs (a larger single job goes alone),
        starting with `first` (else _first); drop the expired. Jobs that may not join it keep their
        place in the queue."""
        now = asyncio.get_running_loop().time()
        first = first or self._first(shared)
        if first is None:
            return [], 0
        if self.sharers > 1 and len(self._owned) > 1:  # several models have jobs waiting: in turn
            return self._take_in_turn(first, shared, now)
        batch: list[Job] = []
        size = 0
        passed: list[Job] = []  # jobs left for a later batch, in their order
        while self._jobs:
            job = self._jobs.popleft()
            if not self._joins(first, job) or shared and not self._may_share(job):
                passed.append(job)
                continue
            if batch and size + job.n > self.max_batch:
                self._jobs.appendleft(job)
                break
            if self._admit(job, now):
                batch.append(job)
                size += job.n
        self._jobs.extendleft(reversed(passed))
        self._gauge()
        return batch, size

    def _admit(self, job: Job, now: float) -> bool:
        """A job taken off the queue joins the batch unless it was cancelled or has expired (504)."""
        self._left_queue(job)
        if job.future.done():  # (a cancelled job left the queue when it was cancelled)
            return False
        if now >= job.deadline:
            job.future.set_exception(DeadlineExceeded("request expired in the queue before it was computed"))
            return False
        if self.metrics is not None:
            self.metrics.queue_wait.observe(now - job.enqueued)
        return True

    def _take_in_turn(self, first: Job, shared: bool, now: float) -> tuple[list[Job], int]:
        """_take for a lane several models share: the batch takes one job of each model in turn (each
        model's own in their order, `first`'s model first), so a model that queued a flood does not
        hold the others' jobs back for as many batches as its flood fills. One walk over the queue per
        batch, paid only while several models have jobs waiting."""
        mine: dict[int, deque] = {}
        for job in self._jobs:
            mine.setdefault(id(job.owner), deque()).append(job)
        turns = deque([mine.pop(id(first.owner))] + list(mine.values()))  # each model's jobs, oldest first
        batch, size, gone = [], 0, set()
        while turns:
            queue_of = turns.popleft()
            job = queue_of.popleft()
            if queue_of:
                turns.append(queue_of)
            if not self._joins(first, job) or shared and not self._may_share(job):
                continue
            if batch and size + job.n > self.max_batch:
                break
            gone.add(id(job))
            if self._admit(job, now):
                batch.append(job)
                size += job.n
        self._jobs = deque(job for job in self._jobs if id(job) not in gone)
        self._gauge()
        return batch, size
