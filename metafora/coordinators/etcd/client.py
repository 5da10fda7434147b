"""The operator client on etcd: submit, inspect, retry, delete, purge tasks; command nodes.

Finished tasks stay queryable until :meth:`EtcdClient.purge`: ``done``/``fail``/expiry
write ``tasks/<id>/state`` and delete the owner key, keeping ``props`` and the last claim
record; purge (and ``delete_task``) delete the task's prefix ``tasks/<id>/`` (trailing
slash: never a sibling such as ``tasks/<id>bar/``), its owner key, its state-machine key and
its state-machine command queue.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from metafora.contracts.client import Client, NodeInfo
from metafora.coordinators.etcd import limits as _limits
from metafora.coordinators.etcd import schedules as _schedules
from metafora.coordinators.etcd.config import EtcdConfig
from metafora.coordinators.etcd.coordinator import new_command_name
from metafora.coordinators.etcd.driver import (
    Compare,
    Delete,
    EtcdDriver,
    KeyValue,
    Put,
    Range,
    absent,
    created_at,
    exists,
    modified_at,
    prefix_end,
)
from metafora.coordinators.etcd.layout import (
    Keys,
    TaskRecord,
    decode_json,
    escape,
    iso,
    task_info,
    task_record,
)
from metafora.coordinators.etcd.queries import (
    expire_task,
    launch_and_expiry,
    live_members,
    live_nodes,
    node_infos,
    node_task_count,
    read_all_tasks,
    read_task,
    read_task_page,
)
from metafora.coordinators.etcd.retention import EtcdRetention
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.commands import Command
from metafora.core.errors import (
    CoordinatorClosed,
    NodeNotFound,
    StoreError,
    TaskExists,
    TaskNotFound,
)
from metafora.core.limits import GroupUsage, Limit
from metafora.core.retention import purge_policy
from metafora.core.schedule_model import Schedule
from metafora.core.submitting import IfExists, check_if_exists, no_transactions
from metafora.core.task import Task, TaskInfo, TaskState, validate_schedule, validate_task_id
from metafora.core.task_retry import RetrySnapshot, StateRewrite, check_retryable

__all__ = ["EtcdClient"]

log = logging.getLogger(__name__)

_FINISHED = (TaskState.DONE, TaskState.FAILED, TaskState.EXPIRED)
_RETRIES = 5
_TXN_OPS = 128  # etcd's default --max-txn-ops: operations per branch of one txn


_PAGE_KEYS_MAX = 20_000
"""The most task keys :meth:`EtcdClient.task_page` reads in one request."""



def _past_expiry(record: dict[str, Any], now: datetime) -> bool:
    """Whether a stored task record's ``expires_at`` has passed (unset or unreadable: no)."""
    props = record.get("props")
    _, expires = launch_and_expiry(props if isinstance(props, dict) else {})
    return expires is not None and expires <= now

