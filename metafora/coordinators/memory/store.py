"""The shared in-process store behind every ``memory://NAME`` of one process: rows, nodes, schedules."""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from metafora.contracts.coordinator import (
    CoordinatorContext,
)
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.config import OptionReader, StoreURL
from metafora.core.errors import (
    ConfigError,
)
from metafora.core.holds import held_against
from metafora.core.leases import LeaseTTL, read_lease_ttl
from metafora.core.limits import GroupUsage, Limit
from metafora.core.schedule_model import Schedule
from metafora.core.task import (
    Task,
    TaskInfo,
    TaskState,
)

log = logging.getLogger(__name__)


LEASE_TTL = LeaseTTL(minimum=0.1)
"""The memory store's bounds on ``lease_ttl``: accepted for parity with the real stores, not
used (memory nodes hold their claims until ``close()``)."""

POLL_SECONDS = 1.0  # real seconds between re-checks of launch_at / expires_at while idle


@dataclass
class Row:
    task_id: str
    props: dict[str, Any]
    state: TaskState
    created_at: datetime
    owner: str | None = None
    token: int = 0
    claimed_at: datetime | None = None
    error: str | None = None
    finished_at: datetime | None = None
    attempts: int = 0
    crashes: int = 0  # latest claims in a row that ended with their node dead
    ready: int = 0  # store version at which the row last became claimable
    selector: dict[str, str] = field(default_factory=dict)
    priority: int = 0
    prefer: dict[str, str] = field(default_factory=dict)
    spread: str | None = None
    group: str | None = None
    held_for: str | None = None  # released held for this node id until held_until (holds.py)
    held_until: datetime | None = None
    _times: tuple[datetime | None, datetime | None] | None = field(default=None, repr=False)

    @classmethod
    def new(cls, task: Task, now: datetime) -> Row:
        return cls(task.id, dict(task.props), TaskState.PENDING, now,
                   selector=dict(task.selector), priority=task.priority,
                   prefer=dict(task.prefer), spread=task.spread, group=task.group)

    def task(self) -> Task:
        return Task(self.task_id, self.props, self.token, selector=self.selector,
                    priority=self.priority, prefer=self.prefer, spread=self.spread,
                    group=self.group)

    def times(self) -> tuple[datetime | None, datetime | None]:
        """(launch_at, expires_at) of its props, parsed once (a row's props never change:
        a resubmit makes a new row): sweeps and claims ask this for every row."""
        if self._times is None:
            task = self.task()
            self._times = (task.launch_at, task.expires_at)
        return self._times

    def info(self, now: datetime | None = None) -> TaskInfo:
        held = (self.state is TaskState.PENDING and self.held_until is not None
                and (now is None or now < self.held_until))
        return TaskInfo(
            id=self.task_id,
            props=dict(self.props),
            state=self.state,
            owner=self.owner,
            token=self.token,
            claimed_at=self.claimed_at,
            error=self.error,
            created_at=self.created_at,
            finished_at=self.finished_at,
            attempts=self.attempts,
            selector=dict(self.selector),
            priority=self.priority,
            prefer=dict(self.prefer),
            spread=self.spread,
            group=self.group,
            held_for=self.held_for if held else None,
            held_until=self.held_until if held else None,
        )

    def hold(self, node_id: str | None, until: datetime | None) -> None:
        """Hold the (pending) row for ``node_id`` until ``until``; None clears the hold."""
        self.held_for, self.held_until = (node_id, until) if node_id is not None else (None, None)


@dataclass
class NodeRecord:
    node_id: str
    ctx: CoordinatorContext
    started: datetime
    commands: deque[str] = field(default_factory=deque)
    frozen: bool = False
    leaving: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    weight: float = 1.0


