"""Masterless periodic tasks: schedules, their ticks, and the loop that materialises them.

A :class:`~metafora.core.schedule_model.Schedule` says when (``every`` N seconds, or a ``cron``
expression, in UTC) a task is made from its ``props``. Every consumer runs a
:class:`Scheduler`; any of them may materialise a due tick. The store's one atomic step
(:meth:`metafora.contracts.coordinator.Coordinator.materialise`) advances the schedule's ``cursor``
with a compare-and-set on its ``version`` and creates the tick's task if absent, in one
transaction: two nodes racing make one task, and a tick whose task was since purged is never
made again. No leader is needed, and no tick is lost while at least one node is up.

The values (:class:`~metafora.core.schedule_model.Schedule`, tick computation, the missed-tick
policy) live in :mod:`metafora.core.schedule_model`, below the coordinator interface that names
them; the stores and this loop import them from there. This module is the loop, which drives
a coordinator.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from metafora.core.clock import Clock
from metafora.core.errors import CoordinatorClosed, MetaforaError
from metafora.core.schedule_model import (
    MAX_CATCH_UP,
    MAX_TICKS_PER_STEP,
    Schedule,
    due,
    tick_id,
)

if TYPE_CHECKING:
    from metafora.contracts.coordinator import Coordinator

__all__ = ["Scheduler"]

log = logging.getLogger("metafora.schedule")  # its name before the move (users' log config names it)


class Scheduler:
    """A consumer's side loop that materialises the due ticks of every schedule.

    It wakes at the next due tick of the schedules it knows (not a poll per schedule),
    re-reads the list when the store pushes a change (:meth:`wake`) or every
    ``refresh_every`` seconds as a safety net, and waits on the injected clock.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        clock: Clock,
        *,
        refresh_every: float = 30.0,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._coord = coordinator
        self._on_error = on_error  # counts an error of the loop (``schedules``) for /metrics
        self._clock = clock
        self._refresh_every = refresh_every
        self._log = logger or log
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._broken: set[str] = set()  # schedules whose ticks cannot be computed
        self._known: list[str] = []
        self.made = 0
        """Ticks this node made into tasks (won the compare-and-set for). Counted once the
        store's step has returned, so a reader may see the ticks' tasks a moment before this
        count; it is final once :meth:`run` has returned."""

    @property
    def known(self) -> list[str]:
        """Names of the schedules this scheduler read last (for tests and views)."""
        return list(self._known)

    def wake(self) -> None:
        """The schedules changed (a push from the store): re-read them now."""
        self._wake.set()

    def stop(self) -> None:
        """End :meth:`run` soon."""
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Loop until :meth:`stop`. Store outages are logged and retried with a back-off."""
        try:
            pushed = self._coord.listen_schedules(self.wake)
        except CoordinatorClosed:
            return
        refresh = self._refresh_every if pushed else min(self._refresh_every, 5.0)
        backoff = 0.5
        known: list[Schedule] = []
        stale = True
        refreshed = self._clock.monotonic()
        while not self._stop.is_set():
            try:
                if stale or self._wake.is_set() or self._clock.monotonic() - refreshed >= refresh:
                    self._wake.clear()
                    known = self._coord.schedules()
                    self._known = [schedule.name for schedule in known]
                    refreshed = self._clock.monotonic()
                stale = self._tick(known)
            except CoordinatorClosed:
                if self._stop.is_set():
                    return
                raise
            except MetaforaError as exc:
                self._log.warning("schedules: %s (retrying in %.1fs)", exc, backoff,
                                  extra={"action": "schedule"})
                if self._on_error is not None:
                    self._on_error("schedules")
                self._clock.wait(self._stop, backoff)
                backoff = min(backoff * 2, 10.0)
                stale = True
                continue
            backoff = 0.5
            if stale:
                continue
            now = self._clock.now()
            wait = refresh - (self._clock.monotonic() - refreshed)
            for schedule in known:
                if not schedule.paused and schedule.name not in self._broken:
                    wait = min(wait, (schedule.next_tick(schedule.cursor) - now).total_seconds())
            self._clock.wait(self._wake, max(0.0, wait))

    def _tick(self, known: list[Schedule]) -> bool:
        """Materialise what is due; whether the list must be read again (something moved)."""
        now = self._clock.now()
        moved = False
        for schedule in known:
            try:
                found = due(schedule, now)
            except (ValueError, LookupError, TypeError, AssertionError, ArithmeticError) as exc:
                # A row written around metafora (a period past the dates a computer counts:
                # OverflowError) must not stop the node: skip it, say and count it once.
                if schedule.name not in self._broken:
                    self._log.error("schedule %s cannot be evaluated, skipped: %s", schedule.name,
                                    exc, extra={"action": "schedule"})
                    if self._on_error is not None:
                        self._on_error("schedules")
                self._broken.add(schedule.name)
                continue
            self._broken.discard(schedule.name)
            if found is None:
                continue
            moved = True
            ticks, cursor = found.ticks, found.cursor
            if len(ticks) > MAX_TICKS_PER_STEP:  # the rest on the next round, after a re-read
                ticks = ticks[:MAX_TICKS_PER_STEP]
                cursor = ticks[-1]
            won = self._coord.materialise(schedule, [schedule.task(t) for t in ticks], cursor)
            if not won:
                continue  # another node settled it first (or it changed): re-read
            self.made += len(ticks)
            if found.dropped:
                self._log.warning(
                    "schedule %s: %d missed tick(s) dropped (missed=%s%s)", schedule.name,
                    found.dropped, schedule.missed,
                    f", at most {MAX_CATCH_UP} caught up" if schedule.missed == "all" else "",
                    extra={"action": "schedule"})
            if ticks:
                self._log.info("schedule %s: made %d task(s), last %s", schedule.name,
                               len(ticks), tick_id(schedule.name, ticks[-1]),
                               extra={"action": "schedule"})
        return moved
