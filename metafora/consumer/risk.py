"""Claim at risk: handlers learn until when their claim is guaranteed, and are warned early.

A node holds every claim through ONE lease, renewed every ``renew_every`` seconds; it stops
its handlers (self-fences, :mod:`metafora.core.leases`) ``fence_after`` seconds
after the start of its last good renewal. Between the renewal falling due and the fence
there is the *slack* (``fence_after - renew_every``). :class:`RiskRule` says when a node
is *at risk*, with ``left`` the seconds to its fence by its own clock:

- a renewal was reported failed (the store refused or was unreachable) since the last good
  one, and ``left <= slack`` (the due renewal did not get through): at once;
- or ``left <= share * slack`` (default half) with nothing reported: the renewal hangs
  (a frozen store never answers).

Both points are strictly before the fence, which is itself ``margin`` seconds before the
store could let anyone else claim the tasks. An *episode* (:class:`RiskEpisode`) starts with
a warning, and ends with a ``recovered`` notice when a renewal gets through (``left`` back
above the slack), or silently with the fence (the handlers are then stopped as lost).

:class:`RiskWatch` is the node's one watcher thread: it looks at the lease's time left when
the next point is due (computed from the last renewal) or when a renewal is reported good
or failed -- never per task -- and fans a change out to the running handlers: their
optional ``at_risk(until)`` / ``recovered(until)`` methods (async handlers' on the event
loop), once per episode each; a handler started during an episode is told as it starts.
:class:`ClaimView` is what ``Task.valid_until()`` / ``Task.at_risk()`` read (no I/O).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from metafora.consumer.context import PartsContext
from metafora.consumer.runner import AsyncRun
from metafora.consumer.running import NodeLog, Running
from metafora.contracts.coordinator import Coordinator
from metafora.core.leases import LeaseTiming
from metafora.core.task import Task

__all__ = ["DEFAULT_WARN_SHARE", "Change", "ClaimView", "RiskEpisode", "RiskRule", "RiskWatch"]

DEFAULT_WARN_SHARE = 0.5
"""Without a failure reported, warn when this share of the slack is left before the fence."""

_EPSILON = 0.005  # seconds past a point before looking again (timers may fire a bit early)
_LOGGED_TASKS = 20  # tasks named one by one at INFO per notice; the rest at DEBUG


class Change(enum.Enum):
    """What a look at the lease changed."""

    WARN = "at_risk"
    """Renewals are failing: the claims are at risk (the episode starts)."""
    RECOVERED = "recovered"
    """A renewal got through: the claims are safe again (the episode ends)."""
    LOST = "lost"
    """The node fenced during the episode: its handlers are being stopped (it ends)."""


@dataclass(frozen=True)
class RiskRule:
    """When a node is at risk (see the module docstring)."""

    timing: LeaseTiming
    share: float = DEFAULT_WARN_SHARE

    def warn_left(self, failing: bool) -> float:
        """Seconds before the fence at which to warn: the slack when a renewal was reported
        failed, ``share`` of it otherwise."""
        slack = self.timing.slack
        return slack if failing else slack * self.share

    def at_risk(self, left: float, failing: bool) -> bool:
        """Whether a node with ``left`` seconds to its fence is at risk."""
        return 0.0 < left <= self.warn_left(failing)


class RiskEpisode:
    """A node's at-risk state, stepped by observations of its lease (pure: no clock, no I/O)."""

    def __init__(self, rule: RiskRule) -> None:
        self.rule = rule
        self.at_risk = False

    def step(self, left: float, failing: bool) -> Change | None:
        """Observe ``left`` seconds to the fence (``failing``: a renewal failed since the
        last good one); the change it makes, if any."""
        if self.at_risk:
            if left <= 0.0:
                self.at_risk = False
                return Change.LOST
            if not failing and left > self.rule.timing.slack:
                self.at_risk = False
                return Change.RECOVERED
            return None
        if self.rule.at_risk(left, failing):
            self.at_risk = True
            return Change.WARN
        return None

    def next_look(self, left: float, failing: bool) -> float | None:
        """Seconds until a look could change something without news from the lease (None:
        only news can, e.g. the node has no lease)."""
        if left <= 0.0:
            return None
        if self.at_risk:
            return left  # the fence
        return max(0.0, left - self.rule.warn_left(failing))