class MemoryStore:
    """The shared state behind one ``memory://NAME``. All access holds ``cond``."""

    def __init__(self, name: str, clock: Clock) -> None:
        self.name = name
        self.clock = clock
        self.cond = threading.Condition()
        self.tasks: dict[str, Row] = {}
        self.nodes: dict[str, NodeRecord] = {}
        self.token_seq = 0
        self.version = 0
        self.schedules: dict[str, Schedule] = {}
        self.schedule_seq = 0  # the schedules' compare-and-set versions
        self.schedule_listeners: list[Callable[[], None]] = []
        self.member_listeners: list[Callable[[], None]] = []
        # Each task's state-machine state: (claim token, body, the row it belongs to). The
        # coordinator keeps where it lives, as SQL's metafora_state and etcd's state/<id>
        # do; what it means is the state machine's (metafora.coordinators.memory.states).
        self.task_states: dict[str, tuple[int, str, weakref.ref[Row]]] = {}
        self.limits: dict[str, Limit] = {}
        self.rate_log: dict[str, deque[datetime]] = {}  # claim times per rate-limited group
        # Rows with a launch_at or expires_at: the only ones a sweep or a launch wait reads.
        self.timed: dict[str, Row] = {}
        # Rows that became claimable, in that order (id -> their ``ready`` version): a watch
        # reads only those newer than its last round, not every row. A claim, an end or a
        # delete takes a row out.
        self.ready_rows: dict[str, int] = {}
        self.members_seq = 0  # bumped when a node joins or leaves: a watch then reads all
        # Rows released held for a node (holds.py): a watch re-offers them when the hold ends.
        self.held_rows: dict[str, Row] = {}

    def make_ready(self, row: Row, version: int) -> None:
        """``row`` became claimable at ``version`` (a submit, a release, a retry...)."""
        row.ready = version
        self.ready_rows.pop(row.task_id, None)
        self.ready_rows[row.task_id] = version

    def ready_since(self, version: int) -> list[Row]:
        """Rows that became claimable after ``version`` (newest first)."""
        rows = []
        for task_id, ready in reversed(self.ready_rows.items()):
            if ready <= version:
                break
            row = self.tasks.get(task_id)
            if row is not None:
                rows.append(row)
        return rows

    def _held(self) -> list[Row]:
        """The held rows still pending and held (others are dropped from ``held_rows``)."""
        rows = []
        for task_id, row in list(self.held_rows.items()):
            if (self.tasks.get(task_id) is not row or row.state is not TaskState.PENDING
                    or row.held_until is None):
                del self.held_rows[task_id]
            else:
                rows.append(row)
        return rows

    def unheld(self, now: datetime) -> list[Row]:
        """Held rows whose hold is over (a watch offers them to every node when it is)."""
        return [r for r in self._held() if r.held_until is not None and r.held_until <= now]

    def next_unhold(self, now: datetime) -> float | None:
        """Seconds until the soonest hold ends, if any (one timer, not one per task)."""
        ends = [(r.held_until - now).total_seconds() for r in self._held()
                if r.held_until is not None and r.held_until > now]
        return min(ends, default=None)

    def release_row(self, row: Row, version: int, hold: tuple[str, datetime] | None) -> None:
        """Make a claimed ``row`` pending again at ``version``, held for ``hold`` if given."""
        row.state = TaskState.PENDING
        row.owner = None
        row.claimed_at = None
        row.hold(*(hold or (None, None)))
        if hold is not None:
            self.held_rows[row.task_id] = row
        self.make_ready(row, version)

    def drain(self, node_id: str) -> int:
        """Hand the rows held for ``node_id`` to every node now; how many there were."""
        now = self.clock.now()
        rows = [r for r in self._held() if r.held_for == node_id
                and r.held_until is not None and r.held_until > now]
        if rows:
            version = self.bump()
            for row in rows:
                row.hold(None, None)
                self.make_ready(row, version)
        return len(rows)

    def launched(self, now: datetime) -> list[Row]:
        """Pending rows whose launch time has come (a watch offers them when it does)."""
        return [r for r in self._timed_rows() if r.state is TaskState.PENDING
                and (launch := r.times()[0]) is not None and launch <= now]

    def add(self, row: Row) -> None:
        """Store a new row (the caller checked its id is free, or replaces the old row)."""
        self.tasks[row.task_id] = row
        if row.times() != (None, None):
            self.timed[row.task_id] = row

    def group_usage(self, group: str, now: datetime) -> GroupUsage | None:
        """The usage of a limited group now (None: no limit); prunes its rate log."""
        limit = self.limits.get(group)
        if limit is None:
            return None
        running = sum(1 for row in self.tasks.values() if row.group == group
                      and row.state is TaskState.CLAIMED and row.owner in self.nodes)
        recent = 0
        if limit.rate is not None:
            log_ = self.rate_log.setdefault(group, deque())
            edge = now - timedelta(seconds=limit.rate.window)
            while log_ and log_[0] <= edge:
                log_.popleft()
            recent = len(log_)
        return GroupUsage(limit, running, recent)

    def take_slot(self, group: str | None, now: datetime) -> bool:
        """Whether a claim of a task of ``group`` fits its limit now; if so, it is counted
        (the caller holds ``cond`` and makes the claim)."""
        if group is None:
            return True
        usage = self.group_usage(group, now)
        if usage is None:
            return True
        if usage.full() is not None:
            return False
        if usage.limit.rate is not None:
            self.rate_log[group].append(now)
        return True

    def task_state(self, task_id: str) -> tuple[int, str] | None:
        """(token, body) of the task's stored state-machine state, or None (the caller
        holds ``cond``). An entry left by a deleted task (perhaps submitted again under
        the same id: a new row) is dropped."""
        held = self.task_states.get(task_id)
        if held is None:
            return None
        if held[2]() is not self.tasks.get(task_id):
            del self.task_states[task_id]
            return None
        return held[0], held[1]

    def put_task_state(self, task_id: str, token: int, body: str) -> None:
        """Store the state-machine state of an existing task, written under claim ``token``
        (the caller holds ``cond``)."""
        self.task_states[task_id] = (token, body, weakref.ref(self.tasks[task_id]))

    def schedule_changed(self, schedule: Schedule | None, name: str) -> None:
        """Store ``schedule`` (None: delete ``name``) with a fresh version; tell the listeners."""
        if schedule is None:
            self.schedules.pop(name, None)
        else:
            self.schedule_seq += 1
            self.schedules[name] = dataclasses.replace(schedule, version=self.schedule_seq)
        for wake in self.schedule_listeners:
            wake()

    def members_changed(self) -> None:
        """A node joined, left or announced leaving: tell every listening coordinator."""
        for listener in list(self.member_listeners):
            try:
                listener()
            except Exception:
                log.exception("a membership listener of %s raised", self.name)

    def bump(self) -> int:
        """Note a change that may make tasks claimable; wake watchers."""
        self.version += 1
        self.cond.notify_all()
        return self.version

    def claimable(self, row: Row, now: datetime, node_id: str | None = None) -> bool:
        """Whether ``row`` may be claimed now (by ``node_id``: a hold for another node
        refuses it; None, an operator's count, ignores holds)."""
        if row.state is TaskState.CLAIMED:
            return row.owner not in self.nodes
        if row.state is not TaskState.PENDING:
            return False
        if node_id is not None and held_against(row.held_for, row.held_until, node_id, now):
            return False
        launch = row.times()[0]
        return launch is None or launch <= now

    def _timed_rows(self) -> list[Row]:
        """The timed rows still stored and not finished (others are dropped from ``timed``)."""
        rows = []
        for task_id, row in list(self.timed.items()):
            if self.tasks.get(task_id) is not row or row.finished_at is not None:
                del self.timed[task_id]
            else:
                rows.append(row)
        return rows

    def sweep(self, now: datetime) -> None:
        """Move pending tasks past their expires_at to expired."""
        for row in self._timed_rows():
            if row.state is TaskState.PENDING:
                expires = row.times()[1]
                if expires is not None and expires <= now:
                    row.state = TaskState.EXPIRED
                    row.finished_at = now
                    self.ready_rows.pop(row.task_id, None)

    def next_launch(self, now: datetime) -> float | None:
        """Seconds until the earliest future launch_at, if any."""
        soonest: float | None = None
        for row in self._timed_rows():
            if row.state is TaskState.PENDING:
                launch = row.times()[0]
                if launch is not None and launch > now:
                    wait = (launch - now).total_seconds()
                    soonest = wait if soonest is None else min(soonest, wait)
        return soonest

    def free_claims(self, node_id: str, *, crashed: bool = False,
                    hold: tuple[str, datetime] | None = None) -> list[Task]:
        """Make every claim of ``node_id`` pending again; return the tasks it held.

        ``crashed``: the node died (its lease was lost), so each claim counts as a crash;
        ``hold``: (node id, until) to hold them for (a graceful close, see holds.py)."""
        rows = [r for r in self.tasks.values() if r.state is TaskState.CLAIMED and r.owner == node_id]
        freed = [row.task() for row in rows]
        if rows:
            version = self.bump()
            for row in rows:
                row.crashes = row.crashes + 1 if crashed else 0
                self.release_row(row, version, hold)
        return freed

    def counts(self, *, active: bool = False) -> dict[str, int]:
        counts = dict.fromkeys((n for n, node in self.nodes.items()
                                if not (active and node.leaving)), 0)
        for row in self.tasks.values():
            if row.state is TaskState.CLAIMED and row.owner in counts:
                counts[row.owner] += 1
        return counts


