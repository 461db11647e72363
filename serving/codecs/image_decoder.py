"""Image bodies decoded under a budget of their own (SLC_DECODE_* in docs/configuration.md).

Decoders are C code: a thread running one cannot be stopped, and a crafted file can keep one busy
for minutes. So the server decodes in a few worker processes (serving/codecs/image_worker.py), started
with an image bundle and stopped with the server. Each has a feeder thread here (never the event
loop, never the default thread pool the gallery uses) that hands it one body at a time and waits
at most `decode_budget_s` for the answer. Past it, the process is killed (SIGKILL), the request
gets 422 `image_decode_timeout` and a new process takes the place of the old. A request cancelled
while its body is being decoded (its deadline passed, its client left) kills that decode the same
way. Bodies waiting for a worker are bounded: beyond `decode_queue` of them, 429 `overloaded`.

A process that dies while decoding (killed from outside, out of memory) is the server's fault, not
the body's: the body has passed the byte checks, and an image that fails to decode on its own is
answered by the process (422). So the body is decoded once more, by a fresh process; when that one
dies too, the request gets 503 `decoder_crashed` with Retry-After. A decode that raises MemoryError is
the server's want too (the body is within the pixel limit): 503 `decoder_unavailable` with Retry-After,
and the process is replaced.

Small images never wait behind large ones: a body of at most LIGHT_PIXELS by its header goes
first, and larger ones (or ones whose header cannot be read cheaply) decode on all workers but
one; a large one that would not be decoded before the request deadline (at the recent pace, per
pixel, of large ones, and the pixels of those ahead of it) is refused at once with 429 instead of
a 504 later. A body whose header declares more pixels than the limit can never be decoded: 413
`image_too_large` before it is queued or paced (a 429 would tell its client to retry it).

The processes are started with subprocess (fork + exec of a fresh interpreter), never by a bare
fork of the server, whose threads may hold locks.
"""
from __future__ import annotations

import asyncio
import atexit
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
import struct
from multiprocessing.connection import Connection
from collections import deque
from pathlib import Path
from typing import Optional

import numpy as np

from serving.codecs import images
from serving.codecs.image_worker import OUT_OF_MEMORY
from serving.bundle.image import MAX_PIXELS, header_pixels
from serving.errors import InvalidInput, NotReady, Overloaded, PayloadTooLarge

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a worker's interpreter and imports (about 0.2 s on an idle core)
WORKER_MODULE = "serving.codecs.image_worker"  # what each worker process runs (`python -m`)
PIPE_BYTES = 1 << 20
# A body of at most this many pixels by its header (1024 x 1024) is "light": it never waits behind
# larger ones (or ones whose header says nothing), which decode on all workers but one.
LIGHT_PIXELS = 1 << 20
# A heavy body is refused (429) when the heavy ones ahead of it and itself would take more than this
# share of the request deadline, at RATE (seconds per pixel; before any is measured: the prior, about
# the slowest legitimate format's, so that the first estimates err long rather than short).
DEADLINE_SHARE = 0.8
RATE_PRIOR = 50e-9
HEADER_MAX_BYTES = 64 * 1024  # of a worker's answer header (the example's bytes: at most its size)
CRASH_RETRY_AFTER_S = 1
_CRASHED = object()  # what _decode returns when the process died mid-decode


