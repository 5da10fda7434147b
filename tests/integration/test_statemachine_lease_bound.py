"""Fenced state and item writes never block past the node's lease (issue 13 item 5), on
real stores.

Each test claims a task (for gates, also takes an item), then makes the store hang for
this node -- etcd frozen with SIGSTOP; PostgreSQL row locks (the node's lease row, and the
task's state row or the partition row) held by another connection; SQLite's write lock
held by another connection -- so the lease cannot be renewed and the write cannot finish.
The write must come back as ClaimLost by the time the node's lease runs out (plus a
generous allowance for a busy machine), although the store's own request / busy timeout
is 30 s (what it waited for before: 60 s on etcd, 30 s on SQLite, for ever on a PostgreSQL
row lock).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import text

from metafora import Task, open_client, open_coordinator
from metafora.contracts.coordinator import Coordinator
from metafora.core.errors import ClaimLost
from metafora.statemachine import State, state_store_for
from metafora.testing import RecordingContext
from tests.helpers import sigstop, wait_until

# timing: each bounds a refused write by the lease left (wall clock, run alone in CI).
pytestmark = [pytest.mark.integration, pytest.mark.timing]

SLACK = 3.0  # seconds beyond the lease a loaded machine may need to report the write lost
STORE_TIMEOUT = 30.0  # the store's own timeout: what a write could block for without the bound


def _claimed(url: str) -> tuple[Coordinator, Task, RecordingContext]:
    with open_client(url) as client:
        client.submit_task(Task("t1"))
    ctx = RecordingContext()
    coord = open_coordinator(url, node_id="a")
    coord.init(ctx)
    task = coord.claim(Task("t1"))
    assert task is not None
    state_store_for(coord).store(task, State(cursor="1"))  # the state row exists
    return coord, task, ctx


def _write_while_hung(coord: Coordinator, task: Task, hang: Callable[[], Any],
                      store: str) -> float:
    """Hang the store, write a state, and return how long the write took to be refused."""
    states = state_store_for(coord)
    with hang():
        left = coord.claim_time_left(task)
        assert left is not None and left > 0
        started = time.monotonic()
        with pytest.raises(ClaimLost):
            states.store(task, State(cursor="2"))
        took = time.monotonic() - started
    assert took <= left + SLACK, f"the write took {took:.2f}s with {left:.2f}s of lease left"
    assert took < STORE_TIMEOUT / 2
    assert coord.claim_time_left(task) == 0.0
    with pytest.raises(ClaimLost):  # no time left: refused at once, without I/O
        states.store(task, State(cursor="3"))
    print(f"{store}: state write refused as lost after {took:.2f}s ({left:.2f}s of lease left)")
    return took


def test_etcd_frozen_by_sigstop(etcd_factory: Any) -> None:
    server = etcd_factory()
    url = server.url() + f"?lease_ttl=2&timeout={STORE_TIMEOUT:g}"
    coord, task, ctx = _claimed(url)

    @contextlib.contextmanager
    def frozen() -> Iterator[None]:
        sigstop(server.pid)
        try:
            yield
        finally:
            os.kill(server.pid, signal.SIGCONT)

    try:
        _write_while_hung(coord, task, frozen, "etcd")
        wait_until(lambda: any(t.id == "t1" for t in ctx.lost_tasks), 30, message="lost reported")
    finally:
        coord.close()


def test_etcd_command_take_on_frozen_etcd_is_bounded_by_the_lease(etcd_factory: Any) -> None:
    """A fenced take from the task's command queue is bounded like a state write."""
    from metafora.coordinators.etcd.states import EtcdTaskCommands

    server = etcd_factory()
    url = server.url() + f"?lease_ttl=2&timeout={STORE_TIMEOUT:g}"
    coord, task, _ctx = _claimed(url)
    cmds = EtcdTaskCommands.of(coord)
    sigstop(server.pid)
    try:
        left = coord.claim_time_left(task)
        assert left is not None and left > 0
        started = time.monotonic()
        with pytest.raises(ClaimLost):
            cmds._take(task.id, task.token)
        took = time.monotonic() - started
    finally:
        os.kill(server.pid, signal.SIGCONT)
        coord.close()
    assert took <= left + SLACK, f"the take took {took:.2f}s with {left:.2f}s of lease left"
    assert took < STORE_TIMEOUT / 2


@contextlib.contextmanager
def _pg_locked(coord: Coordinator, table: str, where: str) -> Iterator[None]:
    """Another connection holds the node's lease row (renewals wait) and the rows of
    ``table`` matching ``where`` (the write waits) until the block ends."""
    db: Any = coord._db  # type: ignore[attr-defined]  # a second connection to the same database
    with db.engine.connect() as other:
        tx = other.begin()
        ns = {"ns": db.config.namespace}
        other.execute(text("SELECT 1 FROM metafora_nodes WHERE namespace = :ns"
                           " AND node_id = 'a' FOR UPDATE"), ns)
        other.execute(text(f"SELECT 1 FROM {table} WHERE namespace = :ns AND {where} FOR UPDATE"), ns)
        try:
            yield
        finally:
            tx.rollback()


