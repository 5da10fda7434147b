"""The start of a stateful task on every store: what it writes, and the commands around it.

Every claim (and so every move) runs a state machine's start again. It writes a fresh
task's state once and a stored one never (counted on a real store wrapped by
:class:`CountingStates`), a stale token is still refused before the handler runs, and a
command sent around a claim or a move is never dropped silently: it reaches the handler of
the node that runs the task, or the machine logs it as applied.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import pytest

from metafora import Task
from metafora.contracts.coordinator import Coordinator
from metafora.statemachine import (
    AsyncCommands,
    Commands,
    Message,
    MessageKind,
    State,
    StateCode,
    StatefulTaskHandler,
    StateStore,
    commands_for,
    handler_func,
    state_store_for,
)
from metafora.statemachine.aio import AsyncStatefulTaskHandler
from tests.integration import test_statemachine_stores as _stores
from tests.integration.test_statemachine_stores import Nodes

pytestmark = pytest.mark.integration

url = _stores.url  # the same fixtures: every store in turn, a fresh namespace per test
nodes = _stores.nodes

APPLIED = "command run applied; still runnable"


class CountingStates(StateStore):
    """A real state store, wrapped: counts the fenced reads and writes a machine makes."""

    def __init__(self, inner: StateStore) -> None:
        self.inner = inner
        self.loads = 0
        self.writes: list[State] = []

    def load(self, task: Task) -> State:
        self.loads += 1
        return self.inner.load(task)

    def load_stored(self, task: Task) -> State | None:
        self.loads += 1
        return self.inner.load_stored(task)

    def store(self, task: Task, state: State) -> None:
        self.writes.append(state)
        self.inner.store(task, state)

    def get(self, task_id: str) -> State | None:
        return self.inner.get(task_id)


class Listener:
    """A stateful handler that waits for one command in ``cmds.get()`` and records it.

    ``hold`` keeps the handler between its call and its first ``get()`` until set. A
    ``run`` it gets completes the task; any other message is returned (a release ends
    the run)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, Message | None]] = []
        self.entered = threading.Event()
        self.hold = threading.Event()
        self.hold.set()

    def _seen(self, node: str, message: Message | None) -> Message:
        self.got.append((node, message))
        if message is None:
            return Message.release()
        return Message.complete() if message.kind is MessageKind.RUN else message

    def sync(self, node: str) -> Callable[[Task, Commands], Message]:
        def step(task: Task, cmds: Commands) -> Message:
            self.entered.set()
            self.hold.wait(10)
            return self._seen(node, cmds.get(timeout=10))
        return step

    def aio(self, node: str) -> Callable[[Task, AsyncCommands], object]:
        async def step(task: Task, cmds: AsyncCommands) -> Message:
            self.entered.set()
            return self._seen(node, await cmds.get(timeout=10))
        return step


def _machine(coord: Coordinator, step: Callable[..., object], task: Task,
             states: StateStore | None = None) -> StatefulTaskHandler:
    machine = handler_func(step, coord, state_store=states, poll_interval=0.05)(task)  # type: ignore[arg-type]
    assert isinstance(machine, StatefulTaskHandler)
    return machine


def _run(machine: StatefulTaskHandler | AsyncStatefulTaskHandler) -> bool:
    if isinstance(machine, AsyncStatefulTaskHandler):
        return asyncio.run(machine.run())
    return machine.run()


class Background:
    """``_run(machine)`` in a thread; ``result()`` joins it (bounded)."""

    def __init__(self, machine: StatefulTaskHandler) -> None:
        self.machine = machine
        self.value: bool | None = None
        self.thread = threading.Thread(target=self._go, daemon=True)
        self.thread.start()

    def _go(self) -> None:
        self.value = _run(self.machine)

    def result(self) -> bool:
        self.thread.join(20)
        assert not self.thread.is_alive(), "run() did not return"
        assert self.value is not None
        return self.value


# -- the start's writes ---------------------------------------------------------------------