class ClaimView:
    """A claimed task's window on its claim (what ``Task.valid_until()`` reads; no I/O)."""

    __slots__ = ("_task", "_watch")

    def __init__(self, task: Task, watch: RiskWatch) -> None:
        self._task = task
        self._watch = watch

    def time_left(self) -> float | None:
        """Seconds to the node's fencing deadline while it holds the claim (None: unbounded)."""
        return self._watch.claim_time_left(self._task)

    def valid_until(self) -> datetime | None:
        """The fencing deadline as a UTC time of this host (None: unbounded)."""
        left = self.time_left()
        if left is None:
            return None
        return self._watch.clock.now() + timedelta(seconds=left)

    def at_risk(self) -> bool:
        """Whether the claim is held and its node is at risk."""
        return self._watch.at_risk and bool(self.time_left())

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator that holds the claim (its node's): where a handler's own fenced
        writes about it go (``ctx.complete(conn=)``, ``ctx.checkpoint``)."""
        return self._watch.coordinator

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        # A copied or unpickled task is not the claimed one: it carries no claim.
        return (_no_claim, ())


def _no_claim() -> None:
    return None


class RiskWatch:
    """The node's at-risk watcher (one thread) and the fan-out to its handlers.

    ``running`` and ``lock`` are the consumer's; ``renewed`` and ``failed`` are called by
    the coordinator's context on each renewal's outcome. On a store without
    ``lease_timing()`` (memory) :meth:`run` returns at once and nothing is ever at risk.
    """

    def __init__(self, ctx: PartsContext, share: float = DEFAULT_WARN_SHARE) -> None:
        coordinator = ctx.coordinator
        self._coord = coordinator
        self._running: Mapping[str, Running] = ctx.running
        self._consumer_lock = ctx.lock
        self.clock = ctx.clock
        self._log = ctx.log
        timing = getattr(coordinator, "lease_timing", None)
        self._episode = RiskEpisode(RiskRule(timing(), share)) if callable(timing) else None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._failing = False
        self._warned: set[Running] = set()  # told in this episode (identity: eq=False)
        self._until: datetime | None = None  # valid_until at the warning
        self._warned_at = 0.0  # monotonic time of the warning

    @property
    def at_risk(self) -> bool:
        """Whether an at-risk episode is on."""
        return self._episode is not None and self._episode.at_risk

    @property
    def coordinator(self) -> Coordinator:
        """The node's coordinator."""
        return self._coord

    def claim_time_left(self, task: Task) -> float | None:
        """The coordinator's ``claim_time_left`` (no I/O)."""
        return self._coord.claim_time_left(task)

    def attach(self, task: Task) -> Task:
        """Give ``task`` (just claimed) its :class:`ClaimView`; returns it."""
        object.__setattr__(task, "_claim", ClaimView(task, self))
        return task

    # -- news from the lease (any thread; must not block) ---------------------------------

    def renewed(self) -> None:
        """A renewal got through."""
        with self._lock:
            news = self._failing or self.at_risk
            self._failing = False
        if news:
            self._wake.set()

    def failed(self, error: BaseException) -> None:
        """A renewal failed (``error``: why). Ignored once the lease is gone: a failure
        counts for the lease it was meant to renew, not for the next registration's."""
        if not self._coord.lease_time_left():
            return
        with self._lock:
            self._failing = True
        self._wake.set()

    def close(self) -> None:
        """End :meth:`run`."""
        self._closed.set()
        self._wake.set()

    # -- the thread -----------------------------------------------------------------------

    def run(self) -> None:
        """Look at the lease whenever a point is due or news came, until :meth:`close`."""
        episode = self._episode
        if episode is None:
            return
        while not self._closed.is_set():
            self._wake.clear()
            self.look()
            left = self._coord.lease_time_left() or 0.0
            with self._lock:
                failing = self._failing
            wait = episode.next_look(left, failing)
            # Without a lease, only a renewal (after re-registering) changes anything: look
            # again one renewal interval later in case that news does not come.
            self.clock.wait(self._wake, episode.rule.timing.renew_every if wait is None
                            else wait + _EPSILON)

    def look(self) -> Change | None:
        """One look at the lease; fans out and returns the change it made, if any."""
        episode = self._episode
        left = self._coord.lease_time_left()
        if episode is None or left is None:
            return None
        with self._lock:
            if left <= 0.0:
                self._failing = False  # the lease is gone: its failures with it
            failing = self._failing
        change = episode.step(left, failing)
        if change is not None:
            self._announce(change, left)
        return change

    def started(self, entry: Running) -> None:
        """A handler just started: tell it if an episode is on."""
        if self.at_risk:
            self._tell(entry, Change.WARN)

    # -- fan-out --------------------------------------------------------------------------

    def _announce(self, change: Change, left: float) -> None:
        now = self.clock.monotonic()
        until = self.clock.now() + timedelta(seconds=left)
        if change is Change.LOST:
            with self._lock:
                count = len(self._warned)
                self._warned.clear()
            self._log.warning("node %s fenced %.2fs after its at-risk warning; %d handler(s) "
                              "were warned", self._coord.node_id, now - self._warned_at, count,
                              extra={"action": "at_risk_lost", "lead_s": now - self._warned_at})
            return
        with self._consumer_lock:
            entries = [e for e in self._running.values()
                       if e.run is not None and e.stopped is None and not e.lost]
        if change is Change.WARN:
            with self._lock:
                self._until, self._warned_at = until, now
            self._log.warning("lease renewals of node %s are failing: %d claim(s) at risk, "
                              "guaranteed until %s (%.2fs left)", self._coord.node_id,
                              len(entries), until.isoformat(), left, extra={"action": "at_risk"})
        else:
            self._log.info("lease renewals of node %s succeed again (%.2fs after the warning): "
                           "claims guaranteed until %s", self._coord.node_id, now - self._warned_at,
                           until.isoformat(), extra={"action": "recovered"})
            with self._lock:
                warned, self._warned = self._warned, set()
            entries = [e for e in entries if e in warned]
        for n, entry in enumerate(entries):
            self._tell(entry, change, until, quiet=n >= _LOGGED_TASKS)

    def _tell(self, entry: Running, change: Change, until: datetime | None = None,
              quiet: bool = False) -> None:
        """Deliver ``change`` to ``entry``'s handler (a warning once per episode)."""
        with self._lock:
            if change is Change.WARN:
                if entry in self._warned:
                    return
                self._warned.add(entry)
                until = until or self._until
        if until is None:
            return
        task = entry.task
        level = 10 if quiet else 20  # DEBUG / INFO
        self._log.log(level, "task %s (token %d): claim %s, guaranteed until %s", task.id,
                      task.token, "at risk" if change is Change.WARN else "safe again",
                      until.isoformat(), extra={"task": task.id, "token": task.token,
                                                "action": change.value})
        hook = getattr(entry.handler, change.value, None)
        if not callable(hook):
            return
        run = entry.run

        def call() -> None:
            _call_hook(hook, until, entry, self._log)

        if isinstance(run, AsyncRun):
            run.call(call)  # on the event loop's thread, like stop()
        else:
            call()


def _call_hook(hook: Callable[[datetime], Any], until: datetime, entry: Running,
               log: NodeLog) -> None:
    try:
        hook(until)
    except Exception:
        log.exception("%s() of the handler of task %s raised", getattr(hook, "__name__", "hook"),
                      entry.task.id, extra={"task": entry.task.id, "action": "at_risk"})
