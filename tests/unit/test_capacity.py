"""Claim only what can run: the default thread cap, and a handler that cannot be started.

A node whose handler cannot start (its thread cannot start, the event loop is gone) releases
the task at once, claims no more than it runs, logs the cause once and goes on; the rest of
the cluster takes the released tasks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from metafora import Consumer, Task, TaskState
from metafora.consumer.capacity import (
    CAPACITY_RETRY,
    THREAD_CAP_CEILING,
    Capacity,
    MachineThreads,
    default_thread_cap,
    machine_threads,
    thread_cap_from,
    thread_limits,
)
from metafora.consumer.options import ConsumerOptions
from metafora.consumer.runner import CannotStart, HandlerRunner
from metafora.consumer.running import NodeLog
from metafora.contracts.handler import HandlerFunc, simple_handler
from metafora.core.errors import ConfigError
from metafora.surfaces.connect import open_coordinator
from metafora.testing import LocalCluster
from tests.helpers import wait_until

# -- the default cap ---------------------------------------------------------------------


def test_the_cap_is_a_quarter_of_the_tightest_limit_under_a_ceiling() -> None:
    assert thread_cap_from({}) == THREAD_CAP_CEILING
    assert thread_cap_from({"pid_max": 4_194_304, "threads-max": 192_731}) == THREAD_CAP_CEILING
    assert thread_cap_from({"pid_max": 32_768}) == 4096 == THREAD_CAP_CEILING
    assert thread_cap_from({"pid_max": 32_768, "pids.max": 1000}) == 250
    assert thread_cap_from({"RLIMIT_NPROC": 2}) == 1  # never 0: a node runs something
    assert thread_cap_from({"RLIMIT_AS": 100, "pid_max": 32_768}) == 25


def test_the_limits_of_this_process_are_read() -> None:
    limits = thread_limits()
    assert all(isinstance(v, int) and v > 0 for v in limits.values())
    assert "pid_max" in limits  # Linux: /proc/sys/kernel/pid_max
    assert 1 <= default_thread_cap() <= THREAD_CAP_CEILING
    assert default_thread_cap() == thread_cap_from(limits)


def test_the_machine_keeps_a_quarter_of_its_threads_free_for_every_node_together() -> None:
    now = [0.0]
    reading = [(20_000, 32_768)]  # 20,000 threads in use on a machine of 32,768
    machine = MachineThreads(lambda: now[0], lambda: list(reading))
    assert machine.left() == 32_768 - 8_192 - 20_000  # 4,576 before a quarter is left
    machine.took(576)
    assert machine.left() == 4_000  # a burst of starts counts before the next reading
    reading[0] = (24_600, 32_768)  # other nodes started threads meanwhile
    assert machine.left() == 4_000  # kept half a second
    now[0] = 0.5
    assert machine.left() == 0  # under a quarter left: no node starts more
    reading.append((900, 1_000))  # a cgroup limit, tighter still
    now[0] = 1.0
    assert machine.left() == 0
    assert MachineThreads(lambda: 0.0, lambda: []).left() is None  # nothing to read


def test_a_nodes_thread_cap_follows_what_the_machine_has_left() -> None:
    busy = [10]
    machine = MachineThreads(lambda: 0.0, lambda: [(24_000, 32_768)])  # 576 left
    capped = Capacity(max_tasks=None, thread_cap=4096, busy_threads=lambda: busy[0],
                      monotonic=lambda: 0.0, log=NodeLog(logging.getLogger("t"), {}),
                      machine=machine)
    assert capped.free_slots(10) == 576
    capped.started(11, "thread")
    assert capped.free_slots(11) == 575
    assert capped.limit() == 10 + 575  # published: the shares see the machine's bound


@pytest.mark.parametrize("max_tasks", [None, 5])
@pytest.mark.parametrize("thread_cap", [None, 0, 64])
@pytest.mark.parametrize("ran_threads", [False, True])
@pytest.mark.parametrize("reduced", [None, 3])
def test_bounded_says_whether_there_is_a_limit(max_tasks: int | None, thread_cap: int | None,
                                               ran_threads: bool, reduced: int | None) -> None:
    """``bounded()`` (asked at every handler's end) answers without counting threads: the
    same as ``limit() is not None`` in every combination of bounds."""
    capacity = Capacity(max_tasks=max_tasks, thread_cap=thread_cap, busy_threads=lambda: 2,
                        monotonic=lambda: 0.0, log=NodeLog(logging.getLogger("t"), {}),
                        machine=MachineThreads(lambda: 0.0, lambda: [(100, 32_768)]))
    capacity.ran_threads = ran_threads
    capacity.reduced = reduced
    assert capacity.bounded() is (capacity.limit() is not None)


def test_the_machines_threads_are_read() -> None:
    readings = machine_threads()
    assert readings and all(0 < used < limit for used, limit in readings)


def test_thread_cap_is_validated() -> None:
    for bad in (-1, True, 1.5, "8"):
        with pytest.raises(ConfigError, match="thread_cap"):
            ConsumerOptions(thread_cap=bad)  # type: ignore[arg-type]
    assert ConsumerOptions(thread_cap=0).thread_cap == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def capacity(busy: list[int], clock: Clock | None = None, **kwargs: int | None) -> Capacity:
    options: dict[str, int | None] = {"max_tasks": None, "thread_cap": None, **kwargs}
    return Capacity(max_tasks=options["max_tasks"], thread_cap=options["thread_cap"],
                    busy_threads=lambda: busy[0], monotonic=clock or Clock(),
                    log=NodeLog(logging.getLogger("metafora.consumer"), {"node": "n"}))


def test_an_explicit_max_tasks_wins_over_the_thread_cap() -> None:
    busy = [0]
    assert capacity(busy, max_tasks=3, thread_cap=100).thread_cap is None
    assert capacity(busy, max_tasks=3).free_slots(1) == 2
    assert capacity(busy, thread_cap=0).free_slots(5000) is None  # off
    assert capacity(busy).thread_cap == default_thread_cap()
    capped = capacity(busy, thread_cap=4)
    busy[0] = 3  # the cap counts thread handlers, not the async ones among the running
    assert capped.free_slots(10) == 1
    assert capped.limit() is None  # no thread handler ran yet
    capped.started(10, "thread")
    assert capped.limit() == 4


def test_a_failed_start_reduces_the_capacity_to_what_runs_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    cap = capacity([0], clock, max_tasks=10)
    caplog.set_level(logging.DEBUG, "metafora.consumer")
    error = RuntimeError("can't start new thread")
    cap.start_failed(4, "thread", error, "t5")
    cap.start_failed(4, "thread", error, "t6")
    assert cap.free_slots(4) == 0 and cap.limit() == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    record = warnings[0].__dict__
    assert (record["action"], record["capacity"], record["handler"], record["node"]) == (
        "capacity", 4, "thread", "n")
    assert record["cause"] == "RuntimeError: can't start new thread"
    assert cap.info() == {"limit": 4, "max_tasks": 10, "thread_cap": None, "reduced": 4,
                          "cause": "RuntimeError: can't start new thread"}
    # A task ended (3 run), its slot was taken again and the start succeeded: try one more.
    cap.started(4, "thread")
    assert cap.reduced == 5
    cap.start_failed(5 - 1, "thread", error, "t7")  # ... which failed: back to what runs
    assert cap.reduced == 4
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    # Nothing ended for CAPACITY_RETRY seconds: one more is tried anyway.
    assert not cap.retry_due(CAPACITY_RETRY - 1, 4)
    clock.now = CAPACITY_RETRY
    assert cap.retry_due(CAPACITY_RETRY, 4) and cap.reduced == 5
    for running in range(5, 10):
        cap.started(running, "thread")
    assert cap.reduced is None and cap.cause is None and cap.free_slots(9) == 1
    assert any("capacity back to 10" in r.getMessage() for r in caplog.records)


# -- a runner whose threads cannot start -----------------------------------------------


class FullRunner(HandlerRunner):
    """A runner in a process that can start only ``allowed`` more threads."""

    allowed = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.refused = 0

    def start_thread(self, thread: threading.Thread) -> None:
        if self.allowed <= 0:
            self.refused += 1
            raise RuntimeError("can't start new thread")
        self.allowed -= 1
        super().start_thread(thread)


def full_consumer(allowed: int) -> type[Consumer]:
    runner = type("Runner", (FullRunner,), {"allowed": allowed})
    return type("FullConsumer", (Consumer,), {"_runner_class": runner})


def blocking(ran: dict[str, set[str]], node: str) -> HandlerFunc:
    """Handlers that run until stopped (at most 30 s), recording where they ran."""
    lock = threading.Lock()

    def work(task: Task, stop: threading.Event) -> bool:
        with lock:
            ran.setdefault(node, set()).add(task.id)
        stop.wait(30)
        return False

    return simple_handler(work)


@pytest.fixture(params=["memory", "sqlite"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalCluster]:
    # A 6 s lease on SQLite: a node publishes its capacity at its renewal (lease_ttl / 3).
    url = None if request.param == "memory" else f"sqlite:///{tmp_path / 'capacity.db'}?lease_ttl=6"
    with LocalCluster(url, shutdown_timeout=5.0) as c:
        yield c


def owners(cluster: LocalCluster) -> dict[str, str | None]:
    return {t.id: t.owner for t in cluster.client.tasks() if t.state is TaskState.CLAIMED}


def test_a_node_that_cannot_start_threads_releases_and_others_take_the_rest(
    cluster: LocalCluster, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "metafora.consumer")
    ran: dict[str, set[str]] = {}
    a = cluster.start(full_consumer(2)(open_coordinator(cluster.url, node_id="a"),
                                       blocking(ran, "a"), release_backoff=5.0))
    cluster.client.submit_tasks([Task(f"t{i}") for i in range(8)])
    wait_until(lambda: a.info()["capacity"]["reduced"] == 2 and len(a.tasks()) == 2,
               message="a runs the 2 it could start, its capacity down to them")
    wait_until(lambda: len(cluster.client.tasks(TaskState.PENDING)) == 6,
               message="the tasks a could not start were released")
    assert all(t.error is None for t in cluster.client.tasks())  # released, not failed
    b = cluster.add(blocking(ran, "b"), node_id="b")
    wait_until(lambda: len(owners(cluster)) == 8 and len(b.tasks()) == 6,
               message="b took the released tasks")
    held = owners(cluster)
    assert sorted(k for k, v in held.items() if v == "a") == sorted(t.task.id for t in a.tasks())
    assert len([v for v in held.values() if v == "b"]) == 6 and len(b.tasks()) == 6
    info = a.info()["capacity"]
    assert info["cause"] == "RuntimeError: can't start new thread" and info["limit"] == 2
    # published, so that b's share leaves a out instead of giving tasks back for it
    wait_until(lambda: b._coord.node_capacities().get("a") == 2, 30,
               message="b sees a's reduced capacity")
    assert a.healthy() and not cluster.errors  # the consumer survived
    warnings = [r for r in caplog.records if getattr(r, "action", None) == "capacity"
                and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].__dict__["node"] == "a"
    assert ran["a"] == {t.task.id for t in a.tasks()}  # nothing else ran there
    cluster.stop(a)
    assert not cluster.errors
    wait_until(lambda: len(owners(cluster)) == 8 and set(owners(cluster).values()) == {"b"},
               message="b took a's tasks once it left")


def test_a_node_claims_again_once_a_task_ended_and_a_start_succeeds(
    cluster: LocalCluster,
) -> None:
    stops: dict[str, threading.Event] = {}
    lock = threading.Lock()

    def work(task: Task, stop: threading.Event) -> bool:
        with lock:
            stops[task.id] = stop
        stop.wait(30)
        return task.id == "t0"  # t0 finishes for good when stopped

    a = cluster.start(full_consumer(2)(open_coordinator(cluster.url, node_id="a"),
                                       simple_handler(work), release_backoff=0.05))
    cluster.client.submit_tasks([Task(f"t{i}") for i in range(6)])
    wait_until(lambda: a.info()["capacity"]["reduced"] == 2, message="capacity down to 2")
    first = {t.task.id for t in a.tasks()}
    a._runner.allowed = 1  # type: ignore[attr-defined]  # one more thread could start now
    done = sorted(first)[0]
    wait_until(lambda: done in stops, message="handler registered")
    stops[done].set()  # a task ends: its thread is reused for the next claim
    # A task for the freed slot started (on the idle thread), so a tried one more (on the
    # thread that could start), and one more again, which failed: capacity 3.
    wait_until(lambda: len(a.tasks()) == 3 and a.info()["capacity"]["reduced"] == 3,
               message="a climbed back by one")
    assert {t.task.id for t in a.tasks()} != first
    assert a.healthy() and not cluster.errors


def test_async_handlers_whose_loop_cannot_start_are_released(cluster: LocalCluster) -> None:
    async def work(task: Task, stop: asyncio.Event) -> bool:
        await asyncio.wait_for(stop.wait(), 30)
        return False

    a = cluster.start(full_consumer(0)(open_coordinator(cluster.url, node_id="a"),
                                       simple_handler(work), release_backoff=5.0))
    cluster.client.submit_tasks([Task("t0"), Task("t1")])
    wait_until(lambda: a.info()["capacity"]["reduced"] == 0, message="no loop: capacity 0")
    wait_until(lambda: len(cluster.client.tasks(TaskState.PENDING)) == 2,
               message="both released")
    b = cluster.add(simple_handler(work), node_id="b")
    wait_until(lambda: len(b.tasks()) == 2, message="b runs them on its loop")
    assert a.healthy() and not a.tasks() and not cluster.errors


def test_the_thread_cap_bounds_thread_handlers_only(cluster: LocalCluster) -> None:
    ran: dict[str, set[str]] = {}
    a = cluster.add(blocking(ran, "a"), node_id="a", thread_cap=2)
    cluster.client.submit_tasks([Task(f"t{i}") for i in range(5)])
    wait_until(lambda: len(a.tasks()) == 2, message="a runs its 2")
    b = cluster.add(blocking(ran, "b"), node_id="b", thread_cap=0)
    wait_until(lambda: len(b.tasks()) == 3, message="b took the rest")
    assert len(a.tasks()) == 2 and a.info()["capacity"]["reduced"] is None
    assert a.info()["capacity"]["limit"] == 2


def test_async_handlers_are_not_capped(cluster: LocalCluster) -> None:
    async def work(task: Task, stop: asyncio.Event) -> bool:
        await asyncio.wait_for(stop.wait(), 30)
        return False

    c = cluster.add(simple_handler(work), node_id="c", thread_cap=1)
    cluster.client.submit_tasks([Task(f"u{i}") for i in range(3)])
    wait_until(lambda: len(c.tasks()) == 3, message="all 3 run on the loop")
    assert c.info()["capacity"] == {"limit": None, "max_tasks": None, "thread_cap": 1,
                                    "reduced": None, "cause": None}


def test_spawning_on_a_dead_loop_cannot_start() -> None:
    fatal: list[str] = []
    runner = HandlerRunner("n1", slow_callback=5.0, on_fatal=lambda what, exc: fatal.append(what))

    async def idle(task: Task, stop: asyncio.Event) -> bool:
        return True

    handler = simple_handler(idle)(Task("t"))
    ended = threading.Event()
    runner.start("first", handler, lambda result, error, scope: ended.set())
    assert ended.wait(10)
    loop = runner._event_loop()

    def die() -> None:
        raise SystemExit("the loop dies")

    loop.call(die)
    wait_until(lambda: fatal == ["asyncio"], message="the loop died")
    with pytest.raises(CannotStart) as info:
        runner.start("second", simple_handler(idle)(Task("u")), lambda *args: None)
    assert info.value.kind == "async"
    runner.close(1.0)
