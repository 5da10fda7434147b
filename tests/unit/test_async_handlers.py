"""Async handlers on the in-memory store: outcomes, stop, lost claims, shutdown, a blocked loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

import pytest

from metafora import AsyncHandler, Consumer, Handler, Task, TaskState, simple_handler
from metafora.core import commands
from tests.helpers import Harness, wait_until


class Seen:
    """What async handlers saw, written from the event loop and read by the test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.cancelled: list[str] = []
        self.threads: set[str] = set()

    def add(self, what: list[str], task_id: str) -> None:
        with self.lock:
            what.append(task_id)
            self.threads.add(threading.current_thread().name)


def waiting(seen: Seen, *, result: bool = False,
            ignore_stop: bool = False) -> Callable[[Task, asyncio.Event], Awaitable[bool]]:
    """An async handler that waits for stop (or forever when ``ignore_stop``)."""

    async def work(task: Task, stop: asyncio.Event) -> bool:
        seen.add(seen.started, task.id)
        try:
            if ignore_stop:
                await asyncio.Event().wait()  # never set: only cancellation ends it
            await stop.wait()
            assert stop.is_set()
            seen.add(seen.stopped, task.id)
            return result
        except asyncio.CancelledError:
            seen.add(seen.cancelled, task.id)
            raise

    return work


def test_async_function_completes_on_the_event_loop(harness: Harness) -> None:
    seen = Seen()

    async def work(task: Task, stop: asyncio.Event) -> bool:
        await asyncio.sleep(0)  # really awaited: a coroutine never run would not get here
        seen.add(seen.started, task.id)
        return True

    consumer = harness.add(simple_handler(work), "a")
    for i in range(20):
        harness.client.submit_task(Task(f"t{i:02d}"))
    wait_until(lambda: len(harness.client.tasks("done")) == 20, 20, "20 async tasks done")
    assert sorted(seen.started) == [f"t{i:02d}" for i in range(20)]
    assert seen.threads == {f"metafora-asyncio-{consumer.node_id}"}


def test_async_function_returning_false_releases(harness: Harness) -> None:
    calls: list[str] = []

    async def work(task: Task, stop: asyncio.Event) -> bool:
        calls.append(task.id)
        return False

    harness.add(simple_handler(work), "a", release_backoff=60)
    harness.client.submit_task(Task("back"))
    wait_until(lambda: calls and harness.client.get_task("back").state is TaskState.PENDING,
               20, "released")
    assert calls == ["back"]


def test_async_function_raising_fails_the_task(harness: Harness) -> None:
    async def work(task: Task, stop: asyncio.Event) -> bool:
        await asyncio.sleep(0)
        raise ValueError("bad input")

    harness.add(simple_handler(work), "a")
    harness.client.submit_task(Task("broken"))
    harness.wait_for_state("broken", TaskState.FAILED, 20)
    assert "ValueError: bad input" in (harness.client.get_task("broken").error or "")


def test_a_sync_function_returning_a_coroutine_fails_not_done(harness: Harness) -> None:
    async def body() -> bool:
        return True

    # Not declared async: before async handlers, this was marked done without running.
    harness.add(simple_handler(lambda task, stop: body()), "a")
    harness.client.submit_task(Task("sneaky"))
    harness.wait_for_state("sneaky", TaskState.FAILED, 20)
    assert "awaitable" in (harness.client.get_task("sneaky").error or "")


def test_stop_task_stops_an_async_handler(harness: Harness) -> None:
    seen = Seen()
    consumer = harness.add(simple_handler(waiting(seen)), "a", release_backoff=60)
    harness.client.submit_task(Task("mover"))
    wait_until(lambda: seen.started == ["mover"], 20, "started")
    harness.client.submit_command(consumer.node_id, commands.stop_task("mover"))
    wait_until(lambda: harness.client.get_task("mover").state is TaskState.PENDING, 20,
               "released after stop")
    assert seen.stopped == ["mover"] and seen.cancelled == []


