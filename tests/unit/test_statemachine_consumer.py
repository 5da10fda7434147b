"""Stateful handlers under a real Consumer on the memory store: task commands from an
operator (pause, resume, kill, sleep), cursor resume on another node, operator helpers."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from metafora import Task, TaskState
from metafora.coordinators.memory.states import MemoryTaskCommands
from metafora.core.errors import InvalidTaskState, TaskNotFound
from metafora.statemachine import (
    Commands,
    ErrorPolicy,
    InvalidMessage,
    Message,
    StateCode,
    StatefulHandler,
    command_message,
    get_state,
    send_task_command,
)
from metafora.testing import FakeClock, LocalCluster
from tests.helpers import start_stateful as start
from tests.helpers import state_code as code
from tests.helpers import state_cursor as cursor
from tests.helpers import wait_until

_PACE = 0.005  # real seconds between pages of the test worker (pacing, not synchronisation)


class Worker:
    """A stateful handler doing numbered pages, checkpointing each, obeying commands."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.starts: list[tuple[str, str | None]] = []  # (node, cursor at start)
        self._pace = threading.Event()  # never set: waiting on it paces the loop

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
                self._pace.wait(_PACE)

        return work


def test_pause_resume_kill_from_an_operator(cluster: LocalCluster) -> None:
    worker = Worker()
    start(cluster, worker.for_node("a"), "a")
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: cursor(cluster) >= 3, message="progress")

    send_task_command(cluster.url, "t1", command_message("pause"))
    wait_until(lambda: code(cluster) is StateCode.PAUSED, message="paused")
    paused_at = cursor(cluster)
    assert cluster.client.get_task("t1").state is TaskState.CLAIMED  # keeps its claim

    send_task_command(cluster.url, "t1", command_message("resume"))
    wait_until(lambda: cursor(cluster) > paused_at + 2, message="progress after resume")
    assert code(cluster) is StateCode.RUNNABLE

    send_task_command(cluster.url, "t1", command_message("kill"))
    cluster.wait_for_state("t1", TaskState.DONE)
    assert code(cluster) is StateCode.KILLED
    assert [node for node, _ in worker.starts] == ["a", "a"]  # resumed in place, once
    assert not cluster.errors


def test_consumer_info_shows_the_machine_state(cluster: LocalCluster) -> None:
    consumer = start(cluster, lambda t, c: Message.pause(), "a")
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: code(cluster) is StateCode.PAUSED, message="paused")
    rows = consumer.info()["tasks"]
    assert [(r["id"], r["state"]) for r in rows] == [("t1", "paused")]


def test_sleep_until_then_wake_on_the_fake_clock(cluster: LocalCluster) -> None:
    clock = FakeClock()
    worker = Worker()
    start(cluster, worker.for_node("a"), "a", clock=clock)
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: cursor(cluster) >= 1, message="progress")
    until = clock.now() + timedelta(hours=2)
    send_task_command(cluster.url, "t1", command_message("sleep", until.isoformat()))
    wait_until(lambda: code(cluster) is StateCode.SLEEPING, message="sleeping")
    state = get_state(cluster.url, "t1")
    assert state is not None and state.until == until
    asleep_at = cursor(cluster)
    clock.advance(timedelta(hours=1))
    assert code(cluster) is StateCode.SLEEPING
    clock.advance(timedelta(hours=1))
    wait_until(lambda: cursor(cluster) > asleep_at, message="woke up and worked")
    assert code(cluster) is StateCode.RUNNABLE
    assert len(worker.starts) == 2


def test_cursor_resumes_on_another_consumer(cluster: LocalCluster) -> None:
    worker = Worker()
    a = start(cluster, worker.for_node("a"), "a")
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: cursor(cluster) >= 5, message="progress on a")
    start(cluster, worker.for_node("b"), "b")
    cluster.stop(a)  # a releases the task (stop -> poll() answers release)
    wait_until(lambda: len(worker.starts) == 2, message="b picked the task up")
    stopped_at = worker.starts[1][1]
    assert worker.starts[0] == ("a", None)
    assert worker.starts[1][0] == "b"
    assert stopped_at is not None and int(stopped_at) >= 5
    wait_until(lambda: cursor(cluster) > int(stopped_at), message="progress on b")
    send_task_command(cluster.client, "t1", Message.kill())
    cluster.wait_for_state("t1", TaskState.DONE)
    assert not cluster.errors


def test_a_paused_task_stays_paused_on_its_next_owner(cluster: LocalCluster) -> None:
    worker = Worker()
    a = start(cluster, worker.for_node("a"), "a")
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: cursor(cluster) >= 1, message="progress")
    send_task_command(cluster.url, "t1", Message.pause())
    wait_until(lambda: code(cluster) is StateCode.PAUSED, message="paused")
    start(cluster, worker.for_node("b"), "b")
    cluster.stop(a)
    wait_until(lambda: cluster.client.get_task("t1").owner == "b", message="b holds it")
    assert len(worker.starts) == 1  # paused: b does not run the handler
    send_task_command(cluster.url, "t1", Message.run())
    wait_until(lambda: len(worker.starts) == 2, message="resumed on b")
    assert worker.starts[1][0] == "b"


def test_a_failing_task_ends_failed_and_done(cluster: LocalCluster) -> None:
    def broken(task: Task, cmds: Commands) -> Message:
        raise RuntimeError("no such bucket")

    start(cluster, broken, "a", error_handler=ErrorPolicy(max_errors=1))
    cluster.client.submit_task(Task("t1"))
    cluster.wait_for_state("t1", TaskState.DONE)
    state = get_state(cluster.url, "t1")
    assert state is not None and state.code is StateCode.FAILED
    assert state.errors[0].text == "RuntimeError: no such bucket"
    assert state.errors[-1].text.startswith("ExceededErrorRate")


def test_operator_helpers_validate_before_touching_the_store(cluster: LocalCluster) -> None:
    with pytest.raises(TaskNotFound):
        send_task_command(cluster.url, "ghost", Message.pause())
    with pytest.raises(TaskNotFound):
        get_state(cluster.url, "ghost")
    cluster.client.submit_task(Task("t1"))
    assert get_state(cluster.url, "t1") is None  # never run by a state machine
    with pytest.raises(InvalidMessage, match="cannot be sent"):
        send_task_command(cluster.url, "t1", Message.complete())
    channel = MemoryTaskCommands.of(cluster.client)
    assert channel.pending("t1") == 0
    send_task_command(cluster.url, "t1", Message.pause())  # pending task: waits for a claim
    assert channel.pending("t1") == 1


def test_commands_to_finished_tasks_are_refused(cluster: LocalCluster) -> None:
    start(cluster, lambda t, c: Message.complete(), "a")
    cluster.client.submit_task(Task("t1"))
    cluster.wait_for_state("t1", TaskState.DONE)
    with pytest.raises(InvalidTaskState, match="is done"):
        send_task_command(cluster.url, "t1", Message.run())
