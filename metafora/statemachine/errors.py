"""The error handler: what a task in ``fault`` does next.

An :data:`ErrorHandler` is called by the machine when a task is in ``fault`` (its handler
raised or returned ``Message.error``). It returns the next :class:`Message`:

- ``Message.sleep(until)`` -- back off, then run again (the usual answer);
- ``Message.run()`` -- retry at once;
- ``Message.error(...)`` -- give up: ``fault`` + ``error`` -> ``failed`` (terminal);
- ``Message.pause()`` / ``Message.kill()`` / ``Message.release()`` -- also accepted.

:class:`ErrorPolicy` is the configurable default: ``max_errors`` errors within ``window``
fail the task, otherwise it sleeps with exponential back-off and jitter.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from metafora.core.durations import seconds
from metafora.core.errors import ConfigError, MetaforaError
from metafora.core.task import Task
from metafora.statemachine.machine import MAX_ERRORS, Message, State

__all__ = ["ErrorHandler", "ErrorPolicy", "ExceededErrorRate", "default_error_handler"]

ErrorHandler = Callable[[Task, State, datetime], Message]
"""``(task, state, now) -> Message``: decides what a faulted task does next.

``state`` is the ``fault`` state (its ``errors`` end with the newest); ``now`` is the
machine's clock. Each :class:`~metafora.statemachine.machine.ErrorRecord` has ``text``
(``Type: message``) and, for errors raised during this run of the machine, ``exception``
(the exception object; ``exception_type`` its type) -- errors read back from the store
(raised before a restart or on another node) have the text only::

    def handler(task, state, now):
        if isinstance(state.errors[-1].exception, PermissionError):
            return Message.error("permission denied: giving up")
        return default_error_handler(task, state, now)

An error handler that raises, or returns a message the ``fault`` state ignores, is logged and
replaced by the default policy's answer.
"""


class ExceededErrorRate(MetaforaError):
    """The error policy gave up on a task: too many errors within its window."""


@dataclass(frozen=True)
class ErrorPolicy:
    """``max_errors`` errors within ``window`` -> failed; else sleep with back-off.

    The n-th recent error sleeps ``min(max_delay, base_delay * 2**(n-1))`` seconds, scaled
    by a random factor in ``[1 - jitter, 1]`` (so the delay never exceeds ``max_delay`` and
    many tasks failing together do not retry in lockstep). Times are seconds or timedeltas.
    ``rng`` makes the jitter reproducible in tests. Defaults: 8 errors in 4 hours, 10 s
    doubling up to 10 min (Metafora: 8 errors in 4 hours, a flat 10 minutes).
    """

    max_errors: int = 8
    window: float | timedelta = timedelta(hours=4)
    base_delay: float | timedelta = 10.0
    max_delay: float | timedelta = 600.0
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (not isinstance(self.max_errors, int) or isinstance(self.max_errors, bool)
                or not 1 <= self.max_errors <= MAX_ERRORS):
            raise ConfigError(
                f"max_errors must be an integer from 1 to {MAX_ERRORS} (a state keeps the last "
                f"{MAX_ERRORS} errors), got {self.max_errors!r}"
            )
        window = seconds(self.window, "window")
        base = seconds(self.base_delay, "base_delay", allow_zero=True)
        top = seconds(self.max_delay, "max_delay", allow_zero=True)
        if top < base:
            raise ConfigError(f"max_delay ({top:g}s) must not be less than base_delay ({base:g}s)")
        if not isinstance(self.jitter, int | float) or not 0 <= self.jitter <= 1:
            raise ConfigError(f"jitter must be a fraction from 0 to 1, got {self.jitter!r}")
        object.__setattr__(self, "window", timedelta(seconds=window))
        object.__setattr__(self, "base_delay", base)
        object.__setattr__(self, "max_delay", top)

    def recent_errors(self, state: State, now: datetime) -> int:
        """How many of the state's errors happened within the window before ``now``."""
        assert isinstance(self.window, timedelta)
        since = now - self.window
        return sum(1 for e in state.errors if e.time > since)

    def delay(self, attempt: int) -> float:
        """Seconds to sleep after the ``attempt``-th recent error (1-based), jittered."""
        assert isinstance(self.base_delay, float) and isinstance(self.max_delay, float)
        exponent = max(0, attempt - 1)
        raw = self.max_delay if exponent >= 64 else min(self.max_delay, self.base_delay * 2.0**exponent)
        return raw * self.rng.uniform(1.0 - self.jitter, 1.0)

    def __call__(self, task: Task, state: State, now: datetime) -> Message:
        """The policy as an :data:`ErrorHandler`."""
        recent = self.recent_errors(state, now)
        if recent >= self.max_errors:
            return Message.error(ExceededErrorRate(
                f"{recent} errors within {self.window}; giving up on task {task.id!r}"
            ))
        return Message.sleep(now + timedelta(seconds=self.delay(recent)))


_DEFAULT_POLICY = ErrorPolicy()


def default_error_handler(task: Task, state: State, now: datetime) -> Message:
    """The default :data:`ErrorHandler`: ``ErrorPolicy()`` (8 errors in 4 h fail the task)."""
    return _DEFAULT_POLICY(task, state, now)