def test_a_lost_claim_cancels_the_async_handler_at_once(harness: Harness) -> None:
    seen = Seen()
    coord = harness.coordinator("a")
    consumer = harness.start(Consumer(coord, simple_handler(waiting(seen, ignore_stop=True)),
                                      release_backoff=60))
    harness.client.submit_task(Task("fragile"))
    wait_until(lambda: seen.started == ["fragile"], 20, "started")
    assert [t.id for t in coord.expire_lease()] == ["fragile"]
    wait_until(lambda: seen.cancelled == ["fragile"], 20, "cancelled after the lost claim")
    wait_until(lambda: not consumer.tasks(), 20, "no longer running")
    # Lost: nothing is written for it (the task is pending for anyone, not failed).
    assert harness.client.get_task("fragile").state in (TaskState.PENDING, TaskState.CLAIMED)


class Ticker(AsyncHandler):
    """An async Handler class: stop() sets an asyncio.Event (it is called on the loop)."""

    def __init__(self, task: Task, seen: Seen) -> None:
        self.task = task
        self.seen = seen
        self.event = asyncio.Event()
        self.stop_threads: list[str] = []

    async def run(self) -> bool:
        self.seen.add(self.seen.started, self.task.id)
        await self.event.wait()
        self.seen.add(self.seen.stopped, self.task.id)
        return self.task.id.startswith("done")

    def stop(self) -> None:
        self.stop_threads.append(threading.current_thread().name)
        self.event.set()


