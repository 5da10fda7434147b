"""SleepBalancer: a head start for lightly loaded nodes, by waiting before each claim."""

from __future__ import annotations

from datetime import datetime, timedelta

from metafora.balancers._base import ContextBalancer
from metafora.core.clock import Clock
from metafora.core.durations import seconds
from metafora.core.task import Task

__all__ = ["SleepBalancer"]


class SleepBalancer(ContextBalancer):
    """Waits ``per_task`` (30 ms by default) times the number of running tasks before each claim.

    Every node sees every offered task; the node running fewer tasks waits less and so
    usually wins the claim. It always claims in the end and never releases anything.
    The wait is ``clock.wait`` on the balancer's clock (the context's unless ``clock`` is
    given), so tests on :class:`metafora.testing.FakeClock` do not really sleep.
    """

    def __init__(self, per_task: float | timedelta = 0.030, *, clock: Clock | None = None) -> None:
        super().__init__(clock)
        self._per_task = seconds(per_task, "per_task", allow_zero=True)

    @property
    def per_task(self) -> float:
        """Seconds waited per running task before a claim."""
        return self._per_task

    def delay(self, running: int) -> float:
        """Seconds waited before a claim when ``running`` tasks run on this node."""
        return self._per_task * max(0, running)

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        """Wait :meth:`delay` for the current task count, then ``(True, None)``."""
        ctx, clock = self._context("can_claim")
        self._sleep(clock, self.delay(ctx.task_count()))
        return True, None

    def balance(self) -> list[str]:
        """Always ``[]``: this balancer never releases."""
        self._context("balance")
        return []

    def __repr__(self) -> str:
        return f"SleepBalancer(per_task={self._per_task!r})"
