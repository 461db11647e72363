"""The gallery's own bounded executor: every gallery database call, and the parsing and
serialising of gallery bodies, run on its threads, never on the event loop and never in the
default thread pool (which image decoding and other work share).

Bounded: at most `queue_size` calls waiting or running; one more is answered 429 with
Retry-After at once instead of queueing behind a stuck database. A call counts until its thread
is done with it, even when the request that made it has gone (deadline, client left), so a frozen
database fills the queue and then only gallery routes are refused: detect, the image routes and
health never wait for it.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from serving.errors import Kind, SlcError


class GalleryBusy(SlcError):
    """Every place in the gallery's queue is taken (a slow or frozen database): retry later."""

    kind, code = Kind.OVERLOADED, "gallery_busy"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, retry_after=retry_after)


class GalleryExecutor:
    def __init__(self, threads: int, queue_size: int):
        self.threads, self.queue_size = int(threads), int(queue_size)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="slc-gallery")
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not yet finished (waiting or running)

    @property
    def pending(self) -> int:
        return self._pending

    def _done(self, _future: Future) -> None:
        with self._lock:
            self._pending -= 1

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on a gallery thread; GalleryBusy (429) when queue_size calls are already pending."""
        with self._lock:
            if self._pending >= self.queue_size:
                raise GalleryBusy(f"the gallery is busy: {self._pending} calls are waiting or running "
                                  f"(SLC_GALLERY_QUEUE_SIZE={self.queue_size}); retry shortly")
            self._pending += 1
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        future.add_done_callback(self._done)  # (a cancelled future that never ran is done too)
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        """Stop taking calls; queued ones are cancelled, running ones finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
