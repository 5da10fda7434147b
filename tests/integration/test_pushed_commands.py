"""Task and node commands arrive by push on every real store (SQLite, PostgreSQL, etcd).

The coordinators run with ``poll_interval=600``: the safety net cannot deliver anything
within a test's deadlines, so a command that arrives came by push (PostgreSQL NOTIFY,
the etcd watch, SQLite's per-node ``data_version`` check). The store requests a node
makes are counted on the node's own connection -- SQL statements that touch the command
tables, every unary etcd request -- over a window while many stateful tasks wait in
``cmds.get()``: they stay flat, where polling cost a look per task every 0.5 s.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from metafora import Consumer, Task, TaskState, open_coordinator
from metafora.contracts.coordinator import Coordinator
from metafora.core import commands
from metafora.statemachine import Commands, Message, StateCode, get_state, handler_func, send_task_command
from metafora.testing import LocalCluster
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

_FIXTURE = {"sqlite": "sqlite_url", "postgresql": "postgres_url", "etcd": "etcd_url"}
WAITING = 40  # stateful tasks waiting in cmds.get() on one node
WINDOW = 3.0  # seconds of counting: polling would have made WAITING * 2 * WINDOW looks
NODE_WINDOW = 6.0  # seconds of counting node-command looks: polling made one a second


@pytest.fixture(params=list(_FIXTURE))
def url(request: pytest.FixtureRequest) -> str:
    """A fresh store URL whose safety-net polling is out of the way (10 minutes)."""
    base = str(request.getfixturevalue(_FIXTURE[request.param]))
    return base + ("&" if "?" in base else "?") + "poll_interval=600"


class Requests:
    """Counts one node's store requests: SQL statements on ``tables``; etcd unary calls."""

    def __init__(self, coord: Coordinator, tables: tuple[str, ...]) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._undo: Callable[[], None]
        driver = getattr(coord, "driver", None)
        if driver is not None:  # etcd: every unary request goes through driver._call
            call = driver._call

            def counting(name: str, *args: Any, **kwargs: Any) -> Any:
                self._add(name)
                return call(name, *args, **kwargs)

            driver._call = counting
            self._undo = lambda: delattr(driver, "_call")
        else:
            def seen(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
                for table in tables:
                    if table in statement:
                        self._add(table)

            event.listen(Engine, "before_cursor_execute", seen)
            self._undo = lambda: event.remove(Engine, "before_cursor_execute", seen)

    def _add(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def close(self) -> None:
        self._undo()


def _window(seconds: float) -> None:
    threading.Event().wait(seconds)  # a measurement window, not synchronisation


def _settled(requests: Requests, quiet: float = 1.0, deadline: float = 30.0) -> None:
    """Return once a ``quiet`` interval passed with no request: the node's start-up looks
    (the first command look, membership and schedule reads, the watch's first list) are
    over, even on a loaded machine where they spill past the registration."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        requests.reset()
        _window(quiet)
        if requests.total() == 0:
            return
    raise AssertionError(f"the node never went quiet for {quiet:g}s: {dict(requests.counts)}")


class Waiters:
    """A stateful handler that waits in ``cmds.get()`` and records what it gets."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: set[str] = set()
        self.got: dict[str, Message] = {}
        self.runs: list[tuple[str, str]] = []

    def for_node(self, node: str) -> Callable[[Task, Commands], Message]:
        def wait(task: Task, cmds: Commands) -> Message:
            with self.lock:
                self.runs.append((node, task.id))
                self.waiting.add(task.id)
            message = cmds.get()
            with self.lock:
                self.waiting.discard(task.id)
                if message is not None and not cmds.stopping:
                    self.got[task.id] = message
            return message or Message.release()

        return wait

    def count_waiting(self) -> int:
        with self.lock:
            return len(self.waiting)


def _consumer(cluster: LocalCluster, waiters: Waiters, node: str,
              counted: tuple[str, ...] = ()) -> tuple[Consumer, Requests | None]:
    coord = open_coordinator(cluster.url, node_id=node)
    requests = Requests(coord, counted) if counted else None
    consumer = cluster.start(Consumer(coord, handler_func(waiters.for_node(node), coord)))
    return consumer, requests


@pytest.fixture
def cluster(url: str) -> Iterator[LocalCluster]:
    with LocalCluster(url, shutdown_timeout=20.0) as running:
        running.client.tasks()  # the schema, from one thread, before the consumers start
        yield running
        assert not running.errors


def test_a_command_to_a_task_waiting_in_get_arrives_by_push_without_polling(
    cluster: LocalCluster,
) -> None:
    waiters = Waiters()
    for i in range(WAITING):
        cluster.client.submit_task(Task(f"t{i:02d}"))
    _, requests = _consumer(cluster, waiters, "a", ("metafora_task_commands",))
    assert requests is not None
    try:
        wait_until(lambda: waiters.count_waiting() == WAITING, 60, message="every task waiting")
        requests.reset()
        _window(WINDOW)
        idle = dict(requests.counts)
        # Polling: WAITING tasks x 2 looks a second. Pushed: nothing while nothing arrives
        # (etcd: at most a lease keep-alive in the window).
        assert requests.total() <= 2, idle

        requests.reset()
        send_task_command(cluster.url, "t07", Message.kill())
        wait_until(lambda: "t07" in waiters.got, 20, message="the pushed command")
        cluster.wait_for_state("t07", TaskState.DONE, timeout=20)
        state = get_state(cluster.url, "t07")
        assert state is not None and state.code is StateCode.KILLED
        assert waiters.got == {"t07": Message.kill()}
        assert waiters.count_waiting() == WAITING - 1
        # Delivery reads the one task's queue, not every task's.
        assert requests.total() <= 12, dict(requests.counts)
    finally:
        requests.close()


def test_a_command_sent_while_the_task_moves_reaches_the_next_owner(cluster: LocalCluster) -> None:
    waiters = Waiters()
    cluster.client.submit_task(Task("t1"))
    a, _ = _consumer(cluster, waiters, "a")
    wait_until(lambda: waiters.count_waiting() == 1, 30, message="t1 waiting on a")
    cluster.stop(a)  # graceful: a releases t1
    cluster.wait_for_state("t1", TaskState.PENDING, timeout=20)
    send_task_command(cluster.url, "t1", Message.kill())  # queued while nobody holds t1
    _consumer(cluster, waiters, "b")
    cluster.wait_for_state("t1", TaskState.DONE, timeout=30)
    state = get_state(cluster.url, "t1")
    assert state is not None and state.code is StateCode.KILLED
    # b's machine took the command on claiming, before calling the handler.
    assert waiters.runs == [("a", "t1")]


def test_a_command_sent_to_a_task_being_released_is_not_lost(cluster: LocalCluster) -> None:
    # The command races the release: whichever owner takes it, it is delivered once.
    waiters = Waiters()
    cluster.client.submit_task(Task("t1"))
    a, _ = _consumer(cluster, waiters, "a")
    wait_until(lambda: waiters.count_waiting() == 1, 30, message="t1 waiting on a")
    _consumer(cluster, waiters, "b")
    stopping = threading.Thread(target=cluster.stop, args=(a,), daemon=True)
    stopping.start()
    send_task_command(cluster.url, "t1", Message.kill())
    stopping.join(30)
    assert not stopping.is_alive()
    cluster.wait_for_state("t1", TaskState.DONE, timeout=30)
    state = get_state(cluster.url, "t1")
    assert state is not None and state.code is StateCode.KILLED


def test_node_commands_arrive_by_push_without_polling(cluster: LocalCluster) -> None:
    waiters = Waiters()
    consumer, requests = _consumer(cluster, waiters, "a", ("metafora_commands",))
    assert requests is not None
    try:
        wait_until(lambda: "a" in cluster.client.nodes(), 20, message="a registered")
        _settled(requests)
        requests.reset()
        _window(NODE_WINDOW)
        # The consumer asks for a command every second; the store is asked only when woken
        # (at most a lease keep-alive, or the look after a late LISTEN, may fall in the window).
        assert requests.total() <= 2, dict(requests.counts)
        cluster.client.submit_command("a", commands.freeze())
        wait_until(lambda: consumer.frozen, 20, message="the pushed freeze")
        cluster.client.submit_command("a", commands.unfreeze())
        wait_until(lambda: not consumer.frozen, 20, message="the pushed unfreeze")
    finally:
        requests.close()
