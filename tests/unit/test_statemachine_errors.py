"""The default error handler: N errors within a window fail the task, else back off."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from metafora import Task
from metafora.core.errors import ConfigError
from metafora.statemachine import (
    ErrorPolicy,
    ErrorRecord,
    Message,
    MessageKind,
    State,
    StateCode,
    apply,
    default_error_handler,
)
from metafora.statemachine.machine import MAX_ERRORS

T0 = datetime(2030, 1, 1, tzinfo=UTC)
TASK = Task("t", token=1)


def fault(*ages: float) -> State:
    """A fault state with errors that happened ``ages`` seconds before T0 (oldest first)."""
    errors = tuple(ErrorRecord(T0 - timedelta(seconds=a), f"E: {a}") for a in ages)
    return State(StateCode.FAULT, errors=errors)


def test_backs_off_exponentially_up_to_max_delay_without_jitter() -> None:
    policy = ErrorPolicy(max_errors=10, window=3600, base_delay=1, max_delay=10, jitter=0)
    delays = []
    for n in range(1, 8):
        message = policy(TASK, fault(*([1.0] * n)), T0)
        assert message.kind is MessageKind.SLEEP and message.until is not None
        delays.append((message.until - T0).total_seconds())
    assert delays == [1, 2, 4, 8, 10, 10, 10]


def test_jitter_stays_within_its_band_and_below_max_delay() -> None:
    policy = ErrorPolicy(max_errors=10, base_delay=100, max_delay=150, jitter=0.5,
                         rng=random.Random(7))
    for n in range(1, 9):
        seconds = policy.delay(n)
        raw = min(150.0, 100.0 * 2 ** (n - 1))
        assert raw * 0.5 <= seconds <= raw <= 150.0


def test_jitter_is_reproducible_with_an_injected_rng() -> None:
    a = ErrorPolicy(rng=random.Random(42))
    b = ErrorPolicy(rng=random.Random(42))
    assert [a.delay(n) for n in range(1, 6)] == [b.delay(n) for n in range(1, 6)]


def test_max_errors_within_the_window_fail_the_task() -> None:
    policy = ErrorPolicy(max_errors=3, window=60, base_delay=1, max_delay=5, jitter=0)
    assert policy(TASK, fault(30, 20), T0).kind is MessageKind.SLEEP
    message = policy(TASK, fault(30, 20, 10), T0)
    assert message.kind is MessageKind.ERROR
    assert message.reason is not None and "ExceededErrorRate: 3 errors within 0:01:00" in message.reason
    failed = apply(fault(30, 20, 10), message, T0)
    assert failed is not None and failed.code is StateCode.FAILED
    assert failed.errors[-1].text == message.reason


def test_errors_outside_the_window_do_not_count() -> None:
    policy = ErrorPolicy(max_errors=3, window=60, base_delay=1, max_delay=5, jitter=0)
    message = policy(TASK, fault(600, 500, 400, 10), T0)
    assert message.kind is MessageKind.SLEEP
    assert message.until == T0 + timedelta(seconds=1)  # only one recent error: base delay
    assert policy.recent_errors(fault(600, 59, 1), T0) == 2


def test_default_error_handler_is_the_default_policy() -> None:
    message = default_error_handler(TASK, fault(1), T0)
    assert message.kind is MessageKind.SLEEP and message.until is not None
    assert timedelta(seconds=5) <= message.until - T0 <= timedelta(seconds=10)
    assert default_error_handler(TASK, fault(*[1.0] * 8), T0).kind is MessageKind.ERROR
    assert default_error_handler(TASK, fault(*[1.0] * 7), T0).kind is MessageKind.SLEEP


def test_timedelta_arguments() -> None:
    policy = ErrorPolicy(window=timedelta(minutes=1), base_delay=timedelta(seconds=2),
                         max_delay=timedelta(seconds=4), jitter=0)
    assert policy(TASK, fault(1), T0) == Message.sleep(T0 + timedelta(seconds=2))


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"max_errors": 0}, "max_errors"),
        ({"max_errors": MAX_ERRORS + 1}, "max_errors"),
        ({"max_errors": True}, "max_errors"),
        ({"window": 0}, "window"),
        ({"window": float("nan")}, "window"),
        ({"base_delay": -1}, "base_delay"),
        ({"base_delay": 10, "max_delay": 5}, "max_delay"),
        ({"jitter": 1.5}, "jitter"),
    ],
)
def test_bad_policies_are_config_errors(kwargs: dict[str, object], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        ErrorPolicy(**kwargs)  # type: ignore[arg-type]
