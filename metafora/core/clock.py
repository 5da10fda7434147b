"""Injectable time: wall clock for timestamps, monotonic clock for deadlines.

Production code takes a :class:`Clock`; tests pass :class:`metafora.testing.FakeClock`
so timing logic (ignore deadlines, balance cadence, back-off) runs without sleeping.
"""

from __future__ import annotations

import abc
import threading
import time
from datetime import UTC, datetime

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


class Clock(abc.ABC):
    """A source of time and of timed waits."""

    @abc.abstractmethod
    def now(self) -> datetime:
        """The current wall-clock time, timezone-aware UTC."""

    @abc.abstractmethod
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""

    @abc.abstractmethod
    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        """Wait until ``event`` is set or ``timeout`` seconds pass on this clock.

        Returns whether the event is set. May return early; callers re-check their state.
        """


class SystemClock(Clock):
    """The real clock."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        return event.wait(None if timeout is None else max(0.0, timeout))


SYSTEM_CLOCK = SystemClock()
