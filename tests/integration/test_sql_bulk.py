"""Bulk submit on the SQL stores: one INSERT statement and (PostgreSQL) one NOTIFY per batch."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import event
from sqlalchemy.engine import Engine

from metafora import Task, open_client
from metafora.coordinators.sql.dialect import channel_name
from metafora.core.config import parse_store_url
from tests.integration.test_sql_coordinator import Nodes, next_offer

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
    # a plain task's notification carries its whole offer: 'p', the id, US, the props
    assert [p[0] for p in payloads] == ["b", "b", "b", "p"]
    assert payloads[-1].split("\x1f")[0] == "psingle"


def test_a_watch_is_woken_once_per_batch_not_by_its_safety_net(sql_url: str) -> None:
    nodes = Nodes(sql_url)
    with nodes.stack:
        # The safety-net rescan and the lease-expiry wake-ups are minutes away.
        watcher = nodes.node("w", poll_interval=300, lease_ttl=300)
        offers = nodes.watch(watcher)
        nodes.client.submit_task(Task("first"))
        next_offer(offers, "first", 30)  # the watch has done its first full scan
        nodes.client.submit_tasks(Task(f"t{i:05d}") for i in range(N))
        wanted = {f"t{i:05d}" for i in range(N)}
        deadline = time.monotonic() + 60
        while wanted and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                wanted.discard(offers.get(timeout=1).id)
        assert not wanted, f"{len(wanted)} bulk-submitted tasks were never offered"
