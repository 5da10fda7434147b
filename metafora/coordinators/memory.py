"""In-process coordinator: every ``memory://NAME`` opened in one process shares one store.

A product feature for users' tests and single-process programs, with the same semantics
as the real stores (see docs/coordinators.md). Nodes hold their claims until ``close()``;
:meth:`MemoryCoordinator.expire_lease` simulates a lost lease.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from metafora.clock import SYSTEM_CLOCK, Clock
from metafora.commands import Command
from metafora.config import OptionReader, StoreURL
from metafora.coordinator import (
    Client,
    Coordinator,
    CoordinatorContext,
    Finish,
    NodeInfo,
    TaskSink,
    as_sink,
    crash_limit_error,
    error_text,
)
from metafora.errors import (
    ClaimLost,
    ConfigError,
    CoordinatorClosed,
    InvalidCommand,
    MetaforaError,
    NodeExists,
    NodeNotFound,
    ScheduleExists,
    ScheduleNotFound,
    TaskExists,
    TaskNotFound,
)
from metafora.schedule import Schedule
from metafora.task import (
    Task,
    TaskInfo,
    TaskState,
    matches,
    validate_schedule,
    validate_task_id,
)
from metafora.task_retry import RetrySnapshot, StateRewrite, check_retryable

__all__ = ["MemoryClient", "MemoryCoordinator", "MemoryStore", "drop_store", "get_store"]

log = logging.getLogger(__name__)

_POLL = 1.0  # real seconds between re-checks of launch_at / expires_at while idle


@dataclass
class _Row:
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

    @classmethod
    def new(cls, task: Task, now: datetime) -> _Row:
        return cls(task.id, dict(task.props), TaskState.PENDING, now,
                   selector=dict(task.selector), priority=task.priority,
                   prefer=dict(task.prefer), spread=task.spread)

    def task(self) -> Task:
        return Task(self.task_id, self.props, self.token, selector=self.selector,
                    priority=self.priority, prefer=self.prefer, spread=self.spread)

    def info(self) -> TaskInfo:
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
        )


@dataclass
class _Node:
    node_id: str
    ctx: CoordinatorContext
    started: datetime
    commands: deque[str] = field(default_factory=deque)
    frozen: bool = False
    leaving: bool = False
    labels: dict[str, str] = field(default_factory=dict)


class MemoryStore:
    """The shared state behind one ``memory://NAME``. All access holds ``cond``."""

    def __init__(self, name: str, clock: Clock) -> None:
        self.name = name
        self.clock = clock
        self.cond = threading.Condition()
        self.tasks: dict[str, _Row] = {}
        self.nodes: dict[str, _Node] = {}
        self.token_seq = 0
        self.version = 0
        self.schedules: dict[str, Schedule] = {}
        self.schedule_seq = 0  # the schedules' compare-and-set versions
        self.schedule_listeners: list[Callable[[], None]] = []
        self.member_listeners: list[Callable[[], None]] = []
        # Each task's state-machine state: (claim token, body, the row it belongs to). The
        # coordinator keeps where it lives, as SQL's metafora_state and etcd's state/<id>
        # do; what it means is the state machine's (metafora.statemachine.stores.memory).
        self.task_states: dict[str, tuple[int, str, weakref.ref[_Row]]] = {}

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

    def claimable(self, row: _Row, now: datetime) -> bool:
        if row.state is TaskState.CLAIMED:
            return row.owner not in self.nodes
        if row.state is not TaskState.PENDING:
            return False
        launch = row.task().launch_at
        return launch is None or launch <= now

    def sweep(self, now: datetime) -> None:
        """Move pending tasks past their expires_at to expired."""
        for row in self.tasks.values():
            if row.state is TaskState.PENDING:
                expires = row.task().expires_at
                if expires is not None and expires <= now:
                    row.state = TaskState.EXPIRED
                    row.finished_at = now

    def next_launch(self, now: datetime) -> float | None:
        """Seconds until the earliest future launch_at, if any."""
        soonest: float | None = None
        for row in self.tasks.values():
            if row.state is TaskState.PENDING:
                launch = row.task().launch_at
                if launch is not None and launch > now:
                    wait = (launch - now).total_seconds()
                    soonest = wait if soonest is None else min(soonest, wait)
        return soonest

    def free_claims(self, node_id: str, *, crashed: bool = False) -> list[Task]:
        """Make every claim of ``node_id`` pending again; return the tasks it held.

        ``crashed``: the node died (its lease was lost), so each claim counts as a crash."""
        rows = [r for r in self.tasks.values() if r.state is TaskState.CLAIMED and r.owner == node_id]
        freed = [row.task() for row in rows]
        if rows:
            version = self.bump()
            for row in rows:
                row.state = TaskState.PENDING
                row.owner = None
                row.claimed_at = None
                row.crashes = row.crashes + 1 if crashed else 0
                row.ready = version
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


