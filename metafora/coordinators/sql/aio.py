"""The async client on PostgreSQL, and the SQL stores' writes in an application's async
transaction (what the SQL store's backend object offers :mod:`metafora.contracts.aio`).

PostgreSQL goes through an async driver end to end: SQLAlchemy's async engine on psycopg's
``AsyncConnection``, no thread per call. It runs the statements the sync client runs (built
once per store, :mod:`~metafora.coordinators.sql.statements` and
:mod:`~metafora.coordinators.sql.submit`). The schema is created on first use as the sync
client does (through the same async connection). One exception: ``retry_task(...,
reset_state=True)`` rewrites a state machine's state with the sync client's code, on a worker
thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from metafora.contracts.aio import AsyncClient
from metafora.contracts.client import Client
from metafora.coordinators.sql import submit as _submit
from metafora.coordinators.sql.client import _STORED_AS, SQLClient
from metafora.coordinators.sql.complete import complete_steps
from metafora.coordinators.sql.schema import migrate, needs_migration, require_current
from metafora.coordinators.sql.statements import BATCH
from metafora.coordinators.sql.store import Database, driver_errors, task_params
from metafora.core import bulk
from metafora.core.commands import Command
from metafora.core.errors import (
    ConfigError,
    CoordinatorClosed,
    InvalidTaskState,
    LimitNotFound,
    NodeNotFound,
    TaskExists,
    TaskNotFound,
)
from metafora.core.limits import Limit, Rate, validate_limit
from metafora.core.submitting import IfExists
from metafora.core.task import Task, TaskInfo, TaskState, validate_group, validate_task_id
from metafora.core.task_retry import check_retry_options, check_retryable

__all__ = ["PostgresAsyncClient", "complete_in_transaction", "submit_in_transaction"]

T = TypeVar("T")


async def submit_in_transaction(
    client: SQLClient, conn: Any, tasks: list[Task], mode: IfExists,
    run: Callable[[Callable[[], Any]], Awaitable[Any]],
) -> int:
    """Write checked ``tasks`` in the application's async transaction ``conn`` on ``client``'s
    store (its schema made ready first, on metafora's own connection through ``run``)."""
    db: Database = await run(client._ready)
    return await _submit.run_app_steps_async(conn, db, _submit.submit_steps(db, tasks, mode))


async def complete_in_transaction(
    client: SQLClient, conn: Any, task: Task, run: Callable[[Callable[[], Any]], Awaitable[Any]],
) -> None:
    """Mark the claimed ``task`` done in the application's async transaction ``conn`` on
    ``client``'s store, fenced by its token (its schema made ready first, through ``run``)."""
    db: Database = await run(client._ready)
    await _submit.run_app_steps_async(conn, db, complete_steps(db, task))


def _async_engine(db: Database, autocommit: bool) -> AsyncEngine:
    """SQLAlchemy's async engine on psycopg for a PostgreSQL store (as the sync engines)."""
    url, kwargs = db.dialect.engine_url()  # type: ignore[attr-defined]
    size = db.config.pool_size
    return create_async_engine(
        url, pool_size=size, max_overflow=size, pool_timeout=db.config.connect_timeout,
        connect_args=kwargs, **({"isolation_level": "AUTOCOMMIT"} if autocommit else {}),
    )


class PostgresAsyncClient(AsyncClient):
    """The async client on PostgreSQL: psycopg's async connections through SQLAlchemy's async
    engine, running the sync client's statements."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._sync = SQLClient(db)  # row conversions; reset_state retries (on a thread)
        self._engine: AsyncEngine | None = None
        self._auto: AsyncEngine | None = None
        self._schema_ready = False
        self._schema_lock = asyncio.Lock()
        self._closed = False

    @property
    def name(self) -> str:
        return self._db.name

    def _blocking_client(self) -> Client:
        return self._sync

    def _engines(self) -> tuple[AsyncEngine, AsyncEngine]:
        if self._closed:
            raise CoordinatorClosed(f"async client on {self.name} is closed")
        if self._engine is None or self._auto is None:
            self._engine = _async_engine(self._db, autocommit=False)
            self._auto = _async_engine(self._db, autocommit=True)
        return self._engine, self._auto

    @asynccontextmanager
    async def _conn(self, transaction: bool = False) -> AsyncIterator[AsyncConnection]:
        """A connection: in a transaction, or in autocommit for one statement."""
        await self._ready()
        engine, auto = self._engines()
        try:
            if transaction:
                async with engine.begin() as conn:
                    yield conn
            else:
                async with auto.connect() as conn:
                    yield conn
        except driver_errors() as exc:
            raise _submit.translate(exc, self._db) from exc

    async def _ready(self) -> None:
        if self._schema_ready:
            return
        engine, _auto = self._engines()
        name, dialect = self._db.name, self._db.dialect
        async with self._schema_lock:
            if self._schema_ready:
                return
            try:
                async with engine.connect() as conn:
                    if not self._db.config.migrate:  # the release step's (metafora migrate)
                        await conn.run_sync(lambda c: require_current(c, name))
                    needed = self._db.config.migrate and await conn.run_sync(
                        lambda c: needs_migration(c, name))
                if needed:
                    async with engine.begin() as conn:
                        await conn.run_sync(lambda c: migrate(c, dialect, name))
            except driver_errors() as exc:
                raise _submit.translate(exc, self._db) from exc
            self._schema_ready = True

    async def _rows(self, name: str, params: dict[str, Any],
                    conn: AsyncConnection | None = None) -> list[tuple[Any, ...]]:
        params["ns"] = self._db.config.namespace
        if conn is not None:
            return _submit.rows_of(await conn.execute(self._db.sql[name], params))
        async with self._conn() as own:
            return _submit.rows_of(await own.execute(self._db.sql[name], params))

    async def _complete_in(self, conn: Any, task: Task) -> None:
        await self._ready()
        await _submit.run_app_steps_async(conn, self._db, complete_steps(self._db, task))

    async def _submit_in(self, conn: Any, tasks: list[Task], mode: IfExists) -> int:
        await self._ready()
        return await _submit.run_app_steps_async(conn, self._db, _submit.submit_steps(self._db, tasks, mode))

    def _group_max(self) -> int:
        return BATCH

    async def _run(self, steps: _submit.Steps[T]) -> T:
        """Drive a submit's statements in one transaction on a pooled connection."""
        async with self._conn(transaction=True) as conn:
            async def execute(clause: Any, params: dict[str, Any]) -> list[tuple[Any, ...]]:
                return _submit.rows_of(await conn.execute(clause, params))

            return await _submit.drive_async(execute, self._db, steps)

    async def _submit_group(self, tasks: list[Task], mode: IfExists) -> tuple[list[str], list[Task]]:
        # One transaction: a multi-row INSERT, one wake-up, one commit for every caller.
        return await self._run(_submit.left_steps(self._db, tasks, mode)), []

    async def _submit_one(self, task: Task, mode: IfExists) -> bool:
        # One statement (its RETURNING sends the wake-up) in autocommit, one round trip, run on
        # the pooled psycopg AsyncConnection itself (prepared, as the sync hot path): the
        # SQLAlchemy execution layer cost more CPU per call than the round trip.
        db = self._db
        params = task_params(task, db)
        params["ns"] = db.config.namespace
        sql = _submit.psycopg_sql(_submit.statements(db).one(mode))
        async with self._conn() as conn:
            raw = await conn.get_raw_connection()
            cursor = await raw.driver_connection.execute(sql, params, prepare=True)  # type: ignore[union-attr]
            added = bool(await cursor.fetchall())
        if not added and mode == "error":
            raise TaskExists(f"task {task.id!r} already exists in {self.name}", ids=[task.id])
        return added

    async def _submit_many(self, tasks: list[Task], mode: IfExists) -> int:
        added = 0
        for batch in bulk.batches(tasks, BATCH, _submit.BATCH_BYTES):
            try:  # a transaction per batch, as the sync client: all-or-nothing per batch
                added += await self._run(_submit.submit_steps(self._db, list(batch), mode))
            except TaskExists as exc:
                raise bulk.exists_error(exc.ids, added, len(tasks), self.name) from None
        return added

    async def task(self, task_id: str) -> TaskInfo:
        rows = await self._rows("get", {"id": validate_task_id(task_id)})
        if not rows:
            raise TaskNotFound(f"no task {task_id!r} in {self.name}")
        return self._sync._info(rows[0])

    async def tasks(self, state: TaskState | str | None = None) -> list[TaskInfo]:
        wanted = None if state is None else TaskState(state)
        if wanted is None:
            rows = await self._rows("list", {})
        else:
            rows = await self._rows("list_states", {"states": _STORED_AS[wanted]})
        infos = [self._sync._info(row) for row in rows]
        return infos if wanted is None else [i for i in infos if i.state is wanted]

    async def retry_task(self, task_id: str, reset_state: bool = False, keep_cursor: bool = False) -> None:
        check_retry_options(reset_state, keep_cursor)
        validate_task_id(task_id)
        if reset_state:  # the state machine's rewrite is sync code: on a worker thread
            await asyncio.to_thread(self._sync.retry_task, task_id, reset_state, keep_cursor)
            return
        if await self._rows("retry", {"id": task_id}):
            return
        check_retryable(task_id, (await self.task(task_id)).state)  # raises why not
        raise InvalidTaskState(f"task {task_id!r} changed while retrying it; try again")

    async def delete_task(self, task_id: str) -> None:
        validate_task_id(task_id)
        async with self._conn(transaction=True) as conn:
            rows = await self._rows("delete", {"id": task_id}, conn)
            if rows:
                await self._rows("delete_state", {"id": task_id}, conn)
        if not rows:
            raise TaskNotFound(f"no task {task_id!r} in {self.name}")

    async def submit_command(self, node_id: str, command: Command) -> None:
        if not await self._rows("command_submit", {"node": node_id, "body": command.to_json()}):
            raise NodeNotFound(f"no live node {node_id!r} in {self.name}")

    async def set_limit(self, group: str, max: int | None = None,
                        rate: str | Rate | None = None) -> Limit:
        limit = validate_limit(group, max, rate)
        r = limit.rate
        await self._rows("limit_put", {
            "grp": limit.group, "max": limit.max,
            "rate_count": None if r is None else r.count, "rate_secs": None if r is None else r.window,
        })
        return limit

    async def limits(self) -> list[Limit]:
        rows = await self._rows("limit_usage", {})
        found = [Limit(str(grp), None if most is None else int(most),
                       None if count is None else Rate(int(count), int(secs)))
                 for grp, most, count, secs, _running, _recent in rows]
        return sorted(found, key=lambda limit: limit.group)

    async def delete_limit(self, group: str) -> None:
        name = validate_group(group)
        if name is None:
            raise ConfigError("delete_limit needs a group name")
        async with self._conn(transaction=True) as conn:
            rows = await self._rows("limit_delete", {"grp": name}, conn)
            if rows:
                await self._rows("limit_log_clear", {"grp": name}, conn)
        if not rows:
            raise LimitNotFound(f"no limit is set on group {name!r}")

    async def close(self) -> None:
        if not self._closed:
            await self._drained()
            self._closed = True
            for engine in (self._engine, self._auto):
                if engine is not None:
                    await engine.dispose()
            self._sync.close()
