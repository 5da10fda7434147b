"""The SQL client: an operator's handle on a SQLite or PostgreSQL store."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import TextClause, bindparam, text

from metafora.contracts.client import Client, NodeInfo
from metafora.contracts.coordinator import MAX_ERROR_BYTES
from metafora.coordinators.members import stored_weight
from metafora.coordinators.sql import complete as _complete
from metafora.coordinators.sql import schedules as _schedules
from metafora.coordinators.sql import submit as _submit
from metafora.coordinators.sql.retention import SQLRetention
from metafora.coordinators.sql.statements import BATCH
from metafora.coordinators.sql.statements import INFO_COLUMNS as _INFO_COLUMNS
from metafora.coordinators.sql.store import Database, task_params
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.commands import Command
from metafora.core.errors import (
    CoordinatorClosed,
    InvalidProps,
    InvalidTaskState,
    LimitNotFound,
    MetaforaError,
    NodeNotFound,
    TaskExists,
    TaskNotFound,
    WriteConflict,
)
from metafora.core.limits import GroupUsage, Limit, Rate
from metafora.core.retention import purge_policy
from metafora.core.schedule_model import Schedule
from metafora.core.submitting import IfExists, check_if_exists
from metafora.core.task import (
    Task,
    TaskInfo,
    TaskState,
    decode_labels,
    decode_props,
    decode_soft,
    validate_schedule,
    validate_task_id,
)
from metafora.core.task_retry import RetrySnapshot, StateRewrite, check_retryable

__all__ = ["SQLClient"]

log = logging.getLogger(__name__)

ANALYZE_AFTER = 1000
"""Tasks one ``submit_tasks`` call adds before it refreshes PostgreSQL's statistics."""

_FINISHED = (TaskState.DONE, TaskState.FAILED, TaskState.EXPIRED)
# A list's columns: no props, and only the start of a long error (what a list shows).
_LIST_COLUMNS = _INFO_COLUMNS.replace("id, props,", "id, '{{}}' AS props,", 1).replace(
    " error,", f" substr(error, 1, {MAX_ERROR_BYTES}) AS error,", 1)
# Stored states that may show as a given state (a pending task past expires_at shows expired
# until the next sweep moves it there).
_STORED_AS = {
    TaskState.PENDING: ["pending"],
    TaskState.CLAIMED: ["claimed"],
    TaskState.DONE: ["done"],
    TaskState.FAILED: ["failed"],
    TaskState.EXPIRED: ["expired", "pending"],
}


def _successor(prefix: str) -> str | None:
    """The least string greater than every string starting with ``prefix`` (None: no bound)."""
    while prefix and ord(prefix[-1]) == 0x10FFFF:
        prefix = prefix[:-1]
    if not prefix:
        return None
    following = ord(prefix[-1]) + 1
    if 0xD800 <= following <= 0xDFFF:  # surrogates are no characters: skip to U+E000
        following = 0xE000
    return prefix[:-1] + chr(following)


def key_range(column: str, prefix: str, after: str | None,
              where: list[str], params: dict[str, Any]) -> None:
    """Append to ``where``/``params`` the conditions of a page of ids in ``column``: those
    starting with ``prefix`` and greater than ``after``."""
    if prefix:
        # ids compare byte-wise (code point order): [prefix, successor) is exactly the ids
        # that start with prefix, an index range.
        where.append(f"{column} >= :prefix")
        params["prefix"] = prefix
        upper = _successor(prefix)
        if upper is not None:
            where.append(f"{column} < :upper")
            params["upper"] = upper
    if after is not None:
        where.append(f"{column} > :after")
        params["after"] = after


def _selector(raw: str | None, task_id: str) -> dict[str, str]:
    try:
        return decode_labels(raw, f"stored selector of task {task_id!r}")
    except InvalidProps as exc:  # written around metafora: listed as no node can match it
        log.warning("%s", exc, extra={"task": task_id})
        return {"invalid selector": "?"}


def _placement(raw: str | None, task_id: str) -> dict[str, Any]:
    try:
        prefer, spread, group = decode_soft(raw, task_id)
    except InvalidProps as exc:  # written around metafora: listed without it
        log.warning("%s", exc, extra={"task": task_id})
        return {}
    return {"prefer": prefer, "spread": spread, "group": group}