_STORES: dict[str, MemoryStore] = {}
_STORES_LOCK = threading.Lock()


def get_store(name: str, clock: Clock | None = None) -> MemoryStore:
    """The store for ``memory://name`` in this process (created on first use)."""
    with _STORES_LOCK:
        store = _STORES.get(name)
        if store is None:
            store = _STORES[name] = MemoryStore(name, clock or SYSTEM_CLOCK)
        return store


def drop_store(name: str) -> None:
    """Forget ``memory://name`` (tests use it to start from nothing)."""
    with _STORES_LOCK:
        _STORES.pop(name, None)


def store_for(url: StoreURL, options: dict[str, Any]) -> MemoryStore:
    clock = options.pop("clock", None)
    if clock is not None and not isinstance(clock, Clock):
        raise ConfigError("option 'clock' must be a metafora.core.clock.Clock")
    reader = OptionReader(url, options)
    namespace = reader.namespace()
    # Accepted for parity with the real stores; memory nodes hold claims until close().
    read_lease_ttl(reader, LEASE_TTL, "memory")
    reader.number("poll_interval", 1.0, minimum=0.01, maximum=3600.0)
    reader.finish()
    if len(url.hosts) != 1 or url.path not in ("", "/"):
        raise ConfigError(f"memory URL must be memory://NAME, got {url}")
    return get_store(f"{url.hosts[0][0]}/{namespace}", clock)