class _Job:
    """One body on its way through a worker; `cancel` (on the loop) skips or kills it."""

    __slots__ = ("request", "body", "shape", "pixels", "heavy", "loop", "future", "worker", "cancelled")

    def __init__(self, request: bytes, body: bytes, shape: tuple[int, ...], pixels: int,
                 loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.request, self.body, self.shape = request, body, shape
        self.pixels, self.heavy = pixels, pixels > LIGHT_PIXELS  # pixels: by its header (the limit when unknown)
        self.loop, self.future = loop, future
        self.worker: Optional[_Worker] = None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True  # a feeder that has not taken it yet skips it
        worker = self.worker
        if worker is not None:
            worker.kill_if_running(self)

    def settle(self, result) -> None:
        """Hand the answer (a tuple, or an exception) to the waiting request."""
        def deliver():
            if not self.future.done():
                if isinstance(result, BaseException):
                    self.future.set_exception(result)
                else:
                    self.future.set_result(result)
        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop is closed: nobody is waiting
            pass


class _Lanes:
    """The bodies waiting for a worker, in two lanes: light ones first, and at most `heavy_slots`
    heavy ones decoding at once, so that a worker is left for light ones however many heavy ones wait."""

    def __init__(self, heavy_slots: int):
        self.cond = threading.Condition()
        self.light: deque[_Job] = deque()
        self.heavy: deque[_Job] = deque()
        self.heavy_slots, self.heavy_running = heavy_slots, 0
        self.heavy_pixels = 0  # of the heavy bodies waiting or decoding
        self.rate = RATE_PRIOR  # seconds per pixel of recent heavy decodes (moving average)
        self.closed = False

    def put(self, job: _Job) -> None:
        with self.cond:
            (self.heavy if job.heavy else self.light).append(job)
            self.heavy_pixels += job.pixels if job.heavy else 0
            self.cond.notify()

    def take(self) -> Optional[_Job]:
        """The next body for a free worker (waits for one); None once closed."""
        with self.cond:
            while not self.closed:
                if self.light:
                    return self.light.popleft()
                if self.heavy and self.heavy_running < self.heavy_slots:
                    self.heavy_running += 1
                    return self.heavy.popleft()
                self.cond.wait()
            return None

    def done(self, job: _Job, seconds: Optional[float]) -> None:
        """A taken body is finished (`seconds` None: skipped, cancelled while waiting)."""
        if job.heavy:
            with self.cond:
                self.heavy_running -= 1
                self.heavy_pixels -= job.pixels
                if seconds is not None:
                    self.rate = 0.8 * self.rate + 0.2 * seconds / max(job.pixels, 1)
                self.cond.notify()

    def heavy_wait(self, pixels: int) -> float:
        """About how long until a heavy body of `pixels` admitted now is decoded (those ahead of it
        counted whole, as if none had started)."""
        return (self.heavy_pixels / self.heavy_slots + pixels) * self.rate

    def close(self) -> list[_Job]:
        """No more bodies taken; those still waiting are returned."""
        with self.cond:
            self.closed = True
            rest = [*self.light, *self.heavy]
            self.light.clear()
            self.heavy.clear()
            self.cond.notify_all()
        return rest


class _Worker:
    """One decode process and the thread that feeds it."""

    def __init__(self, pool: "DecodePool", index: int):
        self.pool = pool
        self.proc: Optional[subprocess.Popen] = None
        self.rd: Optional[Connection] = None
        self.wr: Optional[Connection] = None
        self.lock = threading.Lock()
        self.current: Optional[_Job] = None
        self.doomed = False  # its process was killed for a cancelled job: replace before the next
        self.ready = threading.Event()
        self.header_buf = bytearray(HEADER_MAX_BYTES)
        self.thread = threading.Thread(target=self._run, name=f"slc-decode-{index}", daemon=True)

    # ----------------------------------------------------------------- the process
    def spawn(self) -> None:
        """A fresh process, back once it has said it is ready (imports done); RuntimeError otherwise."""
        try:
            rd, wr, proc = _start_process()
        except OSError as exc:  # out of processes or file descriptors
            raise RuntimeError(f"an image decode worker could not be started ({exc})") from None
        with self.lock:
            self.proc, self.rd, self.wr, self.doomed = proc, rd, wr, False
        try:
            if not rd.poll(START_TIMEOUT_S):
                raise TimeoutError(f"no answer in {START_TIMEOUT_S:g} s")
            rd.recv_bytes()
        except (EOFError, OSError, TimeoutError) as exc:
            self.reap()
            raise RuntimeError(f"an image decode worker did not start ({exc})") from None

    def kill(self) -> None:
        with self.lock:
            if self.proc is not None:
                _kill(self.proc)

    def kill_if_running(self, job: _Job) -> None:
        with self.lock:
            if self.current is job and self.proc is not None:
                self.doomed = True
                _kill(self.proc)

    def reap(self) -> None:
        """Kill the process (if still there) and release its pipes."""
        with self.lock:
            proc, rd, wr, self.proc, self.rd, self.wr = self.proc, self.rd, self.wr, None, None, None
        if proc is not None:
            _kill(proc)
            proc.wait()
        for conn in (rd, wr):
            if conn is not None:
                conn.close()

    # ----------------------------------------------------------------- the feeder thread
    def _run(self) -> None:
        self._replace()
        self.ready.set()
        lanes = self.pool.lanes
        while (job := lanes.take()) is not None:
            with self.lock:
                skip = job.cancelled
                if not skip:
                    self.current, job.worker = job, self
            if skip:
                lanes.done(job, None)
                continue
            t0 = time.perf_counter()
            try:
                result = self._answer(job)
            except Exception as exc:  # noqa: BLE001 - a bug here must not take the feeder thread down
                log.exception("image decode feeder")
                result = exc
            finally:
                with self.lock:
                    self.current, doomed = None, self.doomed
            lanes.done(job, time.perf_counter() - t0)
            job.settle(result)
            if doomed or self.proc is None or self.proc.poll() is not None or _out_of_memory(result):
                self._replace()  # after a MemoryError too: a fresh heap, not a fragmented one
        self.reap()

    def _replace(self) -> None:
        """A new process in place of the old one (none once the pool is closed)."""
        self.reap()
        if self.pool.closed:
            return
        try:
            self.spawn()
        except RuntimeError as exc:
            if not self.pool.closed:
                log.error("%s", exc)

    def _answer(self, job: _Job):
        """`_decode`, once more on a fresh process when the process died mid-decode: a death (a kill, the OOM
        killer) is the server's failure, not the body's, which passed the byte checks. Once only: a body that
        kills every decoder costs two processes, then 503 with Retry-After."""
        result = self._decode(job)
        if result is _CRASHED and not job.cancelled:
            log.warning("decoding the %d-byte body once more, on a fresh worker", len(job.body))
            result = self._decode(job)  # it starts the fresh process
        if result is _CRASHED:
            return NotReady("the image decoder process died while decoding the body, twice (a server-side "
                            "failure, not the image's); retry", code="decoder_crashed", retry_after=CRASH_RETRY_AFTER_S)
        return result

    def _decode(self, job: _Job):
        """(header, example, its size in bytes) from the process, or the exception for the request, or _CRASHED
        when the process died decoding it; never raises."""
        if self.pool.closed:
            return NotReady("the server is shutting down")
        if self.proc is None or self.proc.poll() is not None:  # never started, or died while idle
            self._replace()
            if self.proc is None:
                return NotReady("no image decode worker could be started; retry")
        budget = self.pool.budget_s
        try:
            self.wr.send_bytes(job.request)
            self.wr.send_bytes(job.body)
            if self.rd.poll(budget):
                fd = self.rd.fileno()
                header = json.loads(bytes(_read_frame(fd, self.header_buf)))
                out = np.empty(job.shape, np.float32)  # the example is read straight into it
                size = len(_read_frame(fd, out.reshape(-1).view(np.uint8)))
                return header, out, size
        except (EOFError, OSError, ValueError):
            if job.cancelled or self.pool.closed:
                return NotReady("the request was cancelled, or the server is shutting down")
            self.pool.crashes += 1
            log.warning("an image decode worker died decoding a body of %d bytes; replaced", len(job.body))
            self.reap()
            return _CRASHED
        self.reap()  # past the budget: SIGKILL, the only way to stop a decoder
        self.pool.kills += 1
        log.warning("an image decode of a %d-byte body ran past its %g s budget: worker killed", len(job.body), budget)
        return InvalidInput(f"the image took more than {budget:g} s to decode (SLC_DECODE_BUDGET_S): "
                            "it was stopped", code="image_decode_timeout")


def _out_of_memory(result) -> bool:
    """A worker's answer that its decode ran out of memory (image_worker.refusal)."""
    return isinstance(result, tuple) and result[0].get("code") == OUT_OF_MEMORY


def _read_frame(fd: int, buffer) -> memoryview:
    """One frame of Connection.send_bytes (a 4-byte big-endian size, then the bytes) read from `fd`
    into `buffer`: the part of it filled. Connection.recv_bytes_into would read into a BytesIO first
    and copy (0.7 ms for a 224x224x3 example against 0.13 ms here). OSError when larger than `buffer`."""
    (size,) = struct.unpack("!i", _read_exact(fd, memoryview(bytearray(4))))
    if not 0 <= size <= len(buffer):
        raise OSError(f"a decode worker sent a frame of {size} bytes, more than {len(buffer)}")
    return _read_exact(fd, memoryview(buffer)[:size])


def _read_exact(fd: int, view: memoryview) -> memoryview:
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError("the decode worker closed its pipe")
        got += n
    return view


def _start_process() -> tuple[Connection, Connection, subprocess.Popen]:
    """`python -m WORKER_MODULE R W` on two new pipes: (its answers, its requests, the process)."""
    child_rd, parent_wr = os.pipe()
    parent_rd, child_wr = os.pipe()
    for fd in (child_rd, parent_rd):
        _widen(fd)
    try:
        proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(child_rd), str(child_wr)],
                                pass_fds=(child_rd, child_wr), stdin=subprocess.DEVNULL, env=_worker_env())
    except OSError:
        os.close(parent_rd)
        os.close(parent_wr)
        raise
    finally:
        os.close(child_rd)
        os.close(child_wr)
    return Connection(parent_rd, writable=False), Connection(parent_wr, readable=False), proc


