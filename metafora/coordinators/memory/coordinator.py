"""The in-process coordinator: one node's claims, watch and commands over a :class:`MemoryStore`."""

from __future__ import annotations

import dataclasses
import logging
import queue
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from metafora.contracts.coordinator import (
    Coordinator,
    CoordinatorContext,
    Finish,
    TaskSink,
    as_sink,
    crash_limit_error,
    error_text,
)
from metafora.coordinators.members import context_capacity, context_weight
from metafora.coordinators.memory.retention import MemoryRetention
from metafora.coordinators.memory.store import POLL_SECONDS, MemoryStore, NodeRecord, Row, store_for
from metafora.core.commands import Command
from metafora.core.config import StoreURL
from metafora.core.errors import (
    ClaimLost,
    CoordinatorClosed,
    InvalidCommand,
    MetaforaError,
    NodeExists,
    NodeNotFound,
)
from metafora.core.holds import check_sticky_for
from metafora.core.schedule_model import Schedule
from metafora.core.task import (
    Task,
    TaskState,
    matches,
    validate_task_id,
)

log = logging.getLogger(__name__)

_OFFERED_MIN = 1024  # a watch forgets what it offered of rows no longer pending past this size


class MemoryCoordinator(MemoryRetention, Coordinator):
    """A node's coordinator on an in-process :class:`MemoryStore`."""

    backend = "memory"

    claim_burst = 256  # claims are in-process: no round trip to save, no limit to mind

    def __init__(self, store: MemoryStore, node_id: str) -> None:
        self._store = store
        self._node_id = validate_task_id(node_id)
        self._ctx: CoordinatorContext | None = None
        self._closed = False
        self._offered = 0  # how many offers the watch remembers (see watch)
        self._schedule_wakes: list[Callable[[], None]] = []
        self._listening: list[Callable[[], None]] = []
        self._hold_for = 0.0  # seconds this node's releases are held for its id (holds.py)

    @property
    def name(self) -> str:
        return f"memory://{self._store.name}"

    @property
    def node_id(self) -> str:
        return self._node_id

    def init(self, ctx: CoordinatorContext) -> None:
        s = self._store
        weight = context_weight(ctx)
        with s.cond:
            self._check_open()
            if self._node_id in s.nodes:
                raise NodeExists(f"node {self._node_id!r} is already live on {self.name}")
            s.members_seq += 1
            s.nodes[self._node_id] = NodeRecord(self._node_id, ctx, s.clock.now(), labels=dict(ctx.labels),
                                                weight=weight)
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
            self._store.members_seq += 1
            self._store.nodes[self._node_id] = NodeRecord(self._node_id, self._ctx, self._store.clock.now(),
                                                          labels=dict(self._ctx.labels),
                                                          weight=context_weight(self._ctx))
            self._store.members_changed()

    def watch(self, out: TaskSink | queue.Queue[Task]) -> None:
        sink = as_sink(out)
        s = self._store
        offered: dict[str, int] = {}  # task id -> the ready value offered (no repeats)
        prune_at = _OFFERED_MIN
        seen_version, seen_members = -1, -1
        while True:
            with s.cond:
                if self._closed:
                    return
                now = s.clock.now()
                s.sweep(now)
                # Every row after a membership change (a dead owner's claims are claimable);
                # else only those made ready since the last round, and those launched now.
                rows: Iterable[Row] = s.tasks.values() if s.members_seq != seen_members else [
                    *reversed(s.ready_since(seen_version)), *s.launched(now), *s.unheld(now)]
                seen_members, seen_version = s.members_seq, s.version
                batch = [
                    row.task()
                    for row in rows
                    if s.claimable(row, now, self._node_id) and offered.get(row.task_id) != row.ready
                ]
                for task in batch:
                    offered[task.id] = s.tasks[task.id].ready
                if len(offered) > prune_at:  # amortised: keep only rows still pending
                    offered = {i: r for i, r in offered.items()
                               if (row := s.tasks.get(i)) is not None and row.ready == r
                               and row.state is TaskState.PENDING}
                    prune_at = max(_OFFERED_MIN, 2 * len(offered))
                self._offered = len(offered)  # for tests: what the watch remembers
                version = s.version
            batch.sort(key=lambda t: -t.priority)  # higher priority offered first
            for task in batch:
                sink(task.with_token(0))
            with s.cond:
                if self._closed:
                    return
                if s.version == version:
                    now = s.clock.now()
                    due = [d for d in (s.next_launch(now), s.next_unhold(now)) if d is not None]
                    s.cond.wait(min([POLL_SECONDS, *due]))

    def claim(self, task: Task) -> Task | None:
        s = self._store
        with s.cond:
            self._require_node()
            row = s.tasks.get(task.id)
            now = s.clock.now()
            s.sweep(now)
            if row is None or not s.claimable(row, now, self._node_id):
                return None
            if self._ctx is not None and not matches(row.selector, self._ctx.labels):
                return None  # placement: this node's labels do not match the task's selector
            if row.state is TaskState.CLAIMED:  # taken over from a dead owner
                row.crashes += 1
            verdict = crash_limit_error(row.crashes, self._ctx.max_crashes if self._ctx else None)
            if verdict is not None:
                row.state, row.owner, row.error = TaskState.FAILED, None, verdict
                row.finished_at = now
                s.ready_rows.pop(row.task_id, None)
                s.bump()
                return None
            if not s.take_slot(row.group, now):
                return None  # the task's group is at its limit
            s.token_seq += 1
            s.ready_rows.pop(row.task_id, None)
            row.state = TaskState.CLAIMED
            row.owner = self._node_id
            row.token = s.token_seq
            row.claimed_at = now
            row.attempts += 1
            row.hold(None, None)
            return row.task()

    def claimable(self, tasks: Sequence[Task]) -> list[Task]:
        """Those of ``tasks`` that are still claimable, in order (no claim is made)."""
        s = self._store
        with s.cond:
            now = s.clock.now()
            return [t for t in tasks if (row := s.tasks.get(t.id)) is not None
                    and s.claimable(row, now, self._node_id)]

    def _fenced(self, task: Task) -> Row:
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
            row.crashes = 0
            s.release_row(row, s.bump(), self._hold())

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
            s.ready_rows.pop(row.task_id, None)
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
                s.cond.wait(POLL_SECONDS if left is None else min(POLL_SECONDS, left))

    def node_task_count(self) -> dict[str, int]:
        with self._store.cond:
            return self._store.counts()

    def active_task_count(self) -> dict[str, int]:
        with self._store.cond:
            return self._store.counts(active=True)

    def _retention_store(self) -> MemoryStore:
        return self._store

    def claimable_count(self) -> int | None:
        """Tasks claimable now (in process: no read to share with the counts)."""
        with self._store.cond:
            now = self._store.clock.now()
            return sum(1 for row in self._store.tasks.values() if self._store.claimable(row, now))

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

    def node_weights(self) -> dict[str, float]:
        """Live node -> its weight (in-process: no read to share with the counts)."""
        with self._store.cond:
            return {n.node_id: n.weight for n in self._store.nodes.values()}

    def node_capacities(self) -> dict[str, int]:
        """Live nodes whose context gives a capacity -> it (read from the node at once: in
        process, nothing to publish)."""
        with self._store.cond:
            nodes = list(self._store.nodes.values())
        return {n.node_id: c for n in nodes if (c := context_capacity(n.ctx)) is not None}

    def frozen_nodes(self) -> frozenset[str]:
        """Live nodes that reported themselves frozen."""
        with self._store.cond:
            return frozenset(n.node_id for n in self._store.nodes.values() if n.frozen)

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
                s.free_claims(self._node_id, hold=self._hold())
                del s.nodes[self._node_id]
                s.members_seq += 1
                s.members_changed()
            s.bump()

    def hold_releases(self, seconds: float) -> bool:
        with self._store.cond:
            self._hold_for = check_sticky_for(seconds, "seconds")
        return True

    def _hold(self) -> tuple[str, datetime] | None:
        """(this node, until when) to hold a release for now, or None (the caller holds cond)."""
        if not self._hold_for:
            return None
        return self._node_id, self._store.clock.now() + timedelta(seconds=self._hold_for)

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
                s.members_seq += 1
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
                    row = Row.new(task, now)  # its selector, priority, group... too
                    s.add(row)
                    s.make_ready(row, s.bump())
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



def open_coordinator(url: StoreURL, node_id: str, options: dict[str, Any]) -> MemoryCoordinator:
    """Backend hook for :func:`metafora.open_coordinator`."""
    return MemoryCoordinator(store_for(url, dict(options)), node_id)
