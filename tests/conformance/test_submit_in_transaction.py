"""Issue 35: ``submit_task(..., conn=...)`` in the application's own transaction, on SQLite and
PostgreSQL (a SQLAlchemy Connection or Session, or a psycopg Connection); a ConfigError on
memory and etcd."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from metafora import Task, open_client, simple_handler
from metafora.coordinators.sql.dialect import channel_name
from metafora.core.errors import ConfigError, TaskExists, TaskNotFound
from metafora.testing import LocalCluster, wait_for
from tests.helpers import RanIds


def sqlalchemy_url(store_url: str, driver: str = "psycopg") -> str:
    """The SQLAlchemy URL of a store's database (no metafora options)."""
    if store_url.startswith("sqlite:"):
        return store_url.split("?", 1)[0]
    parts = urlsplit(store_url)
    return urlunsplit((f"postgresql+{driver}", parts.netloc, parts.path, "", ""))


def conninfo(store_url: str) -> str:
    """A psycopg conninfo of a PostgreSQL store's database."""
    parts = urlsplit(store_url)
    return urlunsplit(("postgresql", parts.netloc, parts.path, "", ""))


def namespace(store_url: str) -> str:
    query = dict(p.split("=", 1) for p in urlsplit(store_url).query.split("&") if "=" in p)
    return query.get("namespace", "metafora")


Txn = Callable[[], AbstractContextManager[Any]]
"""A transaction of the application: enter to begin, leave normally to commit, raise to roll
back; yields the ``conn=`` to pass and runs ``app_sql`` on the same connection."""


class App:
    """The application's side: its own table and a way into a transaction of each kind."""

    def __init__(self, store_url: str, kind: str) -> None:
        self.url = store_url
        self.kind = kind
        self.table = f"app_orders_{uuid.uuid4().hex[:8]}"
        self.engine = create_engine(sqlalchemy_url(store_url))
        with self.engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {self.table} (id TEXT PRIMARY KEY)"))

    @contextmanager
    def txn(self) -> Iterator[tuple[Any, Callable[[str], None]]]:
        """(conn, add_order) inside one transaction of ``kind``."""
        insert = f"INSERT INTO {self.table} (id) VALUES "
        if self.kind == "connection":
            with self.engine.begin() as conn:
                yield conn, lambda oid: conn.execute(text(insert + "(:id)"), {"id": oid})
        elif self.kind == "session":
            with Session(self.engine) as session, session.begin():
                yield session, lambda oid: session.execute(text(insert + "(:id)"), {"id": oid})
        else:
            with psycopg.connect(conninfo(self.url)) as pconn, pconn.transaction():
                yield pconn, lambda oid: pconn.execute(insert + "(%s)", (oid,))  # type: ignore[arg-type]

    def orders(self) -> list[str]:
        with self.engine.connect() as conn:
            return [str(r[0]) for r in conn.execute(text(f"SELECT id FROM {self.table} ORDER BY id"))]

    def close(self) -> None:
        self.engine.dispose()


KINDS = [("sqlite", "connection"), ("sqlite", "session"), ("postgresql", "connection"),
         ("postgresql", "session"), ("postgresql", "psycopg")]


@pytest.fixture(params=KINDS, ids=["-".join(k) for k in KINDS])
def app(request: pytest.FixtureRequest, metafora_store_url: Callable[[str], str]) -> Iterator[App]:
    store, kind = request.param
    made = App(metafora_store_url(store), kind)
    yield made
    made.close()


class Boom(Exception):
    pass


def test_a_committed_submit_runs_and_a_rolled_back_one_leaves_nothing(app: App) -> None:
    ran = RanIds()
    with LocalCluster(app.url) as cluster:
        cluster.add(simple_handler(ran), "runner")
        client = cluster.client
        with app.txn() as (conn, add_order):
            add_order("o-1")
            assert client.submit_task(Task("ship-o-1", {"order": "o-1"}), conn=conn) is True
            assert client.submit_tasks([Task(f"bulk-{n}") for n in range(3)], conn=conn) == 3
            with pytest.raises(TaskNotFound):
                client.get_task("ship-o-1")  # not committed yet: no one else sees it
        for task_id in ["ship-o-1", "bulk-0", "bulk-1", "bulk-2"]:
            cluster.wait_for_state(task_id, "done", 30)
        # A transaction that fails after the submit: neither the order nor its task.
        with pytest.raises(Boom), app.txn() as (conn, add_order):
            add_order("o-2")
            client.submit_task(Task("ship-o-2"), conn=conn)
            client.submit_tasks([Task("bulk-x"), Task("bulk-y")], conn=conn)
            raise Boom
        client.submit_task(Task("after"))  # committed after: its run shows the consumer looked
        cluster.wait_for_state("after", "done", 30)
        assert app.orders() == ["o-1"]
        assert sorted(i.id for i in client.tasks()) == ["after", "bulk-0", "bulk-1", "bulk-2",
                                                        "ship-o-1"]
        assert sorted(ran.ids) == ["after", "bulk-0", "bulk-1", "bulk-2", "ship-o-1"]


