"""metafora.core.clock: the real clock behind the Clock interface (the fake one: test_testing.py)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest

from metafora.core.clock import SYSTEM_CLOCK, Clock, SystemClock


def test_the_system_clock_gives_aware_utc_time_and_a_monotonic_clock() -> None:
    before = datetime.now(UTC)
    now = SYSTEM_CLOCK.now()
    assert now.tzinfo is not None and now.utcoffset() == UTC.utcoffset(now)
    assert before <= now <= datetime.now(UTC)
    first = SYSTEM_CLOCK.monotonic()
    assert SYSTEM_CLOCK.monotonic() >= first
    assert isinstance(SYSTEM_CLOCK, SystemClock)


def test_wait_returns_whether_the_event_is_set() -> None:
    event = threading.Event()
    assert SYSTEM_CLOCK.wait(event, 0) is False
    assert SYSTEM_CLOCK.wait(event, -5) is False  # a deadline already past waits not at all
    event.set()
    assert SYSTEM_CLOCK.wait(event, None) is True
    assert SYSTEM_CLOCK.wait(event, 0) is True


def test_wait_ends_when_another_thread_sets_the_event() -> None:
    event = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(SYSTEM_CLOCK.wait(event, 60)))
    waiter.start()
    event.set()
    waiter.join(10)
    assert result == [True]


def test_a_clock_must_give_all_three_of_now_monotonic_and_wait() -> None:
    class NoWait(Clock):
        def now(self) -> datetime:
            return datetime.now(UTC)

        def monotonic(self) -> float:
            return 0.0

    with pytest.raises(TypeError, match="wait"):
        NoWait()  # type: ignore[abstract]
