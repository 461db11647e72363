"""The gallery's executor (serving/gallery/executor.py): its own threads, at most queue_size calls
waiting or running (then 429 gallery_busy with Retry-After), and a call counts until its thread is
done with it, even when the request that made it was cancelled (a deadline, a client gone)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from serving.errors import Kind
from serving.gallery.executor import GalleryBusy, GalleryExecutor


def test_calls_past_the_queue_are_refused_at_once_and_the_queue_frees_when_threads_finish():
    async def main():
        pool = GalleryExecutor(threads=2, queue_size=3)
        release = threading.Event()
        names = []

        def stuck():
            names.append(threading.current_thread().name)
            release.wait(30)
            return "done"

        calls = [asyncio.ensure_future(pool.run(stuck)) for _ in range(3)]
        await asyncio.sleep(0.2)
        with pytest.raises(GalleryBusy) as err:
            await pool.run(stuck)
        assert err.value.kind is Kind.OVERLOADED and err.value.retry_after == 1
        calls[0].cancel()  # the request went away: its call still runs and still counts
        await asyncio.sleep(0.1)
        assert pool.pending == 3
        with pytest.raises(GalleryBusy):
            await pool.run(stuck)
        release.set()
        assert [await c for c in calls[1:]] == ["done", "done"]
        for _ in range(100):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.02)
        assert pool.pending == 0
        assert await pool.run(lambda: 7) == 7
        assert all(n.startswith("slc-gallery") for n in names)  # its own threads, not the default pool's
        pool.shutdown()

    asyncio.run(main())


def test_a_queued_call_cancelled_before_it_ran_leaves_the_queue():
    async def main():
        pool = GalleryExecutor(threads=1, queue_size=2)
        release = threading.Event()
        running = asyncio.ensure_future(pool.run(release.wait, 30))
        queued = asyncio.ensure_future(pool.run(lambda: "never"))
        await asyncio.sleep(0.1)
        assert pool.pending == 2
        queued.cancel()  # not started yet: cancelled, and no longer counted
        await asyncio.sleep(0.1)
        assert pool.pending == 1
        release.set()
        assert await running is True
        pool.shutdown()

    asyncio.run(main())
