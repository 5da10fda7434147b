"""The pace of a :class:`~metafora.balancers.fair.FairBalancer`: the cold start's wait, the
short-task verdict, and the offers it refused while a lighter peer might take them (see the
balancer's docstring, "Cold start", "Short tasks" and "Claiming")."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from metafora.balancers._fair_counts import Snapshot
from metafora.contracts.balancer import BalancerContext
from metafora.core.clock import Clock

__all__ = ["MAX_REFUSALS", "Pace", "Refusals"]

_WARMUP_MAX = 4  # a cold start never waits more than this many warmups in all
_PROBE = 200  # a cold node may hold 1/_PROBE of the work while it waits (at least one task)
_COLD_HELD = 10  # while the cluster holds less than 1/_COLD_HELD of its work, a start is cold
_SHORT_MIN_RUNS = 8  # short-task mode needs this many runs ended in the last window
_SHORT_WINDOW = 10  # the window, in short_run units
_SHORT_RECHECK = 0.25  # seconds a short-mode verdict is kept
_REFUSED_KEEP = timedelta(seconds=60)  # how long a first refusal is remembered past its ignore
_REFUSED_PRUNE_AT = 1024  # prune remembered refusals once there are this many
MAX_REFUSALS = 5  # refuse_for periods an offer may wait for a lighter node before it is taken


@dataclass
class _ColdStart:
    """A cold start in progress: when it began, the members seen last and since when."""

    began: float  # monotonic
    members: frozenset[str]
    quiet_since: float  # monotonic time of the last change of ``members``


class Pace:
    """Whether a node waits at a cold start, and whether its tasks are short."""

    def __init__(self, warmup: float, warmup_backlog: int, short_run: float) -> None:
        self.warmup = warmup
        self.warmup_backlog = warmup_backlog
        self.short_run = short_run
        self._lock = threading.Lock()
        self._cold: _ColdStart | None = None  # a cold start in progress
        self._short_seen: tuple[float, bool] | None = None  # (monotonic, short) last verdict

    def start(self, node_id: str, mono: float) -> None:
        """A new context: a cold start begins now (when there is a warmup)."""
        with self._lock:
            self._cold = _ColdStart(mono, frozenset({node_id}), mono) if self.warmup > 0 else None
            self._short_seen = None

    @property
    def cold(self) -> bool:
        """Whether a cold start is in progress."""
        return self._cold is not None

    def joined(self, mono: float) -> None:
        """A node joined: a cold start waits for the membership to hold still."""
        with self._lock:
            if self._cold is not None:
                self._cold.quiet_since = mono

    def warming(self, ctx: BalancerContext, clock: Clock,
                snap: Snapshot) -> tuple[float | None, bool]:
        """(seconds left of the cold-start wait, 0.0 to claim as the probe, or None; whether
        the wait just ended)."""
        with self._lock:
            cold = self._cold
            if cold is None:
                return None, False
            mono = clock.monotonic()
            members = frozenset(snap.counts) | {ctx.node_id}
            if members != cold.members:
                cold.members, cold.quiet_since = members, mono
            end = min(cold.quiet_since + self.warmup, cold.began + _WARMUP_MAX * self.warmup)
        held = ctx.task_count()
        cluster_held = held + sum(max(0, int(n)) for node, n in snap.counts.items()
                                  if node != ctx.node_id)
        claimable = snap.claimable if snap.claimable is not None else ctx.claimable_count()
        work = cluster_held + max(0, claimable or 0)
        if (mono < end and work >= max(1, self.warmup_backlog)
                and cluster_held * _COLD_HELD < work):
            if held < max(1, work // _PROBE):
                return 0.0, False
            return end - mono, False
        with self._lock:
            self._cold = None
        return None, mono >= end

    def short(self, ctx: BalancerContext, clock: Clock) -> bool:
        """Whether this node runs short tasks now; the verdict is kept a quarter of a second."""
        runs = ctx.runs
        if runs is None or self.short_run <= 0:
            return False
        mono = clock.monotonic()
        with self._lock:
            seen = self._short_seen
        if seen is not None and mono - seen[0] < _SHORT_RECHECK:
            return seen[1]
        window = _SHORT_WINDOW * self.short_run
        count, median = runs.recent(window)
        short = count >= _SHORT_MIN_RUNS and median is not None and median < self.short_run
        if short:
            now = clock.now()
            running = [rt for rt in ctx.tasks() if rt.stopped is None]
            old = sum(1 for rt in running if (now - rt.started).total_seconds() > window)
            short = 4 * old <= len(running)
        with self._lock:
            if short and self._cold is not None:
                self._cold = None  # nothing to wait for: completion evens short tasks
            # Too few runs yet is no verdict: the next run to end may decide (and
            # refusals_lifted asks right then), so it is not kept.
            self._short_seen = (mono, short) if count >= _SHORT_MIN_RUNS else None
        return short


class Refusals:
    """The offers refused above the share, each with its episode: (ignored until, first
    refused). The caller holds its balancer's lock."""

    def __init__(self, refuse_for: timedelta) -> None:
        self.refuse_for = refuse_for
        self._refused: dict[str, tuple[datetime, datetime]] = {}  # id -> (until, first)
        self._prune_at = _REFUSED_PRUNE_AT

    def clear(self) -> None:
        """Forget every refusal."""
        self._refused.clear()
        self._prune_at = _REFUSED_PRUNE_AT

    def forget(self, task_id: str) -> None:
        """The task may be claimed: its episode ends."""
        self._refused.pop(task_id, None)

    def refuse(self, task_id: str, now: datetime, room: bool) -> datetime | None:
        """Until when to refuse an offer above the share (``room``: a lighter peer still has
        room below its share); None to claim it after all: nobody lighter took it."""
        seen = self._refused.get(task_id)
        if seen is not None and now - seen[0] > 2 * self.refuse_for:
            # An old episode (refused at a cold start, then claimed elsewhere; offered
            # again now because it was released): a new refusal, not a long wait.
            seen = None
        if seen is None:
            until = now + self.refuse_for
            self._refused[task_id] = (until, now)
            self._prune(now)
            return until
        until, first = seen
        if now < until:
            return until
        waited = now - first
        if room and waited < MAX_REFUSALS * self.refuse_for:
            # A lighter peer still has room: it may be slow, not gone. Wait again (twice
            # refuse_for at most, so an offer is judged again soon after the counts
            # change), but never forever: it may also be full or unable to run it.
            until = now + min(2 * self.refuse_for, max(self.refuse_for, waited))
            self._refused[task_id] = (until, first)
            return until
        del self._refused[task_id]
        return None

    def _prune(self, now: datetime) -> None:
        """Forget old first refusals.

        Once the map has grown to twice its size after the last pruning, not on every
        refusal past a fixed size: a storm refuses tens of thousands of offers within the
        horizon, and walking them all per refusal made ``can_claim`` quadratic.
        """
        if len(self._refused) < self._prune_at:
            return
        horizon = now - max(_REFUSED_KEEP, 10 * self.refuse_for)
        for task_id in [tid for tid, (until, _) in self._refused.items() if until < horizon]:
            del self._refused[task_id]
        self._prune_at = max(_REFUSED_PRUNE_AT, 2 * len(self._refused))
