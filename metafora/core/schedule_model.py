"""Periodic tasks as values: schedules, their ticks, and which ticks are due.

A :class:`Schedule` says when (``every`` N seconds, or a ``cron`` expression, in UTC) a task
is made from its ``props``. This module holds the values and the rules every store and the
:class:`~metafora.consumer.schedule.Scheduler` share: validation, tick computation and the missed-tick
policy. It imports nothing of the coordinator, so the coordinator interface
(:meth:`~metafora.contracts.coordinator.Coordinator.materialise`, ``Client.add_schedule``) can name
these values while the loop in :mod:`metafora.consumer.schedule` drives a coordinator.

Tick times:

- ``every``: the multiples of the period since the Unix epoch (``5m`` ticks at :00, :05...).
- ``cron``: the times the expression names, in UTC (parsed by ``croniter``).

A tick is *on time* while it is at most :data:`LATE_AFTER` old: such ticks are always
materialised, one task each, whatever the policy (a node that woke a little late loses
nothing). Older ticks were *missed* (the whole cluster was down) and follow the schedule's
``missed`` policy: ``skip`` (none of them), ``once`` (one task, for the latest missed tick) or
``all`` (one task each, the latest :data:`MAX_CATCH_UP` of them; older ones are dropped with
a warning).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from metafora.core.durations import format_duration, whole_seconds
from metafora.core.errors import ConfigError, InvalidProps, InvalidTaskId
from metafora.core.task import MAX_TASK_ID_LENGTH, Task, validate_task_id

__all__ = [
    "LATE_AFTER",
    "MAX_CATCH_UP",
    "MAX_TICKS_PER_STEP",
    "MISSED_POLICIES",
    "Due",
    "Schedule",
    "due",
    "new_schedule",
    "tick_id",
]

MISSED_POLICIES = ("skip", "once", "all")
"""What to do with ticks missed while the whole cluster was down."""

MAX_CATCH_UP = 100
"""``missed="all"`` makes at most this many tasks for missed ticks at once (the latest ones)."""

MAX_TICKS_PER_STEP = 25
"""Ticks settled by one atomic step (an etcd txn holds at most 128 operations, 4 a task);
more are settled in several steps, oldest first."""

LATE_AFTER = timedelta(seconds=30)
"""A tick older than this when a node gets to it was missed; younger ones are on time."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_TICK_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_TICK_SUFFIX = len("@2026-11-23T14:05:00Z")
MAX_NAME_LENGTH = MAX_TASK_ID_LENGTH - _TICK_SUFFIX
"""The longest schedule name: its tasks' ids add ``@`` and the tick time."""

_TIME_PROPS = ("launch_at", "expires_at")


def _croniter(expr: str, start: datetime) -> Any:
    from croniter import croniter

    return croniter(expr, start)


def check_cron(expr: object) -> str:
    """``expr`` if croniter understands it, else a ConfigError naming the expression."""
    if not isinstance(expr, str) or not expr.strip():
        raise ConfigError(f"a cron expression must be a non-empty string, got {expr!r}")
    from croniter import CroniterBadDateError, CroniterError

    try:
        _croniter(expr, _EPOCH).get_next(datetime)
    except CroniterBadDateError:
        raise ConfigError(f"cron expression {expr!r} never matches a date") from None
    except (CroniterError, ValueError, KeyError) as exc:
        raise ConfigError(f"unknown cron syntax {expr!r}: {exc}") from None
    return expr.strip()


def check_name(name: object) -> str:
    """A schedule name: a valid task id prefix, short enough for its ticks' ids."""
    try:
        validate_task_id(name)
    except InvalidTaskId as exc:
        raise InvalidTaskId(f"bad schedule name: {exc}") from None
    assert isinstance(name, str)
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidTaskId(
            f"schedule name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH} "
            f"(its tasks' ids add the tick time)"
        )
    return name


def tick_id(name: str, tick: datetime) -> str:
    """The id of the task made for ``tick`` of schedule ``name`` (``NAME@2026-11-23T14:05:00Z``)."""
    return f"{name}@{tick.astimezone(UTC).strftime(_TICK_FORMAT)}"