def _widen(fd: int) -> None:
    """A pipe of PIPE_BYTES (Linux; default 64 KiB): a 224x224x3 example crosses in one write, not ten."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size: the default
        pass


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def _worker_env() -> dict:
    """The server's environment; one thread per numeric library; this checkout importable."""
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds serving/
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (path, root) if p)}


class DecodePool:
    """`workers` decode processes, `queue_limit` bodies waiting beyond them, `budget_s` per decode."""

    def __init__(self, workers: int, queue_limit: int, budget_s: float, max_pixels: int = MAX_PIXELS,
                 deadline_s: Optional[float] = None):
        self.budget_s, self.queue_limit, self.max_pixels, self.deadline_s = budget_s, queue_limit, max_pixels, deadline_s
        self.lanes = _Lanes(heavy_slots=max(1, workers - 1))
        self.workers = [_Worker(self, i) for i in range(workers)]
        self.pending = 0  # jobs admitted and not yet answered (changed on the event loop only)
        self.closed = False
        self.kills = self.crashes = 0
        self.started_s: Optional[float] = None
        self._settings = None  # the server settings it belongs to (pool_for)

    def start(self) -> "DecodePool":
        """Start every worker (in parallel, in their feeder threads); `wait_ready` waits for them."""
        self._t0 = time.perf_counter()
        for w in self.workers:
            w.thread.start()
        return self

    def is_ready(self) -> bool:
        return all(w.ready.is_set() for w in self.workers)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every worker has started (or failed to); RuntimeError when none could."""
        for w in self.workers:
            w.ready.wait(timeout)
        self.started_s = time.perf_counter() - self._t0
        if not any(w.proc is not None for w in self.workers):
            raise RuntimeError("no image decode worker could be started (see the log)")

    def pids(self) -> list[Optional[int]]:
        """The workers' process ids (None while one is being replaced)."""
        return [w.proc.pid if w.proc is not None else None for w in self.workers]

    async def decode(self, body: bytes, content_type: bytes, spec: Optional[dict], input_shape: tuple[int, ...]
                     ) -> np.ndarray:
        """One example float32 [*input_shape] from an image body; 415 / 413 / 422 / 429 / 503 as the envelope."""
        fmt = images.image_format(content_type, spec)  # 415 before anything is queued
        declared = header_pixels(body)
        if declared is not None and declared > self.max_pixels:  # never decodable: 413 now, not 429 "retry"
            raise PayloadTooLarge(f"the image's header declares {declared:,} pixels; the limit is {self.max_pixels:,}",
                                  code="image_too_large")
        if self.closed:
            raise NotReady("the server is shutting down")
        if self.pending >= len(self.workers) + self.queue_limit:
            raise Overloaded(f"{self.pending} image bodies are being decoded or waiting (SLC_DECODE_QUEUE); retry", 1)
        pixels = declared or self.max_pixels  # unknown: as large as allowed
        limit = DEADLINE_SHARE * (self.deadline_s or math.inf)
        if pixels > LIGHT_PIXELS and (wait := self.lanes.heavy_wait(pixels)) > limit:
            raise Overloaded(f"the large images queued for decoding would take about {wait:.1f} s with this one, "
                             f"past the request deadline of {self.deadline_s:g} s; retry", math.ceil(wait - limit))
        loop = asyncio.get_running_loop()
        request = json.dumps({"format": fmt, "spec": spec, "max_pixels": self.max_pixels}).encode()
        job = _Job(request, body, tuple(input_shape), pixels, loop, loop.create_future())
        self.pending += 1
        try:
            self.lanes.put(job)
            header, out, size = await job.future
        except asyncio.CancelledError:
            job.cancel()
            raise
        finally:
            self.pending -= 1
        if not header.get("ok"):
            raise images.refusal_error(str(header["kind"]), str(header["code"]), str(header["message"]))
        return _example(header, out, size)

    def stop(self) -> None:
        """Kill every worker; queued bodies get 503; the feeder threads end."""
        self.closed = True
        for job in self.lanes.close():
            job.settle(NotReady("the server is shutting down"))
        for w in self.workers:
            w.kill()  # each feeder thread releases its own pipes
        for w in self.workers:
            if w.thread.is_alive():
                w.thread.join(10)


