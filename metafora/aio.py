"""The async client: the client's verbs as coroutines, for asyncio applications.

Build it with :func:`metafora.open_async_client` (``async with open_async_client(url) as
client:``). Nothing touches the store until the first call.

- **PostgreSQL** goes through an async driver end to end: SQLAlchemy's async engine on
  psycopg's ``AsyncConnection``, no thread per call. It runs the statements the sync client
  runs (built once per store, :mod:`metafora.coordinators.sql.statements` and
  :mod:`metafora.coordinators.sql.submit`). The schema is created on first use as the sync
  client does (through the same async connection). One exception: ``retry_task(...,
  reset_state=True)`` rewrites a state machine's state with the sync client's code, on a
  worker thread.
- **SQLite, etcd and memory** run the sync client's calls on a bounded thread pool
  (``threads`` workers, 8 unless given): their drivers have no async API worth the name
  (SQLite serializes writers anyway; etcd's gRPC client is sync).

Concurrent ``submit_task`` calls share one write (group commit, :class:`_Coalescer`): while
one write is in flight the calls that arrive queue, and the next write carries them all
(PostgreSQL: one multi-row INSERT, one wake-up and one commit; the other stores one
``submit_tasks`` batch on a worker thread). A lone call is written at once, alone, as before.

``conn=`` (SQLite and PostgreSQL stores): the application's async transaction -- a SQLAlchemy
``AsyncConnection`` or ``AsyncSession``, or a psycopg ``AsyncConnection`` -- in which the
tasks are written, existing only if it commits (docs/submit.md).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import functools
import importlib.util
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from metafora import bulk
from metafora.client import Client
from metafora.clock import SYSTEM_CLOCK
from metafora.commands import Command
from metafora.coordinators.sql import submit as _submit
from metafora.coordinators.sql.client import _STORED_AS, SQLClient
from metafora.coordinators.sql.complete import complete_steps
from metafora.coordinators.sql.schema import migrate, needs_migration, require_current
from metafora.coordinators.sql.statements import BATCH
from metafora.coordinators.sql.store import DRIVER_ERRORS, Database, task_params
from metafora.errors import (
    ConfigError,
    CoordinatorClosed,
    InvalidTaskState,
    LimitNotFound,
    MetaforaError,
    NodeNotFound,
    TaskExists,
    TaskNotFound,
)
from metafora.limits import Limit, Rate, validate_limit
from metafora.submitting import IfExists, check_if_exists, no_completion, no_transactions
from metafora.task import Task, TaskInfo, TaskState, validate_group, validate_schedule, validate_task_id
from metafora.task_retry import check_retry_options, check_retryable

if TYPE_CHECKING:
    from metafora.streams.jobs import StreamInfo

__all__ = ["DEFAULT_THREADS", "AsyncClient", "open_async"]

DEFAULT_THREADS = 8
"""Worker threads of an async client on SQLite, etcd or memory (option ``threads``)."""

T = TypeVar("T")


class AsyncClient(abc.ABC):
    """An application's async handle on the store: submit and inspect tasks, command nodes,
    set limits. Every verb is a coroutine; use it as ``async with`` or ``await close()``."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """A printable name of the store (its URL without password)."""

    async def submit_task(self, task: Task, *, conn: Any = None, if_exists: IfExists = "error") -> bool:
        """As :meth:`metafora.Client.submit_task`: True if added or replaced, False if left.

        ``conn``: the application's async transaction (SQLAlchemy ``AsyncConnection`` /
        ``AsyncSession``, psycopg ``AsyncConnection``) on SQLite and PostgreSQL stores."""
        mode = check_if_exists(if_exists)
        validate_schedule(task, SYSTEM_CLOCK.now())
        if conn is not None:
            db = await self._sql_db()
            try:
                steps = _submit.submit_steps(db, [task], mode)
                return await _submit.run_app_steps_async(conn, db, steps) == 1
            except TaskExists:
                raise TaskExists(f"task {task.id!r} already exists in {self.name}",
                                 ids=[task.id]) from None
        return await self._coalesced().submit(task, mode)

    async def submit_tasks(
        self, tasks: Iterable[Task], *, conn: Any = None, if_exists: IfExists = "error"
    ) -> int:
        """As :meth:`metafora.Client.submit_tasks`: the number added or replaced."""
        mode = check_if_exists(if_exists)
        todo = bulk.checked(tasks, SYSTEM_CLOCK.now())
        if conn is not None:
            db = await self._sql_db()
            return await _submit.run_app_steps_async(conn, db, _submit.submit_steps(db, todo, mode))
        return await self._submit_many(todo, mode)

    async def complete_task(self, task: Task, *, conn: Any) -> None:
        """As :meth:`metafora.Client.complete_task`, in the application's async transaction."""
        try:
            db = await self._sql_db()
        except ConfigError:
            raise no_completion(self.name) from None
        await _submit.run_app_steps_async(conn, db, complete_steps(db, task))

    @abc.abstractmethod
    async def _sql_db(self) -> Database:
        """The SQL store's handle with its schema ready (ConfigError on other stores)."""

    _coalescer: _Coalescer | None = None

    def _coalesced(self) -> _Coalescer:
        if self._coalescer is None:
            self._coalescer = _Coalescer(self, self._group_max())
        return self._coalescer

    def _group_max(self) -> int:
        """Most single submits one shared write carries (the store's batch size)."""
        return BATCH

    async def _drained(self) -> None:
        """Wait for the single submits in flight (before the connections are released)."""
        if self._coalescer is not None:
            await self._coalescer.drained()

    @abc.abstractmethod
    async def _submit_one(self, task: Task, mode: IfExists) -> bool:
        """Submit one checked task alone on the client's own connection."""

    @abc.abstractmethod
    async def _submit_group(self, tasks: list[Task], mode: IfExists) -> tuple[list[str], list[Task]]:
        """Submit checked tasks (ids distinct) deciding each alone (``mode`` ``"ignore"`` or
        ``"replace"``) on the client's own connection: the ids left as they were, and the
        tasks of a write that failed (rolled back: none of them was written). An exception:
        nothing of the group was written."""

    @abc.abstractmethod
    async def _submit_many(self, tasks: list[Task], mode: IfExists) -> int:
        """Submit checked tasks (ids distinct) on the client's own connection."""

    async def get_task(self, task_id: str) -> TaskInfo:
        """One task's info, as the sync client's ``get_task``. TaskNotFound."""
        return await self.task(task_id)

    @abc.abstractmethod
    async def task(self, task_id: str) -> TaskInfo:
        """One task's info: :meth:`get_task` (this name is kept as an alias). TaskNotFound."""

    @abc.abstractmethod
    async def tasks(self, state: TaskState | str | None = None) -> list[TaskInfo]:
        """Every task (of ``state``), by id."""

    @abc.abstractmethod
    async def retry_task(self, task_id: str, reset_state: bool = False, keep_cursor: bool = False) -> None:
        """As :meth:`metafora.Client.retry_task`. TaskNotFound, InvalidTaskState."""

    @abc.abstractmethod
    async def delete_task(self, task_id: str) -> None:
        """Remove a task in any state (a running one is stopped on its node). TaskNotFound."""

    @abc.abstractmethod
    async def submit_command(self, node_id: str, command: Command) -> None:
        """Queue ``command`` for live node ``node_id``. NodeNotFound."""

    @abc.abstractmethod
    async def set_limit(self, group: str, max: int | None = None,
                        rate: str | Rate | None = None) -> Limit:
        """As :meth:`metafora.Client.set_limit`."""

    @abc.abstractmethod
    async def limits(self) -> list[Limit]:
        """Every group's limit, by group name."""

    @abc.abstractmethod
    async def delete_limit(self, group: str) -> None:
        """Remove the limit of ``group``. LimitNotFound."""

    # -- streams (metafora.streams): the sync client's verbs on a worker thread ----------

    def _blocking_client(self) -> Client:
        """The sync client the stream verbs run on (off the loop)."""
        raise NotImplementedError  # both implementations below override it

    async def stream(self, task_id: str) -> StreamInfo:
        """As :meth:`metafora.Client.stream`: processed, head, in_flight, failing."""
        return await asyncio.to_thread(self._blocking_client().stream, task_id)

    async def check_stream(self, task_id: str) -> bool:
        """As :meth:`metafora.Client.check_stream`: wake the stream's owner (pushed)."""
        return await asyncio.to_thread(self._blocking_client().check_stream, task_id)

    async def retry_stream(self, task_id: str) -> None:
        """As :meth:`metafora.Client.retry_stream`: resume a stream paused on a failing job."""
        await asyncio.to_thread(self._blocking_client().retry_stream, task_id)

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and threads. Idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


