"""A fake clock for tests: time moves only when the test says so.

Code under test takes a :class:`~metafora.core.clock.Clock`; a test passes :class:`FakeClock` and
calls :meth:`FakeClock.advance`. Waits end when fake time reaches their deadline (each waiter
re-checks every few real milliseconds), never by sleeping for the time they wait.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

from metafora.core.clock import Clock

__all__ = ["FakeClock"]

_REAL_SLICE = 0.005  # real seconds a fake wait blocks before re-checking fake time


class FakeClock(Clock):
    """A clock that only moves when told to (:meth:`advance`).

    ``wait`` returns as soon as the event is set or fake time reaches the deadline, so
    code under test that waits on this clock runs as fast as the test advances it.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2030, 1, 1, tzinfo=UTC)
        self._mono = 1000.0
        self._cond = threading.Condition()
        self._waiters: list[tuple[float, threading.Event]] = []

    def now(self) -> datetime:
        with self._cond:
            return self._now

    def monotonic(self) -> float:
        with self._cond:
            return self._mono

    def advance(self, seconds: float | timedelta) -> None:
        """Move time forward and wake every waiter whose deadline has come."""
        delta = seconds.total_seconds() if isinstance(seconds, timedelta) else float(seconds)
        if delta < 0:
            raise ValueError("a clock does not go back")
        with self._cond:
            self._now += timedelta(seconds=delta)
            self._mono += delta
            self._cond.notify_all()

    def waiters(self) -> int:
        """How many threads wait on this clock now (lets a test know a loop is idle)."""
        with self._cond:
            return len(self._waiters)

    def wait_for_waiters(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Block (in real time, up to ``timeout``) until ``count`` threads wait on the clock."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._waiters) >= count, timeout)

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if event.is_set():
            return True
        with self._cond:
            deadline = float("inf") if timeout is None else self._mono + max(0.0, timeout)
            if deadline <= self._mono:
                return event.is_set()
            entry = (deadline, event)
            self._waiters.append(entry)
            self._cond.notify_all()
        try:
            # The caller's event is never set by the clock: it may mean "stop" to the caller.
            while not event.is_set():
                with self._cond:
                    if self._mono >= deadline:
                        return False
                event.wait(_REAL_SLICE)
            return True
        finally:
            with self._cond:
                self._waiters.remove(entry)
                self._cond.notify_all()
