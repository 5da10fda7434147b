"""Async stateful handlers (``async def step(task, cmds)``, ``await cmds.get()``) under a real
Consumer on the memory store: the same machine as the sync one, on the event loop."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

from metafora import Task, TaskState, open_coordinator
from metafora.statemachine import (
    AsyncCommands,
    AsyncStatefulTaskHandler,
    ErrorPolicy,
    Message,
    StateCode,
    command_message,
    get_state,
    handler_func,
    send_task_command,
)
from metafora.testing import FakeClock, LocalCluster
from tests.helpers import start_stateful as start
from tests.helpers import state_code as code
from tests.helpers import state_cursor as cursor
from tests.helpers import wait_until


class Worker:
    """An async stateful handler doing numbered pages, checkpointing each, obeying commands."""

    def __init__(self) -> None:
        self.starts: list[tuple[str, str | None]] = []  # (node, cursor at start)
        self.threads: set[str] = set()

    def for_node(self, node: str):  # type: ignore[no-untyped-def]
        async def work(task: Task, cmds: AsyncCommands) -> Message:
            self.starts.append((node, cmds.cursor))
            self.threads.add(threading.current_thread().name)
            page = int(cmds.cursor or 0)
            while True:
                message = await cmds.poll()
                if message is not None:
                    return message
                page += 1
                await cmds.checkpoint(str(page))
                await asyncio.sleep(0.005)  # pacing the fake work (not synchronisation)

        return work


def test_handler_func_picks_the_async_runner_for_an_async_def(cluster: LocalCluster) -> None:
    async def step(task: Task, cmds: AsyncCommands) -> Message:
        return Message.complete()

    coord = open_coordinator(cluster.url, node_id="x")
    made = handler_func(step, coord)(Task("t1"))
    assert isinstance(made, AsyncStatefulTaskHandler)
    coord.close()


def test_pause_resume_kill_on_the_event_loop(cluster: LocalCluster) -> None:
    worker = Worker()
    start(cluster, worker.for_node("a"), "a")
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: cursor(cluster) >= 3, message="progress")
    send_task_command(cluster.url, "t1", Message.pause())
    wait_until(lambda: code(cluster) is StateCode.PAUSED, message="paused")
    paused_at = cursor(cluster)
    send_task_command(cluster.url, "t1", Message.run())
    wait_until(lambda: cursor(cluster) > paused_at, message="resumed")
    send_task_command(cluster.url, "t1", Message.kill())
    cluster.wait_for_state("t1", TaskState.DONE)
    assert code(cluster) is StateCode.KILLED
    assert not any(name.startswith("metafora-task-") for name in worker.threads)
    assert not cluster.errors


def test_many_tasks_wait_in_get_without_a_thread_each(cluster: LocalCluster) -> None:
    got: dict[str, str] = {}
    waiting: set[str] = set()

    async def wait_for_order(task: Task, cmds: AsyncCommands) -> Message:
        waiting.add(task.id)
        message = await cmds.get()  # no timeout: until a command or stop()
        assert message is not None
        got[task.id] = message.kind.value
        return message

    start(cluster, wait_for_order, "a")
    before = threading.active_count()
    cluster.client.submit_tasks(Task(f"w{i:03d}") for i in range(200))
    wait_until(lambda: len(waiting) == 200, message="all 200 waiting in get()")
    # 200 tasks wait in `await cmds.get()`; a thread each would add 200.
    assert threading.active_count() - before < 50
    for i in range(200):
        send_task_command(cluster.client, f"w{i:03d}", Message.kill())
    wait_until(lambda: cluster.client.task_counts()[TaskState.DONE] == 200, message="all killed")
    assert set(got.values()) == {"kill"} and len(got) == 200
    assert code(cluster, "w000") is StateCode.KILLED


def test_get_with_a_timeout_returns_none_then_a_command(cluster: LocalCluster) -> None:
    seen: list[str | None] = []

    async def step(task: Task, cmds: AsyncCommands) -> Message:
        first = await cmds.get(timeout=0.05)
        seen.append(None if first is None else first.kind.value)
        second = await cmds.get()
        assert second is not None
        seen.append(second.kind.value)
        return Message.complete()

    start(cluster, step, "a")
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: seen == [None], message="first get timed out")
    send_task_command(cluster.url, "t1", Message.run())
    cluster.wait_for_state("t1", TaskState.DONE)
    assert seen == [None, "run"]
    assert code(cluster) is StateCode.COMPLETED


def test_shutdown_releases_a_task_waiting_in_get_and_the_cursor_resumes(cluster: LocalCluster) -> None:
    starts: list[tuple[str, str | None]] = []

    def make(node: str):  # type: ignore[no-untyped-def]
        async def step(task: Task, cmds: AsyncCommands) -> Message:
            starts.append((node, cmds.cursor))
            await cmds.checkpoint(f"{node}-checkpoint")
            message = await cmds.get()
            assert message is not None  # release when stopped
            return message

        return step

    a = start(cluster, make("a"), "a")
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: get_state(cluster.client, "t1") is not None
               and get_state(cluster.client, "t1").cursor == "a-checkpoint",  # type: ignore[union-attr]
               message="a checkpointed")
    start(cluster, make("b"), "b")
    cluster.stop(a)  # stop() wakes `await cmds.get()`, which answers release
    wait_until(lambda: len(starts) == 2, message="b picked the task up")
    assert starts == [("a", None), ("b", "a-checkpoint")]
    assert code(cluster) is StateCode.RUNNABLE


def test_sleep_until_then_wake_on_the_fake_clock(cluster: LocalCluster) -> None:
    clock = FakeClock()
    worker = Worker()
    start(cluster, worker.for_node("a"), "a", clock=clock)
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: cursor(cluster) >= 1, message="progress")
    until = clock.now() + timedelta(hours=2)
    send_task_command(cluster.url, "t1", command_message("sleep", until.isoformat()))
    wait_until(lambda: code(cluster) is StateCode.SLEEPING, message="sleeping")
    asleep_at = cursor(cluster)
    clock.advance(timedelta(hours=2))
    wait_until(lambda: cursor(cluster) > asleep_at, message="woke up and worked")
    assert len(worker.starts) == 2


def test_a_failing_async_step_ends_failed(cluster: LocalCluster) -> None:
    async def broken(task: Task, cmds: AsyncCommands) -> Message:
        raise RuntimeError("no such bucket")

    start(cluster, broken, "a", error_handler=ErrorPolicy(max_errors=1))
    cluster.client.submit_task(Task("t1"))
    cluster.wait_for_state("t1", TaskState.DONE)
    state = get_state(cluster.url, "t1")
    assert state is not None and state.code is StateCode.FAILED
    assert state.errors[0].text == "RuntimeError: no such bucket"


def test_a_step_returning_no_message_is_a_fault(cluster: LocalCluster) -> None:
    async def wrong(task: Task, cmds: AsyncCommands) -> Message:
        return "done"  # type: ignore[return-value]

    start(cluster, wrong, "a", error_handler=ErrorPolicy(max_errors=1))
    cluster.client.submit_task(Task("t1"))
    cluster.wait_for_state("t1", TaskState.DONE)
    state = get_state(cluster.url, "t1")
    assert state is not None and "not a Message" in state.errors[0].text
