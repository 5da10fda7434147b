"""Claim at risk on real stores: the warning comes before the handler's stop.

On SQLite, PostgreSQL and etcd, with the store frozen and with it cut off (see
:mod:`tests.integration.risk_harness`): the handler's ``at_risk(until)`` is called before
its ``stop()``, with ``until`` in the future and ``task.at_risk()`` true; before the fault,
``task.valid_until()`` is in the future and moves on with the renewals. Also: an async
handler is warned on the event loop; a stateful handler answers the notice with a
checkpoint that the next owner resumes from; renewals that come back end the episode with
``recovered``; the memory store bounds nothing.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import text

from metafora import Consumer, Task, open_client, open_coordinator, simple_handler
from metafora.contracts.handler import Handler
from metafora.statemachine import Commands, Message, MessageKind, handler_func
from tests.helpers import wait_until
from tests.integration.risk_harness import (
    Outcome,
    etcd_faults,
    postgres_faults,
    run_scenario,
    sqlite_faults,
)

pytestmark = pytest.mark.integration

SQL_TTL = 3  # renew every 1 s, fence 2 s after the last good renewal
ETCD_TTL = 2  # renew every 0.67 s, fence 1.5 s after


def _check(outcome: Outcome, store: str, fault: str) -> None:
    rec = outcome.rec
    first, moved = outcome.valid_until
    assert first > outcome.at_start, "valid_until is not in the future"
    assert moved > first, "valid_until did not move on with the renewals"
    assert rec.warned_at is not None, "no at-risk warning before the stop"
    assert rec.stopped_at is not None
    assert rec.warned_at < rec.stopped_at, "the warning came after the stop"
    assert rec.warned_at >= outcome.fault_at
    assert rec.warned_until is not None and rec.warned_wall is not None
    assert rec.warned_until > rec.warned_wall, "the warning's until is not in the future"
    assert rec.at_risk_flag is True, "task.at_risk() was false inside at_risk()"
    print(f"{store}/{fault}: warned {outcome.warned_after_s:.2f}s after the fault, "
          f"{outcome.lead_s:.2f}s before the stop")


# -- SQLite ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["frozen", "cut"])
def test_sqlite(tmp_path: Any, fault: str) -> None:
    path = f"{tmp_path}/risk.db"
    busy = 30 if fault == "frozen" else 0.1  # a renewal waits for the lock, or is refused
    url = f"sqlite:///{path}?lease_ttl={SQL_TTL}&busy_timeout={busy}"
    outcome = run_scenario(url, sqlite_faults(path)[fault], renew_every=SQL_TTL / 3)
    _check(outcome, "sqlite", fault)


def test_sqlite_async_handler_warned_on_the_loop(tmp_path: Any) -> None:
    path = f"{tmp_path}/risk.db"
    url = f"sqlite:///{path}?lease_ttl={SQL_TTL}&busy_timeout=30"
    outcome = run_scenario(url, sqlite_faults(path)["frozen"], renew_every=SQL_TTL / 3,
                           asynchronous=True)
    _check(outcome, "sqlite-async", "frozen")


# -- PostgreSQL --------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["frozen", "cut"])
def test_postgresql(temp_postgres: Any, fault: str) -> None:
    url = (f"{temp_postgres.url}?namespace=r{uuid.uuid4().hex[:8]}&lease_ttl={SQL_TTL}"
           "&connect_timeout=30")
    outcome = run_scenario(url, postgres_faults(temp_postgres)[fault], renew_every=SQL_TTL / 3)
    _check(outcome, "postgresql", fault)


# -- etcd --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["frozen", "cut"])
def test_etcd(etcd_factory: Any, fault: str) -> None:
    server = etcd_factory()
    url = server.url() + f"?lease_ttl={ETCD_TTL}&timeout=30"
    outcome = run_scenario(url, etcd_faults(server)[fault], renew_every=ETCD_TTL / 3)
    _check(outcome, "etcd", fault)


# -- recovery, state machines, memory ---------------------------------------------------------


def test_recovered_when_the_store_comes_back(tmp_path: Any) -> None:
    """A lock held for less than the slack: warned, then recovered, never stopped."""
    path = f"{tmp_path}/risk.db"
    url = f"sqlite:///{path}?lease_ttl=6&busy_timeout=0.1"  # renew every 2 s, fence after 4 s
    events: list[str] = []
    started = threading.Event()
    warned = threading.Event()

    class Patient(Handler):
        def __init__(self, task: Task) -> None:
            self.task = task
            self._stop = threading.Event()

        def run(self) -> bool:
            started.set()
            self._stop.wait(120)
            return False

        def stop(self) -> None:
            events.append("stop")
            self._stop.set()

        def at_risk(self, until: datetime) -> None:
            events.append("at_risk")
            warned.set()

        def recovered(self, until: datetime) -> None:
            events.append("recovered")

    with open_client(url) as client:
        client.submit_task(Task("t1"))
    consumer = Consumer(open_coordinator(url, node_id="n1"), Patient, shutdown_timeout=5)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        assert started.wait(30)
        with sqlite_faults(path)["cut"]():
            assert warned.wait(30)  # the due renewal is refused as busy
        wait_until(lambda: "recovered" in events, 30, "recovered")
        assert events == ["at_risk", "recovered"]
        assert not [t for t in consumer.tasks() if t.stopped is not None]
    finally:
        consumer.shutdown(timeout=5)
        thread.join(30)
    assert events[:2] == ["at_risk", "recovered"]


@contextlib.contextmanager
def _lease_row_locked(url: str, node: str) -> Iterator[None]:
    """Another connection locks the node's lease row: its renewals hang, other writes pass."""
    from sqlalchemy import create_engine

    engine = create_engine(url.split("?", maxsplit=1)[0].replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            tx = conn.begin()
            conn.execute(text("SELECT 1 FROM metafora_nodes WHERE node_id = :n FOR UPDATE"),
                         {"n": node})
            try:
                yield
            finally:
                tx.rollback()
    finally:
        engine.dispose()


def test_stateful_handler_checkpoints_when_warned(postgres_url: str) -> None:
    """The renewal path hangs (the lease row locked) while state writes still pass: the
    handler answers the notice with a checkpoint of its exact position, and the next run
    of the task resumes from it."""
    url = postgres_url + f"&lease_ttl={SQL_TTL}"
    progress = {"page": 0}
    notices: list[tuple[str, str | None]] = []
    resumed: list[str | None] = []
    running = threading.Event()
    second = threading.Event()

    def crawl(task: Task, cmds: Commands) -> Message:
        if notices:  # the second run: where does it resume?
            resumed.append(cmds.cursor)
            second.set()
            return Message.complete()
        running.set()
        while True:
            progress["page"] += 1
            message = cmds.get(timeout=0.01)
            if message is None:
                continue
            if message.kind is MessageKind.CHECKPOINT:
                cursor = str(progress["page"])
                cmds.checkpoint(cursor)
                notices.append(("checkpoint", cursor))
                continue
            notices.append((message.kind.value, None))
            return message

    with open_client(url) as client:
        client.submit_task(Task("crawl"))
    coord = open_coordinator(url, node_id="sm")
    consumer = Consumer(coord, handler_func(crawl, coord), shutdown_timeout=5)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        assert running.wait(30)
        with _lease_row_locked(url, "sm"):
            wait_until(lambda: ("release", None) in notices, 30, "the stop after the warning")
        assert notices[0][0] == "checkpoint", notices
        assert second.wait(60), "the task did not run again"
        assert resumed == [notices[0][1]]
    finally:
        consumer.shutdown(timeout=5)
        thread.join(30)


def test_memory_store_bounds_nothing() -> None:
    url = f"memory://risk-{uuid.uuid4().hex[:8]}"
    seen: list[object] = []
    done = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        seen.extend([task.valid_until(), task.at_risk()])
        done.set()
        return True

    with open_client(url) as client:
        client.submit_task(Task("t1"))
    consumer = Consumer(open_coordinator(url, node_id="m"), simple_handler(work))
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        assert done.wait(30)
    finally:
        consumer.shutdown(timeout=5)
        thread.join(30)
    assert seen == [None, False]