def test_a_start_writes_a_fresh_state_once_and_a_stored_one_never(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    nodes.client.submit_task(Task("t1"))
    def release(task: Task, cmds: Commands) -> Message:
        return Message.release()

    first = nodes.claim("a")
    counted = CountingStates(state_store_for(a))
    assert _machine(a, release, first, counted).run() is False
    assert (counted.loads, counted.writes) == (1, [State()])  # fresh: stored once
    a.release(first)

    moved = nodes.claim("b")  # the same runnable state is stored: nothing to write
    counted = CountingStates(state_store_for(b))
    assert _machine(b, release, moved, counted).run() is False
    assert (counted.loads, counted.writes) == (1, [])
    assert state_store_for(nodes.client).get("t1") == State()

    # A stored state that differs is kept as it is at the start; its change is written.
    state_store_for(b).store(moved, State(StateCode.PAUSED, cursor="7"))
    b.release(moved)
    again = nodes.claim("a")
    commands_for(nodes.client).send("t1", Message.run())  # resumes it as it starts
    counted = CountingStates(state_store_for(a))
    assert _machine(a, release, again, counted).run() is False
    assert counted.writes == [State(cursor="7")]  # paused -> runnable, cursor kept


def test_a_stale_token_start_is_refused_before_the_handler_runs(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    nodes.client.submit_task(Task("t1"))
    old = nodes.claim("a")
    state_store_for(a).store(old, State(cursor="1"))
    a.release(old)  # ... or its lease ran out: the claim moves on
    new = nodes.claim("b")
    called: list[str] = []

    def step(task: Task, cmds: Commands) -> Message:
        called.append(task.id)
        return Message.complete()

    counted = CountingStates(state_store_for(a))
    assert _machine(a, step, old, counted).run() is False  # the zombie releases at once
    assert (called, counted.writes) == ([], [])
    assert state_store_for(nodes.client).get("t1") == State(cursor="1")
    assert _machine(b, step, new).run() is True
    assert called == ["t1"]


# -- commands around a claim and a move -------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_run_sent_before_the_claim_reaches_the_handler(nodes: Nodes, kind: str) -> None:
    a = nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    commands_for(nodes.client).send("t1", Message.run())
    listener = Listener()
    step = listener.sync("a") if kind == "sync" else listener.aio("a")
    assert _run(handler_func(step, a, poll_interval=0.05)(nodes.claim("a"))) is True
    assert listener.got == [("a", Message.run())]


def test_a_run_sent_between_the_claim_and_the_first_get_reaches_the_handler(
    nodes: Nodes,
) -> None:
    a = nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    channel = commands_for(nodes.client)
    task = nodes.claim("a")
    channel.send("t1", Message.run())  # claimed; the machine has not looked yet
    listener = Listener()
    assert _machine(a, listener.sync("a"), task).run() is True
    assert listener.got == [("a", Message.run())]

    nodes.client.submit_task(Task("t2"))  # the handler is called, before its first get()
    listener = Listener()
    listener.hold.clear()
    running = Background(_machine(a, listener.sync("a"), nodes.claim("a", "t2")))
    assert listener.entered.wait(10)
    channel.send("t2", Message.run())
    listener.hold.set()
    assert running.result() is True
    assert listener.got == [("a", Message.run())]


def test_a_run_the_handler_never_reads_is_logged_as_applied(
    nodes: Nodes, caplog: pytest.LogCaptureFixture,
) -> None:
    a = nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    commands_for(nodes.client).send("t1", Message.run())
    with caplog.at_level(logging.INFO, logger="metafora.statemachine"):
        assert _machine(a, lambda task, cmds: Message.complete(), nodes.claim("a")).run() is True
    assert any(APPLIED in r.getMessage() and "did not read it" in r.getMessage()
               for r in caplog.records)


def test_a_run_sent_during_a_handoff_reaches_the_next_owner(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    nodes.client.submit_task(Task("t1"))
    channel = commands_for(nodes.client)
    listener = Listener()
    old = nodes.claim("a")
    machine = _machine(a, listener.sync("a"), old)
    listener.hold.clear()
    running = Background(machine)
    assert listener.entered.wait(10)
    machine.stop()  # the balancer asked a for t1: its handler is being stopped
    channel.send("t1", Message.run())  # while the task moves
    listener.hold.set()
    assert running.result() is False
    assert listener.got == [("a", Message.release())]  # stopping: a's get() answers that
    a.release(old)
    assert _machine(b, listener.sync("b"), nodes.claim("b")).run() is True
    assert listener.got[1:] == [("b", Message.run())]
    assert channel.pending("t1") == 0


def test_a_run_racing_a_release_reaches_a_handler_or_is_logged(
    nodes: Nodes, caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    nodes.client.submit_task(Task("t1"))
    listener = Listener()
    old = nodes.claim("a")
    machine = _machine(a, listener.sync("a"), old)
    running = Background(machine)
    assert listener.entered.wait(10)
    with caplog.at_level(logging.INFO, logger="metafora.statemachine"):
        stopping = threading.Thread(target=machine.stop, daemon=True)
        stopping.start()
        commands_for(nodes.client).send("t1", Message.run())
        stopping.join(10)
        finished = running.result()
        if not finished:  # a released t1 before the run reached its handler
            a.release(old)
            assert _machine(b, listener.sync("b"), nodes.claim("b")).run() is True
    runs = [node for node, message in listener.got if message == Message.run()]
    logged = [r for r in caplog.records if APPLIED in r.getMessage()]
    assert len(runs) + len(logged) == 1, (listener.got, logged)


def test_a_command_that_changes_nothing_is_logged_as_applied(
    nodes: Nodes, caplog: pytest.LogCaptureFixture,
) -> None:
    a = nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    task = nodes.claim("a")
    state_store_for(a).store(task, State(StateCode.PAUSED))
    channel = commands_for(nodes.client)
    channel.send("t1", Message.pause())  # already paused
    channel.send("t1", Message.kill())
    with caplog.at_level(logging.INFO, logger="metafora.statemachine"):
        assert _machine(a, lambda task, cmds: Message.complete(), task).run() is True
    assert any("command pause applied; still paused" in r.getMessage() for r in caplog.records)
