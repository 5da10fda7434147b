"""State stores and task command channels on every real store (SQLite, PostgreSQL, etcd;
memory for parity): fenced writes, zombie refusal, FIFO-once commands, and stateful
handlers under real Consumers (operator commands, cursor resume on another node)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from metafora import Consumer, Task, TaskState, open_client, open_coordinator
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator
from metafora.coordinators.memory import drop_store
from metafora.core.errors import ClaimLost, TaskNotFound
from metafora.statemachine import (
    Commands,
    Message,
    State,
    StateCode,
    StatefulHandler,
    commands_for,
    get_state,
    handler_func,
    send_task_command,
    state_store_for,
)
from metafora.testing import LocalCluster, RecordingContext
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

STORES = ["memory", "sqlite", "postgresql", "etcd"]
_FIXTURE = {"sqlite": "sqlite_url", "postgresql": "postgres_url", "etcd": "etcd_url"}


@pytest.fixture(params=STORES)
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh store URL (own namespace) for one test, on each backend in turn."""
    kind = request.param
    if kind == "memory":
        name = f"smi-{uuid.uuid4().hex[:8]}"
        yield f"memory://{name}"
        drop_store(f"{name}/metafora")
        return
    value = request.getfixturevalue(_FIXTURE[kind])
    yield value


@dataclass
class Nodes:
    url: str
    client: Client
    coords: dict[str, Coordinator]

    def node(self, node_id: str) -> Coordinator:
        coord = open_coordinator(self.url, node_id=node_id)
        coord.init(RecordingContext())
        self.coords[node_id] = coord
        return coord

    def claim(self, node_id: str, task_id: str = "t1") -> Task:
        claimed = self.coords[node_id].claim(Task(task_id))
        assert claimed is not None, f"{node_id} could not claim {task_id}"
        return claimed


@pytest.fixture
def nodes(url: str) -> Iterator[Nodes]:
    client = open_client(url)
    n = Nodes(url, client, {})
    try:
        yield n
    finally:
        for coord in n.coords.values():
            coord.close()
        client.close()


def test_fenced_state_round_trip(nodes: Nodes) -> None:
    a = nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    task = nodes.claim("a")
    store = state_store_for(a)
    assert store.load(task) == State()
    assert store.get("t1") is None
    state = State(StateCode.PAUSED, cursor='{"page": 3}')
    store.store(task, state)
    assert store.load(task) == state
    assert state_store_for(nodes.client).get("t1") == state
    assert get_state(nodes.url, "t1") == state


