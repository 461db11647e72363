"""serving/core/deadlines.py: the guarded block gets TimeoutError once its deadline has passed (as with
asyncio.timeout), a block that finishes in time is untouched, and a cancel from elsewhere stays
a cancel."""
from __future__ import annotations

import asyncio

import pytest

from serving.core import deadlines
from serving.core.deadlines import within


def test_a_block_past_its_deadline_gets_timeout_error():
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            with within(0.05):
                await asyncio.sleep(10)
        return loop.time() - t0

    assert asyncio.run(main()) < 5  # cut off by the deadline, not the sleep's end


def test_a_block_in_time_is_untouched_and_leaves_nothing_pending():
    async def main():
        with within(5):
            await asyncio.sleep(0.01)
        await asyncio.sleep(2 * deadlines.SWEEP_S)  # a later await is not cancelled
        return deadlines._SWEEPERS[asyncio.get_running_loop()].pending

    assert asyncio.run(main()) == {}


def test_a_cancel_from_elsewhere_stays_a_cancel():
    async def guarded():
        with within(30):
            await asyncio.sleep(10)

    async def main():
        task = asyncio.create_task(guarded())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_only_the_expired_of_concurrent_deadlines_fire():
    async def one(deadline: float, work: float) -> str:
        try:
            with within(deadline):
                await asyncio.sleep(work)
            return "done"
        except TimeoutError:
            return "timeout"

    async def main():
        return await asyncio.gather(one(0.05, 10), one(10, 0.2), one(0.1, 10), one(10, 0.01))

    assert asyncio.run(main()) == ["timeout", "done", "timeout", "done"]


def test_the_sweep_stops_when_nothing_is_pending():
    async def main():
        with within(5):
            await asyncio.sleep(0)
        await asyncio.sleep(2 * deadlines.SWEEP_S)
        return deadlines._SWEEPERS[asyncio.get_running_loop()]._timer

    assert asyncio.run(main()) is None
