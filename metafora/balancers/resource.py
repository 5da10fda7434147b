"""ResourceBalancer: claim and release by a machine resource's usage (CPU, memory, ...)."""

from __future__ import annotations

import abc
import inspect
import logging
import math
from datetime import datetime, timedelta
from typing import Any

import psutil

from metafora.balancers._base import ContextBalancer
from metafora.core.clock import Clock
from metafora.core.durations import seconds
from metafora.core.errors import ConfigError
from metafora.core.task import Task

__all__ = ["CpuReporter", "MemoryReporter", "ResourceBalancer", "ResourceReporter", "release_count"]

logger = logging.getLogger(__name__)


class ResourceReporter(abc.ABC):  # noqa: B024 (used() or percent(): checked per subclass)
    """Reports how much of one resource this machine uses (Metafora's ``ResourceReporter``).

    Implement :meth:`used` -- ``(used, total)`` in the resource's own unit, as Metafora's
    ``Used() (used, total uint64)`` -- or, the older form, :meth:`percent`; each defaults to
    the other, so either one is enough (a subclass defining neither is refused when it is
    defined). ``str(reporter)`` names the resource for logs (Metafora's ``String()``); the
    default is the class name. Called on every claim decision and balance, from the
    consumer's threads, so it should be cheap and must not block for long.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> ResourceReporter:
        if cls is ResourceReporter:
            raise TypeError("ResourceReporter is an interface: subclass it and implement used()")
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if (not inspect.isabstract(cls) and cls.used is ResourceReporter.used
                and cls.percent is ResourceReporter.percent):
            raise TypeError(f"{cls.__name__} must implement ResourceReporter.used() (or percent())")

    def used(self) -> tuple[float, float]:
        """``(used, total)`` of the resource, in its own unit (bytes, cores, slots...).

        The default answers ``(percent(), 100.0)``.
        """
        return self.percent(), 100.0

    def percent(self) -> float:
        """Current usage, from 0.0 (idle) to 100.0 (exhausted): ``used / total * 100`` by
        default."""
        used, total = self.used()
        return float(used) / float(total) * 100.0

    def __str__(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CpuReporter(ResourceReporter):
    """System-wide CPU usage: ``psutil.cpu_percent(interval=None)``, out of 100.

    Non-blocking: the value covers the time since the previous call in this process
    (psutil keeps one baseline for all callers). The very first call has no baseline and
    reports 0.0.
    """

    def used(self) -> tuple[float, float]:
        """``(busy percentage since the previous call, 100.0)``."""
        return float(psutil.cpu_percent(interval=None)), 100.0

    def __str__(self) -> str:
        return "cpu percent"


class MemoryReporter(ResourceReporter):
    """System memory in use, in bytes: ``(total - available, total)`` of
    ``psutil.virtual_memory()`` (what its ``percent`` is computed from)."""

    def used(self) -> tuple[float, float]:
        """``(bytes in use, bytes of physical memory)``."""
        memory = psutil.virtual_memory()
        return float(memory.total - memory.available), float(memory.total)

    def __str__(self) -> str:
        return "memory bytes"


def _limit(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 100:
        raise ConfigError(
            f"ResourceBalancer {name} must be an integer from 1 to 100, got {value!r}"
        )
    return value


class ResourceBalancer(ContextBalancer):
    """Claims while a resource's usage is below ``claim_limit``; releases above ``release_limit``.

    Both limits are percentages of the reporter's total (integers,
    ``1 <= claim_limit < release_limit <= 100``); usage is ``used / total * 100``.

    **Claiming** (:meth:`can_claim`): at or above ``claim_limit`` it refuses, ignoring the
    task for ``refuse_for``. Below it, it claims after waiting :meth:`claim_delay` —
    ``usage / claim_limit * max_claim_delay`` — so that, of the nodes offered the same task,
    the least loaded answers first and wins the race. The wait is ``clock.wait`` on the
    balancer's clock (the context's unless ``clock`` is given), so tests driving a
    :class:`metafora.testing.FakeClock` measure it without really sleeping.

    **Releasing** (:meth:`balance`): above ``release_limit`` it releases running tasks,
    oldest first (earliest ``started``, not already stopping), as many as it takes to bring
    usage below ``release_limit`` in this one balance, as Metafora's does. Usage is only
    measured again later, so what a task uses is estimated as an equal part of the usage
    (``usage / tasks running``, stopping ones included): at 95 % with 10 tasks and a limit
    of 80 % it releases 2 (95 - 2 x 9.5 = 76 < 80). Never more than the tasks not already
    stopping.

    A reporter that raises, or returns something that is not a number (or a total that is
    not positive), is logged as a warning; the node then claims without delay and releases
    nothing (a broken meter must not stop the node from working).
    """

    def __init__(
        self,
        reporter: ResourceReporter,
        claim_limit: int,
        release_limit: int,
        *,
        max_claim_delay: float | timedelta = 0.5,
        refuse_for: float | timedelta = 10.0,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(clock)
        if not isinstance(reporter, ResourceReporter):
            raise ConfigError(
                f"ResourceBalancer reporter must be a ResourceReporter, got {reporter!r}"
            )
        claim = _limit(claim_limit, "claim_limit")
        release = _limit(release_limit, "release_limit")
        if claim >= release:
            raise ConfigError(
                f"ResourceBalancer claim_limit ({claim}) must be below release_limit ({release})"
            )
        self._reporter = reporter
        self._claim_limit = claim
        self._release_limit = release
        self._max_claim_delay = seconds(max_claim_delay, "max_claim_delay", allow_zero=True)
        self._refuse_for = timedelta(seconds=seconds(refuse_for, "refuse_for", allow_zero=True))

    @property
    def reporter(self) -> ResourceReporter:
        """Where usage comes from."""
        return self._reporter

    @property
    def claim_limit(self) -> int:
        """Usage percentage at or above which nothing is claimed."""
        return self._claim_limit

    @property
    def release_limit(self) -> int:
        """Usage percentage above which the oldest tasks are released (until below it)."""
        return self._release_limit

    def claim_delay(self, usage: float) -> float:
        """Seconds to wait before claiming at ``usage`` percent (below ``claim_limit``).

        ``usage / claim_limit * max_claim_delay``, clamped to ``[0, max_claim_delay]``.
        """
        fraction = min(max(usage / self._claim_limit, 0.0), 1.0)
        return fraction * self._max_claim_delay

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        """Refuse at or above ``claim_limit``; below it, wait :meth:`claim_delay` and claim."""
        ctx, clock = self._context("can_claim")
        usage = self._usage(ctx.node_id)
        if usage is None:
            return True, None
        if usage >= self._claim_limit:
            logger.debug(
                "not claiming %s: usage %.1f%% >= claim limit %d%%",
                task.id,
                usage,
                self._claim_limit,
                extra={"node_id": ctx.node_id, "task_id": task.id, "usage": usage},
            )
            return False, clock.now() + self._refuse_for
        self._sleep(clock, self.claim_delay(usage))
        return True, None

    def balance(self) -> list[str]:
        """Above ``release_limit``: the ids of the oldest tasks not already stopping, as
        many as bring the estimated usage below ``release_limit`` (see the class)."""
        ctx, _ = self._context("balance")
        usage = self._usage(ctx.node_id)
        if usage is None or usage <= self._release_limit:
            return []
        tasks = ctx.tasks()
        candidates = sorted((rt for rt in tasks if rt.stopped is None),
                            key=lambda rt: rt.started)  # sorted is stable: equals keep their order
        if not candidates:
            return []
        count = release_count(usage, self._release_limit, len(tasks), len(candidates))
        chosen = [rt.id for rt in candidates[:count]]
        logger.info(
            "releasing %d task(s) (oldest %s): %s usage %.1f%% > release limit %d%%",
            len(chosen),
            chosen[0],
            self._reporter,
            usage,
            self._release_limit,
            extra={"node_id": ctx.node_id, "task_id": chosen[0], "usage": usage},
        )
        return chosen

    def _usage(self, node_id: str) -> float | None:
        """The reporter's usage in percent clamped to 0..100, or None (logged) when it failed."""
        try:
            value = _percent_of(self._reporter)
        except Exception:
            logger.warning(
                "resource reporter %r failed; treating usage as unknown",
                self._reporter,
                exc_info=True,
                extra={"node_id": node_id},
            )
            return None
        return min(max(value, 0.0), 100.0)

    def __repr__(self) -> str:
        return (
            f"ResourceBalancer({self._reporter!r}, claim_limit={self._claim_limit}, "
            f"release_limit={self._release_limit})"
        )


def release_count(usage: float, limit: float, running: int, candidates: int) -> int:
    """How many tasks to release at ``usage`` percent so that the estimate falls below
    ``limit``, each of the ``running`` tasks taken to use ``usage / running``; at least one,
    at most ``candidates``."""
    if usage <= limit or candidates <= 0:
        return 0
    share = usage / max(running, 1)
    count = math.floor((usage - limit) / share) + 1  # the smallest k with usage - k*share < limit
    return max(1, min(count, candidates))


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} returned {value!r}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"{what} returned {value!r}")
    return float(value)


def _percent_of(reporter: ResourceReporter) -> float:
    """The reporter's usage in percent: from :meth:`ResourceReporter.used` when the class
    defines it (or the default, from ``percent``), checked."""
    if type(reporter).used is ResourceReporter.used:
        return _number(reporter.percent(), "percent()")
    answer = reporter.used()
    if not isinstance(answer, tuple) or len(answer) != 2:
        raise TypeError(f"used() returned {answer!r}, not (used, total)")
    used, total = _number(answer[0], "used()"), _number(answer[1], "used()")
    if total <= 0:
        raise ValueError(f"used() returned a total of {total!r}; it must be positive")
    return used / total * 100.0
