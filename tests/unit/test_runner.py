"""metafora.consumer.runner: HandlerRunner on its own: where handlers run, where their outcomes are
written, and how stop, cancel and close reach them.

The runner inside a consumer (the watchdog, a dead loop): test_async_handlers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from metafora.consumer.runner import AsyncRun, HandlerRunner, SyncRun, Write
from metafora.contracts.handler import AsyncHandler, Handler


@dataclass
class Ended:
    """What a finish callback saw, and where its write ran."""

    result: bool | None = None
    error: BaseException | None = None
    scope: Any = None
    finish_thread: str = ""
    write_thread: str = ""
    written: threading.Event = field(default_factory=threading.Event)

    def finish(self, result: bool | None, error: BaseException | None, scope: Any) -> Write:
        self.result, self.error, self.scope = result, error, scope
        self.finish_thread = threading.current_thread().name

        def write() -> None:
            self.write_thread = threading.current_thread().name
            self.written.set()

        return write


@contextlib.contextmanager
def span() -> Iterator[str]:
    yield "span-1"


class Blocking(Handler):
    def __init__(self, result: bool = True) -> None:
        self.result = result
        self.stopped = threading.Event()

    def run(self) -> bool:
        self.stopped.wait(60)
        return self.result

    def stop(self) -> None:
        self.stopped.set()


class Waits(AsyncHandler):
    """Waits for stop(); records the thread stop() was called on."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.stop_thread = ""
        self._stop: asyncio.Event | None = None

    async def run(self) -> bool:
        self._stop = asyncio.Event()
        self.started.set()
        await self._stop.wait()
        return False

    def stop(self) -> None:
        self.stop_thread = threading.current_thread().name
        assert self._stop is not None
        self._stop.set()


@pytest.fixture
def runner() -> Iterator[HandlerRunner]:
    fatal: list[tuple[str, BaseException]] = []
    runner = HandlerRunner("n1", slow_callback=5.0, on_fatal=lambda what, exc: fatal.append((what, exc)))
    yield runner
    runner.close(timeout=5.0)
    assert fatal == []


def test_a_sync_handler_runs_and_writes_its_outcome_on_its_own_named_thread(runner: HandlerRunner) -> None:
    ended = Ended()
    handler = Blocking()
    run = runner.start("task-t1", handler, ended.finish, span)
    assert isinstance(run, SyncRun) and not run.is_async
    runner.stop([run])
    assert ended.written.wait(10)
    assert (ended.result, ended.error, ended.scope) == (True, None, "span-1")
    assert ended.finish_thread == ended.write_thread == "task-t1"


def test_a_sync_handler_that_raises_or_returns_an_awaitable_ends_with_the_error(
        runner: HandlerRunner) -> None:
    class Raises(Handler):
        def run(self) -> bool:
            raise KeyError("boom")

        def stop(self) -> None:
            pass

    class ReturnsCoroutine(Handler):
        def run(self) -> bool:
            return asyncio.sleep(0)  # type: ignore[return-value]

        def stop(self) -> None:
            pass

    raised, awaited = Ended(), Ended()
    runner.start("raises", Raises(), raised.finish)
    runner.start("awaits", ReturnsCoroutine(), awaited.finish)
    assert raised.written.wait(10) and awaited.written.wait(10)
    assert raised.result is None and isinstance(raised.error, KeyError)
    assert isinstance(awaited.error, TypeError) and "declare it 'async def'" in str(awaited.error)
    assert raised.scope is None  # no around given: nullcontext yields None


def test_an_async_handler_runs_on_the_loop_and_its_write_runs_off_it(runner: HandlerRunner) -> None:
    ended = Ended()
    handler = Waits()
    run = runner.start("task-a1", handler, ended.finish, span)
    assert isinstance(run, AsyncRun) and run.is_async
    assert handler.started.wait(10)
    runner.stop([run])
    assert ended.written.wait(10)
    assert (ended.result, ended.error, ended.scope) == (False, None, "span-1")
    assert handler.stop_thread == "metafora-asyncio-n1"  # stop() runs where asyncio objects live
    assert ended.finish_thread == "metafora-asyncio-n1"
    assert ended.write_thread.startswith("metafora-outcome-n1")  # the store write never blocks the loop


def test_cancel_ends_an_async_handler_with_cancelled_error(runner: HandlerRunner) -> None:
    ended = Ended()
    handler = Waits()
    run = runner.start("task-a2", handler, ended.finish)
    assert handler.started.wait(10)
    blocking = Blocking()
    sync = runner.start("task-s2", blocking, Ended().finish)
    runner.cancel([run, sync])  # threads cannot be cancelled: the sync one runs on
    assert ended.written.wait(10)
    assert isinstance(ended.error, asyncio.CancelledError) and ended.result is None
    assert not blocking.stopped.is_set()
    runner.stop([sync])


def test_an_async_handler_whose_run_is_not_a_coroutine_ends_with_a_type_error(
        runner: HandlerRunner) -> None:
    class NotACoroutine(AsyncHandler):
        def run(self) -> bool:  # type: ignore[override]
            return True

        def stop(self) -> None:
            pass

    ended = Ended()
    runner.start("task-a3", NotACoroutine(), ended.finish)
    assert ended.written.wait(10)
    assert isinstance(ended.error, TypeError) and "not a coroutine" in str(ended.error)


def test_a_stop_that_raises_is_logged_and_the_others_are_still_stopped(
        runner: HandlerRunner, caplog: pytest.LogCaptureFixture) -> None:
    class StopRaises(Blocking):
        def stop(self) -> None:
            raise RuntimeError("stop failed")

    bad, good = StopRaises(), Blocking()
    bad_run = runner.start("bad", bad, Ended().finish)
    good_ended = Ended()
    good_run = runner.start("good", good, good_ended.finish)
    with caplog.at_level(logging.ERROR, logger="metafora.runner"):
        runner.stop([bad_run, good_run])
    assert good_ended.written.wait(10)
    assert "stop() of handler bad raised" in caplog.text
    bad.stopped.set()


def test_close_cancels_async_handlers_still_running(runner: HandlerRunner) -> None:
    ended = Ended()
    handler = Waits()
    runner.start("task-a4", handler, ended.finish)
    assert handler.started.wait(10)
    runner.close(timeout=5.0)
    assert ended.written.wait(10)
    assert isinstance(ended.error, asyncio.CancelledError)
    assert not any(t.name == "metafora-asyncio-n1" for t in threading.enumerate())