def _whole_second(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(microsecond=0)


@dataclass(frozen=True)
class Schedule:
    """A periodic task as stored: when it ticks, what its tasks carry, and how far it got.

    Exactly one of ``every`` (seconds) and ``cron`` is set. ``cursor``: every tick at or
    before it is settled (made into a task, skipped as missed, or passed while paused).
    ``version``: the store's compare-and-set token of the row (its meaning is the store's).
    """

    name: str
    every: int | None
    cron: str | None
    props: Mapping[str, Any] = field(default_factory=dict)
    missed: str = "skip"
    paused: bool = False
    cursor: datetime = _EPOCH
    created_at: datetime | None = None
    version: int = 0

    @property
    def spec(self) -> str:
        """``every 5m`` or ``cron */5 * * * *``, for listings."""
        if self.every is not None:
            return f"every {format_duration(self.every)}"
        return f"cron {self.cron}"

    def next_tick(self, after: datetime) -> datetime:
        """The first tick strictly after ``after``."""
        if self.every is not None:
            step = timedelta(seconds=self.every)
            count = (after.astimezone(UTC) - _EPOCH) // step
            return _EPOCH + (count + 1) * step
        assert self.cron is not None
        result: datetime = _croniter(self.cron, after.astimezone(UTC)).get_next(datetime)
        return result.astimezone(UTC)

    def last_tick(self, at: datetime) -> datetime:
        """The latest tick at or before ``at``."""
        if self.every is not None:
            step = timedelta(seconds=self.every)
            return _EPOCH + ((at.astimezone(UTC) - _EPOCH) // step) * step
        assert self.cron is not None
        # croniter works in whole seconds: look back from the next second, then check.
        probe = _whole_second(at) + timedelta(seconds=1)
        result: datetime = _croniter(self.cron, probe).get_prev(datetime)
        result = result.astimezone(UTC)
        return result if result <= at else self._prev_tick(result)

    def _prev_tick(self, before: datetime) -> datetime:
        if self.every is not None:
            return before - timedelta(seconds=self.every)
        assert self.cron is not None
        result: datetime = _croniter(self.cron, before).get_prev(datetime)
        return result.astimezone(UTC)

    def task(self, tick: datetime) -> Task:
        """The task made for ``tick``."""
        return Task(tick_id(self.name, tick), dict(self.props))


def new_schedule(
    name: str,
    *,
    every: object = None,
    cron: object = None,
    props: Mapping[str, Any] | None = None,
    missed: str = "skip",
    now: datetime,
) -> Schedule:
    """A validated new schedule whose first tick is the first one after ``now``."""
    check_name(name)
    if (every is None) == (cron is None):
        raise ConfigError("give exactly one of every (a duration like 5m) and cron (an expression)")
    period = None if every is None else whole_seconds(every, "a schedule period")
    expr = None if cron is None else check_cron(cron)
    if missed not in MISSED_POLICIES:
        raise ConfigError(f"missed must be one of {', '.join(MISSED_POLICIES)}, got {missed!r}")
    if props is not None and not isinstance(props, Mapping):
        raise InvalidProps(f"schedule props must be a JSON object, not {type(props).__name__}")
    props = dict(props or {})
    fixed = sorted(k for k in _TIME_PROPS if k in props)
    if fixed:
        # Every tick's task would carry the same absolute time: one past it, all are wrong.
        raise InvalidProps(f"schedule props must not set {', '.join(fixed)} (every tick's task "
                           "would share that one time)")
    Task(tick_id(name, now), props).props_json()  # the size and shape rules of task props
    return Schedule(name, period, expr, props, missed, False, now.astimezone(UTC), now, 0)


@dataclass(frozen=True)
class Due:
    """What one look at a schedule found to do: the ticks to make tasks of (oldest first),
    the new cursor, and how many missed ticks were dropped (``skip``, ``once``, the bound)."""

    ticks: list[datetime]
    cursor: datetime
    dropped: int


def due(schedule: Schedule, now: datetime) -> Due | None:
    """The ticks of ``schedule`` due at ``now`` under its missed policy, or None."""
    if schedule.paused:
        return None
    cursor = schedule.cursor
    if schedule.next_tick(cursor) > now:
        return None
    late_edge = now - LATE_AFTER
    ticks: list[datetime] = []
    # On-time ticks: at most LATE_AFTER / 1 s of them, walked forward.
    tick = schedule.next_tick(max(cursor, late_edge))
    while tick <= now:
        ticks.append(tick)
        tick = schedule.next_tick(tick)
    missed: list[datetime] = []
    dropped = 0
    if cursor < late_edge:
        latest_missed = schedule.last_tick(late_edge)
        if latest_missed > cursor:
            total = _count_missed(schedule, cursor, latest_missed)
            if schedule.missed == "once":
                missed = [latest_missed]
            elif schedule.missed == "all":
                walk = latest_missed
                while walk > cursor and len(missed) < MAX_CATCH_UP:
                    missed.append(walk)
                    walk = schedule._prev_tick(walk)
                missed.reverse()
                if walk > cursor and total is None:
                    total = MAX_CATCH_UP + 1  # at least; cron gaps are not counted
            dropped = (total or len(missed)) - len(missed)
    if not ticks and not missed and dropped == 0:
        return None
    new_cursor = ticks[-1] if ticks else schedule.last_tick(now)
    return Due(missed + ticks, max(new_cursor, cursor), dropped)


def _count_missed(schedule: Schedule, cursor: datetime, latest: datetime) -> int | None:
    """How many ticks lie in (cursor, latest]; None when counting would mean walking (cron)."""
    if schedule.every is not None:
        step = timedelta(seconds=schedule.every)
        first = schedule.next_tick(cursor)
        return max(0, (latest - first) // step + 1)
    count = 0
    walk = latest
    while walk > cursor:
        count += 1
        if count > MAX_CATCH_UP:
            return None
        walk = schedule._prev_tick(walk)
    return count