class EtcdClient(EtcdRetention, Client):
    """Operator client for ``etcd://host:2379/NAMESPACE``. Connects on first use."""

    backend = "etcd"

    def __init__(self, config: EtcdConfig, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._cfg = config
        self._keys = Keys(config.namespace)
        self._driver = EtcdDriver(config.connection)
        self._clock = clock
        self._closed = False

    @property
    def name(self) -> str:
        return self._cfg.name

    def __repr__(self) -> str:
        return f"EtcdClient({self.name!r})"

    @property
    def driver(self) -> EtcdDriver:
        """The etcd connection (for stores kept beside the tasks)."""
        return self._driver

    @property
    def keys(self) -> Keys:
        """The key layout of this namespace."""
        return self._keys

    def _check_open(self) -> None:
        if self._closed:
            raise CoordinatorClosed(f"client on {self.name} is closed")

    # -- tasks ------------------------------------------------------------------------

    def submit_task(self, task: Task, *, conn: Any = None, if_exists: IfExists = "error") -> bool:
        mode = check_if_exists(if_exists)
        if conn is not None:
            raise no_transactions(self.name)
        self._check_open()
        validate_schedule(task, self._clock.now())
        if self._submit_batch([task], mode):
            if mode == "error":
                raise TaskExists(f"task {task.id!r} already exists", ids=[task.id])
            return False
        log.debug("submitted task %s", task.id, extra={"task": task.id})
        return True

    def _now(self) -> datetime:
        return self._clock.now()

    _batch_size = _TXN_OPS // 4  # four ops per task
    _batch_bytes = 1024 * 1024  # etcd refuses requests over 1.5 MiB by default

    def _submit_batch(self, batch: Sequence[Task], if_exists: IfExists = "error") -> list[str]:
        self._check_open()
        if if_exists != "error":
            return self._submit_or_keep(batch, if_exists == "replace")
        keys = [self._keys.task(task.id) for task in batch]
        now = self._clock.now()
        created = iso(now)
        records = [task_record(t, created) for t in batch]
        # A fresh task starts clean even if a crashed writer left a stray key behind.
        puts = [op for k, record in zip(keys, records, strict=True)
                for op in (Put(k.props, record), Delete(k.state), Delete(k.claim), Delete(k.running))]
        for _ in range(_RETRIES):
            result = self._driver.txn([absent(k.props) for k in keys], puts,
                                      [Range(k.props) for k in keys], repeatable=True)
            if result.succeeded:
                return []
            found = [kvs[0].value if kvs else None for kvs in result.ranges]
            if result.retried and found == records:
                return []  # our first attempt was applied
            existing = [t.id for t, value in zip(batch, found, strict=True) if value is not None]
            if existing:
                return existing
            # The ids that failed the compare were deleted since: try again.
        raise StoreError(f"could not submit {len(batch)} task(s) to {self.name}: the store kept changing")

    def _submit_or_keep(self, batch: Sequence[Task], replace: bool) -> list[str]:
        """``if_exists`` ignore / replace: one txn adds every absent id and (``replace``)
        rewrites every pending task's props key, each compared on the revision read (props
        unchanged, no state key, no owner key: still pending); a failed compare reads again."""
        keys = [self._keys.task(task.id) for task in batch]
        now = self._clock.now()
        created = iso(now)
        records = [task_record(t, created) for t in batch]
        todo = list(range(len(batch)))
        pending: dict[int, tuple[int, bytes]] = {}  # index -> (props revision, new record)
        left: list[int] = []
        for _ in range(_RETRIES):
            compares: list[Compare] = []
            ops: list[Put | Delete] = []
            reads: list[Range] = []
            for i in todo:
                k = keys[i]
                if i in pending:
                    revision, record = pending[i]
                    compares += [modified_at(k.props, revision), absent(k.state), absent(k.owner)]
                    ops.append(Put(k.props, record))
                else:
                    compares.append(absent(k.props))
                    ops += [Put(k.props, records[i]), Delete(k.state), Delete(k.claim),
                            Delete(k.running)]
                reads += [Range(k.props), Range(k.state), Range(k.owner)]
            result = self._driver.txn(compares, ops, reads, repeatable=True)
            if result.succeeded:
                break
            again = []
            for n, i in enumerate(todo):
                props_kvs, state_kvs, owner_kvs = result.ranges[3 * n:3 * n + 3]
                if not props_kvs:
                    pending.pop(i, None)  # deleted since: add it
                    again.append(i)
                elif result.retried and props_kvs[0].value in (records[i], pending.get(i, (0, b""))[1]):
                    continue  # our first attempt was applied
                elif not replace or state_kvs or owner_kvs:
                    left.append(i)  # kept as it is (claimed or finished, for replace)
                else:
                    old = decode_json(props_kvs[0].value)
                    old = old if isinstance(old, dict) else {}
                    if _past_expiry(old, now):
                        left.append(i)  # expired (not swept yet): never revived, as on SQL
                        continue
                    was = old.get("created_at")
                    # The limit group is fixed at submit (docs/limits.md): the old one stays.
                    group = old.get("group") if isinstance(old.get("group"), str) else None
                    kept = dataclasses.replace(batch[i], group=group)
                    pending[i] = (props_kvs[0].mod_revision,
                                  task_record(kept, was if isinstance(was, str) else created))
                    again.append(i)
            todo = again
            if not todo:
                break
        else:
            raise StoreError(f"could not submit {len(batch)} task(s) to {self.name}: "
                             "the store kept changing")
        return [batch[i].id for i in sorted(left)]

    def delete_task(self, task_id: str) -> None:
        self._check_open()
        tk = self._keys.task(validate_task_id(task_id))
        result = self._driver.txn(
            [exists(tk.props)],
            [
                Delete(tk.prefix, prefix=True),
                Delete(tk.owner),
                Delete(tk.machine),
                Delete(tk.commands, prefix=True),
            ],
        )
        if not result.succeeded:
            raise TaskNotFound(f"no task {task_id!r}")
        log.debug("deleted task %s", task_id, extra={"task": task_id})

    def retry_with_state(self, task_id: str, rewrite: StateRewrite | None) -> None:
        self._check_open()
        task_id = validate_task_id(task_id)
        tk = self._keys.task(task_id)
        for _ in range(_RETRIES):
            info, rec = self._load(task_id, write=True)  # a retry changes it: expire it first
            machine = self._machine_key(tk.machine) if rewrite is not None else None
            body: str | bytes | None = None
            if rewrite is None:
                check_retryable(task_id, info.state)
            else:
                body = rewrite(RetrySnapshot(task_id, info.state, info.token,
                                             None if machine is None else machine.value))
            if rec.state is None:
                continue  # expired by this very read; read again
            compares = [modified_at(tk.state, rec.state.mod_revision)]
            # A retried task starts with no crash count (max_crashes counts afresh).
            ops: list[Put | Delete] = [Delete(tk.state), Delete(tk.running)]
            if body is not None and machine is not None:
                # One txn: the task is pending again only with its state rewritten.
                compares.append(modified_at(tk.machine, machine.mod_revision))
                ops.append(Put(tk.machine, body.encode() if isinstance(body, str) else body))
            if self._driver.txn(compares, ops).succeeded:
                return
        raise StoreError(f"task {task_id!r} kept changing; retry it again")

    def _machine_key(self, key: bytes) -> KeyValue | None:
        kvs, _ = self._driver.range(Range(key))
        return kvs[0] if kvs else None

    def get_task(self, task_id: str) -> TaskInfo:
        self._check_open()
        info, _ = self._load(validate_task_id(task_id))
        return info

    def _load(self, task_id: str, *, write: bool = False) -> tuple[TaskInfo, TaskRecord]:
        rec = read_task(self._driver, self._keys, task_id)
        info = self._sweep(task_id, rec, write=write)
        if info is None:
            raise TaskNotFound(f"no task {task_id!r}")
        return info, rec

    def _sweep(self, task_id: str, rec: TaskRecord, now: datetime | None = None, *,
               write: bool = False) -> TaskInfo | None:
        """The task's info; a pending task past its ``expires_at`` shows expired, and is
        moved to expired in the store only with ``write`` (a verb that changes the task: a
        read -- ``get_task``, a dashboard GET -- writes nothing, as on SQL)."""
        info = task_info(task_id, rec)
        if info is None or info.state is not TaskState.PENDING or rec.props is None:
            return info
        _, expires = launch_and_expiry(dict(info.props))
        now = now or self._clock.now()
        if expires is None or expires > now:
            return info
        if not write:
            return TaskInfo(
                id=info.id, props=info.props, state=TaskState.EXPIRED, token=info.token,
                created_at=info.created_at, finished_at=expires, attempts=info.attempts,
                selector=info.selector, priority=info.priority,
            )
        if expire_task(self._driver, self._keys, task_id, rec.props.mod_revision, now):
            log.info("task %s expired", task_id, extra={"task": task_id})
            return TaskInfo(
                id=info.id, props=info.props, state=TaskState.EXPIRED, token=info.token,
                created_at=info.created_at, finished_at=now, attempts=info.attempts,
                selector=info.selector, priority=info.priority,
            )
        fresh = task_info(task_id, read_task(self._driver, self._keys, task_id))
        return fresh

    def tasks(self, state: TaskState | str | None = None) -> list[TaskInfo]:
        self._check_open()
        wanted = None if state is None else TaskState(state)
        records, _ = read_all_tasks(self._driver, self._keys)
        out = []
        for task_id in sorted(records):
            info = self._sweep(task_id, records[task_id])
            if info is not None and (wanted is None or info.state is wanted):
                out.append(info)
        return out

    def task_page(
        self,
        *,
        state: TaskState | str | None = None,
        owner: str | None = None,
        prefix: str = "",
        after: str | None = None,
        limit: int = 100,
        props: bool = True,
    ) -> list[TaskInfo]:
        """Like :meth:`Client.task_page` (``props`` makes no difference: a key holds them),
        reading the store a page of keys at a time (never the
        whole namespace at once). etcd orders tasks by key: the percent-encoded id followed by
        ``/``, which is id order except that an id sorts after its extensions that continue
        with a character below ``/`` (``a-1`` before ``a``); ``after`` pages in that same order,
        so paging never skips or repeats a task."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._check_open()
        wanted = None if state is None else TaskState(state)
        base = self._keys.tasks + escape(prefix).encode()
        end = prefix_end(base)
        start: bytes | None = base
        if after is not None:
            start = max(base, prefix_end(self._keys.task(after).prefix))
        page: list[TaskInfo] = []
        max_keys = 4 * limit + 16  # about a page of tasks (up to 4 keys each)
        while start is not None and start < end and len(page) < limit:
            records, start = read_task_page(self._driver, self._keys, start, end, max_keys)
            # A filter that few tasks pass: read more per round trip, still bounded.
            max_keys = min(2 * max_keys, _PAGE_KEYS_MAX)
            for task_id, rec in records:
                info = self._sweep(task_id, rec)
                if info is None or (wanted is not None and info.state is not wanted):
                    continue
                if owner is not None and info.owner != owner:
                    continue
                page.append(info)
                if len(page) >= limit:
                    break
        return page

    def purge(self, older_than: timedelta | None = None) -> int:
        self._check_open()
        records, _ = read_all_tasks(self._driver, self._keys)
        for task_id in sorted(records):  # pending tasks past their expires_at: expired first
            self._sweep(task_id, records[task_id], write=True)
        return self.prune(purge_policy(older_than))

    def _retention_parts(self) -> tuple[EtcdDriver, Keys, Clock]:
        self._check_open()
        return self._driver, self._keys, self._clock

    # -- nodes ------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        self._check_open()
        return live_nodes(self._driver, self._keys)

    def node_task_count(self) -> dict[str, int]:
        self._check_open()
        return node_task_count(self._driver, self._keys)

    def node_infos(self) -> list[NodeInfo]:
        """Live nodes with their task counts, host, pid, start time, frozen flag, labels and
        weight."""
        self._check_open()
        return node_infos(self._driver, self._keys)

    def node_weights(self) -> dict[str, float]:
        self._check_open()
        return {node: m.weight for node, m in live_members(self._driver, self._keys).items()}

    def frozen_nodes(self) -> frozenset[str]:
        self._check_open()
        return frozenset(node for node, m in live_members(self._driver, self._keys).items() if m.frozen)

    def drain_node(self, node_id: str) -> int:
        self._check_open()
        kvs, _rev = self._driver.range(Range(self._keys.node_hold(validate_task_id(node_id))))
        if not kvs or not kvs[0].lease:
            return 0
        # Revoking the hold lease deletes every held running key at once (and the hold key):
        # the watches offer those tasks to every node.
        held = max(0, self._driver.lease_keys(kvs[0].lease) - 1)
        self._driver.revoke(kvs[0].lease)
        return held

    def submit_command(self, node_id: str, command: Command) -> None:
        self._check_open()
        alive = self._keys.node_alive(node_id)
        for _ in range(_RETRIES):
            kvs, _rev = self._driver.range(Range(alive))
            if not kvs:
                break
            key = self._keys.node_commands(node_id) + new_command_name().encode()
            # Attached to the node's lease: a dead node's queue disappears with it.
            result = self._driver.txn(
                [created_at(alive, kvs[0].create_revision)],
                [Put(key, command.to_json().encode(), kvs[0].lease)],
            )
            if result.succeeded:
                return
        raise NodeNotFound(f"no live node {node_id!r}")

    # -- schedules --------------------------------------------------------------------

    def schedules(self) -> list[Schedule]:
        self._check_open()
        return _schedules.list_schedules(self._driver, self._keys)

    def _schedule_insert(self, schedule: Schedule) -> None:
        self._check_open()
        _schedules.insert(self._driver, self._keys, schedule)

    def _schedule_delete(self, name: str) -> None:
        self._check_open()
        _schedules.delete(self._driver, self._keys, name)

    def _schedule_pause(self, name: str, paused: bool, now: datetime) -> None:
        self._check_open()
        _schedules.set_paused(self._driver, self._keys, name, paused, now)

    def group_usage(self) -> dict[str, GroupUsage]:
        self._check_open()
        return _limits.group_usage(self.driver, self.keys)

    def _limit_put(self, limit: Limit) -> None:
        self._check_open()
        _limits.put_limit(self.driver, self.keys, limit)

    def _limit_delete(self, group: str) -> None:
        self._check_open()
        _limits.delete_limit(self.driver, self.keys, group)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._driver.close()