def _labels(raw: str | None, node_id: str) -> dict[str, str]:
    try:
        return decode_labels(raw, f"stored labels of node {node_id!r}")
    except InvalidProps as exc:
        log.warning("%s", exc, extra={"node": node_id})
        return {}


class _Existing(Exception):
    """Rolls a bulk submit's batch back: these ids exist."""

    def __init__(self, ids: list[str]) -> None:
        super().__init__(ids)
        self.ids = ids


_CONFLICT_TRIES = 3
"""Tries of one submit batch that PostgreSQL rolled back for a deadlock or serialization
failure (rare once rows are written in id order) before the WriteConflict reaches the caller."""


class SQLClient(SQLRetention, Client):
    """Operator client on a SQL store. Build it with :func:`metafora.open_client`.

    Nothing touches the store until the first call; the schema is created then if needed.
    """

    backend = "sql"

    def __init__(self, db: Database) -> None:
        self._db = db
        self._closed = threading.Event()
        self._pages: dict[tuple[str, ...], TextClause] = {}

    @property
    def name(self) -> str:
        return self._db.name

    def _ready(self) -> Database:
        if self._closed.is_set():
            raise CoordinatorClosed(f"client on {self.name} is closed")
        self._db.ensure_schema()
        return self._db

    def _info(self, row: Any) -> TaskInfo:
        conv = self._db.dialect.from_db_time
        error = row[6]
        try:
            props = decode_props(row[1], str(row[0]))
        except InvalidProps as exc:
            # Written around metafora: listed with the damage as its error (a claim fails it).
            log.warning("%s (listed with empty props)", exc, extra={"task": row[0]})
            props, error = {}, error or str(exc)
        return TaskInfo(
            id=str(row[0]),
            props=props,
            state=TaskState(row[2]),
            owner=row[3],
            token=int(row[4]),
            claimed_at=conv(row[5]),
            error=error,
            created_at=conv(row[7]),
            finished_at=conv(row[8]),
            attempts=int(row[9]),
            selector=_selector(row[10], str(row[0])),
            priority=int(row[11] or 0),
            **_placement(row[12], str(row[0])),
            held_for=row[13],
            held_until=conv(row[14]),
        )

    def submit_task(self, task: Task, *, conn: Any = None, if_exists: IfExists = "error") -> bool:
        mode = check_if_exists(if_exists)
        validate_schedule(task, SYSTEM_CLOCK.now())  # this machine's clock: no round trip to refuse
        if conn is not None:
            try:
                return self._submit_in(conn, [task], mode) == 1
            except TaskExists:
                raise TaskExists(f"task {task.id!r} already exists in {self.name}",
                                 ids=[task.id]) from None
        db = self._ready()
        params = task_params(task, db)
        params["ns"] = db.config.namespace
        with db.write() as own:
            row = own.execute(_submit.statements(db).one(mode), params).first()
            if row is not None:
                db.next_token_used(own, int(row[0]))
        if row is None:
            if mode == "error":
                raise TaskExists(f"task {task.id!r} already exists in {self.name}", ids=[task.id])
            return False
        log.debug("submitted task %s", task.id, extra={"task": task.id})
        return True

    def _submit_in(self, conn: Any, tasks: Sequence[Task], if_exists: IfExists) -> int:
        """In the application's transaction (see :mod:`metafora.coordinators.sql.submit`)."""
        db = self._ready()  # the schema, on metafora's own connection (never in the caller's)
        return _submit.run_app_steps(conn, db, _submit.submit_steps(db, tasks, if_exists))

    def complete_task(self, task: Task, *, conn: Any) -> None:
        """As :meth:`Client.complete_task` (see :mod:`metafora.coordinators.sql.complete`)."""
        _complete.complete_in(conn, self._ready(), task)

    def submit_tasks(
        self, tasks: Iterable[Task], *, conn: Any = None, if_exists: IfExists = "error"
    ) -> int:
        """As :meth:`Client.submit_tasks`; on PostgreSQL, after adding ``ANALYZE_AFTER`` tasks
        or more, the tasks table's statistics are refreshed (``ANALYZE``, best effort).

        The claim statements are planned once, generically: on statistics taken before a
        backlog was added, the planner believed the namespace held a handful of rows and
        read all of it for every claim (1.1 ms a claim with 3,000 tasks, against 0.26 ms
        probing the offered ids); autovacuum analyzes a minute later at best.
        """
        before = self._added
        try:
            return super().submit_tasks(tasks, conn=conn, if_exists=if_exists)
        finally:
            if self._added - before >= ANALYZE_AFTER:
                self._analyze()

    def _analyze(self) -> None:
        db = self._ready()
        if db.config.kind != "postgresql":
            return  # SQLite plans every statement afresh, by the ids given
        try:
            with db.write() as conn:
                conn.exec_driver_sql("ANALYZE metafora_tasks")
        except MetaforaError as exc:
            log.debug("could not refresh the statistics of %s: %s", self.name, exc)

    _added = 0  # tasks added by submit_tasks (a hint for _analyze; races only delay it)
    _batch_size = BATCH
    _batch_bytes = 16 * 1024 * 1024  # one statement stays a reasonable size with large props

    def _submit_batch(self, batch: Sequence[Task], if_exists: IfExists = "error") -> list[str]:
        db = self._ready()
        batch = _submit.canonical(batch)  # rows locked in id order: concurrent batches cannot deadlock
        params: dict[str, Any] = {"ns": db.config.namespace}
        for n, task in enumerate(batch):
            params.update(task_params(task, db, f"_{n}"))
        clause = _submit.statements(db).many(if_exists, len(batch))
        for attempt in range(_CONFLICT_TRIES):
            try:
                with db.transaction() as conn:  # INSERT, counter and NOTIFY commit together
                    added = {str(row[0]): int(row[1]) for row in conn.execute(clause, params)}
                    left = [task.id for task in batch if task.id not in added]
                    if left and if_exists == "error":
                        raise _Existing(left)
                    if added:
                        db.next_token_used(conn, max(added.values()))
                        db.execute(conn, "notify_batch", {"ready": min(added.values())})
            except _Existing as refused:  # rolled back: the batch added nothing
                return refused.ids
            except WriteConflict:  # rolled back, nothing applied: the same batch again
                if attempt + 1 == _CONFLICT_TRIES:
                    raise
                log.debug("submit batch of %d conflicted; trying again", len(batch))
                continue
            break
        self._added += len(added)
        return left

    def delete_task(self, task_id: str) -> None:
        validate_task_id(task_id)
        db = self._ready()
        with db.transaction() as conn:
            row = db.execute(conn, "delete", {"id": task_id}).first()
            if row is not None:
                db.execute(conn, "delete_state", {"id": task_id})
                if row[0] == "claimed" and row[1] is not None:  # its owner checks its claims
                    db.execute(conn, "poke_owner", {"owner": row[1]})
        if row is None:
            raise TaskNotFound(f"no task {task_id!r} in {self.name}")
        log.info("deleted task %s (was %s on %s)", task_id, row[0], row[1],
                 extra={"task": task_id, "node": row[1]})

    def retry_with_state(self, task_id: str, rewrite: StateRewrite | None) -> None:
        validate_task_id(task_id)
        if rewrite is not None:
            self._retry_rewriting(task_id, rewrite)
            return
        db = self._ready()
        with db.write() as conn:  # one statement: the common case needs no read first
            row = db.execute(conn, "retry", {"id": task_id}).first()
            if row is not None:
                db.next_token_used(conn, int(row[0]))
        if row is None:
            check_retryable(task_id, self.get_task(task_id).state)  # raises why not
            raise InvalidTaskState(f"task {task_id!r} changed while retrying it; try again")

    def _retry_rewriting(self, task_id: str, rewrite: StateRewrite) -> None:
        """``retry_with_state`` with a state rewrite, in one transaction."""
        db = self._ready()
        with db.transaction() as conn:
            found = db.execute(conn, "retry_read", {"id": task_id}).first()
            if found is None:
                raise TaskNotFound(f"no task {task_id!r} in {self.name}")
            was = TaskState(found[0])
            body = rewrite(RetrySnapshot(task_id, was, int(found[2]), found[1]))
            row = db.execute(conn, "retry_from", {"id": task_id, "was": was.value}).first()
            if row is None:
                raise InvalidTaskState(f"task {task_id!r} changed while retrying it; try again")
            db.next_token_used(conn, int(row[0]))
            if body is not None:
                db.execute(conn, "state_reset", {"id": task_id, "body": body})
        log.info("task %s is pending again (was %s; state %s)", task_id, was.value,
                 "kept" if body is None else "reset", extra={"task": task_id, "action": "retry"})

    def get_task(self, task_id: str) -> TaskInfo:
        validate_task_id(task_id)
        db = self._ready()
        with db.read() as conn:
            row = db.execute(conn, "get", {"id": task_id}).first()
        if row is None:
            raise TaskNotFound(f"no task {task_id!r} in {self.name}")
        return self._info(row)

    def tasks(self, state: TaskState | str | None = None) -> list[TaskInfo]:
        wanted = None if state is None else TaskState(state)
        db = self._ready()
        with db.read() as conn:
            if wanted is None:
                rows = db.execute(conn, "list", {}).fetchall()
            else:
                rows = db.execute(conn, "list_states", {"states": _STORED_AS[wanted]}).fetchall()
        infos = [self._info(row) for row in rows]
        if wanted is not None:
            infos = [i for i in infos if i.state is wanted]
        return infos

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
        """One page of tasks in one query (``id > :after ORDER BY id LIMIT``, on the primary key).

        Every filter is in SQL, the expiry too (a pending row past ``expires_at`` is expired):
        the query never reads a row it does not return. ``props=False`` reads no props and
        the first :data:`~metafora.contracts.coordinator.MAX_ERROR_BYTES` characters of each error.
        """
        if limit < 1:
            raise ValueError("limit must be at least 1")
        wanted = None if state is None else TaskState(state)
        db = self._ready()
        where = ["namespace = :ns"]
        params: dict[str, Any] = {"ns": db.config.namespace, "limit": limit}
        if wanted is TaskState.PENDING:
            where.append("state = 'pending' AND (expires_at IS NULL OR expires_at > {now})")
        elif wanted is TaskState.EXPIRED:
            where.append("(state = 'expired' OR (state = 'pending' AND expires_at <= {now}))")
        elif wanted is not None:
            where.append("state IN :states")
            params["states"] = _STORED_AS[wanted]
        if owner is not None:
            where.append("owner = :owner")
            params["owner"] = owner
        key_range("id", prefix, after, where, params)
        with db.read() as conn:
            rows = conn.execute(self._page_clause(tuple(where), props), params).fetchall()
        return [self._info(row) for row in rows]

    def _page_clause(self, where: tuple[str, ...], props: bool = True) -> TextClause:
        cache = self._pages
        key = (*where, f"props={props}")
        clause = cache.get(key)
        if clause is None:
            columns = _INFO_COLUMNS if props else _LIST_COLUMNS
            sql = (f"SELECT {columns} FROM metafora_tasks WHERE {' AND '.join(where)}"
                   " ORDER BY id LIMIT :limit").format(**self._db.dialect.fragments())
            clause = text(sql)
            if "state IN :states" in where:
                clause = clause.bindparams(bindparam("states", expanding=True))
            cache[key] = clause
        return clause

    def task_counts(self) -> dict[TaskState, int]:
        """Tasks per state, counted in the database (a pending task past expiry is expired)."""
        db = self._ready()
        with db.read() as conn:
            pending = int(db.execute(conn, "count_pending", {}).scalar_one())
            overdue = int(db.execute(conn, "count_pending_expired", {}).scalar_one())
            claimed = int(db.execute(conn, "count_claimed", {}).scalar_one())
            finished = db.execute(conn, "count_finished", {}).fetchall()
        counts = dict.fromkeys(TaskState, 0)
        counts[TaskState.PENDING] = pending - overdue
        counts[TaskState.EXPIRED] = overdue
        counts[TaskState.CLAIMED] = claimed
        for state, count in finished:
            counts[TaskState(state)] += int(count)
        return counts

    def nodes(self) -> list[str]:
        db = self._ready()
        with db.read() as conn:
            return [str(r[0]) for r in db.execute(conn, "nodes", {}).fetchall()]

    def node_infos(self) -> list[NodeInfo]:
        """The live nodes with their task counts, host, pid, start, last renewal, frozen,
        labels and weight."""
        db = self._ready()
        conv = db.dialect.from_db_time
        with db.read() as conn:
            rows = db.execute(conn, "node_infos", {}).fetchall()
        return [
            NodeInfo(id=str(r[0]), tasks=int(r[1]), host=r[2], pid=None if r[3] is None else int(r[3]),
                     started=conv(r[4]), heartbeat=conv(r[5]),
                     frozen=None if r[6] is None else bool(r[6]),
                     labels=_labels(r[7], str(r[0])), weight=stored_weight(r[8], str(r[0])))
            for r in rows
        ]

    def node_weights(self) -> dict[str, float]:
        return {node: weight for node, weight, _frozen in self._members()}

    def frozen_nodes(self) -> frozenset[str]:
        return frozenset(node for node, _weight, frozen in self._members() if frozen)

    def _members(self) -> list[tuple[str, float, bool]]:
        """(node, weight, frozen) of every live node, in one read."""
        db = self._ready()
        with db.read() as conn:
            rows = db.execute(conn, "node_members", {}).fetchall()
        return [(str(r[0]), stored_weight(r[1], str(r[0])), bool(r[2])) for r in rows]

    def node_task_count(self) -> dict[str, int]:
        db = self._ready()
        with db.read() as conn:
            rows = db.execute(conn, "node_counts", {}).fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    def drain_node(self, node_id: str) -> int:
        db = self._ready()
        with db.write() as conn:
            rows = db.execute(conn, "drain_holds", {"node": validate_task_id(node_id)}).fetchall()
            if rows:
                db.next_token_used(conn, max(int(r[0]) for r in rows))
        return len(rows)

    def submit_command(self, node_id: str, command: Command) -> None:
        db = self._ready()
        with db.write() as conn:
            row = db.execute(conn, "command_submit",
                             {"node": node_id, "body": command.to_json()}).first()
        if row is None:
            raise NodeNotFound(f"no live node {node_id!r} in {self.name}")

    def purge(self, older_than: timedelta | None = None) -> int:
        db = self._ready()
        with db.write() as conn:
            db.execute(conn, "sweep_expired", {})
        count = self.prune(purge_policy(older_than))
        log.info("purged %d finished task(s) from %s", count, self.name,
                 extra={"action": "purge"})
        return count

    def _retention_db(self) -> Database:
        return self._ready()

    def schedules(self) -> list[Schedule]:
        return _schedules.list_schedules(self._ready())

    def _schedule_insert(self, schedule: Schedule) -> None:
        _schedules.insert(self._ready(), schedule)

    def _schedule_delete(self, name: str) -> None:
        _schedules.delete(self._ready(), name)

    def _schedule_pause(self, name: str, paused: bool, now: datetime) -> None:
        _schedules.set_paused(self._ready(), name, paused, now)

    def group_usage(self) -> dict[str, GroupUsage]:
        db = self._ready()
        with db.read() as conn:
            rows = db.execute(conn, "limit_usage", {}).fetchall()
        usage = {}
        for grp, max_running, rate_count, rate_secs, running, recent in rows:
            rate = None if rate_count is None else Rate(int(rate_count), int(rate_secs))
            limit = Limit(str(grp), None if max_running is None else int(max_running), rate)
            usage[limit.group] = GroupUsage(limit, int(running), int(recent))
        return usage

    def _limit_put(self, limit: Limit) -> None:
        db, rate = self._ready(), limit.rate
        with db.write() as conn:
            db.execute(conn, "limit_put", {
                "grp": limit.group, "max": limit.max,
                "rate_count": None if rate is None else rate.count,
                "rate_secs": None if rate is None else rate.window,
            })

    def _limit_delete(self, group: str) -> None:
        db = self._ready()
        with db.transaction() as conn:
            row = db.execute(conn, "limit_delete", {"grp": group}).first()
            if row is not None:
                db.execute(conn, "limit_log_clear", {"grp": group})
        if row is None:
            raise LimitNotFound(f"no limit is set on group {group!r}")

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._db.close()
