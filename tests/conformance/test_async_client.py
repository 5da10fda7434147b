"""Issue 35: the async client on every store -- the submit conformance bodies of
``test_submit_if_exists`` run through it, its other verbs, and ``conn=`` in the application's
async transaction (SQLAlchemy ``AsyncConnection`` / ``AsyncSession``, psycopg
``AsyncConnection``)."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from metafora import Task, TaskState, open_async_client, open_client, simple_handler
from metafora.contracts.aio import AsyncClient, ThreadedAsyncClient
from metafora.coordinators.sql.aio import PostgresAsyncClient
from metafora.core import commands
from metafora.core.errors import (
    ConfigError,
    CoordinatorUnavailable,
    InvalidTaskState,
    LimitNotFound,
    NodeNotFound,
    TaskExists,
    TaskNotFound,
)
from metafora.messages import encode, message
from metafora.testing import LocalCluster
from tests.conformance.test_submit_if_exists import (
    check_error_is_the_default,
    check_ignore_leaves_the_existing_task,
    check_replace_changes_a_pending_task_only,
)
from tests.conformance.test_submit_in_transaction import conninfo, sqlalchemy_url
from tests.helpers import RanIds

T = TypeVar("T")


class Blocking:
    """An async client driven from sync test code: its coroutines run on a loop in a thread
    (so the shared sync test bodies run unchanged through it)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        verb = getattr(self.client, name)
        return lambda *args, **kwargs: self.run(verb(*args, **kwargs))

    def close(self) -> None:
        self.run(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def blocking(store_url: str) -> Iterator[Blocking]:
    made = Blocking(open_async_client(store_url))
    yield made
    made.close()


def test_the_store_decides_the_kind_of_async_client(store_url: str) -> None:
    client = open_async_client(store_url)
    expected = PostgresAsyncClient if store_url.startswith("postgresql") else ThreadedAsyncClient
    assert isinstance(client, expected)
    asyncio.run(client.close())


def test_error_is_the_default(blocking: Blocking) -> None:
    check_error_is_the_default(blocking)  # type: ignore[arg-type]


def test_ignore_leaves_the_existing_task(blocking: Blocking) -> None:
    check_ignore_leaves_the_existing_task(blocking)  # type: ignore[arg-type]


def test_replace_changes_a_pending_task_only(blocking: Blocking, store_url: str) -> None:
    check_replace_changes_a_pending_task_only(blocking, store_url)  # type: ignore[arg-type]


def test_the_other_verbs(store_url: str) -> None:
    async def body() -> None:
        async with open_async_client(store_url) as client:
            await client.submit_task(Task("t", {"v": 1}))
            assert (await client.get_task("t")).props == {"v": 1}  # the sync client's name
            assert (await client.task("t")).props == {"v": 1}  # its alias
            assert [i.id for i in await client.tasks()] == ["t"]
            assert await client.tasks(TaskState.DONE) == []
            with pytest.raises(InvalidTaskState):
                await client.retry_task("t")  # pending: nothing to retry
            with pytest.raises(TaskNotFound):
                await client.get_task("nope")
            with pytest.raises(TaskNotFound):
                await client.task("nope")
            await client.delete_task("t")
            with pytest.raises(TaskNotFound):
                await client.delete_task("t")
            with pytest.raises(NodeNotFound):
                await client.submit_command("no-such-node", commands.freeze())
            limit = await client.set_limit("g", max=2, rate="5/1m")
            assert await client.limits() == [limit]
            await client.delete_limit("g")
            assert await client.limits() == []
            with pytest.raises(LimitNotFound):
                await client.delete_limit("g")
            with pytest.raises(TaskExists):
                await client.submit_tasks([Task("a"), Task("a")])
        with pytest.raises(Exception, match="closed"):
            await client.tasks()

    asyncio.run(body())


@message("conformance.Shipped")
@dataclasses.dataclass
class Shipped:
    order_id: str
    parcels: int


def test_submit_message_encodes_like_the_sync_client(store_url: str) -> None:
    async def body() -> None:
        async with open_async_client(store_url) as client:
            assert await client.submit_message("m1", Shipped("o-1", 2), priority=3) is True
            assert await client.submit_message("m1", Shipped("o-1", 9), if_exists="ignore") is False
            info = await client.get_task("m1")
            assert info.props == encode(Shipped("o-1", 2)) and info.priority == 3
            with pytest.raises(ConfigError, match="unknown option"):
                await client.submit_message("m2", Shipped("o-2", 1), prio=1)
            with pytest.raises(ConfigError, match="not a message type"):
                await client.submit_message("m3", object())
            assert [i.id for i in await client.tasks()] == ["m1"]  # nothing half-written

    asyncio.run(body())


def test_fifty_coroutines_submit_and_a_consumer_runs_them(store_url: str) -> None:
    async def body() -> None:
        async with open_async_client(store_url) as client:
            added = await asyncio.gather(*(client.submit_task(Task(f"c-{n:02d}")) for n in range(50)))
            assert added == [True] * 50

    asyncio.run(body())
    ran = RanIds()
    with LocalCluster(store_url) as cluster:
        cluster.add(simple_handler(ran), "runner")
        for n in range(50):
            cluster.wait_for_state(f"c-{n:02d}", "done", 60)
        assert len(ran.ids) == 50


def test_concurrent_submits_share_writes_and_each_caller_learns_its_own_outcome(store_url: str) -> None:
    """Concurrent ``submit_task`` calls are written together (group commit); each caller
    still gets its own answer: added, left (``ignore``/``replace`` of a claimed task),
    replaced, or TaskExists -- and a caller cancelled while queued adds nothing."""

    async def body() -> None:
        async with open_async_client(store_url) as client:
            await client.submit_task(Task("old", {"v": 1}))
            writes = 0
            alone, group = client._submit_one, client._submit_group

            async def count_alone(task: Task, mode: Any) -> bool:
                nonlocal writes
                writes += 1
                return await alone(task, mode)

            async def count_group(tasks: list[Task], mode: Any) -> list[str]:
                nonlocal writes
                writes += 1
                return await group(tasks, mode)

            client._submit_one, client._submit_group = count_alone, count_group  # type: ignore[method-assign]
            fresh = [client.submit_task(Task(f"n-{n:02d}")) for n in range(40)]
            twice = [client.submit_task(Task("dup")) for _ in range(4)]
            taken = [client.submit_task(Task("old")) for _ in range(2)]
            ignored = [client.submit_task(Task("old"), if_exists="ignore") for _ in range(2)]
            replaced = [client.submit_task(Task("old", {"v": 2}), if_exists="replace")]
            calls = [*fresh, *twice, *taken, *ignored, *replaced]
            got = await asyncio.gather(*calls, return_exceptions=True)
            assert writes < len(calls) // 4  # shared, not one write a call
            assert got[:40] == [True] * 40
            dup = got[40:44]
            assert dup.count(True) == 1 and sum(isinstance(r, TaskExists) for r in dup) == 3
            assert all(isinstance(r, TaskExists) and r.ids == ("old",) for r in got[44:46])
            assert got[46:48] == [False, False]
            assert got[48] is True
            assert (await client.task("old")).props == {"v": 2}
            assert len(await client.tasks()) == 42

            # A caller cancelled while its submit waits in line: the others' write goes on
            # without its task. (The writer task runs after every queued caller has run up
            # to its await: asyncio runs ready callbacks in order.)
            queued = [asyncio.ensure_future(client.submit_task(Task(f"q-{n}"))) for n in range(5)]
            await asyncio.sleep(0)  # one pass of the loop: each caller queued its task
            queued[2].cancel()
            outcome = await asyncio.gather(*queued, return_exceptions=True)
            assert isinstance(outcome[2], asyncio.CancelledError)
            assert [outcome[n] for n in (0, 1, 3, 4)] == [True] * 4
            assert sorted(i.id for i in await client.tasks() if i.id.startswith("q-")) == [
                "q-0", "q-1", "q-3", "q-4"]

    asyncio.run(body())


def test_a_failed_shared_write_gives_each_caller_an_error(metafora_store_url: Callable[[str], str]) -> None:
    """SQLite held by another writer past the busy timeout: the shared write fails, its tasks
    are tried one by one, and every caller gets its error (none waits forever, none is added);
    once the lock is gone the same submits succeed."""
    url = metafora_store_url("sqlite")
    path = url.removeprefix("sqlite:///")

    async def body() -> None:
        async with open_async_client(f"{url}?busy_timeout=0.2") as client:
            await client.tasks()  # the schema, before the lock
            other = sqlite3.connect(path, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")  # another process's write transaction
            try:
                got = await asyncio.gather(*(client.submit_task(Task(f"f-{n}")) for n in range(5)),
                                           return_exceptions=True)
            finally:
                other.execute("ROLLBACK")
                other.close()
            assert all(isinstance(r, CoordinatorUnavailable) for r in got), got
            assert await client.tasks() == []
            again = await asyncio.gather(*(client.submit_task(Task(f"f-{n}")) for n in range(5)))
            assert again == [True] * 5

    asyncio.run(body())


ASYNC_KINDS = [("sqlite", "connection"), ("sqlite", "session"), ("postgresql", "connection"),
               ("postgresql", "session"), ("postgresql", "psycopg")]


@pytest.mark.parametrize(("store", "kind"), ASYNC_KINDS, ids=["-".join(k) for k in ASYNC_KINDS])
def test_conn_in_the_applications_async_transaction(
    store: str, kind: str, metafora_store_url: Callable[[str], str]
) -> None:
    url = metafora_store_url(store)
    table = f"app_orders_{uuid.uuid4().hex[:8]}"
    with open_client(url) as client:
        client.tasks()  # the schema (the application's engine never creates it)
    sa_url = sqlalchemy_url(url).replace("sqlite:", "sqlite+aiosqlite:", 1)

    class Boom(Exception):
        pass

    async def body() -> list[str]:
        engine = create_async_engine(sa_url)
        async with engine.begin() as conn:
            await conn.execute(text(f"CREATE TABLE {table} (id TEXT PRIMARY KEY)"))
        insert = text(f"INSERT INTO {table} (id) VALUES (:id)")

        async def in_txn(client: AsyncClient, order: str, fail: bool) -> None:
            if kind == "psycopg":
                pconn = await psycopg.AsyncConnection.connect(conninfo(url))
                async with pconn, pconn.transaction():
                    await pconn.execute(f"INSERT INTO {table} (id) VALUES (%s)", (order,))  # type: ignore[arg-type]
                    await client.submit_task(Task(f"ship-{order}"), conn=pconn)
                    await client.submit_tasks([Task(f"more-{order}-{n}") for n in range(2)],
                                              conn=pconn)
                    if fail:
                        raise Boom
                return
            if kind == "session":
                async with AsyncSession(engine) as session, session.begin():
                    await session.execute(insert, {"id": order})
                    await client.submit_task(Task(f"ship-{order}"), conn=session)
                    await client.submit_tasks([Task(f"more-{order}-{n}") for n in range(2)],
                                              conn=session)
                    if fail:
                        raise Boom
                return
            async with engine.begin() as conn:
                await conn.execute(insert, {"id": order})
                await client.submit_task(Task(f"ship-{order}"), conn=conn)
                await client.submit_tasks([Task(f"more-{order}-{n}") for n in range(2)], conn=conn)
                if fail:
                    raise Boom

        async with open_async_client(url) as client:
            await in_txn(client, "o1", fail=False)
            with pytest.raises(Boom):
                await in_txn(client, "o2", fail=True)
            async with engine.connect() as conn:
                orders = [str(r[0]) for r in await conn.execute(text(f"SELECT id FROM {table}"))]
        await engine.dispose()
        return orders

    assert asyncio.run(body()) == ["o1"]
    ran = RanIds()
    with LocalCluster(url) as cluster:
        assert sorted(i.id for i in cluster.client.tasks()) == ["more-o1-0", "more-o1-1", "ship-o1"]
        cluster.add(simple_handler(ran), "runner")
        cluster.wait_for_state("ship-o1", "done", 30)
        assert "ship-o2" not in ran.ids


@pytest.mark.parametrize("kind", ["memory", "etcd"])
def test_async_conn_is_a_config_error_on_memory_and_etcd(
    kind: str, metafora_store_url: Callable[[str], str], tmp_path: Any
) -> None:
    async def body() -> None:
        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
        async with open_async_client(metafora_store_url(kind)) as client, engine.begin() as conn:
            with pytest.raises(ConfigError, match="needs a SQL store"):
                await client.submit_task(Task("t"), conn=conn)
        await engine.dispose()

    asyncio.run(body())


def _refuse_one_row(url: str, task_id: str) -> Callable[[], None]:
    """A trigger that makes the database refuse the row of ``task_id`` (a constraint of the
    application's own, say); returns its removal."""
    if url.startswith("sqlite"):
        path = url.removeprefix("sqlite:///").split("?")[0]
        with sqlite3.connect(path) as db:
            db.execute(f"CREATE TRIGGER refuse_one BEFORE INSERT ON metafora_tasks WHEN NEW.id = "
                       f"'{task_id}' BEGIN SELECT RAISE(ABORT, 'refused by the application'); END")

        def drop_sqlite() -> None:
            with sqlite3.connect(path) as db:
                db.execute("DROP TRIGGER refuse_one")
        return drop_sqlite
    name = f"refuse_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(conninfo(url), autocommit=True) as db:
        db.execute(f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "  # type: ignore[arg-type]
                   f"RAISE EXCEPTION 'refused by the application'; END $$")
        db.execute(f"CREATE TRIGGER {name} BEFORE INSERT ON metafora_tasks FOR EACH ROW "  # type: ignore[arg-type]
                   f"WHEN (NEW.id = '{task_id}') EXECUTE FUNCTION {name}()")

    def drop_postgres() -> None:
        with psycopg.connect(conninfo(url), autocommit=True) as db:
            db.execute(f"DROP TRIGGER {name} ON metafora_tasks")  # type: ignore[arg-type]
            db.execute(f"DROP FUNCTION {name}()")  # type: ignore[arg-type]
    return drop_postgres


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_each_caller_of_a_shared_write_learns_the_truth_of_its_own_row(
        kind: str, metafora_store_url: Callable[[str], str]) -> None:
    """Issue 52, finding 2: 24 concurrent submits of 900 KB props share a write of several
    batches (SQLite: 16 MiB each) and the database refuses one row. Before, the committed
    early batches were retried one by one and 18 callers were told TaskExists for the task
    their own call had added."""
    url = metafora_store_url(kind)
    bad = f"big-refused-{uuid.uuid4().hex[:6]}"
    ids = [f"big-{n:02d}" for n in range(23)]
    ids.insert(20, bad)  # in the second batch
    blob = "x" * 900_000

    async def body() -> list[bool | BaseException]:
        async with open_async_client(url) as client:
            await client.tasks()  # the schema, before the trigger
            drop = _refuse_one_row(url, bad)
            try:
                return await asyncio.gather(
                    *(client.submit_task(Task(i, {"blob": blob})) for i in ids), return_exceptions=True)
            finally:
                drop()

    got = dict(zip(ids, asyncio.run(body()), strict=True))
    refused = got.pop(bad)
    assert isinstance(refused, Exception) and not isinstance(refused, TaskExists), refused
    assert got == dict.fromkeys(got, True), {k: v for k, v in got.items() if v is not True}
    with open_client(url) as client:
        assert sorted(i.id for i in client.tasks()) == sorted(got)