def test_duplicates_in_the_transaction(app: App) -> None:
    with open_client(app.url) as client:
        client.submit_task(Task("taken", {"v": 1}))
        with app.txn() as (conn, _add):
            assert client.submit_task(Task("taken", {"v": 2}), conn=conn, if_exists="ignore") is False
            assert client.submit_task(Task("new", {"v": 2}), conn=conn, if_exists="ignore") is True
            # "error": the refused batch leaves nothing of itself in the transaction, which
            # the application may still commit.
            with pytest.raises(TaskExists, match="'taken'"):
                client.submit_tasks([Task("a"), Task("taken"), Task("b")], conn=conn)
        assert sorted(i.id for i in client.tasks()) == ["new", "taken"]
        with app.txn() as (conn, _add):
            assert client.submit_task(Task("taken", {"v": 3}), conn=conn, if_exists="replace")
        assert client.get_task("taken").props == {"v": 3}


def test_postgresql_wakes_consumers_only_on_commit(metafora_store_url: Callable[[str], str]) -> None:
    url = metafora_store_url("postgresql")
    app = App(url, "connection")
    with open_client(url) as client, psycopg.connect(conninfo(url), autocommit=True) as listener:
        client.tasks()  # the schema
        listener.execute(f"LISTEN {channel_name(namespace(url))}")
        with pytest.raises(Boom), app.txn() as (conn, _add):
            client.submit_task(Task("rolled-back"), conn=conn)
            client.submit_tasks([Task("rb-1"), Task("rb-2")], conn=conn)
            raise Boom
        with app.txn() as (conn, _add):
            client.submit_task(Task("committed"), conn=conn)
        seen: list[str] = []

        def committed_seen() -> bool:
            seen.extend(n.payload for n in listener.notifies(timeout=0.2, stop_after=1))
            return any("committed" in p for p in seen)

        wait_for(committed_seen, 10, "the committed submit's notification")
        # Notifications come in commit order: a rolled-back one would have come first.
        assert not any("rolled-back" in p or p.startswith("b") for p in seen), seen
    app.close()


def test_a_missing_schema_or_another_database_is_a_clear_error(
    metafora_store_url: Callable[[str], str], tmp_path: Any
) -> None:
    url = metafora_store_url("sqlite")
    other = create_engine(f"sqlite:///{tmp_path / 'app-only.db'}")
    with (open_client(url) as client, other.begin() as conn,
          pytest.raises(ConfigError, match="schema is not in the database of this connection")):
        client.submit_task(Task("t"), conn=conn)
    pg = create_engine(sqlalchemy_url(metafora_store_url("postgresql")))
    with open_client(url) as client, pg.begin() as conn:
        with pytest.raises(ConfigError, match="postgresql connection but the store"):
            client.submit_task(Task("t"), conn=conn)
        with pytest.raises(ConfigError, match="takes a SQLAlchemy Connection"):
            client.submit_task(Task("t"), conn="not a connection")
    other.dispose()
    pg.dispose()


@pytest.mark.parametrize("kind", ["memory", "etcd"])
def test_conn_is_a_config_error_on_memory_and_etcd(
    kind: str, metafora_store_url: Callable[[str], str], tmp_path: Any
) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    with open_client(metafora_store_url(kind)) as client, engine.begin() as conn:
        with pytest.raises(ConfigError, match="needs a SQL store"):
            client.submit_task(Task("t"), conn=conn)
        with pytest.raises(ConfigError, match="needs a SQL store"):
            client.submit_tasks([Task("t")], conn=conn)
        assert client.tasks() == []
    engine.dispose()