def test_async_handler_class_outcomes_and_shutdown(harness: Harness,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    seen = Seen()
    made: list[Ticker] = []

    def make(task: Task) -> Ticker:
        made.append(Ticker(task, seen))
        return made[-1]

    consumer = harness.add(make, "a")
    for i in range(50):
        harness.client.submit_task(Task(f"done-{i:02d}" if i % 2 else f"keep-{i:02d}"))
    wait_until(lambda: len(seen.started) == 50, 20, "50 handlers running")
    with caplog.at_level(logging.WARNING, logger="metafora"):
        harness.stop(consumer, timeout=20)
    assert len(seen.stopped) == 50
    assert {n for t in made for n in t.stop_threads} == {f"metafora-asyncio-{consumer.node_id}"}
    states = {t.id: t.state for t in harness.client.tasks()}
    assert all(s is TaskState.DONE for i, s in states.items() if i.startswith("done"))
    assert all(s is TaskState.PENDING for i, s in states.items() if i.startswith("keep"))
    assert not [r for r in caplog.records if "ignored stop" in r.getMessage()]


def test_shutdown_cancels_an_async_handler_that_ignores_stop(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    seen = Seen()
    consumer = harness.add(simple_handler(waiting(seen, ignore_stop=True)), "a")
    harness.client.submit_task(Task("stubborn"))
    wait_until(lambda: seen.started == ["stubborn"], 20, "started")
    with caplog.at_level(logging.ERROR, logger="metafora.consumer"):
        harness.stop(consumer, timeout=0.2)
    assert any("ignored stop()" in r.getMessage() and "cancelling" in r.getMessage()
               for r in caplog.records)
    wait_until(lambda: seen.cancelled == ["stubborn"], 20, "cancelled")
    assert harness.client.get_task("stubborn").state is TaskState.PENDING


def test_sync_and_async_handlers_side_by_side(harness: Harness) -> None:
    done_sync: list[str] = []

    async def slow(task: Task, stop: asyncio.Event) -> bool:
        await stop.wait()
        return False

    def quick(task: Task, stop: threading.Event) -> bool:
        done_sync.append(task.id)
        return True

    async_make, sync_make = simple_handler(slow), simple_handler(quick)

    def make(task: Task) -> Handler | AsyncHandler:
        return async_make(task) if task.id.startswith("async") else sync_make(task)

    consumer = harness.add(make, "a")
    for i in range(10):
        harness.client.submit_task(Task(f"async-{i}"))
        harness.client.submit_task(Task(f"sync-{i}"))
    wait_until(lambda: len(harness.client.tasks("done")) == 10, 20, "sync tasks done")
    wait_until(lambda: len(consumer.tasks()) == 10, 20, "async tasks held")
    assert sorted(done_sync) == sorted(f"sync-{i}" for i in range(10))


def test_a_blocking_async_handler_does_not_stall_claims_and_is_reported(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    unblock = threading.Event()
    blocked = threading.Event()

    async def blocker(task: Task, stop: asyncio.Event) -> bool:
        blocked.set()
        unblock.wait(60)  # the mistake under test: a blocking call on the event loop
        return True

    def quick(task: Task, stop: threading.Event) -> bool:
        return True

    async_make, sync_make = simple_handler(blocker), simple_handler(quick)

    def make(task: Task) -> Handler | AsyncHandler:
        return async_make(task) if task.id == "blocker" else sync_make(task)

    with caplog.at_level(logging.WARNING, logger="metafora.runner"):
        harness.add(make, "a", slow_callback=0.1)
        harness.client.submit_task(Task("blocker"))
        assert blocked.wait(20)
        for i in range(5):
            harness.client.submit_task(Task(f"other-{i}"))
        # The loop is blocked, but the claim loop and thread handlers go on.
        wait_until(lambda: len(harness.client.tasks("done")) == 5, 20, "others done")
        wait_until(lambda: any("blocked for over" in r.getMessage() for r in caplog.records),
                   20, "slow callback warning")
        unblock.set()
        harness.wait_for_state("blocker", TaskState.DONE, 20)
    warning = next(r.getMessage() for r in caplog.records if "blocked for over" in r.getMessage())
    assert "metafora-task-blocker" in warning and "test_async_handlers.py" in warning


class Duck:
    """Neither Handler nor AsyncHandler, but its run is a coroutine function: runs on the loop."""

    def __init__(self, seen: Seen, task: Task) -> None:
        self.seen, self.task = seen, task

    async def run(self) -> bool:
        self.seen.add(self.seen.started, self.task.id)
        return True

    def stop(self) -> None:
        pass


class Sneaky(Handler):
    """A sync run() that hands back a coroutine: it must fail, never count as done."""

    def run(self) -> bool:
        async def body() -> bool:
            return True

        return body()  # type: ignore[return-value]

    def stop(self) -> None:
        pass


def test_duck_typed_async_run_and_a_sync_run_returning_a_coroutine(harness: Harness) -> None:
    seen = Seen()
    consumer = harness.add(
        lambda t: Duck(seen, t) if t.id == "duck" else Sneaky(),  # type: ignore[arg-type, return-value]
        "a",
    )
    harness.client.submit_task(Task("duck"))
    harness.client.submit_task(Task("sneaky"))
    harness.wait_for_state("duck", TaskState.DONE, 20)
    harness.wait_for_state("sneaky", TaskState.FAILED, 20)
    assert "awaitable" in (harness.client.get_task("sneaky").error or "")
    assert seen.threads == {f"metafora-asyncio-{consumer.node_id}"}


def test_a_dead_event_loop_stops_the_consumer(harness: Harness) -> None:
    seen = Seen()
    consumer = Consumer(harness.coordinator("a"), simple_handler(waiting(seen)))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    harness.client.submit_task(Task("t"))
    wait_until(lambda: seen.started == ["t"], 20, "started")
    loop = consumer._runner._loop  # white box: kill the loop the way a bug in it would
    assert loop is not None
    loop._loop.call_soon_threadsafe(loop._loop.stop)
    thread.join(30)
    assert not thread.is_alive() and failure
    assert "event loop stopped unexpectedly" in str(failure[0])
    assert harness.client.nodes() == []


def test_slow_callback_must_be_a_positive_number(harness: Harness) -> None:
    from metafora.core.errors import ConfigError

    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="slow_callback"):
            Consumer(harness.coordinator("a"), simple_handler(waiting(Seen())), slow_callback=bad)


def test_stop_from_another_thread_before_and_after_run(harness: Harness) -> None:
    seen = Seen()
    make = simple_handler(waiting(seen))
    handler = make(Task("early"))
    assert isinstance(handler, AsyncHandler)
    handler.stop()  # before run(): run() must see it and return at once
    assert asyncio.run(handler.run()) is False
    assert seen.stopped == ["early"]
    handler.stop()  # after its loop is closed: a no-op, never an error
