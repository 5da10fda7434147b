"""ResourceBalancer: claim and release by a machine resource's usage (CPU, memory, ...)."""

from __future__ import annotations

import abc
import logging
import math
from datetime import datetime, timedelta

import psutil

from metafora.balancers._base import ContextBalancer
from metafora.clock import Clock
from metafora.durations import seconds
from metafora.errors import ConfigError
from metafora.task import Task

__all__ = ["CpuReporter", "MemoryReporter", "ResourceBalancer", "ResourceReporter"]

logger = logging.getLogger(__name__)


class ResourceReporter(abc.ABC):
    """Reports how much of one resource this machine uses, as a percentage.

    Implement :meth:`percent`; it is called on every claim decision and balance, from the
    consumer's threads, so it should be cheap and must not block for long.
    """

    @abc.abstractmethod
    def percent(self) -> float:
        """Current usage, from 0.0 (idle) to 100.0 (exhausted)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CpuReporter(ResourceReporter):
    """System-wide CPU usage: ``psutil.cpu_percent(interval=None)``.

    Non-blocking: the value covers the time since the previous call in this process
    (psutil keeps one baseline for all callers). The very first call has no baseline and
    reports 0.0.
    """

    def percent(self) -> float:
        """CPU busy percentage since the previous call, 0..100."""
        return float(psutil.cpu_percent(interval=None))


class MemoryReporter(ResourceReporter):
    """System memory in use: ``psutil.virtual_memory().percent``."""

    def percent(self) -> float:
        """Percentage of physical memory in use, 0..100."""
        return float(psutil.virtual_memory().percent)


def _limit(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 100:
        raise ConfigError(
            f"ResourceBalancer {name} must be an integer from 1 to 100, got {value!r}"
        )
    return value


class ResourceBalancer(ContextBalancer):
    """Claims while a resource's usage is below ``claim_limit``; releases above ``release_limit``.

    Both limits are percentages (integers, ``1 <= claim_limit < release_limit <= 100``).

    **Claiming** (:meth:`can_claim`): at or above ``claim_limit`` it refuses, ignoring the
    task for ``refuse_for``. Below it, it claims after waiting :meth:`claim_delay` —
    ``usage / claim_limit * max_claim_delay`` — so that, of the nodes offered the same task,
    the least loaded answers first and wins the race. The wait is ``clock.wait`` on the
    balancer's clock (the context's unless ``clock`` is given), so tests driving a
    :class:`metafora.testing.FakeClock` measure it without really sleeping.

    **Releasing** (:meth:`balance`): above ``release_limit`` it releases the single oldest
    running task (earliest ``started``) that is not already stopping — one per balance
    call, because usage is only re-measured afterwards: releasing one at a time sheds
    load without dumping every task on a brief spike.

    A reporter that raises, or returns something that is not a number, is logged as a
    warning; the node then claims without delay and releases nothing (a broken meter must
    not stop the node from working).
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
        """Usage percentage above which the oldest task is released."""
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
        """Above ``release_limit``: the id of the oldest task not already stopping."""
        ctx, _ = self._context("balance")
        usage = self._usage(ctx.node_id)
        if usage is None or usage <= self._release_limit:
            return []
        candidates = [rt for rt in ctx.tasks() if rt.stopped is None]
        if not candidates:
            return []
        oldest = min(candidates, key=lambda rt: rt.started)  # min keeps the first of equals
        logger.info(
            "releasing %s: usage %.1f%% > release limit %d%%",
            oldest.id,
            usage,
            self._release_limit,
            extra={"node_id": ctx.node_id, "task_id": oldest.id, "usage": usage},
        )
        return [oldest.id]

    def _usage(self, node_id: str) -> float | None:
        """The reporter's value clamped to 0..100, or None (logged) when it failed."""
        try:
            value = self._reporter.percent()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"percent() returned {value!r}, not a number")
            if math.isnan(value):
                raise ValueError("percent() returned NaN")
        except Exception:
            logger.warning(
                "resource reporter %r failed; treating usage as unknown",
                self._reporter,
                exc_info=True,
                extra={"node_id": node_id},
            )
            return None
        return min(max(float(value), 0.0), 100.0)

    def __repr__(self) -> str:
        return (
            f"ResourceBalancer({self._reporter!r}, claim_limit={self._claim_limit}, "
            f"release_limit={self._release_limit})"
        )