def test_a_zombie_cannot_write_or_read_or_take_commands(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    nodes.client.submit_task(Task("t1"))
    old = nodes.claim("a")
    state_store_for(a).store(old, State(cursor="1"))
    a.release(old)  # ... or its lease ran out: either way the claim moves on
    new = nodes.claim("b")
    assert new.token > old.token
    zombie_states, zombie_cmds = state_store_for(a), commands_for(a)
    with pytest.raises(ClaimLost):
        zombie_states.store(old, State(cursor="zombie"))
    with pytest.raises(ClaimLost):
        zombie_states.load(old)
    send_task_command(nodes.client, "t1", Message.pause())
    with pytest.raises(ClaimLost):
        zombie_cmds.receive("t1", 0, token=old.token)
    assert commands_for(b).receive("t1", 0, token=new.token) == Message.pause()
    assert state_store_for(b).load(new) == State(cursor="1")  # the cursor moved with it
    state_store_for(b).store(new, State(cursor="2"))
    assert get_state(nodes.url, "t1") == State(cursor="2")


def test_a_finished_task_refuses_state_writes(nodes: Nodes) -> None:
    a = nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    task = nodes.claim("a")
    a.done(task)
    with pytest.raises(ClaimLost):
        state_store_for(a).store(task, State(StateCode.COMPLETED))


def test_commands_are_fifo_delivered_once_and_malformed_ones_dropped(nodes: Nodes) -> None:
    nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    task = nodes.claim("a")
    sender = commands_for(nodes.client)
    receiver = commands_for(nodes.coords["a"])
    send_task_command(nodes.url, "t1", Message.pause())
    inject = getattr(sender, "inject_raw")  # noqa: B009 - every store's test hook
    inject("t1", '{"message": "complete"}')
    inject("t1", "{broken")
    send_task_command(nodes.client, "t1", Message.sleep("2031-01-01T00:00:00Z"))
    send_task_command(nodes.client, "t1", Message.kill())
    assert sender.pending("t1") == 5
    got = [receiver.receive("t1", 0, token=task.token) for _ in range(4)]
    assert got == [Message.pause(), Message.sleep("2031-01-01T00:00:00Z"), Message.kill(), None]
    assert sender.pending("t1") == 0


def test_receive_waits_for_a_command_and_cancel_ends_the_wait(nodes: Nodes) -> None:
    nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    task = nodes.claim("a")
    receiver = commands_for(nodes.coords["a"])
    got: list[Message | None] = []
    waiting = threading.Thread(
        target=lambda: got.append(receiver.receive("t1", 30, token=task.token)), daemon=True)
    waiting.start()
    send_task_command(nodes.url, "t1", Message.run())
    waiting.join(10)
    assert got == [Message.run()]
    cancel = threading.Event()
    waiting = threading.Thread(
        target=lambda: got.append(receiver.receive("t1", None, token=task.token, cancel=cancel)),
        daemon=True)
    waiting.start()
    cancel.set()
    waiting.join(10)
    assert not waiting.is_alive() and got[-1] is None


def test_a_task_submitted_again_inherits_no_state_and_no_commands(nodes: Nodes) -> None:
    a = nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    task = nodes.claim("a")
    state_store_for(a).store(task, State(cursor="9"))
    send_task_command(nodes.client, "t1", Message.kill())
    nodes.client.delete_task("t1")
    with pytest.raises(TaskNotFound):
        get_state(nodes.url, "t1")
    nodes.client.submit_task(Task("t1"))  # a new task with the old id
    assert get_state(nodes.url, "t1") is None
    assert commands_for(nodes.client).pending("t1") == 0
    fresh = nodes.claim("a")
    assert state_store_for(a).load(fresh) == State()
    assert commands_for(a).receive("t1", 0, token=fresh.token) is None
    send_task_command(nodes.client, "t1", Message.pause())
    assert commands_for(a).receive("t1", 0, token=fresh.token) == Message.pause()


# -- stateful handlers under real consumers ------------------------------------------------


class Worker:
    """Numbered pages, a checkpoint each, obeying commands; records where each run started."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.starts: list[tuple[str, str | None]] = []
        self._pace = threading.Event()

    def for_node(self, node: str) -> StatefulHandler:
        def work(task: Task, cmds: Commands) -> Message:
            with self.lock:
                self.starts.append((node, cmds.cursor))
            page = int(cmds.cursor or 0)
            while True:
                message = cmds.poll()
                if message is not None:
                    return message
                page += 1
                cmds.checkpoint(str(page))
                self._pace.wait(0.01)  # pacing the fake work, not synchronisation

        return work


def _start(cluster: LocalCluster, stateful: StatefulHandler, node: str, **kwargs: Any) -> Consumer:
    coord = open_coordinator(cluster.url, node_id=node)
    kwargs.setdefault("poll_interval", 0.05)
    return cluster.start(Consumer(coord, handler_func(stateful, coord, **kwargs)))


def _cursor(url: str) -> int:
    state = get_state(url, "t1")
    return int(state.cursor or 0) if state is not None else 0


def _code(url: str) -> StateCode | None:
    state = get_state(url, "t1")
    return None if state is None else state.code


@pytest.mark.slow
def test_operator_commands_and_cursor_resume_on_another_consumer(url: str) -> None:
    worker = Worker()
    with LocalCluster(url, shutdown_timeout=10.0) as cluster:
        # Create the schema from one thread first: on a fresh SQLite file the SQL
        # coordinator's concurrent first connections can hit "database is locked".
        cluster.client.tasks()
        a = _start(cluster, worker.for_node("a"), "a")
        cluster.client.submit_task(Task("t1"))
        wait_until(lambda: _cursor(url) >= 3, 30, message="progress on a")

        send_task_command(url, "t1", Message.pause())
        wait_until(lambda: _code(url) is StateCode.PAUSED, 30, message="paused")
        assert cluster.client.get_task("t1").state is TaskState.CLAIMED
        paused_at = _cursor(url)
        send_task_command(url, "t1", Message.run())
        wait_until(lambda: _cursor(url) > paused_at, 30, message="resumed")

        _start(cluster, worker.for_node("b"), "b")
        cluster.stop(a)  # graceful: a releases; b takes over from the last cursor
        wait_until(lambda: len(worker.starts) == 3, 30, message="b took the task over")
        node, start = worker.starts[2]
        assert node == "b" and start is not None and int(start) >= paused_at + 1
        wait_until(lambda: _cursor(url) > int(start), 30, message="progress on b")

        send_task_command(url, "t1", Message.kill())
        cluster.wait_for_state("t1", TaskState.DONE, timeout=30)
        assert _code(url) is StateCode.KILLED
        assert not cluster.errors
