"""metafora.contracts.handler: the handler interfaces and simple_handler, driven without a consumer.

Handlers inside a running consumer: test_consumer.py and test_async_handlers.py.
"""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest

from metafora.contracts.handler import AsyncHandler, Handler, is_async, simple_handler
from metafora.core.task import Task

TASK = Task("t1", {"n": 2})


def test_a_plain_function_becomes_a_thread_handler_with_a_stop_event() -> None:
    seen: list[object] = []

    def work(task: Task, stop: threading.Event) -> bool:
        seen.append((task.id, stop.is_set()))
        return 1  # type: ignore[return-value]  # truthy: done

    handler = simple_handler(work)(TASK)
    assert isinstance(handler, Handler) and not is_async(handler)
    assert handler.run() is True
    handler.stop()
    handler.stop()  # may be called more than once
    assert seen == [("t1", False)]


def test_stop_reaches_a_running_plain_function() -> None:
    started = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        started.set()
        return not stop.wait(60)  # released (False) when stopped

    handler = simple_handler(work)(TASK)
    result: list[bool] = []
    runner = threading.Thread(target=lambda: result.append(handler.run()))
    runner.start()
    assert started.wait(10)
    handler.stop()
    runner.join(10)
    assert result == [False]


def test_a_plain_function_returning_an_awaitable_is_refused_and_the_coroutine_closed() -> None:
    async def later() -> bool:
        return True

    made: list[object] = []

    def work(task: Task, stop: threading.Event) -> bool:
        coro = later()
        made.append(coro)
        return coro  # type: ignore[return-value]

    with pytest.raises(TypeError, match="returned an awaitable"):
        simple_handler(work)(TASK).run()
    assert made[0].cr_frame is None  # type: ignore[attr-defined]  # closed: no "never awaited"


def test_async_functions_are_recognised_through_partials_and_callable_objects() -> None:
    async def work(task: Task, stop: asyncio.Event, extra: int = 0) -> bool:
        return True

    class Callable:
        async def __call__(self, task: Task, stop: asyncio.Event) -> bool:
            return True

    for fn in (work, functools.partial(work, extra=1), functools.partial(functools.partial(work)),
               Callable()):
        handler = simple_handler(fn)(TASK)
        assert isinstance(handler, AsyncHandler) and is_async(handler), fn


def test_is_async_looks_at_run_for_duck_typed_handlers() -> None:
    class DuckAsync:
        async def run(self) -> bool:
            return True

        def stop(self) -> None:
            pass

    class DuckSync:
        def run(self) -> bool:
            return True

        def stop(self) -> None:
            pass

    assert is_async(DuckAsync()) is True  # type: ignore[arg-type]
    assert is_async(DuckSync()) is False  # type: ignore[arg-type]


def test_an_async_function_gets_an_asyncio_event_set_by_stop() -> None:
    started: list[asyncio.Event] = []

    async def work(task: Task, stop: asyncio.Event) -> bool:
        assert isinstance(stop, asyncio.Event)
        started[0].set()
        await stop.wait()
        return False

    handler = simple_handler(work)(TASK)

    async def main() -> bool:
        started.append(asyncio.Event())
        run = asyncio.ensure_future(handler.run())  # type: ignore[arg-type]
        await started[0].wait()
        handler.stop()  # on the loop's own thread: set at once
        return await asyncio.wait_for(run, 10)

    assert asyncio.run(main()) is False


def test_a_stop_before_run_is_seen_when_run_starts() -> None:
    async def work(task: Task, stop: asyncio.Event) -> bool:
        return stop.is_set()

    handler = simple_handler(work)(TASK)
    handler.stop()
    assert asyncio.run(handler.run()) is True  # type: ignore[arg-type]


def test_a_stop_from_another_thread_reaches_the_loop() -> None:
    waiting = threading.Event()

    async def work(task: Task, stop: asyncio.Event) -> bool:
        waiting.set()
        await stop.wait()
        return False

    handler = simple_handler(work)(TASK)
    stopper = threading.Thread(target=lambda: (waiting.wait(10), handler.stop()))
    stopper.start()
    assert asyncio.run(asyncio.wait_for(handler.run(), 10)) is False  # type: ignore[arg-type]
    stopper.join(10)
    handler.stop()  # after the loop closed: nothing left to stop, no error
