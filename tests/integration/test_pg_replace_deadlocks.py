"""Issue 52, finding 10, on PostgreSQL: concurrent replaces of the same ids in different
orders deadlocked (6 of 17 calls) and the deadlock read ``CoordinatorUnavailable`` (CLI exit
3, "unreachable"). Rows are now written in id order, so they wait for each other instead;
a deadlock that still happens is a :class:`~metafora.core.errors.WriteConflict` (exit 1)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest

from metafora import Task, open_client
from metafora.cli._common import ExitCode, exit_code_for
from metafora.coordinators.sql.store import translate_error
from metafora.core.errors import WriteConflict
from tests.conformance.test_submit_in_transaction import conninfo

ROUNDS = 8


def test_concurrent_replaces_in_opposite_orders_do_not_deadlock(postgres_url: str) -> None:
    ids = [f"r-{n:03d}" for n in range(300)]
    with open_client(postgres_url) as client:
        client.submit_tasks([Task(i, {"v": 0}) for i in ids])
    barrier = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []

    def replace(order: list[str], side: int) -> None:
        with open_client(postgres_url) as client:
            for n in range(ROUNDS):
                barrier.wait()
                try:
                    client.submit_tasks([Task(i, {"v": n, "side": side}) for i in order],
                                        if_exists="replace")
                except Exception as exc:  # before: CoordinatorUnavailable ... deadlock detected
                    errors.append(exc)

    threads = [threading.Thread(target=replace, args=(order, side))
               for side, order in enumerate((ids, ids[::-1]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == [], errors[:2]


def test_a_deadlock_is_a_write_conflict_not_an_outage(postgres_url: str) -> None:
    table = f"dl_{uuid.uuid4().hex[:8]}"
    info = conninfo(postgres_url)
    with psycopg.connect(info, autocommit=True) as setup:
        setup.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")  # type: ignore[arg-type]
        setup.execute(f"INSERT INTO {table} VALUES (1, 0), (2, 0)")  # type: ignore[arg-type]
    caught: list[BaseException] = []
    try:
        with psycopg.connect(info) as a, psycopg.connect(info) as b:
            a.execute(f"UPDATE {table} SET v = 1 WHERE id = 1")  # type: ignore[arg-type]
            b.execute(f"UPDATE {table} SET v = 1 WHERE id = 2")  # type: ignore[arg-type]

            def cross(conn: Any, row: int) -> None:
                try:
                    conn.execute(f"UPDATE {table} SET v = 2 WHERE id = {row}")
                except psycopg.Error as exc:
                    caught.append(exc)
                    conn.rollback()

            other = threading.Thread(target=cross, args=(a, 2))
            other.start()
            cross(b, 1)
            other.join(60)
            a.rollback()
            b.rollback()
    finally:
        with psycopg.connect(info, autocommit=True) as setup:
            setup.execute(f"DROP TABLE {table}")  # type: ignore[arg-type]
    assert len(caught) == 1, caught
    with open_client(postgres_url) as client:
        error = translate_error(caught[0], client._db.config)  # type: ignore[attr-defined]
    assert isinstance(error, WriteConflict), error  # before: CoordinatorUnavailable
    assert exit_code_for(error) is ExitCode.REFUSED


@pytest.mark.parametrize("mode", ["replace", "ignore"])
def test_one_call_makes_its_tasks_ready_in_id_order(postgres_url: str, mode: str) -> None:
    with open_client(postgres_url) as client:
        assert client.submit_tasks([Task(i) for i in ("c", "a", "b")], if_exists=mode) == 3  # type: ignore[arg-type]
        assert [i.id for i in client.tasks()] == ["a", "b", "c"]
