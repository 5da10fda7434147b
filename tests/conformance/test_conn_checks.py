"""Issue 52, findings 3-5: a ``conn=`` argument means one open transaction on the store's own
database. An autocommit connection is refused before anything is written (3); a refused
multi-batch submit leaves none of its rows in the application's transaction, which stays
usable (4); a connection to another database that has a metafora schema too is refused (5).
On SQLite and PostgreSQL, through SQLAlchemy and psycopg, sync and async."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from metafora import Task, open_async_client, open_client
from metafora.core.errors import ConfigError, TaskExists
from metafora.testing.servers import postgres_database
from tests.conformance.test_submit_in_transaction import conninfo, sqlalchemy_url

KINDS = ["sqlite", "postgresql"]


@pytest.fixture
def store(request: pytest.FixtureRequest, metafora_store_url: Callable[[str], str]) -> Iterator[str]:
    url = metafora_store_url(request.param)
    with open_client(url) as client:
        client.tasks()  # the schema, at start-up (docs/submit.md)
    yield url


def _ids(url: str) -> list[str]:
    with open_client(url) as client:
        return sorted(info.id for info in client.tasks())


# -- 3: autocommit is refused, nothing is written --------------------------------------------


@pytest.mark.parametrize("store", KINDS, indirect=True)
def test_an_autocommit_sqlalchemy_connection_is_refused(store: str) -> None:
    engine = create_engine(sqlalchemy_url(store))
    try:
        with open_client(store) as client, engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            with pytest.raises(ConfigError, match=r"(?i)autocommit"):
                client.submit_tasks([Task(f"a-{n}") for n in range(3)], conn=auto)
            with pytest.raises(ConfigError, match=r"(?i)autocommit"):
                client.submit_task(Task("a-9"), conn=auto)
        assert _ids(store) == []  # before: committed at once, then deleted by the undo
    finally:
        engine.dispose()


@pytest.mark.parametrize("store", ["postgresql"], indirect=True)
def test_an_autocommit_psycopg_connection_is_refused_unless_in_a_begin(store: str) -> None:
    with open_client(store) as client, psycopg.connect(conninfo(store), autocommit=True) as conn:
        with pytest.raises(ConfigError, match="autocommit"):
            client.submit_tasks([Task("p-1"), Task("p-2")], conn=conn)
        assert _ids(store) == []
        with conn.transaction():  # an explicit BEGIN: a transaction after all
            assert client.submit_tasks([Task("p-1"), Task("p-2")], conn=conn) == 2
    assert _ids(store) == ["p-1", "p-2"]


@pytest.mark.parametrize("store", KINDS, indirect=True)
def test_an_autocommit_async_connection_is_refused(store: str) -> None:
    url = sqlalchemy_url(store).replace("sqlite:", "sqlite+aiosqlite:")

    async def body() -> None:
        engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
        try:
            async with open_async_client(store) as client, engine.connect() as conn:
                with pytest.raises(ConfigError, match=r"(?i)autocommit"):
                    await client.submit_tasks([Task("x-1"), Task("x-2")], conn=conn)
        finally:
            await engine.dispose()

    asyncio.run(body())
    assert _ids(store) == []


# -- 4: a refused multi-batch submit leaves none of its rows ---------------------------------


@pytest.mark.parametrize("store", KINDS, indirect=True)
def test_a_refused_multi_batch_submit_leaves_nothing_in_the_transaction(store: str) -> None:
    """600 tasks, #551 taken: before, the first batch (500) stayed in the transaction and the
    application's commit committed it, against docs/submit.md."""
    engine = create_engine(sqlalchemy_url(store))
    ids = [f"m-{n:03d}" for n in range(600)]
    try:
        with open_client(store) as client:
            client.submit_task(Task(ids[551]))
            with engine.begin() as conn:
                conn.execute(text("CREATE TABLE app_orders (id TEXT PRIMARY KEY)"))
                with pytest.raises(TaskExists) as refused:
                    client.submit_tasks([Task(i) for i in ids], conn=conn)
                assert list(refused.value.ids) == [ids[551]]
                conn.execute(text("INSERT INTO app_orders (id) VALUES ('o-1')"))  # still usable
            with engine.connect() as conn:
                assert conn.execute(text("SELECT id FROM app_orders")).scalars().all() == ["o-1"]
                conn.execute(text("DROP TABLE app_orders"))
                conn.commit()
        assert _ids(store) == [ids[551]]
    finally:
        engine.dispose()