def _store_for(url: StoreURL, options: dict[str, Any]) -> MemoryStore:
    clock = options.pop("clock", None)
    if clock is not None and not isinstance(clock, Clock):
        raise ConfigError("option 'clock' must be a metafora.clock.Clock")
    reader = OptionReader(url, options)
    namespace = reader.namespace()
    # Accepted for parity with the real stores; memory nodes hold claims until close().
    reader.number("lease_ttl", 30.0, minimum=0.1)
    reader.number("poll_interval", 1.0, minimum=0.01)
    reader.finish()
    if len(url.hosts) != 1 or url.path not in ("", "/"):
        raise ConfigError(f"memory URL must be memory://NAME, got {url}")
    return get_store(f"{url.hosts[0][0]}/{namespace}", clock)


class MemoryCoordinator(Coordinator):
    """A node's coordinator on an in-process :class:`MemoryStore`."""

    claim_burst = 256  # claims are in-process: no round trip to save, no limit to mind

    def __init__(self, store: MemoryStore, node_id: str) -> None:
        self._store = store
        self._node_id = validate_task_id(node_id)
        self._ctx: CoordinatorContext | None = None
        self._closed = False
        self._schedule_wakes: list[Callable[[], None]] = []
        self._listening: list[Callable[[], None]] = []

    @property
    def name(self) -> str:
        return f"memory://{self._store.name}"

    @property
    def node_id(self) -> str:
        return self._node_id

    def init(self, ctx: CoordinatorContext) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            if self._node_id in s.nodes:
                raise NodeExists(f"node {self._node_id!r} is already live on {self.name}")
            s.nodes[self._node_id] = _Node(self._node_id, ctx, s.clock.now(), labels=dict(ctx.labels))
            self._ctx = ctx
            s.bump()
            s.members_changed()

    def _check_open(self) -> None:
        if self._closed:
            raise CoordinatorClosed(f"coordinator {self._node_id!r} on {self.name} is closed")

    def _require_node(self) -> None:
        self._check_open()
        if self._ctx is None:
            raise CoordinatorClosed("init(ctx) must be called before using the coordinator")
        if self._node_id not in self._store.nodes:
            # The lease was lost (expire_lease): come back as a fresh registration.
            self._store.nodes[self._node_id] = _Node(self._node_id, self._ctx, self._store.clock.now(),
                                                     labels=dict(self._ctx.labels))
            self._store.members_changed()

    def watch(self, out: TaskSink | queue.Queue[Task]) -> None:
        sink = as_sink(out)
        s = self._store
        offered: dict[str, int] = {}
        while True:
            with s.cond:
                if self._closed:
                    return
                now = s.clock.now()
                s.sweep(now)
                batch = [
                    row.task()
                    for row in s.tasks.values()
                    if s.claimable(row, now) and offered.get(row.task_id) != row.ready
                ]
                for task in batch:
                    offered[task.id] = s.tasks[task.id].ready
                version = s.version
            batch.sort(key=lambda t: -t.priority)  # higher priority offered first
            for task in batch:
                sink(task.with_token(0))
            with s.cond:
                if self._closed:
                    return
                if s.version == version:
                    nxt = s.next_launch(s.clock.now())
                    s.cond.wait(_POLL if nxt is None else min(_POLL, nxt))

    def claim(self, task: Task) -> Task | None:
        s = self._store
        with s.cond:
            self._require_node()
            row = s.tasks.get(task.id)
            now = s.clock.now()
            s.sweep(now)
            if row is None or not s.claimable(row, now):
                return None
            if self._ctx is not None and not matches(row.selector, self._ctx.labels):
                return None  # placement: this node's labels do not match the task's selector
            if row.state is TaskState.CLAIMED:  # taken over from a dead owner
                row.crashes += 1
            verdict = crash_limit_error(row.crashes, self._ctx.max_crashes if self._ctx else None)
            if verdict is not None:
                row.state, row.owner, row.error = TaskState.FAILED, None, verdict
                row.finished_at = now
                s.bump()
                return None
            s.token_seq += 1
            row.state = TaskState.CLAIMED
            row.owner = self._node_id
            row.token = s.token_seq
            row.claimed_at = now
            row.attempts += 1
            return row.task()

    def _fenced(self, task: Task) -> _Row:
        self._check_open()
        row = self._store.tasks.get(task.id)
        if (
            row is None
            or row.state is not TaskState.CLAIMED
            or row.owner != self._node_id
            or row.token != task.token
        ):
            raise ClaimLost(
                f"node {self._node_id!r} no longer holds task {task.id!r} with token {task.token}"
            )
        return row

    def release(self, task: Task) -> None:
        s = self._store
        with s.cond:
            row = self._fenced(task)
            row.state = TaskState.PENDING
            row.owner = None
            row.claimed_at = None
            row.crashes = 0
            row.ready = s.bump()

    def done(self, task: Task) -> None:
        self._finish(task, TaskState.DONE, None)

    def fail(self, task: Task, error: BaseException | str) -> None:
        self._finish(task, TaskState.FAILED, error_text(error))

    def finish_many(self, finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        """Every outcome under one hold of the store's lock (each fenced on its own)."""
        with self._store.cond:  # re-entrant: the single-outcome methods take it again
            return super().finish_many(finishes)

    def _finish(self, task: Task, state: TaskState, error: str | None) -> None:
        s = self._store
        with s.cond:
            row = self._fenced(task)
            row.state = state
            row.owner = None
            row.error = error
            row.finished_at = s.clock.now()
            s.bump()

    def command(self, timeout: float | None = None) -> Command | None:
        s = self._store
        deadline = None if timeout is None else s.clock.monotonic() + timeout
        with s.cond:
            while True:
                node = s.nodes.get(self._node_id)
                if self._closed:
                    return None
                while node is not None and node.commands:
                    raw = node.commands.popleft()
                    try:
                        return Command.from_json(raw)
                    except InvalidCommand as exc:
                        log.warning("dropping malformed command for node %s: %s", self._node_id, exc)
                left = None if deadline is None else deadline - s.clock.monotonic()
                if left is not None and left <= 0:
                    return None
                s.cond.wait(_POLL if left is None else min(_POLL, left))

    def node_task_count(self) -> dict[str, int]:
        with self._store.cond:
            return self._store.counts()

    def active_task_count(self) -> dict[str, int]:
        with self._store.cond:
            return self._store.counts(active=True)

    def announce_leaving(self) -> None:
        """Mark this node leaving (balancers stop counting it) and tell the listeners."""
        with self._store.cond:
            node = self._store.nodes.get(self._node_id)
            if node is None or node.leaving or self._closed:
                return
            node.leaving = True
            self._store.members_changed()

    def listen_membership(self, listener: Callable[[], None]) -> bool:
        """Call ``listener`` whenever a node of this store joins, leaves or announces leaving."""
        with self._store.cond:
            self._check_open()
            self._store.member_listeners.append(listener)
            self._listening.append(listener)
        return True
    def node_labels(self) -> dict[str, dict[str, str]]:
        with self._store.cond:
            return {n.node_id: dict(n.labels) for n in self._store.nodes.values()}

    def close(self) -> None:
        s = self._store
        with s.cond:
            if self._closed:
                return
            self._closed = True
            for wake in self._schedule_wakes:
                s.schedule_listeners.remove(wake)
            for listener in self._listening:
                s.member_listeners.remove(listener)
            self._listening.clear()
            if self._ctx is not None and self._node_id in s.nodes:
                s.free_claims(self._node_id)
                del s.nodes[self._node_id]
                s.members_changed()
            s.bump()

    def report_frozen(self, frozen: bool) -> None:
        with self._store.cond:
            node = self._store.nodes.get(self._node_id)
            if node is not None:
                node.frozen = frozen

    def expire_lease(self) -> list[Task]:
        """Simulate a lost lease: free this node's claims and tell it (``ctx.lost``).

        Returns the tasks it held. The node re-registers on its next claim.
        """
        s = self._store
        with s.cond:
            freed = s.free_claims(self._node_id, crashed=True)
            if s.nodes.pop(self._node_id, None) is not None:
                s.members_changed()
            ctx = self._ctx
        if ctx is not None:
            for task in freed:
                ctx.lost(task)
        return freed

    def schedules(self) -> list[Schedule]:
        with self._store.cond:
            self._check_open()
            return sorted(self._store.schedules.values(), key=lambda x: x.name)

    def materialise(self, schedule: Schedule, tasks: Sequence[Task], cursor: datetime) -> bool:
        s = self._store
        with s.cond:  # the lock makes the compare-and-set and the creates one step
            self._check_open()
            stored = s.schedules.get(schedule.name)
            if stored is None or stored.version != schedule.version:
                return False
            now = s.clock.now()
            added = False
            for task in tasks:
                if task.id not in s.tasks:
                    row = s.tasks[task.id] = _Row(task.id, dict(task.props), TaskState.PENDING, now)
                    row.ready = s.bump()
                    added = True
            s.schedule_seq += 1
            s.schedules[schedule.name] = dataclasses.replace(stored, cursor=cursor,
                                                              version=s.schedule_seq)
            if added:
                s.bump()
            return True

    def listen_schedules(self, wake: Callable[[], None]) -> bool:
        with self._store.cond:
            self._store.schedule_listeners.append(wake)
            self._schedule_wakes.append(wake)
        return True

    def inject_raw_command(self, raw: str) -> None:
        """Queue a raw (possibly malformed) command text for this node, for fault tests."""
        s = self._store
        with s.cond:
            node = s.nodes.get(self._node_id)
            if node is None:
                raise NodeNotFound(f"node {self._node_id!r} is not live")
            node.commands.append(raw)
            s.bump()


class MemoryClient(Client):
    """Operator client on an in-process :class:`MemoryStore`."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._closed = False

    @property
    def name(self) -> str:
        return f"memory://{self._store.name}"

    def _check_open(self) -> None:
        if self._closed:
            raise CoordinatorClosed(f"client on {self.name} is closed")

    def submit_task(self, task: Task) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            validate_schedule(task, s.clock.now())
            if task.id in s.tasks:
                raise TaskExists(f"task {task.id!r} already exists")
            row = _Row.new(task, s.clock.now())
            s.tasks[task.id] = row
            row.ready = s.bump()

    _batch_size = 1 << 62  # in-process: the whole call is one batch, all-or-nothing

    def _now(self) -> datetime:
        return self._store.clock.now()

    def _submit_batch(self, batch: Sequence[Task]) -> list[str]:
        s = self._store
        with s.cond:
            self._check_open()
            existing = [task.id for task in batch if task.id in s.tasks]
            if existing:
                return existing
            now, ready = s.clock.now(), s.bump()  # one wake-up for the batch
            for task in batch:
                row = s.tasks[task.id] = _Row.new(task, now)
                row.ready = ready
        return []

    def _row(self, task_id: str) -> _Row:
        row = self._store.tasks.get(validate_task_id(task_id))
        if row is None:
            raise TaskNotFound(f"no task {task_id!r}")
        return row

    def delete_task(self, task_id: str) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            row = self._row(task_id)
            del s.tasks[task_id]
            owner = s.nodes.get(row.owner) if row.state is TaskState.CLAIMED and row.owner else None
            s.bump()
        if owner is not None:
            owner.ctx.lost(row.task())

    def retry_with_state(self, task_id: str, rewrite: StateRewrite | None) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            s.sweep(s.clock.now())
            row = self._row(task_id)
            if rewrite is None:
                check_retryable(task_id, row.state)
            else:
                held = s.task_state(task_id)
                body = rewrite(RetrySnapshot(task_id, row.state, row.token,
                                             None if held is None else held[1]))
                if body is not None and held is not None:  # the state's token is kept
                    s.put_task_state(task_id, held[0], body if isinstance(body, str) else body.decode())
            row.state = TaskState.PENDING
            row.error = None
            row.finished_at = None
            row.crashes = 0
            row.ready = s.bump()

    def get_task(self, task_id: str) -> TaskInfo:
        s = self._store
        with s.cond:
            self._check_open()
            s.sweep(s.clock.now())
            return self._row(task_id).info()

    def tasks(self, state: TaskState | str | None = None) -> list[TaskInfo]:
        wanted = None if state is None else TaskState(state)
        s = self._store
        with s.cond:
            self._check_open()
            s.sweep(s.clock.now())
            rows = sorted(s.tasks.values(), key=lambda r: r.task_id)
            return [r.info() for r in rows if wanted is None or r.state is wanted]

    def nodes(self) -> list[str]:
        with self._store.cond:
            self._check_open()
            return sorted(self._store.nodes)

    def node_task_count(self) -> dict[str, int]:
        with self._store.cond:
            self._check_open()
            return self._store.counts()

    def node_infos(self) -> list[NodeInfo]:
        s = self._store
        with s.cond:
            self._check_open()
            counts = s.counts()
            return [
                NodeInfo(n.node_id, counts.get(n.node_id, 0), started=n.started, frozen=n.frozen,
                         labels=dict(n.labels))
                for n in sorted(s.nodes.values(), key=lambda n: n.node_id)
            ]

    def submit_command(self, node_id: str, command: Command) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            node = s.nodes.get(node_id)
            if node is None:
                raise NodeNotFound(f"no live node {node_id!r}")
            node.commands.append(command.to_json())
            s.bump()

    def purge(self, older_than: timedelta | None = None) -> int:
        s = self._store
        with s.cond:
            self._check_open()
            now = s.clock.now()
            s.sweep(now)
            cutoff = now - (older_than or timedelta(0))
            finished = (TaskState.DONE, TaskState.FAILED, TaskState.EXPIRED)
            doomed = [
                r.task_id
                for r in s.tasks.values()
                if r.state in finished and r.finished_at is not None and r.finished_at <= cutoff
            ]
            for task_id in doomed:
                del s.tasks[task_id]
            return len(doomed)

    def schedules(self) -> list[Schedule]:
        with self._store.cond:
            self._check_open()
            return sorted(self._store.schedules.values(), key=lambda x: x.name)

    def _schedule_insert(self, schedule: Schedule) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            if schedule.name in s.schedules:
                raise ScheduleExists(f"schedule {schedule.name!r} already exists")
            s.schedule_changed(schedule, schedule.name)

    def _stored_schedule(self, name: str) -> Schedule:
        found = self._store.schedules.get(name)
        if found is None:
            raise ScheduleNotFound(f"no schedule {name!r}")
        return found

    def _schedule_delete(self, name: str) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            self._stored_schedule(name)
            s.schedule_changed(None, name)

    def _schedule_pause(self, name: str, paused: bool, now: datetime) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            found = self._stored_schedule(name)
            if found.paused == paused:
                return
            cursor = found.cursor if paused else max(found.cursor, now)
            s.schedule_changed(dataclasses.replace(found, paused=paused, cursor=cursor), name)

    def close(self) -> None:
        self._closed = True


def open_coordinator(url: StoreURL, node_id: str, options: dict[str, Any]) -> MemoryCoordinator:
    """Backend hook for :func:`metafora.open_coordinator`."""
    return MemoryCoordinator(_store_for(url, dict(options)), node_id)


def open_client(url: StoreURL, options: dict[str, Any]) -> MemoryClient:
    """Backend hook for :func:`metafora.open_client`."""
    return MemoryClient(_store_for(url, dict(options)))