def test_postgresql_row_locks_held_by_another_connection(postgres_url: str) -> None:
    url = postgres_url + f"&lease_ttl=3&connect_timeout={STORE_TIMEOUT:g}"
    coord, task, ctx = _claimed(url)
    try:
        _write_while_hung(coord, task, lambda: _pg_locked(coord, "metafora_state", "task_id = 't1'"),
                          "postgresql")
        wait_until(lambda: any(t.id == "t1" for t in ctx.lost_tasks), 30, message="lost reported")
    finally:
        coord.close()


def test_sqlite_write_lock_held_by_another_connection(sqlite_url: str) -> None:
    url = sqlite_url + f"?lease_ttl=3&busy_timeout={STORE_TIMEOUT:g}"
    coord, task, ctx = _claimed(url)
    path = sqlite_url.removeprefix("sqlite:///")

    @contextlib.contextmanager
    def locked() -> Iterator[None]:
        other = sqlite3.connect(path, isolation_level=None, timeout=STORE_TIMEOUT)
        try:
            other.execute("BEGIN IMMEDIATE")  # the one write lock of the file
            try:
                yield
            finally:
                other.execute("ROLLBACK")
        finally:
            other.close()

    try:
        _write_while_hung(coord, task, locked, "sqlite")
        wait_until(lambda: any(t.id == "t1" for t in ctx.lost_tasks), 30, message="lost reported")
    finally:
        coord.close()


def test_postgresql_gate_item_write_with_the_partition_row_locked(postgres_url: str) -> None:
    from metafora import gates
    from metafora.statemachine.store import lease_bound_of

    url = postgres_url + f"&lease_ttl=3&connect_timeout={STORE_TIMEOUT:g}"
    with gates.ItemStore(url) as items:
        items.add("t1", [gates.NewItem(gate=0, data=b"x")])
        coord, task, _ctx = _claimed(url)
        try:
            lease = items.lease(task, "a", claim_fence=True, bound=lease_bound_of(coord))
            lease.take_over()
            [item] = lease.take(0, 10)
            done = [gates.ItemResult(item.id, gates.ItemStatus.COMPLETE, 0, 1, data=b"y")]
            with _pg_locked(coord, "metafora_partitions", "partition_id = 't1'"):
                left = coord.claim_time_left(task)
                assert left is not None and left > 0
                started = time.monotonic()
                with pytest.raises(ClaimLost):
                    lease.finish(0, done)
                took = time.monotonic() - started
            assert took <= left + SLACK, f"the write took {took:.2f}s with {left:.2f}s of lease left"
            print(f"postgresql items: write refused as lost after {took:.2f}s ({left:.2f}s left)")
            assert items.get("t1", item.id).status is gates.ItemStatus.AVAILABLE  # nothing written
        finally:
            coord.close()


def test_a_checkpointing_machine_on_frozen_etcd_stops_within_the_stop_margin(etcd_factory: Any) -> None:
    """The symptom of issue 13: after a lost lease the handler stayed in a state write."""
    from metafora.coordinators.etcd.config import ETCD_FENCING
    from metafora.statemachine import Commands, Message, handler_func

    ttl = 4
    server = etcd_factory()
    url = server.url() + f"?lease_ttl={ttl}&timeout={STORE_TIMEOUT:g}"
    with open_client(url) as client:
        client.submit_task(Task("t1"))
    ctx = RecordingContext()
    coord = open_coordinator(url, node_id="a")
    coord.init(ctx)
    writing = threading.Event()

    def checkpoints(task: Task, cmds: Commands) -> Message:
        # Only state writes: the task-command channel (cmds.poll) is not under test here.
        page = 0
        while not cmds.stopping:
            page += 1
            cmds.checkpoint(str(page))  # raises ClaimLost once the write is refused
            writing.set()
        return Message.release()

    try:
        task = coord.claim(Task("t1"))
        assert task is not None
        machine = handler_func(checkpoints, coord, store_retry_delay=0.05)(task)
        returned: list[float] = []
        runner = threading.Thread(target=lambda: (machine.run(), returned.append(time.monotonic())))
        runner.start()
        assert writing.wait(30), "the handler never checkpointed"
        sigstop(server.pid)
        try:
            assert ctx.lost_event.wait(30), "the lease was never fenced"
            fenced = time.monotonic()
            runner.join(STORE_TIMEOUT)
            assert not runner.is_alive(), "the machine stayed in a state write"
        finally:
            os.kill(server.pid, signal.SIGCONT)
        took = returned[0] - fenced
        margin = ETCD_FENCING.margin(ttl)
        print(f"etcd machine: returned {took:.2f}s after the fence (stop margin {margin:.2f}s)")
        assert took <= margin + SLACK
    finally:
        coord.close()