@pytest.mark.parametrize("store", ["postgresql"], indirect=True)
def test_a_refused_submit_on_psycopg_keeps_the_transaction_usable(store: str) -> None:
    with open_client(store) as client:
        client.submit_task(Task("q-1"))
        with psycopg.connect(conninfo(store)) as conn:
            with pytest.raises(TaskExists):
                client.submit_tasks([Task("q-0"), Task("q-1"), Task("q-2")], conn=conn)
            assert client.submit_task(Task("q-3"), conn=conn)  # the same transaction, usable
            conn.commit()
    assert _ids(store) == ["q-1", "q-3"]


# -- 5: another database with a metafora schema -----------------------------------------------


def _other_sqlite(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'other.db'}"
    with open_client(url) as other:
        other.tasks()  # a metafora schema of its own
    return url


@pytest.mark.parametrize("store", KINDS, indirect=True)
def test_a_connection_to_another_metafora_database_is_refused(
        store: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    other_url: str
    if store.startswith("sqlite"):
        other_url = _other_sqlite(tmp_path)
        engine = create_engine(sqlalchemy_url(other_url))
        run(store, other_url, engine)
        return
    server = request.getfixturevalue("metafora_postgres_server")
    with postgres_database(server) as other_url:
        with open_client(other_url) as other:
            other.tasks()
        engine = create_engine(sqlalchemy_url(other_url))
        run(store, other_url, engine)


def run(store: str, other_url: str, engine: Any) -> None:
    try:
        with (open_client(store) as client, engine.begin() as conn,
              pytest.raises(ConfigError, match="another database")):
            client.submit_task(Task("elsewhere"), conn=conn)  # before: True, written there
        assert _ids(other_url) == [] and _ids(store) == []
        with open_client(store) as client:  # the store's own database is accepted
            own = create_engine(sqlalchemy_url(store))
            try:
                with own.begin() as conn:
                    assert client.submit_task(Task("here"), conn=conn)
            finally:
                own.dispose()
        assert _ids(store) == ["here"]
    finally:
        engine.dispose()


@contextlib.contextmanager
def _claimed(store: str, task_id: str) -> Iterator[tuple[Any, Any, Task, Any]]:
    """A client, a coordinator holding ``task_id``'s claim, the claimed task and an engine on
    the store's database (disposed afterwards)."""
    from metafora import open_coordinator
    from metafora.testing import RecordingContext, wait_for

    engine = create_engine(sqlalchemy_url(store))
    try:
        with open_client(store) as client, open_coordinator(store, node_id="n1") as coord:
            coord.init(RecordingContext())
            client.submit_task(Task(task_id))
            claimed = wait_for(lambda: coord.claim(Task(task_id)), 10, "the claim")
            assert claimed is not None
            yield client, coord, claimed, engine
    finally:
        engine.dispose()


@pytest.mark.parametrize("store", KINDS, indirect=True)
def test_complete_task_refuses_an_autocommit_connection(store: str) -> None:
    """The same rule for ``complete_task(conn=)``: an autocommit connection would commit the
    completion at once, whatever the application's transaction decides."""
    from metafora import TaskState

    with _claimed(store, "c-1") as (client, _, claimed, engine):
        with engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            with pytest.raises(ConfigError, match=r"(?i)autocommit"):
                client.complete_task(claimed, conn=auto)
        assert client.get_task("c-1").state is TaskState.CLAIMED
        with engine.begin() as conn:
            client.complete_task(claimed, conn=conn)
        assert client.get_task("c-1").state is TaskState.DONE


@pytest.mark.parametrize("store", KINDS, indirect=True)
def test_a_stateful_checkpoint_refuses_an_autocommit_connection(store: str) -> None:
    """The same rule for ``cmds.checkpoint(cursor, conn=)`` (the state store's ``store_in``):
    an autocommit connection would commit the cursor at once, whatever the application's
    transaction decides."""
    from metafora.statemachine import State, state_store_for

    with _claimed(store, "s-1") as (_, coord, claimed, engine):
        states = state_store_for(coord)
        with engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            with pytest.raises(ConfigError, match=r"(?i)autocommit"):
                states.store_in(claimed, State(cursor="1"), auto)
        assert states.get("s-1") is None or states.get("s-1").cursor != "1"  # type: ignore[union-attr]
        with engine.begin() as conn:
            states.store_in(claimed, State(cursor="2"), conn)
        stored = states.get("s-1")
        assert stored is not None and stored.cursor == "2"
