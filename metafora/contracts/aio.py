"""The async client: the client's verbs as coroutines, for asyncio applications.

Build it with :func:`metafora.open_async_client` (``async with open_async_client(url) as
client:``). Nothing touches the store until the first call.

- A store may offer a native async client (its backend object's
  ``open_async_client``, see :mod:`metafora.contracts.backends`): **PostgreSQL** goes through an
  async driver end to end (:mod:`metafora.coordinators.sql.aio`).
- **SQLite, etcd and memory** run the sync client's calls on a bounded thread pool
  (:class:`ThreadedAsyncClient`, ``threads`` workers, 8 unless given): their drivers have no
  async API worth the name (SQLite serializes writers anyway; etcd's gRPC client is sync).

Concurrent ``submit_task`` calls share one write (group commit, :class:`_Coalescer`): while
one write is in flight the calls that arrive queue, and the next write carries them all
(PostgreSQL: one multi-row INSERT, one wake-up and one commit; the other stores one
``submit_tasks`` batch on a worker thread). A lone call is written at once, alone, as before.

``conn=`` (SQLite and PostgreSQL stores): the application's async transaction -- a SQLAlchemy
``AsyncConnection`` or ``AsyncSession``, or a psycopg ``AsyncConnection`` -- in which the
tasks are written, existing only if it commits (docs/submit.md); the store's backend object
writes them (:meth:`~metafora.contracts.backends.StoreBackend.submit_in_transaction`).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

from metafora.contracts.client import Client
from metafora.contracts.recipes import verb
from metafora.core import bulk
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.commands import Command
from metafora.core.errors import ConfigError, CoordinatorClosed, MetaforaError, TaskExists
from metafora.core.limits import Limit, Rate
from metafora.core.submitting import IfExists, check_if_exists, no_completion, no_transactions
from metafora.core.task import Task, TaskInfo, TaskState, validate_schedule

if TYPE_CHECKING:
    from metafora.streams.jobs import StreamInfo

__all__ = ["DEFAULT_THREADS", "AsyncClient", "InTransaction", "ThreadedAsyncClient"]

DEFAULT_THREADS = 8
"""Worker threads of an async client on SQLite, etcd or memory (option ``threads``)."""

T = TypeVar("T")

Run = Callable[[Callable[[], Any]], Awaitable[Any]]
"""Runs a sync call off the event loop (the threaded client's pool)."""


class InTransaction(Protocol):
    """What a store offers the threaded async client for ``conn=``: writes in the
    application's async transaction (:class:`metafora.contracts.backends.StoreBackend` has both)."""

    async def submit_in_transaction(self, client: Client, conn: Any, tasks: list[Task],
                                    mode: IfExists, run: Run) -> int:
        """Write checked ``tasks`` in ``conn``: the number added or replaced."""
        ...

    async def complete_in_transaction(self, client: Client, conn: Any, task: Task, run: Run) -> None:
        """Mark the claimed ``task`` done in ``conn``, fenced by its token."""
        ...


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
            try:
                return await self._submit_in(conn, [task], mode) == 1
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
            return await self._submit_in(conn, todo, mode)
        return await self._submit_many(todo, mode)

    async def submit_message(self, task_id: str, message: Any, **options: Any) -> bool:
        """As :meth:`metafora.Client.submit_message`: ``message`` (a registered dataclass,
        pydantic model or protobuf message) as the props of task ``task_id``; ``options`` are
        :meth:`submit_task`'s (``conn``: the application's async transaction, ``if_exists``)
        and the task's own (``priority``, ``group``, ``selector``, ``prefer``, ``spread``)."""
        task, submit = verb("message_task")(task_id, message, options)
        return await self.submit_task(task, **submit)

    async def complete_task(self, task: Task, *, conn: Any) -> None:
        """As :meth:`metafora.Client.complete_task`, in the application's async transaction."""
        await self._complete_in(conn, task)

    @abc.abstractmethod
    async def _complete_in(self, conn: Any, task: Task) -> None:
        """Mark the claimed ``task`` done in the application's async transaction ``conn``,
        fenced by its token (ConfigError on a store that shares no transaction)."""

    @abc.abstractmethod
    async def _submit_in(self, conn: Any, tasks: list[Task], mode: IfExists) -> int:
        """Submit checked tasks in the application's async transaction ``conn``: the number
        added or replaced (ConfigError on a store that shares no transaction)."""

    _coalescer: _Coalescer | None = None

    def _coalesced(self) -> _Coalescer:
        if self._coalescer is None:
            self._coalescer = _Coalescer(self, self._group_max())
        return self._coalescer

    def _group_max(self) -> int:
        """Most single submits one shared write carries (a sync client's batch size)."""
        return Client._batch_size

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


log = logging.getLogger("metafora.aio")  # its name before the move (users' log config names it)

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
    memory); ``transactions`` writes in an application's transaction (``conn=``), on a store
    that shares one (none: ``conn=`` is refused)."""

    def __init__(self, client: Client, threads: int = DEFAULT_THREADS,
                 transactions: InTransaction | None = None) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be a positive integer, got {threads!r}")
        self._client = client
        self._transactions = transactions
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

    async def _complete_in(self, conn: Any, task: Task) -> None:
        if self._transactions is None:
            raise no_completion(self.name)
        await self._transactions.complete_in_transaction(self._client, conn, task, self._call)

    async def _submit_in(self, conn: Any, tasks: list[Task], mode: IfExists) -> int:
        if self._transactions is None:
            raise no_transactions(self.name)
        return await self._transactions.submit_in_transaction(self._client, conn, tasks, mode, self._call)

    async def _submit_one(self, task: Task, mode: IfExists) -> bool:
        return await self._call(self._client.submit_task, task, if_exists=mode)

    async def _submit_many(self, tasks: list[Task], mode: IfExists) -> int:
        return await self._call(self._client.submit_tasks, tasks, if_exists=mode)

    def _group_max(self) -> int:
        return min(Client._batch_size, self._client._batch_size)

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
