"""Bulk submit on the SQL stores: one INSERT statement and (PostgreSQL) one NOTIFY per batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import event
from sqlalchemy.engine import Engine

from metafora import Task, open_client
from metafora.config import parse_store_url
from metafora.coordinators.sql.dialect import channel_name

N = 1200  # three batches of at most 500


@contextmanager
def _statements() -> Iterator[list[str]]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(Engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", record)


def test_one_insert_per_batch(sql_url: str) -> None:
    with open_client(sql_url) as client:
        client.tasks()  # the schema first, outside the count
        with _statements() as seen:
            client.submit_tasks(Task(f"t{i:05d}") for i in range(N))
        inserts = [s for s in seen if s.lstrip().upper().startswith("INSERT INTO METAFORA_TASKS")]
        assert len(inserts) == 3
        assert len(client.tasks("pending")) == N


def test_one_notification_per_batch_on_postgresql(postgres_url: str) -> None:
    parsed = parse_store_url(postgres_url)
    libpq = postgres_url.split("?", 1)[0].replace("postgresql+psycopg://", "postgresql://")
    with open_client(postgres_url) as client, psycopg.connect(libpq, autocommit=True) as listener:
        client.tasks()
        channel = channel_name(parsed.query["namespace"])
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        client.submit_tasks(Task(f"t{i:05d}") for i in range(N))
        client.submit_task(Task("single"))  # a single submit still names its task
        payloads = [n.payload for n in listener.notifies(timeout=10, stop_after=4)]
    assert [p[0] for p in payloads] == ["b", "b", "b", "t"] and payloads[-1] == "tsingle"