log = logging.getLogger(__name__)

_Waiting = tuple[Task, IfExists, "asyncio.Future[bool]"]


class _Coalescer:
    """Group commit of an async client's concurrent ``submit_task`` calls.

    A caller queues its task and awaits its own future. One writer task (started by the
    first caller that finds none running) writes what is queued: a lone task by the
    single-task path (one round trip, as the sync client), several at once by one shared
    write (:meth:`AsyncClient._submit_group`: PostgreSQL one transaction of a multi-row
    INSERT and one wake-up; the other stores one ``_submit_batch`` on a worker thread); the
    calls that arrive meanwhile queue for the next write. No added latency when idle: the
    first caller's write starts at once. Each caller learns its own fate (added, left, or
    ``TaskExists`` for ``"error"``), the truth of its own row: a shared write may be several
    transactions (a store's batches), and only the tasks of one that failed (rolled back) are
    written again, alone, so one caller's failure is only its own and a task a committed
    batch added is never retried into a ``TaskExists`` of its own caller's row. The writer is
    a task of its own: a caller that is cancelled leaves the others' write alone (its queued
    task is dropped, a task already in a write may be added).
    """

    def __init__(self, client: AsyncClient, most: int) -> None:
        self._client = client
        self._most = most
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._writer: asyncio.Task[None] | None = None

    async def submit(self, task: Task, mode: IfExists) -> bool:
        """Write ``task`` (with the others queued meanwhile): True if added or replaced."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append((task, mode, future))
        if self._writer is None:
            self._writer = asyncio.create_task(self._drain(), name="metafora-aio-submit")
        return await future

    async def drained(self) -> None:
        """Return once nothing is queued or being written."""
        while self._writer is not None:
            await asyncio.wait({self._writer})  # its errors went to its callers

    async def _drain(self) -> None:
        batch: list[_Waiting] = []
        try:
            while self._queue:
                batch = self._take()
                if batch:
                    await self._write(batch)
        except BaseException as exc:  # cancelled (the loop is closing): no caller waits forever
            closed = CoordinatorClosed(f"async client on {self._client.name}: submit abandoned ({exc!r})")
            for _task, _mode, future in [*batch, *self._queue]:
                if not future.done():
                    future.set_exception(closed)
            self._queue.clear()
            raise
        finally:
            self._writer = None

    def _take(self) -> list[_Waiting]:
        """The oldest waiting calls that can share a write: the same kind of write (replace
        or not), distinct ids, at most ``most``; the others keep their place in line."""
        queue, kept, ids = self._queue, [], set()
        batch: list[_Waiting] = []
        replace: bool | None = None
        while queue and len(batch) < self._most:
            item = queue.popleft()
            task, mode, future = item
            if future.done():  # its caller was cancelled
                continue
            if replace is None:
                replace = mode == "replace"
            if (mode == "replace") != replace or task.id in ids:
                kept.append(item)
                continue
            ids.add(task.id)
            batch.append(item)
        queue.extendleft(reversed(kept))
        return batch

    async def _write(self, batch: list[_Waiting]) -> None:
        client = self._client
        if len(batch) == 1:
            task, mode, future = batch[0]
            try:
                added = await client._submit_one(task, mode)
            except Exception as exc:
                _settle(future, exc)
            else:
                _settle(future, added)
            return
        try:
            each: IfExists = "replace" if batch[0][1] == "replace" else "ignore"
            found, failed = await client._submit_group([task for task, _m, _f in batch], each)
        except Exception:  # nothing written: which task failed it? each alone, its own error
            await asyncio.gather(*(self._write([item]) for item in batch))
            return
        left = set(found)
        again = {task.id for task in failed}  # their write rolled back: each alone
        if again:
            await asyncio.gather(*(self._write([item]) for item in batch if item[0].id in again))
        for task, mode, future in batch:
            if task.id in again:
                continue
            if task.id not in left:
                _settle(future, True)
            elif mode == "error":
                _settle(future, TaskExists(f"task {task.id!r} already exists in {client.name}",
                                           ids=[task.id]))
            else:
                _settle(future, False)


def _settle(future: asyncio.Future[bool], outcome: bool | Exception) -> None:
    """Give a waiting caller its outcome (unless it stopped waiting)."""
    if future.done():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class ThreadedAsyncClient(AsyncClient):
    """A sync :class:`~metafora.Client` whose calls run on a bounded thread pool (SQLite, etcd,
    memory)."""

    def __init__(self, client: Client, threads: int = DEFAULT_THREADS) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be a positive integer, got {threads!r}")
        self._client = client
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="metafora-aio")
        self._closed = False

    @property
    def name(self) -> str:
        return self._client.name

    @property
    def client(self) -> Client:
        """The sync client the calls run on."""
        return self._client

    def _blocking_client(self) -> Client:
        return self._client

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._closed:
            raise CoordinatorClosed(f"async client on {self.name} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def _sql_db(self) -> Database:
        client = self._client
        if not isinstance(client, SQLClient):
            raise no_transactions(self.name)
        return await self._call(client._ready)  # the schema, on metafora's own connection

    async def _submit_one(self, task: Task, mode: IfExists) -> bool:
        return await self._call(self._client.submit_task, task, if_exists=mode)

    async def _submit_many(self, tasks: list[Task], mode: IfExists) -> int:
        return await self._call(self._client.submit_tasks, tasks, if_exists=mode)

    def _group_max(self) -> int:
        return min(BATCH, self._client._batch_size)

    async def _submit_group(self, tasks: list[Task], mode: IfExists) -> tuple[list[str], list[Task]]:
        return await self._call(self._group, tasks, mode)

    def _group(self, tasks: list[Task], mode: IfExists) -> tuple[list[str], list[Task]]:
        client = self._client
        left: list[str] = []
        failed: list[Task] = []
        for batch in bulk.batches(tasks, client._batch_size, client._batch_bytes):
            try:  # one write per batch, each id decided alone
                left += client._submit_batch(batch, mode)
            except CoordinatorClosed:
                raise
            except MetaforaError as exc:  # that batch rolled back; the others stand
                log.debug("a shared submit's batch of %d failed: %s", len(batch), exc)
                failed += batch
        return left, failed

    async def task(self, task_id: str) -> TaskInfo:
        return await self._call(self._client.get_task, task_id)

    async def tasks(self, state: TaskState | str | None = None) -> list[TaskInfo]:
        return await self._call(self._client.tasks, state)

    async def retry_task(self, task_id: str, reset_state: bool = False, keep_cursor: bool = False) -> None:
        await self._call(self._client.retry_task, task_id, reset_state, keep_cursor)

    async def delete_task(self, task_id: str) -> None:
        await self._call(self._client.delete_task, task_id)

    async def submit_command(self, node_id: str, command: Command) -> None:
        await self._call(self._client.submit_command, node_id, command)

    async def set_limit(self, group: str, max: int | None = None,
                        rate: str | Rate | None = None) -> Limit:
        return await self._call(self._client.set_limit, group, max, rate)

    async def limits(self) -> list[Limit]:
        return await self._call(self._client.limits)

    async def delete_limit(self, group: str) -> None:
        await self._call(self._client.delete_limit, group)

    async def close(self) -> None:
        if not self._closed:
            await self._drained()
            self._closed = True
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._pool.shutdown)
            self._client.close()


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
        except DRIVER_ERRORS as exc:
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
            except DRIVER_ERRORS as exc:
                raise _submit.translate(exc, self._db) from exc
            self._schema_ready = True

    async def _rows(self, name: str, params: dict[str, Any],
                    conn: AsyncConnection | None = None) -> list[tuple[Any, ...]]:
        params["ns"] = self._db.config.namespace
        if conn is not None:
            return _submit.rows_of(await conn.execute(self._db.sql[name], params))
        async with self._conn() as own:
            return _submit.rows_of(await own.execute(self._db.sql[name], params))

    async def _sql_db(self) -> Database:
        await self._ready()
        return self._db

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


def open_async(client: Client, threads: int = DEFAULT_THREADS) -> AsyncClient:
    """The async client over the store of ``client`` (see :func:`metafora.open_async_client`)."""
    if isinstance(client, SQLClient) and client._db.config.kind == "postgresql":
        if importlib.util.find_spec("greenlet") is None:
            client.close()
            raise ConfigError("the async client on PostgreSQL needs SQLAlchemy's asyncio support"
                              " (greenlet): pip install 'metafora-cluster[async]'")
        return PostgresAsyncClient(client._db)
    return ThreadedAsyncClient(client, threads)
