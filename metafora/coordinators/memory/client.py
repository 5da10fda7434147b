"""The in-process client: submit, inspect and steer the tasks of a :class:`MemoryStore`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from metafora.contracts.client import Client, NodeInfo
from metafora.coordinators.memory.retention import MemoryRetention
from metafora.coordinators.memory.store import MemoryStore, Row, store_for
from metafora.core.commands import Command
from metafora.core.config import StoreURL
from metafora.core.errors import (
    CoordinatorClosed,
    LimitNotFound,
    NodeNotFound,
    ScheduleExists,
    ScheduleNotFound,
    TaskExists,
    TaskNotFound,
)
from metafora.core.limits import GroupUsage, Limit
from metafora.core.retention import purge_policy
from metafora.core.schedule_model import Schedule
from metafora.core.submitting import IfExists, check_if_exists, no_transactions
from metafora.core.task import (
    Task,
    TaskInfo,
    TaskState,
    validate_schedule,
    validate_task_id,
)
from metafora.core.task_retry import RetrySnapshot, StateRewrite, check_retryable


def _replace(row: Row, task: Task) -> None:
    """A pending row takes what ``task`` says (its id, state, token, history and limit group
    stay)."""
    row.props = dict(task.props)
    row.selector = dict(task.selector)
    row.priority = task.priority
    row.prefer = dict(task.prefer)
    row.spread = task.spread  # the limit group stays: fixed at submit (docs/limits.md)
    row._times = None  # parsed again from the new props


class MemoryClient(MemoryRetention, Client):
    """Operator client on an in-process :class:`MemoryStore`."""

    backend = "memory"

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._closed = False

    @property
    def name(self) -> str:
        return f"memory://{self._store.name}"

    def _check_open(self) -> None:
        if self._closed:
            raise CoordinatorClosed(f"client on {self.name} is closed")

    def submit_task(self, task: Task, *, conn: Any = None, if_exists: IfExists = "error") -> bool:
        mode = check_if_exists(if_exists)
        if conn is not None:
            raise no_transactions(self.name)
        s = self._store
        with s.cond:
            self._check_open()
            validate_schedule(task, s.clock.now())
            left = self._submit_batch([task], mode)
        if left and mode == "error":
            raise TaskExists(f"task {task.id!r} already exists", ids=[task.id])
        return not left

    _batch_size = 1 << 62  # in-process: the whole call is one batch, all-or-nothing

    def _now(self) -> datetime:
        return self._store.clock.now()

    def _submit_batch(self, batch: Sequence[Task], if_exists: IfExists = "error") -> list[str]:
        s = self._store
        with s.cond:
            self._check_open()
            now = s.clock.now()
            existing = [task.id for task in batch if task.id in s.tasks]
            if existing and if_exists == "error":
                return existing
            if existing and if_exists == "replace":
                s.sweep(now)  # a pending task past its expiry is expired: left alone
            ready = s.bump()  # one wake-up for the batch
            left = []
            for task in batch:
                row = s.tasks.get(task.id)
                if row is None:
                    row = Row.new(task, now)
                elif if_exists == "replace" and row.state is TaskState.PENDING:
                    _replace(row, task)  # in place: a stored state-machine state stays its own
                else:
                    left.append(task.id)
                    continue
                s.add(row)
                s.make_ready(row, ready)
        return left

    def _row(self, task_id: str) -> Row:
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
            s.ready_rows.pop(task_id, None)
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
            s.add(row)  # timed again, if it has a launch or expiry time
            s.make_ready(row, s.bump())

    def get_task(self, task_id: str) -> TaskInfo:
        s = self._store
        with s.cond:
            self._check_open()
            now = s.clock.now()
            s.sweep(now)
            return self._row(task_id).info(now)

    def tasks(self, state: TaskState | str | None = None) -> list[TaskInfo]:
        wanted = None if state is None else TaskState(state)
        s = self._store
        with s.cond:
            self._check_open()
            now = s.clock.now()
            s.sweep(now)
            rows = sorted(s.tasks.values(), key=lambda r: r.task_id)
            return [r.info(now) for r in rows if wanted is None or r.state is wanted]

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
                         labels=dict(n.labels), weight=n.weight)
                for n in sorted(s.nodes.values(), key=lambda n: n.node_id)
            ]

    def node_weights(self) -> dict[str, float]:
        with self._store.cond:
            self._check_open()
            return {n.node_id: n.weight for n in self._store.nodes.values()}

    def frozen_nodes(self) -> frozenset[str]:
        with self._store.cond:
            self._check_open()
            return frozenset(n.node_id for n in self._store.nodes.values() if n.frozen)

    def drain_node(self, node_id: str) -> int:
        s = self._store
        with s.cond:
            self._check_open()
            return s.drain(validate_task_id(node_id))

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
        self._check_open()
        return self.prune(purge_policy(older_than))

    def _retention_store(self) -> MemoryStore:
        self._check_open()
        return self._store

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

    def group_usage(self) -> dict[str, GroupUsage]:
        s = self._store
        with s.cond:
            self._check_open()
            now = s.clock.now()
            found = {group: s.group_usage(group, now) for group in s.limits}
            return {group: usage for group, usage in found.items() if usage is not None}

    def _limit_put(self, limit: Limit) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            s.limits[limit.group] = limit
            s.bump()  # a raised limit lets waiting tasks in

    def _limit_delete(self, group: str) -> None:
        s = self._store
        with s.cond:
            self._check_open()
            if s.limits.pop(group, None) is None:
                raise LimitNotFound(f"no limit is set on group {group!r}")
            s.rate_log.pop(group, None)
            s.bump()

    def close(self) -> None:
        self._closed = True



def open_client(url: StoreURL, options: dict[str, Any]) -> MemoryClient:
    """Backend hook for :func:`metafora.open_client`."""
    return MemoryClient(store_for(url, dict(options)))
