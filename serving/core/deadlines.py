"""Deadlines for the request path from one periodic sweep instead of a timer per request.

`asyncio.timeout` puts a timer in the loop's heap and takes it out again: about 5 µs per use, and
a body request used two (the body's read time, the request's deadline) on the event loop, which
is the server's bottleneck. Here entering a deadline is a dict insert and leaving it a dict pop;
one sweep every SWEEP_S (only while some deadline is pending) cancels the tasks whose deadline
has passed, so a deadline fires up to SWEEP_S late. Exceptions as in asyncio.timeout: the guarded
block raises TimeoutError when its own deadline cancelled it, and a cancel from elsewhere stays a
CancelledError.
"""
from __future__ import annotations

import asyncio
import weakref
from typing import Optional

SWEEP_S = 0.05

_SWEEPERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Sweeper]" = weakref.WeakKeyDictionary()


class _Sweeper:
    """The pending deadlines of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: dict[Deadline, None] = {}
        self._timer: Optional[asyncio.TimerHandle] = None

    def add(self, guard: "Deadline") -> None:
        self.pending[guard] = None
        if self._timer is None:
            self._timer = self.loop.call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        now = self.loop.time()
        for guard in [g for g in self.pending if g.when <= now]:
            del self.pending[guard]
            guard.expire()
        if self.pending:
            self._timer = self.loop.call_later(SWEEP_S, self._sweep)


class Deadline:
    """`with Deadline(loop.time() + 30): await ...` in a task: TimeoutError once the time has passed."""

    __slots__ = ("when", "_task", "_cancelling", "_expired", "_sweeper")

    def __init__(self, when: float):
        self.when = when
        self._expired = False

    def __enter__(self) -> "Deadline":
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task(loop)
        self._cancelling = self._task.cancelling()
        self._sweeper = _SWEEPERS.get(loop)
        if self._sweeper is None:
            self._sweeper = _SWEEPERS[loop] = _Sweeper(loop)
        self._sweeper.add(self)
        return self

    def expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._sweeper.pending.pop(self, None)
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


def within(delay: float) -> Deadline:
    """A Deadline `delay` seconds from now (in the running loop's time)."""
    return Deadline(asyncio.get_running_loop().time() + delay)