def _example(header: dict, out: np.ndarray, size: int) -> np.ndarray:
    """The example received into `out` [*input_shape], in the worker's shape (the spec's layout)."""
    shape = tuple(int(s) for s in header["shape"])
    if math.prod(shape) != out.size or size != out.nbytes:
        raise InvalidInput(f"the image decoded to {list(shape)}, not the bundle's input {list(out.shape)}",
                           code="invalid_image")
    return out.reshape(shape)


# ------------------------------------------------------------------------- one pool per server
_POOLS: dict[int, DecodePool] = {}


def pool_for(settings) -> DecodePool:
    """The pool of the server with these settings; one started here (and stopped at exit) when the
    server did not start one (an engine used without the app)."""
    pool = _POOLS.get(id(settings))
    if pool is None:
        pool = _POOLS[id(settings)] = _new_pool(settings).start()
        pool._settings = settings  # keeps id(settings) from being reused while registered
        atexit.register(pool.stop)
    return pool


def current(settings) -> Optional[DecodePool]:
    """The pool of the server with these settings, if one was started."""
    return _POOLS.get(id(settings))


def _new_pool(settings) -> DecodePool:
    return DecodePool(settings.decode_workers, settings.decode_queue, settings.decode_budget_s,
                      deadline_s=settings.request_timeout_s)


async def start(settings) -> DecodePool:
    """Start the decode workers of a server and wait until they are ready."""
    pool = pool_for(settings)
    deadline = time.perf_counter() + START_TIMEOUT_S
    while not pool.is_ready() and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    pool.wait_ready(0)
    log.info("image decoding: %d worker processes ready in %.2f s (budget %g s per image, %d may wait)",
             len(pool.workers), pool.started_s, pool.budget_s, pool.queue_limit)
    return pool


def stop(settings) -> None:
    """Stop the decode workers of a server, if it has any."""
    pool = _POOLS.pop(id(settings), None)
    if pool is not None:
        pool.stop()
        atexit.unregister(pool.stop)


async def decode(settings, body: bytes, content_type: bytes, spec: Optional[dict], input_shape: tuple[int, ...]
                 ) -> np.ndarray:
    """One example float32 [*input_shape] from an image body, decoded by the server's workers."""
    if spec is None:
        images.image_format(content_type, spec)  # 415 for a JSON-only bundle: no worker needed
    return await pool_for(settings).decode(body, content_type, spec, input_shape)
